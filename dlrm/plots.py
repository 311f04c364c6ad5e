"""``dlrm report RUN_DIR``: one PNG of a finished or running run, from its history
(:mod:`dlrm.monitor`): loss and validation AUC against steps, the loss scale with the
intervals that skipped steps marked, each cached table's hit rate over time, and each
table's memory against its FP32 size."""

from __future__ import annotations

from pathlib import Path

from dlrm import run_dir
from dlrm.errors import RunError
from dlrm.monitor import HISTORY, read_history

# a hit-rate line's dash, cycled so that lines of neighbouring colours differ in it too
_DASHES = ("-", "--", ":")


def render(out_dir: Path, png: Path | None = None) -> Path:
    """Draw the run in ``out_dir`` into ``png`` (default ``out_dir/report.png``, written
    atomically); its path. RunError if the run has no history yet."""
    if not (out_dir / HISTORY).exists():
        raise RunError(f"{out_dir / HISTORY}: missing (not a run directory, or nothing yet)")
    records = read_history(out_dir)
    if not any("loss" in r for r in records):
        raise RunError(f"{out_dir / HISTORY}: no interval yet (it is written every --log-every)")
    fig = draw(records, out_dir.resolve().name)
    png = png or out_dir / "report.png"
    run_dir.write_atomically(png, lambda p: fig.savefig(p, format="png", dpi=100))
    return png


def draw(records: list[dict], name: str):
    """The report's matplotlib Figure (13 x 8.5 in, four panels) of a run's history
    (:func:`dlrm.monitor.read_history`, with at least one interval), titled with the run's
    ``name`` and its last step. Each trace reaches the history's last interval; each legend
    is outside its panel."""
    import matplotlib
    from matplotlib.figure import Figure

    tables = records[0].get("tables", {})
    intervals = [r for r in records if "loss" in r]
    evals = [r for r in records if "val" in r]
    steps = [r["step"] for r in intervals]
    lone = "o" if len(steps) == 1 else None  # a marker, or a lone interval's lines are unseen

    fig = Figure(figsize=(13, 8.5), layout="constrained")
    (loss_ax, scale_ax), (hit_ax, memory_ax) = fig.subplots(2, 2)
    last = max(r["step"] for r in [*intervals, *evals])
    fig.suptitle(f"dlrm run {name}: {last} steps")

    loss = [r["loss"] for r in intervals]
    handles = loss_ax.plot(steps, loss, marker=lone, color="tab:blue", label="train loss")
    loss_ax.set(xlabel="step", ylabel="loss (mean over the interval)")
    loss_ax.set_title("loss and AUC", loc="left")
    auc = [(r["step"], r["val"]["auc"]) for r in evals if r["val"].get("auc") is not None]
    if auc:
        auc_ax = loss_ax.twinx()
        handles += auc_ax.plot(*zip(*auc), "o-", color="tab:orange", label="validation AUC")
        auc_ax.set_ylabel("validation AUC")
    _legend_above(loss_ax, handles)

    scale = [r["scale"] for r in intervals]
    scale_ax.step(steps, scale, where="post", marker=lone, color="tab:green")
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
        _legend_above(scale_ax, scale_ax.collections)
    scale_ax.set(xlabel="step", ylabel="loss scale", yscale="log")
    scale_ax.set_title("loss scale", loc="left")

    cached = [name for name, t in tables.items() if t["cache_slots"] > 0]
    colors = matplotlib.colormaps["turbo"].resampled(max(len(cached), 1))
    for i, table in enumerate(cached):
        hit_ax.plot(
            steps,
            [r["tables"].get(table, {}).get("hit_rate", 0.0) for r in intervals],
            label=table,
            color=colors(i),
            linestyle=_DASHES[i % len(_DASHES)],
            marker=lone,
            linewidth=1,
        )
    hit_ax.set(xlabel="step", ylabel="hit rate of the interval", ylim=(0, 1))
    hit_ax.set_title("cache hit rate per table", loc="left")
    if cached:
        hit_ax.legend(
            loc="upper left",
            bbox_to_anchor=(1.01, 1),
            borderaxespad=0,
            fontsize="x-small",
            ncol=2 if len(cached) > 13 else 1,
        )

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
    memory_ax.set(xscale="log", xlabel="bytes")
    memory_ax.set_title("memory per table", loc="left")
    memory_ax.invert_yaxis()
    _legend_above(memory_ax, memory_ax.containers)
    return fig


def _legend_above(ax, handles) -> None:
    """A legend of ``handles`` above ``ax``, right of its title (which is on the left)."""
    ax.legend(
        handles=list(handles),
        loc="lower right",
        bbox_to_anchor=(1, 1),
        borderaxespad=0.2,
        ncol=len(handles),
        fontsize="small",
        frameon=False,
    )
