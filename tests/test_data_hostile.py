"""Hostile data input: NUL bytes and over-long lines in a Criteo TSV file, temporaries of a
killed run, and resuming a run on another dataset (its fingerprint). Bad input is skipped and
reported in one line naming the file, line and field; nothing good is lost."""

import json
import logging
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dlrm.cli import main
from dlrm.data import batches, criteo
from dlrm.data.criteo import preprocess_criteo
from dlrm.data.synthetic import SyntheticCriteo

HEAD = Path(__file__).resolve().parents[1].parent / "shared/data/criteo_kaggle_train_head1000.tsv"
needs_head = pytest.mark.skipif(not HEAD.is_file(), reason=f"real Criteo rows not found at {HEAD}")
ROOT = Path(__file__).resolve().parents[1]


def arrays(path):
    return [np.load(Path(path) / name) for name in ("dense.npy", "sparse.npy", "labels.npy")]


def same_rows(a, b):
    for x, y in zip(arrays(a), arrays(b)):
        np.testing.assert_array_equal(x, y)


def temporaries(path):
    return sorted(p.name for p in Path(path).iterdir() if p.name.endswith(".tmp"))


@pytest.fixture(scope="module")
def head_lines():
    """The lines of HEAD, each ending with a newline (the file's last one has none)."""
    return [line.rstrip(b"\n") + b"\n" for line in HEAD.read_bytes().splitlines()]


# --------------------------------------------------------------------------- 1. NUL bytes


@needs_head
def test_nul_byte_makes_the_line_malformed(tmp_path, head_lines, caplog):
    """Cut at the NUL, each of these fields would still parse (as '68fd', '13', '0', ...):
    the line must be reported, not read short."""
    lines = list(head_lines)

    def with_nul(number, field, at):  # a NUL at byte `at` of field `field` (1-based)
        fields = lines[number - 1][:-1].split(b"\t")
        fields[field - 1] = fields[field - 1][:at] + b"\x00" + fields[field - 1][at:]
        return b"\t".join(fields) + b"\n"

    last = lines[997].count(b"\t") + 1  # the last field of line 998 (may be ragged)
    nul = {5: with_nul(5, 6, 2), 40: with_nul(40, 1, 1), 300: with_nul(300, 15, 4)}
    nul[998] = lines[997][:-1] + b"\x00\x00\n"
    for number, line in nul.items():
        lines[number - 1] = line
    src = tmp_path / "nul.tsv"
    src.write_bytes(b"".join(lines))
    clean = tmp_path / "clean.tsv"
    clean.write_bytes(b"".join(line for i, line in enumerate(head_lines) if i + 1 not in nul))

    with caplog.at_level(logging.WARNING, logger="dlrm.data.criteo"):
        meta = preprocess_criteo(src, tmp_path / "out", chunk_bytes=8192, progress=False)
    report = meta["malformed"]
    assert report["count"] == 4 and report["by_reason"]["NUL byte"] == 4
    assert [f["line"] for f in report["first"]] == sorted(nul)
    assert {f["reason"] for f in report["first"]} == {"NUL byte"}
    assert [f.get("field") for f in report["first"]] == [6, 1, 15, last]
    (message,) = [r.getMessage() for r in caplog.records]
    assert str(src) in message and "line 5, field 6 (I5): NUL byte" in message
    assert "line 40, field 1 (label): NUL byte" in message and "\n" not in message

    expected = preprocess_criteo(clean, tmp_path / "expected", progress=False)
    assert meta["rows"] == expected["rows"] == 996
    assert meta["cardinalities"] == expected["cardinalities"]
    same_rows(tmp_path / "out", tmp_path / "expected")


# --------------------------------------------------------------------------- 2. long lines

# Peak RSS of this process: VmHWM, as ru_maxrss but not inherited from the parent (pytest,
# with torch loaded) across fork and exec, which would hide the growth.
_MEASURE = textwrap.dedent(
    """
    import json, sys
    from dlrm.data.criteo import preprocess_criteo

    def peak_kib():
        status = open("/proc/self/status").read()
        return int(status.split("VmHWM:")[1].split()[0])

    src, small, out = sys.argv[1:4]
    preprocess_criteo(small, out + "-warm", chunk_bytes=1 << 20, progress=False)  # warm up
    before = peak_kib()
    meta = preprocess_criteo(src, out, chunk_bytes=1 << 20, progress=False)
    growth = peak_kib() - before
    print(json.dumps({"peak_growth_kib": growth, "malformed": meta["malformed"]}))
    """
)


