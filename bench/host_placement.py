"""Issue 51 item 4: a table whose storage is in pinned host memory, behind its FP32 cache on the
GPU, against the same table without a cache (the unified-memory baseline: every lookup reads
host memory in place) and the same table on the device. Run as
``bench/bandwidth.py --placement host`` (this module holds that mode).

Engines, one table each (``ENGINES``), all of the same rows (``_common.filled_table``: the same
seed, so the two cached tables are the same table byte for byte), INT8 (``--precisions``,
first), dim 128 (``--dims``), SGD, lr 0.01:

* ``host + cache``: ``placement="host"``, a 5% 32-way LFU cache (``--policies``, first);
* ``host + cache + prefetch``: the same table, given the next batch after each forward
  (``prefetch``: docs/design.md, "Prefetch"), as ``dlrm train`` gives it;
* ``host, no cache``: ``placement="host"``, ``cache_ratio=0`` (the unified-memory baseline);
* ``device + cache``: ``placement="device"``, the same cache.

At each target hit rate (``bandwidth.HOST_HIT_RATES``: 0, 50, 90, 95, 99 and 100%) the ids come from
``bandwidth.Trace`` (a hot set of half the cache's slots drawn with probability p, else the
next row of a walk through the rest), p calibrated by ``bandwidth.calibrate`` on the host table
with a cache while every engine steps on the same batches (so the two cached tables stay
identical, as a host-placed table trains bit for bit as on the device). Then ``WARMUP_STEPS``
steps of each, and ``--rounds`` rounds in each of which every engine in turn trains ``--steps``
steps on the round's batches, timed as ``kernel_bench.timed`` times them (CUDA events at each
step's start, the end of its forward and the end of its update; on the CPU the wall clock). An
engine's figure is the median over rounds of its mean ms a step; a ratio of two engines is the
median of their per-round ratios.

Reported per engine and target: forward ms and lookups/s (the lookup throughput), step ms
(forward, backward and update) and lookups/s and samples (bags)/s, the hit rate the table
counted over the timed steps, the forward's effective GB/s as ``bandwidth.py`` counts it (a hit
an FP32 row, a miss its stored row), and the bytes a step reads and writes in host memory.

**Host bytes a step** (``host_bytes``), counted from the table's own counters over the timed
steps (``stats()``: lookups, hits, unique rows, unique misses, evictions, bypasses) by what the
CUDA kernels (``csrc/cuda/kernels``) read and write in a host table's storage
(``TableConfig.storage_tensors``: the stored rows, and AdaGrad's per-element state; the LFU
counts and row-wise accumulators stay on the GPU), with ``R`` the stored row's bytes (payload
and qparams: 132 at INT8, dim 128) and ``S`` the per-element optimizer state's bytes a row
(``4 x dim`` for AdaGrad, else 0):

* forward read: ``misses x R`` (every lookup that misses dequantizes its stored row);
* update read: ``unique_misses x R`` (the optimizer reads an uncached row's stored value
  again), plus ``unique_rows x S``;
* update write: ``(bypasses + evictions) x R`` (a row that does not enter the cache is
  rounded into the table; so is the row an insertion evicts), plus ``unique_rows x S``.

With prefetch the staging reads each missed row once, ahead (``unique_misses x R``, counted
as the forward's read), and the update reads the copy: its read is ``unique_rows x S``. (A
copy that an update in between made stale, or a row evicted in between, is read again from
the table; not counted.)

An inserted row's value goes into the cache only; a hit reads no host memory. These are bytes
the kernels access, an upper bound of what crosses PCIe (the GPU's L2 may serve a row read twice
in a step) and a lower bound of the PCIe traffic they cause (a 132-byte row spans five or six
32-byte sectors; a 2-byte count moves a whole sector; packet headers are not counted). A
device-placed table moves none of them over PCIe: its ``pcie_bytes`` are 0, its ``host_bytes``
are what it would move if host-placed.

The targets (``targets`` in the JSON, the first table of the Markdown), for the forward (the
lookup throughput) and for the whole step, each as the figure, the figure it is compared with,
their ratio (median and rounds) and the goal:

* at 95% hits, host + cache against host without cache: at least 10x (the paper: 25.8x);
* at 100% hits, host + cache against device + cache: at least 0.8.

Results: ``OUT/placement.json`` (strict JSON; written after each target, so that a run cut
short keeps what it measured) and ``OUT/placement.md``, under the command, commit, GPU,
driver, CUDA and torch versions (``_common.environment``; ``EMBCACHE_COMMIT`` names the commit
where the tree has no git metadata). On an H100 the default run (a table of 10x the L2 cache at
INT8, 16384 bags of 8 ids) takes under a minute. Where torch has no CUDA device, or with
``--device cpu``, the host tables are built with ``placement="device"`` (a host-placed table
needs CUDA): a rehearsal, marked ``rehearsal`` in the JSON and Markdown, whose host bytes are
counted as if the tables were host-placed. ``--quick`` (20,000 rows, 64 bags of 4, 2 rounds of
2 steps) rehearses in seconds. Examples:

    python bench/bandwidth.py --device cuda --placement host --out bench/results/placement_gpu
    python bench/bandwidth.py --device cpu --placement host --quick --out /tmp/placement
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from _common import environment, environment_markdown, filled_table, torch_device, write_text
from bandwidth import CACHE_RATIO, WARMUP_STEPS, WAYS, Trace, calibrate, default_rows
from kernel_bench import Engine, spread, timed

LR = 0.01
HOST_CACHED, HOST_UNCACHED, DEVICE_CACHED = "host + cache", "host, no cache", "device + cache"
HOST_PREFETCH = "host + cache + prefetch"
ENGINES = (HOST_CACHED, HOST_PREFETCH, HOST_UNCACHED, DEVICE_CACHED)
# issue 51 item 4's goals, and the paper's figure at 95% hits (against unified memory)
CACHE_GAIN_GOAL, PAPER_CACHE_GAIN, DEVICE_SHARE_GOAL = 10.0, 25.8, 0.8
# defaults of this mode; --quick's sizes
DEFAULTS = {
    "dims": "128",
    "precisions": "int8",
    "policies": "lfu",
    "pooling": 8,
    "steps": 10,
    "rounds": 5,
}
QUICK = {"rows": 20_000, "bags": 64, "pooling": 4, "steps": 2, "rounds": 2}
COUNTED = ("lookups", "hits", "unique_rows", "unique_misses", "evictions", "bypasses")


class _Step:
    """``Engine``'s optimizer for one table: its ``step()``; nothing to zero afterwards (the
    step clears the table's gradient)."""

    def __init__(self, table) -> None:
        self.step = table.step

    def zero_grad(self) -> None:
        pass


