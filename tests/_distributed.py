"""Run a test body in several processes joined by a gloo process group (CPU)."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embcache.collection import CachedLowPrecisionEmbeddingCollection
from embcache.sharding import (
    CachedEmbeddingBagCollectionSharder,
    CachedEmbeddingCollectionSharder,
    ShardedCachedEmbeddingBagCollection,
    ShardedCachedEmbeddingCollection,
)

# A collective waiting on a dead or stuck rank raises after this long instead of hanging.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
CPU = torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, backend: str, body, args) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(body, world_size: int = 2, *args, backend: str = "gloo") -> None:
    """Call ``body(rank, world_size, *args)`` in ``world_size`` spawned processes with the
    default process group initialised (``nccl``: rank ``r`` on GPU ``r``); an exception in
    any rank fails the caller (with that rank's traceback) and ends the others. ``body``
    must be a module-level function."""
    mp.spawn(
        _entry,
        args=(world_size, _free_port(), backend, body, args),
        nprocs=world_size,
        join=True,
    )


def skewed_features(gen: torch.Generator, rows: list[int], samples: int):
    """Feature ``f`` of ``samples`` samples: lengths ``[F, samples]`` of 0-3 ids, and the ids
    of each feature, skewed towards small ids so that caches see hits."""
    lengths = torch.randint(0, 4, (len(rows), samples), generator=gen)
    ids = [
        (torch.rand(int(lengths[f].sum()), generator=gen) ** 3 * n).long()
        for f, n in enumerate(rows)
    ]
    return lengths, ids


def features_of(lengths: torch.Tensor, ids: list, first: int, last: int) -> KeyedJaggedTensor:
    """The KJT (keys ``f_0``, ``f_1``, ...) of samples ``[first, last)`` of ``skewed_features``."""
    values = []
    for f in range(len(ids)):
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[f].cumsum(0)])
        values.append(ids[f][offsets[first] : offsets[last]])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{f}" for f in range(len(ids))],
        values=torch.cat(values),
        lengths=lengths[:, first:last].reshape(-1),
    )


def shard_placed(
    model: nn.Module,
    name: str,
    placement: dict,
    world_size: int,
    device: torch.device = CPU,
    **dmp_options,
) -> tuple[
    DistributedModelParallel,
    ShardedCachedEmbeddingBagCollection | ShardedCachedEmbeddingCollection,
]:
    """``model`` in TorchRec's DMP over the default group on ``device``, its collection
    ``model.<name>`` (pooled or unpooled) sharded by our sharder of its kind as ``placement``
    (table -> parameter sharding) says; and this rank's sharded collection."""
    unpooled = isinstance(getattr(model, name), CachedLowPrecisionEmbeddingCollection)
    sharder = (
        CachedEmbeddingCollectionSharder() if unpooled else CachedEmbeddingBagCollectionSharder()
    )
    plan = construct_module_sharding_plan(
        getattr(model, name),
        placement,
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type=device.type,
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=device,
        plan=ShardingPlan({name: plan}),
        sharders=[sharder],
        **dmp_options,
    )
    (sharded,) = [m for m in dmp.modules() if isinstance(m, sharder.sharded_module_type)]
    return dmp, sharded
