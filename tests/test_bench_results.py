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


def _strict(path: Path) -> dict:
    def refuse(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_placement_rehearsal_reports_every_engine_its_host_bytes_and_issue_51s_targets(tmp_path):
    """bench/bandwidth.py --placement host (bench/host_placement.py) at its CPU rehearsal size:
    a rehearsal (the host tables built on the device), every engine at every target hit rate,
    the host bytes a step by the module's rule, and issue 51 item 4's targets as figure,
    compared figure and the median of per-round ratios."""
    import host_placement as hp

    argv = ["--device", "cpu", "--placement", "host", "--quick", "--out", str(tmp_path)]
    _run("bandwidth.py", argv, tmp_path / "placement.json")
    result = _strict(tmp_path / "placement.json")
    assert result["rehearsal"] is True and result["rounds"] == result["steps"] == 2
    assert result["hit_rates"] == [0.0, 0.5, 0.9, 0.95, 0.99, 1.0]
    (name, run), *others = result["runs"].items()
    assert not others and name == "dim 128, int8 + 5% 32-way LFU cache"
    assert (run["rows"], run["bags"], run["pooling"]) == (20_000, 64, 4)
    assert run["lookups"] == 256 and set(run["build_seconds"]) == set(hp.ENGINES)
    row_bytes = 128 + 4  # INT8 codes and FP16 scale and bias
    assert [pt["target"] for pt in run["points"]] == result["hit_rates"]
    for pt in run["points"]:
        e = pt["engines"]
        assert list(e) == list(hp.ENGINES)
        assert [e[n]["placement"] for n in hp.ENGINES] == ["host", "host", "host", "device"]
        assert {e[n]["placement_used"] for n in hp.ENGINES} == {"device"}
        # the three cached tables are one table: same ids, same hits (prefetch changes nothing)
        cached = (hp.HOST_CACHED, hp.HOST_PREFETCH, hp.DEVICE_CACHED)
        assert len({e[n]["hit_rate"] for n in cached}) == 1
        staged, plain = e[hp.HOST_PREFETCH]["host_bytes"], e[hp.HOST_CACHED]["host_bytes"]
        assert staged["update_write"] == plain["update_write"]  # a row read once, ahead:
        assert staged["forward_read"] + staged["update_read"] <= plain["forward_read"]
        assert abs(e[hp.HOST_CACHED]["hit_rate"] - pt["target"]) <= 0.05, pt
        assert e[hp.HOST_UNCACHED]["hit_rate"] == 0.0
        for n, x in e.items():
            assert len(x["forward_ms_rounds"]) == len(x["step_ms_rounds"]) == 2
            assert x["step_ms"] == statistics.median(x["step_ms_rounds"]) > 0
            assert x["forward_lookups_per_s"] == pytest.approx(256 / x["forward_ms"] * 1e3)
            b = x["host_bytes"]
            parts = b["forward_read"] + b["update_read"] + b["update_write"]
            assert b["total"] == pytest.approx(parts)
            assert x["pcie_bytes"] == (b["total"] if n != hp.DEVICE_CACHED else 0.0)
        # without a cache every lookup reads its row, every updated row is read and written
        b = e[hp.HOST_UNCACHED]["host_bytes"]
        assert b["forward_read"] == 256 * row_bytes
        timed = result["rounds"] * result["steps"]  # a step's bytes: the mean over these
        assert b["update_read"] == b["update_write"] and b["update_read"] * timed % row_bytes == 0
        if pt["target"] == 1.0:  # all hits, SGD: nothing in host memory is read or written
            assert e[hp.HOST_CACHED]["host_bytes"]["total"] == 0
    targets = result["targets"]
    assert [(t["hit_rate_target"], t["engine"], t["phase"]) for t in targets] == [
        (at, engine, phase)
        for at in (0.95, 1.0)
        for engine in (hp.HOST_CACHED, hp.HOST_PREFETCH)
        for phase in ("forward", "step")
    ]
    points = {pt["target"]: pt["engines"] for pt in run["points"]}
    for t in targets:
        versus = hp.HOST_UNCACHED if t["hit_rate_target"] == 0.95 else hp.DEVICE_CACHED
        assert t["compared_with"] == versus and t["run"] == name
        assert (t["goal"], t["paper"]) == (
            (10.0, 25.8) if versus == hp.HOST_UNCACHED else (0.8, None)
        )
        e = points[t["hit_rate_target"]]
        ms = f"{t['phase']}_ms_rounds"
        expected = [a / b for a, b in zip(e[versus][ms], e[t["engine"]][ms])]
        assert t["ratio_rounds"] == pytest.approx(expected)
        assert t["ratio"] == statistics.median(t["ratio_rounds"])
        assert t["met"] == (t["ratio"] >= t["goal"])
        assert t["figure"] == e[t["engine"]][f"{t['phase']}_lookups_per_s"]
    md = (tmp_path / "placement.md").read_text().splitlines()
    assert md[2] == f"Command: `python bench/bandwidth.py {' '.join(argv)}`  "
    assert any(line.startswith("**Rehearsal**") for line in md)
    table = md.index("## Issue 51's targets")
    assert len([line for line in md[table:] if line.startswith("| host + cache / ")]) == 4
    assert (
        len([line for line in md[table:] if line.startswith("| host + cache + prefetch / ")]) == 4
    )


def test_placement_mode_refuses_quick_without_it():
    done = subprocess.run(
        [sys.executable, "bench/bandwidth.py", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--quick is a size of --placement host" in done.stderr


def test_filled_table_has_the_same_rows_whatever_its_cache():
    """bench/_common.filled_table: the table's rows drawn in blocks (of 1,000 rows here),
    the same for the same seed with or without a cache, within the table's initial bound, and
    the table trains."""
    import torch

    a, seconds = _common.filled_table(5000, 16, "cpu", block_rows=1000, mode="sum")
    b, _ = _common.filled_table(5000, 16, "cpu", block_rows=1000, mode="sum", cache_ratio=0.0)
    assert set(seconds) == {"allocate", "move", "fill"}
    assert torch.equal(a.weights, b.weights) and a.weights.any()
    assert a.current_weight().abs().max() <= 5000**-0.5 * 1.01
    assert a.config.num_slots > 0 and b.config.num_slots == 0
    out = a(torch.arange(0, 4000, 2), torch.arange(0, 2000, 4))
    out.backward(torch.ones_like(out))
    a.step()
    assert a.stats()["steps"] == 1


def test_beyond_gpu_rows_and_its_zipf_stream(monkeypatch):
    """bench/beyond_gpu.py's default rows (FP32 just past the GPU's memory: 170M rows at dim 128
    on an 80 GB H100) and its id stream (in range, skewed as its law says)."""
    import torch

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)  # the script sets it on import
    import beyond_gpu as bg

    h100, h200 = 85_031_714_816, 150_121_545_728  # torch.cuda.mem_get_info()[1]
    assert bg.default_rows(h100, 128) == 170_000_000
    assert bg.default_rows(h200, 128) == 300_000_000
    assert bg.default_rows(10**9, 16) * 16 * 4 > 10**9
    z = bg.Zipf(100_003, 1.05, 200_000, torch.device("cpu"))
    ids = z.batch()
    assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 100_003
    counts = torch.bincount(ids, minlength=100_003).sort(descending=True).values
    top = counts[:5000].sum().item() / ids.numel()
    assert abs(top - z.top_share(5000)) < 0.02 and 0.5 < top < 1.0


def test_beyond_gpu_rehearsal_writes_its_figures(tmp_path):
    argv = ["--device", "cpu", "--quick", "--seconds", "1", "--window", "0.5"]
    argv += ["--out", str(tmp_path)]
    r = _run("beyond_gpu.py", argv, tmp_path / "beyond_gpu.json")
    assert _strict(tmp_path / "beyond_gpu.json") == r
    assert r["rehearsal"] is True and r["table"]["placement_used"] == "device"
    assert r["prefetch"] is True  # as dlrm train trains: the next batch prefetched
    assert r["table"]["rows"] == 200_000 and r["table"]["cache_slots"] == 9984
    assert r["steps"] == sum(w["steps"] for w in r["windows"]) > 0
    assert r["samples_per_s"] == pytest.approx(r["steps"] * r["bags"] / r["seconds"])
    assert 0.0 < r["hit_rate"] <= r["top_rows_share"] + 0.02
    assert r["last_window"] == r["windows"][-1]
    assert set(r["build_seconds"]) == {"allocate", "move", "fill"}
    m = r["memory"]
    assert m["table"]["total"] == m["table"]["device"] > 0 and m["table"]["host"] == 0
    assert m["fp32_bytes"] == 200_000 * 128 * 4
    assert "pinned_max_round_threshold_mb:1024" in m["alloc_conf"]
    md = (tmp_path / "beyond_gpu.md").read_text()
    assert "samples/s, hit rate" in md and "**Rehearsal**" in md