def build(rows: int, dim: int, device: torch.device, precision: str, policy: str) -> dict:
    """The engines' tables (module docstring) and their build seconds: ``{name: (table,
    placement asked, placement used, seconds)}``. Host placement needs CUDA: elsewhere those
    tables are built on the device (a rehearsal)."""
    host = "host" if device.type == "cuda" else "device"
    common = dict(mode="sum", precision=precision, lr=LR, min_rows_for_low_precision=0)
    cache = dict(cache_ratio=CACHE_RATIO, associativity=WAYS, policy=policy)
    asked = {
        HOST_CACHED: ("host", cache),
        HOST_PREFETCH: ("host", cache),
        HOST_UNCACHED: ("host", {"cache_ratio": 0.0}),
        DEVICE_CACHED: ("device", cache),
    }
    built = {}
    for name, (placement, options) in asked.items():
        used = host if placement == "host" else placement
        table, seconds = filled_table(rows, dim, device, placement=used, **common, **options)
        built[name] = (table, placement, used, seconds)
    return built


def host_bytes(config, delta: dict, steps: int, prefetched: bool = False) -> dict:
    """Bytes a step reads and writes in a table's storage (module docstring), from the
    table's counters' ``delta`` over ``steps`` steps; ``prefetched``: with prefetch."""
    row = config.row_bytes
    state = config.optimizer_state_width * 4 if "optimizer_state" in config.storage_tensors else 0
    unique, misses = delta["unique_rows"], delta["unique_misses"]
    parts = {
        "forward_read": (misses if prefetched else delta["lookups"] - delta["hits"]) * row,
        "update_read": (0 if prefetched else misses * row) + unique * state,
        "update_write": (delta["bypasses"] + delta["evictions"]) * row + unique * state,
    }
    parts = {k: v / steps for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def measure(
    built: dict, trace: Trace, target: float, args, device: torch.device, grad: torch.Tensor
) -> dict:
    """Every engine at ``target`` hits (module docstring): its point."""
    starts = trace.offsets[:-1]
    engines = {
        name: Engine(
            lambda ids, t=table: t(ids, starts),
            _Step(table),
            [table],
            prefetch=(lambda ids, t=table: t.prefetch(ids, starts))
            if name == HOST_PREFETCH
            else None,
        )
        for name, (table, *_rest) in built.items()
    }

    def step_all(p: float) -> None:
        ids = trace.batch(p)
        for e in engines.values():
            e.update(e.forward(ids), grad)

    p = calibrate(step_all, engines[HOST_CACHED].counts, target)
    warm = [trace.batch(p) for _ in range(WARMUP_STEPS)]
    for e in engines.values():
        timed(e, warm, grad, device)
    before = {name: e.cached[0].stats() for name, e in engines.items()}
    rounds = {name: ([], []) for name in engines}
    for _ in range(args.rounds):
        batches = [trace.batch(p) for _ in range(args.steps)]
        for name, e in engines.items():
            forward, step = timed(e, batches, grad, device)
            rounds[name][0].append(forward)
            rounds[name][1].append(step)
    steps = args.rounds * args.steps
    bags = trace.offsets.numel() - 1
    out = {}
    for name in engines:
        table, placement, used, _ = built[name]
        after = table.stats()
        delta = {k: after[k] - before[name][k] for k in COUNTED}
        forward, step = (statistics.median(r) for r in rounds[name])
        moved = host_bytes(table.config, delta, steps, prefetched=name == HOST_PREFETCH)
        hits, misses = delta["hits"], delta["lookups"] - delta["hits"]
        effective = (
            hits * table.config.embedding_dim * 4 + misses * table.config.row_bytes
        ) / steps
        out[name] = {
            "placement": placement,
            "placement_used": used,
            "forward_ms": forward,
            "step_ms": step,
            "forward_ms_rounds": rounds[name][0],
            "step_ms_rounds": rounds[name][1],
            "forward_lookups_per_s": trace.lookups / forward * 1e3,
            "step_lookups_per_s": trace.lookups / step * 1e3,
            "step_samples_per_s": bags / step * 1e3,
            "forward_gbs": effective / forward / 1e6,
            "hit_rate": hits / delta["lookups"] if delta["lookups"] else 0.0,
            "host_bytes": moved,
            "pcie_bytes": moved["total"] if placement == "host" else 0.0,
            "pcie_gbs": moved["total"] / step / 1e6 if placement == "host" else 0.0,
        }
    return {"target": target, "p_hot": p, "engines": out}


def targets(points: list[dict]) -> list[dict]:
    """Issue 51 item 4's targets over one run's ``points`` (module docstring), for the host
    table with a cache, without and with prefetch: a row per target, engine and phase, with
    the figure, what it is compared with, the ratio (median of the per-round ratios, and
    those), the goal and whether the ratio meets it. A target whose hit rate was not measured
    has no rows."""
    by_target = {pt["target"]: pt["engines"] for pt in points}
    goals = (
        (0.95, HOST_UNCACHED, CACHE_GAIN_GOAL, PAPER_CACHE_GAIN),
        (1.0, DEVICE_CACHED, DEVICE_SHARE_GOAL, None),
    )
    rows = []
    for at, versus, goal, paper in goals:
        if at not in by_target:
            continue
        for name in (HOST_CACHED, HOST_PREFETCH):
            ours, theirs = by_target[at][name], by_target[at][versus]
            for phase in ("forward", "step"):
                ratios = [
                    a / b for a, b in zip(theirs[f"{phase}_ms_rounds"], ours[f"{phase}_ms_rounds"])
                ]
                ratio = statistics.median(ratios)
                rows.append(
                    {
                        "target": f"{name} / {versus}, {phase}",
                        "engine": name,
                        "hit_rate_target": at,
                        "hit_rate": ours["hit_rate"],
                        "phase": phase,
                        "figure": ours[f"{phase}_lookups_per_s"],
                        "unit": "lookups/s",
                        "compared_with": versus,
                        "compared_value": theirs[f"{phase}_lookups_per_s"],
                        "ratio": ratio,
                        "ratio_rounds": ratios,
                        "goal": goal,
                        "paper": paper,
                        "met": ratio >= goal,
                    }
                )
    return rows


def markdown(result: dict) -> str:
    lines = [
        f"# A host-placed table behind its cache ({result['where']})",
        "",
        environment_markdown(result["environment"]),
        "",
    ]
    if result["rehearsal"]:
        lines += [
            "**Rehearsal**: no CUDA device, so the host tables were built with "
            "placement='device'; their host bytes are counted as if host-placed.",
            "",
        ]
    lines += [
        result["note"],
        "",
        "## Issue 51's targets",
        "",
        "| target | run | hit rate | figure | compared with | ratio (rounds) | goal | paper "
        "| met |",
        "|---|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for t in result["targets"]:
        paper = "-" if t["paper"] is None else f"{t['paper']:g}x"
        lines.append(
            f"| {t['target']} | {t['run']} | {100 * t['hit_rate']:.1f}% | "
            f"{t['figure'] / 1e6:.3g}M {t['unit']} | {t['compared_with']}: "
            f"{t['compared_value'] / 1e6:.3g}M | {spread(t['ratio_rounds'], '.2f')} | "
            f"{t['goal']:g} | {paper} | {'yes' if t['met'] else 'no'} |"
        )
    for run, r in result["runs"].items():
        points = r["points"]
        heads = " | ".join(f"{100 * pt['target']:g}%" for pt in points)
        cols = "|---|" + "---:|" * len(points)
        lines += [
            "",
            f"## {run}",
            "",
            f"{r['rows']:,} rows ({r['table_mb']:.0f} MB stored, {r['cache_mb']:.0f} MB of "
            f"cache), {r['bags']} bags of {r['pooling']} ids ({r['lookups']:,} lookups a "
            f"step); hot set {r['hot_rows']:,} rows. Tables built in "
            + ", ".join(f"{n} {s:.1f} s" for n, s in r["build_seconds"].items())
            + ".",
            "",
            "Forward / whole step, M lookups/s (measured hit rate), at each target hit rate:",
            "",
            f"| engine | {heads} |",
            cols,
        ]
        for name in ENGINES:
            cells = []
            for pt in points:
                e = pt["engines"][name]
                cells.append(
                    f"{e['forward_lookups_per_s'] / 1e6:.3g} / {e['step_lookups_per_s'] / 1e6:.3g}"
                    f" ({100 * e['hit_rate']:.1f}%)"
                )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Host bytes a step, MB (forward read + update read + update write), and over the "
            "step's time, GB/s (bytes the kernels access in host memory: module docstring):",
            "",
            f"| engine | {heads} |",
            cols,
        ]
        for name in (HOST_CACHED, HOST_PREFETCH, HOST_UNCACHED):
            cells = []
            for pt in points:
                e = pt["engines"][name]
                b = e["host_bytes"]
                cells.append(
                    f"{b['total'] / 1e6:.3g} ({b['forward_read'] / 1e6:.3g} + "
                    f"{b['update_read'] / 1e6:.3g} + {b['update_write'] / 1e6:.3g}); "
                    f"{b['total'] / e['step_ms'] / 1e6:.3g} GB/s"
                )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "placement.json", json.dumps(result, indent=1, allow_nan=False))
    write_text(out / "placement.md", markdown(result))


