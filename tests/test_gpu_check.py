"""The one-call GPU check (bench/gpu_check.py, `make gpu-check`) as far as a machine without a
GPU can try it: it says there is no GPU and exits 0, and its driver -- with `import embcache`
and a table -- runs where neither TorchRec nor FBGEMM is installed, as on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Makes torchrec and fbgemm_gpu unimportable, then runs the GPU check's driver on the CPU.
_HIDDEN = """
import importlib.abc, runpy, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, Hide())
sys.argv = ["gpu_check.py", "--driver", "cpu"]
try:
    runpy.run_path("bench/gpu_check.py", run_name="__main__")
except SystemExit as e:
    assert e.code == 0, e.code
import embcache
assert not [m for m in sys.modules if m.startswith(("torchrec", "fbgemm_gpu"))]
try:
    embcache.CachedLowPrecisionEmbeddingBagCollection
except ModuleNotFoundError as e:
    print("collection:", e)
"""


def test_a_table_trains_without_torchrec_or_fbgemm():
    done = subprocess.run(
        [sys.executable, "-c", _HIDDEN], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "driver: every op ran on cpu" in done.stdout
    assert "collection: No module named 'torchrec" in done.stdout  # needs it, and says so


@pytest.mark.skipif(torch.cuda.is_available(), reason="here `make gpu-check` runs it whole")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA device here" in done.stdout
    assert json.loads((tmp_path / "gpu_check.json").read_text())["cuda"] is False


def test_the_step_profile_runs_every_phase_of_both_steps(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    result = gpu_check.profile("cpu", tables=3, rows=3000, dim=8, batch=64, pooling=2, steps=2)
    # the warm-up (the first 3 batches: here both), the timed pass and the profiled pass
    assert result["embcache"]["updates_applied"] == 2 + 2 + 2
    for peer in ("embcache", "nn.EmbeddingBag"):
        assert set(result[peer]["ms"]) == set(result[peer]["kernel_ms"])
        assert set(result[peer]["ms"]) == {"forward", "backward", "update"}
        assert all(ms > 0 for ms in result[peer]["ms"].values())
        calls = result[peer]["runtime_calls_per_step"]["update"]
        assert set(calls) == set(gpu_check.RUNTIME_CALLS)
        assert set(result[peer]["kernels"]) == {"forward", "backward", "update"}


def test_help_prints_usage_and_writes_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu_check.py"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "usage:" in done.stdout
    assert not list(tmp_path.iterdir())  # not a folder named --help


def test_kernel_names_are_shortened_to_the_function():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    name = "void embcache::gpu::commit_sets_kernel(embcache::gpu::UpdateTable const*, long)"
    assert gpu_check._kernel_name(name) == "commit_sets_kernel"
    templated = "void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long>(x)"
    assert gpu_check._kernel_name(templated) == "indexSelectLargeIndex"
    assert gpu_check._kernel_name("Memcpy HtoD (Pageable -> Device)") == "Memcpy HtoD"


def test_the_rehearsal_runs_the_gpu_checks_training_steps_on_the_cpu(tmp_path):
    """`gpu_check.py OUT --rehearse`: the GPU check's kernel benchmark, its dlrm runs (train,
    evaluate, a CPU-begun run resumed) and its training benchmark, on the CPU and smaller, all
    pass and leave their reports, so a GPU's time is not spent finding a command line's
    mistake."""
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", str(tmp_path), "--rehearse"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr + (tmp_path / "gpu_check.json").read_text()
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["rehearsal"]
    assert list(steps) == [
        "kernels",
        "train",
        "evaluate",
        "begin_on_cpu",
        "resume_on_cpu",
        "train_gpu",
    ]
    assert all(s["status"] == "passed" for s in steps.values())
    resumed = json.loads((tmp_path / "resume_report.json").read_text())
    assert [d["step"] for d in resumed["devices"]] == [0, 4] and resumed["steps"] == 8
    kernels = json.loads((tmp_path / "kernels" / "kernel_bench.json").read_text())
    assert len(kernels["runs"]) == 5 and kernels["targets"]
    bench = json.loads((tmp_path / "train_gpu" / "train_gpu.json").read_text())["results"]
    assert {"ours", "plain PyTorch"} <= set(bench["256"])
