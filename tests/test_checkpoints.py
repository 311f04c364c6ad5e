"""Trust on disk through the `dlrm` command: a checkpoint that would run code or is damaged
is refused before anything is loaded, one run writes a directory at a time, the last
checkpoint kept is a usable one, cheap refusals come before any work, and SIGTERM / SIGINT
stop a run cleanly (docs/design.md, "Runs and checkpoints")."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_serialization import CreatesFile, plant_in_tensor_item
from test_train import SMALL

from dlrm import run_dir
from dlrm.cli import main
from dlrm.monitor import HISTORY
from embcache.serialization import read_metadata


def _train(out: Path, *extra: str) -> int:
    return main(["train", "--out", str(out), *SMALL, *extra])


def _refused(capsys, argv: list, *needles) -> str:
    """Run ``argv``: it must exit 2 with one line on stderr holding every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert str(needle) in err, (needle, err)
    return err


def _resume_and_evaluate(out: Path) -> list[list]:
    """The two ways a user reads a run's checkpoint."""
    return [
        ["train", "--out", str(out), *SMALL, "--resume", "--steps", "8"],
        ["evaluate", "--out", str(out), "--no-progress"],
    ]


def _sign(checkpoint: Path) -> None:
    """Rewrite the manifest to match the files, as someone who planted them would."""
    manifest = json.loads((checkpoint / run_dir.MANIFEST).read_text())
    manifest["files"] = {
        p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in checkpoint.iterdir()
        if p.name != run_dir.MANIFEST
    }
    (checkpoint / run_dir.MANIFEST).write_text(json.dumps(manifest))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, capsys):
    out, marker = tmp_path / "run", tmp_path / "marker"
    assert _train(out, "--steps", "2") == 0
    state = out / "checkpoint" / "state.pt"
    torch.save({"config": {}, "trainer": CreatesFile(marker), "progress": {}}, state)
    _sign(out / "checkpoint")
    for argv in _resume_and_evaluate(out):
        _refused(capsys, argv, f"{state}: refused", "open")
    assert not marker.exists()


