"""The `dlrm` command end to end: a short run, an interrupted-and-resumed run that ends exactly
like an uninterrupted one, and user errors that print one line and exit 2."""

import json
import math

import pytest
import torch

from dlrm.checkpoint import open_checkpoint
from dlrm.cli import main
from dlrm.distributed import ONE_PROCESS
from dlrm.run_dir import latest_checkpoint

SMALL = [
    "--synthetic-scale",
    "0.001",
    "--synthetic-rows",
    "30000",
    "--batch-size",
    "256",
    "--eval-every",
    "5",
    "--eval-batches",
    "2",
    "--no-progress",
    "--threads",
    "1",
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def _train(out, *extra):
    return main(["train", "--out", str(out), *SMALL, *extra])


def test_train_writes_report(workdir, capsys):
    assert _train(workdir / "a", "--steps", "12") == 0
    report = json.loads((workdir / "a" / "report.json").read_text())
    assert report["steps"] == 12
    assert set(report["test"]) >= {"auc", "accuracy", "log_loss", "normalized_entropy"}
    assert [e["step"] for e in report["evals"]] == [5, 10]
    emb = report["embeddings"]
    assert 0 < emb["compression_factor"] < 1 and 0 < emb["hit_rate"] < 1  # skewed ids: hits
    assert report["data"]["bayes_auc"] > 0.7
    assert report["test"]["auc"] > 0.55  # it learned something (an untrained model: ~0.5)
    # The default backoff scaler starts at 2^16, halves on every overflowing (skipped) step
    # and grows only after 2000 clean ones: in 12 steps the trace can only fall, once per
    # skipped step, and every scale is a power of two in [1, 2^24].
    scale, trace = report["loss_scale"], report["loss_scale"]["trace"]
    assert trace[0] == [0, 2.0**16] and len(trace) < 50  # the whole trace
    assert scale["changes"] == len(trace) - 1 and scale["final"] == trace[-1][1]
    assert [s for _, s in trace] == [2.0**16 / 2**k for k in range(len(trace))]
    assert report["skipped_steps"] == scale["changes"]
    assert 1 <= scale["final"] <= 2**24 and math.frexp(scale["final"])[0] == 0.5
    assert (scale["min"], scale["max"]) == (scale["final"], 2.0**16)
    assert "test: auc" in capsys.readouterr().out


def test_overflowing_steps_are_skipped_and_counted(workdir):
    """A static scale so large that every scaled gradient overflows: every step is skipped
    and counted, and the scale never changes."""
    args = ["--steps", "3", "--eval-every", "0", "--loss-scaler", "static"]
    assert _train(workdir / "overflow", *args, "--static-scale", "1e38") == 0
    report = json.loads((workdir / "overflow" / "report.json").read_text())
    assert report["steps"] == 3 and report["skipped_steps"] == 3
    assert report["loss_scale"]["final"] == 1e38 and report["loss_scale"]["changes"] == 0


def test_interrupted_run_resumes_to_the_same_result(workdir):
    assert _train(workdir / "full", "--steps", "14", "--checkpoint-every", "4") == 0
    assert (
        _train(workdir / "cut", "--steps", "14", "--checkpoint-every", "4", "--stop-after", "6")
        == 0
    )
    assert not (workdir / "cut" / "report.json").exists()
    assert _train(workdir / "cut", "--steps", "14", "--checkpoint-every", "4", "--resume") == 0
    full = json.loads((workdir / "full" / "report.json").read_text())
    cut = json.loads((workdir / "cut" / "report.json").read_text())
    assert full["test"] == cut["test"]
    assert full["evals"] == cut["evals"]
    a = _saved_model(workdir / "full")
    b = _saved_model(workdir / "cut")
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k


def _saved_model(out):
    """The model state of the run in ``out``'s latest checkpoint."""
    path = latest_checkpoint(out)
    return open_checkpoint(path, ONE_PROCESS)["trainer"]["model"]


def test_evaluate_checkpoint(workdir, capsys):
    assert _train(workdir / "e", "--steps", "3") == 0
    capsys.readouterr()
    assert main(["evaluate", "--out", str(workdir / "e"), "--no-progress"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    report = json.loads((workdir / "e" / "report.json").read_text())
    metrics = ("auc", "accuracy", "log_loss", "normalized_entropy")
    # the checkpoint holds the model the run ended with: the same test metrics, exactly
    assert {k: evaluated[k] for k in metrics} == {k: report["test"][k] for k in metrics}


def _fails(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.count("\n") == 1, err


def test_user_errors_are_one_line(workdir, tmp_path, capsys):
    _fails(
        capsys,
        ["train", "--out", str(tmp_path / "x"), "--data", str(tmp_path / "nope"), *SMALL],
        "meta.json",
    )
    _fails(capsys, ["train", "--out", str(tmp_path / "y"), "--resume", *SMALL], "no checkpoint")
    assert _train(workdir / "cfg", "--steps", "2") == 0
    _fails(
        capsys,
        ["train", "--out", str(workdir / "cfg"), "--resume", "--precision", "int4", *SMALL],
        "precision",
    )
    (tmp_path / "bad" / "checkpoint").mkdir(parents=True)
    (tmp_path / "bad" / "checkpoint" / "state.pt").write_bytes(b"not a checkpoint")
    _fails(
        capsys,
        ["train", "--out", str(tmp_path / "bad"), "--resume", *SMALL],
        "not a complete checkpoint",
    )
    blocker = tmp_path / "file"
    blocker.write_text("")
    _fails(capsys, ["train", "--out", str(blocker / "sub"), *SMALL], "cannot create")
    _fails(
        capsys,
        ["train", "--out", str(tmp_path / "z"), "--cache-ratio", "1.5", *SMALL],
        "cache_ratio",
    )
    _fails(
        capsys, ["preprocess", str(tmp_path / "missing.tsv"), str(tmp_path / "out")], "missing.tsv"
    )


def test_killed_process_resumes_to_the_same_result(workdir):
    """A real SIGKILL mid-run: --resume from the last (atomic) checkpoint ends exactly like an
    uninterrupted run, whenever the kill lands."""
    import os
    import signal
    import subprocess
    import sys
    import time

    args = ["--steps", "40", "--checkpoint-every", "3", "--eval-every", "0"]
    assert _train(workdir / "whole", *args) == 0
    out = workdir / "killed"
    cmd = [sys.executable, "-m", "dlrm.cli", "train", "--out", str(out), *SMALL, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while latest_checkpoint(out) is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest_checkpoint(out) is not None
    assert _train(out, *args, "--resume") == 0
    whole = json.loads((workdir / "whole" / "report.json").read_text())
    resumed = json.loads((out / "report.json").read_text())
    assert whole["test"] == resumed["test"] and whole["steps"] == resumed["steps"] == 40