def main(args) -> None:
    """The mode, from ``bench/bandwidth.py``'s parsed and checked ``args`` (``hit_rates`` a
    list of fractions; ``script``: bandwidth.py's path, for the command recorded)."""
    for key, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, key) is None:  # given on the command line: as given
            setattr(args, key, value)
    device = torch_device(args.device)
    cuda = device.type == "cuda"
    targets_asked = args.hit_rates
    precision, policy = args.precisions.split(",")[0], args.policies.split(",")[0]
    env = environment(args.script, gpu=cuda)
    result = {
        "environment": env,
        "where": env.get("gpu", env["cpu_model"]),
        "rehearsal": not cuda,
        "note": (
            f"{precision.upper()} rows, SGD (lr {LR}); a {CACHE_RATIO:.0%} {WAYS}-way "
            f"{policy.upper()} cache; ids of bench/bandwidth.py's trace, calibrated on the host table "
            f"with a cache while every engine steps on the same batches; {WARMUP_STEPS} warm-up "
            f"steps, then {args.rounds} rounds of {args.steps} steps of every engine in turn, "
            f"timed with {'CUDA events' if cuda else 'the wall clock'}: medians (and ranges) "
            "over rounds; ratios are medians of per-round ratios. Host bytes: what the kernels "
            "read and write in a host table's storage (bench/host_placement.py)."
        ),
        "hit_rates": targets_asked,
        "rounds": args.rounds,
        "steps": args.steps,
        "runs": {},
        "targets": [],
    }
    for dim in (int(d) for d in args.dims.split(",")):
        rows = args.rows or default_rows(device, dim)
        bags = args.bags or (16384 if cuda else 2048)
        start = time.perf_counter()
        built = build(rows, dim, device, precision, policy)
        cfg = built[HOST_CACHED][0].config
        hot = max(1, min(cfg.num_slots // 2, bags * args.pooling))  # as bandwidth.py's
        trace = Trace(rows, hot, bags, args.pooling, device)
        gen = torch.Generator(device=device).manual_seed(0)
        grad = torch.randn(bags, dim, generator=gen, device=device)
        name = f"dim {dim}, {precision} + {CACHE_RATIO:.0%} {WAYS}-way {policy.upper()} cache"
        memory = built[HOST_CACHED][0].memory_bytes()
        run = result["runs"][name] = {
            "rows": rows,
            "dim": dim,
            "precision": precision,
            "policy": policy,
            "bags": bags,
            "pooling": args.pooling,
            "lookups": trace.lookups,
            "hot_rows": trace.hot,
            "table_mb": (memory["table_payload"] + memory["table_qparams"]) / 1e6,
            "cache_mb": memory["cache_rows"] / 1e6,
            "memory_bytes": {n: t.memory_bytes() for n, (t, *_r) in built.items()},
            "build_seconds": {n: sum(s.values()) for n, (*_r, s) in built.items()},
            "points": [],
        }
        for target in targets_asked:
            run["points"].append(measure(built, trace, target, args, device, grad))
            run["seconds"] = time.perf_counter() - start
            result["targets"] = [
                {"run": n, **t} for n, r in result["runs"].items() for t in targets(r["points"])
            ]
            if args.out:
                write(result, args.out)
        del built
        if cuda:
            torch.cuda.empty_cache()
    print(markdown(result))
    if args.out:
        print(f"wrote {args.out}/placement.json, placement.md")
