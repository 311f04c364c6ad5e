"""A run's report (``report.json``): strict JSON of its configuration, data, metrics,
loss scaling, embedding memory and hit rates, and peak memory."""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dlrm import distributed, run_dir
from dlrm.torchrec_adapter import unwrap
from embcache.memory import fp32_bytes
from embcache.telemetry import PROBE_COUNTERS, rounding_figures

# a table's counters that the report and the run's history carry
TABLE_COUNTS = ("lookups", "hits", "insertions", "evictions", "bypasses", *PROBE_COUNTERS)


def describe_device(device: torch.device) -> str:
    """``device`` for a person: ``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"


def make_report(cfg, dataset, data_dir, trainer, progress, test, ranks, device) -> dict:
    """The run's report (as report.json holds it, before :func:`strict_json`), of a run that
    trained on ``device`` (the peak device memory is that since the loop began)."""
    scaling = trainer.report
    rss = ranks.gather(_peak_rss_bytes())
    peak_device = ranks.gather(
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    )
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
        "device": describe_device(device),
        "devices": progress["devices"],  # where each part of the run trained, from its step
        # CUDA memory the tensors took at most (None on the CPU: see peak_rss_bytes)
        "peak_device_memory_bytes": None if device.type != "cuda" else max(peak_device),
        "peak_rss_bytes": max(rss),
        **({"peak_rss_bytes_per_rank": rss} if ranks.world_size > 1 else {}),
    }


def table_figures(model: nn.Module, ranks: distributed.Ranks) -> dict | None:
    """Every table's (or row-wise shard's) figures, from every rank (a collective): its
    ``rank``, ``precision``, ``rows``, ``cache_slots``, counters since it was made
    (``lookups``, ``hits``, ``insertions``, ``evictions``, ``bypasses`` and the precision
    telemetry's ``probed_*``), ``untouched_share``, ``placement``, ``memory_bytes`` (split
    into ``device_memory_bytes`` and ``host_memory_bytes``, a host-placed table's storage) and
    ``fp32_bytes`` (FP32 rows with the same optimizer state: the compression factor's
    denominator). None for a collection that is not ours (TorchRec's FP32 baseline)."""
    if not hasattr(unwrap(model).embedding_collection, "stats"):
        return None
    mine = {}
    for name, t in distributed.process_tables(model).items():
        memory, stats, c = t.memory_bytes(), t.stats(), t.config
        mine[name] = {
            "rank": ranks.rank,
            "precision": c.stored_precision,
            "rows": c.num_embeddings,
            "cache_slots": c.num_slots,
            **{k: stats[k] for k in TABLE_COUNTS},
            "untouched_share": stats["untouched_share"],
            "placement": c.placement,
            "memory_bytes": memory["total"],
            "device_memory_bytes": memory["device"],
            "host_memory_bytes": memory["host"],
            "fp32_bytes": fp32_bytes(c),
        }
    return {name: e for part in ranks.gather(mine) for name, e in part.items()}


def _embedding_report(model: nn.Module, ranks: distributed.Ranks) -> dict:
    """Memory (all of it, and split by where it lives: ``device_memory_bytes`` on the device
    the run trains on, ``host_memory_bytes`` in pinned host memory for host-placed tables),
    FP32 equivalent, hit rate and per-table figures of the embedding tables; over several
    ranks, of every rank's shards, with the rank of each and the memory per rank."""
    tables = table_figures(model, ranks)
    if tables is None:
        fp32 = sum(p.nbytes for p in unwrap(model).embedding_collection.parameters())
        return {
            "memory_bytes": fp32,
            "device_memory_bytes": fp32,
            "host_memory_bytes": 0,
            "fp32_bytes": fp32,
            "compression_factor": 1.0,
        }
    cached = [e for e in tables.values() if e["cache_slots"] > 0]
    lookups = sum(e["lookups"] for e in cached)
    memory = sum(e["memory_bytes"] for e in tables.values())
    fp32 = sum(e["fp32_bytes"] for e in tables.values())
    report = {
        # over the tables that have a cache (small tables stay FP32 without one)
        "hit_rate": sum(e["hits"] for e in cached) / lookups if lookups else 0.0,
        "memory_bytes": memory,
        "device_memory_bytes": sum(e["device_memory_bytes"] for e in tables.values()),
        "host_memory_bytes": sum(e["host_memory_bytes"] for e in tables.values()),
        "fp32_bytes": fp32,
        "compression_factor": memory / fp32,
        "tables": {
            name: {
                **({"rank": e["rank"]} if ranks.world_size > 1 else {}),
                "precision": e["precision"],
                "rows": e["rows"],
                "cache_slots": e["cache_slots"],
                "hit_rate": e["hits"] / e["lookups"] if e["lookups"] else 0.0,
                **rounding_figures(e),
                "untouched_share": e["untouched_share"],
                "placement": e["placement"],
                "memory_bytes": e["memory_bytes"],
                "device_memory_bytes": e["device_memory_bytes"],
                "host_memory_bytes": e["host_memory_bytes"],
                "fp32_bytes": e["fp32_bytes"],
            }
            for name, e in tables.items()
        },
    }
    if ranks.world_size > 1:
        report["memory_bytes_per_rank"] = [
            sum(e["memory_bytes"] for e in tables.values() if e["rank"] == r)
            for r in range(ranks.world_size)
        ]
        report["sharding"] = distributed.sharding_report(model)
    return report


def _peak_rss_bytes() -> int:
    """The process's peak resident memory so far."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError):  # not Linux: getrusage's maximum (KiB on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def metrics_line(m: dict) -> str:
    """``auc 0.7123 logloss 0.4567``, with ``n/a`` for an undefined metric."""
    return " ".join(
        f"{name} " + ("n/a" if m[key] is None else f"{m[key]:.4f}")
        for name, key in (("auc", "auc"), ("logloss", "log_loss"))
    )


def strict_json(x):
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
                out[key] = strict_json(value)
        return out
    if isinstance(x, (list, tuple)):
        return [
            None if isinstance(v, (float, np.floating)) and not math.isfinite(v) else strict_json(v)
            for v in x
        ]
    return x


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(type(x))


def write_report(out_dir: Path, report: dict) -> None:
    """``out_dir/report.json``: ``report`` as strict JSON, written atomically."""
    text = json.dumps(strict_json(report), indent=2, allow_nan=False, default=_json_default)
    run_dir.write_atomically(out_dir / "report.json", lambda p: p.write_text(text))
