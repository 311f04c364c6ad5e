"""The embedding access stream shared by ``bench/hit_rate.py`` and ``bench/skew.py``.

A source is one of:

* ``synthetic`` (default): the default data of ``dlrm train`` (``dlrm.data.synthetic``),
  generated once into ``--data-root``/data/ exactly as ``dlrm train`` would;
* a preprocessed directory written by ``dlrm preprocess`` / ``dlrm generate``
  (``sparse.npy`` int32 [N, 26] memory-mapped, one split of it by ``--split``);
* a saved trace ``.npy`` of ids [N, tables] (any integer type), read in file order.

Tables are named ``t_0``, ``t_1``, ... as in ``dlrm train``; a table's row count is its
cardinality (for a trace: the largest id + 1).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.metadata
import logging
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

# torch.fx's import-time notice concerns neither us nor the user (as in dlrm.cli).
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

ROOT = Path(__file__).resolve().parent.parent
# The paths whose uncommitted changes make a result "dirty" (results themselves excluded).
CODE_PATHS = ("bench", "embcache", "dlrm", "csrc", "setup.py", "pyproject.toml")
PACKAGES = {
    "torch": ("torch",),
    "fbgemm_gpu": ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu"),
    "torchrec": ("torchrec", "torchrec-nightly"),
}


def same_memory_footing() -> dict:
    """Puts every engine a benchmark times on the same memory footing, and says which
    (``huge_pages``, ``keep_freed_memory``). Call it before torch is imported (torch reads
    THP_MEM_ALLOC_ENABLE when it first allocates), and in each process (mallopt is per
    process; the environment variable is inherited).

    * Huge pages: our tables madvise theirs (embcache.embedding._state_tensor), which halves
      the cost of a random row on these machines; torch's own huge-page allocation
      (THP_MEM_ALLOC_ENABLE=1) gives the peers' tables the same. EMBCACHE_HUGE_PAGES=0 turns
      huge pages off for all.
    * Freed memory: glibc gives freed memory back to the OS once the top of its heap passes a
      threshold that adapts to the process's history, so whether a step's multi-MB buffers
      are page-faulted in (and zeroed) again every step depends on what ran before. Here glibc
      keeps it (mallopt: no trimming; blocks under 32 MiB from the heap, not mmap).
      EMBCACHE_KEEP_FREED_MEMORY=0 leaves glibc's defaults; False where it is not glibc."""
    huge_pages = os.environ.get("EMBCACHE_HUGE_PAGES", "1") != "0"
    if huge_pages:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    keep = os.environ.get("EMBCACHE_KEEP_FREED_MEMORY", "1") != "0"
    if keep:
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except AttributeError:
            keep = False
        else:
            keep = bool(mallopt(m_trim_threshold, 1 << 30)) and bool(
                mallopt(m_mmap_threshold, 32 << 20)
            )
    return {"huge_pages": huge_pages, "keep_freed_memory": keep}


def memory_footing_words(footing: dict) -> str:
    """``same_memory_footing``'s result in words, for a results page."""
    return (
        f"huge pages {'on' if footing['huge_pages'] else 'off'} and freed memory "
        f"{'kept' if footing['keep_freed_memory'] else 'as glibc decides'} for every engine"
    )


def progress(iterable=None, **kwargs) -> tqdm:
    """A tqdm bar on a terminal and nothing when the output is a file or a pipe (logs and CI
    stay clean); ``tqdm.write`` still prints either way."""
    return tqdm(iterable, disable=None, **kwargs)


