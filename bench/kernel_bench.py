"""Issue 50's GPU benchmark: our tables' kernels beside the machine's ceilings and
``nn.EmbeddingBag``, on the same ids, timed with CUDA events.

Configurations (``CONFIGS``), in this order (the results are written after each, so that a
run cut short keeps those done):

* FBGEMM's published TBE benchmark: T=32 tables of E=100,000 rows, D=128, bags of L=20 ids,
  B=512 bags a table (327,680 lookups a step);
* Criteo's 26 features, one id a bag: 26 tables of 100,000 rows at dim 16 and at dim 128,
  each at batch 2048 and 16384 (the tables built once per dim).

In each, every table's ids come from ``bandwidth.Trace`` (with probability p a row of a hot
set of half the cache's slots, else the next row of a walk through the others), p calibrated
(``bandwidth.calibrate``) until our collection counts ``--hit-rate`` hits (default 95%).
Every engine then trains on the same batches, from the same output gradient:

* ``nn.EmbeddingBag`` FP32, ``sparse=True``, a module per table, ``torch.optim.SGD``;
* ours, INT8 rows behind a 5% 32-way LFU cache, SGD: a module per table (``embcache.swap``
  of those modules, stepped by ``embcache.TableOptimizer``); and the same tables as one
  collection (``CachedLowPrecisionEmbeddingBags``: one table-batched call a phase);

beside the ceilings, which only read: ``index_select`` of the FP32 rows from one table
holding every table's rows (the bare read of the rows a forward sums: the gather rate), and
``nn.EmbeddingBag``'s forward on that table (one pooled gather), each call on the step's
batch and as many more of the trace as make ``CEILING_BYTES`` of rows (so that the host's
time a call stays under a tenth of it; their figures are a batch's); and once a run a
device-to-device copy (bytes read plus written).

Timing: after calibration and ``WARMUP_STEPS`` steps of every engine, ``--rounds`` rounds in
each of which every engine in turn runs ``--steps`` steps on the round's batches. CUDA
events mark each step's start, the end of its forward and the end of its update (on the CPU,
whose ops return when done, the wall clock). An engine's figure is the median over rounds of
its mean ms a step; a ratio of two engines is the median of their per-round ratios (the two
timed in the same round). Bytes are counted as FBGEMM counts them, whatever a table stores:
the forward ``lookups x D x 4``, forward + backward + update ``3 x lookups x D x 4``. Over
``PROFILE_STEPS`` more steps under torch.profiler (``_common.runtime_calls``): host syncs and
kernel launches a step, and the device's busy ms, whose share of the step's time says
whether that time is its kernels' (the rest is the device waiting for the host: launches,
syncs, Python).

The targets of issue 50 item 2 (``targets`` in the JSON, the first table of the Markdown),
each as the figure, the figure it is compared with, their ratio and the goal:

* every configuration, each of our engines: its forward against the gather (``index_select``)
  of the same rows, at least 0.6 (at 95% hits and above);
* FBGEMM's shape: forward + backward + update GB/s against 500 GB/s (at least 1.0), and
  against FBGEMM's published 978 GB/s (its FP32 rows resident in its cache; the moonshot);
* the 26-table configurations: nn.EmbeddingBag's step time over ours, at least 1.0.

Results: ``OUT/kernel_bench.json`` (strict JSON) and ``OUT/kernel_bench.md``, under the
command, commit, GPU, driver, CUDA and torch versions (``_common.environment``). ``--quick``
shrinks every configuration (3 tables of 2,000 rows), the copy and the ceilings' calls, to
rehearse on a CPU (the tests and ``gpu_check.py --rehearse`` run it). Examples:

    python bench/kernel_bench.py --out bench/results/kernels_gpu
    python bench/kernel_bench.py --device cpu --quick --rounds 2 --steps 2
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import environment, environment_markdown, runtime_calls, torch_device, write_text
from bandwidth import WARMUP_STEPS, Trace, calibrate
from torch import nn

import embcache

CACHE = {"precision": "int8", "cache_ratio": 0.05, "associativity": 32, "policy": "lfu"}
LR = 0.01
PROFILE_STEPS = 3
# bytes of the copy; and of rows a ceiling reads a call at least, as many batches' as make
# them: 0.1-0.2 ms on an H100, so that the ~10 us the host spends a call stays under 10% of it.
# --quick divides both by QUICK_SHRINK.
COPY_BYTES, CEILING_BYTES, QUICK_SHRINK = 1 << 30, 128 << 20, 1 << 12
# issue 50 item 2's goals, and FBGEMM's published rate on its shape (PR #4614)
FORWARD_SHARE_GOAL, STEP_GBS_GOAL, STEP_RATIO_GOAL, FBGEMM_GBS = 0.6, 500.0, 1.0, 978.0

# the engines (module docstring); ours: INT8 rows behind a 5% 32-way LFU cache
BAGS = "nn.EmbeddingBag + SGD, a module per table"
MODULES = "ours, a module per table (swap)"
COLLECTION = "ours, one collection"
GATHER = "gather: index_select, one table"
POOLED = "nn.EmbeddingBag forward, one table"
OURS = (MODULES, COLLECTION)


@dataclasses.dataclass(frozen=True)
class Config:
    """``tables`` tables of ``rows`` rows of ``dim``, read by bags of ``pooling`` ids, at each
    of ``batches`` bags a table; ``fbgemm``: FBGEMM's published shape (its targets)."""

    name: str
    tables: int
    rows: int
    dim: int
    pooling: int
    batches: tuple[int, ...]
    fbgemm: bool = False

    def quick(self) -> Config:
        """The same, small enough to rehearse on a CPU in seconds."""
        return dataclasses.replace(
            self,
            tables=3,
            rows=2000,
            dim=max(4, self.dim // 16),
            pooling=min(self.pooling, 4),
            batches=tuple(max(4, b // 256) for b in self.batches),
        )


CONFIGS = (
    Config("FBGEMM's shape", 32, 100_000, 128, 20, (512,), fbgemm=True),
    Config("26 features, dim 16", 26, 100_000, 16, 1, (2048, 16384)),
    Config("26 features, dim 128", 26, 100_000, 128, 1, (2048, 16384)),
)


@dataclasses.dataclass
class Engine:
    """One way of stepping ``batches`` batches of ids at once (each flat and table-major:
    table t's bags are ``ids.view(tables, -1)[t]``; several concatenated): ``prepare`` them,
    outside the clock; ``forward`` them; then, if there is an ``optimizer`` (``step``,
    ``zero_grad``), the backward of the output's gradient and the optimizer's step (the
    ceilings only read, several batches a call). ``cached``: our tables, whose counters give
    the hit rate. ``prefetch``, if any, is given the next prepared batch after each forward
    (as dlrm's trainer gives it), within the step's time."""

    forward: Callable
    optimizer: object | None = None
    cached: list = dataclasses.field(default_factory=list)
    prepare: Callable = lambda ids: ids
    batches: int = 1
    prefetch: Callable | None = None

    def update(self, out: torch.Tensor, grad: torch.Tensor) -> None:
        if self.optimizer is not None:
            out.backward(grad)
            self.optimizer.step()
            self.optimizer.zero_grad()

    def counts(self) -> dict:
        """The ``lookups`` and ``hits`` of the cached tables (none: zero)."""
        stats = [t.stats() for t in self.cached]
        return {k: sum(s[k] for s in stats) for k in ("lookups", "hits")}


def build(c: Config, device: torch.device) -> dict:
    """The tables of configuration ``c`` on ``device``: a module per table
    (``nn.EmbeddingBag``, and ours made from a copy of them by ``embcache.swap``), our
    collection, and one FP32 table of every table's rows (the ceilings')."""
    bags = nn.ModuleList(
        nn.EmbeddingBag(c.rows, c.dim, mode="sum", sparse=True, device=device)
        for _ in range(c.tables)
    )
    swapped = copy.deepcopy(bags)
    embcache.swap(swapped, lr=LR, **CACHE)  # ours are made in host memory
    tables = [embcache.BagTable(f"t{t}", c.rows, c.dim) for t in range(c.tables)]
    return {
        "bags": bags,
        "swapped": swapped.to(device),
        "collection": embcache.CachedLowPrecisionEmbeddingBags(
            tables, device=device, lr=LR, **CACHE
        ),
        "stacked": nn.EmbeddingBag(c.tables * c.rows, c.dim, mode="sum", device=device),
    }


def engines(
    built: dict, c: Config, batch: int, ceiling_bytes: int, device: torch.device
) -> dict[str, Engine]:
    """Every engine of the module docstring over ``built`` (``build``), at ``batch`` bags a
    table; the ceilings read as many batches a call as make ``ceiling_bytes`` of rows."""
    lookups = c.tables * batch * c.pooling
    wide = -(-ceiling_bytes // (lookups * c.dim * 4))
    starts = torch.arange(0, batch * c.pooling, c.pooling, device=device)  # a table's bags
    all_starts = torch.arange(0, wide * lookups, c.pooling, device=device)
    lengths = torch.full((c.tables * batch,), c.pooling, dtype=torch.int32, device=device)
    first_row = torch.arange(c.tables, device=device).repeat_interleave(lookups // c.tables)
    first_row = (first_row * c.rows).repeat(wide)
    stacked, collection = built["stacked"], built["collection"]

    def per_table(modules):
        def forward(ids):
            return torch.cat([m(x, starts) for m, x in zip(modules, ids)], 1)

        return forward

    @torch.no_grad()
    def gather(ids):
        return stacked.weight.index_select(0, ids)

    @torch.no_grad()
    def pooled(ids):
        return stacked(ids, all_starts)

    def in_tables(ids):
        return ids.view(c.tables, -1)

    def in_stacked(ids):
        return ids + first_row

    return {
        BAGS: Engine(
            per_table(built["bags"]),
            torch.optim.SGD(built["bags"].parameters(), lr=LR),
            prepare=in_tables,
        ),
        MODULES: Engine(
            per_table(built["swapped"]),
            embcache.TableOptimizer(built["swapped"]),
            list(built["swapped"]),
            prepare=in_tables,
        ),
        COLLECTION: Engine(
            lambda ids: collection(ids, lengths),
            embcache.TableOptimizer(collection),
            collection.tables(),
        ),
        GATHER: Engine(gather, prepare=in_stacked, batches=wide),
        POOLED: Engine(pooled, prepare=in_stacked, batches=wide),
    }


def mark(device: torch.device):
    """A point on the device's timeline: a CUDA event recorded on the current stream, or on
    the CPU the wall clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def ms_between(a, b) -> float:
    """Milliseconds from mark ``a`` to mark ``b`` (CUDA events: once ``b`` has happened)."""
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(engine: Engine, batches: list, grad: torch.Tensor, device: torch.device):
    """(forward, forward + update) mean ms a batch of ``engine`` over ``batches`` (each of
    ``engine.batches`` batches)."""
    inputs = [engine.prepare(ids) for ids in batches]
    marks = []
    for i, x in enumerate(inputs):
        start = mark(device)
        out = engine.forward(x)
        middle = mark(device)
        if engine.prefetch is not None and i + 1 < len(inputs):
            engine.prefetch(inputs[i + 1])
        engine.update(out, grad)
        marks.append((start, middle, mark(device)))
    synchronize(device)
    n = len(marks) * engine.batches
    return (
        sum(ms_between(a, b) for a, b, _ in marks) / n,
        sum(ms_between(a, e) for a, _, e in marks) / n,
    )


def copy_gbs(nbytes: int, rounds: int, device: torch.device) -> list[float]:
    """GB/s of a copy of ``nbytes`` on ``device`` (bytes read plus written), each of ``rounds``
    copies timed alone, after one untimed."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(rounds):
        start = mark(device)
        dst.copy_(src)
        end = mark(device)
        synchronize(device)
        rates.append(2 * nbytes / ms_between(start, end) / 1e6)
    return rates


def measure(
    built: dict, c: Config, batch: int, args, ceiling_bytes: int, device: torch.device
) -> dict:
    """Every engine at ``batch`` bags a table (module docstring; ``args``: the command line's
    rounds, steps and hit rate): per engine its ms a batch (forward, whole step: medians and
    rounds), GB/s, hit rate, and what the profiler counts a batch."""
    forward_bytes = c.tables * batch * c.pooling * c.dim * 4
    found = engines(built, c, batch, ceiling_bytes, device)
    slots = built["collection"].tables()[0].config.num_slots
    hot = max(1, min(slots // 2, batch * c.pooling))
    trace = Trace(c.rows, hot, c.tables * batch, c.pooling, device)
    gen = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(batch, c.tables * c.dim, generator=gen, device=device)

    def call_ids(engine: Engine, batches: list) -> list:
        """Each batch, followed by ``engine.batches - 1`` more of the trace: a call's ids."""
        more = engine.batches - 1
        return [torch.cat([ids, *(trace.batch(p) for _ in range(more))]) for ids in batches]

    ours = found[COLLECTION]
    p = calibrate(
        lambda p: ours.update(ours.forward(trace.batch(p)), grad), ours.counts, args.hit_rate
    )
    warm = [trace.batch(p) for _ in range(WARMUP_STEPS)]
    for engine in found.values():
        timed(engine, call_ids(engine, warm), grad, device)
    before = {name: e.counts() for name, e in found.items()}
    rounds = {name: ([], []) for name in found}
    for _ in range(args.rounds):
        batches = [trace.batch(p) for _ in range(args.steps)]
        for name, engine in found.items():
            forward, step = timed(engine, call_ids(engine, batches), grad, device)
            rounds[name][0].append(forward)
            rounds[name][1].append(step)
    counted = {name: (before[name], e.counts()) for name, e in found.items()}
    out = {}
    for name, engine in found.items():
        forward, step = (statistics.median(r) for r in rounds[name])
        first, last = counted[name]
        lookups = last["lookups"] - first["lookups"]
        profiled = call_ids(engine, [trace.batch(p) for _ in range(PROFILE_STEPS)])
        profiled = [engine.prepare(ids) for ids in profiled]

        def run(engine=engine, profiled=profiled):
            for x in profiled:
                engine.update(engine.forward(x), grad)

        calls = runtime_calls(run, PROFILE_STEPS * engine.batches, device)
        busy = calls["device_ms"]
        out[name] = {
            "batches_a_call": engine.batches,
            "forward_ms": forward,
            "step_ms": step,
            "forward_ms_rounds": rounds[name][0],
            "step_ms_rounds": rounds[name][1],
            "forward_gbs": forward_bytes / forward / 1e6,
            "step_gbs": 3 * forward_bytes / step / 1e6 if engine.optimizer else None,
            "hit_rate": (last["hits"] - first["hits"]) / lookups if lookups else None,
            **calls,
            "kernel_share": None if busy is None else busy / step,
        }
    shape = {k: v for k, v in dataclasses.asdict(c).items() if k not in ("name", "batches")}
    return {
        **shape,
        "batch": batch,
        "lookups": trace.lookups,
        "forward_bytes": forward_bytes,
        "hot_rows": trace.hot,
        "p_hot": p,
        "engines": out,
    }


def targets(runs: dict[str, dict]) -> list[dict]:
    """Issue 50 item 2's targets over ``runs`` (module docstring), a row per target, run and
    engine of ours: the figure, what it is compared with and its value, the ratio (the
    median of the per-round ratios, and those), the goal and whether the ratio meets it."""
    rows = []
    for run, r in runs.items():
        e = r["engines"]
        for name in OURS:
            ours = e[name]
            found = [
                (
                    "forward / gather of the same rows",
                    ours["forward_gbs"],
                    "GB/s",
                    GATHER,
                    e[GATHER]["forward_gbs"],
                    _paired(e[GATHER]["forward_ms_rounds"], ours["forward_ms_rounds"]),
                    FORWARD_SHARE_GOAL,
                )
            ]
            if r["fbgemm"]:
                gbs = [3 * r["forward_bytes"] / ms / 1e6 for ms in ours["step_ms_rounds"]]
                for versus, rate in [
                    ("issue 50's goal", STEP_GBS_GOAL),
                    ("FBGEMM TBE, published (fp32 rows in its cache)", FBGEMM_GBS),
                ]:
                    found.append(
                        (
                            "forward + backward + update GB/s",
                            ours["step_gbs"],
                            "GB/s",
                            versus,
                            rate,
                            [x / rate for x in gbs],
                            1.0,
                        )
                    )
            else:
                found.append(
                    (
                        "step: nn.EmbeddingBag's ms / ours",
                        ours["step_ms"],
                        "ms",
                        BAGS,
                        e[BAGS]["step_ms"],
                        _paired(e[BAGS]["step_ms_rounds"], ours["step_ms_rounds"]),
                        STEP_RATIO_GOAL,
                    )
                )
            for target, figure, unit, versus, value, ratios, goal in found:
                ratio = statistics.median(ratios)
                rows.append(
                    {
                        "target": target,
                        "run": run,
                        "engine": name,
                        "hit_rate": ours["hit_rate"],
                        "figure": figure,
                        "unit": unit,
                        "compared_with": versus,
                        "compared_value": value,
                        "ratio": ratio,
                        "ratio_rounds": ratios,
                        "goal": goal,
                        "met": ratio >= goal,
                    }
                )
    return rows


def _paired(numerators: list[float], denominators: list[float]) -> list[float]:
    """Round by round, the first's figure over the second's."""
    return [a / b for a, b in zip(numerators, denominators)]


def _cell(x, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def spread(values: list[float], fmt: str) -> str:
    """``median (min-max)`` of ``values``, each in ``fmt``."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def markdown(result: dict) -> str:
    lines = [
        f"# Kernels against the ceilings and nn.EmbeddingBag ({result['where']})",
        "",
        environment_markdown(result["environment"]),
        "",
        result["note"],
        "",
        f"Device-to-device copy: {spread(result['copy_gbs_rounds'], '.0f')} GB/s "
        "(bytes read plus written; median and range).",
        "",
        "## Issue 50's targets",
        "",
        "| target | run | engine (hit rate) | figure | compared with | ratio (rounds) | goal "
        "| met |",
        "|---|---|---|---:|---|---:|---:|---|",
    ]
    for t in result["targets"]:
        lines.append(
            f"| {t['target']} | {t['run']} | {t['engine']} ({100 * t['hit_rate']:.1f}%) | "
            f"{t['figure']:.3g} {t['unit']} | {t['compared_with']}: {t['compared_value']:.3g} "
            f"{t['unit']} | {spread(t['ratio_rounds'], '.2f')} | {t['goal']:g} | "
            f"{'yes' if t['met'] else 'no'} |"
        )
    for run, r in result["runs"].items():
        lines += [
            "",
            f"## {run}",
            "",
            f"{r['tables']} tables of {r['rows']:,} rows, dim {r['dim']}, {r['batch']} bags of "
            f"{r['pooling']} ids a table ({r['lookups']:,} lookups a step); hot sets of "
            f"{r['hot_rows']:,} rows a table drawn with p = {r['p_hot']:.3f}. The ceilings "
            f"read {r['engines'][GATHER]['batches_a_call']} batches a call; every figure is a "
            "batch's.",
            "",
            "| engine | forward ms | forward GB/s | step ms | step GB/s | hit rate | syncs "
            "| launches | device ms | kernel share |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, e in r["engines"].items():
            hit = None if e["hit_rate"] is None else 100 * e["hit_rate"]
            lines.append(
                f"| {name} | {spread(e['forward_ms_rounds'], '.3g')} | "
                f"{e['forward_gbs']:.3g} | {spread(e['step_ms_rounds'], '.3g')} | "
                f"{_cell(e['step_gbs'])} | {_cell(hit, '.1f')} | {_cell(e['syncs'], 'g')} | "
                f"{_cell(e['launches'], 'g')} | {_cell(e['device_ms'])} | "
                f"{_cell(e['kernel_share'], '.0%')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="small configurations: a CPU rehearsal")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every engine in turn")
    p.add_argument("--steps", type=int, default=10, help="timed steps per engine per round")
    p.add_argument(
        "--hit-rate",
        type=float,
        default=0.95,
        help="the hit rate our collection is calibrated to (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, help="write kernel_bench.json and .md here")
    args = p.parse_args()
    device = torch_device(args.device)
    env = environment(__file__, gpu=device.type == "cuda")
    configs = [c.quick() for c in CONFIGS] if args.quick else list(CONFIGS)
    clock = "CUDA events" if device.type == "cuda" else "the wall clock"
    shrink = QUICK_SHRINK if args.quick else 1
    copies = copy_gbs(COPY_BYTES // shrink, 2 * args.rounds, device)
    result = {
        "environment": env,
        "where": env.get("gpu", env["cpu_model"]),
        "note": (
            f"Ids of a hot set and a walk (bench/bandwidth.py's trace), calibrated to "
            f"{args.hit_rate:.0%} hits of our collection; SGD, lr {LR}; {WARMUP_STEPS} "
            f"warm-up steps, then {args.rounds} rounds of {args.steps} steps of every engine "
            f"in turn, timed with {clock}: medians (and ranges) over rounds; ratios are the "
            "median of per-round ratios. GB/s as FBGEMM counts them: the forward lookups x "
            "dim x 4 bytes, the step (forward, backward, update) 3 x that. Syncs, launches "
            f"and device ms a step under torch.profiler ({PROFILE_STEPS} steps); kernel share: "
            "device ms over step ms."
        ),
        "hit_rate_target": args.hit_rate,
        "rounds": args.rounds,
        "steps": args.steps,
        "copy_gbs": statistics.median(copies),
        "copy_gbs_rounds": copies,
        "runs": {},
        "targets": [],
    }
    for c in configs:
        start = time.perf_counter()
        built = build(c, device)
        built_s = time.perf_counter() - start
        for batch in c.batches:
            start = time.perf_counter()
            run = measure(built, c, batch, args, CEILING_BYTES // shrink, device)
            # wall seconds: the tables' build (shared by the configuration's batches), this run
            run["seconds"] = {"build": built_s, "measure": time.perf_counter() - start}
            name = f"{c.name}, batch {batch}"
            result["runs"][name] = run
            result["targets"] = targets(result["runs"])
            if args.out:
                write(result, args.out)
            print(f"{name}: {run['seconds']}", flush=True)
        del built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(markdown(result))


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "kernel_bench.json", json.dumps(result, indent=1, allow_nan=False))
    write_text(out / "kernel_bench.md", markdown(result))


if __name__ == "__main__":
    main()
