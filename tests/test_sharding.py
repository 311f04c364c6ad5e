"""Sharding our collections with TorchRec's DistributedModelParallel (2 processes, gloo, CPU).

The oracle is the unsharded collection trained in one process on the same global batches,
with the loss a fixed linear function of the pooled embeddings (of the rows, for the
unpooled collection), so that each gradient is exact and independent of how the ranks split
the batch: each rank's loss is the mean over its own samples (as DDP expects), TorchRec's
output communication divides the gradient by the world size on the way back (2: exact), and
so the tables must end byte-identical.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embcache import CachedLowPrecisionEmbeddingBagCollection, CachedLowPrecisionEmbeddingCollection
from embcache.sharding import (
    KERNEL,
    CachedEmbeddingBagCollectionSharder,
    CachedEmbeddingCollectionSharder,
)
from tests._distributed import features_of, run_ranks, shard_placed, skewed_features

ROWS = [3000, 2000, 4001, 50]  # t_3 is below min_rows_for_low_precision: FP32, no cache
DIM = 8
BATCH = 32  # per rank
STEPS = 6
OPTIONS = dict(
    precision="int8",
    rounding="stochastic",
    cache_ratio=0.05,
    associativity=4,
    policy="lfu",
    optimizer="rowwise_adagrad",
    lr=0.05,
    seed=7,
)
# The row-wise table has no cache and rounds to nearest: its shards then hold exactly the
# unsharded rows (a shard's own cache, and its rounding stream keyed by shard row, differ).
PER_TABLE = {"t_2": dict(rounding="nearest", cache_ratio=0.0)}


OWNER = {"t_0": 0, "t_1": 1, "t_3": 0}  # the rank of each table-wise table (modulo ranks)


def _placement(world_size: int) -> dict:
    placement = {
        t: table_wise(rank=rank % world_size, compute_kernel=KERNEL) for t, rank in OWNER.items()
    }
    return {**placement, "t_2": row_wise(compute_kernel=KERNEL)}


def _collection(device: str | None = None) -> CachedLowPrecisionEmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(
            name=f"t_{i}", num_embeddings=n, embedding_dim=DIM, feature_names=[f"f_{i}"]
        )
        for i, n in enumerate(ROWS)
    ]
    return CachedLowPrecisionEmbeddingBagCollection(
        tables, per_table=PER_TABLE, device=device, **OPTIONS
    )


def _global_batch(step: int, world_size: int):
    """Per feature: lengths ``[samples]`` and ids; the fixed weights of the linear loss."""
    gen = torch.Generator().manual_seed(1000 + step)
    samples = BATCH * world_size
    lengths, ids = skewed_features(gen, ROWS, samples)
    weights = torch.randn(samples, DIM * len(ROWS), generator=gen)
    return lengths, ids, weights


class _Model(nn.Module):
    def __init__(self, collection: nn.Module) -> None:
        super().__init__()
        self.ebc = collection

    def forward(self, features: KeyedJaggedTensor):
        return self.ebc(features)


def _train_sharded_and_reference(rank: int, world_size: int, build: str | None) -> None:
    """``build``: None (the model in memory), "meta" (built on the meta device), "cuda"
    (built on the meta device, sharded onto this rank's GPU)."""
    on = torch.device("cuda", rank) if build == "cuda" else torch.device("cpu")
    placement = _placement(world_size)
    model = _Model(_collection("meta" if build in ("meta", "cuda") else None))
    dmp, sharded = shard_placed(model, "ebc", placement, world_size, device=on)
    reference = _collection()
    first, last = rank * BATCH, (rank + 1) * BATCH
    for step in range(STEPS):
        lengths, ids, weights = _global_batch(step, world_size)
        expected = reference(features_of(lengths, ids, 0, BATCH * world_size))
        ((expected.values() * weights).sum() / (BATCH * world_size)).backward()
        reference.step()

        out = dmp(features_of(lengths, ids, first, last).to(on)).wait()
        assert out.keys() == expected.keys()
        mine, theirs = out.values().cpu(), expected.values()[first:last].detach()
        # table-wise features: the unsharded lookup exactly; the row-wise one is a sum of
        # per-shard partial sums, added in another order
        tw = [c for c in range(4 * DIM) if not 2 * DIM <= c < 3 * DIM]
        assert torch.equal(mine[:, tw].detach(), theirs[:, tw])
        torch.testing.assert_close(
            mine[:, 2 * DIM : 3 * DIM].detach(), theirs[:, 2 * DIM : 3 * DIM]
        )
        ((out.values() * weights[first:last].to(on)).sum() / BATCH).backward()
        sharded.step()

    _assert_shards_hold_the_unsharded_state(sharded, reference, rank, world_size)
    if rank == 0:  # the cached table really used its cache
        assert sharded.local_tables()["t_0"].stats()["hits"] > 0


def _assert_shards_hold_the_unsharded_state(sharded, reference, rank: int, world_size: int):
    """Each of this rank's shards holds what the reference's table (one process) holds: a
    table-wise shard its whole state, the row-wise shard its rows and their AdaGrad state."""
    local = sharded.local_tables()
    row_wise_shards = [name for name in local if name.startswith("t_2@")]
    owned = {t for t, owner in OWNER.items() if owner % world_size == rank}
    assert len(row_wise_shards) == 1 and set(local) == owned | set(row_wise_shards)
    for name, shard in local.items():
        table = reference.embedding_bags[name.split("@")[0]]
        if "@" in name:  # the row-wise shard: the unsharded rows and their AdaGrad state
            start = int(name.split("@")[1])
            stop = start + shard.config.num_embeddings
            assert torch.equal(shard.weights.cpu(), table.weights[start:stop])
            assert torch.equal(shard.optimizer_state.cpu(), table.optimizer_state[start:stop])
            assert shard.step_count == table.step_count == STEPS
            continue
        got, want = shard.state_dict(), table.state_dict()
        assert got.keys() == want.keys()
        for key in want:
            if isinstance(want[key], torch.Tensor):
                assert torch.equal(got[key].cpu(), want[key]), f"{name}.{key}"
            else:
                assert got[key] == want[key], f"{name}.{key}"


# "meta": the sharded model is built without memory, and each rank draws only its shards
@pytest.mark.parametrize("build", [None, "meta"])
def test_sharded_training_equals_one_process(build):
    run_ranks(_train_sharded_and_reference, 2, build)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not hasattr(torch.ops.embcache, "multi_lookup_forward"),
    reason="needs a CUDA GPU and a CUDA build of the kernels",
)
def test_sharded_training_on_cuda_equals_one_process_on_the_cpu():
    """Table-wise and row-wise shards on GPUs (NCCL; one rank on a machine of one GPU)."""
    world_size = min(2, torch.cuda.device_count())
    run_ranks(_train_sharded_and_reference, world_size, "cuda", backend="nccl")


