"""``dlrm train --nproc-per-node 2``: two processes (gloo) started by torch's elastic launcher.

A rank killed with SIGKILL mid-run makes the launcher end the other and exit with one line
naming the rank (no hang); ``--resume`` from the last sharded checkpoint then ends exactly
like the uninterrupted run. ``dlrm evaluate`` of a sharded checkpoint gives the run's test
metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

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
]


def _train(out: Path, *extra: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dlrm.cli", "train", "--out", str(out), *ARGS, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


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


def test_sigkill_of_one_rank_ends_the_run_and_resume_reproduces_it(tmp_path):
    whole = _train(tmp_path / "whole")
    assert _finish(whole)[0] == 0
    # `dlrm evaluate` of the sharded checkpoint runs 2 processes and gets the run's metrics
    evaluated = subprocess.run(
        [sys.executable, "-m", "dlrm.cli", "evaluate", "--out", str(tmp_path / "whole")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert evaluated.returncode == 0, evaluated.stderr
    report = json.loads((tmp_path / "whole" / "report.json").read_text())
    assert json.loads(evaluated.stdout) == report["test"]
    out = tmp_path / "killed"
    proc = _train(out)
    deadline = time.time() + 240
    while not (out / "checkpoint" / ".metadata").exists() and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    workers = _workers(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    code, err = _finish(proc)
    (line,) = [line for line in err.splitlines() if line.startswith("dlrm train: error:")]
    assert code == 2 and re.search(r"rank [01] failed", line) and "SIGKILL" in line, err
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)  # none left running

    code, err = _finish(_train(out, "--resume"))
    assert code == 0, err
    a = json.loads((tmp_path / "whole" / "report.json").read_text())
    b = json.loads((out / "report.json").read_text())
    assert a["world_size"] == b["world_size"] == 2 and a["steps"] == b["steps"] == 60
    for key in ("test", "skipped_steps", "loss_scale"):
        assert a[key] == b[key], key
    assert a["embeddings"] == b["embeddings"]  # tables, ranks, hit rates, memory per rank
    assert set(a["embeddings"]["sharding"]) == {f"t_{i}" for i in range(26)}
    assert len(a["embeddings"]["memory_bytes_per_rank"]) == 2
