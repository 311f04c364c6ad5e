"""Calibration of the synthetic data's id skew against real Criteo rows.

What it measures: per categorical column C1..C26, on the real rows (the first lines of Kaggle's
train.txt) and on as many rows of ``dlrm.data.synthetic`` at scale 1.0 (Kaggle's full
cardinalities): over the distinct values seen in those rows, the share of the accesses taken
by the hottest 1% and 10% of them (rounded up to whole values) and the share of them seen
only once. A missing value counts as one value (preprocessing maps it to one id). Both sides
have the same row count, since "seen once" depends mostly on it.

    python bench/calibrate_synthetic.py              # compare the generator's defaults
    python bench/calibrate_synthetic.py --fit        # also fit alpha and head per column

--fit: per column, the power-law exponent ``alpha`` and head share ``head`` of the generator
(dlrm/data/synthetic.py) minimizing the sum of the three absolute differences, by grid search
(alpha 0.3-3.0 step 0.1, head 0-0.9 step 0.05, then around the best alpha +-0.1 step 0.02,
head +-0.05 step 0.01) on --fit-repeats independent samples of the same row count (common
random numbers for all candidates); prints KAGGLE_SKEW (alpha, head per column) to paste into
dlrm/data/synthetic.py. The comparison always uses the generator as it is (its defaults).

Writes --out/calibration.md (also printed) and calibration.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from _common import environment, environment_markdown, markdown_table, parser, write_text

from dlrm.data.criteo import KAGGLE_CARDINALITIES, NUM_DENSE, NUM_SPARSE
from dlrm.data.synthetic import SyntheticCriteo, power_law_ranks

REAL = Path("/work/shared/data/criteo_kaggle_train_head10000.tsv")
STATS = ("hottest 1%", "hottest 10%", "seen once")
OLD_DEFAULTS = {"alpha": 1.05, "head": 0.0}  # the generator's skew before this calibration


def column_stats(values: np.ndarray) -> tuple[float, float, float]:
    """(share of accesses of the hottest 1% and 10% of distinct values, share of the distinct
    values seen once) of one column's values (any hashable dtype)."""
    counts = np.sort(np.unique(values, return_counts=True)[1])[::-1]
    cum = np.cumsum(counts) / counts.sum()
    d = len(counts)
    return (
        float(cum[int(np.ceil(0.01 * d - 1e-9)) - 1]),
        float(cum[int(np.ceil(0.1 * d - 1e-9)) - 1]),
        float((counts == 1).mean()),
    )


def real_columns(path: Path, rows: int) -> list[np.ndarray]:
    """The categorical columns' raw strings of the first ``rows`` lines; missing -> ''."""
    df = pd.read_csv(
        path, sep="\t", header=None, dtype=str, nrows=rows, keep_default_na=False, quoting=3
    )
    if len(df) < rows:
        raise SystemExit(f"{path}: {len(df)} lines, fewer than --rows {rows}")
    first = 1 + NUM_DENSE
    return [df[first + j].to_numpy() for j in range(NUM_SPARSE)]


