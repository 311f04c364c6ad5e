"""``dlrm`` where only torch is installed (a GPU machine without TorchRec and FBGEMM, whose
wheels are pinned to one torch and one CUDA): an import hook hides both, and the command's
single-process work runs -- help, training, evaluation, a resume -- without importing them,
while what needs TorchRec says so."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs `dlrm ARGS...` with torchrec and fbgemm_gpu hidden, then fails (exit 3) if anything
# imported either after all.
_HIDDEN = textwrap.dedent(
    """
    import sys

    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")

    sys.meta_path.insert(0, Hide())
    from dlrm.cli import main

    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("torchrec", "fbgemm_gpu"))
    if leaked:
        print("imported:", leaked, file=sys.stderr)
        code = 3
    sys.exit(code)
    """
)

# the data, also what planning reads; then a short run's options
DATA = ["--synthetic-scale", "0.001", "--synthetic-rows", "20000", "--batch-size", "256"]
SMALL = [*DATA, "--eval-every", "0", "--no-progress", "--threads", "1"]


def _dlrm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _HIDDEN, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=600,
    )


def test_the_hook_hides_torchrec():
    """The hook works: a command that needs TorchRec fails when it is hidden."""
    out = _dlrm("train", "--embeddings", "torchrec", "--out", "/nonexistent/x", *SMALL)
    assert out.returncode != 0 and "hidden by the test" in out.stderr


@pytest.mark.xdist_group("torch_only")
def test_help_train_evaluate_and_resume_need_only_torch(tmp_path):
    out = _dlrm("--help")
    assert out.returncode == 0 and "train" in out.stdout, out.stderr
    for command in ("train", "evaluate", "plan", "report", "generate", "preprocess"):
        out = _dlrm(command, "--help")
        assert out.returncode == 0, (command, out.stderr)

    run = tmp_path / "run"
    out = _dlrm("train", "--out", str(run), "--steps", "6", "--stop-after", "3", *SMALL)
    assert out.returncode == 0, out.stderr
    out = _dlrm("train", "--out", str(run), "--steps", "6", "--resume", *SMALL)
    assert out.returncode == 0, out.stderr
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "completed" and report["steps"] == 6
    assert [d["step"] for d in report["devices"]] == [0, 3]  # the run and its resumption

    out = _dlrm("report", str(run))
    assert out.returncode == 0 and (run / "report.png").exists(), out.stderr
    out = _dlrm("evaluate", "--out", str(run), "--split", "val", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert 0.0 <= json.loads(out.stdout)["log_loss"]

    out = _dlrm("plan", "--memory-budget", "1MiB", "--plan-rows", "2000", *DATA)
    assert out.returncode == 0, out.stderr
