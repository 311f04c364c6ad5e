"""Issue 51 item 5: one table whose FP32 size exceeds the memory of the GPU it trains on.

One table of ``--rows`` rows x dim 128 (``--dim``), INT8 (``--precision``) with
``placement="host"``: its stored rows in pinned host memory, read and written in place by the
CUDA kernels, its 5% 32-way LFU FP32 cache (``--cache-ratio``, ``--ways``, ``--policy``) and
LFU counts in GPU memory. By default ``rows`` is the smallest multiple of 10M whose FP32
table (rows x dim x 4 bytes) is larger than the GPU's whole memory (``torch.cuda.mem_get_info``):
on an 80 GB H100 (79.2 GiB) 170M rows, 87 GB at FP32, 22.4 GB of INT8 rows in host memory, a 4.35 GB
cache and 0.34 GB of counts on the GPU; on a 141 GB H200 300M rows. Before building,
the host's available memory (``/proc/meminfo``) must hold the storage with a tenth to spare.

**Build.** The table's own initialisation draws its rows on the CPU with one generator per
2^16-row block, one core at a time: measured on the 2-core development VM, ``uniform_`` takes
0.36 s per 1M rows of dim 128 whatever the threads, and rounding them (``quantize_rows``, in
parallel) 0.38 s per 1M rows on 2 threads; at 170M rows that is over a minute of drawing alone
on any number of cores, about 1.5 minutes in all on 16. So the rows are drawn and rounded on the
GPU in blocks of 2^22 rows and copied into the pinned storage (``_common.filled_table``: the
table built on the meta device, given its memory by ``copy_rows_from`` of no rows, moved, then
its ``weights`` written; the same distribution as the table's own, not its draws). Its phases'
seconds are recorded: ``allocate`` (pinning and zeroing the storage, the cache's memory),
``move`` (the cache to the GPU), ``fill``. Torch's pinned allocator rounds a block up to a power
of two (docs/design.md, "Host placement": 22.4 GB would take 32 GB): this script sets
``PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:1024`` before torch starts, so blocks above
1 GiB take their own size (``pinned_bytes`` records what the allocator holds).

**Training.** SGD (lr 0.01, ``--optimizer``), bags of ``--pooling`` ids (8), ``--bags`` bags a
step (16384), every id drawn from a Zipf-like law over the rows: rank ``k`` (0 the most
frequent) with probability proportional to ``(k + 1)^-s`` (``--zipf`` s, default 1.05; drawn by
the continuous law's inverse CDF in FP64 on the GPU), the ranks scattered over the rows by a
multiplication modulo the row count. A fixed output gradient (``randn x 0.01``). Each step
prefetches the next batch after its forward, as ``dlrm train`` does (``--no-prefetch``: not;
docs/design.md, "Prefetch"). After
``WARMUP_STEPS`` steps, training runs for ``--seconds`` (60) in windows of ``--window`` seconds
(10; the device synchronized at each window's end, when the table's counters are read): per
window its steps, samples (bags)/s, lookups/s and hit rate, and the cache's insertions,
evictions and bypasses, so the cache's warming shows. ``top_rows_share``: the share of
lookups that go to the ``cache slots`` most frequent rows, the hit rate of an ideal cache of
that size on this law (set conflicts and LFU's counting ignored).

Recorded (``OUT/beyond_gpu.json``, strict JSON, and ``OUT/beyond_gpu.md``, under the command,
commit, GPU, driver, CUDA and torch versions; ``EMBCACHE_COMMIT`` names the commit where the
tree has no git metadata): samples/s and the hit rate over the timed run and its last window;
the FP32 size against the GPU's memory; the table's device and host bytes (``memory_bytes()``);
the peak device memory (allocated and reserved by torch) and the device's free memory at the
end; the pinned bytes the allocator holds and the process's resident memory; the build's
seconds. Expected on an H100: about 2 minutes (start, build 15-30 s, 60 s of training,
teardown); give it a timeout of 300 s.

Where torch has no CUDA device, or with ``--device cpu``, the table is built with
``placement="device"`` (host placement needs CUDA): a rehearsal, marked ``rehearsal``.
``--quick`` (200,000 rows, 256 bags, 3 s in windows of 1 s) rehearses in seconds. Examples:

    python bench/beyond_gpu.py --out bench/results/beyond_gpu
    python bench/beyond_gpu.py --device cpu --quick --out /tmp/beyond_gpu
"""