# The unpooled collection: the same tables, t_1 and t_3 of another dimension. A sequence
# sharding's tables share a dimension, so the shardings are table-wise t_0 (rank 1 has no
# shard of it), table-wise t_1 and t_3, and row-wise t_2: their features come out of the
# shardings in another order than the unsharded one.
SEQUENCE_DIMS = [DIM, 4, DIM, 4]


def _unpooled_collection(
    precision: str, device: str | None = None
) -> CachedLowPrecisionEmbeddingCollection:
    tables = [
        EmbeddingConfig(name=f"t_{i}", num_embeddings=n, embedding_dim=d, feature_names=[f"f_{i}"])
        for i, (n, d) in enumerate(zip(ROWS, SEQUENCE_DIMS))
    ]
    options = {**OPTIONS, "precision": precision}
    if precision == "fp32":
        options["cache_ratio"] = 0.0
    return CachedLowPrecisionEmbeddingCollection(
        tables, per_table=PER_TABLE, device=device, **options
    )


def _train_unpooled_sharded_and_reference(
    rank: int, world_size: int, precision: str, build: str | None, seed: int
) -> None:
    """The sharded unpooled collection's rows and tables equal, bit for bit, those of the
    unsharded one trained in one process: every id's row comes from one shard (row-wise
    too, put back in the input's order), and each row's gradient is exact."""
    model = _Model(_unpooled_collection(precision, build))
    dmp, sharded = shard_placed(model, "ebc", _placement(world_size), world_size)
    assert type(sharded.local_collection) is CachedLowPrecisionEmbeddingCollection
    reference = _unpooled_collection(precision)
    samples, first, last = BATCH * world_size, rank * BATCH, (rank + 1) * BATCH
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(seed + step)
        lengths, ids = skewed_features(gen, ROWS, samples)
        weights = [torch.randn(len(i), d, generator=gen) for i, d in zip(ids, SEQUENCE_DIMS)]
        expected = reference(features_of(lengths, ids, 0, samples))
        sum((expected[f"f_{f}"].values() * w).sum() for f, w in enumerate(weights)).div(
            samples
        ).backward()
        reference.step()

        out = dmp(features_of(lengths, ids, first, last)).wait()
        assert list(out) == list(expected)
        loss = 0
        for f, w in enumerate(weights):
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[f].cumsum(0)])
            mine = slice(int(offsets[first]), int(offsets[last]))
            got, want = out[f"f_{f}"], expected[f"f_{f}"]
            assert torch.equal(got.lengths(), want.lengths()[first:last]), f"seed {seed}"
            assert torch.equal(got.values().detach(), want.values()[mine].detach()), (
                f"seed {seed}, step {step}, feature f_{f}"
            )
            loss = loss + (got.values() * w[mine]).sum()
        (loss / BATCH).backward()
        assert not sharded.has_nonfinite_grad()
        sharded.check_step()  # the trainer's dry run: changes nothing
        sharded.step()

    _assert_shards_hold_the_unsharded_state(sharded, reference, rank, world_size)
    if rank == 0 and precision != "fp32":  # the cached table really used its cache
        assert sharded.local_tables()["t_0"].stats()["hits"] > 0