def huge_page_share(tensors) -> float | None:
    """The share of the bytes of CPU tensor ``tensors`` (or of a list of them, weighted by
    their bytes) in mappings backed by transparent huge pages: each mapping a tensor overlaps
    counts its ``AnonHugePages`` share (``/proc/self/smaps``, read once) for the bytes it
    holds of that tensor. None off Linux, for a GPU tensor, and with no bytes. A random-row
    benchmark over a table 100x the cache moves several times with this (docs/design.md)."""
    tensors = [tensors] if hasattr(tensors, "data_ptr") else list(tensors)  # no torch import
    spans = [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tensors
        if t.numel() > 0
    ]
    if (
        not spans
        or any(t.device.type != "cpu" for t in tensors)
        or not os.path.exists("/proc/self/smaps")
    ):
        return None
    covered = 0.0
    mapping = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                mapping = tuple(int(x, 16) for x in head.split("-"))
            elif mapping and head == "AnonHugePages:":
                lo, hi = mapping
                huge = min(1.0, int(line.split()[1]) * 1024 / (hi - lo))
                for first, last in spans:
                    overlap = min(hi, last) - max(lo, first)
                    if overlap > 0:
                        covered += overlap * huge
    return covered / sum(last - first for first, last in spans)


def torch_device(name: str):
    """The torch device ``name`` names (cpu, cuda, cuda:N); a GPU with its index (the current
    one for cuda), made the current device (``torch.cuda.set_device`` refuses a device
    without an index). SystemExit where torch sees no CUDA device."""
    import torch

    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise SystemExit(f"--device {name}, but torch sees no CUDA device")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


# the CUDA runtime calls that make the host wait for the device, and those that launch a kernel
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def runtime_calls(run, steps: int, device) -> dict:
    """Per step of ``run()``, which runs ``steps`` steps on ``device``, under torch.profiler:
    the host syncs (SYNC_CALLS; not the profiler's own closing synchronize), the kernel
    launches (LAUNCH_CALLS) and ``device_ms``, the device's busy time (kernels, copies and
    memsets). Off CUDA each is None; the profiler runs all the same, so that a rehearsal on
    the CPU tries this path."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()  # the device's events of the steps inside the profile
    if not cuda:
        return {"syncs": None, "launches": None, "device_ms": None}
    events = prof.events()
    names = [e.name for e in events]
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "syncs": (sum(names.count(c) for c in SYNC_CALLS) - 1) / steps,
        "launches": sum(names.count(c) for c in LAUNCH_CALLS) / steps,
        "device_ms": sum(e.time_range.elapsed_us() for e in on_device) / 1e3 / steps,
    }


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _version(names: tuple[str, ...]) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "not installed"


def cpu_model() -> str:
    """The CPU's model name, with its family, model and widest vector instructions where
    /proc/cpuinfo gives them: a VM's name ("AMD EPYC") hides the generation, and with it
    whether FBGEMM's kernels run in AVX-512 or AVX2, which moves every ratio to FBGEMM."""
    try:
        info = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block is enough
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    except OSError:
        info = {}
    name = info.get("model name") or platform.processor() or "unknown"
    if "cpu family" not in info:
        return name
    flags = info.get("flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} (family {info['cpu family']}, model {info.get('model', '?')}, {isa})"


def gpu_description() -> dict:
    """The current CUDA device: its name, the driver version (from nvidia-smi) and torch's
    CUDA version."""
    import torch

    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True, timeout=30)
        driver = done.stdout.strip().splitlines()[0] if done.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = "unknown"
    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "cuda": torch.version.cuda}


