"""Fitting tables to a memory budget (docs/design.md, "The memory-budget planner"): per table
the precision, cache size, associativity and policy that make a loss proxy smallest while
every table's bytes (:func:`embcache.memory.memory_breakdown`) sum to at most the budget,
chosen from a sample of the ids training will look up. Given a host budget too, each table's
placement is chosen with them: a table may keep its storage in pinned host memory, its cache
on the device, the device's bytes within the budget and the host's within the host budget.

:func:`replay` is the hit-rate replay the planner measures caches with (``bench/hit_rate.py``
too): a stream of training steps through one table's cache, by
``torch.ops.embcache.cache_replay``, the cache rule of the training update (docs/contract.md
§4.3) without any row values.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from embcache import _C  # noqa: F401  (registers torch.ops.embcache)
from embcache.config import COUNTERS, PLACEMENTS, POLICIES, PRECISION_BITS, TableConfig
from embcache.memory import fp32_bytes, memory_breakdown

# The caches a plan may give a table (besides none): fractions of its rows, associativities.
CACHE_RATIOS = (0.01, 0.02, 0.05, 0.1, 0.2)
ASSOCIATIVITIES = (1, 8, 32)
# The TableConfig fields a plan chooses; the others are the caller's. (The placement is
# "device" for every table unless the plan is given a host budget.)
PLANNED = ("precision", "cache_ratio", "associativity", "policy", "placement")
# The search's byte grid: the bytes between the cheapest and the dearest plan in this many
# steps (so a plan may leave up to one step per table of its budget unused).
_GRID_STEPS = 1 << 16


def replay(
    ids: torch.Tensor,
    num_rows: int,
    batch_size: int,
    cache_ratio: float,
    policy: str,
    ways: int,
    lfu_count_bits: int = TableConfig.lfu_count_bits,
) -> tuple[dict, torch.Tensor]:
    """Replays ``ids`` (int64, steps of ``batch_size`` lookups) through a fresh cache of one
    table (LFU counts of ``lfu_count_bits``); returns the counters (``embcache.config.COUNTERS``, as the table's ``stats()``
    would count them in training; ``flushed`` is 0), slots, sets and seconds, and the final
    cache tags."""
    if len(ids) % batch_size:
        raise ValueError("ids must hold whole steps")
    cfg = TableConfig(
        num_rows,
        1,
        cache_ratio=cache_ratio,
        associativity=ways,
        policy=policy,
        lfu_count_bits=lfu_count_bits,
        min_rows_for_low_precision=0,
    )
    tags = torch.full((cfg.num_slots,), -1, dtype=torch.int32)
    priority = torch.zeros(cfg.num_slots, dtype=torch.int32)
    counts = torch.zeros(num_rows if cfg.keeps_counts else 0, dtype=cfg.counts_dtype)
    offsets = torch.arange(0, len(ids) + 1, batch_size)
    counters = torch.zeros(len(COUNTERS), dtype=torch.int64)
    start = time.perf_counter()
    torch.ops.embcache.cache_replay(tags, priority, counts, cfg.spec(), ids, offsets, counters)
    seconds = time.perf_counter() - start
    return {
        **dict(zip(COUNTERS, counters.tolist())),
        "slots": cfg.num_slots,
        "sets": cfg.num_sets,
        "seconds": seconds,
    }, tags


def rounding_noise(precision: str) -> float:
    """Mean squared rounding error of one element stored in ``precision``, relative to the
    mean square of its row, for a row whose values are spread evenly over ``[-a, a]``: int k
    (min-max, step ``2a / (2^k - 1)``, error variance step² / 12): ``1 / (2^k - 1)^2``; fp16
    (relative step at most its epsilon): the bound ``eps^2 / 12``; fp32: 0, the reference.
    Stochastic rounding doubles each (variance step² / 6), which changes no plan."""
    if PRECISION_BITS[precision] == 32:
        return 0.0
    if precision == "fp16":
        return torch.finfo(torch.float16).eps ** 2 / 12
    return 1 / (2 ** PRECISION_BITS[precision] - 1) ** 2


def candidates(
    table: TableConfig,
    cache_ratios: Sequence[float] = CACHE_RATIOS,
    associativities: Sequence[int] = ASSOCIATIVITIES,
    placements: Sequence[str] = ("device",),
) -> list[TableConfig]:
    """The configurations a plan may give ``table``: every precision without a cache and
    behind every (cache ratio, policy, associativity), in each of ``placements``; a table too
    small for low precision (docs/contract.md §4.4) has one per placement, FP32 without a
    cache. Fields other than :data:`PLANNED` are ``table``'s."""
    if not table.low_precision:
        return [
            dataclasses.replace(table, precision="fp32", cache_ratio=0.0, placement=where)
            for where in placements
        ]
    caches = [(0.0, table.associativity, table.policy)]
    caches += [(r, w, p) for r in cache_ratios for p in POLICIES for w in associativities]
    return [
        dataclasses.replace(
            table, precision=x, cache_ratio=r, associativity=w, policy=p, placement=where
        )
        for where in placements
        for x in PRECISION_BITS
        for r, w, p in caches
    ]