from __future__ import annotations

import os

# before torch starts: pinned blocks above 1 GiB take their own size, not the next power of two
_CONF = "pinned_max_round_threshold_mb:1024"
if "pinned_max_round_threshold_mb" not in os.environ.get("PYTORCH_ALLOC_CONF", ""):
    os.environ["PYTORCH_ALLOC_CONF"] = ",".join(
        c for c in (os.environ.get("PYTORCH_ALLOC_CONF"), _CONF) if c
    )

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _common import (  # noqa: E402
    environment,
    environment_markdown,
    filled_table,
    torch_device,
    write_text,
)

from embcache.config import TableConfig  # noqa: E402
from embcache.memory import memory_breakdown  # noqa: E402

WARMUP_STEPS = 3
ROWS_QUANTUM = 10_000_000
LR = 0.01
QUICK = {"rows": 200_000, "bags": 256, "seconds": 3.0, "window": 1.0}
DEFAULTS = {"bags": 16384, "seconds": 60.0, "window": 10.0}
HOST_SPARE = 0.1  # of the host's available memory, left free


def default_rows(device_bytes: int, dim: int) -> int:
    """The smallest multiple of ROWS_QUANTUM rows whose FP32 table (rows x dim x 4 bytes) is
    larger than ``device_bytes``."""
    rows = ROWS_QUANTUM * (device_bytes // (dim * 4) // ROWS_QUANTUM + 1)
    assert rows * dim * 4 > device_bytes
    return rows


def available_host_bytes() -> int | None:
    """MemAvailable (/proc/meminfo), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def process_memory() -> dict:
    """The process's resident and locked memory, bytes (/proc/self/status; empty elsewhere)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "VmLck", "VmPin"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


class Zipf:
    """Batches of ``n`` ids over ``rows`` rows: rank k with probability about (k + 1)^-s
    (the continuous law's inverse CDF over [1, rows + 1), in FP64), ranks scattered over the
    rows by a multiplication modulo ``rows`` (a bijection: the multiplier is coprime with it)."""

    def __init__(self, rows: int, s: float, n: int, device: torch.device, seed: int = 0):
        self.rows, self.s, self.n, self.device = rows, s, n, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.mult = 2654435761
        while math.gcd(self.mult, rows) != 1:
            self.mult += 2
        self.top = float(rows + 1)

    def batch(self) -> torch.Tensor:
        u = torch.rand(self.n, generator=self.gen, device=self.device, dtype=torch.float64)
        if self.s == 1.0:
            x = self.top**u
        else:
            a = 1.0 - self.s
            x = (1.0 + u * (self.top**a - 1.0)) ** (1.0 / a)
        rank = x.long().clamp_(1, self.rows) - 1
        return rank * self.mult % self.rows

    def top_share(self, k: int) -> float:
        """The share of draws whose rank is below ``k`` (the continuous law's CDF at k + 1)."""
        if self.s == 1.0:
            return math.log(k + 1) / math.log(self.top)
        a = 1.0 - self.s
        return ((k + 1) ** a - 1.0) / (self.top**a - 1.0)


def window_figures(before: dict, after: dict, steps: int, seconds: float, bags: int) -> dict:
    """A window's figures from the table's counters before and after it."""
    delta = {k: after[k] - before[k] for k in ("lookups", "hits", "insertions", "evictions")}
    delta["bypasses"] = after["bypasses"] - before["bypasses"]
    return {
        "steps": steps,
        "seconds": seconds,
        "samples_per_s": steps * bags / seconds if seconds > 0 else 0.0,
        "lookups_per_s": delta["lookups"] / seconds if seconds > 0 else 0.0,
        "hit_rate": delta["hits"] / delta["lookups"] if delta["lookups"] else 0.0,
        **{k: delta[k] for k in ("insertions", "evictions", "bypasses")},
    }


def markdown(r: dict) -> str:
    gb = 1e9
    t, m = r["table"], r["memory"]
    lines = [
        f"# One table larger than the GPU ({r['where']})",
        "",
        environment_markdown(r["environment"]),
        "",
    ]
    if r["rehearsal"]:
        lines += [
            "**Rehearsal**: no CUDA device, so the table was built with placement='device'.",
            "",
        ]
    lines += [
        f"{t['rows']:,} rows x dim {t['dim']}, {t['precision']} with placement="
        f"'{t['placement_used']}', a {t['cache_ratio']:.0%} {t['ways']}-way "
        f"{t['policy'].upper()} cache ({t['cache_slots']:,} slots), {t['optimizer']}; "
        f"{r['bags']} bags of {r['pooling']} ids a step, Zipf s = {r['zipf']} "
        f"(an ideal cache of that size would hit {r['top_rows_share']:.1%}); "
        f"{'the next batch prefetched' if r['prefetch'] else 'no prefetch'}.",
        "",
        (
            f"FP32 size {m['fp32_bytes'] / gb:.1f} GB against the GPU's "
            f"{m['device_total_bytes'] / gb:.1f} GB ({m['fp32_over_device']:.2f}x). "
            if m["device_total_bytes"]
            else f"FP32 size {m['fp32_bytes'] / gb:.1f} GB (no GPU). "
        )
        + f"Table: "
        f"{m['table']['device'] / gb:.2f} GB on the device, {m['table']['host'] / gb:.2f} GB "
        f"in host memory; peak device memory {m['peak_allocated_bytes'] / gb:.2f} GB "
        f"allocated, {m['peak_reserved_bytes'] / gb:.2f} GB reserved; pinned "
        f"{m['pinned_bytes'] / gb:.2f} GB.",
        "",
        f"Built in {sum(r['build_seconds'].values()):.1f} s ("
        + ", ".join(f"{k} {v:.1f} s" for k, v in r["build_seconds"].items())
        + ").",
        "",
        f"**{r['samples_per_s']:,.0f} samples/s, hit rate {r['hit_rate']:.1%}** over "
        f"{r['steps']} steps in {r['seconds']:.1f} s (last window: "
        f"{r['last_window']['samples_per_s']:,.0f} samples/s, "
        f"{r['last_window']['hit_rate']:.1%}).",
        "",
        "| window | steps | seconds | samples/s | lookups/s | hit rate | insertions | "
        "evictions | bypasses |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, w in enumerate(r["windows"]):
        lines.append(
            f"| {i} | {w['steps']} | {w['seconds']:.2f} | {w['samples_per_s']:,.0f} | "
            f"{w['lookups_per_s']:,.0f} | {w['hit_rate']:.1%} | {w['insertions']:,} | "
            f"{w['evictions']:,} | {w['bypasses']:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    p.add_argument("--rows", type=int, help="rows (default: FP32 larger than the GPU's memory)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--precision", default="int8")
    p.add_argument("--cache-ratio", type=float, default=0.05)
    p.add_argument("--ways", type=int, default=32)
    p.add_argument("--policy", default="lfu")
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--bags", type=int, help="bags a step (default: 16384)")
    p.add_argument("--pooling", type=int, default=8)
    p.add_argument("--zipf", type=float, default=1.05, help="the law's exponent s")
    p.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stage the next batch's misses during each step (default: %(default)s)",
    )
    p.add_argument("--seconds", type=float, help="seconds of timed training (default: 60)")
    p.add_argument("--window", type=float, help="seconds a window (default: 10)")
    p.add_argument("--quick", action="store_true", help="a small rehearsal (CPU)")
    p.add_argument("--out", type=Path, help="write beyond_gpu.json and .md here")
    args = p.parse_args(argv)
    for key, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch_device(args.device)
    cuda = device.type == "cuda"
    device_total = torch.cuda.mem_get_info(device)[1] if cuda else None
    if args.rows is None:
        if not cuda:
            p.error("--rows (or --quick) is needed without a CUDA device")
        args.rows = default_rows(device_total, args.dim)
    placement = "host" if cuda else "device"
    options = dict(
        mode="sum",
        precision=args.precision,
        cache_ratio=args.cache_ratio,
        associativity=args.ways,
        policy=args.policy,
        optimizer=args.optimizer,
        lr=LR,
        placement=placement,
    )
    planned = memory_breakdown(TableConfig.of(args.rows, args.dim, **options))
    available = available_host_bytes()
    host_need = planned["host"] if cuda else planned["total"]
    if available is not None and host_need > (1 - HOST_SPARE) * available:
        raise SystemExit(
            f"beyond_gpu.py: {args.rows:,} rows need {host_need / 1e9:.1f} GB of host memory, "
            f"and {available / 1e9:.1f} GB are available (with {HOST_SPARE:.0%} to spare): "
            "give fewer --rows"
        )
    env = environment(__file__, argv, gpu=cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    table, build_seconds = filled_table(args.rows, args.dim, device, **options)
    cfg = table.config
    zipf = Zipf(args.rows, args.zipf, args.bags * args.pooling, device)
    offsets = torch.arange(0, args.bags * args.pooling, args.pooling, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    grad = torch.randn(args.bags, args.dim, generator=gen, device=device) * 0.01

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    upcoming = [zipf.batch()]  # the next step's ids, drawn a step ahead

    def step() -> None:
        out = table(upcoming.pop(), offsets)
        upcoming.append(zipf.batch())
        if args.prefetch:
            table.prefetch(upcoming[0], offsets)
        out.backward(grad)
        table.step()

    for _ in range(WARMUP_STEPS):
        step()
    sync()
    windows, total_steps = [], 0
    begin = time.perf_counter()
    while time.perf_counter() - begin < args.seconds:
        before, start, steps = table.stats(), time.perf_counter(), 0
        while steps == 0 or time.perf_counter() - start < args.window:
            step()
            steps += 1
            if time.perf_counter() - begin >= args.seconds:
                break
        sync()
        windows.append(
            window_figures(before, table.stats(), steps, time.perf_counter() - start, args.bags)
        )
        total_steps += steps
    seconds = sum(w["seconds"] for w in windows)
    lookups = sum(w["lookups_per_s"] * w["seconds"] for w in windows)
    hits = sum(w["hit_rate"] * w["lookups_per_s"] * w["seconds"] for w in windows)
    memory = table.memory_bytes()
    try:
        pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if cuda else 0
    except RuntimeError:
        pinned = 0
    fp32 = args.rows * args.dim * 4
    result = {
        "environment": env,
        "where": env.get("gpu", env["cpu_model"]),
        "rehearsal": not cuda,
        "table": {
            "rows": args.rows,
            "dim": args.dim,
            "precision": cfg.stored_precision,
            "placement": "host",
            "placement_used": cfg.placement,
            "cache_ratio": args.cache_ratio,
            "cache_slots": cfg.num_slots,
            "ways": cfg.ways,
            "policy": cfg.policy,
            "optimizer": cfg.optimizer,
            "row_bytes": cfg.row_bytes,
        },
        "prefetch": args.prefetch,
        "bags": args.bags,
        "pooling": args.pooling,
        "zipf": args.zipf,
        "top_rows_share": zipf.top_share(cfg.num_slots),
        "build_seconds": build_seconds,
        "warmup_steps": WARMUP_STEPS,
        "steps": total_steps,
        "seconds": seconds,
        "samples_per_s": total_steps * args.bags / seconds,
        "hit_rate": hits / lookups if lookups else 0.0,
        "last_window": windows[-1],
        "windows": windows,
        "cached_rows": int((table.cache_tags >= 0).sum()),
        "memory": {
            "table": memory,
            "fp32_bytes": fp32,
            "device_total_bytes": device_total or 0,
            "fp32_over_device": fp32 / device_total if device_total else 0.0,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else 0,
            "device_free_bytes_at_end": torch.cuda.mem_get_info(device)[0] if cuda else 0,
            "pinned_bytes": pinned,
            "process": process_memory(),
            "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""),
        },
    }
    text = markdown(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_text(args.out / "beyond_gpu.json", json.dumps(result, indent=1, allow_nan=False))
        write_text(args.out / "beyond_gpu.md", text)
        print(f"wrote {args.out}/beyond_gpu.json, beyond_gpu.md")
    return result


if __name__ == "__main__":
    main()
