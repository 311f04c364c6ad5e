"""The one-call GPU check (`make gpu-check OUT=dir`), for the first GPU machine the project gets.

On a CUDA machine whose Python has torch (FBGEMM and TorchRec are not needed), in this order,
each step logged into OUT and bounded in time, and the whole bounded by ``DEADLINE`` (a step
with no time left is skipped, so that the most important come first):

1. ``environment``: the GPU (nvidia-smi), the driver, torch and CUDA versions;
2. ``build``: the extension for the GPU present, in place (``setup.py build_ext --inplace``,
   the CUDA kernels and the warp emulator). Where setup.py refuses $CXX because it links
   libstdc++ statically (the workplace's CUDA image sets CXX to such a wrapper), the build is
   retried once with the distribution's /usr/bin/g++;
3. ``tests``: the CUDA tests (``tests/test_cuda_kernels.py``, ``tests/test_cuda_modules.py``:
   the kernels against the CPU ops bit for bit; ``tests/test_device.py``: a GPU run's
   checkpoint loaded, evaluated and resumed on the CPU; ``tests/test_cuda_placement.py``:
   host-placed tables against tables on the device, bit for bit);
4. ``kernels``: ``bench/kernel_bench.py`` (issue 50's benchmark: our tables against the
   copy and gather ceilings and ``nn.EmbeddingBag`` on FBGEMM's shape and 26 tables, and
   the issue's targets) into ``OUT/kernels/`` (written after each run, so a step cut at its
   limit keeps the runs it finished);
5. ``train``, ``evaluate``: a short ``dlrm train --device cuda`` (``TRAIN``: scale 0.01) and
   ``dlrm evaluate --device cuda`` of it; ``begin_on_cpu``, ``resume_on_cuda``: a run begun
   on the CPU and resumed on the GPU. Their ``report.json``s are copied into OUT
   (``train_report.json``, ``resume_report.json``). ``--rehearse`` runs steps 4 to 6 on the
   CPU, smaller, where there is no GPU (``tests/test_gpu_check.py`` does);
6. ``train_gpu``: ``bench/train_gpu.py`` (ours against a plain PyTorch loop at Kaggle size)
   into ``OUT/train_gpu/``;
7. ``memcheck``, ``racecheck``, ``synccheck``: compute-sanitizer over a small driver (this
   script with ``--driver [DEVICE]``: tables of every format behind a cache, trained a few
   steps, flushed; the tests run it on the CPU with TorchRec and FBGEMM hidden);
8. ``profile``: training steps of 26 tables and of one large table (``PROFILES``), each
   phase's time, device time and CUDA runtime calls (syncs, copies, launches) against
   ``nn.EmbeddingBag`` (this script with ``--profile PATH [DEVICE]``), into
   ``OUT/profile.json``;
9. ``bandwidth``: ``bench/bandwidth.py --device cuda`` into ``OUT/bandwidth/`` (results are
   written after each dim, so a step cut at its limit keeps the dims it finished).

``OUT/gpu_check.json`` says each step's status (``passed``, ``failed``, ``skipped``, with the
reason), its seconds and its log. Without a CUDA device it says so and exits 0; otherwise the
exit status is 1 if a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
# seconds each step may take (on an H200 build, tests, the sanitizers and bandwidth took 45,
# 41, 5 to 26 and 142; kernels is sized for about 75 on an H100, not yet measured), and the
# whole check: under the 9 minutes a GPU call may take
LIMITS = {
    "environment": 20,
    "build": 120,
    "tests": 120,
    "kernels": 120,
    "train": 90,
    "evaluate": 45,
    "begin_on_cpu": 60,
    "resume": 60,
    "train_gpu": 150,
    "profile": 90,
    "bandwidth": 180,
}
SANITIZER_LIMIT = 40
DEADLINE = 510
# the short runs of step 4: a run's options, and per device the steps of the run on it, of
# the CPU-begun run, and of its part on the CPU; the rehearsal (--rehearse) is on the CPU
TRAIN = ["--synthetic-scale", "0.01", "--synthetic-rows", "400000", "--batch-size", "2048"]
TRAIN += ["--eval-every", "100", "--eval-batches", "5", "--no-progress"]
RUN_STEPS = {"cuda": (300, 120, 60), "cpu": (12, 8, 4)}
# bench/train_gpu.py's and bench/kernel_bench.py's options: full size on a GPU; tiny in the
# rehearsal
TRAIN_GPU = {
    "cuda": [],
    "cpu": ["--scale", "0.001", "--batch-sizes", "256", "--rounds", "2", "--steps", "2"],
}
KERNELS = {"cuda": [], "cpu": ["--quick", "--rounds", "2", "--steps", "2"]}
# setup.py's refusal of a compiler whose shared libraries carry their own libstdc++
STATIC_LIBSTDCXX = "links libstdc++ statically"
SYSTEM_COMPILERS = {"CXX": "/usr/bin/g++", "CC": "/usr/bin/gcc"}


def driver(device: str) -> None:
    """Every table-batched op on ``device``: one table of each format behind an LFU and an
    LRU cache, a few training steps, a flush and a dequantizing read."""
    import torch

    from embcache import CachedLowPrecisionEmbedding
    from embcache.config import POLICIES, PRECISION_BITS

    gen = torch.Generator().manual_seed(0)
    for precision in PRECISION_BITS:
        for policy in POLICIES:
            table = CachedLowPrecisionEmbedding(
                4096,
                16,
                mode="sum",
                precision=precision,
                policy=policy,
                cache_ratio=0.05,
                associativity=32,
                optimizer="rowwise_adagrad",
                min_rows_for_low_precision=0,
            ).to(device)
            for _ in range(3):
                ids = (torch.rand(64, 4, generator=gen) ** 3 * 4096).long().to(device)
                table(ids).pow(2).sum().backward()
                table.step()
            table.flush()
            assert torch.isfinite(table.current_weight()).all()
    print(f"driver: every op ran on {device}")


# The profiled steps: Criteo's 26 features, one id per sample each; and one large table read
# by bags of 8 (bench/bandwidth.py's dim-128 table and batch), uniform ids (few hits).
PROFILES = {
    "26 tables": {"tables": 26, "rows": 100_000, "dim": 64, "batch": 2048, "pooling": 1},
    "1 table, bags of 8": {
        "tables": 1,
        "rows": 4_626_071,
        "dim": 128,
        "batch": 16384,
        "pooling": 8,
    },
}
PROFILE_STEPS = 10
# the CUDA runtime calls counted per phase of the step
RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaMemsetAsync", "cudaLaunchKernel")


def profile(
    device: str, tables: int, rows: int, dim: int, batch: int, pooling: int, steps: int
) -> dict:
    """Training steps of ``tables`` INT8 tables (5% 32-way LFU cache, row-wise AdaGrad) driven
    as one table group, as the collection drives them, ``pooling`` ids a bag: each phase's
    median time (ms, the device synchronized around it) and, under torch.profiler, per step its
    device time (``kernel_ms``: kernels and copies on the GPU; ``kernels``: the largest, each
    as [ms, launches]) and its CUDA runtime calls
    (``RUNTIME_CALLS``: the syncs and launches it costs the host). Beside it, the same step with
    ``nn.EmbeddingBag`` (FP32, sparse gradients, SGD)."""
    import torch
    from torch.profiler import ProfilerActivity, record_function

    from embcache import CachedLowPrecisionEmbedding
    from embcache.group import TableGroup

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()

    gen = torch.Generator().manual_seed(0)
    lookups = tables * batch * pooling
    skew = 3 if pooling == 1 else 1  # Criteo-like skew, or uniform ids
    batches = [
        (torch.rand(lookups, generator=gen) ** skew * rows).long().to(device) for _ in range(steps)
    ]
    lengths = torch.full((tables * batch,), pooling, dtype=torch.int64, device=device)
    grad = torch.randn(batch, tables * dim, generator=gen).to(device) * 1e-3
    ours = [
        CachedLowPrecisionEmbedding(
            rows, dim, mode="sum", precision="int8", cache_ratio=0.05, associativity=32, seed=t
        ).to(device)
        for t in range(tables)
    ]
    group = TableGroup(ours)
    features = list(range(tables))

    def our_phases(ids):
        kept = {}

        def forward():
            kept["pooled"] = group.lookup(ids, lengths, None, features, batch, True)

        return forward, lambda: kept.pop("pooled").backward(grad), group.update

    bags = [torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True).to(device) for _ in ours]
    sgd = torch.optim.SGD([p for b in bags for p in b.parameters()], lr=0.01)
    offsets = torch.arange(0, batch * pooling, pooling, device=device)

    def their_phases(ids):
        kept = {}

        def forward():
            per_table = ids.view(tables, batch * pooling)
            kept["pooled"] = torch.cat([b(x, offsets) for b, x in zip(bags, per_table)], 1)

        def update():
            sgd.step()
            sgd.zero_grad()

        return forward, lambda: kept.pop("pooled").backward(grad), update

    setup = {"tables": tables, "rows": rows, "dim": dim, "batch": batch, "pooling": pooling}
    setup.update(steps=steps, device=device, precision="int8", cache="5% 32-way LFU")
    result = {"setup": {**setup, "optimizer": "rowwise_adagrad"}}
    phases = ("forward", "backward", "update")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    for name, make in (("embcache", our_phases), ("nn.EmbeddingBag", their_phases)):
        for ids in batches[:3]:  # warm-up: the allocator's pools, the caches
            for run in make(ids):
                run()
        times = {p: [] for p in phases}
        for ids in batches:
            for phase, run in zip(phases, make(ids)):
                sync()
                start = time.perf_counter()
                run()
                sync()
                times[phase].append((time.perf_counter() - start) * 1e3)
        with torch.profiler.profile(activities=activities) as prof:
            for ids in batches:
                for phase, run in zip(phases, make(ids)):
                    with record_function(phase):
                        run()
                        sync()  # the phase's device work inside its range
        events = prof.events()
        result[name] = {
            "ms": {p: round(sorted(t)[len(t) // 2], 3) for p, t in times.items()},
            "kernel_ms": _device_ms_per_phase(events, phases, steps),
            "kernels": _kernels_per_phase(events, phases, steps),
            "runtime_calls_per_step": _calls_per_phase(events, phases, steps),
        }
    result["embcache"]["updates_applied"] = ours[0].stats()["steps"]
    return result


def _in_phase(events, phase):
    """Whether an event starts inside one of ``phase``'s record_function ranges."""
    spans = [e.time_range for e in events if e.name == phase]
    return lambda e: any(r.start <= e.time_range.start <= r.end for r in spans)


