"""The mixed-precision training step (docs/contract.md §6): :class:`MixedPrecisionTrainer`
keeps FP16 dense weights with FP32 masters, scales the FP32 loss, unscales every gradient in
FP32, makes one overflow decision per step for dense and embedding gradients together (and
over every rank), and applies either all of the step or none of it. Embedding collections
that keep their own sparse update take part through the :class:`MixedPrecisionEmbedding`
protocol."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from dlrm.mixed_precision.scalers import BackoffScaler, LossScaler, StaticScaler
from dlrm.torchrec_adapter import is_sharded
from embcache.embedding import check_state_dict  # (also registers torch.ops.embcache)
from embcache.group import EmbeddingUpdateError


@runtime_checkable
class MixedPrecisionEmbedding(Protocol):
    """An embedding collection that keeps its own (sparse) gradient and applies its own update.

    The trainer drives such a collection through these four methods only; it never touches
    its parameters (they are left out of the dense optimizer). Once per training step, after
    ``backward``:

    1. ``unscale_grad_(inv_scale)``: multiply the pending gradient by ``inv_scale = 1 / S``
       in FP32;
    2. ``has_nonfinite_grad()``: whether the pending gradient holds an inf or NaN; it takes
       part in the step's single overflow decision;
    3. exactly one of ``step()`` (the step is applied: apply the pending update, then clear
       it) or ``zero_grad()`` (the step is skipped: discard the pending gradient and change no
       other state -- no table, cache, count or timestamp change).

    The collection owns its optimizer and learning rate: the trainer's LR schedule does not
    reach it. Everything it needs to resume bit-identically must be in its ``state_dict``.
    Optionally it offers ``pending_grads() -> list[Tensor]`` (its FP32 gradient tensors, all
    of them, such that multiplying each in place by ``inv_scale`` is ``unscale_grad_``); then
    the trainer unscales them itself, in the one pass that also finds the step's min/max
    |grad| (which the ``logmax`` scaler feeds on) and sees any inf or NaN, in place of
    ``unscale_grad_`` and ``has_nonfinite_grad()``. Either way they are part of the overflow
    decision. It may also offer ``start_step(gate) -> pending`` (a single process then uses it
    in place of ``step()``): the update launched, applied only if every word of ``gate``
    (int64, on its device) is 0, and ``pending.words`` (int64 on its device) which the
    trainer reads together with its own figures, then passes to ``pending.finish(words)``,
    which raises ``EmbeddingUpdateError`` if the tables refused the update (nothing changed).
    """

    def has_nonfinite_grad(self) -> bool: ...

    def unscale_grad_(self, inv_scale: float) -> None: ...

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...


DENSE_PRECISIONS = ("fp32", "fp16")
_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad}
OPTIMIZERS = tuple(_OPTIMIZERS)


@dataclasses.dataclass
class ScalingReport:
    """What loss scaling did over a run (docs/contract.md §6, "report per run").

    * ``steps``: training steps taken (applied + skipped); ``skipped``: steps skipped because a
      gradient was non-finite (the overflow count).
    * ``scale_trace``: ``(step, scale)`` pairs, one per change of scale, starting with
      ``(0, initial scale)``; ``(s, S)`` means steps ``s, s+1, ...`` (counted from 0) used ``S``.
    * ``min_abs_grad`` / ``max_abs_grad``: the smallest non-zero / the largest unscaled
      |gradient| over all applied steps (``inf`` / ``0`` while there is none).
    """

    steps: int = 0
    skipped: int = 0
    scale_trace: list = dataclasses.field(default_factory=list)
    min_abs_grad: float = math.inf
    max_abs_grad: float = 0.0


class StepRefusedError(ValueError):
    """A training step whose gradients were finite but whose new values cannot be stored (see
    :class:`MixedPrecisionTrainer`). ``step`` is the number the step would have had, counted
    from 1; ``reason`` names the parameter or table."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"step {step} refused: {reason}; nothing was changed")
        self.step = step
        self.reason = reason


