"""Training and evaluation runs of DLRM: model construction, the training loop, evaluation,
checkpoints that resume bit-identically, and the JSON report (docs/contract.md §6-7).

A run lives in one directory (:mod:`dlrm.run_dir`): its checkpoints (written every
``checkpoint_every`` steps and at the end, :mod:`dlrm.checkpoint`) and ``report.json``. A
run is described by a
:class:`RunConfig`; resuming checks that the checkpoint was made by the same configuration
(everything but the step budget and the bookkeeping fields may not change).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from tqdm import tqdm

from dlrm import checkpoint, distributed, metrics, run_dir
from dlrm.data import batches as data_batches
from dlrm.data.criteo import DataError
from dlrm.data.synthetic import SyntheticCriteo, scaled_cardinalities
from dlrm.errors import RunError, Stopped
from dlrm.mixed_precision import (
    OPTIMIZERS,
    SCALERS,
    MixedPrecisionTrainer,
    StepRefusedError,
    make_scaler,
)
from dlrm.model import DLRM, PRESETS, SPARSE_KEYS, make_torchrec_ebc
from embcache.config import TableConfig


@dataclasses.dataclass
class RunConfig:
    """Everything that defines a run. Table options apply to every table unless ``tables``
    overrides them per table (``{"t_2": {"precision": "int4"}}``)."""

    data: str = "synthetic"  # a preprocessed directory, or "synthetic"
    # full Kaggle cardinalities, and rows enough for a 5% LFU cache to warm
    synthetic_rows: int = 12_000_000
    synthetic_scale: float = 1.0
    preset: str = "kaggle"
    embeddings: str = "embcache"  # or "torchrec" (FP32 baseline)
    precision: str = "int8"
    rounding: str = "stochastic"
    cache_ratio: float = 0.05
    associativity: int = 32
    policy: str = "lfu"
    emb_optimizer: str = "rowwise_adagrad"
    emb_lr: float = 0.05
    qparams: str = "fp32"
    min_rows_for_low_precision: int = 1000
    tables: dict = dataclasses.field(default_factory=dict)
    dense_precision: str = "fp16"
    loss_scaler: str = "backoff"
    static_scale: float = 1024.0
    optimizer: str = "adagrad"  # AdaGrad learns far faster than SGD in a few hundred steps
    lr: float = 0.01
    batch_size: int = 1024
    epochs: int = 1
    steps: int | None = None  # None: whole epochs
    eval_every: int = 100
    eval_batches: int = 20
    seed: int = 0
    # processes on this machine, each with a part of every batch and a shard of the tables
    nproc_per_node: int = 1
    # bookkeeping: may differ between a run and its resumption
    threads: int | None = None
    checkpoint_every: int = 500
    # stop (as if interrupted) after this many steps of this invocation
    stop_after: int | None = None
    # a run that skips this many steps in a row has diverged (more than the backoff scaler
    # needs to fall from its largest scale, 2^24, to 1)
    max_skipped_in_a_row: int = 25
    # also train the same run with FP32 tables (no cache) in out_dir/fp32, and compare
    compare_fp32: bool = False
    progress: bool = True

    BOOKKEEPING = (
        "steps",
        "threads",
        "checkpoint_every",
        "stop_after",
        "max_skipped_in_a_row",
        "compare_fp32",
        "progress",
        "eval_every",
        "nproc_per_node",  # a checkpoint resumes at any world size (embcache.resharding)
    )

    def identity(self) -> dict:
        """The fields a resumed run must share with the checkpoint."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.BOOKKEEPING}

    def validate(self) -> None:
        """Raise :class:`RunError` naming the first invalid field (as its command-line option)
        and its value. Reads nothing from disk: a run checks this before any work."""
        for name, (low, optional) in _INT_FIELDS.items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RunError(f"{_option(name)} must be an integer >= {low}, got {value!r}")
        for name, positive in _FLOAT_FIELDS.items():
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and math.isfinite(value)
            if not ok or value < 0 or (positive and value == 0):
                want = "positive" if positive else "non-negative"
                raise RunError(f"{_option(name)} must be a finite {want} number, got {value!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise RunError(f"{_option(name)} must be one of {', '.join(choices)}")
        if self.nproc_per_node > 1:
            if self.batch_size % self.nproc_per_node:
                raise RunError(
                    f"--batch-size ({self.batch_size}) must be a multiple of --nproc-per-node "
                    f"({self.nproc_per_node}): every process takes an equal part of a batch"
                )
            if self.embeddings != "embcache":
                raise RunError("--nproc-per-node > 1 shards our tables: use --embeddings embcache")
        for option, (field, value) in _TABLE_DEFAULT_OPTIONS.items():
            try:
                TableConfig(1, 1, **{field: getattr(self, value)})
            except (TypeError, ValueError) as e:
                raise RunError(f"{option}: {str(e).split(': ', 1)[-1]}") from None
        if self.data == "synthetic":  # refused here, not after the data are generated
            rows = max(scaled_cardinalities(self.synthetic_scale))
            try:
                TableConfig(rows, 1)
            except ValueError as e:
                rule = str(e).split(" must ", 1)[-1]
                raise RunError(
                    f"--synthetic-scale {self.synthetic_scale:g}: the largest table would have "
                    f"{rows:,} rows, and a table's rows must be {rule}"
                ) from None
        tables = [f"t_{i}" for i in range(len(SPARSE_KEYS))]
        for table, options in self.tables.items():
            if table not in tables:
                raise RunError(f"--table {table}: no such table (tables are t_0 ... {tables[-1]})")
            unknown = set(options) - _TABLE_OPTIONS
            if unknown:
                raise RunError(
                    f"--table {table}: unknown option {sorted(unknown)[0]!r} "
                    f"(options: {', '.join(sorted(_TABLE_OPTIONS))})"
                )
            try:
                TableConfig(1, 1, **{**self._table_defaults(), **options, "name": table})
            except (TypeError, ValueError) as e:
                raise RunError(f"--table {table}: {str(e).split(': ', 1)[-1]}") from None

    def _table_defaults(self) -> dict:
        """The options every table of an embcache run gets unless ``tables`` overrides them."""
        options = {field: getattr(self, own) for field, own in _TABLE_DEFAULT_OPTIONS.values()}
        options["seed"] = self.seed
        options["min_rows_for_low_precision"] = self.min_rows_for_low_precision
        return options


# (smallest value, None allowed) of each integer field, and whether each float must be > 0
_INT_FIELDS = {
    "synthetic_rows": (1, False),
    "min_rows_for_low_precision": (0, False),
    "batch_size": (1, False),
    "epochs": (1, False),
    "steps": (1, True),
    "eval_every": (0, False),  # 0: no validation during training
    "eval_batches": (1, False),
    "seed": (0, False),
    "threads": (1, True),
    "checkpoint_every": (1, False),
    "stop_after": (1, True),
    "max_skipped_in_a_row": (1, False),
    "nproc_per_node": (1, False),
}
_FLOAT_FIELDS = {"synthetic_scale": True, "static_scale": True, "lr": False}
_CHOICES = {
    "preset": tuple(PRESETS),
    "embeddings": ("embcache", "torchrec"),
    "dense_precision": ("fp32", "fp16"),
    "loss_scaler": SCALERS,
    "optimizer": OPTIMIZERS,
}
# what --table may set for one table (the rest is fixed by the run or the collection)
_TABLE_OPTIONS = {
    "precision",
    "rounding",
    "cache_ratio",
    "associativity",
    "policy",
    "optimizer",
    "lr",
    "eps",
    "qparams",
    "min_rows_for_low_precision",
}


# the command-line option of each table default: (TableConfig field, RunConfig field)
_TABLE_DEFAULT_OPTIONS = {
    "--precision": ("precision", "precision"),
    "--rounding": ("rounding", "rounding"),
    "--cache-ratio": ("cache_ratio", "cache_ratio"),
    "--associativity": ("associativity", "associativity"),
    "--policy": ("policy", "policy"),
    "--emb-optimizer": ("optimizer", "emb_optimizer"),
    "--emb-lr": ("lr", "emb_lr"),
    "--qparams": ("qparams", "qparams"),
}


def _option(field: str) -> str:
    return "--" + field.replace("_", "-")


# --------------------------------------------------------------------------- construction


def resolve_data(cfg: RunConfig, root: Path) -> Path:
    """The preprocessed directory of the run; the synthetic default is generated once into
    ``root/data/...`` (deterministic for the seed)."""
    if cfg.data != "synthetic":
        path = Path(cfg.data)
        data_batches.read_meta(path)  # DataError if not a preprocessed directory
        return path
    path = (
        root
        / "data"
        / f"synthetic-scale{cfg.synthetic_scale}-rows{cfg.synthetic_rows}-seed{cfg.seed}"
    )
    if not (path / "meta.json").exists():
        SyntheticCriteo(scale=cfg.synthetic_scale, seed=cfg.seed).write(
            path, cfg.synthetic_rows, progress=cfg.progress
        )
    return path


def build_model(cfg: RunConfig, cardinalities: list[int], device: str | None = None) -> DLRM:
    """The run's DLRM; ``device="meta"`` builds its tables without memory, to be sharded."""
    torch.manual_seed(cfg.seed)
    dim = PRESETS[cfg.preset].embedding_dim
    if cfg.embeddings == "torchrec":
        collection = make_torchrec_ebc(cardinalities, dim)
    elif cfg.embeddings == "embcache":
        from torchrec.modules.embedding_configs import EmbeddingBagConfig

        from embcache import CachedLowPrecisionEmbeddingBagCollection

        tables = [
            EmbeddingBagConfig(
                name=f"t_{i}", embedding_dim=dim, num_embeddings=n, feature_names=[key]
            )
            for i, (n, key) in enumerate(zip(cardinalities, SPARSE_KEYS))
        ]
        collection = CachedLowPrecisionEmbeddingBagCollection(
            tables, per_table=cfg.tables, device=device, **cfg._table_defaults()
        )
    else:
        raise RunError(f"--embeddings must be 'embcache' or 'torchrec', got {cfg.embeddings!r}")
    return DLRM.from_preset(cfg.preset, collection)


def _process_model(cfg: RunConfig, cardinalities: list[int], ranks, loading: bool) -> nn.Module:
    """This process's model: over several ranks DMP's, with only the rank's shards (built
    from the meta device); in one process the whole model, its tables left without memory
    when a checkpoint is about to fill them (``loading``), so none is drawn in vain."""
    if ranks.world_size > 1:
        model = build_model(cfg, cardinalities, device="meta")
        return distributed.shard(model, ranks, cfg.batch_size)
    return build_model(cfg, cardinalities, device="meta" if loading else None)


def build_trainer(cfg: RunConfig, model: DLRM) -> MixedPrecisionTrainer:
    kwargs = {"scale": cfg.static_scale} if cfg.loss_scaler == "static" else {}
    return MixedPrecisionTrainer(
        model,
        precision=cfg.dense_precision,
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        scaler=make_scaler(cfg.loss_scaler, **kwargs),
    )


# --------------------------------------------------------------------------- evaluation


def evaluate(
    model: nn.Module,
    dataset,
    split: str,
    batch_size: int,
    max_batches: int | None = None,
    ranks: distributed.Ranks = distributed.ONE_PROCESS,
) -> dict:
    """Metrics of ``model`` on ``split`` (all of it, or its first ``max_batches`` batches).
    Changes no state: the model is put in eval mode and gradients are off. Over several
    ranks each computes its part of every batch and all get the metrics of the whole."""
    was_training = model.training
    model.eval()
    labels, logits = [], []
    batches = data_batches.iterate_batches(dataset, split, batch_size, part=ranks.part)
    with torch.no_grad():
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            logits.append(model(batch.dense, batch.sparse).float())
            labels.append(batch.labels)
    model.train(was_training)
    if not labels:
        raise RunError(f"the {split} split is empty: more rows are needed")
    parts = ranks.gather((torch.cat(labels).numpy(), torch.cat(logits).numpy()))
    return metrics.evaluate(
        np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    )


# --------------------------------------------------------------------------- the run


def _embedding_report(model: nn.Module, ranks: distributed.Ranks) -> dict:
    """Memory, FP32 equivalent, hit rate and per-table figures of the embedding tables; over
    several ranks, of every rank's shards, with the rank of each and the memory per rank."""
    dmp = isinstance(model, DistributedModelParallel)
    collection = (model.module if dmp else model).embedding_collection
    if not hasattr(collection, "stats"):
        fp32 = sum(p.nbytes for p in collection.parameters())
        return {"memory_bytes": fp32, "fp32_bytes": fp32, "compression_factor": 1.0}
    tables = distributed.process_tables(model)
    mine = {}
    for name, t in tables.items():
        memory, stats, c = t.memory_bytes(), t.stats(), t.config
        mine[name] = {
            "precision": c.stored_precision,
            "rows": c.num_embeddings,
            "cache_slots": c.num_slots,
            "lookups": stats["lookups"],
            "hits": stats["hits"],
            "memory_bytes": memory["total"],
            # FP32 rows with the same optimizer state: the compression factor's denominator
            "fp32_bytes": c.num_embeddings * c.embedding_dim * 4 + memory["optimizer_state"],
        }
    parts = ranks.gather(mine)
    entries = {name: (rank, e) for rank, part in enumerate(parts) for name, e in part.items()}
    cached = [e for _, e in entries.values() if e["cache_slots"] > 0]
    lookups = sum(e["lookups"] for e in cached)
    memory = sum(e["memory_bytes"] for _, e in entries.values())
    fp32 = sum(e["fp32_bytes"] for _, e in entries.values())
    report = {
        # over the tables that have a cache (small tables stay FP32 without one)
        "hit_rate": sum(e["hits"] for e in cached) / lookups if lookups else 0.0,
        "memory_bytes": memory,
        "fp32_bytes": fp32,
        "compression_factor": memory / fp32,
        "tables": {
            name: {
                **({"rank": rank} if ranks.world_size > 1 else {}),
                "precision": e["precision"],
                "rows": e["rows"],
                "cache_slots": e["cache_slots"],
                "hit_rate": e["hits"] / e["lookups"] if e["lookups"] else 0.0,
                "memory_bytes": e["memory_bytes"],
            }
            for name, (rank, e) in entries.items()
        },
    }
    if ranks.world_size > 1:
        report["memory_bytes_per_rank"] = [
            sum(e["memory_bytes"] for e in part.values()) for part in parts
        ]
        report["sharding"] = distributed.sharding_report(model)
    return report


def train(cfg: RunConfig, out_dir: Path, resume: bool = False) -> dict:
    """Train (or resume) a run in ``out_dir``; returns the report (also in report.json).

    Everything that can be refused without work is refused first (RunError), before any
    directory is made or any data generated: an invalid option, an ``out_dir`` that is a
    file, missing data, ``resume`` with nothing to resume. The run then holds ``out_dir``
    for its whole life (:func:`dlrm.run_dir.lock`: a second writer is refused at once).

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
    (:mod:`dlrm.distributed`); rank 0 writes the report, and it is returned."""
    cfg.validate()
    ranks = distributed.Ranks.current()
    if ranks.world_size > 1:  # a rank of a launched run: the launcher holds out_dir
        return _train_here(cfg, out_dir, resume, ranks)
    _refuse_early(cfg, out_dir, resume)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"cannot create the output directory {out_dir}: {e.strerror}") from None
    if not os.access(out_dir, os.W_OK):
        raise RunError(f"the output directory {out_dir} is not writable")
    with run_dir.lock(out_dir):
        if cfg.nproc_per_node == 1:
            return _train_here(cfg, out_dir, resume, ranks)
        _resolve_dataset(cfg, out_dir)  # once, before the processes start
        try:
            return distributed.launch(
                "train", cfg.nproc_per_node, dataclasses.asdict(cfg), out_dir, resume
            )
        except Stopped as e:
            path = run_dir.latest_checkpoint(out_dir)
            step = run_dir.read_manifest(path)["step"] if path else None
            return {"stopped_at_step": None, "signal": str(e), "checkpoint_step": step}


