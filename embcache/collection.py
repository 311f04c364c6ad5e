"""A drop-in for TorchRec's ``EmbeddingBagCollection`` made of cached low-precision tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from embcache.embedding import (
    META_TABLE,
    CachedLowPrecisionEmbedding,
    PendingGradient,
    _ops,
    check_state_dict,
)

_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}
_NO_HINT = torch.empty(0, dtype=torch.int64)


class _StoredGradient(NamedTuple):
    """One backward's gradient for every feature as multi_dedup_backward made it: feature f's
    unique rows are ``rows[row_starts[f]:row_starts[f + 1]]``, with their occurrences and
    (unless ``slots`` is empty) the cache slots the forward found at the same positions, and
    their gradients a block of rows x dim values of the 1-D ``grads``, blocks in feature
    order. Also what the forward saw: each table's cache version, each feature's value bound."""

    rows: torch.Tensor
    grads: torch.Tensor
    occurrences: torch.Tensor
    slots: torch.Tensor
    row_starts: list[int]
    versions: list[int]
    bounds: list[float]


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

    A backward's gradient is kept here as one record for all tables (handing 26 tables their
    parts costs Python time every step); a table's own methods (``step``, ``zero_grad``,
    ``pending_grads``, ...) first hand every table its part, so they see it as theirs.
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
            self.embedding_bags[t.name] = CachedLowPrecisionEmbedding(
                t.num_embeddings,
                t.embedding_dim,
                mode=_MODES[t.pooling],
                name=t.name,
                include_last_offset=True,
                device=device,
                **options,
            )
        # Fixed once built, like the layout: the per-step paths read these lists.
        self._table_list = list(self.embedding_bags.values())
        self._counters_list = [t._counters for t in self._table_list]
        self._layout = self._feature_layout()
        self._static_lookup_args = self._lookup_args()
        mean = self._static_lookup_args[-1]
        self._feature_means = [mean[t] for t in self._layout[1]]  # per feature, for backward
        # the update's per-table settings when every table has a gradient (the usual step)
        self._all_update_settings = _columns(t._update_settings for t in self.tables())
        # a stored gradient can go to multi_update as it is: feature i reads table i
        self._one_feature_per_table = self._layout[1] == list(range(len(tables)))
        self._stored: list[_StoredGradient] = []  # gradients not yet handed to the tables
        for t in self._table_list:
            t._hand_over = self._hand_over

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

    def _lookup_args(self) -> tuple[list[int], ...]:
        """The per-table settings of the table-batched forward (they never change)."""
        cfgs = [t.config for t in self.tables()]
        return (
            [c.bits for c in cfgs],
            [c.embedding_dim for c in cfgs],
            [int(c.qparams_fp16) for c in cfgs],
            [c.num_sets for c in cfgs],
            [c.ways for c in cfgs],
            [int(c.mode == "mean") for c in cfgs],
        )

    @staticmethod
    def _check_lengths(features: KeyedJaggedTensor) -> list[int]:
        """Each feature's number of ids from the lengths, checked: one length per feature and
        sample, none negative, as many ids as the lengths add up to, and a length_per_key or
        offset_per_key the KeyedJaggedTensor carries agreeing with them; else a ValueError
        naming the feature. Not on the per-step path: run before a permute reads the lengths,
        and when the C++ forward (which checks lengths against values, but does not read a
        length_per_key) has refused the input."""
        if features.variable_stride_per_key():
            raise ValueError("variable batch size per feature is not supported")
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
        carried = features._length_per_key
        if carried is None and features._offset_per_key is not None:
            o = features._offset_per_key
            carried = [b - a for a, b in zip(o, o[1:])]
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
        feature. (Run only when the C++ forward, which checks the same, has refused the input.)"""
        for t in self._table_list:
            if t.weights.is_meta:
                raise ValueError(f"table '{t.config.name}': {META_TABLE}")
        per_key = self._check_lengths(features)
        values = features.values()
        if values.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be int64 or int32, got {values.dtype}")
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
        keys = features.keys()
        if keys != names:
            missing = [n for n in names if n not in keys]
            if missing:
                raise ValueError(f"features {missing} are missing from the input")
            self._check_lengths(features)  # the permute trusts them
            features = features.permute([keys.index(n) for n in names])
        if features.variable_stride_per_key():
            raise ValueError("variable batch size per feature is not supported")
        if features.values().dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be int64 or int32, got {features.values().dtype}")
        tables = self._table_list
        state = [t._state_tensors() for t in tables]
        values = features.values().long().contiguous()
        psw = features.weights_or_none()
        psw = None if psw is None else psw.detach().float().contiguous()
        batch = features.stride()
        try:
            pooled, offsets, slots, bounds = _ops.multi_lookup_forward(
                [s[0] for s in state],
                [s[1] for s in state],
                [s[2] for s in state],
                values,
                features.lengths(),
                psw,
                table_of,
                *self._static_lookup_args,
                batch,
                self._counters_list if self.training else [],
            )
        except RuntimeError:
            self._check(features, names, table_of)  # raises the error that names the table
            raise
        anchor = tables[0]._grad_anchor
        if not self.training:
            anchor = anchor.detach()
        versions = [t._cache_version for t in tables]
        lookup = (self, pooled, values, offsets, psw, slots, versions, bounds)
        pooled = _FusedLookup.apply(anchor, lookup)
        return KeyedTensor(keys=names, length_per_key=dims, values=pooled)

    # -------------------------------------------------------------- the sparse optimizer

    def _store(self, stored: _StoredGradient) -> None:
        """Keeps a backward's gradient; one stored before it goes to the tables first."""
        self._hand_over()
        self._stored.append(stored)

    def _hand_over(self) -> None:
        """Hands each table its part of the stored gradient, as the last part it holds."""
        if not self._stored:
            return
        s = self._stored.pop()
        _, table_of, dims = self._layout
        starts = s.row_starts
        counts = [b - a for a, b in zip(starts, starts[1:])]
        rows, occ = s.rows.split(counts), s.occurrences.split(counts)
        grads = s.grads.split([n * d for n, d in zip(counts, dims)])
        for f, t in enumerate(table_of):
            g = grads[f].view(counts[f], dims[f])
            self._table_list[t]._pending.append(PendingGradient(rows[f], g, occ[f]))

    def _grads(self) -> list[torch.Tensor]:
        """Every stored gradient tensor: the tables' parts and those kept here."""
        return [p.grads for t in self._table_list for p in t._pending] + [
            s.grads for s in self._stored
        ]

    def has_nonfinite_grad(self) -> bool:
        return any(not bool(torch.isfinite(g).all()) for g in self._grads())

    def pending_grads(self) -> list[torch.Tensor]:
        return self._grads()

    def unscale_grad_(self, inv_scale: float) -> None:
        grads = self._grads()
        if grads:
            torch._foreach_mul_(grads, inv_scale)  # each tensor as g.mul_(inv_scale) would

    def step(self) -> None:
        """Apply every table's stored gradient in one table-batched call, all or nothing:
        if any table refuses its update (non-finite or unstorable values), no table is
        changed and the :class:`~embcache.EmbeddingUpdateError` names the table."""
        self._update(commit=True)

    def check_step(self) -> None:
        """A dry run of :meth:`step`: raises the error it would raise, changes nothing (the
        gradient stays pending). Lets several processes agree before any of them updates."""
        self._update(commit=False)

    def _update(self, commit: bool) -> None:
        tables = self._table_list
        if (
            self._stored
            and self._one_feature_per_table
            and not any(t._pending for t in tables)
            and self._stored[0].versions == [t._cache_version for t in tables]
        ):  # the usual step: one backward, the cache as its forward saw it
            s = self._stored[0]
            bad = _ops.multi_update(
                *_columns(t._state_tensors() for t in tables),
                s.rows,
                s.grads,
                s.occurrences,
                s.slots,
                s.row_starts,
                s.bounds,
                *self._all_update_settings,
                self._counters_list,
                commit,
            )
            self._finish(tables, bad, commit)
            return
        # Otherwise each table's gradient, its parts merged, and no slot hints (the update
        # finds the slots in the sets).
        self._hand_over()
        tables, parts = [], []
        for t in self._table_list:
            p = t._pending_gradient()
            if p is not None:
                tables.append(t)
                parts.append(p)
        if not tables:
            return
        every_table = len(tables) == len(self._table_list)
        settings = (
            self._all_update_settings
            if every_table
            else _columns(t._update_settings for t in tables)
        )
        row_starts = [0]
        for p in parts:
            row_starts.append(row_starts[-1] + p.rows.numel())
        bad = _ops.multi_update(
            *_columns(t._state_tensors() for t in tables),
            torch.cat([p.rows for p in parts]),
            torch.cat([p.grads.flatten() for p in parts]),
            torch.cat([p.occurrences for p in parts]),
            _NO_HINT,
            row_starts,
            [-1.0] * len(tables),
            *settings,
            self._counters_list if every_table else [t._counters for t in tables],
            commit,
        )
        self._finish(tables, bad, commit)

    def _finish(
        self, tables: list[CachedLowPrecisionEmbedding], bad: list[int], commit: bool
    ) -> None:
        """After multi_update on ``tables``: raise for the first table that refused (nothing
        was changed then); else, if it committed, the gradients are used and the caches may
        have changed."""
        if max(bad) >= 0:
            self._hand_over()  # the tables' parts name the row
            for t, b in zip(tables, bad):
                t._raise_if_bad(b)
        if not commit:
            return
        self._stored.clear()
        for t in tables:
            t._finish_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._stored.clear()
        for t in self.tables():
            t.zero_grad()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, all or nothing: every table's state is checked first
        (:func:`~embcache.embedding.check_state_dict`), so a refused load changes no table."""
        check_state_dict(self, state_dict, strict)
        return super().load_state_dict(state_dict, strict, assign)

    def flush(self) -> int:
        return sum(t.flush() for t in self.tables())

    # -------------------------------------------------------------- reporting

    def stats(self) -> dict[str, dict]:
        return {name: t.stats() for name, t in self.embedding_bags.items()}

    def memory_bytes(self) -> dict[str, dict]:
        return {name: t.memory_bytes() for name, t in self.embedding_bags.items()}

    def compression_factor(self) -> float:
        """The paper's factor over all tables: total bytes / (FP32 tables + optimizer state)."""
        total = fp32 = 0
        for t in self.tables():
            mem = t.memory_bytes()
            total += mem["total"]
            fp32 += t.config.num_embeddings * t.config.embedding_dim * 4 + mem["optimizer_state"]
        return total / fp32


