"""The one door from ``dlrm`` to TorchRec. A single-process run with our tables needs only
torch; TorchRec is imported, here and in :mod:`dlrm.distributed`, only where a run uses it:
its FP32 ``EmbeddingBagCollection`` (``--embeddings torchrec``), or several processes, whose
tables ``DistributedModelParallel`` shards (``--nproc-per-node``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import Tensor, nn

_DMP_MODULE = "torchrec.distributed.model_parallel"


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is a TorchRec ``DistributedModelParallel`` (without importing
    TorchRec: a model cannot be one unless TorchRec has been imported)."""
    module = sys.modules.get(_DMP_MODULE)
    return module is not None and isinstance(model, module.DistributedModelParallel)


def unwrap(model: nn.Module) -> nn.Module:
    """The model a ``DistributedModelParallel`` wraps, or ``model`` itself."""
    return model.module if is_sharded(model) else model


def takes_keyed_input(embeddings: nn.Module) -> bool:
    """Whether ``embeddings`` has TorchRec's ``EmbeddingBagCollection`` interface
    (``KeyedJaggedTensor`` in, ``KeyedTensor`` out: TorchRec's own collection, ours in
    :mod:`embcache.collection`, and what DMP makes of them) rather than taking the ids as a
    tensor (:class:`embcache.multi_table.CachedLowPrecisionEmbeddingBags`)."""
    return hasattr(embeddings, "embedding_bag_configs")


def kjt_from_ids(ids: Tensor, keys: Sequence[str]):
    """One id per sample and feature (``ids[b, k]``, shape ``[B, len(keys)]``, Criteo's one-hot
    case) as a ``KeyedJaggedTensor``: ``values`` feature-major, every length 1."""
    from torchrec import KeyedJaggedTensor

    if ids.dim() != 2 or ids.shape[1] != len(keys):
        raise ValueError(f"ids must have shape [B, {len(keys)}], got {tuple(ids.shape)}")
    return KeyedJaggedTensor(
        keys=list(keys),
        values=ids.t().reshape(-1).long(),
        lengths=torch.ones(ids.numel(), dtype=torch.int32, device=ids.device),
        stride=ids.shape[0],
    )


def make_torchrec_ebc(
    cardinalities: Sequence[int],
    dim: int,
    keys: Sequence[str],
    device: torch.device | str | None = None,
) -> nn.Module:
    """TorchRec's FP32 ``EmbeddingBagCollection`` (the baseline): table ``t_k`` of
    ``cardinalities[k]`` rows serves feature ``keys[k]``, pooled by sum. Rows are
    initialised by TorchRec's default, uniform in ``+-sqrt(1 / rows)`` -- the reference
    DLRM's initialisation."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(
            name=f"t_{k}",
            num_embeddings=int(rows),
            embedding_dim=dim,
            feature_names=[key],
        )
        for k, (rows, key) in enumerate(zip(cardinalities, keys))
    ]
    return EmbeddingBagCollection(tables=tables, device=device)
