"""The table-batched driver of cached tables (docs/design.md, "The step path"): one C++ call
per phase (forward, backward, update, flush) for all the tables of a group, and the gradient
they hold between a backward and the update that applies it.

Every :class:`~embcache.CachedLowPrecisionEmbedding` belongs to exactly one
:class:`TableGroup`: a table made on its own is a group of one; a
:class:`~embcache.CachedLowPrecisionEmbeddingBagCollection` makes one group of all its
tables, which then holds their gradients. A table's own methods (``step``, ``zero_grad``,
``pending_grads``, ...) act on its part of its group's gradient, so one table and a collection
of them run the same ops and the same code.

The group reads its tables through their public door: ``spec`` (their packed configuration),
``counters`` (their statistics, which the ops add to), ``device_counts()``, ``state_tensors()``
and ``config``.

A table holds its group and the group refers to its tables weakly, so that no reference cycle
keeps a dropped table's memory (gigabytes, for the tables this is for) until Python's cycle
collector happens to run: ``del table`` frees it at once.
"""

from __future__ import annotations

import collections
import copy
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from embcache import _C  # noqa: F401  (registers torch.ops.embcache)

_ops = torch.ops.embcache
_NO_HINT = torch.empty(0, dtype=torch.int64)
# The forwards whose input errors a group may leave unread before it waits for the oldest.
MAX_UNCHECKED_FORWARDS = 64
# as csrc/cuda/cache_api.h: ErrorBits, the first that is set named
_ERROR_BITS = (
    (2, "offsets must start at 0, not decrease and end at len(indices)"),
    (1, "an index is out of range"),
    (4, "unique rows must be ascending and in range"),
    (8, "row ranges must be ascending, disjoint and within the arrays"),
)


class EmbeddingUpdateError(ValueError):
    """A training step the tables refused; the tables, caches and optimizer state are unchanged."""


class PendingGradient(NamedTuple):
    """One table's stored gradient: unique rows (ascending), their summed gradients
    ``[rows, dim]`` and how often each occurs."""

    rows: torch.Tensor
    grads: torch.Tensor
    occurrences: torch.Tensor