def environment(
    script: str, argv: list[str] | None = None, threads: int | None = None, gpu: bool = False
) -> dict:
    """Where and with what a result was made, for its JSON (``"environment"``) and the top of its
    Markdown (``environment_markdown``): the command line (``python bench/<script> argv``; argv
    defaults to sys.argv[1:]), the git commit and whether the code differs from it (``dirty``,
    ``dirty_paths``: uncommitted changes under CODE_PATHS, bench/results left out), the CPU model,
    cores, ``threads`` if given, the GPU if ``gpu`` (gpu_description), the torch / fbgemm_gpu /
    torchrec / Python versions and the UTC date. $EMBCACHE_COMMIT, where set, names the commit
    instead of git (a copy sent to a GPU machine carries stale or no git metadata); whether
    the tree differs from it is then "unknown"."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    path = Path(script).resolve()
    try:
        path = path.relative_to(ROOT)
    except ValueError:
        pass
    named = os.environ.get("EMBCACHE_COMMIT")
    status = (
        None
        if named
        else _git("status", "--porcelain", "--", *CODE_PATHS, ":(exclude)bench/results")
    )
    dirty = sorted({line[3:] for line in status.splitlines() if line.strip()}) if status else []
    env = {
        "command": shlex.join(["python", path.as_posix(), *argv]),
        "commit": named or (_git("rev-parse", "--short", "HEAD") or "").strip() or "unknown",
        "dirty": bool(dirty) if status is not None else "unknown",
        "dirty_paths": dirty,
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
    }
    if threads is not None:
        env["threads"] = threads
    if gpu:
        env.update(gpu_description())
    env.update({key: _version(names) for key, names in PACKAGES.items()})
    env["python"] = platform.python_version()
    env["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return env


def environment_markdown(env: dict) -> str:
    """``environment``'s record as a few Markdown lines (for the top of a result)."""
    commit = env["commit"] + (
        f" + uncommitted changes in {', '.join(env['dirty_paths'])}"
        if env.get("dirty") is True
        else ""
    )
    n = env.get("threads")
    threads = "" if n is None else f", {n} thread{'' if n == 1 else 's'}"
    lines = [
        f"Command: `{env['command']}`  ",
        f"Commit {commit}, {env['date']}  ",
        f"Machine: {env['cpu_model']}, {env['cores']} cores{threads}; Python {env['python']}, "
        f"torch {env['torch']}, fbgemm_gpu {env['fbgemm_gpu']}, torchrec {env['torchrec']}",
    ]
    if "gpu" in env:
        lines[-1] += "  "
        lines.append(f"GPU: {env['gpu']}, driver {env['driver']}, CUDA {env['cuda']}")
    return "\n".join(lines)


@dataclass
class Source:
    ids: np.ndarray  # [N, tables] integer ids, possibly memory-mapped, in the source's order
    cardinalities: list[int]
    description: str
    is_split: bool  # a split of a data directory (dlrm train shuffles it), not a trace

    @property
    def names(self) -> list[str]:
        return [f"t_{t}" for t in range(len(self.cardinalities))]


def add_source_args(p: argparse.ArgumentParser) -> None:
    # dlrm (and through it TorchRec) only where a data source is read: the environment record
    # and the writers serve bench/bandwidth.py on a GPU machine that has neither.
    from dlrm.cli import add_data_options
    from dlrm.config import RunConfig

    defaults = RunConfig()
    g = p.add_argument_group(
        "data source", "dlrm train's data options; --data may also be a trace .npy of ids"
    )
    add_data_options(g)
    g.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="seed of the synthetic data and of dlrm train's shuffle (default: %(default)s)",
    )
    g.add_argument(
        "--data-root",
        type=Path,
        default=Path("runs"),
        help="the synthetic data goes to DATA_ROOT/data/ (dlrm train's place; default: %(default)s)",
    )
    g.add_argument(
        "--split",
        choices=["train", "val", "test"],
        default="train",
        help="split of a data directory (default: %(default)s)",
    )
    g.add_argument(
        "--min-rows",
        type=int,
        default=defaults.min_rows_for_low_precision,
        help="tables with fewer rows have no cache in training and are left out "
        "(default: %(default)s)",
    )


def load_source(args: argparse.Namespace) -> Source:
    """The ids of ``args.data`` (see the module docstring)."""
    if args.data.endswith(".npy"):
        ids = np.load(args.data, mmap_mode="r")
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise SystemExit(
                f"{args.data}: expected integer ids [N, tables], got {ids.dtype} {ids.shape}"
            )
        if len(ids) and ids.min() < 0:
            raise SystemExit(f"{args.data}: negative ids")
        cards = [int(m) + 1 for m in ids.max(axis=0)] if len(ids) else [1] * ids.shape[1]
        return Source(ids, cards, f"trace {args.data} ({len(ids):,} rows)", False)
    from dlrm.build import resolve_data
    from dlrm.config import RunConfig
    from dlrm.data import batches

    cfg = RunConfig(
        data=args.data,
        synthetic_rows=args.synthetic_rows,
        synthetic_scale=args.synthetic_scale,
        seed=args.seed,
    )
    path = resolve_data(cfg, args.data_root)
    ds = batches.load(path)
    start, stop = ds.split(args.split)
    what = (
        f"synthetic scale {args.synthetic_scale}, {args.synthetic_rows:,} rows, seed {args.seed}"
        if args.data == "synthetic"
        else str(args.data)
    )
    return Source(
        ds.sparse[start:stop],
        list(ds.meta["cardinalities"]),
        f"{what}: {args.split} split ({stop - start:,} rows)",
        True,
    )


