"""Experiment sweep: DLRM test accuracy and embedding memory over a grid of table
configurations (the paper's Tables 2-5 and 11, Figures 2 and 7).

The hour-long run on 2 cores -- Tables 2, 3, 11 and Figure 7: fp16/int8/int4/int2 x
nearest/stochastic x no cache, 5, 10, 30, 50% 32-way LFU, plus FP32 = 41 runs per seed, 3 seeds,
400 steps of 1024 (2/3 of an epoch of dlrm train's default synthetic data) per run; estimated
~55 min (measured: ~50 s per run with two runs at once, ~8.5k samples/s each):

    python bench/sweep.py --steps 400 --seeds 0 1 2 --jobs 2

What it measures: every run trains DLRM with ``dlrm.train.train`` (same data, steps, batch size
and seed for every configuration; intermediate evaluations off) and evaluates the whole test
split; the table configuration varies over --precision x --rounding x --cache (% of each
table's rows; 0 = no cache) x --policy x --ways x --qparams (integer rows' scale and bias in
FP32 or FP16; the paper's tables show FP32's). For every seed the FP32 reference run
(precision fp32, no cache) is added, and a configuration's accuracy drop is
``(acc_fp32 - acc) / acc_fp32 * 100`` against the reference of the same seed (docs/contract.md §7),
shown as mean ± std over seeds; "neutral" (bold) is a mean below 0.02%. The compression factor
is the run's embedding memory over FP32's (docs/contract.md §5); the hit rate is averaged over the
tables with a cache (every table has the same number of lookups; small tables stay FP32).

--budget F adds planned runs (issue 30's validation): ``dlrm train --memory-budget`` with F
times the tables' FP32 bytes, so each table's precision, cache, associativity and policy come
from the planner; sweep.md sets each budget beside the uniform configuration with the
smallest drop that takes no more memory, and figure7.png draws the budgets as a line:

    python bench/sweep.py --steps 2000 --seeds 0 1 2 --jobs 2 --synthetic-rows 12000000 \
        --precision int8 int4 int2 --rounding stochastic --cache 0 5 --budget 0.52 0.35 0.25 0.18 \
        --out bench/results/planner

Each run lives in --runs/NAME/ (checkpoint, report.json; the synthetic data in --runs/data/);
its result is one row of --out/runs.jsonl (mirrored in runs.csv). A run whose row is present
is not redone, and an interrupted run resumes from its checkpoint; so re-running the same
command continues the sweep, and a wider grid adds only the new runs (e.g. the paper's Tables
4 and 5: the same command with --policy lru lfu --ways 1). The settings every run shares
(data, steps, batch size, preset) are fixed by the sweep's first invocation
(--out/sweep.json). --jobs N trains N runs at once in separate processes (1 thread each).

Outputs in --out: sweep.md (Tables 2-5 and 11, all configurations), figure7.png (accuracy
drop against compression factor, one point per configuration), figure2.png (drop against
cache size), runs.jsonl, runs.csv, and sweep.json: the shared settings and the environment of
the latest invocation (command, commit, machine, library versions: bench/_common.environment),
printed at the top of sweep.md. Each row also records the commit (and "dirty") of the
invocation that trained it, so a sweep continued at another commit says so.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from itertools import product
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from _common import (
    environment,
    environment_markdown,
    markdown_table,
    parser,
    progress,
    save_figure,
    write_atomic,
    write_text,
)
from tqdm import tqdm

from dlrm.build import resolve_data
from dlrm.cli import add_data_options
from dlrm.config import RunConfig
from dlrm.model import PRESETS
from dlrm.plan import run_cardinalities
from dlrm.run_dir import latest_checkpoint, remove_checkpoints
from dlrm.train import train
from embcache import TableConfig, compression_factor
from embcache.config import POLICIES, PRECISION_BITS, QPARAMS, ROUNDINGS
from embcache.memory import fp32_bytes

PRECISIONS = tuple(PRECISION_BITS)  # fp32 (the reference) first, then the low precisions
PLANNED = "planned"  # the precision column of a run planned to a memory budget
NEUTRAL = 0.02  # % relative accuracy drop
MARKERS = {(False, "fp32"): "s", (True, "fp32"): "o", (False, "fp16"): "v", (True, "fp16"): "^"}
PAPER_TABLE = {("lfu", 32): 3, ("lru", 1): 4, ("lfu", 1): 5}
CONFIG = ["precision", "rounding", "cache", "policy", "ways", "qparams", "budget"]
# the paper's int32 LFU counts in every run (they trained bit for bit as 16-bit ones do:
# bench/results/lfu_count_bits/), so that the sweep's results stay one set
SWEEP_LFU_COUNT_BITS = 32


@dataclasses.dataclass(frozen=True)
class Run:
    precision: str
    rounding: str | None  # None for fp32
    cache: float  # % of each table's rows
    policy: str | None  # None without a cache
    ways: int | None
    seed: int
    qparams: str = "fp32"  # an integer row's scale and bias (TableConfig.qparams)
    # a planned run's memory budget, a fraction of its tables' FP32 bytes (dlrm train
    # --memory-budget chooses each table's precision and cache); None for a uniform run
    budget: float | None = None

    @property
    def name(self) -> str:
        if self.precision == "fp32":
            return f"fp32-s{self.seed}"
        qparams = "-qp16" if self.qparams == "fp16" else ""
        if self.budget is not None:
            return f"{PLANNED}{self.budget:g}-{self.rounding}{qparams}-s{self.seed}"
        cache = f"-c{self.cache:g}-{self.policy}{self.ways}" if self.cache else "-c0"
        return f"{self.precision}-{self.rounding}{cache}{qparams}-s{self.seed}"


def grid(
    precisions, roundings, caches, policies, ways, seeds, budgets=(), qparams=("fp32",)
) -> list[Run]:
    """Seed after seed: the FP32 reference, then every planned configuration, then every
    low-precision one."""
    runs = []
    for seed in seeds:
        runs.append(Run("fp32", None, 0, None, None, seed))
        for q in qparams:
            runs += [
                Run(PLANNED, r, 0, None, None, seed, q, b) for b, r in product(budgets, roundings)
            ]
            for precision, rounding, cache in product(precisions, roundings, caches):
                if precision == "fp32":
                    continue
                if cache == 0:
                    runs.append(Run(precision, rounding, 0, None, None, seed, q))
                else:
                    runs += [
                        Run(precision, rounding, cache, p, w, seed, q)
                        for p, w in product(policies, ways)
                    ]
    return list(dict.fromkeys(runs))


def run_config(
    run: Run, base: dict, threads: int | None, checkpoint_every: int = RunConfig.checkpoint_every
) -> RunConfig:
    cfg = RunConfig(
        **base,
        precision="int8" if run.budget is not None else run.precision,
        rounding=run.rounding or "nearest",
        cache_ratio=run.cache / 100,
        policy=run.policy or "lfu",
        associativity=run.ways or 1,
        qparams=run.qparams,
        lfu_count_bits=SWEEP_LFU_COUNT_BITS,
        seed=run.seed,
        eval_every=0,
        progress=False,
        threads=threads,
        checkpoint_every=checkpoint_every,
    )
    if run.budget is None:
        return cfg
    fp32 = sum(fp32_bytes(t) for t in cfg.table_configs(run_cardinalities(cfg)))
    return dataclasses.replace(cfg, memory_budget=int(run.budget * fp32))


def execute(
    run: Run, base: dict, run_dir: Path, threads: int | None, checkpoint_every: int
) -> dict:
    """Train (or finish) one run; its result row. The finished run's checkpoint is deleted
    (at full cardinality it is 1-2.5 GB; the row and run_dir/report.json are the record)."""
    start = time.perf_counter()
    cfg = run_config(run, base, threads, checkpoint_every)
    report = train(cfg, run_dir, resume=latest_checkpoint(run_dir) is not None)
    remove_checkpoints(run_dir)
    emb = report["embeddings"]
    cached = [t["hit_rate"] for t in emb["tables"].values() if t["cache_slots"]]
    plan = report.get("plan")
    return {
        "name": run.name,
        **dataclasses.asdict(run),
        "plan": None if plan is None else [_planned_table(t) for t in plan["tables"]],
        "proxy": None if plan is None else plan["proxy"],
        "steps": report["steps"],
        **{k: report["test"][k] for k in ("accuracy", "auc", "log_loss", "normalized_entropy")},
        "compression_factor": emb["compression_factor"],
        "hit_rate": float(np.mean(cached)) if cached else None,
        "samples_per_second": report["samples_per_second"],
        "seconds": time.perf_counter() - start,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _planned_table(t: dict) -> str:
    """One table of a plan in a few words, e.g. ``t_2 int4 + 2% 32-way lru``."""
    cache = (
        t["cache_slots"]
        and f" + {t['cache_ratio'] * 100:g}% {t['associativity']}-way {t['policy']}"
    )
    return f"{t['name']} {t['precision']}{cache or ''}"


def run_all(todo: list[Run], base: dict, runs_dir: Path, jobs: int, checkpoint_every: int):
    """Yields (run, row or None, error or None) as runs finish."""
    if jobs == 1:
        for run in todo:
            try:
                yield run, execute(run, base, runs_dir / run.name, None, checkpoint_every), None
            except Exception as e:  # one failed run must not stop the sweep
                yield run, None, e
        return
    # a fresh process per run: a worker that trains run after run at full cardinality grows
    # (it reached 15 GB after ~15 runs), and two of them exhaust the machine's memory
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context, max_tasks_per_child=1) as pool:
        futures = {
            pool.submit(execute, run, base, runs_dir / run.name, 1, checkpoint_every): run
            for run in todo
        }
        for f in as_completed(futures):
            yield futures[f], (None if f.exception() else f.result()), f.exception()


# --------------------------------------------------------------------------- rendering


def read_rows(out: Path) -> pd.DataFrame:
    path = out / "runs.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not rows:
        return pd.DataFrame(columns=["name"])
    return pd.DataFrame(rows).astype({"ways": "Int64"})


def relative_drop(rows: pd.DataFrame) -> pd.Series:
    """Per row: ``(acc_fp32 - acc) / acc_fp32 * 100`` with the FP32 reference of its seed
    (NaN where that seed has no reference)."""
    ref = rows[rows.precision == "fp32"].set_index("seed").accuracy
    acc32 = rows.seed.map(ref)
    return (acc32 - rows.accuracy) / acc32 * 100


def with_later_columns(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with the columns that rows of older sweeps lack, at their values then."""
    defaults = {"budget": np.nan, "qparams": "fp32"}
    return rows.assign(**{k: rows[k].fillna(v) if k in rows else v for k, v in defaults.items()})


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: mean and std over seeds of the drop, and the other metrics."""
    rows = with_later_columns(rows)
    g = rows.assign(drop=relative_drop(rows)).groupby(CONFIG, dropna=False, sort=False)
    out = g.agg(
        seeds=("seed", "nunique"),
        accuracy=("accuracy", "mean"),
        auc=("auc", "mean"),
        drop=("drop", "mean"),
        drop_std=("drop", "std"),
        compression_factor=("compression_factor", "mean"),
        hit_rate=("hit_rate", "mean"),
    )
    rank = {
        "precision": lambda p: PRECISIONS.index(p) if p in PRECISIONS else len(PRECISIONS),
        "rounding": lambda r: ROUNDINGS.index(r) if r in ROUNDINGS else -1,
    }
    return out.reset_index().sort_values(
        CONFIG,
        key=lambda c: c.map(rank[c.name]) if c.name in rank else c,
        na_position="first",
        ignore_index=True,
    )


def rounding_effect(rows: pd.DataFrame) -> pd.DataFrame:
    """Per precision and cache configuration run with both roundings: the drop with nearest
    minus the drop with stochastic rounding, paired by seed (same data, same FP32 reference),
    its mean and std over seeds, in how many seeds stochastic was better, and a paired
    t-test's two-sided p. "decided" needs p < 0.05: the difference stands out of the seeds'
    spread."""
    from scipy import stats

    d = with_later_columns(rows).assign(drop=relative_drop(rows))
    d = d[~d.precision.isin(["fp32", PLANNED]) & (d.qparams == "fp32")].assign(
        policy=d.policy.fillna("-"), ways=d.ways.astype("Int64").fillna(0)
    )
    key = ["precision", "cache", "policy", "ways"]
    paired = d.pivot_table(index=[*key, "seed"], columns="rounding", values="drop").dropna()
    if paired.empty or not {"nearest", "stochastic"} <= set(paired.columns):
        return pd.DataFrame()
    diff = (paired["nearest"] - paired["stochastic"]).rename("diff").reset_index()
    out = []
    for config, g in diff.groupby(key, sort=False):
        n = len(g)
        p = float(stats.ttest_1samp(g["diff"], 0.0).pvalue) if n >= 2 else float("nan")
        better = "stochastic" if g["diff"].mean() > 0 else "nearest"
        out.append(
            {
                **dict(zip(key, config)),
                "seeds": n,
                "mean": g["diff"].mean(),
                "std": g["diff"].std(),
                "stochastic_better": int((g["diff"] > 0).sum()),
                "p": p,
                "verdict": f"{better} better" if p < 0.05 else "not decided",
            }
        )
    return pd.DataFrame(out)


def cell(mean: float, std: float) -> str:
    if pd.isna(mean):
        return "–"
    text = f"{mean:.3f}" + ("" if pd.isna(std) else f" ± {std:.3f}")
    return f"**{text}**" if mean < NEUTRAL else text


def kind_label(policy: str, ways: int) -> str:
    return f"{policy.upper()} {'direct-mapped' if ways == 1 else f'{ways}-way'}"


def cache_label(cache: float, policy: str, ways: int) -> str:
    return "no cache" if cache == 0 else f"{cache:g}% {kind_label(policy, ways)}"


def formula_factor(precision: str, cache: float, policy, ways, qparams: str) -> float:
    """The compression factor of a 10M-row, dim-128 table without optimizer state (docs/contract.md §5)."""
    return compression_factor(
        TableConfig(
            10_000_000,
            128,
            precision=precision,
            cache_ratio=cache / 100,
            policy=policy if cache else "lfu",
            associativity=int(ways) if cache else 1,
            optimizer="sgd",
            qparams=qparams,
            lfu_count_bits=SWEEP_LFU_COUNT_BITS,
        )
    )


def render(rows: pd.DataFrame, base: dict, env: dict | None = None) -> str:
    """sweep.md; ``env`` (bench/_common.environment of the latest invocation) goes on top."""
    s = summarize(rows)
    s["cell"] = [cell(m, sd) for m, sd in zip(s["drop"], s.drop_std)]
    precisions = [p for p in PRECISIONS[1:] if p in set(s.precision)]
    seeds = sorted(rows.seed.unique())
    data = (
        base["data"]
        if base["data"] != "synthetic"
        else (f"synthetic (scale {base['synthetic_scale']}, {base['synthetic_rows']:,} rows)")
    )
    steps = f"{base['steps']} steps" if base["steps"] else "one epoch"
    out = ["# Accuracy and memory sweep", ""]
    if env is not None:
        out += [environment_markdown(env), ""]
    if "commit" in rows:
        commits = rows.commit.fillna("not recorded") + rows.dirty.map(
            lambda d: " (dirty)" if d is True else ""
        )
        counts = commits.value_counts(sort=False)
        out += [
            "Runs trained at: " + ", ".join(f"{c} ({n} runs)" for c, n in counts.items()) + ".",
            "",
        ]
    out += [
        f"Data: {data}; {steps} of batch {base['batch_size']}; preset "
        f"{base['preset']}; seeds {', '.join(map(str, seeds))}. Cells: relative test accuracy drop in % "
        f"vs the FP32 run of the same seed, `(acc_fp32 - acc) / acc_fp32 * 100`, mean ± std over "
        f"seeds; **bold**: neutral (mean < {NEUTRAL}%).",
        "",
    ]

    # the paper's tables: FP32 qparams (the others are in "All configurations")
    lp = s[~s.precision.isin(["fp32", PLANNED]) & (s.qparams == "fp32")]
    nocache = lp[lp.cache == 0]
    if len(nocache):
        t = nocache.pivot(index="rounding", columns="precision", values="cell")
        out += [
            "## Without cache (the paper's Table 2)",
            "",
            markdown_table(t.reindex(columns=precisions).fillna("–").rename_axis(None, axis=1)),
            "",
        ]
    cached = lp[lp.cache != 0]
    for (policy, ways), d in cached.groupby(["policy", "ways"], sort=False):
        sizes = sorted(d.cache.unique())
        cells = d.set_index(["cache", "precision", "rounding"]).cell
        t = pd.DataFrame(
            {
                p: [
                    f"{cells.get((c, p, 'nearest'), '–')} / {cells.get((c, p, 'stochastic'), '–')}"
                    for c in sizes
                ]
                for p in precisions
            },
            index=pd.Index([f"{c:g}%" for c in sizes], name="cache size"),
        )
        ref = (
            f" (the paper's Table {PAPER_TABLE[(policy, ways)]})"
            if (policy, ways) in PAPER_TABLE
            else ""
        )
        out += [
            f"## {kind_label(policy, ways)} cache, nearest / stochastic{ref}",
            "",
            markdown_table(t),
            "",
        ]

    effect = rounding_effect(rows)
    if len(effect):
        effect = effect.assign(
            cache=[
                cache_label(c, p, w) for c, p, w in zip(effect.cache, effect.policy, effect.ways)
            ],
            diff=[f"{m:+.3f} ± {sd:.3f}" for m, sd in zip(effect["mean"], effect["std"])],
            better=[f"{b} of {n}" for b, n in zip(effect.stochastic_better, effect.seeds)],
            p=effect.p.map("{:.3f}".format),
        )[["precision", "cache", "diff", "better", "p", "verdict"]]
        out += [
            "## Stochastic against nearest rounding",
            "",
            "Drop with nearest minus drop with stochastic rounding (percentage points), paired "
            "by seed; positive: stochastic is better. Decided where a paired t-test over the "
            "seeds gives p < 0.05.",
            "",
            markdown_table(
                effect.rename(
                    columns={"diff": "nearest - stochastic", "better": "stochastic better in"}
                ).set_index("precision")
            ),
            "",
        ]

    out += planned_section(rows, s)

    s["config"] = [
        f"planned to {b:g} of FP32" if p == PLANNED else cache_label(c, pol, w)
        for p, c, pol, w, b in zip(s.precision, s.cache, s.policy, s.ways, s.budget)
    ]
    uniform = s[(s.precision != PLANNED) & (s.qparams == "fp32")]
    comp = uniform.groupby(["config", "precision"], sort=False).compression_factor.mean().unstack()
    comp = comp.reindex(columns=[p for p in PRECISIONS if p in comp.columns])
    kind = uniform.drop_duplicates("config").set_index("config").loc[comp.index]
    paper = pd.DataFrame(
        {
            p: [formula_factor(p, k.cache, k.policy, k.ways, k.qparams) for k in kind.itertuples()]
            for p in comp.columns
        },
        index=comp.index,
    ).where(comp.notna())
    comp, paper = (t.map(lambda v: "–" if pd.isna(v) else f"{v:.4f}") for t in (comp, paper))
    out += [
        "## Memory compression factor (the paper's Table 11)",
        "",
        "Measured: these runs' embedding memory (tables, qparams, cache, tags, priorities, "
        "optimizer state) over FP32 tables with the same optimizer state, all tables (small "
        "ones stay FP32).",
        "",
        markdown_table(comp.rename_axis("cache").rename_axis(None, axis=1)),
        "",
        "Formula at the paper's setting (one large table, dim 128, no optimizer state; "
        "docs/contract.md §5 reference points: fp16 0.5, int8 0.2656, int8 + 10% LFU 0.374):",
        "",
        markdown_table(paper.rename_axis("cache").rename_axis(None, axis=1)),
        "",
    ]

    full = s.assign(
        rounding=s.rounding.fillna("–"),
        cache=s.config,
        drop=s.cell,
        accuracy=s.accuracy.map("{:.4f}".format),
        auc=s.auc.map("{:.4f}".format),
        compression_factor=s.compression_factor.map("{:.4f}".format),
        hit_rate=s.hit_rate.map(lambda v: "–" if pd.isna(v) else f"{v:.1%}"),
    )
    full = full[
        [
            "precision",
            "rounding",
            "cache",
            "qparams",
            "seeds",
            "accuracy",
            "drop",
            "auc",
            "compression_factor",
            "hit_rate",
        ]
    ]
    out += [
        "## All configurations",
        "",
        "Accuracy and AUC: means over seeds; drop in %.",
        "",
        markdown_table(full.set_index("precision")),
        "",
    ]
    return "\n".join(out)


def _plan_summary(plan: list[str]) -> str:
    """Tables per precision, and how many of them have a cache: ``fp32 11, fp16 9 (7 cached)``."""
    kinds = [t.split(" ", 2)[1:] for t in plan]  # [precision] or [precision, "+ cache ..."]
    counts = Counter(k[0] for k in kinds)
    cached = Counter(k[0] for k in kinds if len(k) > 1)
    return ", ".join(
        f"{p} {n}" + (f" ({cached[p]} cached)" if cached[p] else "")
        for p, n in sorted(counts.items(), key=lambda pn: PRECISIONS.index(pn[0]))
    )


def planned_section(rows: pd.DataFrame, s: pd.DataFrame) -> list[str]:
    """Markdown lines: each planned budget's drop beside the best uniform configuration that
    fits the budget, the smallest neutral budget, and what the plans chose."""
    planned = s[s.precision == PLANNED].sort_values(["rounding", "budget"])
    if planned.empty:
        return []
    uniform = s[~s.precision.isin(["fp32", PLANNED])]
    table = []
    for p in planned.itertuples():
        # at the 4 decimals a budget is given with (0.5236: the default run's 0.523603)
        fits = uniform[
            (uniform.rounding == p.rounding) & (uniform.compression_factor.round(4) <= p.budget)
        ]
        best = fits.loc[fits["drop"].idxmin()] if len(fits) else None
        table.append(
            {
                "rounding": p.rounding,
                "budget": f"{p.budget:g}",
                "memory factor": f"{p.compression_factor:.4f}",
                "seeds": p.seeds,
                "planned: drop": cell(p.drop, p.drop_std),
                "best uniform within the budget": "–"
                if best is None
                else f"{best.precision} {cache_label(best.cache, best.policy, best.ways)}"
                f"{', fp16 qparams' if best.qparams == 'fp16' else ''} "
                f"({best.compression_factor:.4f})",
                "its drop": "–" if best is None else cell(best["drop"], best.drop_std),
            }
        )
    neutral = planned[planned["drop"] < NEUTRAL]
    smallest = (
        f"The smallest neutral budget: **{neutral.budget.min():g} of FP32 memory** "
        f"({1 / neutral.compression_factor.min():.1f}x less)."
        if len(neutral)
        else "No budget run was neutral."
    )
    plans = rows[rows.precision == PLANNED].sort_values(["budget", "seed"])
    chosen = [
        f"- {r.budget:g} (seed {r.seed}, proxy {r.proxy:.3g}): " + _plan_summary(r.plan)
        for r in plans.drop_duplicates("budget").itertuples()
    ]
    return [
        "## Planned to a memory budget",
        "",
        "Each table's precision, cache size, associativity and policy chosen by "
        "`dlrm train --memory-budget` (the budget: this fraction of the tables' FP32 bytes) "
        "from the first 1M rows training reads. Beside it, the uniform configuration of this "
        f"sweep with the smallest drop that fits the same budget. {smallest}",
        "",
        markdown_table(pd.DataFrame(table).set_index("rounding")),
        "",
        "What the plans chose (tables per stored precision; every plan's tables are in "
        "runs.jsonl):",
        "",
        *chosen,
        "",
    ]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, dict(zip(PRECISIONS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))


def plot_figure7(rows: pd.DataFrame, path: Path) -> None:
    """Accuracy drop against compression factor, one point per configuration, a panel per rounding."""
    plt, colors = _pyplot()
    s = summarize(rows)
    planned = s[s.precision == PLANNED].sort_values("compression_factor")
    lp = s[~s.precision.isin(["fp32", PLANNED])]
    roundings = [r for r in ROUNDINGS if r in set(lp.rounding)] or ROUNDINGS[-1:]
    fig, axes = plt.subplots(
        1, len(roundings), figsize=(6 * len(roundings), 4.5), sharey=True, squeeze=False
    )
    for ax, rounding in zip(axes[0], roundings):
        ax.scatter([1.0], [0.0], color=colors["fp32"], marker="*", s=80, label="fp32 (reference)")
        for precision, d in lp[lp.rounding == rounding].groupby("precision", sort=False):
            for (cached, qparams), marker in MARKERS.items():
                e = d[((d.cache != 0) == cached) & (d.qparams == qparams)]
                if len(e):
                    ax.errorbar(
                        e.compression_factor,
                        e["drop"],
                        yerr=e.drop_std.fillna(0),
                        fmt=marker,
                        color=colors[precision],
                        capsize=2,
                        label=f"{precision} {'+ cache' if cached else 'no cache'}"
                        + (", fp16 qparams" if qparams == "fp16" else ""),
                    )
            for _, r in d[d.cache != 0].iterrows():
                ax.annotate(
                    f"{r.cache:g}%",
                    (r.compression_factor, r["drop"]),
                    fontsize=6,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
        p = planned[planned.rounding == rounding]
        if len(p):
            ax.errorbar(
                p.compression_factor,
                p["drop"],
                yerr=p.drop_std.fillna(0),
                fmt="-D",
                color="black",
                capsize=2,
                label="planned to a budget",
            )
        ax.axhline(NEUTRAL, color="gray", ls="--", lw=0.8)
        ax.set(
            title=f"{rounding} rounding",
            xlabel="memory compression factor (lower = smaller)",
            ylabel="relative accuracy drop (%)",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_figure2(rows: pd.DataFrame, path: Path) -> None:
    """Accuracy drop against cache size (0 = no cache), a panel per (cache kind, rounding)."""
    plt, colors = _pyplot()
    s = summarize(rows)
    lp = s[~s.precision.isin(["fp32", PLANNED]) & (s.qparams == "fp32")]
    kinds = list(dict.fromkeys(zip(lp[lp.cache != 0].policy, lp[lp.cache != 0].ways)))
    panels = [(k, r) for k in kinds for r in ROUNDINGS if r in set(lp.rounding)]
    if not panels:
        return
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.5 * len(panels), 4), sharey=True, squeeze=False
    )
    for ax, ((policy, ways), rounding) in zip(axes[0], panels):
        d = lp[
            (lp.rounding == rounding)
            & ((lp.cache == 0) | ((lp.policy == policy) & (lp.ways == ways)))
        ]
        for precision, e in d.groupby("precision", sort=False):
            e = e.sort_values("cache")
            ax.errorbar(
                e.cache,
                e["drop"],
                yerr=e.drop_std.fillna(0),
                marker="o",
                capsize=2,
                color=colors[precision],
                label=precision,
            )
        ax.axhline(NEUTRAL, color="gray", ls="--", lw=0.8)
        ax.set(
            title=f"{kind_label(policy, ways)}, {rounding}",
            xlabel="cache size (% of rows)",
            ylabel="relative accuracy drop (%)",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def write_outputs(out: Path, base: dict, env: dict | None = None) -> pd.DataFrame:
    rows = read_rows(out)
    write_atomic(out / "runs.csv", lambda tmp: rows.to_csv(tmp, index=False))
    if len(rows):
        write_text(out / "sweep.md", render(rows, base, env))
        plot_figure7(rows, out / "figure7.png")
        plot_figure2(rows, out / "figure2.png")
    return rows


def main(argv=None) -> int:
    p = parser(__doc__)
    g = p.add_argument_group("grid (fp32 = the reference, always run once per seed)")
    g.add_argument("--precision", nargs="+", choices=PRECISIONS, default=list(PRECISIONS[1:]))
    g.add_argument("--rounding", nargs="+", choices=ROUNDINGS, default=list(ROUNDINGS))
    g.add_argument(
        "--cache",
        type=float,
        nargs="+",
        default=[0, 5, 10, 30, 50],
        help="%% of each table's rows; 0 = none",
    )
    g.add_argument("--policy", nargs="+", choices=POLICIES, default=["lfu"])
    g.add_argument("--ways", type=int, nargs="+", default=[32], help="associativities")
    g.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    g.add_argument(
        "--qparams",
        nargs="+",
        choices=QPARAMS,
        default=["fp32"],
        help="integer rows' scale and bias (low-precision and planned runs)",
    )
    g.add_argument(
        "--budget",
        type=float,
        nargs="+",
        default=[],
        help="planned runs: each table's precision and cache chosen (dlrm train "
        "--memory-budget) to fit this fraction of the tables' FP32 bytes, per --rounding",
    )
    g = p.add_argument_group("shared by every run (fixed by the sweep's first invocation)")
    d = RunConfig()
    add_data_options(g)
    g.add_argument(
        "--steps", type=int, default=d.steps, help="training steps per run (default: one epoch)"
    )
    g.add_argument("--batch-size", type=int, default=d.batch_size)
    g.add_argument("--preset", choices=list(PRESETS), default=d.preset)
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=RunConfig.checkpoint_every,
        help="steps between a run's checkpoints (an interrupted run resumes from its last)",
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="runs trained at once, one process (1 thread) each"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench/results/sweep"),
        help="results (default: %(default)s)",
    )
    p.add_argument(
        "--runs",
        type=Path,
        default=Path("runs/sweep"),
        help="run directories and synthetic data (default: %(default)s, git-ignored)",
    )
    args = p.parse_args(argv)
    if any(not 0 < b <= 1 for b in args.budget):
        p.error("--budget: a fraction of the tables' FP32 bytes in (0, 1], e.g. 0.25")
    # Runs of --jobs > 1 train in their own processes with 1 thread each.
    threads = 1 if args.jobs > 1 else torch.get_num_threads()
    env = environment(__file__, argv, threads=threads)

    base = {
        k: getattr(args, k)
        for k in ("data", "synthetic_rows", "synthetic_scale", "steps", "batch_size", "preset")
    }
    args.out.mkdir(parents=True, exist_ok=True)
    settings = args.out / "sweep.json"
    if settings.exists():
        before = json.loads(settings.read_text())
        before = before.get("settings", before)  # a sweep.json of old held only the settings
        if before != base:
            p.error(
                f"{args.out} is a sweep with other shared settings ({json.dumps(before)}); "
                f"use another --out"
            )
    write_text(settings, json.dumps({"settings": base, "environment": env}, indent=1))

    runs = grid(
        args.precision,
        args.rounding,
        args.cache,
        args.policy,
        args.ways,
        args.seeds,
        args.budget,
        args.qparams,
    )
    done = set(read_rows(args.out).name)
    todo = [r for r in runs if r.name not in done]
    print(
        f"{len(runs)} runs in the grid, {len(runs) - len(todo)} already done, {len(todo)} to run "
        f"with {args.jobs} job(s)"
    )
    for seed in sorted({r.seed for r in todo}):  # generate the data once, before the jobs start
        resolve_data(run_config(Run("fp32", None, 0, None, None, seed), base, None), args.runs)
    failed = []
    with open(args.out / "runs.jsonl", "a") as log:
        for run, row, error in progress(
            run_all(todo, base, args.runs, args.jobs, args.checkpoint_every),
            total=len(todo),
            desc="sweep",
            unit="run",
        ):
            if error is not None:
                failed.append(run.name)
                tqdm.write(f"{run.name}: failed: {type(error).__name__}: {error}")
                continue
            row.update(commit=env["commit"], dirty=env["dirty"])
            log.write(json.dumps(row) + "\n")
            log.flush()
            tqdm.write(f"{run.name}: accuracy {row['accuracy']:.4f}, {row['seconds']:.0f} s")
    rows = write_outputs(args.out, base, env)
    if len(rows):
        print(render(rows, base, env))
    print(f"wrote {args.out}/sweep.md, figure7.png, figure2.png, runs.csv, runs.jsonl")
    if failed:
        print(
            f"{len(failed)} run(s) failed (re-run to retry): {', '.join(failed)}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
