"""A low-precision embedding-bag table behind an FP32 set-associative cache (docs/contract.md §2-4)."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import math
import operator
import os
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from embcache import _C  # noqa: F401  (registers torch.ops.embcache)
from embcache.config import (
    ADDED_FIELDS,
    COUNTERS,
    DEVICE_COUNTS,
    STATE_TENSORS,
    WHERE_FIELDS,
    TableConfig,
)
from embcache.group import TableGroup
from embcache.memory import compression_factor, memory_breakdown
from embcache.telemetry import PROBE_COUNTERS, TouchedSample, rounding_figures

_ops = torch.ops.embcache
_STEPS = COUNTERS.index("steps")
_state_of = operator.itemgetter(*STATE_TENSORS)


class CachedLowPrecisionEmbedding(nn.Module):
    r"""An ``nn.EmbeddingBag`` whose rows are stored in FP16/INT8/INT4/INT2 and trained there,
    with the hottest rows kept in a small FP32 cache (LRU or LFU, direct-mapped or N-way).

    Usage is ``nn.EmbeddingBag``'s (its constructor's arguments, in its order, and its forward's
    conventions), except that the update is applied by :meth:`step` (a fused sparse optimizer)
    rather than by a ``torch.optim`` optimizer; the remaining differences are listed in
    docs/contract.md §8::

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
    * With ``placement="host"`` (docs/design.md, "Host placement") the storage tensors
      (``weights``, and AdaGrad's per-element ``optimizer_state``:
      :attr:`~embcache.config.TableConfig.storage_tensors`) are allocated in pinned host
      memory and stay there when the module moves to a GPU, whose kernels read and write them
      in place; the cache tensors (with the LFU counts and row-wise accumulators) move. Such a table needs
      CUDA: where torch has none it is refused when built.

    The kernels see a table through ``spec`` (its configuration packed once,
    :meth:`TableConfig.spec`), ``counters`` (int64 CPU, the statistics in the order of
    :data:`embcache.config.COUNTERS`, which the ops add to), :meth:`device_counts` and
    :meth:`state_tensors`. Its ops
    run through ``group`` (:class:`embcache.group.TableGroup`): its own group of one, or that
    of the collection it belongs to, which holds its pending gradient.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        weight: torch.Tensor | None = None,
        **options,
    ) -> None:
        """``nn.EmbeddingBag``'s arguments, positional in its order, then this package's own,
        keyword-only: ``weight`` (the initial rows, as ``_weight``) and the fields of
        :class:`~embcache.config.TableConfig` (``precision``, ``cache_ratio``, ``lr``, ...).
        Its options that this table cannot honour are refused by name unless left at their
        defaults: ``max_norm``, ``scale_grad_by_freq=True`` and a ``dtype`` other than FP32.
        ``norm_type`` (read only with ``max_norm``) and ``sparse`` are accepted whatever
        their value: the gradient is always sparse, deduplicated per row, and applied by
        :meth:`step`. Without initial rows, the ``padding_idx`` row starts at zero, as
        ``nn.EmbeddingBag``'s."""
        super().__init__()
        name = options.get("name", TableConfig.name)
        check_torch_options(
            name, max_norm=max_norm, scale_grad_by_freq=scale_grad_by_freq, dtype=dtype
        )
        if _weight is not None and weight is not None:
            raise ValueError(
                f"table '{name}': give the initial rows as weight or _weight, not both"
            )
        weight = _weight if weight is None else weight
        self.include_last_offset = include_last_offset
        self.config = TableConfig.of(num_embeddings, embedding_dim, mode=mode, **options)
        cfg = self.config
        check_placement(cfg)
        self.spec = cfg.spec()
        self.norm_type, self.sparse = norm_type, sparse
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"table '{cfg.name}': padding_idx={padding_idx} is out of range "
                    f"[{-num_embeddings}, {num_embeddings})"
                )
            padding_idx %= num_embeddings
        # as nn.EmbeddingBag: entries equal to it are left out of every bag (not counted by
        # mean) and its row is never updated
        self.padding_idx = padding_idx
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
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64)  # CPU, wherever the table is
        self._device_counts = torch.zeros(len(DEVICE_COUNTS), dtype=torch.int64)
        self.touched = TouchedSample(num_embeddings, (cfg.seed * 1_000_003 + cfg.table_id) % 2**63)
        self.group = TableGroup([self])
        if device.type not in ("cpu", "meta"):
            self.to(device)

    # nn.EmbeddingBag's attributes, for code that reads them: read-only, since setting one
    # would not change what the table does (norm_type and sparse change nothing anyway)

    @property
    def max_norm(self) -> None:
        return None

    @property
    def scale_grad_by_freq(self) -> bool:
        return False

    @property
    def num_embeddings(self) -> int:
        return self.config.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.config.embedding_dim

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def device(self) -> torch.device:
        """The device the table's lookups and updates run on: that of its cache, where its
        storage is too unless ``placement="host"`` keeps that in pinned host memory."""
        return self._buffers["cache_tags"].device

    # ------------------------------------------------------------------ construction helpers

    @property
    def step_count(self) -> int:
        """The number of updates applied so far."""
        return int(self.counters[_STEPS])

    def device_counts(self) -> torch.Tensor:
        """The counts that ``counters`` does not hold yet (int64, in the order of
        :data:`embcache.config.DEVICE_COUNTS`), on the device of the table's state: the
        training forward and the update add to them there, so that on a GPU they read nothing
        back, and :meth:`fold_counts` moves them into ``counters``. Made anew (after a fold)
        where the state has moved to another device."""
        where = self._buffers["cache_tags"].device  # not nn.Module.__getattr__: a per-step path
        if self._device_counts.device != where:
            self.fold_counts()
            self._device_counts = torch.zeros(len(DEVICE_COUNTS), dtype=torch.int64, device=where)
        return self._device_counts

    def fold_counts(self) -> None:
        """Moves the device counts into ``counters`` (from a GPU: one read-back)."""
        if self._device_counts.device.type != "meta":
            _ops.fold_device_counts([self.counters], [self._device_counts])

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """The state tensors in the order the ops take them (:data:`embcache.config.STATE_TENSORS`)."""
        # from the buffers directly: nn.Module.__getattr__ is slow on a per-step path
        return _state_of(self._buffers)

    def _allocate_state(self, device: torch.device | None) -> None:
        """Register every state tensor, uninitialised: on the meta device, or (None) in host
        memory, on huge pages, but for the storage tensors of a host-placed table, which are
        pinned (so that a GPU can read and write them in place once the table is moved)."""
        cfg = self.config
        pinned = device is None and cfg.placement == "host"

        def state(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
            if device is not None:
                return torch.empty(shape, dtype=dtype, device=device)
            if pinned and name in cfg.storage_tensors:
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            return _state_tensor(shape, dtype)

        slots = cfg.num_slots
        width = cfg.optimizer_state_width
        shapes = {
            "weights": ((cfg.num_embeddings, cfg.row_bytes), torch.uint8),
            "cache_tags": ((slots,), torch.int32),
            "cache_rows": ((slots, cfg.embedding_dim), torch.float32),
            "cache_priority": ((slots,), torch.int32),
            "cache_set_floor": ((cfg.num_sets,), torch.int32),
            "counts": ((cfg.num_embeddings if cfg.keeps_counts else 0,), cfg.counts_dtype),
            "optimizer_state": ((cfg.num_embeddings * width,), torch.float32),
        }
        for name in STATE_TENSORS:  # the set floors are a speed hint, not saved
            shape, dtype = shapes[name]
            self.register_buffer(
                name, state(name, shape, dtype), persistent=name != "cache_set_floor"
            )

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``to``, ``cuda``, ``cpu``, ...), but a host-placed table
        whose cache goes to a GPU keeps its storage tensors in pinned host memory (pinning them
        if a copy is not: :func:`_host_storage`) rather than copying them to the GPU. Moved
        anywhere else (the CPU, the meta device) its storage goes with its cache."""
        if self.config.placement != "host":
            return super()._apply(fn, recurse)
        buffers = self._buffers
        storage = {k: buffers[k] for k in self.config.storage_tensors}
        for k in storage:  # nn.Module._apply passes None buffers by, keeping their order
            buffers[k] = None
        try:
            super()._apply(fn, recurse)
        except BaseException:
            buffers.update(storage)
            raise
        on_gpu = buffers["cache_tags"].device.type == "cuda"
        for k, t in storage.items():
            buffers[k] = _host_storage(t) if on_gpu else fn(t)
        return self

    def __setstate__(self, state) -> None:
        # a copy (copy.deepcopy, pickle) of a host-placed table on a GPU: its storage tensors
        # come back in ordinary host memory, which a GPU cannot read; pin them again
        super().__setstate__(state)
        buffers = self.__dict__.get("_buffers", {})
        tags = buffers.get("cache_tags")
        if self.config.placement == "host" and tags is not None and tags.device.type == "cuda":
            for k in self.config.storage_tensors:
                buffers[k] = _host_storage(buffers[k])

    def _reset_state(self) -> None:
        """Empty the cache; zero the LFU counts and the optimizer state."""
        with torch.no_grad():
            self.cache_tags.fill_(-1)
            self.cache_rows.zero_()
            self.cache_priority.zero_()
            self.cache_set_floor.fill_(_NO_FLOOR)
            self.counts.zero_()
            self.optimizer_state.zero_()

    def _write_rows(
        self, first: int, blocks: Iterator[tuple[int, Callable[[], torch.Tensor]]] | None
    ) -> None:
        """Store FP32 rows, rounded to nearest: each block (source row ``r``, a function that
        makes its rows) goes to this table's rows from ``r - first`` on; ``blocks=None``
        stores this table's initial rows (:func:`_initial_blocks`). Blocks are at most 2^16
        rows, made on several threads a few blocks ahead (:func:`_made_ahead`: drawing random
        rows is one thread's work per block), so no FP32 copy of the table exists at once."""
        cfg = self.config
        if blocks is None:
            blocks = _initial_blocks(cfg, 0, cfg.num_embeddings, self.padding_idx)
        for start, block in _made_ahead(blocks):
            at = start - first
            ids = torch.arange(at, at + block.shape[0], dtype=torch.int64)
            try:  # no step: rounded to nearest
                self.weights[at : at + block.shape[0]] = _ops.quantize_rows(block, ids, self.spec)
            except RuntimeError as e:
                raise ValueError(f"table '{cfg.name}': initial weight: {e}") from None

    # ------------------------------------------------------------------ input checking

    def _bags(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None,
        per_sample_weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(indices int64 [L], offsets int64 [B+1], weights float32 [L] or None), their types
        and shapes checked as ``F.embedding_bag`` checks them. With ``include_last_offset``
        ids past the last offset are in no bag, and are left out. Their values (which reading
        would cost a device sync per check) are checked by the C++ forward;
        :meth:`_check_values` names what it refused."""
        name = self.config.name

        def bad(msg: str) -> ValueError:
            return ValueError(f"table '{name}': {msg}")

        if self.weights.is_meta:
            raise bad(META_TABLE)
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int64, torch.int32):
            raise bad(
                f"input must be an int64 or int32 tensor, got {getattr(input, 'dtype', type(input))}"
            )
        psw = per_sample_weights
        if psw is not None:
            if not isinstance(psw, torch.Tensor) or psw.shape != input.shape:
                got = tuple(psw.shape) if isinstance(psw, torch.Tensor) else type(psw).__name__
                raise bad(
                    f"per_sample_weights must have the input's shape {tuple(input.shape)}, "
                    f"got {got}"
                )
            if self.config.mode != "sum":
                raise bad(
                    f"per_sample_weights are only supported with mode='sum' "
                    f"(got mode={self.config.mode!r})"
                )
            if psw.dtype != torch.float32:
                raise bad(
                    "per_sample_weights must have the dtype of the table's values, "
                    f"torch.float32, got {psw.dtype}"
                )
            psw = psw.reshape(-1)
        if input.dim() == 2:
            if offsets is not None:
                raise bad("offsets must be None when input is 2-D (fixed-length bags)")
            bags, length = input.shape
            offsets = torch.arange(bags + 1, device=input.device) * length
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
                end = input.numel() if offsets.numel() else 0  # no offsets: no bags
                offsets = torch.cat([offsets, offsets.new_full((1,), end)])  # (no copy: no wait)
            elif offsets.numel() == 0:
                raise bad("with include_last_offset, offsets must hold at least one offset")
            else:
                end = int(offsets[-1])
            if 0 <= end < input.numel():  # ids past the last offset are in no bag
                input = input[:end]
                psw = None if psw is None else psw[:end]
        else:
            raise bad(f"input must be 1-D or 2-D, got {input.dim()}-D")
        indices = input.long().contiguous()
        if self.padding_idx is not None and bool((indices == self.padding_idx).any()):
            self._check_values(indices, offsets)
            keep = indices != self.padding_idx
            bag_of = torch.repeat_interleave(
                torch.arange(offsets.numel() - 1, device=indices.device), offsets.diff()
            )
            kept = torch.bincount(bag_of[keep], minlength=offsets.numel() - 1)
            offsets = torch.cat([offsets[:1], kept.cumsum(0)])
            indices = indices[keep]
            psw = None if psw is None else psw[keep]
        return indices, offsets.contiguous(), psw

    # ------------------------------------------------------------------ forward / backward

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
        psw32 = None if psw is None else psw.detach().contiguous()
        try:
            return self.group.lookup(
                indices,
                offs[1:] - offs[:-1],
                psw32,
                [self.group.position(self)],
                offs.numel() - 1,
                self.training,
                psw,
                check=lambda: self._check_values(indices, offs),
            )
        except RuntimeError:
            self._check_values(indices, offs)  # raises the error that names the table
            raise

    def prefetch(self, input: torch.Tensor, offsets: torch.Tensor | None = None) -> None:
        """Starts bringing the stored rows that a coming :meth:`forward` of ``input`` (and
        ``offsets``) will miss into GPU memory, on a side stream, while the current batch
        trains, for a host-placed table; call it after the current forward, before its
        update (:meth:`CachedLowPrecisionEmbeddingBags.prefetch` says more). Changes no
        value; a table in device memory, or on the CPU, does nothing."""
        if not self.group.staged_positions(self.device):
            return
        indices, offs, _ = self._bags(input, offsets, None)
        lengths = offs[1:] - offs[:-1]
        position = [self.group.position(self)]
        self.group.prefetch(indices, lengths, position, offs.numel() - 1, self.training)

    def _check_values(self, indices: torch.Tensor, offsets: torch.Tensor) -> None:
        """Every index in range, offsets from 0 up to len(indices) without decreasing: else
        a ValueError naming the table. (Run when the C++ forward has refused them, and
        before padding ids are taken out of their bags.)"""

        def bad(msg: str) -> ValueError:
            return ValueError(f"table '{self.config.name}': {msg}")

        rows = self.config.num_embeddings
        out = (indices < 0) | (indices >= rows)
        if bool(out.any()):
            raise bad(f"index {int(indices[out][0])} is out of range [0, {rows})")
        n = indices.numel()
        if int(offsets[0]) != 0:
            raise bad(f"offsets must start at 0, got {int(offsets[0])}")
        if int(offsets[-1]) != n:
            raise bad(f"the last offset must be in [0, len(input)={n}], got {int(offsets[-1])}")
        steps = offsets.diff()
        if bool((steps < 0).any()):
            at = int(torch.nonzero(steps < 0)[0])
            raise bad(
                f"offsets decrease at bag {at} ({int(offsets[at])} > {int(offsets[at + 1])}) "
                f"or exceed len(input)={n}"
            )

    # ------------------------------------------------------------------ the update

    def has_nonfinite_grad(self) -> bool:
        """Whether the stored gradient holds an inf or NaN (the overflow check of docs/contract.md §6)."""
        return self.group.has_nonfinite_grad(self)

    def pending_grads(self) -> list[torch.Tensor]:
        """The stored FP32 gradient tensors (rows of unique ids), for gradient statistics."""
        return self.group.pending_grads(self)

    def unscale_grad_(self, inv_scale: float) -> None:
        """Multiply the stored gradient by ``inv_scale`` (in FP32), e.g. ``1 / loss_scale``."""
        self.group.unscale_grad_(inv_scale, self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the stored gradient (a skipped step)."""
        self.group.zero_grad(self)

    def step(self) -> None:
        """Apply the stored gradient (docs/contract.md §4 step 3) and clear it.

        Raises :class:`EmbeddingUpdateError` and changes nothing if the gradient or the
        updated values are not finite (or not storable in the table's format).
        """
        self.group.update(True, self)

    def check_step(self) -> None:
        """A dry run of :meth:`step`: raises the error it would raise, changes nothing (the
        gradient stays pending)."""
        self.group.update(False, self)

    def flush(self) -> int:
        """Round every cached row down into the table and empty the cache.

        Afterwards ``weights`` alone holds every row. Returns the number of rows written.
        """
        return self.group.flush(self)[0]

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
                self._write_rows(
                    start - into, _initial_blocks(theirs, start, stop, source.padding_idx)
                )
            else:
                self.weights[into:end] = source.weights[start:stop]
            state = self.optimizer_state[into * width : end * width]
            counts = self.counts[into:end] if mine.keeps_counts else None
            if initial:
                state.zero_()
            else:
                state.copy_(source.optimizer_state[start * width : stop * width])
            if counts is not None and theirs.keeps_counts and not initial:  # saturating
                counts.copy_(source.counts[start:stop].clamp(max=torch.iinfo(counts.dtype).max))
            elif counts is not None:
                counts.zero_()
        self.counters[_STEPS] = source.step_count
        self.group.zero_grad(self)
        self.group.cache_changed()

    @classmethod
    def from_state(
        cls, state: Mapping[str, object], *, placement: str = "device"
    ) -> CachedLowPrecisionEmbedding:
        """A table rebuilt from a ``state_dict()`` alone (its extra state holds the
        configuration): no rows drawn, only the saved state's memory allocated, in host
        memory. ``placement`` is the new table's, whatever the saved one's: as a device, a
        placement is chosen where a table is built, not restored."""
        extra = state.get(_EXTRA_STATE)
        if not isinstance(extra, dict) or not isinstance(extra.get("config"), dict):
            raise ValueError("the saved state is not a table's (it has no configuration)")
        options = {**ADDED_FIELDS, **extra["config"], "placement": placement}
        rows, dim = options.pop("num_embeddings"), options.pop("embedding_dim")
        table = cls(rows, dim, device="meta", **options)
        table.load_state_dict(state)
        return table

    @classmethod
    def from_pretrained(cls, weight: torch.Tensor, **options) -> CachedLowPrecisionEmbedding:
        """A table of ``weight``'s rows (``[rows, dim]``, as ``nn.EmbeddingBag.from_pretrained``
        takes), each stored by the table's rule: rounded into its format (``options``: any of
        the constructor's) unless the table is FP32 or small enough to stay FP32."""
        if weight.dim() != 2:
            raise ValueError(
                f"from_pretrained: weight must be [rows, dim], got {tuple(weight.shape)}"
            )
        return cls(weight.shape[0], weight.shape[1], weight=weight, **options)

    # ------------------------------------------------------------------ inspection

    @property
    def weight(self) -> torch.Tensor:
        """Every row's current FP32 value, ``[rows, dim]`` (a copy: read-only, as
        :meth:`current_weight`), for code written against ``nn.EmbeddingBag.weight``."""
        return self.current_weight()

    def current_weight(self) -> torch.Tensor:
        """The FP32 value of every row as a forward pass sees it (cache over table)."""
        # (from a host-placed table's storage, dequantized on the CPU: brought to its device)
        out = _ops.dequantize_rows(self.weights, self.spec).to(self.device)
        resident = self.cache_tags >= 0
        out[self.cache_tags[resident].long()] = self.cache_rows[resident]
        return out

    def stats(self) -> dict:
        """Counters since construction: per lookup (``lookups``, ``hits``, ``misses``,
        ``hit_rate``: a hit is a training-forward lookup that finds its row cached) and per
        unique updated row (``unique_hits``/``unique_misses``, ``insertions``, ``evictions``,
        ``bypasses``), ``steps`` applied and rows ``flushed``; the precision telemetry
        (:mod:`embcache.telemetry`): the probes' counters ``probed_*``, their
        :func:`~embcache.telemetry.rounding_figures`, and ``untouched_share``, the estimated
        share of rows never updated."""
        self.fold_counts()
        s = dict(zip(COUNTERS, self.counters.tolist()))
        s["misses"] = s["lookups"] - s["hits"]
        s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        s.update(rounding_figures(s))
        s["untouched_share"] = self.touched.untouched_share()
        return s

    def memory_bytes(self) -> dict:
        """Bytes of the module's state by component (:func:`embcache.memory_breakdown`);
        ``total`` is their sum and equals the bytes of all its tensors, ``device`` and
        ``host`` split it by where it lives (``host``: a host-placed table's storage)."""
        return memory_breakdown(self.config)

    def compression_factor(self) -> float:
        """Bytes of this module over those of the FP32 table with the same optimizer state
        (the paper's Appendix A)."""
        return compression_factor(self.config)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"{c.num_embeddings}, {c.embedding_dim}, precision={c.stored_precision}, "
            f"rounding={c.rounding}, slots={c.num_slots}, ways={c.ways}, policy={c.policy}, "
            f"optimizer={c.optimizer}, lr={c.lr}, name={c.name!r}"
            + (f", placement={c.placement}" if c.placement != "device" else "")
        )

    def get_extra_state(self) -> dict:
        self.fold_counts()
        stats = dict(zip(COUNTERS, self.counters.tolist()))
        return {
            "config": self.config.to_dict(),
            "step_count": self.step_count,
            "stats": stats,
            "touched": self.touched.state(),
        }

    def _check_extra_state(self, state) -> None:
        """Raise ValueError, naming the table, unless ``state`` is this table's extra state as
        :meth:`get_extra_state` makes it, saved with the same configuration."""
        name = self.config.name
        if not isinstance(state, dict) or not {"config", "step_count", "stats"} <= set(state):
            raise ValueError(f"table '{name}': the saved extra state is not a table's")
        # where the saved table lived (its placement) is not its identity: a checkpoint loads
        # across placements
        saved = {
            k: v for k, v in {**ADDED_FIELDS, **state["config"]}.items() if k not in WHERE_FIELDS
        }
        mine = self.config.identity()
        if saved != mine:
            diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
            raise ValueError(
                f"table '{name}': checkpoint was saved with another configuration "
                f"(field: (saved, current)) {diff}"
            )
        # checkpoints from before the precision telemetry have no probe counters
        if not set(COUNTERS) - {"steps", *PROBE_COUNTERS} <= set(state["stats"]):
            raise ValueError(f"table '{name}': the saved statistics are not a table's")
        touched = state.get("touched", [])
        n = self.touched.touched.numel()
        if not (
            isinstance(touched, list)
            and all(isinstance(i, int) and 0 <= i < n for i in touched)
            and touched == sorted(set(touched))
        ):
            raise ValueError(f"table '{name}': the saved touched rows are not a table's")

    def set_extra_state(self, state: dict) -> None:
        self._check_extra_state(state)
        stats = {**dict.fromkeys(PROBE_COUNTERS, 0), **state["stats"]}
        stats["steps"] = int(state["step_count"])
        self.counters.copy_(torch.tensor([stats[name] for name in COUNTERS]))
        self._device_counts.zero_()  # the counts of steps before the load are not its own
        self.touched.load(state.get("touched", []))

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
            self.group.cache_changed()
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


# nn.EmbeddingBag's and nn.Embedding's options that a table honours at these values only, and why
_TORCH_OPTIONS = {
    "max_norm": (
        (None,),
        "nn.EmbeddingBag renormalises the rows it looks up in place, in the forward; this "
        "table's rows change only in step()",
    ),
    "scale_grad_by_freq": ((False,), "the gradient is not scaled by the ids' frequencies"),
    "dtype": ((None, torch.float32), "lookups are FP32; precision= sets how rows are stored"),
    "_freeze": ((False,), "the rows change only in step(): not calling it freezes them"),
}


def check_torch_options(table: str, **options) -> None:
    """Raise ValueError naming table ``table``, the option, its value and why, for the first
    of ``options`` (any of ``max_norm``, ``scale_grad_by_freq``, ``dtype``, ``_freeze``) that
    is set to a value the table cannot honour."""
    for option, value in options.items():
        honoured, why = _TORCH_OPTIONS[option]
        if value not in honoured:
            raise ValueError(f"table '{table}': {option}={value!r} is not supported: {why}")


def check_placement(config: TableConfig) -> None:
    """``ValueError`` naming the table if its placement cannot be honoured here: a host-placed
    table keeps its storage in pinned host memory for a CUDA GPU to read, which needs torch
    with CUDA and a GPU."""
    if config.placement == "host" and not torch.cuda.is_available():
        raise ValueError(
            f"table '{config.name}': placement='host' keeps its rows in pinned host memory for "
            f"a CUDA GPU to read in place, and torch {torch.__version__} sees no CUDA GPU here "
            "(use placement='device')"
        )


def _host_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a host-placed table's storage tensor) in pinned host memory: itself if it is
    there already (or has no elements, hence no memory to pin), else a pinned copy."""
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.numel() == 0 or t.is_pinned() else t.pin_memory()


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
    config: TableConfig, start: int, stop: int, padding_idx: int | None = None
) -> Iterator[tuple[int, Callable[[], torch.Tensor]]]:
    """Rows ``[start, stop)`` of the initial FP32 values of a table with ``config``, as
    (first row, a function that draws the rows) blocks: uniform in ``±sqrt(1 / rows)``, the
    2^16 rows from ``c * 2^16`` on drawn by a generator seeded by (seed, table id, ``c``), and
    row ``padding_idx`` zero (as nn.EmbeddingBag's; every format stores zero exactly). So any
    row range is drawn without drawing the rows before it, a row-wise shard built on its own
    holds the rows the whole table would, and blocks may be drawn in any order, on any
    thread."""
    rows, dim = config.num_embeddings, config.embedding_dim
    bound = math.sqrt(1.0 / rows)

    def draw(chunk: int, a: int, b: int) -> torch.Tensor:
        lo = chunk * _INIT_CHUNK_ROWS
        hi = min(lo + _INIT_CHUNK_ROWS, rows)
        seed = ((config.seed * 1_000_003 + config.table_id) * 1_000_003 + chunk) % (1 << 63)
        gen = torch.Generator().manual_seed(seed)
        block = torch.empty(hi - lo, dim).uniform_(-bound, bound, generator=gen)
        if padding_idx is not None and lo <= padding_idx < hi:
            block[padding_idx - lo] = 0.0
        return block[a - lo : b - lo]

    for chunk in range(start // _INIT_CHUNK_ROWS, -(-stop // _INIT_CHUNK_ROWS)):
        lo = chunk * _INIT_CHUNK_ROWS
        a, b = max(lo, start), min(lo + _INIT_CHUNK_ROWS, rows, stop)
        yield a, functools.partial(draw, chunk, a, b)


def _weight_blocks(weight: torch.Tensor) -> Iterator[tuple[int, Callable[[], torch.Tensor]]]:
    """``weight``'s rows as FP32 (first row, a function that makes the rows) blocks of at
    most 2^16 rows."""

    def fp32(start: int) -> torch.Tensor:
        return weight[start : start + _INIT_CHUNK_ROWS].detach().float().contiguous()

    for start in range(0, weight.shape[0], _INIT_CHUNK_ROWS):
        yield start, functools.partial(fp32, start)


def _made_ahead(
    blocks: Iterator[tuple[int, Callable[[], torch.Tensor]]],
) -> Iterator[tuple[int, torch.Tensor]]:
    """``blocks``' (first row, rows), in order, each made by its function on one of
    ``torch.get_num_threads()`` threads, at most twice as many blocks ahead of the one
    returned (torch's ops release the GIL)."""
    workers = max(1, torch.get_num_threads())
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        ahead: collections.deque = collections.deque()
        for start, make in blocks:
            ahead.append((start, pool.submit(make)))
            if len(ahead) >= 2 * workers:
                first, made = ahead.popleft()
                yield first, made.result()
        while ahead:
            first, made = ahead.popleft()
            yield first, made.result()