def cached_tables(source: Source, min_rows: int) -> tuple[list[int], list[int]]:
    """(tables with at least ``min_rows`` rows, the others)."""
    big = [t for t, n in enumerate(source.cardinalities) if n >= min_rows]
    return big, [t for t in range(len(source.cardinalities)) if t not in big]


def small_tables_note(source: Source, small: list[int], min_rows: int) -> str:
    if not small:
        return ""
    listed = ", ".join(f"{source.names[t]} ({source.cardinalities[t]:,})" for t in small)
    return (
        f"Left out: {len(small)} tables with fewer than {min_rows:,} rows, which stay FP32 "
        f"without a cache in training: {listed}."
    )


def markdown_table(df: pd.DataFrame) -> str:
    """``df`` as a markdown table, its index (named) as the first column(s)."""
    df = df.reset_index()
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose help is the script's docstring (first paragraph, then the rest)."""
    return argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def write_atomic(path, write) -> None:
    """write(tmp) fills a temporary file beside ``path``, which then replaces ``path``: an
    interrupted run leaves the old file or none, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path, text: str) -> None:
    """``Path.write_text``, atomically (see write_atomic)."""
    write_atomic(path, lambda tmp: tmp.write_text(text))


def save_figure(fig, path) -> None:
    """Lay out, write (PNG, 120 dpi, atomically) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def filled_table(rows: int, dim: int, device, *, seed: int = 0, block_rows: int = 0, **options):
    """(table, seconds by phase): a ``CachedLowPrecisionEmbedding`` of ``rows`` x ``dim`` on
    ``device`` (``options``: its keyword options, ``placement`` among them), built without
    drawing its rows on the CPU, whose generator draws them one 2^16-row block at a time on
    one core (at 170M x 128 that is minutes).

    Built through the public API: on the meta device (no memory), given its memory by
    ``copy_rows_from`` of no rows (storage pinned for ``placement="host"``, zeroed; counts,
    optimizer state and cache empty), moved to ``device``, then its ``weights`` written in
    blocks of ``block_rows`` rows (default 2^22 on a GPU, 2^16 on the CPU): rows uniform in
    ``±sqrt(1 / rows)`` (the table's own initial distribution, not its own draws), drawn on
    ``device`` by a generator seeded ``seed`` and rounded to nearest there
    (``torch.ops.embcache.quantize_rows``), then copied into the storage wherever it lies.
    The same (rows, dim, format, seed, device type) give the same rows whatever the cache and
    the placement. Phases: ``allocate`` (build and memory), ``move``, ``fill``."""
    import math
    import time

    import torch

    import embcache

    device = torch.device(device)
    cuda = device.type == "cuda"

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    seconds = {}
    start = now()
    table = embcache.CachedLowPrecisionEmbedding(rows, dim, device="meta", **options)
    source = embcache.CachedLowPrecisionEmbedding(rows, dim, device="meta", **options)
    table.copy_rows_from(source, 0, rows=0)  # memory for every tensor, the rows zero
    seconds["allocate"] = now() - start
    start = now()
    if device.type != "cpu":
        table.to(device)
    seconds["move"] = now() - start
    start = now()
    block = block_rows or (1 << 22 if cuda else 1 << 16)
    gen = torch.Generator(device=device).manual_seed(seed)
    bound = math.sqrt(1.0 / rows)
    with torch.no_grad():
        for a in range(0, rows, block):
            b = min(rows, a + block)
            values = torch.empty(b - a, dim, device=device).uniform_(-bound, bound, generator=gen)
            ids = torch.arange(a, b, device=device)
            table.weights[a:b].copy_(torch.ops.embcache.quantize_rows(values, ids, table.spec))
    seconds["fill"] = now() - start
    return table, seconds