@needs_head
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_over_long_line_skipped_in_bounded_memory(tmp_path, head_lines):
    """A 50 MB line between good lines: skipped and reported (line number), the good lines
    kept, and the peak memory of the process grows by far less than the line."""
    line_bytes = 50 << 20
    src = tmp_path / "long.tsv"
    with open(src, "wb") as f:
        f.writelines(head_lines[:500])
        f.write(b"1\t" + b"12345\t" * (line_bytes // 6) + b"\n")  # line 501
        f.writelines(head_lines[500:])
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(src), str(HEAD), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    measured = json.loads(result.stdout.splitlines()[-1])
    report = measured["malformed"]
    assert report["count"] == 1 and report["by_reason"]["line too long"] == 1
    assert report["first"] == [{"line": 501, "reason": "line too long"}]
    assert f"line 501: line too long (over {criteo.MAX_LINE_BYTES} bytes)" in result.stderr
    # Reading 1 MiB chunks, the process holds a few MiB of the line at most.
    assert measured["peak_growth_kib"] < 16 << 10, measured
    preprocess_criteo(HEAD, tmp_path / "clean", progress=False)
    same_rows(tmp_path / "out", tmp_path / "clean")


@needs_head
def test_long_lines_inside_a_block_and_at_the_end(tmp_path, head_lines):
    """Over-long lines that a block holds whole (chunk larger than the line), one that ends
    the file without a newline, and one of exactly the bound (kept as a malformed line of
    another kind, not cut or refused)."""
    bound = criteo.MAX_LINE_BYTES
    long_line = b"0\t" + b"7" * bound + b"\n"
    lines = head_lines[:10] + [long_line] + head_lines[10:20] + [b"0" * bound + b"\n"]
    lines += head_lines[20:] + [b"1\t" + b"a\t" * bound]
    src = tmp_path / "long.tsv"
    src.write_bytes(b"".join(lines))
    for chunk in (1 << 20, 4096):
        meta = preprocess_criteo(src, tmp_path / f"out{chunk}", chunk_bytes=chunk, progress=False)
        report = meta["malformed"]
        assert [(f["line"], f["reason"]) for f in report["first"]] == [
            (11, "line too long"),
            (22, "bad label"),
            (1003, "line too long"),
        ], chunk
        assert meta["rows"] == 1000
        same_rows(tmp_path / f"out{chunk}", tmp_path / f"out{1 << 20}")


# --------------------------------------------------------------------------- 3. killed runs


def _leave_temporaries(out: Path) -> None:
    """The temporaries killed writers leave: of a pid now unused and of one now running
    (pid 1: reused since, as after a reboot or in a container)."""
    out.mkdir(parents=True, exist_ok=True)
    for pid in (4194000, 1):
        for name in criteo.FILES:
            (out / f".{name}.{pid}.tmp").write_bytes(b"partial" * 1000)


@needs_head
def test_preprocess_removes_temporaries_of_a_killed_run(tmp_path, caplog):
    out = tmp_path / "out"
    _leave_temporaries(out)
    (out / "notes.tmp").write_text("not ours")  # unrelated files stay
    with caplog.at_level(logging.WARNING, logger="dlrm.data.criteo"):
        meta = preprocess_criteo(HEAD, out, progress=False)
    assert temporaries(out) == ["notes.tmp"]
    assert "left by a killed run" in caplog.text
    assert meta["rows"] == 1000 and batches.load(out).meta == meta
    preprocess_criteo(HEAD, tmp_path / "clean", progress=False)
    same_rows(out, tmp_path / "clean")


def test_synthetic_write_removes_temporaries_of_a_killed_run(tmp_path):
    out = tmp_path / "out"
    _leave_temporaries(out)
    gen = SyntheticCriteo(scale=0.0005, seed=1)
    gen.write(out, 3000)
    assert temporaries(out) == []
    for a, b in zip(gen.rows(0, 3000), arrays(out)):
        np.testing.assert_array_equal(a, b)


def test_generate_killed_midway_then_run_again(tmp_path):
    """SIGKILL ``dlrm generate`` while it writes; the next run into the directory succeeds
    and leaves no temporaries."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dlrm.cli",
            "generate",
            str(out),
            "--rows",
            "20000000",
            "--scale",
            "0.0005",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            tmp = out / f".dense.npy.{proc.pid}.tmp"
            if tmp.exists() and tmp.stat().st_size > 1 << 20:  # data are being written
                break
            time.sleep(0.05)
        assert proc.poll() is None, "generate ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert len(temporaries(out)) >= 3 and not (out / "meta.json").exists()

    assert main(["generate", str(out), "--rows", "5000", "--scale", "0.0005", "--seed", "2"]) == 0
    assert temporaries(out) == []
    meta = batches.load(out).meta
    assert meta["rows"] == 5000
    for a, b in zip(SyntheticCriteo(scale=0.0005, seed=2).rows(0, 5000), arrays(out)):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- 4. fingerprint


def test_fingerprint_covers_the_data(tmp_path):
    a = SyntheticCriteo(scale=0.0005, seed=0).write(tmp_path / "a", 5000)
    again = SyntheticCriteo(scale=0.0005, seed=0).write(tmp_path / "again", 5000)
    seed = SyntheticCriteo(scale=0.0005, seed=1).write(tmp_path / "seed", 5000)
    rows = SyntheticCriteo(scale=0.0005, seed=0).write(tmp_path / "rows", 5001)
    assert a["fingerprint"].startswith("sha256:")
    assert a["fingerprint"] == again["fingerprint"]  # same data, another path
    assert len({a["fingerprint"], seed["fingerprint"], rows["fingerprint"]}) == 3
    # What the files say, computed afresh: what a directory without one gets on load.
    on_disk = json.loads((tmp_path / "a/meta.json").read_text())
    assert on_disk["fingerprint"] == a["fingerprint"]
    assert criteo.file_digests(tmp_path / "a") == on_disk["data_files"]
    del on_disk["fingerprint"], on_disk["data_files"]
    (tmp_path / "a/meta.json").write_text(json.dumps(on_disk))
    assert batches.load(tmp_path / "a").meta["fingerprint"] == a["fingerprint"]


TRAIN = [
    "--steps",
    "4",
    "--batch-size",
    "64",
    "--eval-every",
    "0",
    "--no-progress",
    "--threads",
    "1",
]


def _generate(path, seed=0, rows=5000):
    argv = ["generate", str(path), "--rows", str(rows), "--scale", "0.0005", "--seed", str(seed)]
    assert main(argv) == 0


def _refused(capsys, argv, *needles):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_resume_refuses_another_dataset(tmp_path, capsys):
    data, other = tmp_path / "data", tmp_path / "other"
    _generate(data, seed=0)
    _generate(other, seed=1)
    run = ["train", "--out", str(tmp_path / "run"), *TRAIN]
    assert main([*run, "--data", str(data), "--stop-after", "2"]) == 0
    checkpoint = (tmp_path / "run/checkpoint/state.pt").read_bytes()
    first = json.loads((data / "meta.json").read_text())["fingerprint"]
    second = json.loads((other / "meta.json").read_text())["fingerprint"]

    # Another directory.
    _refused(capsys, [*run, "--data", str(other), "--resume"], first[:23], second[:23])

    # The same directory, regenerated with another seed, then with other rows.
    for seed, rows in ((1, 5000), (0, 5001)):
        _generate(data, seed=seed, rows=rows)
        now = json.loads((data / "meta.json").read_text())["fingerprint"]
        err = _refused(capsys, [*run, "--data", str(data), "--resume"], first[:23], now[:23])
        assert str(data.resolve()) in err and "other data" in err
    assert not (tmp_path / "run/report.json").exists()
    assert (tmp_path / "run/checkpoint/state.pt").read_bytes() == checkpoint  # nothing touched

    # The original data again (same bytes, same fingerprint): the run resumes and ends.
    _generate(data, seed=0)
    assert main([*run, "--data", str(data), "--resume"]) == 0
    assert json.loads((tmp_path / "run/report.json").read_text())["steps"] == 4