def smallest_budget(tables: Sequence[TableConfig], **grid) -> int:
    """The smallest memory budget a plan of ``tables`` on the device alone can meet: every
    table in its cheapest candidate (``grid``: :func:`candidates`'s cache_ratios and
    associativities)."""
    return sum(min(memory_breakdown(c)["total"] for c in candidates(t, **grid)) for t in tables)


def least_host_bytes(tables: Sequence[TableConfig], memory_budget: int, **grid) -> int | None:
    """The fewest bytes of host memory a plan of ``tables`` needs with ``memory_budget`` bytes
    on the device (tables placed on the device or in host memory, as :func:`plan` with a host
    budget places them; over its byte grid of the device's bytes, so at most a grid step a
    table above the exact least); None if none fits the device's budget at all."""
    found = [
        [_Option(c, *_tiers(c), 0, 0.0) for c in candidates(t, **grid, placements=PLACEMENTS)]
        for t in tables
    ]
    chosen = _placed_search(found, memory_budget, 1.0)
    return None if chosen is None else sum(o.host for o in chosen)


def check_budget(
    tables: Sequence[TableConfig], memory_budget: int, host_budget: int | None = None, **grid
) -> None:
    """``ValueError`` (one line, naming the smallest budget that can be met) unless a plan
    of ``tables`` fits ``memory_budget`` bytes on the device, and, given ``host_budget``, at
    most that many bytes in host memory."""
    for name, value in (("memory budget", memory_budget), ("host budget", host_budget)):
        if value is None and name == "host budget":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"the {name} must be an integer number of bytes, got {value!r}")
    if host_budget is not None:
        need = least_host_bytes(tables, memory_budget, **grid)
        if need is not None and need > host_budget:
            raise ValueError(
                f"a device budget of {_size(memory_budget)} with a host budget of "
                f"{_size(host_budget)} cannot be met: with that device budget the tables need "
                f"at least {_size(need)} of host memory"
            )
        if need is not None:
            return
    least = smallest_budget(tables, **grid)
    if memory_budget < least:
        raise ValueError(
            f"a budget of {_size(memory_budget)} cannot be met: the smallest that can is "
            f"{_size(least)}"
        )


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:.1f} MiB)"


