"""Watching a run while it trains (``dlrm train --log-every N --tensorboard DIR``).

Every ``N`` steps, and at a run's end (finished, stopped or diverged) for the steps since
the last such record, the interval's figures -- mean loss (null if a step's loss was not
finite), the loss scale (after the interval's last step: the next step's), skipped steps,
samples/s and, per table, the hit rate, insertions, evictions and bypasses of the interval,
and its precision telemetry (the rounding's mean and largest error, the shares rounded up
and expected up, the share of rows never updated: :mod:`embcache.telemetry`) -- and every
validation go to:

* ``OUT/history.jsonl``, one JSON object a line (what ``dlrm report`` plots; its first line
  describes the run: each table's precision, memory and FP32 size). A resumed run keeps the
  lines up to the step it resumes from;
* TensorBoard event files in ``DIR`` (``train/*``, ``val/*``, ``tables/<table>/*``), if asked;
* one line on stderr when stderr is not a terminal, where a progress bar would write a
  carriage return every step; on a terminal the bar shows them.

Over several ranks the figures are gathered (tables) or agreed on (loss, by all-reduce) and
rank 0 writes. Everything is computed from counters the tables keep anyway: the cost is one
small collective and one line of JSON every ``N`` steps.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dlrm import run_dir
from dlrm.errors import RunError
from dlrm.report import TABLE_COUNTS, table_figures
from embcache.telemetry import PROBE_COUNTERS, rounding_figures

HISTORY = "history.jsonl"


class RunMonitor:
    """The running record of one run in ``out_dir`` (see the module's docstring), used as a
    context: ``step`` after every training step, ``evaluation`` after every validation;
    every rank calls them at the same steps. ``scaler``: the trainer's loss scaler, whose
    ``scale`` an interval records. Leaving the context without an exception writes the steps
    since the last interval as a last, shorter one (so the history ends at the run's last
    step and final loss scale, however few its steps); every rank leaves it at the same
    step."""

    def __init__(
        self,
        out_dir: Path,
        model: nn.Module,
        ranks,
        every: int,
        first_step: int,
        scaler,
        tensorboard: Path | None = None,
        log_lines: bool = False,
    ):
        self.model, self.ranks, self.every, self.scaler = model, ranks, every, scaler
        self.history = out_dir / HISTORY
        self.log_lines = log_lines and ranks.main
        self._loss_sum, self._steps, self._skipped = 0.0, 0, 0
        self._last_step = first_step
        self._start = time.perf_counter()
        self._samples = 0
        tables = table_figures(model, ranks)
        self._counts = _counts(tables)
        self.writer = None
        if not ranks.main:
            return
        kept = _history_until(self.history, first_step)
        if not kept:
            kept = [json.dumps({"tables": _describe(tables)}) + "\n"]
        run_dir.write_atomically(self.history, lambda p: p.write_text("".join(kept)))
        if tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RunError(
                    "--tensorboard needs the tensorboard package: pip install tensorboard"
                ) from None
            # a resumed run's events after first_step are superseded by the new ones
            self.writer = SummaryWriter(str(tensorboard), purge_step=first_step + 1)

    def step(self, step: int, out: dict, samples: int) -> None:
        """Count one training step (``out``: the trainer's result, ``samples``: the global
        batch); at every ``every``-th step, write the interval's figures."""
        self._loss_sum += out["loss"]
        self._steps += 1
        self._skipped += bool(out["skipped"])
        self._samples += samples
        self._last_step = step
        if step % self.every == 0:
            self._write_interval(step)

    def evaluation(self, step: int, metrics: dict) -> None:
        if not self.ranks.main:
            return
        self._append({"step": step, "val": metrics})
        if self.writer is not None:
            for key in ("auc", "log_loss", "accuracy", "normalized_entropy"):
                if metrics.get(key) is not None:
                    self.writer.add_scalar(f"val/{key}", metrics[key], step)

    def __enter__(self) -> RunMonitor:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if exc_type is None and self._steps:  # steps since the last interval
                self._write_interval(self._last_step)
        finally:
            if self.writer is not None:
                self.writer.close()

    def _write_interval(self, step: int) -> None:
        seconds = time.perf_counter() - self._start
        sums = torch.tensor([float(self._loss_sum), float(self._steps)], dtype=torch.float64)
        if self.ranks.group is not None:  # the loss of every rank's part of the batches
            dist.all_reduce(sums, group=self.ranks.group)
        loss_sum, steps = sums.tolist()
        tables = table_figures(self.model, self.ranks)
        counts = _counts(tables)
        loss = loss_sum / max(steps, 1.0)
        record = {
            "step": step,
            # null if a step's loss was not finite: strict JSON has no NaN or Infinity
            "loss": loss if math.isfinite(loss) else None,
            "scale": self.scaler.scale,
            "skipped": self._skipped,  # the ranks skip together
            "samples_per_second": self._samples / max(seconds, 1e-9),
            "tables": {name: _interval(counts[name], self._counts.get(name)) for name in counts},
        }
        self._counts = counts
        self._loss_sum, self._steps, self._skipped, self._samples = 0.0, 0, 0, 0
        self._start = time.perf_counter()
        if not self.ranks.main:
            return
        self._append(record)
        if self.writer is not None:
            for key in ("loss", "scale", "skipped", "samples_per_second"):
                tag = "loss_scale" if key == "scale" else key
                if record[key] is not None:
                    self.writer.add_scalar(f"train/{tag}", record[key], step)
            for name, figures in record["tables"].items():
                for key, value in figures.items():
                    if key not in PROBE_COUNTERS:  # their figures are there
                        self.writer.add_scalar(f"tables/{name}/{key}", value, step)
            self.writer.flush()
        if self.log_lines:
            print(
                f"step {step}: loss {loss:.4f} scale {record['scale']:g} "
                f"skipped {record['skipped']} samples/s {record['samples_per_second']:.0f}",
                file=sys.stderr,
                flush=True,
            )

    def _append(self, record: dict) -> None:
        with open(self.history, "a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")


def read_history(out_dir: Path) -> list[dict]:
    """The records of ``out_dir/history.jsonl`` (an unfinished last line, from a run killed
    while writing it, is left out)."""
    records = []
    for line in (out_dir / HISTORY).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return records


def _history_until(path: Path, step: int) -> list[str]:
    """The lines of the history at ``path`` up to ``step`` (its first line, the run's
    description, included); none if there is no history or ``step`` is 0."""
    if step == 0 or not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            break
        if record.get("step", 0) <= step and line.endswith("\n"):
            kept.append(line)
    return kept


def _counts(tables: dict | None) -> dict:
    keys = (*TABLE_COUNTS, "untouched_share")
    return {name: {k: e[k] for k in keys} for name, e in (tables or {}).items()}


def _describe(tables: dict | None) -> dict:
    keys = ("precision", "rows", "cache_slots", "memory_bytes", "fp32_bytes")
    return {name: {k: e[k] for k in keys} for name, e in (tables or {}).items()}


def _interval(now: dict, before: dict | None) -> dict:
    """A table's figures over an interval, from its counters at its two ends: the counts,
    the hit rate and the rounding's figures of the interval (the largest error: so far), and
    the share of rows never updated (at the interval's end)."""
    d = {k: now[k] - (before or {}).get(k, 0) for k in TABLE_COUNTS}
    d["probed_error_max_e9"] = now["probed_error_max_e9"]
    return {
        "hit_rate": d["hits"] / d["lookups"] if d["lookups"] else 0.0,
        **d,
        **rounding_figures(d),
        "untouched_share": now["untouched_share"],
    }