class _Backup:
    """Copies of some tensors and of their optimizer state, taken before a step so that a
    refused step can be undone exactly. The copy buffers are allocated once and reused."""

    def __init__(self, optimizer: torch.optim.Optimizer, targets: list[Tensor]) -> None:
        self.optimizer = optimizer
        self.targets = targets
        self._copies = [torch.empty_like(t) for t in targets]
        self._state: dict[int, dict] = {}  # target index -> its optimizer state as saved

    def save(self) -> None:
        """Copies the targets and their optimizer state into the buffers, every tensor in one
        foreach copy."""
        copies, sources = list(self._copies), list(self.targets)
        saved = {}
        for i, t in enumerate(self.targets):
            if t not in self.optimizer.state:
                continue
            old = self._state.get(i, {})
            entry = {}
            for key, value in self.optimizer.state[t].items():
                if isinstance(value, Tensor):
                    buf = old.get(key)
                    if not (
                        isinstance(buf, Tensor)
                        and buf.shape == value.shape
                        and buf.dtype == value.dtype
                    ):
                        buf = torch.empty_like(value)
                    copies.append(buf)
                    sources.append(value)
                    entry[key] = buf
                else:
                    entry[key] = value
            saved[i] = entry
        if sources:
            with torch.no_grad():  # targets may be parameters (FP32 dense): no graph
                torch._foreach_copy_(copies, sources)
        self._state = saved

    def restore(self) -> None:
        if self.targets:
            with torch.no_grad():  # in place on parameters that may require grad
                torch._foreach_copy_(self.targets, self._copies)
        state = self.optimizer.state
        for i, t in enumerate(self.targets):
            if i not in self._state:
                state.pop(t, None)  # created by the refused step (e.g. Adam's first step)
                continue
            current, saved = state[t], self._state[i]
            for key in set(current) - set(saved):
                del current[key]
            for key, value in saved.items():
                if isinstance(value, Tensor) and isinstance(current.get(key), Tensor):
                    current[key].copy_(value)
                else:
                    current[key] = value.clone() if isinstance(value, Tensor) else value


# |x| from which float32 x rounds to an infinite FP16 (to nearest: 65504 is the largest finite
# FP16, and the midpoint to the next power of two, 65520, rounds to even, i.e. up)
FP16_OVERFLOW = 65520.0


# The phases of a training step that the trainer times (MixedPrecisionTrainer.phase_seconds).
PHASES = (
    "forward_backward",  # the model's forward, the loss, the backward
    "unscale_check",  # gradients to FP32, unscaled; their range (the overflow check)
    "dry_run",  # several processes: this rank's embedding shards checked (changing nothing)
    # one process: the step's one read of its figures (gradient range, new masters' largest
    # |x|); several: the decision all-reduce, and the wait for the others
    "decision",
    "backup",  # copies of the dense tensors and their optimizer state (to undo a refusal)
    "dense_step",  # the optimizer's step on the dense masters (and a non-protocol collection)
    "dense_check",  # the new dense values checked (finite; FP16: would not overflow)
    "embedding_step",  # the protocol collection's update
    "fp16_copies",  # the FP16 parameters rewritten from their masters
    "bookkeeping",  # zeroing gradients, the scaler, the report, the LR schedule
)


class _PhaseClock:
    """Seconds per phase of :data:`PHASES`, summed over steps: ``lap(phase)`` adds the time
    since the previous lap (or ``start``) to ``phase``."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now


def _on_cpu(tensors: list[Tensor]) -> bool:
    """Whether the fused CPU ops take these tensors (contiguous float32 CPU tensors)."""
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors
    )


def _abs_range(tensors: list[Tensor]) -> Tensor:
    """``[max |x|, min non-zero |x|]`` over all tensors (float64, on their device, so that a
    GPU is not waited for until the figures are read); NaN propagates into both. On the CPU
    (float32) one read of each tensor on all threads (``torch.ops.embcache.abs_range``);
    elsewhere torch's reductions."""
    if tensors and _on_cpu(tensors):
        return torch.tensor(torch.ops.embcache.abs_range(tensors), dtype=torch.float64)
    if not any(t.numel() for t in tensors):  # (torch's reductions refuse empty tensors)
        return torch.tensor([0.0, math.inf], dtype=torch.float64)
    # one flat copy, then a few kernels whatever the number of tensors (a GPU step's launches)
    flat = torch.cat([t.reshape(-1).float() for t in tensors]).abs_()
    min_abs = torch.where(flat != 0, flat, math.inf).amin()
    return torch.stack([flat.amax(), min_abs]).double()


