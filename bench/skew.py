"""Access skew of each embedding table (the paper's Figure 3): how much of a table's traffic its
hottest rows take.

What it measures: per table (at least --min-rows rows, the tables with a cache in training),
the access count of every row over the source (a data directory's --split, the training split
by default; one id per sample per table), rows sorted by count descending, and the cumulative
share of all accesses taken by the hottest fraction f of the table's rows (f of its
cardinality, rounded up to whole rows; rows never accessed count as 0). The order of the
accesses does not matter here.

    python bench/skew.py                                 # dlrm train's synthetic data
    python bench/skew.py --data runs/data/kaggle         # a preprocessed Criteo directory
    python bench/skew.py --data trace.npy --fractions 0.01 0.1

Writes --out/skew.md (also printed; columns: share of accesses of the hottest fractions),
skew.json and skew.png (cumulative share against fraction of rows, log x, one curve per table).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from _common import (
    add_source_args,
    cached_tables,
    environment,
    environment_markdown,
    load_source,
    markdown_table,
    parser,
    progress,
    save_figure,
    small_tables_note,
    write_text,
)

CURVE_POINTS = 400  # log-spaced points per curve in skew.json / skew.png


def access_counts(ids: np.ndarray, tables: list[int], cards: list[int]) -> list[np.ndarray]:
    """Per table in ``tables``: int64 [cardinality] accesses of each row (read in chunks)."""
    counts = [np.zeros(cards[t], np.int64) for t in tables]
    chunk = 1 << 20
    for lo in progress(range(0, len(ids), chunk), desc="count", unit="chunk", leave=False):
        block = np.asarray(ids[lo : lo + chunk])
        for c, t in zip(counts, tables):
            c += np.bincount(block[:, t], minlength=len(c))
    return counts


def cumulative_share(counts: np.ndarray) -> np.ndarray:
    """float64 [rows + 1]: share of accesses of the k hottest rows, k = 0..rows."""
    desc = np.sort(counts)[::-1]
    return np.concatenate([[0.0], np.cumsum(desc) / max(desc.sum(), 1)])


def share_of_hottest(cum: np.ndarray, fraction: float) -> float:
    rows = len(cum) - 1
    return float(cum[min(rows, int(np.ceil(fraction * rows - 1e-9)))])


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, (x, y) in curves.items():
        ax.plot(x, 100 * y, label=name)
    ax.set(
        xscale="log",
        xlabel="hottest fraction of the table's rows",
        ylabel="share of accesses (%)",
        title="Cumulative share of accesses by the hottest rows",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2 if len(curves) > 8 else 1)
    save_figure(fig, path)


def main(argv=None) -> dict:
    p = parser(__doc__)
    add_source_args(p)
    p.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[0.001, 0.01, 0.05, 0.1, 0.5],
        help="hottest fractions of rows to report (default: %(default)s)",
    )
    p.add_argument(
        "--out", type=Path, default=Path("bench/results/skew"), help="(default: %(default)s)"
    )
    args = p.parse_args(argv)
    env = environment(__file__, argv)

    source = load_source(args)
    big, small = cached_tables(source, args.min_rows)
    if not big:
        p.error(f"no table has {args.min_rows} rows or more")
    counts = access_counts(source.ids, big, source.cardinalities)

    records, curves = [], {}
    for t, c in zip(big, counts):
        cum = cumulative_share(c)
        rows = len(c)
        k = np.unique(np.geomspace(1, rows, CURVE_POINTS).round().astype(int))
        curves[f"{source.names[t]} ({rows:,} rows)"] = (k / rows, cum[k])
        records.append(
            {
                "table": source.names[t],
                "rows": rows,
                "accesses": int(c.sum()),
                "rows accessed": float((c > 0).mean()),
                **{
                    f"hottest {f:.1%}".replace(".0%", "%"): share_of_hottest(cum, f)
                    for f in args.fractions
                },
            }
        )
    df = pd.DataFrame(records).set_index("table")
    shown = df.assign(**{col: df[col].map(lambda v: f"{v:.1%}") for col in df.columns[2:]})
    md = "\n".join(
        [
            "# Access skew per table",
            "",
            environment_markdown(env),
            "",
            f"Data: {source.description}. Share of the table's accesses taken by its hottest rows "
            "(fraction of the table's rows, rows never accessed included); 'rows accessed': share of "
            "the table's rows accessed at least once.",
            "",
            markdown_table(shown),
            "",
            small_tables_note(source, small, args.min_rows),
            "",
        ]
    )
    print(md)

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "skew.md", md)
    result = {
        "environment": env,
        "data": source.description,
        "min_rows": args.min_rows,
        "left_out": [source.names[t] for t in small],
        "tables": df.reset_index().to_dict(orient="records"),
        "curves": {
            name: {"fraction": x.tolist(), "share": y.tolist()} for name, (x, y) in curves.items()
        },
    }
    write_text(args.out / "skew.json", json.dumps(result, indent=1))
    plot(curves, args.out / "skew.png")
    print(f"wrote {args.out}/skew.md, skew.json, skew.png")
    return result


if __name__ == "__main__":
    main()
