"""Several cached tables as one module, driven by one table-batched call per phase, with plain
tensors in and out: what a model needs of TorchRec's ``EmbeddingBagCollection`` without
TorchRec (:class:`CachedLowPrecisionEmbeddingBags`). The TorchRec drop-ins
(:mod:`embcache.collection`) are its ``KeyedJaggedTensor`` adapters."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from embcache.config import MODES
from embcache.embedding import META_TABLE, CachedLowPrecisionEmbedding, check_state_dict
from embcache.group import TableGroup
from embcache.memory import fp32_bytes, memory_breakdown


@dataclasses.dataclass(frozen=True)
class BagTable:
    """A table of a :class:`CachedLowPrecisionEmbeddingBags`: ``num_embeddings`` rows of
    ``embedding_dim``, looked up by the features ``feature_names`` (default: one feature named
    as the table), each bag pooled by ``mode`` (``"sum"``, ``"mean"`` or ``"max"``, as
    ``nn.EmbeddingBag`` pools; per-sample weights only with sum)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] = ()
    mode: str = "sum"

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_names", tuple(self.feature_names) or (self.name,))


class CachedLowPrecisionEmbeddingBags(nn.Module):
    """Pooled lookups of several features in several :class:`CachedLowPrecisionEmbedding`
    tables, as one table-batched C++ call per phase (forward, backward, update, flush).

    ``defaults`` are table options (precision, rounding, cache_ratio, associativity, policy,
    optimizer, lr, qparams, seed, min_rows_for_low_precision, ...); ``per_table`` maps a table
    name to options that override them. Table ``i`` gets ``table_id=i`` unless its options
    name one, so tables sharing a seed draw independent rounding streams. Tables below
    ``min_rows_for_low_precision`` rows (default 1000) stay FP32 without cache.
    ``device="meta"`` builds the tables without memory or rows, to be filled by a checkpoint
    or sharded.

    The features are taken in the tables' order, each table's in its ``feature_names`` order
    (:attr:`feature_names`); :meth:`forward` returns ``[batch, sum of their dims]``, feature
    ``f``'s columns after those of features ``0..f-1``.

    The update is sparse and fused: after ``loss.backward()`` call :meth:`step` (or
    :meth:`zero_grad` to skip). ``has_nonfinite_grad`` / ``pending_grads`` /
    ``unscale_grad_`` let a mixed-precision trainer make one overflow decision over dense and
    embedding gradients (the ``MixedPrecisionEmbedding`` protocol of ``dlrm``). The module's
    group holds every table's pending gradient; a table's own methods (``step``,
    ``zero_grad``, ``pending_grads``, ...) act on its part of it.
    """

    def __init__(
        self,
        tables: Sequence[BagTable],
        *,
        per_table: Mapping[str, Mapping] | None = None,
        device: torch.device | str | None = None,
        **defaults,
    ) -> None:
        super().__init__()
        kind = type(self).__name__
        if not tables:
            raise ValueError(f"{kind} needs at least one table")
        per_table = dict(per_table or {})
        unknown = set(per_table) - {t.name for t in tables}
        if unknown:
            raise ValueError(f"per_table names unknown tables: {sorted(unknown)}")
        names = [t.name for t in tables]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"table {twice[0]!r} is named by two tables (names must be unique)")
        self.embedding_bags = nn.ModuleDict()
        seen: set[str] = set()
        for i, t in enumerate(tables):
            if t.mode not in MODES:
                raise ValueError(f"table '{t.name}': mode {t.mode!r} is not supported")
            for f in t.feature_names:
                if f in seen:
                    raise ValueError(f"table '{t.name}': feature '{f}' is used by two tables")
                seen.add(f)
            options = {"table_id": i, **defaults, **per_table.get(t.name, {})}
            for option in ("padding_idx", "mode"):  # nn.EmbeddingBag's: refused, not lost
                if option in options:
                    raise ValueError(f"table '{t.name}': {option} is not an option of {kind}")
            self.embedding_bags[t.name] = CachedLowPrecisionEmbedding(
                t.num_embeddings,
                t.embedding_dim,
                mode=t.mode,
                name=t.name,
                include_last_offset=True,
                device=device,
                **options,
            )
        # Fixed once built: the per-step paths read these.
        self.bag_tables = list(tables)
        self._table_list = list(self.embedding_bags.values())
        self.feature_names = [f for t in tables for f in t.feature_names]
        self._feature_tables = [i for i, t in enumerate(tables) for _ in t.feature_names]
        # per-sample weights only with sum, as nn.EmbeddingBag (mean's backward would not divide)
        self._unweighted = [t for t in tables if t.mode != "sum"]
        self._group = TableGroup(self._table_list)
        self._one_id_bags: torch.Tensor | None = None  # lengths of [batch, features] input

    @classmethod
    def from_bag_tables(
        cls, tables: Sequence[BagTable], **kwargs
    ) -> CachedLowPrecisionEmbeddingBags:
        """A module of this kind over ``tables`` (with the constructor's other arguments): a
        subclass whose constructor takes other table configurations converts them."""
        return cls(tables, **kwargs)

    def tables(self) -> list[CachedLowPrecisionEmbedding]:
        return list(self._table_list)

    @property
    def group(self) -> TableGroup:
        """The group that drives the tables and holds their pending gradient."""
        return self._group

    def feature_dims(self) -> list[int]:
        """Each feature's width in the output, in feature order."""
        return [self.bag_tables[t].embedding_dim for t in self._feature_tables]

    def forward(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled embeddings of every feature, ``[batch, sum of the features' dims]``.

        ``ids`` is either ``[batch, features]``, one id of each feature per sample (lengths
        not given), or 1-D and feature-major with ``lengths`` ``[features * batch]``, the
        bag sizes (feature ``f``'s bags are ``lengths[f * batch:(f + 1) * batch]``, over the
        ids after those of features ``0..f-1``), as TorchRec's ``KeyedJaggedTensor`` holds
        them. Ids are int64 or int32; ``per_sample_weights``, if given, one per id, of the
        ids' shape (read as float32). All tables run in one table-batched C++ call. Bad input raises a
        ValueError naming the table, feature and value, and changes nothing."""
        values, lengths, psw, batch = self._lookups(ids, lengths, per_sample_weights)
        try:
            return self._group.lookup(
                values,
                lengths,
                psw,
                self._feature_tables,
                batch,
                self.training,
                check=lambda: self.check_input(values, lengths, batch),
            )
        except RuntimeError:
            self.check_input(values, lengths, batch)  # raises the error that names the table
            raise

    def prefetch(self, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> None:
        """Starts bringing the stored rows that a coming :meth:`forward` of ``ids`` (and
        ``lengths``, as it takes them) will miss into GPU memory, on a side stream, while the
        current batch trains: for host-placed tables (``placement="host"``), whose misses
        otherwise cross PCIe in the forward and again in the update. Call it with the next
        batch after the current step's forward (the next forward of as many ids, in the
        module's present mode, takes it), before its backward and update. It changes no value (docs/design.md, "Prefetch") and waits for nothing; for
        tables in device memory, or on the CPU, it does nothing."""
        values, lengths, _, batch = self._lookups(ids, lengths, None)
        self._group.prefetch(values, lengths, self._feature_tables, batch, self.training)

    def _lookups(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor | None,
        per_sample_weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """:meth:`forward`'s input as the group takes it: int64 ids feature-major, the bags'
        lengths, float32 per-sample weights (or None) and the batch; ValueError if its shapes
        or types are wrong."""
        features = len(self.feature_names)
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be int64 or int32, got {ids.dtype}")
        if lengths is None:
            if ids.dim() != 2 or ids.shape[1] != features:
                raise ValueError(
                    f"ids without lengths must be [batch, {features}] (one id per feature), "
                    f"got shape {tuple(ids.shape)}"
                )
            if per_sample_weights is not None:
                if per_sample_weights.shape != ids.shape:
                    raise ValueError(
                        f"per_sample_weights must have the shape of ids {tuple(ids.shape)}, "
                        f"got {tuple(per_sample_weights.shape)}"
                    )
                per_sample_weights = per_sample_weights.t()
            batch = ids.shape[0]
            lengths = self._one_id_lengths(ids.numel(), ids.device)
            ids = ids.t()  # feature-major
        else:
            if ids.dim() != 1 or lengths.dim() != 1 or lengths.numel() % features:
                raise ValueError(
                    f"ids with lengths must be 1-D with {features} x batch lengths, got ids "
                    f"{tuple(ids.shape)} and lengths {tuple(lengths.shape)}"
                )
            batch = lengths.numel() // features
        values = ids.reshape(-1).long()
        if per_sample_weights is not None and self._unweighted:
            t = self._unweighted[0]
            raise ValueError(
                f"table '{t.name}': per_sample_weights are only supported with mode='sum' "
                f"(got mode='{t.mode}')"
            )
        psw = None if per_sample_weights is None else per_sample_weights.detach().float()
        if psw is not None and psw.numel() != values.numel():
            raise ValueError(f"{psw.numel()} per-sample weights for {values.numel()} ids")
        return values, lengths, None if psw is None else psw.reshape(-1).contiguous(), batch

    def _one_id_lengths(self, n: int, device: torch.device) -> torch.Tensor:
        """Lengths of ``n`` bags of one id each (kept: the per-step path of one-hot input)."""
        ones = self._one_id_bags
        if ones is None or ones.numel() < n or ones.device != device:
            ones = self._one_id_bags = torch.ones(n, dtype=torch.int32, device=device)
        return ones[:n]

    def check_lengths(
        self, lengths: torch.Tensor, num_ids: int, batch: int, names: Sequence[str] | None = None
    ) -> list[int]:
        """Each feature's number of ids, from ``lengths`` (feature-major, ``[features *
        batch]``, the features ``names``, by default this module's), checked: one length per
        feature and sample, none negative, as many ids as they add up to; else a ValueError
        naming the feature. Not on the per-step path: run when the C++ forward (which checks
        the same) has refused the input."""
        names = self.feature_names if names is None else names
        if lengths.dim() != 1 or lengths.numel() != len(names) * batch:
            raise ValueError(
                f"{lengths.numel()} lengths, expected one per feature and sample: "
                f"{len(names)} features x batch {batch}"
            )
        if lengths.numel() and int(lengths.min()) < 0:
            at = int(torch.nonzero(lengths < 0)[0])
            raise ValueError(
                f"feature '{names[at // batch]}', sample {at % batch}: negative length "
                f"{int(lengths[at])}"
            )
        per_feature = lengths.long().view(len(names), batch).sum(1).tolist()
        total = sum(per_feature)
        if total != num_ids:
            if total < num_ids:
                where = f"{num_ids - total} ids are left after the last feature '{names[-1]}'"
            else:  # the first feature whose ids run past the end
                f = next(f for f in range(len(names)) if sum(per_feature[: f + 1]) > num_ids)
                where = f"feature '{names[f]}' runs past the end of the ids"
            raise ValueError(
                f"lengths sum to {total} but there are {num_ids} ids: {where} "
                f"(ids per feature by the lengths: {dict(zip(names, per_feature))})"
            )
        return per_feature

    def check_input(self, ids: torch.Tensor, lengths: torch.Tensor, batch: int) -> None:
        """Tables with memory, consistent lengths, every id in range for its table: else a
        ValueError naming the table and feature. (Run only when the C++ forward, which checks
        the same, has refused input.)"""
        for t in self._table_list:
            if t.weights.is_meta:
                raise ValueError(f"table '{t.config.name}': {META_TABLE}")
        per_feature = torch.tensor(self.check_lengths(lengths, ids.numel(), batch))
        rows = torch.tensor([self.bag_tables[t].num_embeddings for t in self._feature_tables])
        limit = torch.repeat_interleave(rows, per_feature).to(ids.device)
        bad = (ids < 0) | (ids >= limit)
        if bool(bad.any()):
            at = int(torch.nonzero(bad)[0])
            f = int(torch.searchsorted(per_feature.cumsum(0), at, right=True))
            table = self.bag_tables[self._feature_tables[f]]
            raise ValueError(
                f"table '{table.name}': feature '{self.feature_names[f]}' has index "
                f"{int(ids[at])}, out of range [0, {table.num_embeddings})"
            )

    # -------------------------------------------------------------- the sparse optimizer

    def has_nonfinite_grad(self) -> bool:
        return self._group.has_nonfinite_grad()

    def pending_grads(self) -> list[torch.Tensor]:
        return self._group.pending_grads()

    def unscale_grad_(self, inv_scale: float) -> None:
        self._group.unscale_grad_(inv_scale)

    def step(self) -> None:
        """Apply every table's stored gradient in one table-batched call, all or nothing:
        if any table refuses its update (non-finite or unstorable values), no table is
        changed and the :class:`~embcache.EmbeddingUpdateError` names the table."""
        self._group.update(commit=True)

    def start_step(self, gate: torch.Tensor | None = None):
        """:meth:`step` launched without waiting for the device: returns the
        :class:`~embcache.group.PendingUpdate` whose ``words`` the caller reads (with its own
        figures, in one copy) and passes to its ``finish``, which raises as :meth:`step` would.
        ``gate``: int64 words on the tables' device, any non-zero one stopping the update
        (the caller's decision, made on the device)."""
        return self._group.start_update(gate)

    def check_step(self) -> None:
        """A dry run of :meth:`step`: raises the error it would raise, changes nothing (the
        gradient stays pending). Lets several processes agree before any of them updates."""
        self._group.update(commit=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._group.zero_grad()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, all or nothing: every table's state is checked first
        (:func:`~embcache.embedding.check_state_dict`), so a refused load changes no table."""
        check_state_dict(self, state_dict, strict)
        return super().load_state_dict(state_dict, strict, assign)

    def flush(self) -> int:
        return sum(self._group.flush())

    # -------------------------------------------------------------- reporting

    def stats(self) -> dict[str, dict]:
        return {name: t.stats() for name, t in self.embedding_bags.items()}

    def memory_bytes(self) -> dict[str, dict]:
        return {name: t.memory_bytes() for name, t in self.embedding_bags.items()}

    def compression_factor(self) -> float:
        """The paper's factor over all tables: total bytes / (FP32 tables + optimizer state)."""
        configs = [t.config for t in self._table_list]
        total = sum(memory_breakdown(c)["total"] for c in configs)
        return total / sum(fp32_bytes(c) for c in configs)