def _unscale_abs_range(grads: list[Tensor], inv_scale: float) -> Tensor:
    """Multiplies every gradient in place by ``inv_scale`` (as ``g.mul_(inv_scale)``) and
    returns :func:`_abs_range` of the results: on the CPU (float32) in one pass on all threads
    (``torch.ops.embcache.unscale_abs_range``)."""
    if grads and _on_cpu(grads):
        figures = torch.ops.embcache.unscale_abs_range(grads, inv_scale)
        return torch.tensor(figures, dtype=torch.float64)
    if grads:
        torch._foreach_mul_(grads, inv_scale)
    return _abs_range(grads)


class MixedPrecisionTrainer:
    """Trains a CTR model whose dense part runs in FP16 (or FP32), one step at a time.

    ``model`` is called as ``model(dense, sparse) -> logits`` (shape ``[B]`` or ``[B, 1]``) and
    has an attribute ``embedding_collection`` (a module, or None). Its *dense parameters* are all
    its parameters outside ``embedding_collection``. Construction changes the model in place:
    with ``dense_precision="fp16"`` every dense parameter becomes FP16 (the model's forward must
    follow the dtype of its parameters, as :class:`dlrm.model.DLRM` does).

    Invariants:

    * fp16: ``masters[i]`` is the FP32 master of ``dense_params[i]``; the optimizer updates the
      masters, and after every applied step each FP16 parameter is its master rounded to
      nearest. fp32: the parameters are their own masters and ``masters`` is empty.
    * An embedding collection implementing :class:`MixedPrecisionEmbedding` is driven through
      that protocol only. Any other collection (e.g. TorchRec's ``EmbeddingBagCollection``)
      must hold FP32 parameters with ordinary ``.grad``; they are unscaled, checked and updated
      with the same optimizer as the masters (they need no master copy).
    * The optimizer (``"sgd"``, ``"adam"`` or ``"adagrad"`` with ``lr`` and ``optimizer_kwargs``,
      e.g. ``weight_decay``) sees only FP32 tensors and only unscaled gradients.
    * One overflow decision per step: the step is applied entirely (dense update, embedding
      update, one LR-schedule step) or, if any gradient is non-finite, not at all -- the only
      state a skipped step changes is the scaler's and the report's.
    * A step whose gradients are finite but whose new values cannot be stored is refused: a
      new dense value that is not finite, or whose FP16 copy would overflow (|x| > 65504), or
      an embedding update the tables refuse. :meth:`train_step` then raises
      :class:`StepRefusedError`, and every tensor of the model, the masters, the optimizer
      and the scheduler, the scaler and the report are as before the step; the step's
      gradients are dropped. This is an error, not a skip: the gradients were finite, so a
      smaller loss scale would not help, and a run whose updates leave the representable
      range has diverged. The caller may stop (``dlrm train`` does) or lower the learning
      rate and go on. To undo a refused step the trainer keeps one copy of the dense FP32
      tensors and of their optimizer state (the dense model's size again; the embedding
      collection's state is not copied: it checks its update before changing anything). The
      FP32 parameters of a non-protocol collection are not checked.

    Several processes: ``model`` may be a TorchRec ``DistributedModelParallel`` built with
    ``init_data_parallel=False`` (its sharded embedding collection must follow the protocol,
    as :class:`embcache.sharding.ShardedCachedEmbeddingBagCollection` does). The trainer
    converts the dense part, broadcasts rank 0's masters, then lets DMP wrap the dense part in
    DDP (which averages the dense gradients). Each rank's batch is its slice of the global
    batch and its loss the mean over that slice. Per step, one all-reduce over the process
    group decides for all ranks: whether any gradient anywhere is non-finite (the step is
    skipped everywhere), whether any rank's embedding shards refuse their update (a dry run,
    ``check_step``, before any state changes: refused everywhere), and the global largest and
    smallest |gradient| (so every rank's scaler sees the same figures and keeps the same
    scale). The dense update and its check are the same computation on every rank; a rank
    that would apply the step makes its dense update while the all-reduce is in flight, and
    undoes it from its backup if the decision is to skip or refuse. A process group of one
    process decides as a single process does, without the dry run and the all-reduce.

    One :meth:`train_step`: ``loss = BCEWithLogits(fp32(logits), labels)`` (mean over the
    batch) in FP32; ``backward(loss * S)`` (FP16 gradients inside the FP16 dense part); every
    gradient converted to FP32 and multiplied by ``1/S``; overflow decision; update or skip;
    ``scaler.update``. There is no gradient clipping; any added later belongs after unscaling.

    ``lr_scheduler`` is a factory ``optimizer -> LRScheduler`` (the optimizer is built here);
    it is stepped once per applied step. ``state_dict`` holds the model (FP16 copies and
    embedding state), masters, optimizer, scaler, scheduler and report: loading it into a
    trainer built the same way continues the run bit-identically.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        dense_precision: str = "fp16",
        optimizer: str = "sgd",
        lr: float = 0.01,
        optimizer_kwargs: dict | None = None,
        scaler: LossScaler | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
        | None = None,
    ) -> None:
        if dense_precision not in DENSE_PRECISIONS:
            raise ValueError(
                f"dense_precision must be one of {', '.join(DENSE_PRECISIONS)}, "
                f"got {dense_precision!r}"
            )
        if optimizer not in _OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose from {sorted(_OPTIMIZERS)}")
        self.model = model
        self.dense_precision = dense_precision
        self.process_group: dist.ProcessGroup | None = None
        if is_sharded(model):
            if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
                raise ValueError(
                    "build DistributedModelParallel with init_data_parallel=False: the trainer "
                    "makes the dense part FP16 before DDP wraps it"
                )
            self.process_group = model._env.process_group
            model = model.module
        embeddings = model.embedding_collection
        self.protocol_embedding = (
            embeddings if isinstance(embeddings, MixedPrecisionEmbedding) else None
        )
        embedding_params = list(embeddings.parameters()) if embeddings is not None else []
        embedding_ids = {id(p) for p in embedding_params}
        self.dense_params = [p for p in model.parameters() if id(p) not in embedding_ids]

        if dense_precision == "fp16":
            self.masters = [p.detach().float().clone() for p in self.dense_params]
            for p in self.dense_params:
                # in place, as Module.half() does: the Parameter stays the same object
                p.data = p.data.half()
            pairs = list(zip(self.dense_params, self.masters))
        else:
            self.masters = []
            pairs = [(p, p) for p in self.dense_params]
        if self.protocol_embedding is None:
            for p in embedding_params:
                if p.dtype != torch.float32:
                    raise TypeError("a non-protocol embedding collection must hold FP32 parameters")
            pairs += [(p, p) for p in embedding_params]
        self._pairs = pairs  # (model parameter, FP32 tensor the optimizer updates)
        dense = len(self.dense_params)
        names = {id(p): name for name, p in model.named_parameters()}
        self._dense_names = [names[id(p)] for p in self.dense_params]
        self._dense_targets = [m for _, m in pairs[:dense]]

        self.optimizer = _OPTIMIZERS[optimizer](
            [m for _, m in pairs], lr=lr, **(optimizer_kwargs or {})
        )
        self._backup = _Backup(self.optimizer, self._dense_targets)
        if self.process_group is not None:
            with torch.no_grad():
                for target in self._dense_targets:
                    dist.broadcast(target, 0, group=self.process_group)
                for param, target in pairs[:dense]:
                    if param is not target:
                        param.copy_(target)
            self.model.init_data_parallel()
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self.scaler = (
            scaler
            if scaler is not None
            else (BackoffScaler() if dense_precision == "fp16" else StaticScaler(1.0))
        )
        self.report = ScalingReport(scale_trace=[(0, self.scaler.scale)])
        self._clock = _PhaseClock()

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent in each phase of :data:`PHASES` over every :meth:`train_step` so far
        (wall time on this process: the device is not synchronized between phases)."""
        return dict(self._clock.seconds)

    def train_step(
        self, dense: Tensor, sparse, labels: Tensor, stop: bool = False, next_sparse=None
    ) -> dict:
        """One training step. Returns ``loss`` (the unscaled FP32 loss, a 0-d tensor on the
        model's device: reading it waits for the step, so a loop reads it only when it logs), ``skipped``, ``scale``
        (the S this step used), ``max_abs_grad`` and ``min_abs_nonzero_grad`` (over the unscaled
        dense and FP32-embedding gradients; ``inf`` when none is non-zero, and on a skipped step
        possibly inf or NaN), and ``stop``: whether any rank passed ``stop`` (this process's
        wish to end after this step), the same on every rank, carried by the step's one
        decision all-reduce. Raises :class:`StepRefusedError`, having changed nothing, if the
        step's new values cannot be stored. ``next_sparse``: the next step's sparse input, if
        known, whose table rows the model may start staging once this step's forward is
        launched (the model's ``prefetch``)."""
        clock = self._clock
        clock.start()
        scale = self.scaler.scale
        logits = self.model(dense, sparse)
        prefetch = getattr(self.model, "prefetch", None)
        if next_sparse is not None and prefetch is not None:
            prefetch(next_sparse)
        loss = F.binary_cross_entropy_with_logits(
            logits.float().reshape(-1), labels.float().reshape(-1)
        )
        (loss * scale).backward()
        clock.lap("forward_backward")

        dense_grads, embedding_grads = self._take_grads()
        pending = getattr(self.protocol_embedding, "pending_grads", None)
        grad_range = _unscale_abs_range(
            dense_grads + [g for _, g in embedding_grads] + (pending() if pending else []),
            1.0 / scale,
        )
        # the range is NaN or inf if any gradient it saw is; a collection that does not show
        # its pending gradients unscales them itself and is asked
        found_inf = False
        if pending is None and self.protocol_embedding is not None:
            self.protocol_embedding.unscale_grad_(1.0 / scale)
            found_inf = self.protocol_embedding.has_nonfinite_grad()
        clock.lap("unscale_check")
        refused, stepped, new_max, pending = None, False, None, None
        if self.process_group is not None and dist.get_world_size(self.process_group) > 1:
            # Several processes send their figures, and while the others answer a rank that
            # would apply the step makes its dense step (undone from the backup if the
            # decision is to skip or refuse).
            max_abs, min_abs = grad_range.tolist()
            found_inf = found_inf or not math.isfinite(max_abs)
            reason = self._dry_run() if not found_inf else None
            clock.lap("dry_run")
            decision = self._start_decision(found_inf, reason, max_abs, min_abs, stop)
            clock.lap("decision")
            if not found_inf and decision[2] is None:
                self._dense_step()
                stepped = True
            try:
                found_inf, refused, max_abs, min_abs, stop = self._finish_decision(*decision)
            except BaseException:  # a rank died, or a signal: leave the dense state as it was
                if stepped:
                    self._backup.restore()
                raise
        else:
            # One process decides alone (its update is all-or-nothing without a dry run). It
            # makes its dense step at once (undone from the backup if the step is skipped or
            # refused) and launches the embedding update gated on the device by the same
            # figures, so that the gradients' range, the new masters' largest |x| and the
            # update's outcome are read together: the one wait for a GPU a step costs.
            self._dense_step()
            stepped = True
            figures = torch.cat([grad_range, _abs_range(self._dense_targets)[:1].to(grad_range)])
            words = figures.view(torch.int64)
            pending = None if found_inf else self._start_embedding_step(figures)
            if pending is not None:
                words = torch.cat([words, pending.words.to(words.device)])
            host = words.cpu()
            max_abs, min_abs, new_max = host[:3].view(torch.float64).tolist()
            found_inf = found_inf or not math.isfinite(max_abs)
            if pending is not None:
                refused = self._finish_embedding_step(pending, host[3:].tolist())
        clock.lap("decision")
        try:
            if found_inf or refused is not None:
                if stepped:
                    self._backup.restore()
                if self.protocol_embedding is not None:
                    self.protocol_embedding.zero_grad()
                if refused is not None:
                    raise StepRefusedError(self.report.steps + 1, refused)
            else:
                if not stepped:
                    self._dense_step()
                self._apply_update(embedding_grads, new_max, embedding_done=pending is not None)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update(found_inf, max_abs)
        self._record(found_inf, max_abs, min_abs)
        clock.lap("bookkeeping")
        return {
            "loss": loss.detach(),
            "skipped": found_inf,
            "scale": scale,
            "max_abs_grad": max_abs,
            "min_abs_nonzero_grad": min_abs,
            "stop": stop,
        }

    def _start_embedding_step(self, figures: Tensor):
        """The embedding update of a single process, launched (``start_step``, where the
        collection offers it) with a gate made on the device from ``figures`` (max |g|, min
        non-zero |g|, the new masters' max |x|): it applies only if the gradients are finite
        and the new dense values storable. None where the collection has no ``start_step``
        (it is stepped after the decision)."""
        start = getattr(self.protocol_embedding, "start_step", None)
        if start is None:
            return None
        limit = FP16_OVERFLOW if self.dense_precision == "fp16" else math.inf
        stop = ~torch.isfinite(figures[:1]) | ~(figures[2:] < limit)
        return start(stop.long())

    def _finish_embedding_step(self, pending, words: list[int]) -> str | None:
        """The launched embedding update's outcome, from its words as read: None if it was
        applied or stopped by the gate, else why the tables refused it (nothing changed). A
        forward's input error (the tables' ValueError naming the table and value) is raised,
        the dense step undone and the gradient dropped."""
        try:
            pending.finish(words)
        except EmbeddingUpdateError as e:
            return str(e)
        except BaseException:
            self._backup.restore()
            self.protocol_embedding.zero_grad()
            self.optimizer.zero_grad(set_to_none=True)
            raise
        return None

    def _dry_run(self) -> str | None:
        """Why this rank's embedding shards would refuse their update (a dry run: nothing
        changes), or None."""
        if self.protocol_embedding is not None:
            try:
                self.protocol_embedding.check_step()
            except ValueError as e:
                return str(e)
        return None

    def _start_decision(
        self, found_inf: bool, reason: str | None, max_abs: float, min_abs: float, stop: bool
    ) -> tuple[Tensor, dist.Work, str | None]:
        """Sends this rank's part of the step's decision over all ranks, in one all-reduce
        (:meth:`_finish_decision` waits for it): whether a gradient is non-finite, whether an
        embedding shard refuses its update (``reason``, from :meth:`_dry_run`), max |g|, min
        non-zero |g|, and ``stop``. Returns the flags, the pending all-reduce and ``reason``."""
        flags = torch.tensor(
            [
                float(found_inf),
                float(reason is not None),
                max_abs if math.isfinite(max_abs) else math.inf,
                -min_abs,
                float(stop),
            ],
            dtype=torch.float64,
        )
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
        return flags, work, reason

    def _finish_decision(
        self, flags: Tensor, work: dist.Work, reason: str | None
    ) -> tuple[bool, str | None, float, float, bool]:
        """The decision over all ranks, once the all-reduce is done: (any gradient non-finite,
        the reason an embedding shard refuses its update or None, global max |g|, global min
        non-zero |g|, any rank's ``stop``)."""
        work.wait()
        any_inf, any_refused, max_abs, neg_min, any_stop = flags.tolist()
        if any_inf:
            return True, None, math.inf, -neg_min, bool(any_stop)
        if any_refused:
            reason = reason or "an embedding shard on another rank refused its update"
            return False, reason, max_abs, -neg_min, bool(any_stop)
        return False, None, max_abs, -neg_min, bool(any_stop)

    def _take_grads(self) -> tuple[list[Tensor], list[tuple[Tensor, Tensor]]]:
        """Every model gradient in FP32 (still scaled), taken off the model. The dense ones
        become their FP32 tensors' ``.grad``; those of a non-protocol collection are returned
        with their parameter and given to it only once the dense update is accepted."""
        dense, embedding = [], []
        for i, (param, target) in enumerate(self._pairs):
            if param.grad is None:
                continue
            grad = param.grad.to(torch.float32)  # a new tensor for FP16 params
            param.grad = None
            if i < len(self._dense_targets):
                target.grad = grad
                dense.append(grad)
            else:
                embedding.append((target, grad))
        return dense, embedding

    def _dense_step(self) -> None:
        """The dense update (only the dense targets hold a .grad so far), after a backup of
        what it changes."""
        clock = self._clock
        self._backup.save()
        clock.lap("backup")
        with torch.no_grad():
            self.optimizer.step()
        clock.lap("dense_step")

    def _apply_update(
        self,
        embedding_grads: list[tuple[Tensor, Tensor]],
        new_max: float | None,
        embedding_done: bool = False,
    ) -> None:
        """After the dense update (:meth:`_dense_step`): its check (``new_max``: the largest
        new |master|, if already read), the embedding update (unless ``embedding_done``:
        applied already, gated on the same check), then the FP16 copies and the LR schedule.
        Undone, raising :class:`StepRefusedError`, if a new value cannot be stored."""
        clock = self._clock
        with torch.no_grad():
            reason = self._unstorable_dense_values(new_max)
            clock.lap("dense_check")
            if reason is None and self.protocol_embedding is not None and not embedding_done:
                try:
                    self.protocol_embedding.step()
                except ValueError as e:  # the protocol: refused, nothing changed
                    reason = str(e)
            clock.lap("embedding_step")
            if reason is not None:
                self._backup.restore()
                if self.protocol_embedding is not None:
                    self.protocol_embedding.zero_grad()
                raise StepRefusedError(self.report.steps + 1, reason)
            if embedding_grads:
                for target in self._dense_targets:
                    target.grad = None
                for target, grad in embedding_grads:
                    target.grad = grad
                self.optimizer.step()
                clock.lap("dense_step")
            if self.masters:  # the FP16 parameters: their masters rounded to nearest
                torch._foreach_copy_(self.dense_params, self.masters)
            clock.lap("fp16_copies")
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _unstorable_dense_values(self, max_abs: float | None) -> str | None:
        """None, or why the new dense values cannot be stored, naming the first parameter at
        fault: a value that is not finite, or (fp16) whose FP16 copy would overflow. From
        ``max_abs``, the masters' largest |x| (read here if None: :func:`_abs_range`, one
        read of the masters, not a trial copy); each master is read only if one is at fault."""
        targets = self._dense_targets
        limit = FP16_OVERFLOW if self.dense_precision == "fp16" else math.inf
        if max_abs is None:
            max_abs = float(_abs_range(targets)[0])
        if max_abs < limit:  # False for NaN
            return None
        for name, t in zip(self._dense_names, targets):
            largest = float(_abs_range([t])[0])
            if not math.isfinite(largest):
                return f"dense parameter '{name}': a new value is not finite"
            if largest >= limit:
                return f"dense parameter '{name}': a new value would overflow FP16 (|x| > 65504)"
        raise AssertionError("unreachable: some master is out of range")

    def _record(self, skipped: bool, max_abs: float, min_abs: float) -> None:
        report = self.report
        report.steps += 1
        if skipped:
            report.skipped += 1
        else:
            report.max_abs_grad = max(report.max_abs_grad, max_abs)
            report.min_abs_grad = min(report.min_abs_grad, min_abs)
        if self.scaler.scale != report.scale_trace[-1][1]:
            report.scale_trace.append((report.steps, self.scaler.scale))

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "masters": list(self.masters),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict()
            if self.lr_scheduler is not None
            else None,
            "report": dataclasses.asdict(self.report),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from what :meth:`state_dict` returned, all or nothing: the whole state is
        checked against this trainer first (a ValueError names the first difference), and only
        then loaded."""
        report = self._check_state(state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            for master, saved in zip(self.masters, state["masters"]):
                master.copy_(saved)
        self.scaler.load_state_dict(state["scaler"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.report = report

    def _check_state(self, state: dict) -> ScalingReport:
        """Raise ValueError unless ``state`` fits this trainer; returns its report."""
        missing = {"model", "masters", "optimizer", "scaler", "lr_scheduler", "report"} - set(state)
        if missing:
            raise ValueError(f"the trainer state lacks {sorted(missing)}")
        if len(state["masters"]) != len(self.masters):
            raise ValueError(
                "state has a different number of master tensors (dense_precision or model differ)"
            )
        for name, mine, saved in zip(self._dense_names, self.masters, state["masters"]):
            if not (
                isinstance(saved, Tensor)
                and saved.shape == mine.shape
                and saved.dtype == mine.dtype
            ):
                raise ValueError(f"the saved master of '{name}' does not fit it")
        check_state_dict(self.model, state["model"])
        groups, saved_groups = self.optimizer.param_groups, state["optimizer"]["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved_groups]:
            raise ValueError("the saved optimizer has other parameter groups")
        targets = [p for g in groups for p in g["params"]]
        saved_ids = [i for g in saved_groups for i in g["params"]]
        for param, i in zip(targets, saved_ids):
            for key, value in state["optimizer"]["state"].get(i, {}).items():
                if isinstance(value, Tensor) and value.numel() != 1 and value.shape != param.shape:
                    raise ValueError(
                        f"the saved optimizer state '{key}' does not fit its parameter"
                    )
        if not set(self.scaler.state_keys) <= set(state["scaler"]):
            raise ValueError(f"the saved loss scaler is not a {type(self.scaler).__name__}")
        if (state["lr_scheduler"] is None) != (self.lr_scheduler is None):
            raise ValueError("the saved trainer and this one differ in having an LR scheduler")
        try:
            return ScalingReport(**state["report"])
        except TypeError as e:
            raise ValueError(f"the saved report does not fit: {e}") from None