def plan(
    tables: Sequence[TableConfig],
    memory_budget: int,
    ids_sample: Mapping[str, Sequence[int] | np.ndarray | torch.Tensor],
    *,
    host_budget: int | None = None,
    batch_size: int = 1024,
    cache_ratios: Sequence[float] = CACHE_RATIOS,
    associativities: Sequence[int] = ASSOCIATIVITIES,
) -> dict:
    """The configuration of each table, among its :func:`candidates`, whose bytes sum to at
    most ``memory_budget`` with the smallest loss proxy.

    With ``host_budget`` each table may also be placed in host memory (``placement="host"``:
    its storage in pinned host memory, its cache on the device): ``memory_budget`` then bounds
    the bytes on the device and ``host_budget`` those in host memory, and the placement is
    chosen with the rest. A placement changes no value, so the proxy does not see it; of the
    plans with the smallest proxy, one with the fewest bytes in host memory is chosen (a row
    in host memory crosses PCIe on every miss). Without it every table is on the device.

    ``ids_sample[name]``: the ids table ``name`` looks up, in training order, ``batch_size``
    a step (a last partial step is left out). Each candidate's hits come from :func:`replay`
    of the sample.

    **Proxy**: the expected squared rounding error of a looked-up element, relative to its
    row's scale: ``sum_t misses_t * dim_t * rounding_noise(precision_t) / sum_t lookups_t *
    dim_t``. A hit reads an FP32 cached row, a miss a rounded one, so this is the noise the
    stored format adds to what the model sees, weighted by how often it is seen: a hot table
    matters more than a cold one, and a cache that holds a table's hot rows makes its misses,
    and so its format, matter less. Relative error lets tables of any scale be compared.

    **Search**: exact over a byte grid (multiple-choice knapsack by dynamic programming):
    every table's bytes above its cheapest candidate, rounded up to a step of
    1/65536 of the spread between the cheapest and the dearest plan, with the budget above
    the cheapest plan as capacity. The grid does not depend on the budget, so a larger
    budget never gives a larger proxy, and the rounding up means the plan fits. With a host
    budget the second constraint is taken by a Lagrange multiplier: the search over the
    device's grid minimises proxy + lambda * host bytes, and lambda is the smallest (found by
    bisection from a tie-breaker's value) whose plan fits the host budget. That plan is the
    best of those that use no more host memory than it does.

    Returns a plain JSON-serialisable dict: ``budget`` (the device's), ``host_budget``,
    ``total_bytes`` (``device_bytes`` + ``host_bytes``), ``fp32_bytes`` (the same tables in
    FP32 without cache), ``proxy``, ``batch_size`` and ``tables``, per table ``name``,
    ``rows``, ``dim``, ``precision`` (as stored), ``cache_ratio``, ``associativity``,
    ``policy``, ``placement``, ``cache_slots``, ``lookups`` (of the sample), ``hit_rate``
    (expected: the sample's), ``bytes``, ``device_bytes`` and ``host_bytes``;
    :func:`overrides` turns it into per-table options. ``ValueError`` (one line) for budgets
    no plan meets (:func:`check_budget`), names that do not match, or ids out of a table's
    range."""
    grid = {"cache_ratios": cache_ratios, "associativities": associativities}
    names = [t.name for t in tables]
    if len(set(names)) != len(names) or set(names) != set(ids_sample):
        raise ValueError(
            f"ids_sample must name each table once: tables {names}, sample {sorted(ids_sample)}"
        )
    check_budget(tables, memory_budget, host_budget, **grid)
    placements = ("device",) if host_budget is None else PLACEMENTS
    found, lookups = [], []
    for table in tables:
        ids = torch.as_tensor(ids_sample[table.name], dtype=torch.int64).reshape(-1)
        ids = ids[: len(ids) - len(ids) % batch_size]
        if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < table.num_embeddings:
            raise ValueError(
                f"table '{table.name}': the sample holds ids outside [0, {table.num_embeddings})"
            )
        lookups.append(len(ids))
        found.append(_measured(table, ids, batch_size, grid, placements))
    if host_budget is None:
        chosen = _placed_search(found, memory_budget, 0.0)
    else:
        chosen = _placed_plan(found, memory_budget, host_budget)
    scale = max(1, sum(n * t.embedding_dim for n, t in zip(lookups, tables)))
    return {
        "budget": memory_budget,
        "host_budget": host_budget,
        "total_bytes": sum(o.bytes + o.host for o in chosen),
        "device_bytes": sum(o.bytes for o in chosen),
        "host_bytes": sum(o.host for o in chosen),
        "fp32_bytes": sum(fp32_bytes(t) for t in tables),
        "proxy": sum(o.error for o in chosen) / scale,
        "batch_size": batch_size,
        "tables": [
            {
                "name": o.config.name,
                "rows": o.config.num_embeddings,
                "dim": o.config.embedding_dim,
                "precision": o.config.stored_precision,
                "cache_ratio": o.config.cache_ratio,
                "associativity": o.config.associativity,
                "policy": o.config.policy,
                "placement": o.config.placement,
                "cache_slots": o.config.num_slots,
                "lookups": n,
                "hit_rate": o.hits / n if n else 0.0,
                "bytes": o.bytes + o.host,
                "device_bytes": o.bytes,
                "host_bytes": o.host,
            }
            for o, n in zip(chosen, lookups)
        ],
    }


def overrides(plan: dict) -> dict[str, dict]:
    """A plan's choices as per-table options (``{name: {field: value}}`` for the fields of
    :data:`PLANNED`), as a collection's ``per_table`` and ``RunConfig.tables`` take them. (A
    plan from before placements were planned has none: its tables are on the device.)"""
    return {
        t["name"]: {k: t.get(k, "device") if k == "placement" else t[k] for k in PLANNED}
        for t in plan["tables"]
    }


@dataclasses.dataclass(frozen=True)
class _Option:
    config: TableConfig
    bytes: int  # on the device
    host: int  # in host memory
    hits: int
    error: float  # misses * dim * rounding_noise: the table's share of the proxy, unscaled


def _tiers(config: TableConfig) -> tuple[int, int]:
    """(bytes on the device, bytes in host memory) of a table with ``config``."""
    m = memory_breakdown(config)
    return m["device"], m["host"]


