"""Cache hit rate of the FP32 row cache on a data set's embedding accesses (the paper's Table 6).

What it measures: for every table with a cache in training (at least --min-rows rows), every
cache size (% of the table's rows), policy (LRU, LFU) and associativity, the share of lookups
whose row is cached before its step's update -- exactly what
``CachedLowPrecisionEmbedding.stats()["hits"]`` counts during training.

How: the lookups are cut into training steps of --batch-size rows (one id per sample per
table, as ``dlrm train``; a data split is shuffled like ``dlrm train``'s first epoch with
--seed, a trace is read in order) and replayed, one whole table at a time, by
``embcache.planner.replay`` (``torch.ops.embcache.cache_replay``, the memory-budget planner's
replay too): the C++ cache rule the training update uses, without any
row arithmetic. Capacity and sets are ``embcache.TableConfig``'s (floor(ratio * rows) rounded
down to a multiple of the associativity); a table whose capacity rounds to 0 slots has no
cache and counts 0 hits. The overall rate is hits / lookups over the tables with a cache in
training. Tables are independent: --jobs N replays (table, configuration) pairs in N processes.
The replay rate (accesses/s of one configuration, i.e. one single-threaded op call) is printed.

The regime beside the rates: per table and cache size, the mean number of distinct rows a step
touches (``unique_rows / steps``), that number per slot of the cache (``distinct_per_slot``;
with W ways, per set it is about W times as much: ``distinct_per_set``, per record), and the
distinct rows of the whole trace per slot (below 1 the cache never has to evict: only first
touches miss). The Markdown states, per policy, the threshold of distinct rows per step per
slot that best separates the (table, size) cells where the most ways lose to direct-mapped from
those where they do not.

    python bench/hit_rate.py                                   # dlrm train's synthetic data
    python bench/hit_rate.py --data runs/data/kaggle --jobs 2  # a preprocessed Criteo directory
    python bench/hit_rate.py --data trace.npy --sizes 5 10 --policies lfu --ways 32

Writes --out/hit_rate.md (also printed), hit_rate.json (every count, the trace's
``cardinalities``, ``batch_size``, ``trace_rows`` and ``steps``, the per-table regime) and
hit_rate.png.
"""

from __future__ import annotations

import json
import multiprocessing
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
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

from embcache.config import POLICIES
from embcache.planner import replay


