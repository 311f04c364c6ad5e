"""Every benchmark result records where and with what it was made (bench/_common.environment):
the command line, the commit, the CPU, the library versions and the date, in its JSON and at the
top of its Markdown."""

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _common  # noqa: E402
import skew  # noqa: E402

KEYS = {
    "command",
    "commit",
    "dirty",
    "cpu_model",
    "cores",
    "torch",
    "fbgemm_gpu",
    "torchrec",
    "python",
    "date",
}


def _check(env: dict, command: str) -> None:
    assert KEYS <= env.keys()
    assert env["command"] == command
    assert env["commit"] not in ("", "unknown") and isinstance(env["dirty"], bool)
    assert env["cpu_model"] and env["cores"] >= 1
    assert env["torch"] != "not installed" and env["torchrec"] != "not installed"
    assert env["date"].endswith("+00:00")


def _run(script: str, argv: list[str], out: Path) -> dict:
    """Runs bench/<script> with argv in a process of its own; its JSON result from ``out``,
    whose environment is checked."""
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *argv],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    result = json.loads(out.read_text())
    _check(result["environment"], f"python bench/{script} " + " ".join(argv))
    return result


def test_skew_json_and_markdown_carry_the_environment(tmp_path):
    trace = np.stack([np.arange(300) % 100, np.arange(300) % 7], axis=1)
    np.save(tmp_path / "trace.npy", trace)
    argv = ["--data", str(tmp_path / "trace.npy"), "--min-rows", "1", "--out", str(tmp_path / "s")]
    result = skew.main(argv)
    command = "python bench/skew.py " + " ".join(argv)
    _check(result["environment"], command)
    assert (
        json.loads((tmp_path / "s" / "skew.json").read_text())["environment"]
        == (result["environment"])
    )
    md = (tmp_path / "s" / "skew.md").read_text().splitlines()
    assert md[0] == "# Access skew per table" and md[2] == f"Command: `{command}`  "
    assert any(line.startswith("Machine: ") and "torch " in line for line in md[:6])


def test_embedding_step_writes_its_environment(tmp_path):
    argv = ["--max-rows", "500", "--batch", "32", "--warmup", "2", "--steps", "2", "--rounds", "1"]
    argv += ["--out", str(tmp_path)]
    result = _run("embedding_step.py", argv, tmp_path / "embedding_step.json")
    assert result["environment"]["threads"] >= 1
    assert result["results"]["FBGEMM TBE fp32 EXACT_SGD"]["speed_vs_fbgemm"] == 1.0
    md = (tmp_path / "embedding_step.md").read_text()
    assert md.startswith("# Embedding training step, dim 16\n\nCommand: `python bench/")


def test_environment_versions_and_dirty_state(monkeypatch):
    env = _common.environment("bench/x.py", ["--a", "b c"], threads=3)
    assert env["command"] == "python bench/x.py --a 'b c'" and env["threads"] == 3
    monkeypatch.setitem(_common.PACKAGES, "torchrec", ("no-such-distribution",))
    assert _common.environment("bench/x.py", [])["torchrec"] == "not installed"
    assert "threads" not in _common.environment("bench/x.py", [])


