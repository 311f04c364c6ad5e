"""One call to put cached low-precision tables into a model that has ``nn.EmbeddingBag``,
``nn.Embedding`` or TorchRec ``EmbeddingBagCollection`` / ``EmbeddingCollection`` tables, and
an optimizer that drives them.

:func:`swap` replaces every such module of a model, in place, by ours with the same rows
(rounded into the stored format by the table's rule; tables under
``min_rows_for_low_precision`` rows stay FP32), the same pooling and input conventions, and
returns what it did per table. Our tables update themselves in their own ``step()`` (the
optimizer is fused into the update and the rows are rounded as they are written), so they
leave the model's ``parameters()``; :class:`TableOptimizer` gives the training loop one
``step()`` and ``zero_grad()`` for all of them, beside the torch optimizer of the rest::

    summary = embcache.swap(model, precision="int8", cache_ratio=0.05, lr=0.05)
    dense = torch.optim.Adagrad(model.parameters(), lr=0.01)   # the tables are not in it
    tables = embcache.TableOptimizer(model)
    loss.backward(); dense.step(); tables.step(); dense.zero_grad(); tables.zero_grad()

``placement="host"`` (for every table, or per table) keeps the swapped tables' rows in pinned
host memory once the model is on a GPU, their caches in GPU memory (docs/design.md, "Host
placement"): tables larger than the GPU then train behind their cache.

``max_norm`` and ``scale_grad_by_freq`` are not swapped yet: :func:`swap` refuses them,
naming the module, rather than leave them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from embcache.embedding import CachedLowPrecisionEmbedding
from embcache.group import update_together
from embcache.multi_table import CachedLowPrecisionEmbeddingBags
from embcache.unpooled import CachedLowPrecisionUnpooledEmbedding


def swap(model: nn.Module, per_table: Mapping[str, Mapping] | None = None, **options) -> dict:
    """Replace, in place, every ``nn.EmbeddingBag``, ``nn.Embedding`` (by
    :class:`~embcache.unpooled.CachedLowPrecisionUnpooledEmbedding`) and TorchRec
    ``EmbeddingBagCollection`` and ``EmbeddingCollection`` of ``model`` by ours, carrying their
    weights; ``options`` apply
    to every table and ``per_table`` (by a module's name, or a collection's table name)
    overrides them (any :class:`~embcache.config.TableConfig` field: ``precision``,
    ``cache_ratio``, ``placement``, ...). The new tables are built in host memory: move the
    model (``model.cuda()``) afterwards; a host-placed table then moves only its cache.
    Returns ``{table: {"rows", "precision", "cache_slots", "placement", "bytes_before",
    "bytes_after", "device_bytes_after", "host_bytes_after"}}`` (``bytes_after`` split by
    where the bytes live). Refuses (``ValueError`` naming the module or table, before
    anything is replaced) what it cannot swap: ``max_norm``, ``scale_grad_by_freq``, and
    ``placement="host"`` where torch has no CUDA GPU."""
    per_table = dict(per_table or {})
    plans = []
    for name, module in model.named_modules():
        if any(name.startswith(planned + ".") for planned, _ in plans):
            continue  # inside a collection being replaced (TorchRec's holds nn.EmbeddingBags)
        new = _replacement(name, module, per_table, options)
        if new is not None:
            plans.append((name, new))
    summary = {}
    for name, new in plans:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        tables = [new] if isinstance(new, CachedLowPrecisionEmbedding) else new.tables()
        for table in tables:
            c, memory = table.config, table.memory_bytes()
            summary[c.name] = {
                "rows": c.num_embeddings,
                "precision": c.stored_precision,
                "cache_slots": c.num_slots,
                "placement": c.placement,
                "bytes_before": c.num_embeddings * c.embedding_dim * 4,
                "bytes_after": memory["total"],
                "device_bytes_after": memory["device"],
                "host_bytes_after": memory["host"],
            }
    return summary


def _replacement(name: str, module: nn.Module, per_table: Mapping, options: dict):
    """Ours for ``module`` (named ``name`` in the model), None if it is not a table, or
    ValueError if it is one we cannot take."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        unsupported = [
            what
            for what, present in (
                ("max_norm", module.max_norm is not None),
                ("scale_grad_by_freq", module.scale_grad_by_freq),
            )
            if present
        ]
        if unsupported:
            kind = type(module).__name__
            raise ValueError(f"{name}: nn.{kind} with {unsupported[0]} is not supported yet")
        weight = module.weight.detach().float().cpu()
        options = {"name": name, "padding_idx": module.padding_idx, **options}
        options.update(per_table.get(name, {}))
        if isinstance(module, nn.Embedding):
            return CachedLowPrecisionUnpooledEmbedding.from_pretrained(weight, **options)
        return CachedLowPrecisionEmbedding.from_pretrained(
            weight, mode=module.mode, include_last_offset=module.include_last_offset, **options
        )
    kind = type(module).__name__  # TorchRec's, by name: without TorchRec there are none
    if kind == "EmbeddingBagCollection":
        from embcache.collection import CachedLowPrecisionEmbeddingBagCollection as ours

        configs, tables = module.embedding_bag_configs(), module.embedding_bags
    elif kind == "EmbeddingCollection":
        from embcache.collection import CachedLowPrecisionEmbeddingCollection as ours

        configs, tables = module.embedding_configs(), module.embeddings
    else:
        return None
    weights = {t: table.weight.detach().float().cpu() for t, table in tables.items()}
    return ours(
        configs,
        per_table={t: {"weight": w, **per_table.get(t, {})} for t, w in weights.items()},
        **options,
    )


class TableOptimizer:
    """``step()`` and ``zero_grad()`` for every cached table of ``model``. ``step()`` updates
    all of them (the collections' and those on their own) in one table-batched call per
    device, all or nothing: if any table refuses its update, none changes. Call it after
    ``backward()``, beside the torch optimizer of the other parameters."""

    def __init__(self, model: nn.Module):
        self.units = []
        inside = set()
        for module in model.modules():
            if isinstance(module, CachedLowPrecisionEmbeddingBags):
                self.units.append(module)
                inside.update(id(t) for t in module.tables())
        for module in model.modules():
            if isinstance(module, CachedLowPrecisionEmbedding) and id(module) not in inside:
                self.units.append(module)

    @torch.no_grad()
    def step(self) -> None:
        by_device: dict[torch.device, list] = {}
        for group in (unit.group for unit in self.units):
            by_device.setdefault(group.tables[0].device, []).append(group)
        for groups in by_device.values():
            update_together(groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.units:
            unit.zero_grad()
