"""bench/sweep.py: a tiny grid writes its rows and renderings, re-running redoes nothing, and the
relative accuracy drop is computed against the FP32 run of the same seed."""

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import sweep  # noqa: E402

TINY = [
    "--synthetic-scale",
    "0.001",
    "--synthetic-rows",
    "20000",
    "--batch-size",
    "256",
    "--steps",
    "5",
    "--precision",
    "int8",
    "--rounding",
    "stochastic",
    "--cache",
    "0",
    "5",
]


def _reports(runs: Path) -> dict:
    return {p.parent.name: p.stat().st_mtime_ns for p in runs.glob("*/report.json")}


def test_tiny_sweep_resumes_without_redoing_runs(tmp_path, capsys):
    out, runs = tmp_path / "sweep", tmp_path / "runs"
    tiny = [*TINY, "--out", str(out), "--runs", str(runs)]
    assert sweep.main([*tiny, "--seeds", "0", "--jobs", "2"]) == 0
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert sorted(r["name"] for r in rows) == [
        "fp32-s0",
        "int8-stochastic-c0-s0",
        "int8-stochastic-c5-lfu32-s0",
    ]
    assert all(r["steps"] == 5 and 0 < r["accuracy"] < 1 for r in rows)
    by_name = {r["name"]: r for r in rows}
    assert (
        by_name["fp32-s0"]["compression_factor"] == 1.0 and by_name["fp32-s0"]["hit_rate"] is None
    )
    assert by_name["int8-stochastic-c5-lfu32-s0"]["hit_rate"] > 0
    for name in ("sweep.md", "figure7.png", "figure2.png", "runs.csv"):
        assert (out / name).stat().st_size > 0
    md = (out / "sweep.md").read_text()
    assert "Table 2" in md and "Table 3" in md and "Table 11" in md
    assert len(pd.read_csv(out / "runs.csv")) == 3
    settings = json.loads((out / "sweep.json").read_text())
    assert settings["settings"]["steps"] == 5 and settings["environment"]["threads"] == 1
    assert settings["environment"]["command"].startswith(
        "python bench/sweep.py --synthetic-scale 0.001"
    )
    assert all(r["commit"] == settings["environment"]["commit"] for r in rows)
    assert md.startswith("# Accuracy and memory sweep\n\nCommand: `python bench/sweep.py ")

    before = _reports(runs)
    assert sweep.main([*tiny, "--seeds", "0"]) == 0  # nothing to redo
    assert _reports(runs) == before and len((out / "runs.jsonl").read_text().splitlines()) == 3
    assert sweep.main([*tiny, "--seeds", "0", "1"]) == 0  # only seed 1 is new
    after = _reports(runs)
    assert {k: after[k] for k in before} == before and len(after) == 6

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:  # the shared settings of a sweep cannot change
        sweep.main([*tiny, "--steps", "6"])
    assert exit.value.code == 2  # argparse's usage error
    assert "is a sweep with other shared settings" in capsys.readouterr().err


def test_relative_drop_by_hand():
    base = {
        "rounding": "stochastic",
        "cache": 0.0,
        "policy": None,
        "ways": None,
        "auc": 0.7,
        "compression_factor": 0.5,
        "hit_rate": None,
    }
    rows = pd.DataFrame(
        [
            {
                **base,
                "precision": "fp32",
                "rounding": None,
                "seed": 0,
                "accuracy": 0.80,
                "compression_factor": 1.0,
            },
            {
                **base,
                "precision": "fp32",
                "rounding": None,
                "seed": 1,
                "accuracy": 0.50,
                "compression_factor": 1.0,
            },
            {
                **base,
                "precision": "int8",
                "seed": 0,
                "accuracy": 0.79,
            },  # (0.80 - 0.79) / 0.80 = 1.25 %
            {
                **base,
                "precision": "int8",
                "seed": 1,
                "accuracy": 0.5005,
            },  # (0.50 - 0.5005) / 0.50 = -0.1 %
            {**base, "precision": "int4", "seed": 0, "accuracy": 0.79992},  # 0.01 %: neutral
        ]
    ).astype({"ways": "Int64"})
    assert sweep.relative_drop(rows).tolist() == pytest.approx([0, 0, 1.25, -0.1, 0.01])
    s = sweep.summarize(rows).set_index("precision")
    assert s.loc["int8", "drop"] == pytest.approx(0.575)
    assert s.loc["int8", "drop_std"] == pytest.approx(1.35 / 2**0.5)  # sample std of 1.25, -0.1
    assert s.loc["int8", "seeds"] == 2 and pd.isna(s.loc["int4", "drop_std"])
    assert sweep.cell(0.575, 1.35 / 2**0.5) == "0.575 ± 0.955"
    assert sweep.cell(0.01, float("nan")) == "**0.010**"  # neutral: below 0.02 %
    md = sweep.render(
        rows,
        {
            "data": "synthetic",
            "synthetic_rows": 1,
            "synthetic_scale": 1,
            "steps": 5,
            "batch_size": 2,
            "preset": "kaggle",
        },
    )
    assert "| stochastic | 0.575 ± 0.955 | **0.010** |" in md
    # the paper's setting at the rows' qparams (FP32: they have none): contract.md §5
    assert "| no cache | 1.0000 | 0.2656 | 0.1406 |" in md