def test_bandwidth_meets_its_forced_hit_rates_and_writes_its_environment(tmp_path):
    argv = ["--dims", "8", "--precisions", "int8", "--policies", "lfu,lru", "--rows", "200000"]
    argv += ["--hit-rates", "0,0.5,0.9", "--bags", "256", "--pooling", "4", "--steps", "2"]
    argv += ["--rounds", "1", "--out", str(tmp_path)]
    result = _run("bandwidth.py", argv, tmp_path / "bandwidth.json")
    engines = result["dims"]["8"]["engines"]
    for policy in ("LFU", "LRU"):
        points = engines[f"ours int8 + 5% 32-way {policy} cache"]
        assert [p["target"] for p in points] == [0.0, 0.5, 0.9]
        for p in points:  # measured by the table's own counters, over the timed steps
            assert abs(p["hit_rate"] - p["target"]) <= 0.02, (policy, p)
            assert p["forward_gbs"] > 0 and p["update_gbs"] > 0
    assert {p["hit_rate"] for p in engines["ours int8, no cache"]} == {0.0}
    assert "nn.EmbeddingBag fp32 + SGD" in engines and "FBGEMM TBE fp32 EXACT_SGD" in engines
    shares = result["dims"]["8"]["huge_pages"]  # each table's rows on huge pages (Linux)
    assert shares.keys() == engines.keys()
    assert all(0.0 <= s <= 1.0 for s in shares.values()), shares
    for name, points in engines.items():  # paired with a gather; INT8 + LFU with FP32 too
        for key, which in [
            ("gather_share", "ours"),
            ("rival_step_ratio", "ours int8 + 5% 32-way LFU"),
        ]:
            paired = [p.get(f"{key}_rounds") for p in points]
            if name.startswith(which):
                assert all(len(r) == 1 and r[0] > 0 for r in paired), (name, key, paired)
            else:
                assert paired == [None] * len(points), (name, key)
    assert (tmp_path / "bandwidth.png").stat().st_size > 0
    md = (tmp_path / "bandwidth.md").read_text().splitlines()
    assert md[2] == f"Command: `python bench/bandwidth.py {' '.join(argv)}`  "
    shares_table = md.index(
        "| engine | forward / gather at 0% | forward / gather at 90% "
        "| forward at 90% / FP32 gather ceiling |"
    )
    assert md[shares_table + 2].startswith("| ours int8 + 5% 32-way LFU cache | ")
    rival_rows = [line for line in md if line.startswith("| forward, backward and update | ")]
    assert len(rival_rows) == 1  # INT8 + LFU against our FP32 table


