"""Drop-ins for TorchRec's ``EmbeddingBagCollection`` and ``EmbeddingCollection`` made of
cached low-precision tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from embcache.embedding import META_TABLE, CachedLowPrecisionEmbedding, check_state_dict
from embcache.group import TableGroup
from embcache.memory import fp32_bytes, memory_breakdown

_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


class CachedLowPrecisionEmbeddingBagCollection(nn.Module):
    """TorchRec's ``EmbeddingBagCollection`` interface over :class:`CachedLowPrecisionEmbedding`
    tables: ``KeyedJaggedTensor`` in, ``KeyedTensor`` out, so it can be passed as the
    ``embedding_bag_collection`` of ``torchrec.models.dlrm.DLRM``.

    ``defaults`` are table options (precision, rounding, cache_ratio, associativity, policy,
    optimizer, lr, qparams, seed, min_rows_for_low_precision, ...); ``per_table`` maps a table
    name to options that override them. Table ``i`` gets ``table_id=i`` unless its options
    name one, so tables sharing a seed draw independent rounding streams. Tables below
    ``min_rows_for_low_precision`` rows (default 1000) stay FP32 without cache.

    ``device="meta"`` builds the tables without memory or rows (as TorchRec's own collection
    does), for ``DistributedModelParallel`` to shard: each rank then allocates and draws
    only its shards (:mod:`embcache.sharding`), the rows the unsharded table would hold.

    The update is sparse and fused: after ``loss.backward()`` call :meth:`step` (or
    :meth:`zero_grad` to skip). ``has_nonfinite_grad`` / ``unscale_grad_`` let a mixed-
    precision trainer make one overflow decision over dense and embedding gradients.

    The tables run as one :class:`~embcache.group.TableGroup`: one table-batched C++ call per
    phase, and the collection's group holds every table's pending gradient; a table's own
    methods (``step``, ``zero_grad``, ``pending_grads``, ...) act on its part of it.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        *,
        per_table: Mapping[str, Mapping] | None = None,
        device: torch.device | str | None = None,
        **defaults,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("CachedLowPrecisionEmbeddingBagCollection needs at least one table")
        per_table = dict(per_table or {})
        unknown = set(per_table) - {t.name for t in tables}
        if unknown:
            raise ValueError(f"per_table names unknown tables: {sorted(unknown)}")
        names = [t.name for t in tables]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"table {twice[0]!r} is named by two tables (names must be unique)")
        self._configs = list(tables)
        self.embedding_bags = nn.ModuleDict()
        seen: set[str] = set()
        for i, t in enumerate(tables):
            if t.pooling not in _MODES:
                raise ValueError(f"table '{t.name}': pooling {t.pooling} is not supported")
            for f in t.feature_names:
                if f in seen:
                    raise ValueError(f"table '{t.name}': feature '{f}' is used by two tables")
                seen.add(f)
            options = {"table_id": i, **defaults, **per_table.get(t.name, {})}
            if "padding_idx" in options:  # nn.EmbeddingBag's, not TorchRec's: refused, not lost
                raise ValueError(f"table '{t.name}': padding_idx is not a collection option")
            self.embedding_bags[t.name] = CachedLowPrecisionEmbedding(
                t.num_embeddings,
                t.embedding_dim,
                mode=_MODES[t.pooling],
                name=t.name,
                include_last_offset=True,
                device=device,
                **options,
            )
        # Fixed once built: the per-step paths read these.
        self._table_list = list(self.embedding_bags.values())
        self._layout = self._feature_layout()
        self._group = TableGroup(self._table_list)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return False

    def tables(self) -> list[CachedLowPrecisionEmbedding]:
        return list(self._table_list)

    def _feature_layout(self) -> tuple[list[str], list[int], list[int]]:
        """Feature names in output order, the table of each, and each table's dim."""
        names, table_of = [], []
        for i, config in enumerate(self._configs):
            names += list(config.feature_names)
            table_of += [i] * len(config.feature_names)
        return names, table_of, [self._configs[t].embedding_dim for t in table_of]

    @staticmethod
    def _check_lengths(features: KeyedJaggedTensor) -> list[int]:
        """Each feature's number of ids from the lengths of ``features`` (one batch size for
        every feature: the forward checks that first), checked: one length per feature and
        sample, none negative, as many ids as the lengths add up to, and a length_per_key or
        offset_per_key the KeyedJaggedTensor carries agreeing with them; else a ValueError
        naming the feature. Not on the per-step path: run before a permute reads the lengths,
        and when the C++ forward (which checks lengths against values, but does not read a
        length_per_key) has refused the input."""
        keys, batch, lengths = features.keys(), features.stride(), features.lengths()
        if lengths.dim() != 1 or lengths.numel() != len(keys) * batch:
            raise ValueError(
                f"KeyedJaggedTensor has {lengths.numel()} lengths, expected one per feature and "
                f"sample: {len(keys)} features x batch {batch}"
            )
        if lengths.numel() and int(lengths.min()) < 0:
            at = int(torch.nonzero(lengths < 0)[0])
            raise ValueError(
                f"KeyedJaggedTensor has a negative length: feature '{keys[at // batch]}', "
                f"sample {at % batch}: {int(lengths[at])}"
            )
        per_key = lengths.long().view(len(keys), batch).sum(1).tolist()
        carried = features.length_per_key_or_none()
        offsets = features.offset_per_key_or_none()
        if carried is None and offsets is not None:
            carried = [b - a for a, b in zip(offsets, offsets[1:])]
        if carried is not None and list(carried) != per_key:
            carried = list(carried) + [None] * (len(per_key) - len(carried))
            f = next((f for f, (a, b) in enumerate(zip(carried, per_key)) if a != b), -1)
            raise ValueError(
                f"feature '{keys[f]}': its lengths sum to {per_key[f]}, but the "
                f"KeyedJaggedTensor's length_per_key/offset_per_key says {carried[f]}"
            )
        total, n = sum(per_key), features.values().numel()
        if total != n:
            if total < n:
                where = f"{n - total} values are left after the last feature '{keys[-1]}'"
            else:  # the first feature whose ids run past the end of the values
                f = next(f for f in range(len(keys)) if sum(per_key[: f + 1]) > n)
                where = f"feature '{keys[f]}' runs past the end of the values"
            raise ValueError(
                f"KeyedJaggedTensor lengths sum to {total} but it has {n} values: {where} "
                f"(ids per feature by the lengths: {dict(zip(keys, per_key))})"
            )
        return per_key

    def _check(self, features: KeyedJaggedTensor, names: list[str], table_of: list[int]) -> None:
        """Consistent lengths, every id in range for its table: else a ValueError naming the
        feature. (Run only when the C++ forward, which checks the same, has refused input whose
        batch size and id dtype the forward has already checked.)"""
        for t in self._table_list:
            if t.weights.is_meta:
                raise ValueError(f"table '{t.config.name}': {META_TABLE}")
        per_key = self._check_lengths(features)
        values = features.values()
        weights = features.weights_or_none()
        if weights is not None and weights.numel() != values.numel():
            raise ValueError(
                f"KeyedJaggedTensor has {weights.numel()} weights for {values.numel()} values"
            )
        per_key = torch.tensor(per_key, device=values.device)
        limits = torch.tensor(
            [self._configs[t].num_embeddings for t in table_of], device=values.device
        )
        limit = torch.repeat_interleave(limits, per_key)
        bad = (values < 0) | (values >= limit)
        if bool(bad.any()):
            at = int(torch.nonzero(bad)[0])
            f = int(torch.searchsorted(per_key.cumsum(0), at, right=True))
            config = self._configs[table_of[f]]
            raise ValueError(
                f"table '{config.name}': feature '{names[f]}' has index {int(values[at])}, "
                f"out of range [0, {config.num_embeddings})"
            )

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of every feature, ``[batch, sum of dims]`` as a KeyedTensor.

        All tables run in one table-batched C++ call (tables in parallel)."""
        names, table_of, dims = self._layout
        features = self._in_feature_order(features)
        if features.values().dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be int64 or int32, got {features.values().dtype}")
        values = features.values().long().contiguous()
        psw = features.weights_or_none()
        psw = None if psw is None else psw.detach().float().contiguous()
        try:
            pooled = self._group.lookup(
                values, features.lengths(), psw, table_of, features.stride(), self.training
            )
        except RuntimeError:
            self._check(features, names, table_of)  # raises the error that names the table
            raise
        return KeyedTensor(keys=names, length_per_key=dims, values=pooled)

    def _in_feature_order(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` with its keys in the collection's feature order (permuted if need be,
        extra keys dropped); a ValueError for a variable batch size or a missing feature."""
        if features.variable_stride_per_key():
            raise ValueError("variable batch size per feature is not supported")
        names, keys = self._layout[0], features.keys()
        if keys == names:
            return features
        missing = [n for n in names if n not in keys]
        if missing:
            raise ValueError(f"features {missing} are missing from the input")
        self._check_lengths(features)  # the permute trusts them
        return features.permute([keys.index(n) for n in names])

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


