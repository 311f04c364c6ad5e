"""The run directory on disk (dlrm.run_dir): checksummed checkpoints, the last two kept, one
writer at a time, no temporaries left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dlrm import run_dir
from dlrm.distributed import ONE_PROCESS
from dlrm.errors import RunError


def _write(out, step: int, run: str = "r1", files: dict | None = None):
    """A checkpoint of ``files`` (name -> bytes; random by default) at ``step``."""
    files = files or {"a.bin": os.urandom(3000), "b.bin": os.urandom(70_000)}

    def write(directory):
        for name, data in files.items():
            (directory / name).write_bytes(data)

    info = {"step": step, "run": run, "world_size": 1}
    return run_dir.write_checkpoint(out, write, info, ONE_PROCESS)


def _refused(path, *needles):
    with pytest.raises(RunError) as e:
        run_dir.verify(path, ONE_PROCESS)
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def test_a_checkpoint_verifies_and_the_previous_one_is_kept(tmp_path):
    _write(tmp_path, 5)
    path = _write(tmp_path, 10)
    assert run_dir.verify(path, ONE_PROCESS)["step"] == 10
    assert run_dir.read_manifest(tmp_path / run_dir.PREVIOUS)["step"] == 5
    _write(tmp_path, 15)
    steps = sorted(run_dir.read_manifest(p)["step"] for p in tmp_path.glob("checkpoint*"))
    assert steps == [10, 15]  # the last two, nothing else, no temporaries
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint.prev"]


def test_another_runs_checkpoints_are_replaced_not_kept(tmp_path):
    _write(tmp_path, 5, run="old")
    _write(tmp_path, 10, run="old")
    _write(tmp_path, 2, run="new")
    assert run_dir.read_manifest(tmp_path / run_dir.CHECKPOINT)["run"] == "new"
    assert not (tmp_path / run_dir.PREVIOUS).exists()


@pytest.mark.parametrize("where", [0, 1000, 2999])
def test_a_flipped_byte_anywhere_is_refused_naming_the_file(tmp_path, where):
    path = _write(tmp_path, 5)
    data = bytearray((path / "a.bin").read_bytes())
    data[where] ^= 0x10
    (path / "a.bin").write_bytes(bytes(data))
    _refused(path, str(path / "a.bin"), "damaged")


def test_truncated_and_missing_files_are_refused_naming_them(tmp_path):
    _write(tmp_path, 5)
    path = _write(tmp_path, 10)
    with open(path / "b.bin", "r+b") as f:
        f.truncate(69_999)
    message = _refused(path, str(path / "b.bin"), "69999 bytes", "70000")
    # the checkpoint before it is named: the way back for a user
    assert str(tmp_path / run_dir.PREVIOUS) in message
    (path / "b.bin").unlink()
    _refused(path, str(path / "b.bin"), "missing")
    (path / run_dir.MANIFEST).unlink()
    _refused(path, run_dir.MANIFEST, "not a complete checkpoint")


def test_the_previous_checkpoint_is_named_as_the_way_back_only_if_intact(tmp_path):
    _write(tmp_path, 5)
    path = _write(tmp_path, 10)
    previous = tmp_path / run_dir.PREVIOUS
    manifest = path / run_dir.MANIFEST
    whole = manifest.read_text()
    for damaged in ("", whole[: len(whole) // 2]):  # empty, truncated
        manifest.write_text(damaged)
        message = _refused(path, str(manifest), "not a checkpoint manifest")
        assert f"the checkpoint before it is {previous}: remove {path}" in message
    (previous / "b.bin").write_bytes(b"x")  # the previous one damaged too: no way back
    assert str(previous) not in _refused(path, str(manifest))
    manifest.write_text(whole)
    (path / "a.bin").write_bytes(b"x")
    assert str(previous) not in _refused(path, str(path / "a.bin"), "1 bytes")


def test_a_manifest_cannot_point_outside_its_checkpoint(tmp_path):
    path = _write(tmp_path, 5)
    manifest = json.loads((path / run_dir.MANIFEST).read_text())
    manifest["files"]["../secret"] = {"bytes": 1, "sha256": "0" * 64}
    (path / run_dir.MANIFEST).write_text(json.dumps(manifest))
    _refused(path, run_dir.MANIFEST, "malformed")
    (path / run_dir.MANIFEST).write_text("{not json")
    _refused(path, run_dir.MANIFEST, "not a checkpoint manifest")


def test_a_failed_write_leaves_the_checkpoints_as_they_were(tmp_path):
    _write(tmp_path, 5)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}

    def write(directory):
        (directory / "part").write_bytes(b"x" * 100)
        raise KeyboardInterrupt  # as a second Ctrl-C during the write

    with pytest.raises(KeyboardInterrupt):
        run_dir.write_checkpoint(tmp_path, write, {"step": 6, "run": "r1"}, ONE_PROCESS)
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]  # no temporary


def test_write_atomically_leaves_no_temporary_on_failure(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")

    def fail(path):
        path.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(RunError, match="No space left"):
        run_dir.write_atomically(target, fail)
    assert target.read_text() == "old" and sorted(tmp_path.iterdir()) == [target]
    assert run_dir.temporary_name(target) != run_dir.temporary_name(target)


_HOLD = """
import sys, time
from pathlib import Path
from dlrm import run_dir
with run_dir.lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def test_one_writer_holds_a_directory_and_a_killed_one_does_not_block(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunError, match=f"in use by another run \\(PID {holder.pid}\\)"):
            with run_dir.lock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    stale = run_dir.temporary_name(tmp_path / "checkpoint")
    stale.mkdir()  # as a killed writer leaves it
    with run_dir.lock(tmp_path):
        assert not stale.exists()
        assert (tmp_path / run_dir.LOCK).read_text().strip() == str(os.getpid())


def test_a_checkpoint_of_another_format_is_refused_naming_it(tmp_path):
    path = _write(tmp_path, 5)
    manifest = json.loads((path / run_dir.MANIFEST).read_text())
    assert manifest["format"] == run_dir.FORMAT
    (path / run_dir.MANIFEST).write_text(json.dumps({**manifest, "format": 2}))
    _refused(path, "checkpoint format 2")
    other = tmp_path / "old"
    other.mkdir()
    (other / "checkpoint.pt").write_bytes(b"PK")  # what versions before checksums wrote
    with pytest.raises(RunError, match="checkpoint.pt is of format 0"):
        run_dir.require_checkpoint(other)
