"""Training a run of DLRM (``dlrm train``): the entry that refuses what it can before any
work, holds the run directory and starts the processes, and the training loop
(docs/contract.md §6-7).

A run lives in one directory (:mod:`dlrm.run_dir`): its checkpoints (written every
``checkpoint_every`` steps and at the end, :mod:`dlrm.checkpoint`) and ``report.json``
(:mod:`dlrm.report`). A run is described by a :class:`dlrm.config.RunConfig`; resuming
checks that the checkpoint was made by the same configuration (everything but the step
budget and the bookkeeping fields may not change) and continues bit-identically.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from dlrm import checkpoint, distributed, run_dir
from dlrm.build import build_trainer, process_model, resolve_dataset, run_data
from dlrm.config import RunConfig
from dlrm.data import batches as data_batches
from dlrm.data.criteo import DataError, split_ranges
from dlrm.errors import RunError, Stopped
from dlrm.evaluate import evaluate
from dlrm.mixed_precision import StepRefusedError
from dlrm.monitor import RunMonitor
from dlrm.plan import plan_run, refuse_unmeetable, run_cardinalities, with_plan
from dlrm.report import describe_device, make_report, metrics_line, write_report


def train(cfg: RunConfig, out_dir: Path, resume: bool = False) -> dict:
    """Train (or resume) a run in ``out_dir``; returns the report (also in report.json).

    Everything that can be refused without work is refused first (RunError), before any
    directory is made or any data generated: an invalid option, an ``out_dir`` that is a
    file, missing data, a batch larger than the train split, ``resume`` with nothing to
    resume. The run then holds ``out_dir`` for its whole life (:func:`dlrm.run_dir.lock`: a
    second writer is refused at once).

    A run that diverges -- a step refused because its new values cannot be stored, or
    ``max_skipped_in_a_row`` steps in a row skipped for non-finite gradients -- stops there:
    its report has ``status: "diverged"`` with the step and the reason, and its last
    checkpoint is kept. A checkpoint is written only from a model whose outputs are finite
    (on a fixed batch and on the step's own), and one due while steps are being skipped
    waits for the next applied step, so the last checkpoint holds a usable model.

    SIGINT or SIGTERM stops a run after the step in progress, with a checkpoint at that step
    if the model is good; the result is then ``{"stopped_at_step", "signal",
    "checkpoint_step"}``, as for a run stopped by ``stop_after`` (``signal`` None).

    With ``nproc_per_node > 1`` the data are made ready here, then ``nproc_per_node``
    processes each run this function on a part of every batch and a shard of the tables
    (:mod:`dlrm.distributed`); rank 0 writes the report, and it is returned.

    With ``memory_budget`` the tables are first planned to fit it (:mod:`dlrm.plan`; with
    ``host_memory_budget`` their placements too), the run trains with the plan's per-table
    options, and the report holds the plan under ``plan``."""
    cfg.validate()
    ranks = distributed.Ranks.current()
    if ranks.world_size > 1:  # a rank of a launched run: the launcher holds out_dir
        if cfg.memory_budget is not None:  # it would train unplanned tables
            raise RunError(
                "--memory-budget is planned by the process that starts the run: use "
                "--nproc-per-node, not a launcher of your own"
            )
        return _train_here(cfg, out_dir, resume, ranks)
    _refuse_early(cfg, out_dir, resume)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"cannot create the output directory {out_dir}: {e.strerror}") from None
    if not os.access(out_dir, os.W_OK):
        raise RunError(f"the output directory {out_dir} is not writable")
    with run_dir.lock(out_dir):
        plan = None
        if cfg.memory_budget is not None:
            plan = plan_run(cfg, resolve_dataset(cfg, out_dir)[1])
            cfg = with_plan(cfg, plan)
        if cfg.nproc_per_node == 1:
            return _train_here(cfg, out_dir, resume, ranks, plan)
        resolve_dataset(cfg, out_dir)  # once, before the processes start
        try:
            return distributed.launch(
                _train_rank,
                cfg.nproc_per_node,
                cfg,
                out_dir,
                resume,
                plan,
                device_type=cfg.torch_device().type,
            )
        except Stopped as e:
            path = run_dir.latest_checkpoint(out_dir)
            step = run_dir.read_manifest(path)["step"] if path else None
            return {"stopped_at_step": None, "signal": str(e), "checkpoint_step": step}


def _train_rank(cfg: RunConfig, out_dir: Path, resume: bool, plan: dict | None) -> dict:
    """A launched process's entry: its rank's part of :func:`train`, whose launcher checked
    ``cfg`` and planned the tables (``plan``, for the report)."""
    return _train_here(cfg, out_dir, resume, distributed.Ranks.current(), plan)


def _refuse_early(cfg: RunConfig, out_dir: Path, resume: bool) -> None:
    """Raise RunError for what can be refused without work (see :func:`train`)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunError(f"--out {out_dir}: is a file, not a directory")
    cfg.torch_device()  # a device this machine has
    if cfg.data == "synthetic":  # the rows it will have, split as every dataset is
        train_rows = split_ranges(cfg.synthetic_rows)["train"]
        data = f"--synthetic-rows {cfg.synthetic_rows}"
    else:
        data = cfg.data
        try:
            meta = data_batches.read_meta(Path(cfg.data))
        except DataError as e:
            raise RunError(str(e)) from None
        try:
            train_rows = meta["splits"]["train"]
        except (KeyError, TypeError):
            raise RunError(f"{Path(cfg.data) / 'meta.json'}: no train split") from None
    _refuse_batch_size(cfg, train_rows[1] - train_rows[0], data)
    if resume:
        run_dir.require_checkpoint(out_dir)
    if cfg.memory_budget is not None:  # its data's meta.json was read above
        refuse_unmeetable(cfg, run_cardinalities(cfg))


def _refuse_batch_size(cfg: RunConfig, train_rows: int, data: str) -> None:
    """RunError if a (global) batch of ``cfg.batch_size`` rows is more than the ``train_rows``
    rows of the train split of ``data``: no batch would fill (the last, partial one of an
    epoch is dropped)."""
    if cfg.batch_size > train_rows:
        raise RunError(
            f"--batch-size {cfg.batch_size}: more than the {train_rows} rows of the train "
            f"split ({data}), so no batch would fill"
        )


def _train_here(cfg: RunConfig, out_dir: Path, resume: bool, ranks, plan=None) -> dict:
    """This process's part of :func:`train`: all of it in one process, one rank's part
    (its part of every batch, its shards) of a launched run; ``plan``, the tables' plan to
    report."""
    if ranks.world_size != cfg.nproc_per_node:
        raise RunError(
            f"--nproc-per-node is {cfg.nproc_per_node} but {ranks.world_size} processes run"
        )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = cfg.torch_device(ranks.rank)  # one machine: the local rank is the rank
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if resume:  # its configuration is checked before the data are made
        path = run_dir.require_checkpoint(out_dir)
        saved = checkpoint.open_checkpoint(path, ranks)
        checkpoint.check(saved, path, cfg, None)
    data_dir, dataset = resolve_dataset(cfg, out_dir)
    data = run_data(data_dir, dataset)
    model = process_model(cfg, list(dataset.meta["cardinalities"]), ranks, resume, device)
    trainer = build_trainer(cfg, model)
    if resume:
        checkpoint.check(saved, path, cfg, data)
        checkpoint.load_into(trainer, path, saved, ranks, device)
        progress = saved["progress"]
        del saved
    else:
        progress = {
            "step": 0,
            "epoch": 0,
            "batch": 0,
            "evals": [],
            "train_seconds": 0.0,
            "samples": 0,
            "run": ranks.gather(secrets.token_hex(8))[0],  # names the run's checkpoints
        }
    # where each part of the run trained: a run may resume on another device
    progress.setdefault("devices", []).append(
        {"step": progress["step"], "device": describe_device(device)}
    )

    train_rows = dataset.split("train")[1] - dataset.split("train")[0]
    _refuse_batch_size(cfg, train_rows, str(data_dir))  # if a launcher of its own started it
    per_epoch = data_batches.num_batches(train_rows, cfg.batch_size, drop_last=True)
    probe = next(
        iter(data_batches.iterate_batches(dataset, "train", cfg.batch_size, part=ranks.part))
    ).to(device)
    total = cfg.steps if cfg.steps is not None else cfg.epochs * per_epoch
    this_run = 0
    diverged = None
    checkpoint_due = False
    on_terminal = sys.stderr.isatty()  # else a bar's carriage returns would fill the log
    bar = tqdm(
        total=total,
        initial=progress["step"],
        desc=f"train ({device})",
        unit="step",
        disable=not (cfg.progress and ranks.main and on_terminal),
    )
    monitor = RunMonitor(
        out_dir,
        model,
        ranks,
        every=cfg.log_every,
        first_step=progress["step"],
        scaler=trainer.scaler,
        tensorboard=Path(cfg.tensorboard) if cfg.tensorboard else None,
        log_lines=cfg.progress and not on_terminal,
    )
    if cfg.progress and ranks.main and not on_terminal:  # (on a terminal the bar says it)
        print(f"train: {describe_device(device)}", file=sys.stderr, flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with _StopRequests(interrupt_twice=ranks.world_size == 1) as stop, monitor:
        while progress["step"] < total:
            batches = data_batches.iterate_batches(
                dataset,
                "train",
                cfg.batch_size,
                shuffle=True,
                seed=cfg.seed,
                epoch=progress["epoch"],
                drop_last=True,
                start_batch=progress["batch"],
                part=ranks.part,
            )
            for batch, following in data_batches.with_next(data_batches.on_device(batches, device)):
                try:
                    out = trainer.train_step(
                        batch.dense,
                        batch.ids,
                        batch.labels,
                        stop=stop.signal is not None,
                        next_sparse=None if following is None else following.ids,
                    )
                except StepRefusedError as e:
                    diverged = {"step": e.step, "reason": str(e)}
                    break
                progress["step"] += 1
                progress["batch"] += 1
                progress["samples"] += cfg.batch_size
                in_a_row = progress.get("skipped_in_a_row", 0) + 1 if out["skipped"] else 0
                progress["skipped_in_a_row"] = in_a_row
                this_run += 1
                bar.update(1)
                step = progress["step"]
                if step % cfg.log_every == 0 or step == total:  # reading the loss waits for it
                    bar.set_postfix(loss=f"{float(out['loss']):.4f}", scale=f"{out['scale']:g}")
                monitor.step(step, out, cfg.batch_size)
                if in_a_row >= cfg.max_skipped_in_a_row:
                    diverged = {
                        "step": step,
                        "reason": f"steps {step - in_a_row + 1} to {step} were all skipped "
                        f"(non-finite loss or gradients; loss scale now {trainer.scaler.scale:g})",
                    }
                    break
                if cfg.eval_every and step % cfg.eval_every == 0:
                    m = evaluate(
                        model, dataset, "val", cfg.batch_size, cfg.eval_batches, ranks, device
                    )
                    progress["evals"].append({"step": step, **m})
                    monitor.evaluation(step, m)
                    if ranks.main:
                        bar.write(f"step {step}: val {metrics_line(m)}")
                done = (
                    step >= total
                    or (cfg.stop_after is not None and this_run >= cfg.stop_after)
                    or out["stop"]  # every rank in the same step
                )
                checkpoint_due = checkpoint_due or step % cfg.checkpoint_every == 0
                # mid-run, not while steps are being skipped (the model may be failing);
                # never from a model whose outputs are not finite
                due = done or (checkpoint_due and not in_a_row)
                if due and _predicts_finite(model, [probe, batch], ranks):
                    progress["train_seconds"] += time.perf_counter() - start
                    start = time.perf_counter()
                    progress["checkpoint_step"] = step
                    checkpoint.save(out_dir, cfg, trainer, progress, data, ranks)
                    checkpoint_due = False
                if done:
                    break
            else:  # the epoch's batches are used up: on to the next epoch
                progress["epoch"] += 1
                progress["batch"] = 0
                continue
            break  # done, or diverged
    bar.close()
    if diverged:
        progress["train_seconds"] += time.perf_counter() - start
        diverged["last_checkpoint_step"] = progress.get("checkpoint_step")
        report = make_report(cfg, dataset, data_dir, trainer, progress, None, ranks, device)
        report["status"] = "diverged"
        report["diverged"] = diverged
        report["undefined"] = {"test": "the run diverged"}
    elif progress["step"] < total:
        return {
            "stopped_at_step": progress["step"],
            "signal": stop.signal,
            "checkpoint_step": progress.get("checkpoint_step"),
        }
    else:
        test = evaluate(model, dataset, "test", cfg.batch_size, ranks=ranks, device=device)
        report = make_report(cfg, dataset, data_dir, trainer, progress, test, ranks, device)
        if cfg.compare_fp32:
            report["compare_fp32"] = _compare_fp32(cfg, out_dir, data_dir, report, resume)
    if plan is not None:
        report["plan"] = plan
    if ranks.main:
        write_report(out_dir, report)
    return report


def _predicts_finite(model: nn.Module, batches: list, ranks) -> bool:
    """Whether ``model`` gives a finite logit for every example of ``batches`` on every
    rank (in eval mode: no state changes): the test of a state worth a checkpoint."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        finite = all(bool(torch.isfinite(model(b.dense, b.ids)).all()) for b in batches)
    model.train(was_training)
    return not ranks.any(not finite)


class _StopRequests:
    """SIGINT and SIGTERM while a run trains: the first asks the loop to stop after the step
    in progress (``signal`` names it). A second one interrupts at once (KeyboardInterrupt)
    if ``interrupt_twice``; the ranks of a launched run ignore it, since the launcher
    forwards the signal it got and waits for them. Installed from the main thread only."""

    def __init__(self, interrupt_twice: bool):
        self.signal: str | None = None
        self._interrupt_twice = interrupt_twice
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signal is not None and self._interrupt_twice:
            raise KeyboardInterrupt
        self.signal = self.signal or signal.Signals(signum).name

    def __enter__(self) -> _StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {
                s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)
            }
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _compare_fp32(cfg: RunConfig, out_dir: Path, data_dir: Path, report: dict, resume: bool):
    """Train the same run with FP32 tables and no cache in ``out_dir/fp32`` (on the same
    data; resumed if it was interrupted) and set its results beside ``report``'s. Each table
    keeps its placement (FP32 tables are larger still: one placed in host memory stays)."""
    fp32_cfg = dataclasses.replace(
        cfg,
        data=str(data_dir),
        precision="fp32",
        cache_ratio=0.0,
        tables={
            n: {"placement": "host"} for n, o in cfg.tables.items() if o.get("placement") == "host"
        },
        memory_budget=None,
        host_memory_budget=None,
        compare_fp32=False,
    )
    fp32_dir = out_dir / "fp32"
    fp32_resume = resume and run_dir.latest_checkpoint(fp32_dir) is not None
    fp32 = train(fp32_cfg, fp32_dir, resume=fp32_resume)
    if fp32.get("status") != "completed":
        return {"dir": str(fp32_dir), "status": fp32.get("status", "stopped")}
    ours, theirs = report["test"], fp32["test"]
    return {
        "dir": str(fp32_dir),
        "status": "completed",
        "test": theirs,
        "auc_difference": None
        if ours["auc"] is None or theirs["auc"] is None
        else ours["auc"] - theirs["auc"],
        "embedding_memory_bytes": fp32["embeddings"]["memory_bytes"],
        "samples_per_second": fp32["samples_per_second"],
    }