# FP32 tables without a cache, built in memory; INT8 behind caches, built on the meta device
@pytest.mark.parametrize("precision, build", [("fp32", None), ("int8", "meta")])
def test_sharded_unpooled_training_equals_one_process(precision, build):
    seed = int(torch.randint(0, 1 << 30, ()))  # fresh inputs each run; failures name it
    run_ranks(_train_unpooled_sharded_and_reference, 2, precision, build, seed)


def _train_with_every_table_on_rank_0(rank: int, world_size: int, unpooled: bool, seed: int):
    """Rank 1 holds no shard: its empty lookups still take part in the backward
    communication, and rank 0's tables end as the unsharded ones do."""
    make = (lambda: _unpooled_collection("int8")) if unpooled else _collection
    placement = {f"t_{i}": table_wise(rank=0, compute_kernel=KERNEL) for i in range(len(ROWS))}
    dmp, sharded = shard_placed(_Model(make()), "ebc", placement, world_size)
    reference = make()
    samples, first, last = BATCH * world_size, rank * BATCH, (rank + 1) * BATCH

    def squares(out) -> torch.Tensor:  # its gradient, 2 x / samples, is exact
        rows = [jt.values() for jt in out.values()] if unpooled else [out.values()]
        return sum(r.pow(2).sum() for r in rows)

    for step in range(3):
        lengths, ids = skewed_features(torch.Generator().manual_seed(seed + step), ROWS, samples)
        (squares(reference(features_of(lengths, ids, 0, samples))) / samples).backward()
        reference.step()
        out = dmp(features_of(lengths, ids, first, last)).wait()
        (squares(out) / BATCH).backward()
        sharded.step()
    local = sharded.local_tables()
    assert set(local) == (set(reference.embedding_bags) if rank == 0 else set())
    for name, shard in local.items():
        for key, want in reference.embedding_bags[name].state_dict().items():
            got = shard.state_dict()[key]
            same = torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
            assert same, f"seed {seed}: {name}.{key}"


@pytest.mark.parametrize("unpooled", [False, True])
def test_a_rank_without_shards_takes_part_in_training(unpooled):
    seed = int(torch.randint(0, 1 << 30, ()))
    run_ranks(_train_with_every_table_on_rank_0, 2, unpooled, seed)


BIG_ROWS = 3_000_000  # per table: about 110 MB in INT8 with LFU counts and AdaGrad state