class CachedLowPrecisionEmbeddingCollection(CachedLowPrecisionEmbeddingBagCollection):
    """TorchRec's ``EmbeddingCollection`` interface (unpooled: ``KeyedJaggedTensor`` in, a
    ``JaggedTensor`` of one row per id for each feature out) over the same tables as
    :class:`CachedLowPrecisionEmbeddingBagCollection`, whose options, update, state dict and
    statistics it has. Its forward makes a bag of each id: feature ``f``'s ``n_f`` ids are
    bags ``[0, n_f)`` of a batch of ``max n_f`` bags, the rest empty (zeros, no gradient), so
    one table-batched call serves every feature whatever its length; the empty bags cost
    output rows when the features' lengths differ much. ``DistributedModelParallel`` shards it
    with :class:`embcache.sharding.CachedEmbeddingCollectionSharder`."""

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        *,
        per_table: Mapping[str, Mapping] | None = None,
        device: torch.device | str | None = None,
        **defaults,
    ) -> None:
        if "mode" in defaults or any("mode" in o for o in (per_table or {}).values()):
            raise ValueError("mode (pooling) does not apply to an unpooled collection")
        self._unpooled_configs = list(tables)
        bags = [
            EmbeddingBagConfig(
                name=t.name,
                embedding_dim=t.embedding_dim,
                num_embeddings=t.num_embeddings,
                feature_names=list(t.feature_names),
                pooling=PoolingType.SUM,
            )
            for t in tables
        ]
        super().__init__(bags, per_table=per_table, device=device, **defaults)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._unpooled_configs

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:  # type: ignore[override]
        """Each feature's rows, ``{feature: JaggedTensor}`` with ``features``' lengths and
        values ``[ids of the feature, dim]``."""
        features = self._in_feature_order(features)
        names, device = self._layout[0], features.values().device
        counts = features.length_per_key()
        width = max(counts, default=0)
        one_id_bags = torch.arange(width) < torch.tensor(counts, dtype=torch.int64).unsqueeze(1)
        bags = KeyedJaggedTensor(
            keys=names,
            values=features.values(),
            lengths=one_id_bags.view(-1).long().to(device),
            stride=width,
        )
        pooled = super().forward(bags)
        lengths = features.lengths().view(len(names), -1)
        return {
            n: JaggedTensor(values=pooled[n][:count], lengths=lengths[f])
            for f, (n, count) in enumerate(zip(names, counts))
        }
