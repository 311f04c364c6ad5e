"""A run's tables planned to a memory budget (``--memory-budget``, ``dlrm plan``; docs/design.md,
"The memory-budget planner"): :func:`embcache.planner.plan` on the ids of the first
``plan_rows`` rows the run trains on, in the order it reads them. The budget is per process:
the tables of a run of ``--nproc-per-node`` processes are planned to that many budgets, and
TorchRec's planner shards them so that each process holds at most one
(:func:`dlrm.distributed.shard`). With ``--host-memory-budget`` (one process) the plan places
each table too: on the device, or its storage in pinned host memory and its cache on the
device (docs/design.md, "Host placement")."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from dlrm.config import RunConfig
from dlrm.data import batches as data_batches
from dlrm.data.synthetic import scaled_cardinalities
from dlrm.errors import RunError
from dlrm.model import TABLE_NAMES
from embcache import planner


def run_cardinalities(cfg: RunConfig) -> list[int]:
    """The run's table sizes without reading the data: the synthetic data's from the options,
    else from the directory's meta.json (``DataError`` if it has none)."""
    if cfg.data == "synthetic":
        return scaled_cardinalities(cfg.synthetic_scale)
    return data_batches.cardinalities(cfg.data)


def tables_budget(cfg: RunConfig) -> int:
    """The bytes all the run's tables may take: ``--memory-budget`` in each process."""
    return cfg.memory_budget * cfg.nproc_per_node


def refuse_unmeetable(cfg: RunConfig, cardinalities: list[int]) -> None:
    """``RunError`` (one line naming the option) if ``cfg.memory_budget`` is below the smallest
    budget a plan of its tables can meet (the message names that budget, per process), with
    ``--host-memory-budget`` if the two cannot be met together, or if ``--table`` or
    ``--placement`` sets a field the plan chooses."""
    for name, options in cfg.tables.items():
        fixed = sorted(set(options) & set(planner.PLANNED))
        if fixed:
            raise RunError(f"--table {name}: {fixed[0]} is chosen by --memory-budget, leave it out")
    if cfg.placement != "device":
        raise RunError(
            f"--placement {cfg.placement}: with --memory-budget each table's placement is "
            "planned (on the device, or in host memory within --host-memory-budget): leave it out"
        )
    tables = cfg.table_configs(cardinalities)
    n = cfg.nproc_per_node
    try:
        planner.check_budget(tables, tables_budget(cfg), cfg.host_memory_budget)
    except ValueError as e:
        if cfg.host_memory_budget is not None:
            raise RunError(f"--memory-budget with --host-memory-budget: {e}") from None
        if n == 1:
            raise RunError(f"--memory-budget: {e}") from None
        least = -(-planner.smallest_budget(tables) // n)
        raise RunError(
            f"--memory-budget: {cfg.memory_budget:,} bytes a process cannot be met by {n} "
            f"processes: the smallest that can is {least:,} bytes ({least / 2**20:.1f} MiB) "
            "a process"
        ) from None


def sample_ids(cfg: RunConfig, dataset: data_batches.Dataset) -> dict[str, torch.Tensor]:
    """Each table's ids in the first ``cfg.plan_rows`` rows (whole batches, at least one) of
    the run's first epoch, in the order training reads them."""
    batches = data_batches.iterate_batches(
        dataset, "train", cfg.batch_size, shuffle=True, seed=cfg.seed, drop_last=True
    )
    first = itertools.islice(batches, max(1, cfg.plan_rows // cfg.batch_size))
    parts = [b.ids.t().long() for b in first]  # [26, B]: a row per table
    if not parts:
        raise RunError(f"the train split has fewer rows than one batch of {cfg.batch_size}")
    return dict(zip(TABLE_NAMES, torch.cat(parts, dim=1)))


def plan_run(cfg: RunConfig, dataset: data_batches.Dataset) -> dict:
    """The plan (:func:`embcache.planner.plan`) of the run's tables for ``cfg.memory_budget``
    from :func:`sample_ids`; refused as :func:`refuse_unmeetable` refuses."""
    cardinalities = list(dataset.meta["cardinalities"])
    refuse_unmeetable(cfg, cardinalities)
    return planner.plan(
        cfg.table_configs(cardinalities),
        tables_budget(cfg),
        sample_ids(cfg, dataset),
        host_budget=cfg.host_memory_budget,
        batch_size=cfg.batch_size,
    )


def with_plan(cfg: RunConfig, plan: dict) -> RunConfig:
    """``cfg`` with the plan's choices as its per-table options (beside ``--table``'s)."""
    tables = {n: {**cfg.tables.get(n, {}), **o} for n, o in planner.overrides(plan).items()}
    return dataclasses.replace(cfg, tables=tables)
