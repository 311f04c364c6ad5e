"""Scoring a model: on a split of its dataset (:func:`evaluate`), or a run's latest
checkpoint (:func:`evaluate_checkpoint`, ``dlrm evaluate``)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dlrm import checkpoint, distributed, metrics, run_dir
from dlrm.build import build_trainer, process_model, resolve_dataset, run_data
from dlrm.config import RunConfig
from dlrm.data import batches as data_batches
from dlrm.errors import RunError


def evaluate(
    model: nn.Module,
    dataset,
    split: str,
    batch_size: int,
    max_batches: int | None = None,
    ranks: distributed.Ranks = distributed.ONE_PROCESS,
    device: torch.device = distributed.CPU,
) -> dict:
    """Metrics of ``model`` (on ``device``) on ``split`` (all of it, or its first
    ``max_batches`` batches). Changes no state: the model is put in eval mode and gradients
    are off. Over several ranks each computes its part of every batch and all get the
    metrics of the whole."""
    was_training = model.training
    model.eval()
    labels, logits = [], []
    batches = itertools.islice(
        data_batches.iterate_batches(dataset, split, batch_size, part=ranks.part), max_batches
    )
    with torch.no_grad():
        for batch in data_batches.on_device(batches, device):
            logits.append(model(batch.dense, batch.ids).float())
            labels.append(batch.labels)
    model.train(was_training)
    if not labels:
        raise RunError(f"the {split} split is empty: more rows are needed")
    parts = ranks.gather((torch.cat(labels).cpu().numpy(), torch.cat(logits).cpu().numpy()))
    return metrics.evaluate(
        np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    )


def evaluate_checkpoint(cfg: RunConfig, out_dir: Path, split: str) -> dict:
    """Metrics of the latest checkpoint in ``out_dir`` on ``split``, with the run's own
    config, in ``cfg.nproc_per_node`` processes whatever number wrote it (each loads its
    own shards, cut anew at another world size). Reads ``out_dir`` only: it may run while
    the run trains."""
    ranks = distributed.Ranks.current()
    device = cfg.torch_device(ranks.rank)  # before any work: a device this machine has
    path = run_dir.require_checkpoint(out_dir)
    if cfg.nproc_per_node > 1 and ranks.world_size == 1:  # start the processes
        return distributed.launch(
            evaluate_checkpoint, cfg.nproc_per_node, cfg, out_dir, split, device_type=device.type
        )
    saved = checkpoint.open_checkpoint(path, ranks)
    try:
        cfg = dataclasses.replace(cfg, **{**cfg.ADDED_FIELDS, **saved["config"]})
        cfg.validate()
    except (TypeError, RunError) as e:
        raise RunError(f"{path}: the configuration it holds is not valid ({e})") from None
    data_dir, dataset = resolve_dataset(cfg, out_dir)
    model = process_model(cfg, list(dataset.meta["cardinalities"]), ranks, True, device)
    checkpoint.check(saved, path, cfg, run_data(data_dir, dataset))
    checkpoint.load_into(build_trainer(cfg, model), path, saved, ranks, device)
    return evaluate(model, dataset, split, cfg.batch_size, ranks=ranks, device=device)