@pytest.mark.parametrize("planted", ["metadata", "rest"])
def test_a_sharded_checkpoint_that_would_run_code_is_refused(tmp_path, capsys, planted):
    """A ``torch.distributed.checkpoint`` run directory: its ``.metadata`` pickle, or the
    item that holds the configuration and trainer state, builds a hostile object."""
    out, marker = tmp_path / "run", tmp_path / "marker"
    checkpoint = out / "checkpoint"
    rest = io.BytesIO()
    torch.save({"config": {}, "trainer": CreatesFile(marker), "progress": {}}, rest)
    rest = torch.frombuffer(bytearray(rest.getbuffer()), dtype=torch.uint8)
    dcp.save({"rest": rest}, checkpoint_id=checkpoint, no_dist=True)
    if planted == "metadata":
        metadata = read_metadata(checkpoint)
        metadata.planner_data["x"] = CreatesFile(marker)
        (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = {"format": run_dir.FORMAT, "step": 4, "run": "x", "files": {}}
    (checkpoint / run_dir.MANIFEST).write_text(json.dumps(manifest))
    _sign(checkpoint)
    capsys.readouterr()  # DCP's warning about saving without a process group
    where = checkpoint / ".metadata" if planted == "metadata" else f"{checkpoint} (rest)"
    for argv in _resume_and_evaluate(out):
        _refused(capsys, argv, f"{where}: refused", "open")
    assert not marker.exists()


def test_a_sharded_checkpoint_whose_rest_item_holds_a_pickle_is_refused(tmp_path, capsys):
    """The item that holds the configuration and trainer state is a uint8 tensor; here its
    stored bytes, vouched for by the manifest, are a pickle that would run code."""
    out, marker = tmp_path / "run", tmp_path / "marker"
    checkpoint = out / "checkpoint"
    dcp.save({"rest": torch.zeros(8, dtype=torch.uint8)}, checkpoint_id=checkpoint, no_dist=True)
    hostile = io.BytesIO()
    torch.save({"config": {}, "trainer": CreatesFile(marker), "progress": {}}, hostile)
    name = plant_in_tensor_item(checkpoint, "rest", hostile.getvalue())
    manifest = {"format": run_dir.FORMAT, "step": 4, "run": "x", "files": {}}
    (checkpoint / run_dir.MANIFEST).write_text(json.dumps(manifest))
    _sign(checkpoint)
    capsys.readouterr()  # DCP's warning about saving without a process group
    for argv in _resume_and_evaluate(out):
        _refused(capsys, argv, f"{checkpoint / name} (rest): refused", "would call io.open")
    assert not marker.exists()


def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, "--steps", "2") == 0
    state = out / "checkpoint" / "state.pt"
    data = bytearray(state.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    state.write_bytes(bytes(data))
    for argv in _resume_and_evaluate(out):
        _refused(capsys, argv, state, "damaged")
    state.write_bytes(bytes(data[:middle]))
    for argv in _resume_and_evaluate(out):
        _refused(capsys, argv, state, "truncated")


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_a_damaged_manifest_is_refused_naming_the_previous_checkpoint(tmp_path, capsys, damage):
    out = tmp_path / "run"
    assert _train(out, "--steps", "4", "--checkpoint-every", "2", "--eval-every", "0") == 0
    manifest = out / "checkpoint" / run_dir.MANIFEST
    text = manifest.read_text()
    manifest.write_text("" if damage == "empty" else text[: len(text) // 2])
    way_back = f"the checkpoint before it is {out / 'checkpoint.prev'}"
    for argv in _resume_and_evaluate(out):
        _refused(capsys, argv, manifest, "not a checkpoint manifest", way_back)


def _start(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dlrm.cli", "train", "--out", str(out), *SMALL, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_one_run_writes_a_directory_at_a_time(tmp_path, capsys):
    out = tmp_path / "run"
    first = _start(out, "--steps", "100000", "--eval-every", "0")
    try:
        lock = out / run_dir.LOCK
        _wait_for(lambda: lock.exists() and lock.read_text().strip() == str(first.pid), first)
        _refused(capsys, ["train", "--out", str(out), *SMALL], f"PID {first.pid}", out)
    finally:
        first.kill()  # a killed run's lock goes with it
        first.wait()
    assert _train(out, "--steps", "2") == 0
    assert not list(out.glob(".*.tmp"))


def test_the_last_checkpoint_of_a_diverged_run_is_usable(tmp_path, capsys):
    """A learning rate so large that the model breaks: steps are skipped, one is applied
    that makes every output infinite, and the run ends as diverged. The checkpoint it names
    predates the break."""
    out = tmp_path / "run"
    args = ["--steps", "300", "--checkpoint-every", "5", "--lr", "6", "--optimizer", "sgd"]
    assert _train(out, *args, "--batch-size", "64", "--eval-every", "0") == 1
    err = capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    kept = report["diverged"]["last_checkpoint_step"]
    assert f"last checkpoint: step {kept} ({out / 'checkpoint'})" in err, err
    assert run_dir.read_manifest(out / "checkpoint")["step"] == kept
    assert main(["evaluate", "--out", str(out), "--no-progress"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert math.isfinite(metrics["auc"]) and math.isfinite(metrics["log_loss"])


def test_cheap_refusals_come_before_any_work(tmp_path, capsys):
    data = tmp_path / "data"  # where the synthetic data of a run in tmp_path would go
    run = tmp_path / "run"
    _refused(capsys, ["train", "--out", str(run), *SMALL, "--data", str(tmp_path / "no")], "no")
    _refused(capsys, ["train", "--out", str(run), *SMALL, "--resume"], "no checkpoint")
    _refused(
        capsys,
        ["train", "--out", str(run), *SMALL, "--synthetic-scale", "1000"],
        "--synthetic-scale 1000",
        "rows",
    )
    file = tmp_path / "file"
    file.write_text("mine")
    _refused(capsys, ["train", "--out", str(file), *SMALL], f"--out {file}: is a file")
    assert file.read_text() == "mine"
    assert not run.exists() and not data.exists()  # nothing made, nothing generated


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_run_at_a_step_with_a_checkpoint_there(tmp_path, capsys, sig):
    out = tmp_path / "run"
    proc = _start(out, "--steps", "100000", "--checkpoint-every", "7", "--eval-every", "0")
    _wait_for(lambda: run_dir.latest_checkpoint(out) is not None, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    (line,) = err.splitlines()
    step = int(line.split(f"stopped by {sig.name} at step ")[1].split(";")[0])
    assert f"last checkpoint: step {step} ({out / 'checkpoint'}); continue with --resume" in line
    assert run_dir.read_manifest(out / "checkpoint")["step"] == step
    assert not list(out.glob(".*.tmp"))
    assert main(["evaluate", "--out", str(out), "--no-progress"]) == 0  # the checkpoint loads
    assert _train(out, "--resume", "--steps", str(step + 2)) == 0
    assert json.loads((out / "report.json").read_text())["steps"] == step + 2
    capsys.readouterr()


def test_a_second_signal_interrupts_a_checkpoint_write_and_leaves_no_temporary(
    tmp_path, monkeypatch
):
    """Ctrl-C twice: the first during step 3, the second once the checkpoint at the stop has
    its state file written but before it is in place."""
    from dlrm.mixed_precision import MixedPrecisionTrainer

    out, saves, steps = tmp_path / "run", [], []
    save, train_step = torch.save, MixedPrecisionTrainer.train_step

    def interrupted_save(obj, path, *args, **kwargs):
        save(obj, path, *args, **kwargs)
        saves.append(path)
        if len(saves) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises KeyboardInterrupt here

    def step_interrupted_at_3(self, *args, **kwargs):
        steps.append(1)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return train_step(self, *args, **kwargs)

    monkeypatch.setattr(torch, "save", interrupted_save)
    monkeypatch.setattr(MixedPrecisionTrainer, "train_step", step_interrupted_at_3)
    assert _train(out, "--steps", "50", "--checkpoint-every", "2", "--eval-every", "0") == 130
    assert len(saves) == 2 and not saves[1].exists()  # it was written, then removed
    assert run_dir.read_manifest(out / "checkpoint")["step"] == 2
    assert sorted(p.name for p in out.iterdir()) == [run_dir.LOCK, "checkpoint", HISTORY]
