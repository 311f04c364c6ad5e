"""``dlrm train --nproc-per-node 2``: two processes (gloo) started by torch's elastic launcher.

A rank killed with SIGKILL mid-run makes the launcher end the other and exit with one line
naming the rank (no hang); ``--resume`` from the last sharded checkpoint then ends exactly
like the uninterrupted run. ``dlrm evaluate`` of a sharded checkpoint gives the run's test
metrics, in as many processes or in one; a checkpoint resumes at another world size."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrm.monitor import read_history
from dlrm.run_dir import read_manifest

# one worker runs this file's tests, so that they share one uninterrupted run
pytestmark = pytest.mark.xdist_group("distributed_cli")

ARGS = [
    "--synthetic-scale",
    "0.001",
    "--synthetic-rows",
    "30000",
    "--batch-size",
    "256",
    "--steps",
    "60",
    "--checkpoint-every",
    "10",
    "--eval-every",
    "0",
    "--threads",
    "1",
    "--no-progress",
    "--nproc-per-node",
    "2",
    "--log-every",
    "20",
]


def _train(out: Path, *extra: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dlrm.cli", "train", "--out", str(out), *ARGS, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _evaluate(out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "dlrm.cli", "evaluate", "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and not done.stderr, done.stderr  # nothing but the metrics
    return json.loads(done.stdout)


def _workers(launcher: int) -> list[int]:
    """The training processes the launcher spawned (not multiprocessing's helpers)."""
    pids = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == launcher and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(pid)
    return sorted(pids)


def _wait_for_checkpoint(out: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 240
    while not (out / "checkpoint" / ".metadata").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """An uninterrupted run of 60 steps in 2 processes."""
    out = tmp_path_factory.mktemp("whole")
    code, err = _finish(_train(out))
    assert code == 0, err
    return out


def test_sigkill_of_one_rank_ends_the_run_and_resume_reproduces_it(tmp_path, whole):
    # `dlrm evaluate` of the sharded checkpoint in 2 processes gets the run's metrics
    report = json.loads((whole / "report.json").read_text())
    assert _evaluate(whole, "--nproc-per-node", "2") == report["test"]
    out = tmp_path / "killed"
    proc = _train(out)
    _wait_for_checkpoint(out, proc)
    workers = _workers(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    code, err = _finish(proc)
    (line,) = err.splitlines()  # one line, and nothing else
    assert code == 2 and re.search(r"rank [01] failed", line) and "SIGKILL" in line, err
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)  # none left running

    code, err = _finish(_train(out, "--resume"))
    assert code == 0, err
    a = json.loads((whole / "report.json").read_text())
    b = json.loads((out / "report.json").read_text())
    assert a["world_size"] == b["world_size"] == 2 and a["steps"] == b["steps"] == 60
    for key in ("test", "skipped_steps", "loss_scale"):
        assert a[key] == b[key], key
    assert a["embeddings"] == b["embeddings"]  # tables, ranks, hit rates, memory per rank
    assert set(a["embeddings"]["sharding"]) == {f"t_{i}" for i in range(26)}
    assert len(a["embeddings"]["memory_bytes_per_rank"]) == 2


def test_rank_0_writes_the_history_of_every_rank(whole):
    report = json.loads((whole / "report.json").read_text())
    intervals = [r for r in read_history(whole) if "loss" in r]
    assert [r["step"] for r in intervals] == [20, 40, 60]
    assert sum(r["skipped"] for r in intervals) == report["skipped_steps"]
    assert set(intervals[0]["tables"]) == set(report["embeddings"]["tables"])
    for name, table in report["embeddings"]["tables"].items():  # every rank's tables
        lookups = sum(r["tables"][name]["lookups"] for r in intervals)
        hits = sum(r["tables"][name]["hits"] for r in intervals)
        assert table["hit_rate"] == (hits / lookups if lookups else 0.0), name


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_of_the_launcher_ends_its_ranks(tmp_path):
    """Orphaned ranks would train on, holding their memory (a GPU) for nobody."""
    out = tmp_path / "orphaned"
    proc = _train(out, "--steps", "100000")
    _wait_for_checkpoint(out, proc)  # the ranks are in the training loop
    workers = _workers(proc.pid)
    assert len(workers) == 2, workers
    proc.kill()
    proc.wait()
    deadline = time.time() + 15
    while (alive := [pid for pid in workers if _running(pid)]) and time.time() < deadline:
        time.sleep(0.1)
    for pid in alive:  # none should be left; if some are, end them here
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"ranks {alive} outlived their launcher by 15 s"


def test_sigterm_stops_every_rank_at_one_step_and_resume_reproduces_the_run(tmp_path, whole):
    out = tmp_path / "stopped"
    proc = _train(out)
    _wait_for_checkpoint(out, proc)
    workers = _workers(proc.pid)
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc)
    assert len(err.splitlines()) == 1, err  # one line, and nothing else
    line = err.strip()
    step = read_manifest(out / "checkpoint")["step"]
    assert code == 128 + signal.SIGTERM and "stopped by SIGTERM" in line, err
    assert f"last checkpoint: step {step} ({out / 'checkpoint'})" in line, err
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
    assert not list(out.glob(".*.tmp"))
    code, err = _finish(_train(out, "--resume"))
    assert code == 0, err
    a = json.loads((whole / "report.json").read_text())
    b = json.loads((out / "report.json").read_text())
    for key in ("steps", "test", "skipped_steps", "loss_scale"):
        assert a[key] == b[key], key


def test_a_checkpoint_resumes_and_evaluates_at_another_world_size(tmp_path, whole):
    """2 processes -> 1 -> 2: each resume re-cuts the tables from the other's checkpoint.
    The run is not the uninterrupted one bit for bit (one process adds the dense gradient
    in another order; a re-cut table's cache is written back), but close to it."""
    out = tmp_path / "run"
    assert _finish(_train(out, "--stop-after", "20"))[0] == 0
    assert (out / "checkpoint" / ".metadata").exists()
    # one process reads the 2 ranks' shards: the model 2 processes evaluate
    two = _evaluate(out, "--nproc-per-node", "2")
    one = _evaluate(out)
    assert one.keys() == two.keys()
    for key in ("auc", "accuracy", "log_loss", "normalized_entropy"):
        assert one[key] == pytest.approx(two[key], rel=1e-6), key

    code, err = _finish(_train(out, "--resume", "--stop-after", "20", "--nproc-per-node", "1"))
    assert code == 0, err
    assert read_manifest(out / "checkpoint")["step"] == 40
    assert (out / "checkpoint" / "state.pt").exists()  # one process: one file
    code, err = _finish(_train(out, "--resume"))  # back to 2 processes, to the end
    assert code == 0, err
    assert (out / "checkpoint" / ".metadata").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 60
    uninterrupted = json.loads((whole / "report.json").read_text())["test"]
    assert abs(report["test"]["auc"] - uninterrupted["auc"]) < 0.005
    assert report["test"]["auc"] > two["auc"] + 0.03  # and it went on learning
