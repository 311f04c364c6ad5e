"""``dlrm report RUN_DIR``: one PNG of a finished or running run, from its history
(:mod:`dlrm.monitor`): loss and validation AUC against steps, the loss scale with the
intervals that skipped steps marked, each cached table's hit rate over time, and each
table's memory against its FP32 size."""

from __future__ import annotations

from pathlib import Path

from dlrm import run_dir
from dlrm.errors import RunError
from dlrm.monitor import HISTORY, read_history


def render(out_dir: Path, png: Path | None = None) -> Path:
    """Draw the run in ``out_dir`` into ``png`` (default ``out_dir/report.png``, written
    atomically); its path. RunError if the run has no history yet."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or used
    import matplotlib.pyplot as plt

    if not (out_dir / HISTORY).exists():
        raise RunError(f"{out_dir / HISTORY}: missing (not a run directory, or nothing yet)")
    records = read_history(out_dir)
    tables = records[0].get("tables", {}) if records else {}
    intervals = [r for r in records if "loss" in r]
    evals = [r for r in records if "val" in r]
    if not intervals:
        raise RunError(f"{out_dir / HISTORY}: no interval yet (it is written every --log-every)")
    steps = [r["step"] for r in intervals]

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (loss_ax, scale_ax), (hit_ax, memory_ax) = axes
    fig.suptitle(f"dlrm run {out_dir.resolve().name}: {steps[-1]} steps")

    loss_ax.plot(steps, [r["loss"] for r in intervals], color="tab:blue", label="train loss")
    loss_ax.set(xlabel="step", ylabel="loss (mean over the interval)", title="loss and AUC")
    auc = [(r["step"], r["val"]["auc"]) for r in evals if r["val"].get("auc") is not None]
    if auc:
        auc_ax = loss_ax.twinx()
        auc_ax.plot(*zip(*auc), "o-", color="tab:orange", label="validation AUC")
        auc_ax.set_ylabel("validation AUC")
        auc_ax.legend(loc="upper right")
    loss_ax.legend(loc="upper left")

    scale_ax.step(steps, [r["scale"] for r in intervals], where="post", color="tab:green")
    skipped = [(r["step"], r["scale"], r["skipped"]) for r in intervals if r["skipped"]]
    if skipped:
        s, y, n = zip(*skipped)
        scale_ax.scatter(
            s,
            y,
            s=[20 + 10 * k for k in n],
            color="tab:red",
            zorder=3,
            label="intervals with skipped steps (size: how many)",
        )
        scale_ax.legend(loc="lower right")
    scale_ax.set(xlabel="step", ylabel="loss scale", yscale="log", title="loss scale")

    cached = [name for name, t in tables.items() if t["cache_slots"] > 0]
    for name in cached:
        hit_ax.plot(
            steps,
            [r["tables"].get(name, {}).get("hit_rate", 0.0) for r in intervals],
            label=name,
            linewidth=1,
        )
    hit_ax.set(
        xlabel="step",
        ylabel="hit rate of the interval",
        ylim=(0, 1),
        title="cache hit rate per table",
    )
    if cached:
        hit_ax.legend(fontsize="x-small", ncol=2)

    names = list(tables)
    rows = range(len(names))
    memory_ax.barh(
        [i + 0.2 for i in rows],
        [tables[n]["fp32_bytes"] for n in names],
        height=0.4,
        color="lightgray",
        label="FP32 table",
    )
    memory_ax.barh(
        [i - 0.2 for i in rows],
        [tables[n]["memory_bytes"] for n in names],
        height=0.4,
        color="tab:purple",
        label="ours",
    )
    memory_ax.set_yticks(
        list(rows), [f"{n} ({tables[n]['precision']})" for n in names], fontsize="x-small"
    )
    memory_ax.set(xscale="log", xlabel="bytes", title="memory per table")
    memory_ax.invert_yaxis()
    memory_ax.legend(loc="lower right")

    fig.tight_layout()
    png = png or out_dir / "report.png"
    run_dir.write_atomically(png, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
    return png
