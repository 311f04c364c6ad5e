"""A run's tables planned to a memory budget (``--memory-budget``, ``dlrm plan``; docs/design.md,
"The memory-budget planner"): :func:`embcache.planner.plan` on the ids of the first
``plan_rows`` rows the run trains on, in the order it reads them."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from dlrm.config import RunConfig
from dlrm.data import batches as data_batches
from dlrm.data.criteo import NUM_SPARSE
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


def refuse_unmeetable(cfg: RunConfig, cardinalities: list[int]) -> None:
    """``RunError`` (one line naming the option) if ``cfg.memory_budget`` is below the smallest
    budget a plan of its tables can meet (the message names that budget), or if ``--table``
    sets a field the plan chooses."""
    for name, options in cfg.tables.items():
        fixed = sorted(set(options) & set(planner.PLANNED))
        if fixed:
            raise RunError(f"--table {name}: {fixed[0]} is chosen by --memory-budget, leave it out")
    try:
        planner.check_budget(cfg.table_configs(cardinalities), cfg.memory_budget)
    except ValueError as e:
        raise RunError(f"--memory-budget: {e}") from None


def sample_ids(cfg: RunConfig, dataset: data_batches.Dataset) -> dict[str, torch.Tensor]:
    """Each table's ids in the first ``cfg.plan_rows`` rows (whole batches, at least one) of
    the run's first epoch, in the order training reads them."""
    batches = data_batches.iterate_batches(
        dataset, "train", cfg.batch_size, shuffle=True, seed=cfg.seed, drop_last=True
    )
    first = itertools.islice(batches, max(1, cfg.plan_rows // cfg.batch_size))
    # a batch's ids are key after key, one per sample (dlrm.data.batches.make_batch)
    parts = [b.sparse.values().view(NUM_SPARSE, -1) for b in first]
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
        cfg.memory_budget,
        sample_ids(cfg, dataset),
        batch_size=cfg.batch_size,
    )


def with_plan(cfg: RunConfig, plan: dict) -> RunConfig:
    """``cfg`` with the plan's choices as its per-table options (beside ``--table``'s)."""
    tables = {n: {**cfg.tables.get(n, {}), **o} for n, o in planner.overrides(plan).items()}
    return dataclasses.replace(cfg, tables=tables)