def test_planned_runs_fit_their_budget_and_are_compared_with_uniform_ones(tmp_path):
    out, runs = tmp_path / "sweep", tmp_path / "runs"
    tiny = [*TINY[:-1], "--out", str(out), "--runs", str(runs), "--seeds", "0"]
    assert sweep.main([*tiny, "--budget", "0.5", "0.3"]) == 0
    rows = {r["name"]: r for r in map(json.loads, (out / "runs.jsonl").read_text().splitlines())}
    assert sorted(rows) == [
        "fp32-s0",
        "int8-stochastic-c0-s0",
        "planned0.3-stochastic-s0",
        "planned0.5-stochastic-s0",
    ]
    report = json.loads((runs / "planned0.3-stochastic-s0" / "report.json").read_text())
    for budget in (0.5, 0.3):
        row = rows[f"planned{budget:g}-stochastic-s0"]
        assert row["budget"] == budget and 0 < row["compression_factor"] <= budget
        assert len(row["plan"]) == 26 and row["proxy"] >= 0
    assert report["plan"]["total_bytes"] <= 0.3 * report["plan"]["fp32_bytes"]
    assert [f"{t['name']} {t['precision']}" for t in report["plan"]["tables"]] == [
        p.split(" + ")[0] for p in rows["planned0.3-stochastic-s0"]["plan"]
    ]
    md = (out / "sweep.md").read_text()
    assert "## Planned to a memory budget" in md
    chose = next(x for x in md.splitlines() if x.startswith("- 0.3 (seed 0, proxy "))
    plan = rows["planned0.3-stochastic-s0"]["plan"]
    assert f"fp32 {sum(t.split()[1] == 'fp32' for t in plan)}" in chose
    # uniform int8 without cache takes ~0.41 of FP32: within 0.5's memory, not within 0.3's
    assert "| stochastic | 0.5 |" in md and "| stochastic | 0.3 |" in md
    line = next(x for x in md.splitlines() if x.startswith("| stochastic | 0.5 |"))
    assert "int8 no cache" in line
    line = next(x for x in md.splitlines() if x.startswith("| stochastic | 0.3 |"))
    assert line.rstrip().endswith("| – | – |")


def test_budget_outside_zero_one_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        sweep.main([*TINY, "--out", str(tmp_path), "--budget", "25"])
    assert exit.value.code == 2
    assert "--budget: a fraction" in capsys.readouterr().err


def test_fp16_qparams_runs_are_their_own_configuration(tmp_path):
    out, runs = tmp_path / "sweep", tmp_path / "runs"
    tiny = [*TINY[:-1], "--out", str(out), "--runs", str(runs), "--seeds", "0"]
    assert sweep.main([*tiny, "--qparams", "fp32", "fp16"]) == 0
    rows = {r["name"]: r for r in map(json.loads, (out / "runs.jsonl").read_text().splitlines())}
    assert sorted(rows) == ["fp32-s0", "int8-stochastic-c0-qp16-s0", "int8-stochastic-c0-s0"]
    half, full = rows["int8-stochastic-c0-qp16-s0"], rows["int8-stochastic-c0-s0"]
    assert half["qparams"] == "fp16" and full["qparams"] == "fp32"
    assert half["compression_factor"] < full["compression_factor"]
    md = (out / "sweep.md").read_text()
    table2 = md.split("## Without cache")[1].split("##")[0]
    assert table2.count("| stochastic |") == 1  # the paper's tables: FP32 qparams only
    assert "| int8 | stochastic | no cache | fp16 |" in md


def test_rows_of_older_sweeps_count_as_fp32_qparams_beside_newer_ones():
    """Rows written before the qparams axis have none: beside fp16 rows they are FP32's."""
    base = {"rounding": "stochastic", "cache": 0.0, "policy": None, "ways": None, "auc": 0.7}
    rows = pd.DataFrame(
        [
            {**base, "precision": "fp32", "rounding": None, "seed": 0, "accuracy": 0.8},
            {**base, "precision": "int8", "seed": 0, "accuracy": 0.79, "compression_factor": 0.5},
            {
                **base,
                "precision": "int8",
                "seed": 0,
                "accuracy": 0.78,
                "compression_factor": 0.4,
                "qparams": "fp16",
            },
        ]
    ).astype({"ways": "Int64"})
    s = sweep.summarize(rows.assign(hit_rate=None, compression_factor=[1.0, 0.5, 0.4]))
    int8 = s[s.precision == "int8"].set_index("qparams")
    assert sorted(int8.index) == ["fp16", "fp32"]
    assert int8.loc["fp32", "drop"] == pytest.approx(1.25)
    assert int8.loc["fp16", "drop"] == pytest.approx(2.5)