def fit(real: np.ndarray, rows: int, repeats: int, seed: int) -> tuple[list[float], list[float]]:
    """Per column (alpha, head) minimizing the summed absolute differences (module docstring)."""
    n = np.array(KAGGLE_CARDINALITIES)
    u = np.random.default_rng([seed, 99]).random((repeats, rows, NUM_SPARSE))

    def loss(alpha: np.ndarray, head: np.ndarray) -> np.ndarray:
        ranks = [power_law_ranks(u[r], n, alpha, head) for r in range(repeats)]
        stats = np.array([[column_stats(x[:, t]) for t in range(NUM_SPARSE)] for x in ranks])
        return np.abs(stats.mean(axis=0) - real).sum(axis=1)  # [26]

    def search(alphas: np.ndarray, heads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """alphas, heads: [candidates, 26]; the best candidate per column."""
        losses = np.array([loss(a, h) for a, h in zip(alphas, heads)])
        best = losses.argmin(axis=0)
        cols = np.arange(NUM_SPARSE)
        return alphas[best, cols], heads[best, cols]

    grid = [(a, h) for a in np.arange(0.3, 3.0001, 0.1) for h in np.arange(0, 0.9001, 0.05)]
    alphas = np.array([[a] * NUM_SPARSE for a, _ in grid])
    heads = np.array([[h] * NUM_SPARSE for _, h in grid])
    alpha, head = search(alphas, heads)
    fine = [
        (da, dh) for da in np.arange(-0.1, 0.1001, 0.02) for dh in np.arange(-0.05, 0.0501, 0.01)
    ]
    alphas = np.array([np.maximum(alpha + da, 0.05) for da, _ in fine])
    heads = np.array([np.clip(head + dh, 0, 0.95) for _, dh in fine])
    alpha, head = search(alphas, heads)
    return [round(float(a), 2) for a in alpha], [round(float(h), 2) for h in head]


def synthetic_stats(gen: SyntheticCriteo, rows: int) -> np.ndarray:
    sparse = gen.rows(0, rows)[1]
    return np.array([column_stats(sparse[:, t]) for t in range(NUM_SPARSE)])


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.add_argument("--real", type=Path, default=REAL, help="Criteo TSV (default: %(default)s)")
    p.add_argument("--rows", type=int, default=10_000, help="rows of each (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="of the synthetic rows (default: 0)")
    p.add_argument("--fit", action="store_true", help="fit alpha and head per column")
    p.add_argument("--fit-repeats", type=int, default=4, help="(default: %(default)s)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench/results/synthetic_calibration"),
        help="(default: %(default)s)",
    )
    args = p.parse_args(argv)
    env = environment(__file__, argv)

    real = np.array([column_stats(c) for c in real_columns(args.real, args.rows)])
    fitted = None
    if args.fit:
        alpha, head = fit(real, args.rows, args.fit_repeats, args.seed)
        fitted = {"alpha": alpha, "head": head}
        print("KAGGLE_SKEW = (")
        for t, (a, h) in enumerate(zip(alpha, head)):
            print(f"    ({a}, {h}),  # C{t + 1}")
        print(")")
    gen = SyntheticCriteo(scale=1.0, seed=args.seed)
    synth = synthetic_stats(gen, args.rows)
    old = synthetic_stats(SyntheticCriteo(scale=1.0, seed=args.seed, **OLD_DEFAULTS), args.rows)

    records = []
    for t in range(NUM_SPARSE):
        rec = {"column": f"C{t + 1}", "cardinality": KAGGLE_CARDINALITIES[t]}
        rec["alpha"], rec["head"] = gen.params["alpha"][t], gen.params["head"][t]
        for s, name in enumerate(STATS):
            rec[f"real {name}"] = real[t, s]
            rec[f"synthetic {name}"] = synth[t, s]
        records.append(rec)
    mae = {name: float(np.abs(synth[:, s] - real[:, s]).mean()) for s, name in enumerate(STATS)}
    mae_old = {name: float(np.abs(old[:, s] - real[:, s]).mean()) for s, name in enumerate(STATS)}
    df = pd.DataFrame(records).set_index("column")
    shown = df.assign(
        **{c: df[c].map(lambda v: f"{v:.1%}") for c in df.columns if c.startswith(("real", "syn"))}
    )
    shown["cardinality"] = df["cardinality"].map(lambda v: f"{v:,}")
    mae_line = ", ".join(f"{name} {v:.1%}" for name, v in mae.items())
    mae_old_line = ", ".join(f"{name} {v:.1%}" for name, v in mae_old.items())
    md = "\n".join(
        [
            "# Synthetic data vs real Criteo rows: id skew per column",
            "",
            environment_markdown(env),
            "",
            f"Real: the first {args.rows:,} lines of Kaggle's train.txt ({args.real.name}). "
            f"Synthetic: `SyntheticCriteo(scale=1.0, seed={args.seed}).rows(0, {args.rows:,})` "
            "(Kaggle's full cardinalities, the generator's per-column `alpha` and `head`). Per "
            "column, over the distinct values seen in those rows (missing = one value): share of "
            "the accesses taken by the hottest 1% and 10% of them, and share of them seen once.",
            "",
            markdown_table(shown),
            "",
            f"**Mean absolute difference** (synthetic - real, over the 26 columns): {mae_line}. "
            f"Before the calibration (alpha {OLD_DEFAULTS['alpha']}, no head, every column): "
            f"{mae_old_line}.",
            "",
            "Columns off by more than 5 points: "
            + "; ".join(
                f"{r['column']} ({r['cardinality']:,} ids): "
                + ", ".join(
                    f"{name} {r[f'synthetic {name}']:.1%} vs {r[f'real {name}']:.1%}"
                    for name in STATS
                    if abs(r[f"synthetic {name}"] - r[f"real {name}"]) > 0.05
                )
                for r in records
                if any(abs(r[f"synthetic {n}"] - r[f"real {n}"]) > 0.05 for n in STATS)
            )
            + ".",
            "",
            NOTES,
            "",
        ]
    )
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "calibration.md", md)
    result = {
        "environment": env,
        "real": str(args.real),
        "rows": args.rows,
        "seed": args.seed,
        "fitted": fitted,
        "mean_abs_diff": mae,
        "mean_abs_diff_before": {"defaults": OLD_DEFAULTS, **mae_old},
        "columns": df.reset_index().to_dict(orient="records"),
    }
    write_text(args.out / "calibration.json", json.dumps(result, indent=1))
    print(f"wrote {args.out}/calibration.md, calibration.json")
    return result


NOTES = """Where they still differ, and why:

* The statistics are those of a sample of 10,000 rows, compared at the same row count: in a
  10M-id column 10,000 rows see a few thousand values, so "seen once" and the hottest shares
  describe the head of the distribution and the sample size, not the 10M-id tail. The fit
  matches these sample statistics; how the tail continues beyond them is the power law's
  extrapolation (Criteo's real tail over 45M rows is not checked here).
* The first 10,000 lines of train.txt are one short stretch of the first day, not a random
  sample: values that are bursty in time (ids of one campaign or device) look hotter there
  than over the whole data set, so the fitted skew may be somewhat stronger than Kaggle's.
* Two parameters per column (alpha, head) cannot match three statistics exactly: a real
  column is not a power law plus one hot value (e.g. several hot values of similar counts,
  or small columns of 3-30 values whose shape is arbitrary); the fit minimizes the summed
  absolute difference, so the residual goes to the statistic that is hardest to match.
* The mid-size columns (5k-300k ids: C7, C10, C11, C15, C18, C24) are flatter in the middle
  than a power law: more values seen a few times, so the real "seen once" share is lower (by
  8-20 points) and, for C7, C11, C15, C18, the hottest 10% take more than the fit gives. A
  power law steep enough to match their "seen once" would overshoot their hottest 1%. In the
  largest columns (2M-10M ids) the synthetic "seen once" is 1-7 points higher for the same
  reason. The small columns C2, C14 and C22 have rare values (19%, 8%, 12% of their values
  seen once) that a power law over 583, 27 or 18 ids with the fitted head does not produce.
* The synthetic numbers have sampling noise of their own (one sample of 10,000 rows; the fit
  averages several)."""


if __name__ == "__main__":
    main()
