"""Watching a run (dlrm.monitor, dlrm.plots): history.jsonl, TensorBoard event files, log
lines when piped, and `dlrm report`'s PNG. The oracle for the per-interval figures is the
run's own report: the intervals' counts add up to each table's totals, the intervals'
skipped steps to the run's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from matplotlib.colors import to_hex
from test_train import SMALL

from dlrm.cli import main
from dlrm.monitor import read_history
from dlrm.plots import draw
from embcache.telemetry import PROBE_COUNTERS


def _train(out, *extra) -> int:
    return main(["train", "--out", str(out), *SMALL, "--log-every", "5", *extra])


def _intervals(out) -> list[dict]:
    return [r for r in read_history(out) if "loss" in r]


def test_history_and_tensorboard_add_up_to_the_report(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tb = tmp_path / "run", tmp_path / "tb"
    assert _train(out, "--steps", "20", "--tensorboard", str(tb)) == 0
    report = json.loads((out / "report.json").read_text())
    records = read_history(out)
    intervals = _intervals(out)
    assert [r["step"] for r in intervals] == [5, 10, 15, 20]
    assert [r["step"] for r in records if "val" in r] == [e["step"] for e in report["evals"]]
    assert sum(r["skipped"] for r in intervals) == report["skipped_steps"]
    for name, table in report["embeddings"]["tables"].items():
        lookups = sum(r["tables"][name]["lookups"] for r in intervals)
        hits = sum(r["tables"][name]["hits"] for r in intervals)
        assert table["hit_rate"] == (hits / lookups if lookups else 0.0), name
        assert records[0]["tables"][name]["memory_bytes"] == table["memory_bytes"]

    events = EventAccumulator(str(tb))
    events.Reload()
    for tag, key in (("train/loss", "loss"), ("train/loss_scale", "scale")):
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in intervals]
    assert [e.step for e in events.Scalars("val/auc")] == [e["step"] for e in report["evals"]]
    cached = [n for n, t in report["embeddings"]["tables"].items() if t["cache_slots"]]
    assert cached
    for key in ("hit_rate", "rounding_error_mean", "rounded_up_share", "untouched_share"):
        logged = [e.value for e in events.Scalars(f"tables/{cached[0]}/{key}")]
        assert logged == [pytest.approx(r["tables"][cached[0]][key], rel=1e-6) for r in intervals]


def test_precision_telemetry_adds_up_and_rounds_stochastically(tmp_path):
    """The report's per-table precision telemetry is its intervals' probes summed; the
    stochastic rounding's share of elements rounded up is the expected one within 5 standard
    errors; integer codes err less than one code step; the share of rows never updated
    shrinks."""
    out = tmp_path / "run"
    assert _train(out, "--steps", "20") == 0
    report = json.loads((out / "report.json").read_text())
    intervals = _intervals(out)
    low = {n: t for n, t in report["embeddings"]["tables"].items() if t["precision"] != "fp32"}
    assert low
    for name, table in low.items():
        total = {k: sum(r["tables"][name][k] for r in intervals) for k in PROBE_COUNTERS}
        assert total["probed_rows"] > 0, name
        moved = total["probed_up"] + total["probed_down"]
        assert table["rounding_error_mean"] == pytest.approx(
            total["probed_error_sum_e9"] / 1e9 / total["probed_rows"]
        )
        assert table["rounded_up_share"] == pytest.approx(total["probed_up"] / moved)
        assert 0 < table["rounding_error_mean"] <= table["rounding_error_max"]
        if table["precision"] != "fp16":  # integer codes: within one code step of the range
            assert table["rounding_error_max"] <= 1 / (2 ** int(table["precision"][3:]) - 1)
        expected = table["expected_up_share"]
        assert abs(table["rounded_up_share"] - expected) < 5 * (0.25 / moved) ** 0.5, name
        shares = [r["tables"][name]["untouched_share"] for r in intervals]
        assert shares == sorted(shares, reverse=True) and 0 <= shares[-1] < 1, name


def test_a_resumed_run_continues_its_history(tmp_path):
    out = tmp_path / "run"
    assert _train(out, "--steps", "20", "--stop-after", "12", "--checkpoint-every", "6") == 0
    assert [r["step"] for r in _intervals(out)] == [5, 10, 12]  # 12: where it stopped
    assert _train(out, "--steps", "20", "--resume") == 0
    assert [r["step"] for r in _intervals(out)] == [5, 10, 12, 15, 20]
    assert len([r for r in read_history(out) if "tables" in r and "step" not in r]) == 1


def test_a_piped_run_logs_lines_not_a_progress_bar(tmp_path):
    argv = [a for a in SMALL if a != "--no-progress"]
    cmd = [sys.executable, "-m", "dlrm.cli", "train", "--out", str(tmp_path / "run"), *argv]
    done = subprocess.run(
        [*cmd, "--steps", "10", "--log-every", "5"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "\r" not in done.stdout
    lines = [line for line in done.stderr.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines if "loss" in line] == ["step 5", "step 10"]


def test_report_draws_a_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["report", str(out)]) == 2  # nothing there yet: one line
    assert "history.jsonl" in capsys.readouterr().err
    assert _train(out, "--steps", "10") == 0
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    png = out / "report.png"
    assert capsys.readouterr().out.strip() == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1300, 850)  # the four panels, at 100 dpi


def test_a_diverging_run_records_the_scale_after_each_interval_and_its_last_steps(tmp_path):
    """Steps overflow (SGD at lr 6) until the run diverges: each interval's loss scale is the
    one after its last step (the report's trace there), a mean loss that is not finite is
    null, and the last interval ends at the run's last step; the report draws it."""
    out = tmp_path / "run"
    args = ["--steps", "300", "--lr", "6", "--optimizer", "sgd", "--batch-size", "64"]
    assert _train(out, *args, "--eval-every", "0") == 1
    report = json.loads((out / "report.json").read_text())
    trace = report["loss_scale"]["trace"]  # [s, the scale after step s]
    intervals = _intervals(out)
    for r in intervals:
        assert r["scale"] == [scale for s, scale in trace if s <= r["step"]][-1], r["step"]
    assert len({r["scale"] for r in intervals}) > 1  # the scale fell, a test of the above
    assert intervals[-1]["step"] == report["steps"] == report["diverged"]["step"]
    assert intervals[-1]["loss"] is None and intervals[0]["loss"] is not None
    assert main(["report", str(out)]) == 0


def test_a_run_shorter_than_the_interval_is_logged_and_drawn(tmp_path, capsys):
    """3 steps at --log-every 5: the history ends with an interval of all 3, a piped run prints
    its line, and the report draws it, with markers, to that step and the run's final loss
    scale."""
    out = tmp_path / "run"
    argv = [a for a in SMALL if a != "--no-progress"]  # stderr is not a terminal: lines
    assert main(["train", "--out", str(out), *argv, "--steps", "3", "--log-every", "5"]) == 0
    report = json.loads((out / "report.json").read_text())
    (interval,) = _intervals(out)
    assert interval["step"] == report["steps"] == 3
    assert interval["scale"] == report["loss_scale"]["final"]
    assert interval["skipped"] == report["skipped_steps"]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 3"]
    assert main(["report", str(out)]) == 0

    fig = draw(read_history(out), "run")
    assert fig.get_suptitle() == "dlrm run run: 3 steps"
    (scale,) = _panel(fig, "loss scale").get_lines()
    assert (scale.get_xdata()[-1], scale.get_ydata()[-1]) == (3, report["loss_scale"]["final"])
    lines = [line for ax in fig.axes for line in ax.get_lines()]
    assert lines and all(line.get_marker() == "o" for line in lines)  # a lone point shows


def _history(tables: int, steps: list[int]) -> list[dict]:
    """A history (as read_history gives it) of ``tables`` cached tables, an interval at each
    of ``steps``, the loss scale doubling at each, and a validation at the last."""
    names = [f"t_{i}" for i in range(tables)]
    described = {"precision": "int8", "cache_slots": 8, "memory_bytes": 100, "fp32_bytes": 400}
    records = [{"tables": {n: described for n in names}}]
    for k, step in enumerate(steps):
        figures = {n: {"hit_rate": (i + k) / (tables + len(steps))} for i, n in enumerate(names)}
        records.append(
            {"step": step, "loss": 0.5, "scale": 2.0**k, "skipped": k % 2, "tables": figures}
        )
    return [*records, {"step": steps[-1], "val": {"auc": 0.7}}]


def _panel(fig, title: str):
    (ax,) = [ax for ax in fig.axes if ax.get_title(loc="left") == title]
    return ax


def test_report_draws_every_interval_and_tells_26_tables_apart(tmp_path):
    """The traces reach the last interval (a short one after 10000); the 26 tables' hit-rate
    lines each have their own colour; no legend covers a panel."""
    steps = [*range(1000, 10001, 1000), 10044]
    fig = draw(_history(26, steps), "run")
    fig.draw_without_rendering()  # lays the figure out
    assert fig.get_suptitle() == "dlrm run run: 10044 steps"
    (scale,) = _panel(fig, "loss scale").get_lines()
    assert list(scale.get_xdata()) == steps and scale.get_ydata()[-1] == 2.0**10
    lines = _panel(fig, "cache hit rate per table").get_lines()
    assert [line.get_label() for line in lines] == [f"t_{i}" for i in range(26)]
    assert all(list(line.get_xdata()) == steps for line in lines)
    assert len({to_hex(line.get_color()) for line in lines}) == 26
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 4  # loss and AUC, skipped steps, hit rates, memory
    for legend in legends:
        box = legend.get_window_extent()
        assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes), legend