def _refuse_early(cfg: RunConfig, out_dir: Path, resume: bool) -> None:
    """Raise RunError for what can be refused without work (see :func:`train`)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunError(f"--out {out_dir}: is a file, not a directory")
    if cfg.data != "synthetic":
        try:
            data_batches.read_meta(Path(cfg.data))
        except DataError as e:
            raise RunError(str(e)) from None
    if resume:
        run_dir.require_checkpoint(out_dir)


def _resolve_dataset(cfg: RunConfig, out_dir: Path):
    """(directory, dataset) of the run's data (generated once if synthetic)."""
    try:
        data_dir = resolve_data(cfg, out_dir.parent if out_dir.parent != out_dir else out_dir)
        return data_dir, data_batches.load(data_dir)
    except DataError as e:
        raise RunError(str(e)) from None


def _train_here(cfg: RunConfig, out_dir: Path, resume: bool, ranks) -> dict:
    """This process's part of :func:`train`: all of it in one process, one rank's part
    (its part of every batch, its shards) of a launched run."""
    if ranks.world_size != cfg.nproc_per_node:
        raise RunError(
            f"--nproc-per-node is {cfg.nproc_per_node} but {ranks.world_size} processes run"
        )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if resume:  # its configuration is checked before the data are made
        path = run_dir.require_checkpoint(out_dir)
        saved = checkpoint.open_checkpoint(path, ranks)
        checkpoint.check(saved, path, cfg, None)
    data_dir, dataset = _resolve_dataset(cfg, out_dir)
    run_data = _run_data(data_dir, dataset)
    model = _process_model(cfg, list(dataset.meta["cardinalities"]), ranks, loading=resume)
    trainer = build_trainer(cfg, model)
    if resume:
        checkpoint.check(saved, path, cfg, run_data)
        checkpoint.load_into(trainer, path, saved, ranks)
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

    train_rows = dataset.split("train")[1] - dataset.split("train")[0]
    per_epoch = data_batches.num_batches(train_rows, cfg.batch_size, drop_last=True)
    if per_epoch == 0:
        raise RunError(
            f"the train split has {train_rows} rows, fewer than one batch of {cfg.batch_size}"
        )
    probe = next(
        iter(data_batches.iterate_batches(dataset, "train", cfg.batch_size, part=ranks.part))
    )
    total = cfg.steps if cfg.steps is not None else cfg.epochs * per_epoch
    this_run = 0
    diverged = None
    checkpoint_due = False
    bar = tqdm(
        total=total,
        initial=progress["step"],
        desc="train",
        unit="step",
        disable=not (cfg.progress and ranks.main),
    )
    start = time.perf_counter()
    with _StopRequests(interrupt_twice=ranks.world_size == 1) as stop:
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
            for batch in batches:
                try:
                    out = trainer.train_step(
                        batch.dense, batch.sparse, batch.labels, stop=stop.signal is not None
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
                bar.set_postfix(loss=f"{out['loss']:.4f}", scale=f"{out['scale']:g}")
                step = progress["step"]
                if in_a_row >= cfg.max_skipped_in_a_row:
                    diverged = {
                        "step": step,
                        "reason": f"steps {step - in_a_row + 1} to {step} were all skipped "
                        f"(non-finite loss or gradients; loss scale now {trainer.scaler.scale:g})",
                    }
                    break
                if cfg.eval_every and step % cfg.eval_every == 0:
                    m = evaluate(model, dataset, "val", cfg.batch_size, cfg.eval_batches, ranks)
                    progress["evals"].append({"step": step, **m})
                    if ranks.main:
                        bar.write(f"step {step}: val {_metrics_line(m)}")
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
                    checkpoint.save(out_dir, cfg, trainer, progress, run_data, ranks)
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
        report = _report(cfg, dataset, data_dir, trainer, progress, None, ranks)
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
        test = evaluate(model, dataset, "test", cfg.batch_size, ranks=ranks)
        report = _report(cfg, dataset, data_dir, trainer, progress, test, ranks)
        if cfg.compare_fp32:
            report["compare_fp32"] = _compare_fp32(cfg, out_dir, data_dir, report, resume)
    if ranks.main:
        text = json.dumps(_strict_json(report), indent=2, allow_nan=False, default=_json_default)
        run_dir.write_atomically(out_dir / "report.json", lambda p: p.write_text(text))
    return report


def _predicts_finite(model: nn.Module, batches: list, ranks) -> bool:
    """Whether ``model`` gives a finite logit for every example of ``batches`` on every
    rank (in eval mode: no state changes): the test of a state worth a checkpoint."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        finite = all(bool(torch.isfinite(model(b.dense, b.sparse)).all()) for b in batches)
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
    data; resumed if it was interrupted) and set its results beside ``report``'s."""
    fp32_cfg = dataclasses.replace(
        cfg, data=str(data_dir), precision="fp32", cache_ratio=0.0, tables={}, compare_fp32=False
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


def _peak_rss_bytes() -> int:
    """The process's peak resident memory so far."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError):  # not Linux: getrusage's maximum (KiB on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _metrics_line(m: dict) -> str:
    """``auc 0.7123 logloss 0.4567``, with ``n/a`` for an undefined metric."""
    return " ".join(
        f"{name} " + ("n/a" if m[key] is None else f"{m[key]:.4f}")
        for name, key in (("auc", "auc"), ("logloss", "log_loss"))
    )


def _report(cfg, dataset, data_dir, trainer, progress, test, ranks) -> dict:
    """The run's report (as report.json holds it, before :func:`_strict_json`)."""
    scaling = trainer.report
    rss = ranks.gather(_peak_rss_bytes())
    min_grad = scaling.min_abs_grad
    return {
        "status": "completed",
        "config": dataclasses.asdict(cfg),
        "data": {
            "dir": str(data_dir),
            "rows": dataset.meta["rows"],
            "cardinalities": list(dataset.meta["cardinalities"]),
            "bayes_auc": dataset.meta.get("bayes_auc"),
        },
        "steps": progress["step"],
        "evals": progress["evals"],
        "test": test,
        "samples_per_second": progress["samples"] / max(progress["train_seconds"], 1e-9),
        "loss_scale": {
            "final": trainer.scaler.scale,
            "changes": len(scaling.scale_trace) - 1,
            "trace": scaling.scale_trace[-50:],
            "min": min(s for _, s in scaling.scale_trace),
            "max": max(s for _, s in scaling.scale_trace),
        },
        "skipped_steps": scaling.skipped,
        "grad_abs": {
            "min": min_grad if math.isfinite(min_grad) else None,
            "max": scaling.max_abs_grad,
            **({} if math.isfinite(min_grad) else {"min_undefined": "no non-zero gradient"}),
        },
        "embeddings": _embedding_report(trainer.model, ranks),
        "world_size": ranks.world_size,
        "peak_rss_bytes": max(rss),
        **({"peak_rss_bytes_per_rank": rss} if ranks.world_size > 1 else {}),
    }


def _strict_json(x):
    """``x`` with no NaN or infinity left, so that it is valid strict JSON: a non-finite float
    becomes null and, as a value in a dict under ``key``, ``key_undefined`` beside it says what
    it was (unless the report already says why)."""
    if isinstance(x, dict):
        out = {}
        for key, value in x.items():
            if isinstance(value, (float, np.floating)) and not math.isfinite(value):
                out[key] = None
                out.setdefault(f"{key}_undefined", f"not finite ({value})")
            else:
                out[key] = _strict_json(value)
        return out
    if isinstance(x, (list, tuple)):
        return [
            None
            if isinstance(v, (float, np.floating)) and not math.isfinite(v)
            else _strict_json(v)
            for v in x
        ]
    return x


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(type(x))


def evaluate_checkpoint(cfg: RunConfig, out_dir: Path, split: str) -> dict:
    """Metrics of the latest checkpoint in ``out_dir`` on ``split``, with the run's own
    config, in ``cfg.nproc_per_node`` processes whatever number wrote it (each loads its
    own shards, cut anew at another world size). Reads ``out_dir`` only: it may run while
    the run trains."""
    ranks = distributed.Ranks.current()
    path = run_dir.require_checkpoint(out_dir)
    if cfg.nproc_per_node > 1 and ranks.world_size == 1:  # start the processes
        return distributed.launch(
            "evaluate", cfg.nproc_per_node, dataclasses.asdict(cfg), out_dir, split
        )
    saved = checkpoint.open_checkpoint(path, ranks)
    try:
        cfg = dataclasses.replace(cfg, **saved["config"])
        cfg.validate()
    except (TypeError, RunError) as e:
        raise RunError(f"{path}: the configuration it holds is not valid ({e})") from None
    data_dir, dataset = _resolve_dataset(cfg, out_dir)
    model = _process_model(cfg, list(dataset.meta["cardinalities"]), ranks, loading=True)
    checkpoint.check(saved, path, cfg, _run_data(data_dir, dataset))
    checkpoint.load_into(build_trainer(cfg, model), path, saved, ranks)
    return evaluate(model, dataset, split, cfg.batch_size, ranks=ranks)


def _run_data(data_dir: Path, dataset) -> dict:
    """What a checkpoint records of its dataset (see :func:`dlrm.checkpoint.check`)."""
    return {"dir": str(Path(data_dir).resolve()), "fingerprint": dataset.meta["fingerprint"]}
