"""The paper's Figure 9: effective bandwidth of a cached low-precision table against its hit rate.

For each dim, precision (FP16, INT8, INT4, INT2) and policy (LFU, LRU) a table of --rows rows
behind a 5% 32-way cache is driven, at each forced hit rate (0, 25, 50, 75, 90, 95, 99 and
100%), through training steps (forward, backward, SGD update); the forward and the backward plus
update are timed apart. Effective bandwidth is bytes of embedding rows moved per second,
counted as the paper counts them:

* forward: per lookup, a hit reads its FP32 cache row (dim x 4 bytes), a miss its stored row
  (the packed values and their qparams);
* backward + update: per unique updated row, the row is read and written once, at FP32 if it
  was cached and at its stored size if not.

The pooled outputs and gradients are not counted (they are the same for every engine).

The trace: each lookup draws, with probability p, a row of a hot set (half the cache's
capacity, at most one step's lookups, so that every step touches most of it), else the next
row of a walk through the rest of the table, which comes back to a row only after every other
cold row (a uniform draw would find cached cold rows as often as the cache ratio). The hot
rows, once cached, stay (LFU: their counts are the highest; LRU: they are the most recent) and
the cold rows miss, so the hit rate follows p; p is then corrected from the hit rate the table
counts (``stats()``) over a few calibration steps until the measured rate is within a point of
the target. The measured rate is what the results report.

Beside the cached tables, on the same traces and in the same run: our uncached table at each
precision; ``nn.EmbeddingBag(mode="sum", sparse=True)`` FP32 with ``torch.optim.SGD``; FBGEMM's
TBE FP32 (``EXACT_SGD``) where fbgemm_gpu is installed; and the machine's ceilings, a sequential
copy (bytes read plus written) and a random-row gather of FP32 rows of the same dim (bytes
read), which is the physical limit of a lookup. Each of our tables' forward is also set
against a gather of its own stored rows timed beside every step (``measure``'s ``paired``),
and INT8 + LFU steps beside our uncached FP32 table (``rival``): each pair meets the
machine's drift together, which figures measured minutes apart do not.

``--device cuda`` runs the same on a GPU (tables in device memory; the ceiling is a
device-to-device copy). ``--placement host`` runs issue 51's benchmark instead
(bench/host_placement.py): a table in pinned host memory behind its cache on the GPU, the same
without a cache, and on the device, into ``OUT/placement.json`` and ``placement.md``
(``--quick``: its CPU rehearsal). Results: ``OUT/bandwidth.json``, ``bandwidth.md`` and ``bandwidth.png``
(GB/s against hit rate, the ceilings as lines), under the command, commit, CPU (and GPU) and
library versions. Examples:

    python bench/bandwidth.py --out bench/results/bandwidth
    python bench/bandwidth.py --device cuda --out bench/results/bandwidth_gpu
    python bench/bandwidth.py --dims 16 --precisions int8 --policies lfu --rows 100000  # quick
    python bench/bandwidth.py --device cuda --placement host --out bench/results/placement_gpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _common import (
    environment,
    environment_markdown,
    huge_page_share,
    progress,
    save_figure,
    write_text,
)
from torch import nn

import embcache
from embcache.config import PRECISION_BITS

HIT_RATES = (0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
# --placement host's (bench/host_placement.py)
HOST_HIT_RATES = (0.0, 0.5, 0.9, 0.95, 0.99, 1.0)
CACHE_RATIO, WAYS = 0.05, 32
WARMUP_STEPS, CALIBRATION_ROUNDS, CALIBRATION_STEPS, TOLERANCE = 8, 6, 4, 0.01
# The cached table that also steps beside our uncached FP32 table (measure's rival): issue
# 34's "at 90% hits and above, as fast as our FP32 table" is said of INT8 + LFU.
RIVALED = ("int8", "lfu")
# the options' defaults without --placement host (bench/host_placement.py has its own)
DEVICE_DEFAULTS = {
    "dims": "16,128",
    "precisions": ",".join(f for f in PRECISION_BITS if f != "fp32"),
    "policies": "lfu,lru",
    "pooling": 8,
    "steps": 5,
    "rounds": 3,
}


def last_level_cache_bytes() -> int:
    """The CPU's largest cache (sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def default_rows(device: torch.device, dim: int) -> int:
    """Rows of a table whose INT8 store is at least 100x the CPU's last-level cache, or on a GPU
    10x its L2 cache (tables are made on the host, and 100x an H100's L2 would take minutes
    each to make; 10x already leaves nine random rows in ten out of L2)."""
    if device.type == "cuda":
        cache, times = torch.cuda.get_device_properties(device).L2_cache_size, 10
    else:
        cache, times = last_level_cache_bytes(), 100
    int8_row = dim + 8
    return min(2**31 - 1, -(-times * cache // int8_row))


class Clock:
    """Wall seconds of device work: synchronizes the device before each reading."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def __call__(self) -> float:
        self.sync()
        return time.perf_counter()


class Trace:
    """Batches of ``bags`` bags of ``pooling`` ids each over ``rows`` rows: with probability p
    a uniform draw from the hot set (``hot`` rows), else the next row of the walk through the
    other rows. Rows are named through a fixed random permutation, so both are scattered over
    the table."""

    def __init__(self, rows: int, hot: int, bags: int, pooling: int, device: torch.device):
        self.rows, self.hot, self.device = rows, hot, device
        self.lookups = bags * pooling
        self.offsets = torch.arange(0, self.lookups + 1, pooling, device=device)
        self.gen = torch.Generator(device=device).manual_seed(0)
        self.perm = torch.randperm(rows, generator=self.gen, device=device)
        self.walk = torch.arange(self.lookups, device=device)
        self.cold_at = 0

    def batch(self, p: float) -> torch.Tensor:
        n, g, dev, cold_rows = self.lookups, self.gen, self.device, self.rows - self.hot
        hot = torch.randint(0, self.hot, (n,), generator=g, device=dev)
        cold = self.hot + (self.walk + self.cold_at) % cold_rows
        self.cold_at = (self.cold_at + n) % cold_rows
        pick = torch.rand(n, generator=g, device=dev) < p
        return self.perm[torch.where(pick, hot, cold)]


class Ours:
    """Our table (``CachedLowPrecisionEmbedding``), SGD; bytes per the module docstring."""

    def __init__(self, rows, dim, device, **options):
        self.table = embcache.CachedLowPrecisionEmbedding(
            rows, dim, mode="sum", device=device, lr=0.01, min_rows_for_low_precision=0, **options
        )
        self.stored_row = self.table.config.row_bytes
        self.fp32_row = dim * 4

    def forward(self, ids, offsets):
        return self.table(ids, offsets[:-1])  # nn.EmbeddingBag's convention: bag starts

    def rows(self) -> torch.Tensor:
        return self.table.weights

    def update(self, out, grad):
        out.backward(grad)
        self.table.step()

    def counts(self) -> dict:
        return self.table.stats()

    def forward_bytes(self, before, after, ids):
        hits = after["hits"] - before["hits"]
        misses = after["lookups"] - before["lookups"] - hits
        return hits * self.fp32_row + misses * self.stored_row

    def update_bytes(self, before, after, ids):
        hits = after["unique_hits"] - before["unique_hits"]
        misses = after["unique_misses"] - before["unique_misses"]
        return 2 * (hits * self.fp32_row + misses * self.stored_row)


class Peer:
    """An FP32 peer on the same trace: every lookup reads an FP32 row, every unique row is
    read and written once by the update."""

    def __init__(self, dim):
        self.fp32_row = dim * 4

    def counts(self) -> dict:
        return {}

    def forward_bytes(self, before, after, ids):
        return ids.numel() * self.fp32_row

    def update_bytes(self, before, after, ids):
        return 2 * torch.unique(ids).numel() * self.fp32_row


class EmbeddingBagSGD(Peer):
    def __init__(self, rows, dim, device):
        super().__init__(dim)
        self.bag = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, device=device)
        self.opt = torch.optim.SGD(self.bag.parameters(), lr=0.01)

    def forward(self, ids, offsets):
        return self.bag(ids, offsets[:-1])

    def rows(self) -> torch.Tensor:
        return self.bag.weight

    def update(self, out, grad):
        self.opt.zero_grad()
        out.backward(grad)
        self.opt.step()


class FbgemmTBE(Peer):
    """FBGEMM's training TBE, FP32, EXACT_SGD fused into the backward; its table in host
    memory on the CPU, in device memory on a GPU."""

    def __init__(self, rows, dim, device):
        super().__init__(dim)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        on_gpu = device.type == "cuda"
        where = (
            (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
            if on_gpu
            else (
                EmbeddingLocation.HOST,
                ComputeDevice.CPU,
            )
        )
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, dim, *where)],
            optimizer=EmbOptimType.EXACT_SGD,
            learning_rate=0.01,
            pooling_mode=PoolingMode.SUM,
            device=device,
        )

    def forward(self, ids, offsets):
        return self.tbe(ids, offsets)

    def rows(self) -> torch.Tensor:
        return self.tbe.weights_dev if self.tbe.weights_dev.numel() else self.tbe.weights_host

    def update(self, out, grad):
        out.backward(grad)


def fbgemm_available() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def calibrate(step, counts, target: float) -> float:
    """The hot-set probability whose measured hit rate is within TOLERANCE of ``target``: the
    cache warmed at p = target, then p corrected by the miss over at most CALIBRATION_ROUNDS
    rounds (the last p, which the cache has settled to). ``step(p)`` trains one step on a
    batch drawn at p (``Trace.batch``); ``counts()`` gives the tables' ``lookups`` and
    ``hits`` (``stats()``)."""

    def hit_rate(p: float, steps: int) -> float:
        before = counts()
        for _ in range(steps):
            step(p)
        after = counts()
        return (after["hits"] - before["hits"]) / max(1, after["lookups"] - before["lookups"])

    p = target
    hit_rate(p, WARMUP_STEPS)
    for _ in range(CALIBRATION_ROUNDS):
        measured = hit_rate(p, CALIBRATION_STEPS)
        if abs(measured - target) <= TOLERANCE / 2:
            break
        p = min(1.0, max(0.0, p + (target - measured)))
    return p


def measure(
    engine,
    trace: Trace,
    p: float,
    steps: int,
    rounds: int,
    clock: Clock,
    paired: bool = False,
    rival=None,
) -> dict:
    """Median over ``rounds`` of the forward's and the backward + update's GB/s over ``steps``
    fresh steps each, and the hit rate the table counted over all of them.

    Beside each step, before it on even steps and after it on odd ones, each on another batch
    of the same trace (never the step's own ids, which the first would bring into cache for
    the second): with ``paired``, a gather (``index_select``) of stored rows, whose seconds
    over the forward's are a round's ``gather_share`` (the forward's speed as a share of the
    bare read of its rows); with a ``rival`` engine, its own step, whose seconds over this
    engine's are a round's ``rival_forward_ratio`` and ``rival_step_ratio`` (above 1: this
    engine is faster). Both meet the machine's drift in the same moments as the step."""
    grad = torch.randn(trace.offsets.numel() - 1, engine.fp32_row // 4, device=trace.device)
    first = engine.counts()
    fwd, upd, shares, rival_fwd, rival_step = [], [], [], [], []
    for _ in range(rounds):
        batches = [trace.batch(p) for _ in range(steps)]
        for_gather = [trace.batch(p) for _ in range(steps)] if paired else []
        for_rival = [trace.batch(p) for _ in range(steps)] if rival is not None else []
        seconds, moved, beside = [0.0, 0.0], [0, 0], [0.0, 0.0, 0.0]
        for k, ids in enumerate(batches):
            if k % 2 == 0:
                beside = _beside(
                    beside, engine, rival, for_gather, for_rival, k, trace, grad, clock
                )
            before = engine.counts()
            t0 = clock()
            out = engine.forward(ids, trace.offsets)
            t1 = clock()
            middle = engine.counts()
            engine.update(out, grad)
            t2 = clock()
            after = engine.counts()
            seconds[0] += t1 - t0
            seconds[1] += t2 - t1
            moved[0] += engine.forward_bytes(before, middle, ids)
            moved[1] += engine.update_bytes(middle, after, ids)
            if k % 2 == 1:
                beside = _beside(
                    beside, engine, rival, for_gather, for_rival, k, trace, grad, clock
                )
        fwd.append(moved[0] / seconds[0] / 1e9)
        upd.append(moved[1] / seconds[1] / 1e9)
        shares.append(beside[0] / seconds[0])
        rival_fwd.append(beside[1] / seconds[0])
        rival_step.append(beside[2] / (seconds[0] + seconds[1]))
    last = engine.counts()
    lookups = last["lookups"] - first["lookups"] if last else 0
    point = {
        "forward_gbs": statistics.median(fwd),
        "update_gbs": statistics.median(upd),
        "forward_gbs_rounds": fwd,
        "update_gbs_rounds": upd,
        "hit_rate": (last["hits"] - first["hits"]) / lookups if lookups else None,
    }
    beside_rounds = {"gather_share": shares} if paired else {}
    if rival is not None:
        beside_rounds |= {"rival_forward_ratio": rival_fwd, "rival_step_ratio": rival_step}
    for key, values in beside_rounds.items():
        point[key] = statistics.median(values)
        point[f"{key}_rounds"] = values
    return point


def _beside(total, engine, rival, for_gather, for_rival, k, trace, grad, clock) -> list[float]:
    """``total`` plus the seconds of what measure times beside step k: the gather of
    for_gather[k] from the engine's stored rows, and the rival's forward and whole step on
    for_rival[k] (0 for what is not asked for)."""
    gather = gather_seconds(engine.rows(), for_gather[k], clock) if for_gather else 0.0
    forward = step = 0.0
    if rival is not None:
        t0 = clock()
        out = rival.forward(for_rival[k], trace.offsets)
        t1 = clock()
        rival.update(out, grad)
        forward, step = t1 - t0, clock() - t0
    return [a + b for a, b in zip(total, (gather, forward, step))]


def settle(engine, trace: Trace, target: float, steps: int, rounds: int, clock: Clock, rival=None):
    """(p, measure's result, paired with a gather and with ``rival`` if given) at the
    calibrated p; measured again, p corrected, up to twice more while the timed steps' hit
    rate is off the target by more than TOLERANCE (the cache can drift on from where
    calibration left it)."""
    grad = torch.ones(trace.offsets.numel() - 1, engine.fp32_row // 4, device=trace.device)
    p = calibrate(
        lambda p: engine.update(engine.forward(trace.batch(p), trace.offsets), grad),
        engine.counts,
        target,
    )
    for _ in range(3):
        point = measure(engine, trace, p, steps, rounds, clock, paired=True, rival=rival)
        if abs(point["hit_rate"] - target) <= TOLERANCE:
            break
        p = min(1.0, max(0.0, p + (target - point["hit_rate"])))
    return p, point


def rate(work, nbytes: int, clock: Clock) -> float:
    """GB/s of ``work(k)``, which moves ``nbytes``: the median of 10 calls (k = 0 .. 9), after
    one untimed call."""
    work(0)
    times = []
    for k in range(10):
        t0 = clock()
        work(k)
        times.append(clock() - t0)
    return nbytes / statistics.median(times) / 1e9


def gather_seconds(table: torch.Tensor, ids: torch.Tensor, clock: Clock) -> float:
    """Seconds to gather the rows ``ids`` of ``table`` (``index_select``)."""
    t0 = clock()
    table.index_select(0, ids)
    return clock() - t0


def gather_gbs(table: torch.Tensor, lookups: int, clock: Clock) -> float:
    """GB/s of a random gather of ``lookups`` rows of ``table`` (bytes read): the physical
    limit of a lookup of rows of that size, from memory of that size."""
    ids = torch.randint(0, table.shape[0], (10, lookups), device=table.device)
    row_bytes = table[0].numel() * table.element_size()
    return rate(lambda k: table.index_select(0, ids[k]), lookups * row_bytes, clock)


def ceilings(table: torch.Tensor, lookups: int, clock: Clock) -> dict:
    """GB/s of a sequential copy (read plus written) and of a random gather of ``lookups``
    rows of the FP32 ``table``. The table is nn.EmbeddingBag's, so that no second FP32 table
    is made (at dim 128 on the CPU one is 12 GB)."""
    n = (1 << 28) if table.device.type == "cuda" else (1 << 26)  # 1 GiB / 256 MiB of floats
    src = torch.rand(n, device=table.device)
    dst = torch.empty_like(src)
    copy = rate(lambda k: dst.copy_(src), 2 * src.nbytes, clock)
    return {"copy_gbs": copy, "gather_gbs": gather_gbs(table, lookups, clock)}


PRECISION_COLORS = {"fp32": "C4", "fp16": "C0", "int8": "C1", "int4": "C2", "int2": "C3"}


def line_style(name: str) -> dict:
    """A line per engine: colour by precision; cached LFU solid, cached LRU dashed, uncached
    dotted; the peers grey."""
    if not name.startswith("ours"):
        return {"color": "0.5", "ls": "--", "marker": "x", "ms": 4}
    color = PRECISION_COLORS[name.split()[1].rstrip(",")]
    if "no cache" in name:
        return {"color": color, "ls": ":", "marker": ".", "ms": 3}
    return {"color": color, "ls": "-" if "LFU" in name else "--", "marker": "o", "ms": 3}


def curve(name: str, points: list[dict], phase: str) -> tuple[list[float], list[float]]:
    """(x, y) of an engine: x the hit rate a cached table measured, else the trace's target
    (an uncached table or a peer hits nothing; its x says which trace it ran)."""
    cached = "cache" in name and "no cache" not in name
    xs = [100 * (pt["hit_rate"] if cached else pt["target"]) for pt in points]
    return xs, [pt[phase] for pt in points]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted(results["dims"], key=int)
    fig, axes = plt.subplots(2, len(dims), figsize=(6.5 * len(dims), 9), squeeze=False)
    for col, dim in enumerate(dims):
        r = results["dims"][dim]
        for row, (phase, title) in enumerate(
            [("forward_gbs", "forward"), ("update_gbs", "backward + update")]
        ):
            ax = axes[row][col]
            for name, points in r["engines"].items():
                ax.plot(*curve(name, points, phase), label=name, **line_style(name))
            ax.axhline(
                r["ceilings"]["gather_gbs"], color="k", ls=":", label="random-row gather (FP32)"
            )
            ax.axhline(r["ceilings"]["copy_gbs"], color="gray", ls="-.", label="sequential copy")
            ax.set_yscale("log")
            ax.set_xlabel("hit rate (%): measured, or the trace's target where nothing is cached")
            ax.set_ylabel("effective bandwidth (GB/s)")
            ax.set_title(f"dim {dim}, {r['rows']:,} rows: {title}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"Effective bandwidth on {results['where']}")
    save_figure(fig, path)


def ceiling_shares(r: dict) -> list[str]:
    """Markdown lines: each of our tables' forward at the lowest and highest hit rate measured,
    as a share of the gather of its stored rows paired with it round by round (``measure``:
    the median and range over rounds), and at the highest as a share of the FP32 random-row
    gather ceiling (what a hit reads: an FP32 row)."""
    ours = {k: v for k, v in r["engines"].items() if "gather_share" in v[0]}
    if not ours:
        return []
    fp32 = r["ceilings"]["gather_gbs"]
    first, last = (next(iter(ours.values()))[i]["target"] for i in (0, -1))

    def share(pt: dict) -> str:
        rounds = pt["gather_share_rounds"]
        return f"{pt['gather_share']:.0%} ({min(rounds):.0%}-{max(rounds):.0%})"

    lines = [
        "",
        "The forward against the bare read of its rows: a gather (`index_select`) of the stored "
        "rows of another batch of the same trace, timed beside each step (seconds of the gather "
        "over seconds of the forward, for as many lookups; median and range over rounds); and "
        f"at {100 * last:g}% against the FP32 random-row gather ceiling ({fp32:.2f} GB/s).",
        "",
        f"| engine | forward / gather at {100 * first:g}% | forward / gather at {100 * last:g}% "
        f"| forward at {100 * last:g}% / FP32 gather ceiling |",
        "|---|---:|---:|---:|",
    ]
    for name, points in ours.items():
        lines.append(
            f"| {name} | {share(points[0])} | {share(points[-1])} | "
            f"{points[-1]['forward_gbs'] / fp32:.0%} |"
        )
    return lines


def rival_ratios(r: dict) -> list[str]:
    """Markdown lines: the cached table that stepped beside our uncached FP32 table (RIVALED),
    as FP32's seconds over its own at each hit rate: median and range over rounds."""
    rivaled = {k: v for k, v in r["engines"].items() if "rival_step_ratio" in v[0]}
    lines = []
    for name, points in rivaled.items():

        def cell(pt: dict, key: str) -> str:
            rounds = pt[f"{key}_rounds"]
            return f"{pt[key]:.2f}x ({min(rounds):.2f}-{max(rounds):.2f})"

        lines += [
            "",
            f"{name} against our uncached FP32 table, stepped beside it on the same trace "
            "(another batch each step): FP32's seconds over its own (above 1x: the cached "
            "table is faster), median and range over rounds, at each measured hit rate:",
            "",
            "| phase | " + " | ".join(f"{100 * pt['hit_rate']:.1f}%" for pt in points) + " |",
            "|---|" + "---:|" * len(points),
            "| forward | " + " | ".join(cell(pt, "rival_forward_ratio") for pt in points) + " |",
            "| forward, backward and update | "
            + " | ".join(cell(pt, "rival_step_ratio") for pt in points)
            + " |",
        ]
    return lines


def markdown(results: dict, env: dict) -> str:
    lines = [
        f"# Effective bandwidth against hit rate ({results['where']})",
        "",
        environment_markdown(env),
        "",
    ]
    lines.append(results["note"])
    for dim, r in sorted(results["dims"].items(), key=lambda kv: int(kv[0])):
        targets = [f"{100 * t:g}%" for t in results["hit_rates"]]
        c = r["ceilings"]
        lines += [
            "",
            f"## dim {dim}, {r['rows']:,} rows",
            "",
            f"Ceilings: sequential copy {c['copy_gbs']:.1f} GB/s, random-row gather "
            f"{c['gather_gbs']:.1f} GB/s.",
            "",
            "GB/s forward / backward + update (measured hit rate) at each target hit rate:",
            "",
            "| engine | " + " | ".join(targets) + " |",
            "|---|" + "---:|" * len(targets),
        ]
        for name, points in r["engines"].items():
            cells = []
            for pt in points:
                hr = "" if pt["hit_rate"] is None else f" ({100 * pt['hit_rate']:.1f}%)"
                cells.append(f"{pt['forward_gbs']:.3g} / {pt['update_gbs']:.3g}{hr}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ceiling_shares(r)
        lines += rival_ratios(r)
        shares = {k: v for k, v in r.get("huge_pages", {}).items() if v is not None}
        if shares:
            lines += [
                "",
                "Share of each table's rows on huge pages (cold lookups depend on it): "
                + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
                + ".",
            ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument(
        "--placement",
        choices=["device", "host"],
        default="device",
        help="device: this benchmark, every table in the device's memory (the default); host: "
        "issue 51's placement benchmark (bench/host_placement.py): a host-placed table behind "
        "its cache, without one, and on the device, into OUT/placement.json and .md",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="with --placement host: a table of 20,000 rows, 64 bags of 4, 2 rounds of 2 steps "
        "(a CPU rehearsal)",
    )
    p.add_argument("--dims", help="(default: 16,128; with --placement host 128)")
    p.add_argument(
        "--precisions",
        help="formats behind a cache (default: the low-precision ones, "
        + ",".join(f for f in PRECISION_BITS if f != "fp32")
        + "; with --placement host int8)",
    )
    p.add_argument("--policies", help="(default: lfu,lru; with --placement host lfu)")
    p.add_argument(
        "--hit-rates",
        help="target hit rates, fractions in [0, 1] (default: "
        + ",".join(f"{h:g}" for h in HIT_RATES)
        + "; with --placement host 0,0.5,0.9,0.95,0.99,1)",
    )
    p.add_argument(
        "--rows",
        type=int,
        help="rows of every table (default: an INT8 store 100x the last-level cache, 10x the "
        "L2 cache on a GPU)",
    )
    p.add_argument("--bags", type=int, help="bags per step (default: 2048, 16384 on a GPU)")
    p.add_argument("--pooling", type=int, help="ids per bag (default: 8)")
    p.add_argument("--steps", type=int, help="timed steps per round (default: 5; host: 10)")
    p.add_argument("--rounds", type=int, help="(default: 3; with --placement host 5)")
    p.add_argument("--out", type=Path, help="write bandwidth.json, .md and .png here")
    args = p.parse_args()
    host = args.placement == "host"
    default_hit_rates = HOST_HIT_RATES if host else HIT_RATES
    hit_rates = args.hit_rates or ",".join(f"{h:g}" for h in default_hit_rates)
    try:
        targets = [float(h) for h in hit_rates.split(",")]
    except ValueError:
        p.error(f"--hit-rates: {hit_rates!r} is not a comma-separated list of numbers")
    if not all(0.0 <= t <= 1.0 for t in targets):
        p.error(f"--hit-rates: {hit_rates} are not all fractions in [0, 1] (90% is 0.9)")
    if args.quick and not host:
        p.error("--quick is a size of --placement host")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bandwidth.py: --device cuda, but torch sees no CUDA device")
    if host:
        import host_placement

        args.hit_rates, args.script = targets, __file__
        host_placement.main(args)
        return
    for key, value in DEVICE_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch.device(args.device)
    bags = args.bags or (16384 if device.type == "cuda" else 2048)
    clock = Clock(device)
    env = environment(__file__, threads=torch.get_num_threads(), gpu=device.type == "cuda")
    where = env.get("gpu", env["cpu_model"]) + (" (device memory)" if device.type == "cuda" else "")
    results = {
        "where": where,
        "hit_rates": targets,
        "cache": {"ratio": CACHE_RATIO, "ways": WAYS},
        "bags": bags,
        "pooling": args.pooling,
        "note": (
            f"Batches of {bags} bags x {args.pooling} ids, SGD; a {CACHE_RATIO:.0%} {WAYS}-way "
            "cache; the median of "
            f"{args.rounds} rounds of {args.steps} steps, after calibration steps that bring the "
            "measured hit rate within a point of the target. Bytes are counted as the paper "
            "counts them (see bench/bandwidth.py)."
        ),
        "dims": {},
    }
    for dim in (int(d) for d in args.dims.split(",")):
        rows = args.rows or default_rows(device, dim)
        engines = [
            (
                f"ours {prec} + {CACHE_RATIO:.0%} {WAYS}-way {pol.upper()} cache",
                "cached",
                dict(precision=prec, policy=pol, cache_ratio=CACHE_RATIO, associativity=WAYS),
            )
            for prec in args.precisions.split(",")
            for pol in args.policies.split(",")
        ]
        engines += [
            (f"ours {prec}, no cache", "ours", dict(precision=prec, cache_ratio=0.0))
            for prec in ["fp32", *args.precisions.split(",")]
        ]
        engines.append(("nn.EmbeddingBag fp32 + SGD", "bag", {}))
        if fbgemm_available():
            engines.append(("FBGEMM TBE fp32 EXACT_SGD", "tbe", {}))
        slots = embcache.CachedLowPrecisionEmbedding(
            rows, dim, device="meta", cache_ratio=CACHE_RATIO, associativity=WAYS
        ).config.num_slots
        trace = Trace(
            rows, max(1, min(slots // 2, bags * args.pooling)), bags, args.pooling, device
        )
        r = results["dims"][str(dim)] = {"rows": rows, "hot_rows": trace.hot, "engines": {}}
        for name, kind, options in progress(engines, desc=f"dim {dim}", unit="engine"):
            rival = None
            if kind in ("cached", "ours"):
                engine = Ours(rows, dim, device, **options)
                if kind == "cached" and (options["precision"], options["policy"]) == RIVALED:
                    rival = Ours(rows, dim, device, precision="fp32", cache_ratio=0.0)
            elif kind == "bag":
                engine = EmbeddingBagSGD(rows, dim, device)
                r["ceilings"] = ceilings(engine.bag.weight.detach(), trace.lookups, clock)
            else:
                engine = FbgemmTBE(rows, dim, device)
            points = []
            paired = kind in ("cached", "ours")
            for target in targets:
                if kind == "cached":
                    p_hot, point = settle(
                        engine, trace, target, args.steps, args.rounds, clock, rival
                    )
                else:
                    p_hot = target
                    point = measure(engine, trace, p_hot, args.steps, args.rounds, clock, paired)
                points.append({"target": target, "p_hot": p_hot, **point})
            r["engines"][name] = points
            r.setdefault("huge_pages", {})[name] = huge_page_share(engine.rows())
            del engine, rival
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if args.out:  # after each dim, so that a run cut short keeps what it measured
            write_results(results, env, args.out)
    print(markdown(results, env))
    if args.out:
        print(f"wrote {args.out}/bandwidth.json, bandwidth.md, bandwidth.png")


def write_results(results: dict, env: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "bandwidth.json", json.dumps({"environment": env, **results}, indent=2))
    write_text(out / "bandwidth.md", markdown(results, env))
    plot(results, out / "bandwidth.png")


if __name__ == "__main__":
    main()
