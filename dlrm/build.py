"""What a run is made of, from its configuration: its data (generated once if synthetic),
its model (sharded over the ranks of a launched run) and its trainer."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from dlrm import distributed
from dlrm.config import RunConfig
from dlrm.data import batches as data_batches
from dlrm.data.criteo import DataError
from dlrm.data.synthetic import SyntheticCriteo
from dlrm.errors import RunError
from dlrm.mixed_precision import MixedPrecisionTrainer, make_scaler
from dlrm.model import DLRM, PRESETS, SPARSE_KEYS, TABLE_NAMES
from dlrm.torchrec_adapter import make_torchrec_ebc
from embcache.multi_table import BagTable, CachedLowPrecisionEmbeddingBags


def resolve_data(cfg: RunConfig, root: Path) -> Path:
    """The preprocessed directory of the run; the synthetic default is generated once into
    ``root/data/...`` (deterministic for the seed)."""
    if cfg.data != "synthetic":
        path = Path(cfg.data)
        data_batches.read_meta(path)  # DataError if not a preprocessed directory
        return path
    path = (
        root
        / "data"
        / f"synthetic-scale{cfg.synthetic_scale}-rows{cfg.synthetic_rows}-seed{cfg.seed}"
    )
    if not (path / "meta.json").exists():
        SyntheticCriteo(scale=cfg.synthetic_scale, seed=cfg.seed).write(
            path, cfg.synthetic_rows, progress=cfg.progress and sys.stderr.isatty()
        )
    return path


def resolve_dataset(cfg: RunConfig, out_dir: Path):
    """(directory, dataset) of the run's data (generated once if synthetic)."""
    try:
        data_dir = resolve_data(cfg, out_dir.parent if out_dir.parent != out_dir else out_dir)
        return data_dir, data_batches.load(data_dir)
    except DataError as e:
        raise RunError(str(e)) from None


def run_data(data_dir: Path, dataset) -> dict:
    """What a checkpoint records of its dataset (see :func:`dlrm.checkpoint.check`)."""
    return {"dir": str(Path(data_dir).resolve()), "fingerprint": dataset.meta["fingerprint"]}


def build_model(
    cfg: RunConfig,
    cardinalities: list[int],
    device: torch.device | str = "cpu",
    *,
    tables_on_meta: bool = False,
    keyed: bool = False,
) -> DLRM:
    """The run's DLRM on ``device``, drawn on the CPU whatever the device (the same initial
    model everywhere). Our tables are one
    :class:`~embcache.multi_table.CachedLowPrecisionEmbeddingBags` (torch only), or, ``keyed``,
    TorchRec's collection interface over them (for DMP to shard). ``tables_on_meta``: the
    tables without memory (to be sharded, or filled by a checkpoint), the dense part on
    ``device``."""
    torch.manual_seed(cfg.seed)
    dim = PRESETS[cfg.preset].embedding_dim
    where = "meta" if tables_on_meta else None
    if cfg.embeddings == "torchrec":  # the FP32 baseline; else ours (RunConfig.validate)
        tables = make_torchrec_ebc(cardinalities, dim, SPARSE_KEYS, device=where)
    else:
        bags = [
            BagTable(name, n, dim, (key,))
            for name, n, key in zip(TABLE_NAMES, cardinalities, SPARSE_KEYS)
        ]
        kind = CachedLowPrecisionEmbeddingBags
        if keyed:
            from embcache.collection import CachedLowPrecisionEmbeddingBagCollection as kind

        tables = kind.from_bag_tables(
            bags, per_table=cfg.tables, device=where, **cfg.table_defaults()
        )
    model = DLRM.from_preset(cfg.preset, tables)
    return model.dense_to(device) if tables_on_meta else model.to(device)


def process_model(
    cfg: RunConfig, cardinalities: list[int], ranks, loading: bool, device: torch.device
) -> nn.Module:
    """This process's model on ``device``: over several ranks DMP's, with only the rank's
    shards (built from the meta device); in one process the whole model, its tables left
    without memory when a checkpoint is about to fill them (``loading``: they are then
    filled in host memory, and the caller moves them to ``device``), so none is drawn in
    vain."""
    if ranks.world_size > 1:
        model = build_model(cfg, cardinalities, device, tables_on_meta=True, keyed=True)
        return distributed.shard(model, ranks, cfg.batch_size, cfg.memory_budget, device)
    return build_model(cfg, cardinalities, device, tables_on_meta=loading)


def build_trainer(cfg: RunConfig, model: DLRM) -> MixedPrecisionTrainer:
    kwargs = {"scale": cfg.static_scale} if cfg.loss_scaler == "static" else {}
    return MixedPrecisionTrainer(
        model,
        dense_precision=cfg.dense_precision,
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        scaler=make_scaler(cfg.loss_scaler, **kwargs),
    )