def test_kernel_bench_rehearsal_reports_every_run_and_issue_50s_targets(tmp_path):
    """bench/kernel_bench.py at its CPU rehearsal size: strict JSON with every configuration's
    run, each engine's rounds and GB/s as FBGEMM counts them, and each of issue 50's targets
    as a figure, what it is compared with and their ratio (the median of per-round ratios)."""
    import kernel_bench as kb

    assert kb.CONFIGS[0] == kb.Config("FBGEMM's shape", 32, 100_000, 128, 20, (512,), True)
    argv = ["--device", "cpu", "--quick", "--rounds", "2", "--steps", "2", "--out", str(tmp_path)]
    _run("kernel_bench.py", argv, tmp_path / "kernel_bench.json")

    def refuse(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    result = json.loads((tmp_path / "kernel_bench.json").read_text(), parse_constant=refuse)
    quick = [c.quick() for c in kb.CONFIGS]
    assert list(result["runs"]) == [f"{c.name}, batch {b}" for c in quick for b in c.batches]
    assert len(result["copy_gbs_rounds"]) == 4 and result["copy_gbs"] > 0
    for r in result["runs"].values():
        assert r["lookups"] == r["tables"] * r["batch"] * r["pooling"]
        assert r["forward_bytes"] == r["lookups"] * r["dim"] * 4
        assert list(r["engines"]) == [kb.BAGS, *kb.OURS, kb.GATHER, kb.POOLED]
        for name, e in r["engines"].items():
            assert len(e["forward_ms_rounds"]) == len(e["step_ms_rounds"]) == 2
            assert e["forward_ms"] == statistics.median(e["forward_ms_rounds"]) > 0
            assert e["forward_gbs"] == pytest.approx(r["forward_bytes"] / e["forward_ms"] / 1e6)
            steps = name in (kb.BAGS, *kb.OURS)  # the ceilings only read
            assert (e["step_gbs"] is not None) == steps
            assert (e["hit_rate"] is not None) == (name in kb.OURS)
            # the profiler's counts are the device's: none on the CPU
            assert e["syncs"] is e["launches"] is e["device_ms"] is e["kernel_share"] is None
    targets = result["targets"]
    # rows per engine of ours: FBGEMM's shape 3 (gather, 500 and 978 GB/s), the others 2
    assert len(targets) == 2 * 3 + 4 * 2 * 2
    for t in targets:
        e = result["runs"][t["run"]]["engines"]
        ours = e[t["engine"]]
        assert t["engine"] in kb.OURS and t["hit_rate"] == ours["hit_rate"]
        assert t["ratio"] == statistics.median(t["ratio_rounds"])
        assert t["met"] == (t["ratio"] >= t["goal"])
        if t["compared_with"] == kb.GATHER:
            assert t["goal"] == 0.6 and t["figure"] == ours["forward_gbs"]
            expected = [
                g / f for g, f in zip(e[kb.GATHER]["forward_ms_rounds"], ours["forward_ms_rounds"])
            ]
        elif t["compared_with"] == kb.BAGS:
            assert t["goal"] == 1.0 and t["figure"] == ours["step_ms"]
            expected = [b / o for b, o in zip(e[kb.BAGS]["step_ms_rounds"], ours["step_ms_rounds"])]
        else:
            assert t["run"].startswith("FBGEMM") and t["compared_value"] in (500, 978)
            nbytes = 3 * result["runs"][t["run"]]["forward_bytes"]
            expected = [nbytes / ms / 1e6 / t["compared_value"] for ms in ours["step_ms_rounds"]]
        assert t["ratio_rounds"] == pytest.approx(expected)
    md = (tmp_path / "kernel_bench.md").read_text().splitlines()
    table = md.index("## Issue 50's targets")
    assert len([line for line in md[table:] if line.startswith("| ") and " | 0.6 | " in line]) == 10


def test_every_engine_gets_the_same_memory_footing():
    """same_memory_footing asks for huge pages through torch's allocator and has glibc keep
    freed memory, each unless its variable says 0; run in a child, whose malloc it changes."""
    code = (
        "import json, os, sys; sys.path.insert(0, 'bench'); import _common; "
        "f = _common.same_memory_footing(); "
        "print(json.dumps([f, os.environ.get('THP_MEM_ALLOC_ENABLE')]))"
    )

    def footing(**env):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return json.loads(out)

    glibc = platform.libc_ver()[0] == "glibc"
    assert footing() == [{"huge_pages": True, "keep_freed_memory": glibc}, "1"]
    off = {"EMBCACHE_HUGE_PAGES": "0", "EMBCACHE_KEEP_FREED_MEMORY": "0"}
    assert footing(**off) == [{"huge_pages": False, "keep_freed_memory": False}, None]


def test_progress_bars_are_quiet_off_a_terminal(capsys):
    """Benchmarks' progress bars (tqdm) draw on a terminal only: a log or CI keeps none."""
    assert list(_common.progress(range(3), desc="steps")) == [0, 1, 2]
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_bandwidth_refuses_hit_rates_given_in_percent():
    """`--hit-rates 0,90` (percent, not fractions) is refused in one line naming the option,
    before any table is made."""
    done = subprocess.run(
        [sys.executable, "bench/bandwidth.py", "--hit-rates", "0,90", "--dims", "16"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--hit-rates: 0,90 are not all fractions in [0, 1]" in done.stderr


def test_huge_page_share_of_a_tensor():
    """The share of a tensor's bytes on transparent huge pages, from /proc/self/smaps: a
    fraction for a CPU tensor (how much depends on the kernel's supply), None for no bytes."""
    import torch

    big = torch.ones(8 << 20, dtype=torch.uint8)  # touched: its pages exist
    share = _common.huge_page_share(big)
    assert share is None or 0.0 <= share <= 1.0
    if sys.platform.startswith("linux"):
        assert share is not None
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.exists() and "[madvise]" in mode.read_text():
        assert share == 0.0  # torch's own allocation asks for none
        from embcache.embedding import _state_tensor  # asks for them (madvise)

        advised = _state_tensor((64 << 20,), torch.uint8).fill_(1)
        also = _common.huge_page_share(advised)
        assert also is not None and 0.0 <= also <= 1.0
    assert _common.huge_page_share(torch.empty(0)) is None