class InputCheck(NamedTuple):
    """A forward's input, to be checked once its kernels have run: ``errors`` (int64 [1] on
    the device, the kernels' error bits), ``host`` (their copy in host memory, or ``errors``
    itself on the CPU), ``done`` (a CUDA event after the copy, or None) and ``check`` (raises
    the ValueError that names the table and the value, or does nothing)."""

    errors: torch.Tensor
    host: torch.Tensor
    done: object
    check: Callable[[], None]

    @classmethod
    def of(cls, errors: torch.Tensor, check: Callable[[], None] | None, copy: bool) -> InputCheck:
        """The check of a forward's error bits; with ``copy``, on a GPU, their copy to host
        memory started (no wait), for a forward whose bits no update will read."""
        check = check or (lambda: None)
        if not copy or errors.device.type != "cuda":
            return cls(errors, errors, None, check)
        host = torch.empty(errors.shape, dtype=errors.dtype, pin_memory=True)
        host.copy_(errors, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(errors, host, done, check)

    def raise_if_bad(self, bits: int | None = None) -> None:
        """Raises the forward's input error (its check's ValueError, else a RuntimeError with
        the first error bit), if the kernels found one; waits for them if they have not
        run. ``bits``: the error bits if already read."""
        if bits is None:
            if self.done is not None:
                self.done.synchronize()
            bits = int(self.host[0])
        if bits:
            self.check()
            raise RuntimeError(f"embcache (cuda): {_error_text(bits)}")


def _error_text(bits: int) -> str:
    return next(text for bit, text in _ERROR_BITS if bits & bit)


class Stage(NamedTuple):
    """Copies of the stored rows a coming forward's lookups miss (``stage_misses``; docs/
    design.md, "Prefetch"): ``slots`` (its hash table of keys and copies) and ``rows`` (the
    copies, room for one a lookup) on the tables' device, ``training`` the mode of the
    forward it was made for, ``done`` the CUDA event its staging recorded on the side stream
    (None where it ran on the caller's stream)."""

    slots: torch.Tensor
    rows: torch.Tensor
    training: bool
    done: object

    @property
    def lookups(self) -> int:
        """The lookups of the forward it was made for."""
        return self.rows.shape[0]

    def wait(self) -> None:
        """Orders the current stream's later work after the staging (no host wait)."""
        if self.done is not None:
            torch.cuda.current_stream(self.slots.device).wait_event(self.done)


# the side stream of each CUDA device that stages on it (TableGroup.prefetch)
_STAGING_STREAMS: dict[int, torch.cuda.Stream] = {}


def _staging_stream(device: torch.device):
    """The side stream staging runs on, on a CUDA device (made at its first use); None
    elsewhere (staging then runs in order with everything else)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STAGING_STREAMS:
        _STAGING_STREAMS[index] = torch.cuda.Stream(index)
    return _STAGING_STREAMS[index]


class _Backward(NamedTuple):
    """One backward's gradient for every feature as multi_dedup_backward made it: feature f's
    unique rows are ``rows[ranges[f, 0]:ranges[f, 1]]`` (int64 [features, 3] on the rows'
    device: on a GPU the arrays are sized for the most rows there can be, and only the ranges
    say how many there are), with their occurrences and
    (unless ``slots`` is empty) the cache slots the forward found at the same positions, and
    their gradients a block of rows x dim values of the 1-D ``grads`` from ``ranges[f, 2]``,
    blocks in feature order (zero past the last).
    Also what the forward saw: each feature's table (its position in the group), the group's
    cache epoch, each feature's largest |value| read, and the :class:`Stage` it read misses
    from (or None), which holds the same rows at the update while the epoch is unchanged."""

    feature_tables: list[int]
    rows: torch.Tensor
    grads: torch.Tensor
    occurrences: torch.Tensor
    slots: torch.Tensor
    ranges: torch.Tensor
    epoch: int
    bounds: list[float]
    stage: Stage | None


class TableGroup:
    """Tables driven together, and their pending gradient.

    The gradient of the latest backward is kept whole, as the C++ backward made it (handing
    26 tables their parts costs Python time every step); older ones, and any a table's own
    method asked for, are kept per table. Slot hints and value bounds from the forward go to
    the update only when it applies one backward of every table and no cache has changed
    since its forward (the cache epoch: bumped by every commit, flush and
    :meth:`cache_changed`)."""

    def __init__(self, tables: Sequence) -> None:
        self._table_refs = [weakref.ref(t) for t in tables]
        self.specs = torch.stack([t.spec for t in self.tables])
        self._counters = [t.counters for t in self.tables]
        self._dims = [t.config.embedding_dim for t in self.tables]
        self._every = list(range(len(self.tables)))
        self._anchor = torch.empty(0, requires_grad=True)  # makes the outputs require grad
        self._backward: _Backward | None = None
        self._parts: list[list[PendingGradient]] = [[] for _ in self.tables]
        self._epoch = 0
        self._touch: tuple[torch.Tensor, torch.Tensor] | None = None  # _touch_index
        # forwards whose input the device has not confirmed yet: those of the pending
        # gradient (which its update's gate includes), and recent ones (checked as they finish)
        self._inputs: list[InputCheck] = []
        self._unchecked: collections.deque[InputCheck] = collections.deque()
        self._stage: Stage | None = None  # prefetch's, for the next forward of its lookups
        self._parts_stage: tuple[Stage, int] | None = None  # _hand_over's
        for t in self.tables:
            t.group = self

    @property
    def tables(self) -> list:
        """The group's tables, in order (each held by its owner: a module, a collection)."""
        tables = [ref() for ref in self._table_refs]
        if any(t is None for t in tables):
            raise RuntimeError("a table of this group has been deleted")
        return tables

    def __getstate__(self) -> dict:  # pickling: the tables themselves, not references
        state = self.__dict__.copy()
        state["_table_refs"] = self.tables
        state["_touch"] = None  # rebuilt from the tables' samples
        state["_inputs"], state["_unchecked"] = [], collections.deque()  # (events do not pickle)
        state["_stage"] = state["_parts_stage"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        state["_table_refs"] = [weakref.ref(t) for t in state["_table_refs"]]
        self.__dict__.update(state)

    def __deepcopy__(self, memo: dict) -> TableGroup:
        """A copy referring to the copies of its tables (made here, or already in ``memo``)."""
        new = TableGroup.__new__(TableGroup)
        memo[id(self)] = new
        state = self.__getstate__()
        new.__setstate__(copy.deepcopy(state, memo))
        return new

    def state(self, chosen: list[int] | None = None) -> list[torch.Tensor]:
        """The state tensors of the tables (all, or those at the positions ``chosen``), in the
        order the ops take them."""
        tables = self.tables
        tables = tables if chosen is None else [tables[i] for i in chosen]
        return [x for t in tables for x in t.state_tensors()]

    def device_counts(self, chosen: list[int] | None = None) -> list[torch.Tensor]:
        """The device counts of the tables (all, or those at the positions ``chosen``), which
        the forward and the update add to."""
        tables = self.tables
        tables = tables if chosen is None else [tables[i] for i in chosen]
        return [t.device_counts() for t in tables]

    def position(self, table) -> int:
        """``table``'s position in the group (by identity: a group may be copied or pickled
        with its tables)."""
        return next(i for i, t in enumerate(self.tables) if t is table)

    def cache_changed(self) -> None:
        """Tells the group that a table's cache may have changed outside its ops (a load, a
        copy of rows): the forward's slot hints are stale, and so is a stage."""
        self._epoch += 1
        self._stage = None

    def staged_positions(self, device: torch.device) -> list[int]:
        """The tables whose misses :meth:`prefetch` stages: the host-placed ones, on a GPU
        (their misses cross PCIe; a table in device memory gains nothing from a copy)."""
        if device.type != "cuda":
            return []
        return [i for i, t in enumerate(self.tables) if t.config.placement == "host"]

    def prefetch(
        self,
        indices: torch.Tensor,
        lengths: torch.Tensor,
        feature_tables: list[int],
        batch: int,
        training: bool,
    ) -> None:
        """Stages the misses of a coming forward (arguments as :meth:`lookup`'s) of the
        host-placed tables: on a GPU, on a side stream, copies of the stored rows its lookups
        will not find cached, read there by the next forward of as many lookups in the same
        mode (training or not: an evaluation between two training steps leaves the next
        step's stage) and by the update of its gradient in place of the tables' rows across
        PCIe (docs/design.md, "Prefetch"). The same values either way: an update launched before that forward
        marks the copies of the rows it may write stale, and a stale or missing copy is read
        from the table. Nothing waits for the device; a table in device memory, or a group
        on the CPU, stages nothing."""
        staged = self.staged_positions(indices.device)
        if not staged:
            return
        side = _staging_stream(indices.device)
        args = (self.state(), self.specs, indices, lengths, feature_tables, batch, staged)
        if side is None:
            slots, rows = _ops.stage_misses(*args)
            self._stage = Stage(slots, rows, training, None)
            return
        main = torch.cuda.current_stream(indices.device)
        side.wait_stream(main)  # the inputs, and every update launched so far
        with torch.cuda.stream(side):
            slots, rows = _ops.stage_misses(*args)
            done = torch.cuda.Event()
            done.record(side)
        for t in (indices, lengths):
            t.record_stream(side)
        for t in (slots, rows):
            t.record_stream(main)
        self._stage = Stage(slots, rows, training, done)

    def _take_stage(self, lookups: int, training: bool) -> Stage | None:
        """The prefetched stage if it was made for a forward of this many lookups in this
        mode (it is then the forward's), ordered before the current stream's later work."""
        stage = self._stage
        if stage is None or (stage.lookups, stage.training) != (lookups, training):
            return None
        self._stage = None
        stage.wait()
        return stage

    # ------------------------------------------------------------------ forward / backward

    def lookup(
        self,
        indices: torch.Tensor,
        lengths: torch.Tensor,
        psw: torch.Tensor | None,
        feature_tables: list[int],
        batch: int,
        training: bool,
        psw_input: torch.Tensor | None = None,
        check: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Pooled embeddings ``[batch, sum of the features' dims]``: feature f is bags
        ``[f * batch, (f + 1) * batch)`` of ``lengths`` over ``indices`` (int64), with
        per-sample weights ``psw`` (float32) or none, looked up in table
        ``feature_tables[f]``. In training the tables count lookups and hits, and the backward
        stores the deduplicated gradient here. ``psw_input`` is the caller's tensor of which
        ``psw`` is the float32 value: the output's gradient reaches it if it requires one.

        Bad input changes nothing. On the CPU it raises RuntimeError (from C++) here. On a GPU
        the forward does not wait for its kernels: it raises at a later call, once they have
        run (docs/contract.md §7): in training, the update of the gradient it leads to
        (before anything changes); else a later forward of the group that finds them done, or
        :meth:`check_inputs`. ``check`` then raises the ValueError that names the table and
        the value."""
        self._check_finished_inputs()
        stage = self._take_stage(indices.numel(), training)
        pooled, offsets, slots, bounds, argmax, errors = _ops.multi_lookup_forward(
            self.state(),
            self.specs,
            indices,
            lengths,
            psw,
            feature_tables,
            batch,
            self.device_counts() if training else [],
            None if stage is None else stage.slots,
            None if stage is None else stage.rows,
        )
        pending = None
        if errors.numel():
            # A backward will hand the bits to the update, which reads them in its one read;
            # other forwards' are checked as they arrive (at once where that costs no wait).
            to_update = training and torch.is_grad_enabled() and errors.device.type == "cuda"
            pending = InputCheck.of(errors, check, copy=not to_update)
            if not to_update:
                self._unchecked.append(pending)
                self._check_finished_inputs()
        anchor = self._anchor if training else self._anchor.detach()
        lookup = (
            self,
            feature_tables,
            pooled,
            indices,
            offsets,
            psw,
            slots,
            bounds,
            argmax,
            self._epoch,
            pending,
            stage,
        )
        return _Lookup.apply(anchor, psw_input, lookup)

    def _check_finished_inputs(self) -> None:
        """Raises the input error of the oldest forward whose kernels found one, among those
        done (and, past MAX_UNCHECKED_FORWARDS of them, the oldest waited for)."""
        unchecked = self._unchecked
        while unchecked:
            first = unchecked[0]
            if (
                first.done is not None
                and len(unchecked) <= MAX_UNCHECKED_FORWARDS
                and not first.done.query()
            ):
                return
            unchecked.popleft()
            first.raise_if_bad()

    def check_inputs(self) -> None:
        """Waits for every forward whose input is not confirmed yet and raises the first
        input error (the ValueError naming the table and value); nothing on the CPU, where
        the forward raises at once."""
        while self._unchecked:
            self._unchecked.popleft().raise_if_bad()

    def _store(self, backward: _Backward, checks: list[InputCheck]) -> None:
        """Keeps a backward's gradient (one kept before it goes to the tables' parts first)
        and, on a GPU, the checks of its input, which the update's gate includes."""
        self._hand_over()
        self._backward = backward
        self._inputs += checks

    def _hand_over(self) -> None:
        """Splits the kept backward into the parts of its features' tables."""
        b = self._backward
        if b is None:
            return
        self._backward = None
        # the parts' stage: this backward's, if the parts hold nothing else
        alone = not any(self._parts) and b.stage is not None
        self._parts_stage = (b.stage, b.epoch) if alone else None
        dims = [self._dims[t] for t in b.feature_tables]
        for (first, end, value), t, dim in zip(b.ranges.tolist(), b.feature_tables, dims):
            g = b.grads[value : value + (end - first) * dim].view(end - first, dim)
            self._parts[t].append(PendingGradient(b.rows[first:end], g, b.occurrences[first:end]))

    def _merged(self, t: int) -> PendingGradient:
        """Table t's parts summed per unique row (rows ascending), kept as its one part. A row's
        gradient is the sum of its parts' in the order they came (``((0 + g0) + g1) + g2``), on
        every device: parts are added one after another, and within a part each row occurs
        once, so no two additions to a row race (``index_add_`` would use atomics on CUDA, in
        no fixed order)."""
        parts = self._parts[t]
        if len(parts) > 1:
            unique, inverse = torch.unique(
                torch.cat([p.rows for p in parts]), sorted=True, return_inverse=True
            )
            grads = unique.new_zeros(unique.numel(), self._dims[t], dtype=torch.float32)
            occ = torch.zeros_like(unique)
            for part, at in zip(parts, inverse.split([p.rows.numel() for p in parts])):
                grads[at] += part.grads
                occ[at] += part.occurrences
            parts[:] = [PendingGradient(unique, grads, occ)]
        return parts[0]

    # ------------------------------------------------------------------ the pending gradient

    def pending(self, table) -> list[PendingGradient]:
        """``table``'s stored gradient, in parts (one per backward not yet applied)."""
        self._hand_over()
        return list(self._parts[self.position(table)])

    def pending_grads(self, table=None) -> list[torch.Tensor]:
        """The stored FP32 gradient tensors of every table, or of ``table`` alone."""
        if table is not None:
            return [p.grads for p in self.pending(table)]
        grads = [p.grads for parts in self._parts for p in parts]
        return grads if self._backward is None else grads + [self._backward.grads]

    def has_nonfinite_grad(self, table=None) -> bool:
        return any(not bool(torch.isfinite(g).all()) for g in self.pending_grads(table))

    def unscale_grad_(self, inv_scale: float, table=None) -> None:
        grads = self.pending_grads(table)
        if grads:
            torch._foreach_mul_(grads, inv_scale)  # each tensor as g.mul_(inv_scale) would

    def zero_grad(self, table=None) -> None:
        """Drops the stored gradient of every table, or of ``table`` alone."""
        if table is None:
            self._backward = None
            self._inputs.clear()
            for parts in self._parts:
                parts.clear()
        else:
            self._hand_over()
            self._parts[self.position(table)].clear()

    # ------------------------------------------------------------------ update and flush

    def update(self, commit: bool = True, table=None) -> None:
        """Applies the stored gradient of every table (or of ``table`` alone) in one
        multi_update call, all or nothing: if any table refuses its update (non-finite or
        unstorable values), no table changes and the :class:`EmbeddingUpdateError` names the
        table and the row. With ``commit=False`` only checks (a dry run: the gradient stays).
        One wait for the device (:meth:`start_update`, then its :meth:`PendingUpdate.finish`)."""
        self.start_update(commit=commit, table=table).finish()

    def start_update(self, gate: torch.Tensor | None = None, commit: bool = True, table=None):
        """Launches :meth:`update` without waiting for the device: returns the
        :class:`PendingUpdate`, whose ``finish`` learns the outcome. ``gate``: int64 words on
        the tables' device, of which any non-zero one stops the commit (the caller's own
        decision, made on the device)."""
        chosen = None if table is None or len(self._every) == 1 else [self.position(table)]
        return start_update_together([self], gate, commit, chosen)

    def _whole_backward(self) -> _Backward | None:
        """The stored gradient if it is one backward of every table over the caches as its
        forward saw them (its slot hints and value bounds still hold), else None."""
        b = self._backward
        usable = (
            b is not None
            and b.feature_tables == self._every
            and b.epoch == self._epoch
            and not any(self._parts)
        )
        return b if usable else None

    def _merged_stage(self) -> Stage | None:
        """The stage the tables' parts may read: that of their one backward's forward, while
        no cache has changed since it (as :meth:`_whole_backward`'s)."""
        if self._parts_stage is None or self._parts_stage[1] != self._epoch:
            return None
        return self._parts_stage[0]

    def _forget_inputs(self, inputs: list[InputCheck]) -> None:
        """Drops these forwards' input checks from those still to be read: an update has read
        them."""
        if inputs and self._unchecked:
            ids = {id(i) for i in inputs}
            self._unchecked = collections.deque(i for i in self._unchecked if id(i) not in ids)

    def _refuse(self, chosen: list[int], bad: list[int]) -> None:
        """Raises the :class:`EmbeddingUpdateError` of the first of the tables ``chosen``
        whose update refused row ``bad[i]`` (nothing was changed)."""
        self._hand_over()  # the tables' parts name the row
        t, row = next((t, row) for t, row in zip(chosen, bad) if row >= 0)
        p = self._merged(t)
        at = int(torch.searchsorted(p.rows, row))
        config = self.tables[t].config
        what = (
            "non-finite gradient"
            if not bool(torch.isfinite(p.grads[at]).all())
            else f"new value that {config.stored_precision} cannot store (out of range)"
        )
        raise EmbeddingUpdateError(
            f"table '{config.name}': {what} for row {row}; nothing was changed"
        )

    def _committed(self, chosen: list[int], rows: torch.Tensor, row_starts: list[int]) -> None:
        """After a commit of the tables ``chosen`` (their unique rows ``rows``, table
        ``chosen[i]``'s from ``row_starts[i]``): their steps and unique rows counted, their
        gradients used, the caches maybe changed, each table's sample of touched rows told."""
        counts = [e - s for s, e in zip(row_starts, row_starts[1:])]
        _ops.count_updates([self._counters[t] for t in chosen], counts)
        self._backward = None  # (handed over already where not every table was chosen)
        if chosen == self._every:
            self._inputs.clear()
        for t in chosen:
            self._parts[t].clear()
        self._mark_touched(chosen, rows, row_starts)
        self._epoch += 1

    def _mark_touched(self, chosen: list[int], rows: torch.Tensor, row_starts) -> None:
        """Marks the sampled rows (each table's :class:`~embcache.telemetry.TouchedSample`)
        among the committed unique rows, for every table at once: on the CPU in one C++ pass
        (mark_sampled_rows), elsewhere with :func:`mark_with_tensor_ops`."""
        if rows.numel() == 0:
            return
        keys, touched = self._touch_index(rows.device)
        if rows.device.type == "cpu":
            _ops.mark_sampled_rows(rows, row_starts, chosen, keys, touched)
        else:
            mark_with_tensor_ops(rows, row_starts, chosen, keys, touched)

    def _touch_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every table's sampled rows as keys ``position << 32 | row``, and one flag tensor of
        which each table's sample holds a view (so one in-place OR marks them all), on
        ``device``; made at the first mark."""
        if self._touch is None or self._touch[0].device != device:
            samples = [t.touched for t in self.tables]
            keys = torch.cat([(i << 32) | s.rows.to(device) for i, s in enumerate(samples)])
            touched = torch.cat([s.touched.to(device) for s in samples])
            start = 0
            for s in samples:
                n = s.rows.numel()
                s.rows, s.touched = s.rows.to(device), touched[start : start + n]
                start += n
            self._touch = (keys, touched)
        return self._touch

    def flush(self, table=None) -> list[int]:
        """Rounds every cached row of every table (or of ``table`` alone) into its table and
        empties the caches; returns the rows written per table."""
        chosen = self._every if table is None else [self.position(table)]
        every = chosen == self._every
        written = _ops.cache_flush(
            self.state(None if every else chosen),
            self.specs if every else self.specs[chosen],
            self._counters if every else [self._counters[t] for t in chosen],
        )
        self._epoch += 1
        self._stage = None
        return written


def update_together(groups: Sequence[TableGroup], commit: bool = True) -> None:
    """Applies the stored gradient of every table of ``groups`` (their state on one device)
    in one ``multi_update`` call, all or nothing across all of them: if any table refuses its
    update, no table of any group changes and the :class:`EmbeddingUpdateError` names it.
    One wait for the device."""
    start_update_together(groups, None, commit).finish()


def start_update_together(
    groups: Sequence[TableGroup],
    gate: torch.Tensor | None = None,
    commit: bool = True,
    chosen: list[int] | None = None,
) -> PendingUpdate:
    """Launches :func:`update_together` (of the tables at positions ``chosen`` of a single
    group, if given) without waiting for the device, with the gate of
    :meth:`TableGroup.start_update`. With the forwards' slot hints and value bounds when every
    group holds one whole backward (:meth:`TableGroup._whole_backward`) and all its tables
    are updated; else each table's parts merged, without them."""
    whole = [g._whole_backward() for g in groups]
    if chosen is None and all(b is not None for b in whole):
        return _start_hinted(list(zip(groups, whole)), gate, commit)
    selections = [(g, g._every if chosen is None else chosen) for g in groups]
    return _start_merged(selections, gate, commit)


class PendingUpdate:
    """A launched ``multi_update`` whose outcome is on the device: ``words`` (int64, to be
    read, e.g. with the caller's own figures in one copy) are the gate's words, one per
    forward or backward whose input the update waited on, the verdict, then the tables' row
    ranges. :meth:`finish` reads them (unless given) and does what follows: nothing if
    nothing was to be updated."""

    def __init__(self, taken, rows, ranges, verdict, gate, gate_words, inputs, commit) -> None:
        self.taken = taken  # [(group, positions)], the tables in the op's order
        self.rows, self.commit = rows, commit
        self.inputs: list[InputCheck] = inputs
        self.gate_words = gate_words  # the caller's, at the head of ``gate`` (then the inputs')
        self.words = torch.empty(0, dtype=torch.int64)  # (nothing to update: nothing to read)
        if taken:
            parts = [] if gate is None else [gate]
            self.words = torch.cat(parts + [verdict.reshape(-1), ranges.reshape(-1)])

    def finish(self, words: Sequence[int] | None = None) -> bool:
        """Whether the update was applied. Raises, having changed nothing: a forward's input
        error (the ValueError naming the table and value; the groups' pending gradient, which
        that input led to, is dropped), a table's refusal
        (:class:`EmbeddingUpdateError`); returns False if the gate stopped it or it was a dry
        run."""
        if not self.taken:
            return False
        words = self.words.tolist() if words is None else list(words)
        n, nt = self.gate_words, sum(len(chosen) for _, chosen in self.taken)
        gate, words = words[:n], words[n:]
        errors, words = words[: len(self.inputs)], words[len(self.inputs) :]
        verdict, ranges = words[: 2 * nt], words[2 * nt :]
        for group, _ in self.taken:
            group._forget_inputs(self.inputs)
        if any(errors):  # a bad batch: its gradient is dropped, and the error raised
            for group, _ in self.taken:
                group.zero_grad()
            for pending, bits in zip(self.inputs, errors):
                pending.raise_if_bad(bits)
        bits, bad = verdict[0::2], verdict[1::2]
        if any(bits):
            raise RuntimeError(f"embcache (cuda): {_error_text(next(b for b in bits if b))}")
        if any(gate):
            return False
        at = 0
        for group, chosen in self.taken:
            refused = bad[at : at + len(chosen)]
            if max(refused) >= 0:
                group._refuse(chosen, refused)
            at += len(chosen)
        if not self.commit:
            return False
        at = 0
        for group, chosen in self.taken:
            mine = ranges[3 * at : 3 * (at + len(chosen))]
            first, end = mine[0], mine[-2]  # a group's tables' rows follow each other
            starts = [first] + mine[1::3]
            group._committed(chosen, self.rows[first:end], [r - first for r in starts])
            at += len(chosen)
        return True


def _launch(
    taken, rows, grads, occ, hints, ranges, bounds, gate, commit, stages=None
) -> PendingUpdate:
    """One ``multi_update`` of the tables ``taken`` ([(group, positions)]), gated by ``gate``
    and by the input errors of the forwards behind their gradients; ``stages``: each group's
    :class:`Stage` its gradient's forward read (or None), read again for uncached rows. The
    groups' prefetched stages are waited for (the update must not write rows while they are
    copied) and their copies of the rows it may write marked stale."""
    inputs = [i for g, _ in taken for i in g._inputs]
    gate_words = 0 if gate is None else gate.numel()
    full_gate = gate
    if inputs:
        full_gate = torch.cat(([] if gate is None else [gate]) + [i.errors for i in inputs])
    staged = _staged_arguments(taken, stages)
    for g, _ in taken:
        if g._stage is not None:
            g._stage.wait()
    verdict = _ops.multi_update(
        [x for g, c in taken for x in g.state(c)],
        _joined([g.specs[c] if c != g._every else g.specs for g, c in taken]),
        rows,
        grads,
        occ,
        hints,
        ranges,
        bounds,
        [g._counters[t] for g, c in taken for t in c],
        [x for g, c in taken for x in g.device_counts(c)],
        full_gate,
        commit,
        *staged,
    )
    at = 0
    for g, chosen in taken:
        if g._stage is not None:
            range_of = [-1] * len(g._every)
            for i, t in enumerate(chosen):
                range_of[t] = at + i
            _ops.unstage_rows(g._stage.slots, rows, ranges, range_of)
        at += len(chosen)
    return PendingUpdate(taken, rows, ranges, verdict, full_gate, gate_words, inputs, commit)


def _staged_arguments(taken, stages) -> tuple:
    """multi_update's stage arguments for the tables ``taken``: the stage of the first group
    that has one (``stages``, one per group or None), with each table's position in it (-1
    for another group's tables, which read their rows from their tables); none if no group
    has one."""
    chosen = next((i for i, s in enumerate(stages or ()) if s is not None), None)
    if chosen is None:
        return ()
    positions = []
    for i, (_, tables) in enumerate(taken):
        positions += tables if i == chosen else [-1] * len(tables)
    return stages[chosen].slots, stages[chosen].rows, positions


def _start_hinted(
    selections: list[tuple[TableGroup, _Backward]], gate, commit: bool
) -> PendingUpdate:
    """One ``multi_update`` of every table of each group from its whole backward, with the
    forward's slot hints (if every group has them) and value bounds."""
    backwards = [b for _, b in selections]
    hinted = all(b.slots.numel() or not b.rows.numel() for b in backwards)
    ranges = _joined([b.ranges for b in backwards])
    if len(backwards) > 1:  # each group's ranges moved past the arrays of the groups before it
        bases, row_base, value_base = [], 0, 0
        for b in backwards:
            bases += [[row_base, row_base, value_base]] * len(b.ranges)
            row_base, value_base = row_base + b.rows.numel(), value_base + b.grads.numel()
        # from pageable memory the copy is staged before it returns: nothing waits
        ranges = ranges + torch.tensor(bases).to(ranges.device, non_blocking=True)
    return _launch(
        [(g, g._every) for g, _ in selections],
        _joined([b.rows for b in backwards]),
        _joined([b.grads for b in backwards]),
        _joined([b.occurrences for b in backwards]),
        _joined([b.slots for b in backwards]) if hinted else _NO_HINT,
        ranges,
        [x for b in backwards for x in b.bounds],
        gate,
        commit,
        [b.stage for b in backwards],
    )


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated (one alone is passed on, not copied: the per-step path)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _start_merged(
    selections: list[tuple[TableGroup, list[int]]], gate, commit: bool
) -> PendingUpdate:
    """One ``multi_update`` of the tables chosen in each group (positions), each table's parts
    merged, without slot hints."""
    taken, flat = [], []
    for group, positions in selections:
        group._hand_over()
        mine = [t for t in positions if group._parts[t]]
        if mine:
            taken.append((group, mine))
            flat += [group._merged(t) for t in mine]
    if not flat:
        return PendingUpdate([], None, None, None, None, 0, [], commit)
    stages = [group._merged_stage() for group, _ in taken]
    ranges, first, value = [], 0, 0
    for p in flat:
        ranges.append([first, first + p.rows.numel(), value])
        first, value = first + p.rows.numel(), value + p.grads.numel()
    rows = torch.cat([p.rows for p in flat])
    return _launch(
        taken,
        rows,
        torch.cat([p.grads.flatten() for p in flat]),
        torch.cat([p.occurrences for p in flat]),
        _NO_HINT,
        torch.tensor(ranges, dtype=torch.int64).to(rows.device),
        [-1.0] * len(flat),
        gate,
        commit,
        stages,
    )


class _Lookup(torch.autograd.Function):
    """Returns the table-batched forward's output (``pooled``) with this node as its gradient
    function; backward deduplicates every feature's gradient in one table-batched call and
    stores it in the group, with each row's cache slot as the forward found it, and returns
    the gradient of the per-sample weights if they require one. ``lookup`` is what the
    forward made and saw: (group, feature tables, pooled, ids, offsets, float32 per-sample
    weights or None, every lookup's slot, each feature's value bound, the max-pooled
    features' argmax (no columns without them), the cache epoch, the forward's
    :class:`InputCheck` or None, the :class:`Stage` it read or None). The ids and weights may be
    the caller's tensors, so they are saved (autograd refuses a backward after they change in
    place); the rest are the forward's own, kept on ``ctx``."""

    @staticmethod
    def forward(ctx, anchor, psw_input, lookup):
        (ctx.group, ctx.feature_tables, pooled, indices, ctx.offsets, psw) = lookup[:6]
        ctx.slots, ctx.bounds, ctx.argmax, ctx.epoch, ctx.pending, ctx.stage = lookup[6:]
        ctx.psw_dtype = None if psw_input is None else psw_input.dtype
        ctx.save_for_backward(indices, *(() if psw is None else (psw,)))
        return pooled

    @staticmethod
    def backward(ctx, grad):
        group, feature_tables = ctx.group, ctx.feature_tables
        indices, *psw = ctx.saved_tensors
        psw = psw[0] if psw else None
        grad = grad.float().contiguous()
        if ctx.needs_input_grad[0]:
            # The CUDA forward gives neither slots nor value bounds.
            slots = ctx.slots if ctx.slots.numel() else None
            rows, grads, occ, row_slots, ranges, errors = _ops.multi_dedup_backward(
                indices, ctx.offsets, psw, grad, group.specs, feature_tables, slots, ctx.argmax
            )
            bounds = ctx.bounds.tolist() or [-1.0] * len(feature_tables)
            checks = [] if ctx.pending is None else [ctx.pending]
            if errors.numel():  # a GPU's: its sort's own check of the forward's input
                checks.append(InputCheck.of(errors, ctx.pending and ctx.pending.check, copy=False))
            group._store(
                _Backward(
                    feature_tables,
                    rows,
                    grads,
                    occ,
                    row_slots,
                    ranges,
                    ctx.epoch,
                    bounds,
                    ctx.stage,
                ),
                checks,
            )
        grad_psw = None
        if ctx.needs_input_grad[1]:
            grad_psw = _psw_grad(group, feature_tables, indices, ctx.offsets, grad)
            grad_psw = grad_psw.to(ctx.psw_dtype)
        return None, grad_psw, None


def mark_with_tensor_ops(
    rows: torch.Tensor,
    row_starts: list[int],
    chosen: list[int],
    keys: torch.Tensor,
    touched: torch.Tensor,
) -> None:
    """What mark_sampled_rows does, with tensor ops on ``rows``' device: ``touched[k] |=``
    whether key k (``position << 32 | row``, keys ascending) is among the unique rows of table
    ``chosen[i]``, ``rows[row_starts[i]:row_starts[i + 1]]`` (ascending), found by one search
    of the keys in the rows made keys of the same form. On a GPU: one small copy to the
    device and no wait for it (the output's size is known)."""
    n = len(chosen)
    host = torch.cat([torch.tensor(chosen), torch.tensor(row_starts).diff()])
    # From pageable memory the copy is staged before it returns: nothing to wait for.
    tables_and_counts = host.to(rows.device, non_blocking=True)
    position = torch.repeat_interleave(
        tables_and_counts[:n], tables_and_counts[n:], output_size=rows.numel()
    )
    updated = (position << 32) | rows
    at = torch.searchsorted(updated, keys).clamp_(max=updated.numel() - 1)
    touched |= updated[at] == keys


def _psw_grad(group: TableGroup, feature_tables, indices, offsets, grad) -> torch.Tensor:
    """d pooled[b, feature f's columns] / d psw[l] for lookup l of bag b: the value the lookup
    read, which each feature's lookups give when looked up as bags of their own."""
    batch = grad.shape[0]
    bags = torch.arange(offsets.numel() - 1, device=offsets.device)
    sample = torch.repeat_interleave(bags, offsets.diff()) % batch  # of each lookup
    out, col = [], 0
    for f, t in enumerate(feature_tables):
        first, last = int(offsets[f * batch]), int(offsets[(f + 1) * batch])
        ids = indices[first:last]
        values = _ops.multi_lookup_forward(
            group.state(), group.specs, ids, torch.ones_like(ids), None, [t], ids.numel(), []
        )[0]
        dim = values.shape[1]
        out.append((grad[sample[first:last], col : col + dim] * values).sum(dim=1))
        col += dim
    return torch.cat(out)