def _measured(
    table: TableConfig, ids: torch.Tensor, batch_size: int, grid: dict, placements
) -> list[_Option]:
    """Every candidate of ``table`` in ``placements``, with its bytes, hits and error."""
    hits = {}  # (sets, ways, policy) -> hits: a replay depends on nothing else
    found = []
    for c in candidates(table, **grid, placements=placements):
        key = (c.num_sets, c.associativity, c.policy)
        if key not in hits:
            hits[key] = 0
            if c.num_slots and len(ids):
                r = replay(
                    ids,
                    table.num_embeddings,
                    batch_size,
                    c.cache_ratio,
                    c.policy,
                    c.ways,
                    c.lfu_count_bits,
                )
                hits[key] = r[0]["hits"]
        misses = len(ids) - hits[key]
        error = misses * c.embedding_dim * rounding_noise(c.stored_precision)
        found.append(_Option(c, *_tiers(c), hits[key], error))
    return found


def _frontier(found: list[_Option], lam: float) -> list[_Option]:
    """The options of ``found`` that no other beats in both device bytes and error + ``lam``
    x host bytes, cheapest first (ties: the first candidate), each with that sum as its
    error."""
    kept = []
    for value, o in sorted(
        ((o.error + lam * o.host, o) for o in found), key=lambda p: (p[1].bytes, p[0])
    ):
        if not kept or value < kept[-1].error:
            kept.append(dataclasses.replace(o, error=value))
    return kept


def _placed_search(found: list[list[_Option]], memory_budget: int, lam: float):
    """Each table's option (of ``found``, one list a table) that minimises the summed error +
    ``lam`` x host bytes with the device bytes within ``memory_budget`` (:func:`_search`); the
    options as found (their own errors); None if even the cheapest exceed the budget."""
    fronts = [_frontier(f, lam) for f in found]
    if sum(f[0].bytes for f in fronts) > memory_budget:
        return None
    picks = _search(fronts, memory_budget)
    by_config = [{o.config: o for o in f} for f in found]
    return [mine[f[k].config] for mine, f, k in zip(by_config, fronts, picks)]


# bisection steps of the host budget's multiplier (over about 20 decades: a ratio of 1.0000001)
_LAMBDA_STEPS = 40


def _placed_plan(found: list[list[_Option]], memory_budget: int, host_budget: int):
    """The options of the smallest proxy with the device's bytes within ``memory_budget`` and
    the host's within ``host_budget``, host bytes priced by a multiplier (see :func:`plan`)."""

    def host(chosen) -> int:
        return sum(o.host for o in chosen)

    most_host = sum(max(o.host for o in f) for f in found) + 1
    positive = [o.error for f in found for o in f if o.error > 0]
    # a tie-breaker: below any error difference that matters, it prefers the device
    lo = (min(positive) if positive else 1.0) * 1e-6 / most_host
    chosen = _placed_search(found, memory_budget, lo)
    if chosen is not None and host(chosen) <= host_budget:
        return chosen
    # above the summed errors, a host byte outweighs any proxy: the fewest host bytes
    hi = sum(max(o.error for o in f) for f in found) + 1.0
    best = _placed_search(found, memory_budget, hi)
    if best is None or host(best) > host_budget:
        raise ValueError(
            f"a device budget of {_size(memory_budget)} with a host budget of "
            f"{_size(host_budget)} cannot be met"
        )
    for _ in range(_LAMBDA_STEPS):
        mid = math.sqrt(lo * hi)
        chosen = _placed_search(found, memory_budget, mid)
        if chosen is not None and host(chosen) <= host_budget:
            hi, best = mid, chosen
        else:
            lo = mid
    return best


def _search(options: list[list[_Option]], memory_budget: int) -> list[int]:
    """The index of each table's option (each list cheapest first) that minimises the summed
    error with the summed bytes within ``memory_budget`` (at least the cheapest options' sum),
    exactly over the byte grid of :func:`plan`."""
    base = sum(o[0].bytes for o in options)
    step = max(1, -(-sum(o[-1].bytes - o[0].bytes for o in options) // _GRID_STEPS))
    cells = [[-(-(x.bytes - o[0].bytes) // step) for x in o] for o in options]
    size = min((memory_budget - base) // step, sum(c[-1] for c in cells)) + 1
    best = np.zeros(size)  # best[c]: least error of the tables so far within c steps
    picks = []
    for table_options, table_cells in zip(options, cells):
        error = np.full(size, np.inf)
        pick = np.zeros(size, dtype=np.int64)
        for k, (o, w) in enumerate(zip(table_options, table_cells)):
            if w >= size:
                break
            tail, new = error[w:], best[: size - w] + o.error
            better = new < tail
            tail[better] = new[better]
            pick[w:][better] = k
        best = error
        picks.append(pick)
    chosen, c = [], size - 1
    for pick, table_cells in zip(reversed(picks), reversed(cells)):
        chosen.append(int(pick[c]))
        c -= table_cells[chosen[-1]]
    return chosen[::-1]