def _shard_big_tables_from_meta(rank: int, world_size: int, device: str | None) -> None:
    from embcache import CachedLowPrecisionEmbedding

    tables = [
        EmbeddingBagConfig(
            name=f"t_{i}", num_embeddings=BIG_ROWS, embedding_dim=16, feature_names=[f"f_{i}"]
        )
        for i in range(2)
    ]
    given = []  # every table given memory in this process: (name, rows)
    allocate = CachedLowPrecisionEmbedding._allocate_state

    def recorded(table, where):
        if where is None or where.type != "meta":
            given.append((table.config.name, table.config.num_embeddings))
        return allocate(table, where)

    CachedLowPrecisionEmbedding._allocate_state = recorded
    model = nn.ModuleDict()
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
    before = _peak_rss_kib()
    model["ebc"] = CachedLowPrecisionEmbeddingBagCollection(tables, device=device, **OPTIONS)
    placement = {f"t_{i}": table_wise(rank=i, compute_kernel=KERNEL) for i in range(2)}
    _, sharded = shard_placed(model, "ebc", placement, world_size)
    growth = (_peak_rss_kib() - before) * 1024
    (shard,) = sharded.local_tables().values()
    own = shard.memory_bytes()["total"]
    # Only the rank's own table was ever given memory (neither unsharded table was built) ...
    assert given == [(f"t_{rank}", BIG_ROWS)], given
    # ... and the peak is that table and DMP's working memory (measured 1.4-2.0x the table
    # on a loaded 2-core VM, 1.1-1.4x on a quiet one): the bound catches gross copies.
    assert own <= growth < 3 * own, (growth, own)


def _peak_rss_kib() -> int:
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0])


def test_sharding_from_meta_allocates_only_the_rank_s_shards():
    run_ranks(_shard_big_tables_from_meta, 2, "meta")


def test_copy_rows_from_refuses_and_changes_nothing():
    from embcache import CachedLowPrecisionEmbedding

    source = CachedLowPrecisionEmbedding(5000, DIM, name="big", cache_ratio=0.05, associativity=4)
    shard = CachedLowPrecisionEmbedding(1000, DIM, name="shard", cache_ratio=0.05, associativity=4)
    source(torch.arange(0, 5000, 7).view(-1, 1)).sum().backward()
    source.step()  # rows now cached
    before = {k: v.clone() for k, v in shard.state_dict().items() if isinstance(v, torch.Tensor)}
    other = CachedLowPrecisionEmbedding(5000, DIM, name="int4", precision="int4")
    for src, start, why in [
        (source, 0, "has cached rows"),
        (other, 0, "another format"),
        (source, 4500, r"rows \[4500, 5500\)"),
    ]:
        with pytest.raises(ValueError, match=f"table 'shard': cannot copy rows from .*{why}"):
            shard.copy_rows_from(src, start)
    for k, v in before.items():
        assert torch.equal(shard.state_dict()[k], v)
    source.flush()
    shard.copy_rows_from(source, 1000)
    assert torch.equal(shard.weights, source.weights[1000:2000])
    assert shard.step_count == source.step_count == 1
    assert torch.equal(shard.current_weight(), source.current_weight()[1000:2000])


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_a_shard_of_a_meta_table_holds_the_rows_the_table_draws(precision):
    from embcache import CachedLowPrecisionEmbedding

    rows = 200_000  # chunks of 2^16 rows: shards start and end inside and across them
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    options = dict(
        precision=precision,
        cache_ratio=0.05,
        policy="lfu",
        seed=5,
        table_id=3,
        optimizer="rowwise_adagrad",
        min_rows_for_low_precision=0,
    )
    whole = CachedLowPrecisionEmbedding(rows, DIM, **options)
    meta = CachedLowPrecisionEmbedding(rows, DIM, device="meta", **options)
    assert all(b.is_meta for b in meta.buffers())
    start, size = sorted(torch.randint(0, rows, (2,), generator=gen).tolist())
    for first, n in [(start, size - start + 1), (0, rows), (65_536, 65_536), (rows - 7, 7)]:
        shard = CachedLowPrecisionEmbedding(n, DIM, device="meta", **options)
        shard.copy_rows_from(meta, first)
        assert torch.equal(shard.weights, whole.weights[first : first + n])
        assert not shard.optimizer_state.any() and not shard.counts.any()
        assert (shard.cache_tags == -1).all()
    with pytest.raises(ValueError, match="table 'table': it is on the meta device"):
        meta(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="table 'table': a table on the meta device takes no"):
        CachedLowPrecisionEmbedding(3, DIM, device="meta", weight=torch.zeros(3, DIM))