def _columns(rows) -> list[list]:
    """The columns of a sequence of equal-length tuples, as lists."""
    return [list(column) for column in zip(*rows)]


class _FusedLookup(torch.autograd.Function):
    """Returns the table-batched forward's output (``pooled``) with this node as its
    gradient function; backward deduplicates every feature's gradient in one table-batched
    call and stores the result in the collection, one record for all tables, for
    :meth:`CachedLowPrecisionEmbeddingBagCollection.step`, with each row's cache slot as the
    forward found it. ``lookup`` is what the forward made and saw: (collection, pooled,
    values, offsets, per-sample weights or None, every lookup's slot, each table's cache
    version, each feature's largest |value| read). The ids and weights may be the caller's
    tensors, so they are saved (autograd refuses a backward after they change in place); the
    rest are the forward's own and kept on ``ctx`` as they are."""

    @staticmethod
    def forward(ctx, anchor, lookup):
        ctx.collection, pooled, values, ctx.offsets, psw, ctx.slots, ctx.versions, ctx.bounds = (
            lookup
        )
        ctx.save_for_backward(values, *(() if psw is None else (psw,)))
        return pooled

    @staticmethod
    def backward(ctx, grad):
        collection = ctx.collection
        if ctx.needs_input_grad[0]:
            _, table_of, dims = collection._layout
            # The CUDA forward gives neither slots nor value bounds.
            slots = ctx.slots if ctx.slots.numel() else None
            values, *psw = ctx.saved_tensors
            rows, grads, occurrences, row_slots, row_starts = _ops.multi_dedup_backward(
                values,
                ctx.offsets,
                psw[0] if psw else None,
                grad.float().contiguous(),
                dims,
                collection._feature_means,
                grad.shape[0],
                slots,
            )
            bounds = ctx.bounds.tolist() or [-1.0] * len(table_of)
            collection._store(
                _StoredGradient(
                    rows,
                    grads,
                    occurrences,
                    row_slots,
                    row_starts.tolist(),
                    ctx.versions,
                    bounds,
                )
            )
        return None, None