def _device_events(events, phases) -> list:
    """The kernels and copies on the GPU. The phases' own ranges also appear on the device (the
    profiler's GPU annotations, spanning the phase's kernels): left out, else their kernels
    count twice."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in events if e.device_type == cuda and e.name not in phases]


def _device_ms_per_phase(events, phases, steps) -> dict:
    """The device time inside each phase, ms per step."""
    device = _device_events(events, phases)
    out = {}
    for p in phases:
        inside = _in_phase(events, p)
        us = sum(e.time_range.elapsed_us() for e in device if inside(e))
        out[p] = round(us / 1e3 / steps, 3)
    return out


def _kernel_name(name: str) -> str:
    """A kernel's function name without namespaces, template and parameter lists."""
    short = name.replace("(anonymous namespace)", "").split("(")[0].split("<")[0]
    return short.rsplit("::", 1)[-1].removeprefix("void ").strip() or name


def _kernels_per_phase(events, phases, steps, top: int = 8) -> dict:
    """Each phase's ``top`` kernels (and copies) by device time: ms per step and launches."""
    device = _device_events(events, phases)
    out = {}
    for p in phases:
        inside = _in_phase(events, p)
        totals: dict = {}
        for e in device:
            if inside(e):
                name = _kernel_name(e.name)
                us, n = totals.get(name, (0.0, 0))
                totals[name] = (us + e.time_range.elapsed_us(), n + 1)
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
        out[p] = {k: [round(us / 1e3 / steps, 4), n // steps] for k, (us, n) in ranked}
    return out


def _calls_per_phase(events, phases, steps) -> dict:
    """The RUNTIME_CALLS that start inside each phase, per step."""
    calls = [e for e in events if e.name in RUNTIME_CALLS]
    out = {}
    for p in phases:
        inside = _in_phase(events, p)
        counts = {c: sum(1 for e in calls if e.name == c and inside(e)) for c in RUNTIME_CALLS}
        out[p] = {c: round(n / steps, 1) for c, n in counts.items()}
    return out


def profiles(path: Path, device: str) -> None:
    """Every step of PROFILES, written to ``path`` (after each, so a cut run keeps those done)."""
    done = {}
    for name, setup in PROFILES.items():
        done[name] = profile(device, steps=PROFILE_STEPS, **setup)
        path.write_text(json.dumps(done, indent=1))
        print(name, json.dumps(done[name], indent=1))


class _Steps:
    """Runs the check's steps, each a command logged to ``out/<name>.log`` within its limit and
    what is left of ``DEADLINE``; ``results`` holds each one's status, seconds and log."""

    def __init__(self, out: Path, env: dict) -> None:
        self.out, self.env, self.results = out, env, {}
        self.end = time.monotonic() + DEADLINE

    def run(self, name: str, cmd: list[str], limit: float) -> bool:
        """Run step ``name``; whether it passed."""
        left = self.end - time.monotonic()
        if left < 5:
            self.results[name] = {"status": f"skipped (the check's {DEADLINE} s are spent)"}
            return False
        log = self.out / f"{name}.log"
        limit = min(limit, left)
        start = time.perf_counter()
        try:
            with open(log, "w") as f:
                done = subprocess.run(
                    cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit, env=self.env
                )
            status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            status = f"failed (over its {limit:.0f} s)"
        except OSError as e:  # the tool is missing
            status = f"skipped ({e.strerror}: {cmd[0]})"
        seconds = round(time.perf_counter() - start, 1)
        self.results[name] = {"status": status, "seconds": seconds, "log": log.name}
        return status == "passed"


def _kernels(steps: _Steps, python: str, device: str) -> None:
    """Step 4 (module docstring): ``bench/kernel_bench.py`` on ``device``."""
    kernels = [python, "bench/kernel_bench.py", "--device", device, *KERNELS[device]]
    steps.run("kernels", [*kernels, "--out", str(steps.out / "kernels")], LIMITS["kernels"])


def _training(steps: _Steps, python: str, runs: Path, device: str) -> None:
    """Steps 5 and 6 (module docstring): short runs of ``dlrm`` on ``device`` (a CPU-begun one
    resumed there), in ``runs``, then ``bench/train_gpu.py``."""
    dlrm = [python, "-m", "dlrm.cli"]
    total, resumed, on_cpu = (str(n) for n in RUN_STEPS[device])
    run = runs / device
    train = [*dlrm, "train", "--device", device, "--out", str(run), "--steps", total, *TRAIN]
    if steps.run("train", train, LIMITS["train"]):
        shutil.copy(run / "report.json", steps.out / "train_report.json")
        evaluate = [*dlrm, "evaluate", "--device", device, "--out", str(run), "--no-progress"]
        steps.run("evaluate", evaluate, LIMITS["evaluate"])
    run = runs / f"cpu-then-{device}"
    begin = [*dlrm, "train", "--device", "cpu", "--out", str(run), "--steps", resumed]
    begin += ["--stop-after", on_cpu, *TRAIN]
    if steps.run("begin_on_cpu", begin, LIMITS["begin_on_cpu"]):
        resume = [*dlrm, "train", "--device", device, "--out", str(run), "--resume"]
        resume += ["--steps", resumed, *TRAIN]
        if steps.run(f"resume_on_{device}", resume, LIMITS["resume"]):
            shutil.copy(run / "report.json", steps.out / "resume_report.json")
    train_gpu = [python, "bench/train_gpu.py", "--device", device, *TRAIN_GPU[device]]
    steps.run("train_gpu", [*train_gpu, "--out", str(steps.out / "train_gpu")], LIMITS["train_gpu"])


def rehearse(out: Path) -> int:
    """Steps 4 to 6 on the CPU, smaller (``--rehearse``): what a GPU check will run, tried
    where there is no GPU, so that a GPU's time is not spent on a command line's mistake.
    Writes ``out/gpu_check.json``; exit status 1 if a step failed."""
    steps = _Steps(out, {**os.environ, "PYTHONPATH": str(ROOT)})
    _kernels(steps, sys.executable, "cpu")
    with tempfile.TemporaryDirectory(prefix="gpu-check-runs-") as runs:
        _training(steps, sys.executable, Path(runs), "cpu")
    (out / "gpu_check.json").write_text(json.dumps({"rehearsal": steps.results}, indent=2))
    return 1 if any(not s["status"].startswith("passed") for s in steps.results.values()) else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="The one-call GPU check (module docstring).")
    parser.add_argument("out", nargs="?", type=Path, help="the folder for logs and reports")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--driver",
        nargs="?",
        const="cuda",
        metavar="DEVICE",
        help="only run every op on DEVICE (default cuda): the sanitizers' driver",
    )
    mode.add_argument(
        "--profile",
        type=Path,
        metavar="PATH",
        help="only profile the training steps into PATH (JSON)",
    )
    mode.add_argument(
        "--rehearse",
        action="store_true",
        help="run the benchmark and training steps (4 to 6) on the CPU, smaller, into OUT: "
        "no GPU needed",
    )
    parser.add_argument("--device", default="cuda", help="the device --profile runs on")
    args = parser.parse_args(argv)
    if args.driver:
        driver(args.driver)
        return 0
    if args.profile:
        profiles(args.profile, args.device)
        return 0
    if args.out is None:
        parser.error("the output folder OUT is required")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.rehearse:
        return rehearse(out)
    import torch

    report: dict = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if not report["cuda"]:
        print("gpu-check: no CUDA device here; nothing to check (run it on a GPU machine)")
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        return 0
    from _common import environment  # bench/, beside this script

    report["environment"] = environment(__file__, [str(out)], gpu=True)
    python = sys.executable
    here = {**os.environ, "PYTHONPATH": str(ROOT), "MAX_JOBS": str(os.cpu_count() or 4)}
    steps = _Steps(out, here)
    report["steps"] = steps.results
    steps.run("environment", ["nvidia-smi"], LIMITS["environment"])
    build = [python, "setup.py", "build_ext", "--inplace"]
    steps.run("build", build, LIMITS["build"])
    log = (out / "build.log").read_text()
    if steps.results["build"]["status"] != "passed" and STATIC_LIBSTDCXX in log:
        report["cxx_refused"] = os.environ.get("CXX")
        here.update(SYSTEM_COMPILERS)
        steps.run("build", build, LIMITS["build"])
    # the C++ compiler the build used (torch.utils.cpp_extension: $CXX, else c++)
    report["cxx"] = shutil.which(here.get("CXX", "c++"))
    if steps.results["build"]["status"] == "passed":
        tests = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
        tests += [
            "tests/test_cuda_kernels.py",
            "tests/test_cuda_modules.py",
            "tests/test_device.py",
            "tests/test_cuda_placement.py",
        ]
        steps.run("tests", tests, LIMITS["tests"])
        _kernels(steps, python, "cuda")
        with tempfile.TemporaryDirectory(prefix="gpu-check-runs-") as runs:
            _training(steps, python, Path(runs), "cuda")
        sanitizer = shutil.which("compute-sanitizer")
        for tool in SANITIZER_TOOLS:
            cmd = [sanitizer or "compute-sanitizer", "--tool", tool, "--error-exitcode", "1"]
            cmd += [python, "bench/gpu_check.py", "--driver"]
            steps.run(tool, cmd, SANITIZER_LIMIT)
        step_profile = [python, "bench/gpu_check.py", "--profile", str(out / "profile.json")]
        steps.run("profile", step_profile, LIMITS["profile"])
        bandwidth = [python, "bench/bandwidth.py", "--device", "cuda", "--steps", "3"]
        bandwidth += ["--out", str(out / "bandwidth")]
        steps.run("bandwidth", bandwidth, LIMITS["bandwidth"])
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    for name, step in steps.results.items():
        print(f"{name}: {step['status']}")
    return 1 if any(s["status"].startswith("failed") for s in steps.results.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
