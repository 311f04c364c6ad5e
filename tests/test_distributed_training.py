"""Mixed-precision DLRM training with sharded tables across 2 processes (gloo, CPU).

The reference is the same model trained by one process on the same global batches. DDP
averages the ranks' FP16 dense gradients in FP16: each rank's half-batch sum is rounded to
FP16 before the two are added, where one process rounds the whole sum once. The masters
then differ by about an FP16 rounding of a gradient times the learning rate (rtol 1e-3),
and the tables, whose gradients depend on the dense weights, agree except for the rare
element whose stochastic rounding such a difference flips (one quantization step; a row's
INT8 scale moves all its elements at once). 0.1-1.2% of elements differ over the initial
tables tried; the test allows 2%. SGD everywhere, so that a gradient of the wrong scale
shows.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torchrec.distributed.sharding_plan import (
    row_wise,
    table_wise,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from dlrm.mixed_precision import BackoffScaler, MixedPrecisionTrainer, StepRefusedError
from dlrm.model import DLRM
from embcache import CachedLowPrecisionEmbeddingBagCollection
from embcache.sharding import (
    KERNEL,
    ShardedCachedEmbeddingBagCollection,
)
from tests._distributed import features_of, run_ranks, shard_placed, skewed_features

ROWS = [3000, 2000, 4001, 50]
DIM = 8
BATCH = 32  # per rank
OPTIONS = dict(
    precision="int8",
    rounding="stochastic",
    cache_ratio=0.05,
    associativity=4,
    policy="lfu",
    optimizer="sgd",
    lr=0.5,
    seed=3,
)
# t_1 (on rank 1 alone) is FP16: a large finite gradient makes it refuse (|x| > 65504)
PER_TABLE = {"t_1": dict(precision="fp16")}
PLACEMENT = {
    "t_0": table_wise(rank=0, compute_kernel=KERNEL),
    "t_1": table_wise(rank=1, compute_kernel=KERNEL),
    "t_2": row_wise(compute_kernel=KERNEL),
    "t_3": table_wise(rank=0, compute_kernel=KERNEL),
}


def _model() -> DLRM:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name=f"t_{i}", num_embeddings=n, embedding_dim=DIM, feature_names=[f"f_{i}"]
        )
        for i, n in enumerate(ROWS)
    ]
    ebc = CachedLowPrecisionEmbeddingBagCollection(tables, per_table=PER_TABLE, **OPTIONS)
    return DLRM(ebc, bottom_mlp=(3, 16, DIM), top_mlp=(16, 1), num_sparse_features=len(ROWS))


def _trainer(model, dense_precision: str = "fp16") -> MixedPrecisionTrainer:
    return MixedPrecisionTrainer(
        model,
        dense_precision=dense_precision,
        optimizer="sgd",
        lr=0.1,
        scaler=BackoffScaler(2.0**12),
    )


def _sharded_trainer(
    world_size: int, dense_precision: str = "fp16"
) -> tuple[MixedPrecisionTrainer, ShardedCachedEmbeddingBagCollection]:
    dmp, sharded = shard_placed(
        _model(), "embedding_collection", PLACEMENT, world_size, init_data_parallel=False
    )
    trainer = _trainer(dmp, dense_precision)
    return trainer, sharded


def _global_batch(step: int, world_size: int):
    gen = torch.Generator().manual_seed(500 + step)
    samples = BATCH * world_size
    lengths, ids = skewed_features(gen, ROWS, samples)
    dense = torch.randn(samples, 3, generator=gen)
    labels = torch.randint(0, 2, (samples,), generator=gen).float()
    return lengths, ids, dense, labels


def _slice(batch, first: int, last: int):
    lengths, ids, dense, labels = batch
    return dense[first:last], features_of(lengths, ids, first, last), labels[first:last]


def _train_like_one_process(rank: int, world_size: int) -> None:
    trainer, sharded = _sharded_trainer(world_size)
    reference = _trainer(_model())
    first, last = rank * BATCH, (rank + 1) * BATCH
    for step in range(6):
        batch = _global_batch(step, world_size)
        want = reference.train_step(*_slice(batch, 0, BATCH * world_size))
        got = trainer.train_step(*_slice(batch, first, last))
        assert got["skipped"] == want["skipped"] and got["scale"] == want["scale"]
        assert math.isclose(got["max_abs_grad"], want["max_abs_grad"], rel_tol=1e-3)
    assert trainer.report.skipped == reference.report.skipped
    for mine, theirs in zip(trainer.masters, reference.masters):
        torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-5)
    ref_tables = reference.model.embedding_collection.embedding_bags
    exact = total = 0
    for name, shard in sharded.local_tables().items():
        table = ref_tables[name.split("@")[0]]
        start = int(name.split("@")[1]) if "@" in name else 0
        theirs = table.current_weight()[start : start + shard.config.num_embeddings]
        mine = shard.current_weight()
        if "@" not in name:  # the row-wise shard has its own cache: the table rows differ
            step = (theirs.amax(1) - theirs.amin(1)).max() / 255
            torch.testing.assert_close(mine, theirs, atol=float(step) * 1.01, rtol=0)
            exact += int((mine == theirs).sum())
            total += mine.numel()
        assert shard.step_count == table.step_count == 6
    assert exact >= 0.98 * total, (exact, total)


def _one_rank_overflows_then_refuses(rank: int, world_size: int, dense_precision: str) -> None:
    """Rank 0 makes its dense step while the decision is on its way (its gradients are
    finite), so each skip or refusal undoes it from the backup: FP16 dense weights have FP32
    masters; FP32 ones are parameters that require grad."""
    trainer, sharded = _sharded_trainer(world_size, dense_precision)
    first, last = rank * BATCH, (rank + 1) * BATCH
    blow_up = {"factor": None}

    def hook(module, inputs, output):
        if blow_up["factor"] is not None and rank == 1:
            factor = blow_up["factor"]
            output.values().register_hook(lambda g: g * factor)

    sharded.local_collection.register_forward_hook(hook)
    trainer.train_step(*_slice(_global_batch(0, world_size), first, last))

    def state():  # lookups and hits count every forward, also a skipped step's: left out
        tables = copy.deepcopy({k: t.state_dict() for k, t in sharded.local_tables().items()})
        for table in tables.values():
            for key in ("lookups", "hits"):
                del table["_extra_state"]["stats"][key]
        return copy.deepcopy(
            {
                "tables": tables,
                "masters": trainer.masters,
                "optimizer": trainer.optimizer.state_dict(),
                "dense": [p.detach().clone() for p in trainer.dense_params],
            }
        )

    # rank 1's embedding gradient alone is non-finite: both ranks skip, nothing changes
    before, scale = state(), trainer.scaler.scale
    blow_up["factor"] = math.inf
    out = trainer.train_step(*_slice(_global_batch(1, world_size), first, last))
    assert out["skipped"] and trainer.report.skipped == 1
    assert trainer.scaler.scale == scale / 2
    _same(state(), before)

    # rank 1's FP16 table cannot store its update: both ranks refuse, nothing changes
    blow_up["factor"] = 1e9
    before, steps = state(), trainer.report.steps
    try:
        trainer.train_step(*_slice(_global_batch(2, world_size), first, last))
    except StepRefusedError as e:
        reason = str(e)
    else:
        raise AssertionError(f"rank {rank}: the step was not refused")
    want = "table 't_1'" if rank == 1 else "an embedding shard on another rank refused"
    assert want in reason, reason
    assert trainer.report.steps == steps
    _same(state(), before)

    blow_up["factor"] = None
    out = trainer.train_step(*_slice(_global_batch(3, world_size), first, last))
    assert not out["skipped"] and not out["stop"]

    # rank 1 alone asks to stop (a signal reached it first): every rank learns it this step
    out = trainer.train_step(*_slice(_global_batch(4, world_size), first, last), stop=rank == 1)
    assert out["stop"]


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def test_sharded_mixed_precision_training_follows_one_process():
    run_ranks(_train_like_one_process, 2)


@pytest.mark.parametrize("dense_precision", ["fp16", "fp32"])
def test_overflow_or_refusal_on_one_rank_stops_the_step_on_all(dense_precision):
    run_ranks(_one_rank_overflows_then_refuses, 2, dense_precision)