@pytest.mark.parametrize(
    "placement, message",
    [
        (
            {"t_1": table_wise(rank=0, compute_kernel=KERNEL)},
            "table 't_0': the sharding plan does not place it",
        ),
        (
            dict.fromkeys(["t_0", "t_1"], table_wise(rank=0)),
            "table 't_0': compute kernel .* is not ours",
        ),
    ],
)
@pytest.mark.parametrize("unpooled", [False, True])
def test_sharder_refuses_a_plan_it_cannot_run(placement, message, unpooled):
    if unpooled:
        sharder, ebc = CachedEmbeddingCollectionSharder(), _unpooled_collection("int8")
    else:
        sharder, ebc = CachedEmbeddingBagCollectionSharder(), _collection()
    full = {f"t_{i}": table_wise(rank=0, compute_kernel=KERNEL) for i in range(len(ROWS))}
    plan = construct_module_sharding_plan(
        ebc, {**full, **placement}, sharder=sharder, local_size=1, world_size=1, device_type="cpu"
    )
    if "t_0" not in placement and "t_0" in plan:  # a plan that leaves t_0 out
        del plan["t_0"]
    with pytest.raises(ValueError, match=message):
        sharder.shard(ebc, plan, ShardingEnv(world_size=1, rank=0, pg=None))


def _planning_model(ebc: nn.Module) -> nn.Module:
    model = nn.Module()
    model.ebc = ebc
    return model


def test_planner_places_tables_by_their_real_bytes():
    """FP32 tables that exceed the per-rank budget fit as INT8 behind a 5% cache, and the
    planner's storage for a whole table is the bytes the table really allocates."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from embcache.sharding import CachedTableEstimator, planner, shard_bytes

    tables = [
        EmbeddingBagConfig(
            name=f"t_{i}", num_embeddings=200_000, embedding_dim=16, feature_names=[f"f_{i}"]
        )
        for i in range(4)
    ]
    budget = 20 << 20  # bytes of host memory per rank; FP32 needs 25.6 MiB a rank
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=budget)
    fp32 = _planning_model(EmbeddingBagCollection(tables, device=torch.device("meta")))
    with pytest.raises(PlannerError):
        EmbeddingShardingPlanner(topology=topology).plan(fp32, [EmbeddingBagCollectionSharder()])

    ebc = CachedLowPrecisionEmbeddingBagCollection(
        tables, precision="int8", cache_ratio=0.05, optimizer="rowwise_adagrad"
    )
    sharder = CachedEmbeddingBagCollectionSharder()
    plan = planner(topology).plan(_planning_model(ebc), [sharder])
    per_rank = [0, 0]
    for name, ps in plan.plan["ebc"].items():
        config = ebc.embedding_bags[name].config
        for shard in ps.sharding_spec.shards:
            rank = int(str(shard.placement).split("rank:")[1].split("/")[0])
            per_rank[rank] += shard_bytes(config, shard.shard_sizes[0])
    assert 0 < max(per_rank) <= budget

    options = EmbeddingEnumerator(
        topology, 512, estimator=CachedTableEstimator(topology)
    ).enumerate(_planning_model(ebc), [sharder])
    whole = [o for o in options if o.sharding_type == "table_wise"]
    assert {o.name for o in whole} == set(ebc.embedding_bags)
    for o in whole:
        (shard,) = o.shards
        assert shard.storage.ddr == ebc.embedding_bags[o.name].memory_bytes()["total"]
        assert shard.storage.hbm == 0


def test_default_constraints_split_only_tables_larger_than_a_rank_s_share():
    from torchrec.distributed.planner import Topology

    from embcache.sharding import default_constraints, planner

    rows = [400_000, 100_000, 50_000, 30_000, 2_000, 50]
    tables = [
        EmbeddingBagConfig(
            name=f"t_{i}", num_embeddings=n, embedding_dim=16, feature_names=[f"f_{i}"]
        )
        for i, n in enumerate(rows)
    ]
    ebc = CachedLowPrecisionEmbeddingBagCollection(tables, device="meta", **OPTIONS)
    share = sum(t.memory_bytes()["total"] for t in ebc.tables()) / 4
    constraints = default_constraints(ebc, world_size=4)
    plan = planner(Topology(world_size=4, compute_device="cpu"), 512, constraints).plan(
        _planning_model(ebc), [CachedEmbeddingBagCollectionSharder()]
    )
    for name, ps in plan.plan["ebc"].items():
        large = ebc.embedding_bags[name].memory_bytes()["total"] > share
        assert ps.sharding_type == ("row_wise" if large else "table_wise"), name
        assert len(ps.ranks) == (4 if large else 1)
    assert plan.plan["ebc"]["t_0"].sharding_type == "row_wise"
