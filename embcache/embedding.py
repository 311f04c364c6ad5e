"""A low-precision embedding-bag table behind an FP32 set-associative cache (docs/contract.md §2-4)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import torch
from torch import nn

from embcache import _C  # noqa: F401  (registers torch.ops.embcache)
from embcache.config import TableConfig

_ops = torch.ops.embcache

# A table's counters, in the order of the Counter enum in csrc/op_schemas.h (the table-batched
# ops add to them in place).
_STAT_NAMES = (
    "lookups",
    "hits",
    "steps",
    "unique_rows",
    "unique_hits",
    "unique_misses",
    "insertions",
    "evictions",
    "bypasses",
    "flushed",
)
_COUNTER = {name: i for i, name in enumerate(_STAT_NAMES)}


class PendingGradient(NamedTuple):
    """A stored gradient: unique rows (ascending), their summed gradients ``[rows, dim]``
    and how often each occurs."""

    rows: torch.Tensor
    grads: torch.Tensor
    occurrences: torch.Tensor


class EmbeddingUpdateError(ValueError):
    """A training step the table refused; the table, cache and optimizer state are unchanged."""


class CachedLowPrecisionEmbedding(nn.Module):
    r"""An ``nn.EmbeddingBag`` whose rows are stored in FP16/INT8/INT4/INT2 and trained there,
    with the hottest rows kept in a small FP32 cache (LRU or LFU, direct-mapped or N-way).

    Usage is ``nn.EmbeddingBag``'s (``include_last_offset`` included), except that the update is applied by :meth:`step` (a
    fused sparse optimizer) rather than by a ``torch.optim`` optimizer::

        emb = CachedLowPrecisionEmbedding(10**6, 16, precision="int8", cache_ratio=0.05)
        loss = head(emb(indices, offsets)).sum()
        loss.backward()   # stores the deduplicated per-row gradient in the module
        emb.step()        # optimizer + cache insert/evict/bypass + rounding into the table

    Invariants:

    * ``weights`` (uint8 ``[rows, row_bytes]``) holds every row that is not cached, in the
      stored format (FBGEMM's fused row-wise layouts for integer formats); a cached row's
      table copy is stale (write-back) until it is evicted or :meth:`flush` is called.
    * ``cache_tags`` (int32 ``[sets * ways]``, -1 empty) never holds a row twice; slot
      ``s * ways + w`` is way ``w`` of set ``s`` and row ``i`` can only live in set
      ``murmur_fmix64(i) % sets``. ``cache_rows`` holds the FP32 values of the slots.
    * LFU keeps ``counts`` (int32 per table row, saturating: lookups during training steps).
      ``cache_priority`` (int32 per slot, 0 when empty) holds a resident's priority: for LRU
      the step that last updated it, for LFU a copy of its row's count. Priorities only rise
      until :meth:`flush` empties the cache.
    * ``cache_set_floor`` (int32 per set, not saved) is a lower bound of the set's slot
      priorities (INT32_MIN while a way is empty or the bound is unknown). It only saves the
      update from reading a set that no candidate can enter; it never changes a result.
    * ``optimizer_state`` holds FP32 accumulators for every row (0, 1 or dim per row).
    * ``step_count`` is the number of applied updates. Stochastic rounding at update ``t`` is
      keyed by ``(seed, t, table_id, row, element)``, so ``state_dict()`` (tensors, plus the
      configuration, step count and statistics as extra state) resumes a run bit-identically.
    * Evaluation forwards (``module.eval()``) and refused calls change no state at all.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        weight: torch.Tensor | None = None,
        include_last_offset: bool = False,
        device: torch.device | str | None = None,
        **options,
    ) -> None:
        super().__init__()
        self.include_last_offset = include_last_offset
        self.config = TableConfig(num_embeddings, embedding_dim, **options)
        cfg = self.config
        if weight is not None and tuple(weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(
                f"table '{cfg.name}': initial weight has shape {tuple(weight.shape)}, "
                f"expected {(num_embeddings, embedding_dim)}"
            )
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "meta" and weight is not None:
            raise ValueError(f"table '{cfg.name}': a table on the meta device takes no weight")
        self._allocate_state(torch.device("meta") if device.type == "meta" else None)
        if device.type != "meta":
            self._write_rows(0, _weight_blocks(weight) if weight is not None else None)
            self._reset_state()
        self._counters = torch.zeros(
            len(_STAT_NAMES), dtype=torch.int64
        )  # CPU, wherever the table is
        self._grad_anchor = torch.empty(0, requires_grad=True)
        self._pending: list[PendingGradient] = []
        # Set by a collection that owns this table: it may keep the latest backward's gradient
        # itself (one record for all its tables), and calling this hands every table its part.
        self._hand_over: Callable[[], None] | None = None
        self._cache_version = 0  # changes whenever the cache may have changed
        if device.type not in ("cpu", "meta"):
            self.to(device)

    # ------------------------------------------------------------------ construction helpers

    @property
    def step_count(self) -> int:
        """The number of updates applied so far."""
        return int(self._counters[_COUNTER["steps"]])

    @property
    def _lfu(self) -> bool:
        return self.config.policy == "lfu" and self.config.num_slots > 0

    @functools.cached_property
    def _update_settings(self) -> tuple:
        """This table's settings in the order of the multi_update op (between the gradients
        and the step number)."""
        cfg = self.config
        return (
            cfg.embedding_dim,
            cfg.bits,
            int(cfg.qparams_fp16),
            int(cfg.rounding == "stochastic"),
            cfg.optimizer_code,
            cfg.lr,
            cfg.eps,
            int(self._lfu),
            cfg.seed,
            cfg.table_id,
            cfg.num_sets,
            cfg.ways,
        )

    def _format_args(self) -> tuple[int, bool]:
        return self.config.bits, self.config.qparams_fp16

    def _allocate_state(self, device: torch.device | None) -> None:
        """Register every state tensor, uninitialised: on the meta device, or (None) in host
        memory on huge pages."""
        cfg = self.config

        def state(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
            if device is not None:
                return torch.empty(shape, dtype=dtype, device=device)
            return _state_tensor(shape, dtype)

        slots = cfg.num_slots
        self.register_buffer("weights", state((cfg.num_embeddings, cfg.row_bytes), torch.uint8))
        self.register_buffer("cache_tags", state((slots,), torch.int32))
        self.register_buffer("cache_rows", state((slots, cfg.embedding_dim), torch.float32))
        self.register_buffer("cache_priority", state((slots,), torch.int32))
        self.register_buffer(
            "cache_set_floor", state((cfg.num_sets,), torch.int32), persistent=False
        )
        counts_rows = cfg.num_embeddings if cfg.policy == "lfu" and slots > 0 else 0
        self.register_buffer("counts", state((counts_rows,), torch.int32))
        width = cfg.optimizer_state_width
        self.register_buffer("optimizer_state", state((cfg.num_embeddings * width,), torch.float32))

    def _reset_state(self) -> None:
        """Empty the cache; zero the LFU counts and the optimizer state."""
        with torch.no_grad():
            self.cache_tags.fill_(-1)
            self.cache_rows.zero_()
            self.cache_priority.zero_()
            self.cache_set_floor.fill_(_NO_FLOOR)
            self.counts.zero_()
            self.optimizer_state.zero_()

    def _write_rows(self, first: int, blocks: Iterator[tuple[int, torch.Tensor]] | None) -> None:
        """Store FP32 rows, rounded to nearest: each block (source row ``r``, rows) goes to
        this table's rows from ``r - first`` on; ``blocks=None`` stores this table's initial
        rows (:func:`_initial_blocks`). Blocks are at most 2^16 rows, so no FP32 copy of the
        table exists at once."""
        cfg = self.config
        if blocks is None:
            blocks = _initial_blocks(cfg, 0, cfg.num_embeddings)
        bits, qfp16 = self._format_args()
        for start, block in blocks:
            at = start - first
            ids = torch.arange(at, at + block.shape[0], dtype=torch.int64)
            try:
                self.weights[at : at + block.shape[0]] = _ops.quantize_rows(
                    block, ids, bits, qfp16, False, 0, 0, 0
                )
            except RuntimeError as e:
                raise ValueError(f"table '{cfg.name}': initial weight: {e}") from None

    # ------------------------------------------------------------------ input checking

    def _bags(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None,
        per_sample_weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(indices int64 [L], offsets int64 [B+1], weights float32 [L] or None), checked."""
        name = self.config.name

        def bad(msg: str) -> ValueError:
            return ValueError(f"table '{name}': {msg}")

        if self.weights.is_meta:
            raise bad(META_TABLE)
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int64, torch.int32):
            raise bad(
                f"input must be an int64 or int32 tensor, got {getattr(input, 'dtype', type(input))}"
            )
        if input.dim() == 2:
            if offsets is not None:
                raise bad("offsets must be None when input is 2-D (fixed-length bags)")
            bags, length = input.shape
            offsets = torch.arange(
                0, bags * length + 1, max(length, 1), dtype=torch.int64, device=input.device
            )[: bags + 1]
            input = input.reshape(-1)
        elif input.dim() == 1:
            if offsets is None:
                raise bad("offsets are required when input is 1-D")
            if (
                not isinstance(offsets, torch.Tensor)
                or offsets.dtype not in (torch.int64, torch.int32)
                or offsets.dim() != 1
            ):
                raise bad("offsets must be a 1-D int64 or int32 tensor")
            offsets = offsets.long()
            if not self.include_last_offset:
                offsets = torch.cat([offsets, offsets.new_tensor([input.numel()])])
            elif offsets.numel() == 0 or int(offsets[-1]) != input.numel():
                raise bad(
                    f"with include_last_offset the last offset must be len(input)="
                    f"{input.numel()}, got {offsets[-1:].tolist()}"
                )
        else:
            raise bad(f"input must be 1-D or 2-D, got {input.dim()}-D")
        indices = input.long().contiguous()
        if indices.numel():
            lo, hi = int(indices.min()), int(indices.max())
            if lo < 0 or hi >= self.config.num_embeddings:
                raise bad(
                    f"index {lo if lo < 0 else hi} is out of range [0, {self.config.num_embeddings})"
                )
        if offsets.numel():  # (a single offset too: C++ would refuse it after counting)
            if int(offsets[0]) != 0:
                raise bad(f"offsets must start at 0, got {int(offsets[0])}")
            steps = offsets[1:] - offsets[:-1]
            if bool((steps < 0).any()):
                at = int(torch.nonzero(steps < 0)[0])
                raise bad(
                    f"offsets decrease at bag {at} ({int(offsets[at])} > {int(offsets[at + 1])}) "
                    f"or exceed len(input)={indices.numel()}"
                )
        if per_sample_weights is not None:
            if self.config.mode != "sum":
                raise bad("per_sample_weights are only supported with mode='sum'")
            if (
                not isinstance(per_sample_weights, torch.Tensor)
                or not per_sample_weights.is_floating_point()
            ):
                raise bad("per_sample_weights must be a floating-point tensor")
            if per_sample_weights.shape != indices.shape:
                raise bad(
                    f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
                    f"expected {tuple(indices.shape)}"
                )
        return indices, offsets.contiguous(), per_sample_weights

    # ------------------------------------------------------------------ forward / backward

    def _lookup(self, indices, offsets, psw) -> tuple[torch.Tensor, int]:
        cfg = self.config
        bits, qfp16 = self._format_args()
        out, hits = _ops.lookup_forward(
            self.weights,
            self.cache_tags,
            self.cache_rows,
            indices,
            offsets,
            psw,
            bits,
            cfg.embedding_dim,
            qfp16,
            cfg.num_sets,
            cfg.ways,
            cfg.mode == "mean",
        )
        return out, int(hits)

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled embeddings ``[bags, dim]`` (FP32), with ``nn.EmbeddingBag``'s conventions.

        In training mode the backward pass stores the per-row gradient for :meth:`step`.
        """
        indices, offs, psw = self._bags(input, offsets, per_sample_weights)
        psw32 = None if psw is None else psw.detach().float().contiguous()
        if self.training:
            self._counters[_COUNTER["lookups"]] += indices.numel()
        anchor = self._grad_anchor if self.training else self._grad_anchor.detach()
        psw_in = psw if psw is not None else torch.empty(0)
        return _PooledLookup.apply(self, indices, offs, psw32, anchor, psw_in)

    def _store_gradient(self, indices, offsets, psw, grad_output) -> None:
        rows, grads, occ = _ops.dedup_backward(
            indices, offsets, psw, grad_output.float().contiguous(), self.config.mode == "mean"
        )
        self._parts().append(PendingGradient(rows, grads, occ))

    # ------------------------------------------------------------------ the update

    def _parts(self) -> list[PendingGradient]:
        """The stored gradient parts, oldest first, including any an owning collection held."""
        if self._hand_over is not None:
            self._hand_over()
        return self._pending

    def _pending_gradient(self) -> PendingGradient | None:
        """The stored gradient summed per unique row (rows ascending)."""
        if not self._parts():
            return None
        if len(self._pending) == 1:
            return self._pending[0]
        rows = torch.cat([p.rows for p in self._pending])
        unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
        grads = rows.new_zeros(unique.numel(), self.config.embedding_dim, dtype=torch.float32)
        grads.index_add_(0, inverse, torch.cat([p.grads for p in self._pending]))
        occ = rows.new_zeros(unique.numel())
        occ.index_add_(0, inverse, torch.cat([p.occurrences for p in self._pending]))
        self._pending = [PendingGradient(unique, grads, occ)]
        return self._pending[0]

    def has_nonfinite_grad(self) -> bool:
        """Whether the stored gradient holds an inf or NaN (the overflow check of docs/contract.md §6)."""
        return any(not bool(torch.isfinite(p.grads).all()) for p in self._parts())

    def pending_grads(self) -> list[torch.Tensor]:
        """The stored FP32 gradient tensors (rows of unique ids), for gradient statistics."""
        return [p.grads for p in self._parts()]

    def unscale_grad_(self, inv_scale: float) -> None:
        """Multiply the stored gradient by ``inv_scale`` (in FP32), e.g. ``1 / loss_scale``."""
        for p in self._parts():
            p.grads.mul_(inv_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the stored gradient (a skipped step)."""
        self._parts().clear()

    def step(self) -> None:
        """Apply the stored gradient (docs/contract.md §4 step 3) and clear it.

        Raises :class:`EmbeddingUpdateError` and changes nothing if the gradient or the
        updated values are not finite (or not storable in the table's format).
        """
        prepared = self._prepare_step()
        if prepared is not None:
            self._commit_step(prepared)

    def _prepare_step(self) -> tuple | None:
        """The optimizer's new values for the stored gradient, computed without changing any
        state; raises :class:`EmbeddingUpdateError` if they cannot be applied."""
        pending = self._pending_gradient()
        if pending is None:
            return None
        rows, grads, occ = pending.rows, pending.grads, pending.occurrences
        cfg = self.config
        bits, qfp16 = self._format_args()
        fresh, fresh_state, slots, bad_row = _ops.update_prepare(
            self.weights,
            self.cache_tags,
            self.cache_rows,
            self.optimizer_state,
            rows,
            grads,
            bits,
            qfp16,
            cfg.rounding == "stochastic",
            cfg.optimizer_code,
            cfg.lr,
            cfg.eps,
            cfg.num_sets,
            cfg.ways,
        )
        self._raise_if_bad(bad_row)
        return rows, fresh, fresh_state, slots, occ

    def _raise_if_bad(self, bad_row: int) -> None:
        if bad_row < 0:
            return
        rows, grads = self._pending[0].rows, self._pending[0].grads
        at = int(torch.searchsorted(rows, bad_row))
        what = (
            "non-finite gradient"
            if not bool(torch.isfinite(grads[at]).all())
            else f"new value that {self.config.stored_precision} cannot store (out of range)"
        )
        raise EmbeddingUpdateError(
            f"table '{self.config.name}': {what} for row {bad_row}; nothing was changed"
        )

    def _commit_args(self) -> tuple:
        """Per-table arguments of the commit op after the state tensors and prepared values."""
        cfg = self.config
        return (
            cfg.bits,
            cfg.qparams_fp16,
            cfg.rounding == "stochastic",
            self._lfu,
            cfg.seed,
            self.step_count + 1,
            cfg.table_id,
            cfg.num_sets,
            cfg.ways,
        )

    def _state_tensors(self) -> tuple:
        """(weights, cache_tags, cache_rows, cache_priority, cache_set_floor, counts,
        optimizer_state): the mutable arguments of the update ops."""
        b = self._buffers  # read directly: nn.Module.__getattr__ is slow on a per-step path
        return (
            b["weights"],
            b["cache_tags"],
            b["cache_rows"],
            b["cache_priority"],
            b["cache_set_floor"],
            b["counts"],
            b["optimizer_state"],
        )

    def _commit_step(self, prepared: tuple) -> None:
        counts = _ops.update_commit(*self._state_tensors(), *prepared, *self._commit_args())
        c = self._counters
        c[_COUNTER["steps"]] += 1
        c[_COUNTER["unique_rows"]] += prepared[0].numel()
        c[_COUNTER["unique_hits"] : _COUNTER["bypasses"] + 1] += counts
        self._finish_step()

    def _bump_cache_version(self) -> None:
        # A plain int: object.__setattr__ skips nn.Module.__setattr__'s checks, which cost
        # microseconds per call on this per-step path.
        object.__setattr__(self, "_cache_version", self._cache_version + 1)

    def _finish_step(self) -> None:
        """After an applied update (counted): the cache may have changed, the gradient is used."""
        self._bump_cache_version()
        self._pending.clear()

    def flush(self) -> int:
        """Round every cached row down into the table and empty the cache.

        Afterwards ``weights`` alone holds every row. Returns the number of rows written.
        """
        cfg = self.config
        bits, qfp16 = self._format_args()
        n = _ops.cache_flush(
            self.weights,
            self.cache_tags,
            self.cache_rows,
            self.cache_priority,
            self.cache_set_floor,
            bits,
            qfp16,
            cfg.rounding == "stochastic",
            cfg.seed,
            self.step_count,
            cfg.table_id,
        )
        self.cache_rows.zero_()
        self._bump_cache_version()
        self._counters[_COUNTER["flushed"]] += n
        return n

    def copy_rows_from(
        self,
        source: CachedLowPrecisionEmbedding,
        start: int,
        *,
        into: int = 0,
        rows: int | None = None,
    ) -> None:
        """Make rows ``[into, into + rows)`` of this table (all of it by default) rows
        ``[start, start + rows)`` of ``source``, as a row-wise shard of it: their stored bytes,
        optimizer state and LFU counts (zero if ``source`` keeps none; a shard too small for
        a cache keeps none), and ``source``'s update count; its other rows are left as they
        are. Both tables must have empty caches (call :meth:`flush` first) and the same row
        format and optimizer. Raises ``ValueError`` naming both tables, having changed
        nothing, otherwise.

        A ``source`` on the meta device has its initial rows (those it would draw if built
        in memory), zero optimizer state and counts. A table on the meta device is given its
        memory here (rows outside the copied range zero): so a shard of a table too large
        for one host is built without the table or a second copy of the shard ever
        existing."""
        mine, theirs = self.config, source.config
        rows = mine.num_embeddings - into if rows is None else rows
        initial = source.weights.is_meta
        why = None
        if rows < 0 or not 0 <= into <= mine.num_embeddings - rows:
            why = f"rows [{into}, {into + rows}) are not all in this table's {mine.num_embeddings}"
        elif not 0 <= start <= theirs.num_embeddings - rows:
            why = f"rows [{start}, {start + rows}) are not all in its {theirs.num_embeddings}"
        elif (mine.row_bytes, mine.bits, mine.embedding_dim, mine.qparams) != (
            theirs.row_bytes,
            theirs.bits,
            theirs.embedding_dim,
            theirs.qparams,
        ):
            why = "its rows are stored in another format"
        elif mine.optimizer_state_width != theirs.optimizer_state_width:
            why = "its optimizer state has another width"
        elif not initial and bool((source.cache_tags >= 0).any()):
            why = "it has cached rows (flush it first)"
        elif not self.weights.is_meta and bool((self.cache_tags >= 0).any()):
            why = "this table has cached rows (flush it first)"
        if why is not None:
            raise ValueError(
                f"table '{mine.name}': cannot copy rows from table '{theirs.name}': {why}"
            )
        if self.weights.is_meta:
            self._allocate_state(None)
            self.weights.zero_()
            self._reset_state()
        width = mine.optimizer_state_width
        stop, end = start + rows, into + rows
        with torch.no_grad():
            if initial:
                self._write_rows(start - into, _initial_blocks(theirs, start, stop))
            else:
                self.weights[into:end] = source.weights[start:stop]
            state = self.optimizer_state[into * width : end * width]
            counts = self.counts[into:end] if self._lfu else None
            if initial:
                state.zero_()
            else:
                state.copy_(source.optimizer_state[start * width : stop * width])
            if counts is not None and source._lfu and not initial:
                counts.copy_(source.counts[start:stop])
            elif counts is not None:
                counts.zero_()
        self._counters[_COUNTER["steps"]] = source.step_count
        self._pending.clear()
        self._bump_cache_version()

    @classmethod
    def from_state(cls, state: Mapping[str, object]) -> CachedLowPrecisionEmbedding:
        """A table rebuilt from a ``state_dict()`` alone (its extra state holds the
        configuration): no rows drawn, only the saved state's memory allocated."""
        extra = state.get(_EXTRA_STATE)
        if not isinstance(extra, dict) or not isinstance(extra.get("config"), dict):
            raise ValueError("the saved state is not a table's (it has no configuration)")
        options = dict(extra["config"])
        rows, dim = options.pop("num_embeddings"), options.pop("embedding_dim")
        table = cls(rows, dim, device="meta", **options)
        table.load_state_dict(state)
        return table

    # ------------------------------------------------------------------ inspection

    def current_weight(self) -> torch.Tensor:
        """The FP32 value of every row as a forward pass sees it (cache over table)."""
        bits, qfp16 = self._format_args()
        out = _ops.dequantize_rows(self.weights, bits, self.config.embedding_dim, qfp16)
        resident = self.cache_tags >= 0
        out[self.cache_tags[resident].long()] = self.cache_rows[resident]
        return out

    def stats(self) -> dict:
        """Counters since construction: per lookup (``lookups``, ``hits``, ``misses``,
        ``hit_rate``: a hit is a training-forward lookup that finds its row cached) and per
        unique updated row (``unique_hits``/``unique_misses``, ``insertions``, ``evictions``,
        ``bypasses``), ``steps`` applied and rows ``flushed``."""
        s = dict(zip(_STAT_NAMES, self._counters.tolist()))
        s["misses"] = s["lookups"] - s["hits"]
        s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        return s

    def memory_bytes(self) -> dict:
        """Bytes of the module's state by component; ``total`` is their sum and equals the
        bytes of all its tensors."""
        cfg = self.config
        rows = cfg.num_embeddings
        return _with_total(
            {
                "table_payload": rows * cfg.payload_bytes,
                "table_qparams": rows * cfg.qparam_bytes,
                "cache_rows": self.cache_rows.nbytes,
                "cache_tags": self.cache_tags.nbytes,
                "cache_priority": self.cache_priority.nbytes,
                "cache_set_floor": self.cache_set_floor.nbytes,
                "lfu_counts": self.counts.nbytes,
                "optimizer_state": self.optimizer_state.nbytes,
            }
        )

    def compression_factor(self) -> float:
        """Bytes of this module over those of the FP32 table with the same optimizer state
        (the paper's Appendix A), from the tensors really allocated."""
        mem = self.memory_bytes()
        fp32 = self.config.num_embeddings * self.config.embedding_dim * 4
        return mem["total"] / (fp32 + mem["optimizer_state"])

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"{c.num_embeddings}, {c.embedding_dim}, precision={c.stored_precision}, "
            f"rounding={c.rounding}, slots={c.num_slots}, ways={c.ways}, policy={c.policy}, "
            f"optimizer={c.optimizer}, lr={c.lr}, name={c.name!r}"
        )

    def get_extra_state(self) -> dict:
        stats = dict(zip(_STAT_NAMES, self._counters.tolist()))
        return {"config": self.config.to_dict(), "step_count": self.step_count, "stats": stats}

    def _check_extra_state(self, state) -> None:
        """Raise ValueError, naming the table, unless ``state`` is this table's extra state as
        :meth:`get_extra_state` makes it, saved with the same configuration."""
        name = self.config.name
        if not isinstance(state, dict) or not {"config", "step_count", "stats"} <= set(state):
            raise ValueError(f"table '{name}': the saved extra state is not a table's")
        saved, mine = state["config"], self.config.to_dict()
        if saved != mine:
            diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
            raise ValueError(
                f"table '{name}': checkpoint was saved with another configuration "
                f"(field: (saved, current)) {diff}"
            )
        if not set(_STAT_NAMES) - {"steps"} <= set(state["stats"]):
            raise ValueError(f"table '{name}': the saved statistics are not a table's")

    def set_extra_state(self, state: dict) -> None:
        self._check_extra_state(state)
        stats = {**state["stats"], "steps": int(state["step_count"])}
        self._counters.copy_(torch.tensor([stats[name] for name in _STAT_NAMES]))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, all or nothing: the whole state is checked first
        (:func:`check_state_dict`), so a refused load changes no buffer and no count."""
        check_state_dict(self, state_dict, strict)
        return super().load_state_dict(state_dict, strict, assign)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # Loaded as part of a larger module: this table at least is checked before any of
        # its buffers is written (check_state_dict on the whole module does more).
        extra = state_dict.get(prefix + _EXTRA_STATE)
        if extra is not None:
            self._check_extra_state(extra)
        if self.weights.is_meta:  # a table built without memory is given it now
            self._allocate_state(None)
        try:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        finally:  # the cache may have been replaced: forget forward slots and set floors
            self._bump_cache_version()
            self.cache_set_floor.fill_(_NO_FLOOR)


_EXTRA_STATE = "_extra_state"  # the key suffix nn.Module gives get_extra_state()'s value


def check_state_dict(module: nn.Module, state_dict, strict: bool = True) -> None:
    """Raise ValueError naming the first entry for which ``module.load_state_dict(state_dict,
    strict)`` would fail or load another configuration: with ``strict`` a missing or
    unexpected key; a tensor of another shape or dtype; a table of ``module`` (itself or a
    submodule) saved with another configuration. Reads only, so that calling it first makes
    a load all or nothing."""
    own = module.state_dict(keep_vars=True)
    if strict:
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if missing or unexpected:
            raise ValueError(
                f"state_dict does not fit the module: missing keys {missing[:5]}, "
                f"unexpected keys {unexpected[:5]}"
            )
    for name, sub in module.named_modules():
        key = f"{name}.{_EXTRA_STATE}" if name else _EXTRA_STATE
        if isinstance(sub, CachedLowPrecisionEmbedding) and key in state_dict:
            sub._check_extra_state(state_dict[key])
    for key, mine in own.items():
        if not isinstance(mine, torch.Tensor) or key not in state_dict:
            continue
        saved = state_dict[key]
        if not isinstance(saved, torch.Tensor):
            raise ValueError(f"state_dict['{key}'] is a {type(saved).__name__}, not a tensor")
        if saved.shape != mine.shape or saved.dtype != mine.dtype:
            raise ValueError(
                f"state_dict['{key}'] is {saved.dtype} {tuple(saved.shape)}, "
                f"expected {mine.dtype} {tuple(mine.shape)}"
            )


# why a table built with device="meta" cannot look up: it holds no rows yet
META_TABLE = (
    "it is on the meta device (no rows in memory): shard it with DistributedModelParallel, "
    "or build it without device='meta'"
)
_HUGE_PAGE = 2 << 20
_INIT_CHUNK_ROWS = 1 << 16
_NO_FLOOR = torch.iinfo(torch.int32).min  # a set floor that every priority beats


def _state_tensor(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor for table or cache state, on transparent huge pages where
    Linux allows it (random rows of a big table otherwise miss the TLB on almost every access,
    each miss adding a page walk). ``EMBCACHE_HUGE_PAGES=0`` turns this off."""
    t = torch.empty(shape, dtype=dtype)
    if t.nbytes >= _HUGE_PAGE and os.environ.get("EMBCACHE_HUGE_PAGES", "1") != "0":
        _ops.advise_huge_pages(t)
    return t


def _initial_blocks(
    config: TableConfig, start: int, stop: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Rows ``[start, stop)`` of the initial FP32 values of a table with ``config``, as
    (first row, rows) blocks: uniform in ``±sqrt(1 / rows)``, the 2^16 rows from
    ``c * 2^16`` on drawn by a generator seeded by (seed, table id, ``c``). So any row range
    is drawn without drawing the rows before it, and a row-wise shard built on its own holds
    the rows the whole table would."""
    rows, dim = config.num_embeddings, config.embedding_dim
    bound = math.sqrt(1.0 / rows)
    for chunk in range(start // _INIT_CHUNK_ROWS, -(-stop // _INIT_CHUNK_ROWS)):
        lo = chunk * _INIT_CHUNK_ROWS
        hi = min(lo + _INIT_CHUNK_ROWS, rows)
        seed = ((config.seed * 1_000_003 + config.table_id) * 1_000_003 + chunk) % (1 << 63)
        gen = torch.Generator().manual_seed(seed)
        block = torch.empty(hi - lo, dim).uniform_(-bound, bound, generator=gen)
        a, b = max(lo, start), min(hi, stop)
        yield a, block[a - lo : b - lo]


def _weight_blocks(weight: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``weight``'s rows as FP32 (first row, rows) blocks of at most 2^16 rows."""
    for start in range(0, weight.shape[0], _INIT_CHUNK_ROWS):
        yield start, weight[start : start + _INIT_CHUNK_ROWS].detach().float().contiguous()


def _with_total(parts: dict) -> dict:
    parts["total"] = sum(parts.values())
    return parts


class _PooledLookup(torch.autograd.Function):
    """Forward through the C++ lookup; backward hands the deduplicated per-row gradient to
    the module (for :meth:`CachedLowPrecisionEmbedding.step`) and returns the gradient of
    the per-sample weights, if they require one."""

    @staticmethod
    def forward(ctx, module, indices, offsets, psw32, anchor, psw_in):
        out, hits = module._lookup(indices, offsets, psw32)
        if module.training:
            module._counters[_COUNTER["hits"]] += hits
        ctx.module = module
        ctx.save_for_backward(indices, offsets, psw32 if psw32 is not None else torch.empty(0))
        ctx.has_psw = psw32 is not None
        ctx.psw_dtype = psw_in.dtype
        return out

    @staticmethod
    def backward(ctx, grad_output):
        indices, offsets, psw = ctx.saved_tensors
        psw = psw if ctx.has_psw else None
        module = ctx.module
        grad_output = grad_output.float().contiguous()
        if ctx.needs_input_grad[4]:
            module._store_gradient(indices, offsets, psw, grad_output)
        grad_psw = None
        if ctx.has_psw and ctx.needs_input_grad[5]:
            # d out[b] / d w_l = value of lookup l: fetch each lookup as its own bag.
            single = torch.arange(indices.numel() + 1, dtype=torch.int64, device=indices.device)
            values, _ = module._lookup(indices, single, None)
            bag = torch.repeat_interleave(
                torch.arange(offsets.numel() - 1, device=offsets.device), offsets[1:] - offsets[:-1]
            )
            grad_psw = (grad_output[bag] * values).sum(dim=1).to(ctx.psw_dtype)
        return None, None, None, None, None, grad_psw