def step_order(
    num_rows: int, batch_size: int, steps: int | None, shuffle: bool, seed: int
) -> np.ndarray:
    """The source rows of the first ``steps`` whole steps, step after step: ``dlrm train``'s
    first epoch (``iterate_batches(shuffle=True, seed=seed, epoch=0, drop_last=True)``) or
    file order."""
    steps = min(steps or num_rows // batch_size, num_rows // batch_size)
    if not shuffle:
        return np.arange(steps * batch_size)
    perm = np.random.default_rng([seed, 0]).permutation(num_rows)[: steps * batch_size]
    return np.sort(perm.reshape(steps, batch_size), axis=1).ravel()


def gather_trace(ids: np.ndarray, tables: list[int], rows: np.ndarray) -> np.ndarray:
    """int32 [len(tables), len(rows)]: the ids of ``tables`` at ``rows``, a table per row."""
    out = np.empty((len(tables), len(rows)), np.int32)
    chunk = 1 << 20
    for lo in progress(range(0, len(rows), chunk), desc="trace", unit="chunk", leave=False):
        out[:, lo : lo + chunk] = ids[rows[lo : lo + chunk]][:, tables].T
    return out


# A worker's trace ([tables, lookups], set by _init) and the int64 ids of its current table.
_trace: np.ndarray | None = None
_current: tuple[int, torch.Tensor] | None = None


def _init(path: str) -> None:
    global _trace
    torch.set_num_threads(1)
    _trace = np.load(path, mmap_mode="r")


def _job(job: tuple) -> tuple:
    global _current
    row, num_rows, *config = job
    if _current is None or _current[0] != row:
        _current = (row, torch.from_numpy(_trace[row].astype(np.int64)))
    return job, replay(_current[1], num_rows, *config)[0]


def run_grid(
    trace: np.ndarray,
    cards: list[int],
    batch_size: int,
    sizes: list[float],
    policies: list[str],
    ways: list[int],
    jobs: int,
    lfu_count_bits: int,
) -> pd.DataFrame:
    """One record per (size, policy, ways, trace row); ``cards[i]`` is trace row i's table size."""
    global _trace, _current
    grid = [(s, p, w) for s in sizes for p in policies for w in ways]
    work = [
        (i, cards[i], batch_size, s / 100, p, w, lfu_count_bits)
        for i in range(len(trace))
        for s, p, w in grid
    ]
    if jobs == 1:
        _trace, _current = trace, None
        results = dict(progress(map(_job, work), total=len(work), desc="replay", unit="cfg"))
        _trace = _current = None
    else:
        with tempfile.TemporaryDirectory() as tmp:
            np.save(Path(tmp) / "trace.npy", trace)
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(
                jobs, initializer=_init, initargs=(str(Path(tmp) / "trace.npy"),)
            ) as pool:
                results = dict(
                    progress(
                        pool.imap_unordered(_job, work), total=len(work), desc="replay", unit="cfg"
                    )
                )
    return pd.DataFrame(
        [
            {
                "row": i,
                "size": s,
                "policy": p,
                "ways": w,
                **results[(i, cards[i], batch_size, s / 100, p, w, lfu_count_bits)],
            }
            for s, p, w in grid
            for i in range(len(trace))
        ]
    )


def config_label(policy: str, ways: int) -> str:
    return f"{policy.upper()} {'direct' if ways == 1 else f'{ways}-way'}"


def add_regime(df: pd.DataFrame, steps: int) -> pd.DataFrame:
    """``df`` with the regime of each record: mean distinct rows per step, and that per slot
    and per set of the record's cache (None without a cache)."""
    per_step = df.unique_rows / steps
    return df.assign(
        distinct_per_step=per_step,
        distinct_per_slot=(per_step / df.slots.where(df.slots > 0)).astype(object),
        distinct_per_set=(per_step / df.sets.where(df.sets > 0)).astype(object),
    ).pipe(lambda d: d.where(d.notna(), None))


def regime_table(df: pd.DataFrame, trace_distinct: dict[str, int]) -> pd.DataFrame:
    """Per table and cache size: slots of the least associative cache in ``df`` (the size's
    capacity), distinct rows per step and per trace, and their ratios to the slots."""
    d = df[df.ways == df.ways.min()].drop_duplicates(["table", "size"])
    return pd.DataFrame(
        {
            "table": d.table,
            "rows": d.rows,
            "size": d["size"],
            "slots": d.slots,
            "distinct_per_step": d.distinct_per_step,
            "trace_distinct": [trace_distinct[t] for t in d.table],
        }
    ).assign(
        step_per_slot=lambda x: x.distinct_per_step / x.slots.where(x.slots > 0),
        trace_per_slot=lambda x: x.trace_distinct / x.slots.where(x.slots > 0),
    )


def regime_rule(df: pd.DataFrame, regime: pd.DataFrame) -> list[dict]:
    """Per policy: does the most associative cache lose to the least associative one (lower
    hit rate) in a (table, size) cell, and which threshold t of distinct rows per step per
    slot best separates the cells (loses iff ratio >= t; fewest exceptions, then the smallest
    t)? Cells where either cache has no slot are left out."""
    lo, hi = df.ways.min(), df.ways.max()
    if lo == hi:
        return []
    ratio = regime.set_index(["table", "size"]).step_per_slot
    out = []
    for policy in dict.fromkeys(df.policy):
        d = df[(df.policy == policy) & df.ways.isin([lo, hi])]
        rate = d.assign(rate=d.hits / d.lookups).where(d.slots > 0)
        rate = rate.dropna(subset=["rate"]).pivot(
            index=["table", "size"], columns="ways", values="rate"
        )
        rate = rate.dropna()
        if rate.empty:
            continue
        x = ratio.reindex(rate.index).to_numpy(float)
        loses = (rate[hi] < rate[lo]).to_numpy()
        best = None
        for t in sorted(set(x)) + [np.inf]:
            wrong = int(((x >= t) != loses).sum())
            if best is None or wrong < best[0]:
                best = (wrong, t)
        t = best[1]
        above = x >= t
        out.append(
            {
                "policy": policy,
                "few_ways": int(lo),
                "many_ways": int(hi),
                "cells": len(x),
                "cells_losing": int(loses.sum()),
                "threshold_distinct_per_step_per_slot": None if np.isinf(t) else float(t),
                "cells_at_or_above": int(above.sum()),
                "losing_at_or_above": int((loses & above).sum()),
                "cells_below": int((~above).sum()),
                "losing_below": int((loses & ~above).sum()),
                "largest_ratio_not_losing": float(x[~loses].max()) if (~loses).any() else None,
                "smallest_ratio_losing": float(x[loses].min()) if loses.any() else None,
            }
        )
    return out


def rule_sentences(rules: list[dict]) -> list[str]:
    out = []
    for r in rules:
        few, many = (config_label(r["policy"], w) for w in (r["few_ways"], r["many_ways"]))
        if r["threshold_distinct_per_step_per_slot"] is None:
            out.append(
                f"* {r['policy'].upper()}: {many} loses to {few} in {r['cells_losing']} of "
                f"{r['cells']} (table, size) cells; no threshold of distinct rows per step per "
                f"slot separates them better than 'never'."
            )
            continue
        t = r["threshold_distinct_per_step_per_slot"]
        out.append(
            f"* {r['policy'].upper()}: {many} loses to {few} in {r['cells_losing']} of "
            f"{r['cells']} (table, size) cells: in {r['losing_at_or_above']} of the "
            f"{r['cells_at_or_above']} cells whose step touches at least {t:.3g} distinct rows "
            f"per slot (about {t * r['many_ways']:.3g} per {r['many_ways']}-way set), in "
            f"{r['losing_below']} of the {r['cells_below']} below (largest ratio where it does not "
            f"lose: {r['largest_ratio_not_losing'] if r['largest_ratio_not_losing'] is not None else float('nan'):.3g}; "
            f"smallest where it loses: {r['smallest_ratio_losing']:.3g})."
        )
    return out


def render(
    df: pd.DataFrame,
    header: str,
    footnote: str,
    regime: pd.DataFrame | None = None,
    rules: list[dict] | None = None,
) -> str:
    """The markdown report: overall hit rate (size x configuration), the regime (distinct
    rows per step and per trace over the slots, per table and size, and the rule they
    suggest), then per table."""
    df = df.assign(
        config=[config_label(p, w) for p, w in zip(df.policy, df.ways)],
        size=[f"{s:g}%" for s in df["size"]],
    )
    columns = list(dict.fromkeys(df.config))
    sizes = list(dict.fromkeys(df["size"]))
    tables = list(dict.fromkeys(zip(df.table, df.rows)))

    def pivot(d, index, values):
        return d.pivot(index=index, columns="config", values=values).reindex(columns=columns)

    overall = df.groupby(["size", "config"], sort=False)[["hits", "lookups"]].sum()
    overall = (overall.hits / overall.lookups).rename("rate").reset_index()
    out = [
        header,
        "",
        "## Overall hit rate (the paper's Table 6)",
        "",
        markdown_table(
            pivot(overall, "size", "rate")
            .reindex(sizes)
            .map(lambda r: f"{r:.2%}")
            .rename_axis("cache size")
            .rename_axis(None, axis=1)
        ),
        "",
    ]
    ratio = {}
    if regime is not None:
        r = regime.assign(size=[f"{s:g}%" for s in regime["size"]])
        ratio = {(t, s): v for t, s, v in zip(r.table, r["size"], r.step_per_slot)}

        def grid(values, fmt):
            return (
                r.assign(cell=[("no cache" if v != v else fmt(v)) for v in values])
                .pivot(index=["table", "rows"], columns="size", values="cell")
                .reindex(tables)
                .reindex(columns=sizes)
                .rename_axis(None, axis=1)
            )

        per_step = r.drop_duplicates("table").set_index("table").distinct_per_step
        trace_rows = r.drop_duplicates("table").set_index("table").trace_distinct
        step = grid(r.step_per_slot, lambda v: f"{v:.3g}")
        step.insert(0, "distinct rows / step", [f"{per_step[t]:,.0f}" for t, _ in tables])
        trace = grid(r.trace_per_slot, lambda v: f"{v:.3g}")
        trace.insert(0, "distinct rows in the trace", [f"{trace_rows[t]:,}" for t, _ in tables])
        out += [
            "## Regime: distinct rows per step per slot",
            "",
            "Mean distinct rows one step touches, divided by the cache's slots (the capacity at "
            "the size; a W-way cache has 1/W as many sets, so per set it sees W times this "
            "number each step). Above 1 a step touches more distinct rows than the cache "
            "holds.",
            "",
            markdown_table(step),
            "",
            "Distinct rows of the whole trace per slot: below 1 the cache never has to evict "
            "(only a row's first touch misses), so the trace does not test the policy there.",
            "",
            markdown_table(trace),
            "",
        ]
        if rules:
            out += [
                "Observed rule (these numbers only; a cell is one table at one size):",
                "",
                *rule_sentences(rules),
                "",
            ]
    for size in sizes:
        d = df[df["size"] == size].assign(rate=lambda x: x.hits / x.lookups)
        cell = d.rate.map(lambda r: f"{r:.2%}").where(d.slots > 0, "no cache")
        table = (
            pivot(d.assign(cell=cell), ["table", "rows"], "cell")
            .reindex(tables)
            .rename_axis(None, axis=1)
        )
        if ratio:
            v = [ratio.get((t, size), float("nan")) for t, _ in tables]
            table.insert(
                0,
                "distinct rows / step / slot",
                ["no cache" if x != x else f"{x:.3g}" for x in v],
            )
        out += [f"## Per table, cache {size} of each table", "", markdown_table(table), ""]
    return "\n".join(out + [footnote, ""])


def plot(df: pd.DataFrame, path: Path, regime: pd.DataFrame | None = None) -> None:
    """Top: overall hit rate against cache size, a line per associativity, a panel per policy.
    Bottom (with ``regime`` and more than one associativity): per (table, size) cell, the hit
    rate of the most ways minus that of the fewest, against the cell's distinct rows per step
    per slot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(df.policy))
    lo, hi = df.ways.min(), df.ways.max()
    gain = regime is not None and lo != hi
    fig, axes = plt.subplots(
        2 if gain else 1,
        len(policies),
        figsize=(5.5 * len(policies), 8 if gain else 4),
        squeeze=False,
    )
    overall = df.groupby(["policy", "ways", "size"])[["hits", "lookups"]].sum()
    overall = (100 * overall.hits / overall.lookups).rename("rate").reset_index()
    for ax, policy in zip(axes[0], policies):
        for w, d in overall[overall.policy == policy].groupby("ways"):
            ax.plot(d["size"], d.rate, marker="o", label=config_label(policy, w))
        ax.set(
            title=policy.upper(),
            xlabel="cache size (% of each table's rows)",
            ylabel="hit rate (%)",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if gain:
        ratio = regime.set_index(["table", "size"]).step_per_slot
        sizes = list(dict.fromkeys(df["size"]))
        for ax, policy in zip(axes[1], policies):
            d = df[(df.policy == policy) & df.ways.isin([lo, hi]) & (df.slots > 0)]
            rate = d.assign(rate=100 * d.hits / d.lookups).pivot(
                index=["table", "size"], columns="ways", values="rate"
            )
            rate = rate.dropna().assign(x=lambda r: ratio.reindex(r.index).to_numpy())
            for k, size in enumerate(sizes):
                r = rate[rate.index.get_level_values("size") == size]
                ax.scatter(r.x, r[hi] - r[lo], s=18, color=f"C{k}", label=f"{size:g}% cache")
            ax.axhline(0, color="k", lw=0.8)
            ax.axvline(1, color="k", lw=0.8, ls=":")
            ax.set_xscale("log")
            ax.set(
                title=f"{policy.upper()}: {config_label(policy, hi)} minus "
                f"{config_label(policy, lo)}, per table and size",
                xlabel="distinct rows per step / cache slots",
                ylabel="hit rate difference (points)",
            )
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> dict:
    p = parser(__doc__)
    add_source_args(p)
    p.add_argument(
        "--order",
        choices=["shuffled", "file"],
        help="step order: dlrm train's shuffled first epoch (default for a data directory) "
        "or file order (default, and the only choice, for a trace)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=2048,
        help="lookups per table per step (default: %(default)s)",
    )
    p.add_argument(
        "--steps", type=int, help="replay only the first STEPS steps (default: all whole steps)"
    )
    p.add_argument(
        "--sizes",
        type=float,
        nargs="+",
        default=[1, 5, 10, 30, 50],
        help="cache sizes, %% of each table's rows (default: %(default)s)",
    )
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument(
        "--ways",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32],
        help="associativities (default: %(default)s)",
    )
    from dlrm.cli import add_lfu_count_bits_option  # here: the replay workers need no dlrm

    add_lfu_count_bits_option(p)
    p.add_argument(
        "--jobs", type=int, default=1, help="processes replaying (table, configuration) pairs"
    )
    p.add_argument(
        "--out", type=Path, default=Path("bench/results/hit_rate"), help="(default: %(default)s)"
    )
    args = p.parse_args(argv)
    # Each job replays in its own process, one single-threaded op call at a time.
    env = environment(__file__, argv, threads=args.jobs)

    source = load_source(args)
    if args.order == "shuffled" and not source.is_split:
        p.error("--order shuffled needs a data directory; a trace is replayed in its own order")
    shuffle = source.is_split and args.order != "file"
    big, small = cached_tables(source, args.min_rows)
    if not big:
        p.error(f"no table has {args.min_rows} rows or more")
    rows = step_order(len(source.ids), args.batch_size, args.steps, shuffle, args.seed)
    if not len(rows):
        p.error(f"fewer than {args.batch_size} rows: not one step")
    trace = gather_trace(source.ids, big, rows)

    start = time.perf_counter()
    df = run_grid(
        trace,
        [source.cardinalities[t] for t in big],
        args.batch_size,
        args.sizes,
        args.policies,
        args.ways,
        args.jobs,
        args.lfu_count_bits,
    )
    wall = time.perf_counter() - start
    table = [big[i] for i in df.pop("row")]
    df.insert(0, "table", [source.names[t] for t in table])
    df.insert(1, "rows", [source.cardinalities[t] for t in table])
    steps = len(rows) // args.batch_size
    df = add_regime(df, steps)
    trace_distinct = {
        source.names[t]: int(np.count_nonzero(np.bincount(trace[i], minlength=1)))
        for i, t in enumerate(big)
    }
    regime = regime_table(df, trace_distinct)
    rules = regime_rule(df, regime)

    per_config = df.lookups / df.seconds
    rate = {
        "per_configuration_median": float(per_config.median()),
        "per_configuration_min": float(per_config.min()),
        "per_configuration_total": float(df.lookups.sum() / df.seconds.sum()),
        "wall_seconds": wall,
        "jobs": args.jobs,
        "all_jobs": float(df.lookups.sum() / wall),
    }
    header = (
        f"# Cache hit rate\n\n{environment_markdown(env)}\n\nData: {source.description}; "
        f"trace of {len(rows):,} rows ({len(rows) * len(big):,} lookups): {steps:,} steps of "
        f"{args.batch_size:,} lookups per table, "
        f"{'shuffled as dlrm train (seed ' + str(args.seed) + ')' if shuffle else 'in file order'}. "
        f"LFU counts of {args.lfu_count_bits} bits, saturating. "
        f"A hit is a lookup whose row is cached before its step's update; cache size is % of each "
        f"table's rows; overall = hits / lookups over the {len(big)} tables with a cache in training "
        f"('no cache': capacity rounds to 0 slots, 0 hits)."
    )
    footnote = small_tables_note(source, small, args.min_rows)
    md = render(df, header, footnote, regime, rules)
    rate_line = (
        f"replay: {rate['per_configuration_median'] / 1e6:.1f} M accesses/s per configuration "
        f"(median over {len(df)} table x configuration replays, slowest "
        f"{rate['per_configuration_min'] / 1e6:.1f} M/s); {wall:.1f} s wall with {args.jobs} job(s), "
        f"{rate['all_jobs'] / 1e6:.1f} M accesses/s in all"
    )
    print(md)
    print(rate_line)

    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "hit_rate.md", md + "\n" + rate_line + "\n")
    result = {
        "environment": env,
        "data": source.description,
        "cardinalities": list(map(int, source.cardinalities)),
        "batch_size": args.batch_size,
        "trace_rows": len(rows),
        "steps": steps,
        "lookups_per_table": len(rows),
        "shuffled": shuffle,
        "seed": args.seed,
        "min_rows": args.min_rows,
        "left_out": [source.names[t] for t in small],
        "rate": rate,
        "regime": regime.astype(object).where(regime.notna(), None).to_dict(orient="records"),
        "rule": rules,
        "records": df.to_dict(orient="records"),
    }
    write_text(args.out / "hit_rate.json", json.dumps(result, indent=1))
    plot(df, args.out / "hit_rate.png", regime)
    print(f"wrote {args.out}/hit_rate.md, hit_rate.json, hit_rate.png")
    return result


if __name__ == "__main__":
    main()
