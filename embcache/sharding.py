"""TorchRec model parallelism for :class:`CachedLowPrecisionEmbeddingBagCollection` and
:class:`CachedLowPrecisionEmbeddingCollection`.

:class:`CachedEmbeddingBagCollectionSharder` lets ``DistributedModelParallel`` shard our pooled
collection as it shards its own ``EmbeddingBagCollection``, and
:class:`CachedEmbeddingCollectionSharder` our unpooled one as it shards its own
``EmbeddingCollection``: TorchRec's planner places the tables, TorchRec's table-wise and
row-wise shardings move the data (a ``KeyedJaggedTensor`` all-to-all in; out, a pooled-embedding
all-to-all, or reduce-scatter for row-wise, for the pooled collection, and a sequence-embedding
all-to-all, with row-wise's unbucketize permute, for the unpooled one), and our kernels do the
local lookup and the fused update. Each rank holds its shards as an ordinary collection of the
sharded one's kind, so every single-process contract (formats, rounding, cache rule,
all-or-nothing update) holds per shard.

Example (two processes; see ``tests/test_sharding.py``)::

    sharder = CachedEmbeddingBagCollectionSharder()  # CachedEmbeddingCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc, {"t_0": table_wise(rank=0), "t_1": row_wise()}, sharder=sharder,
        local_size=2, world_size=2, device_type="cpu")
    model = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": plan}), sharders=[sharder])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TypeVar

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionAwaitable, EmbeddingCollectionContext
from torchrec.distributed.embedding_sharding import (
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
    KJTListSplitsAwaitable,
)
from torchrec.distributed.embedding_types import (
    BaseEmbeddingSharder,
    EmbeddingComputeKernel,
    KJTList,
    ShardedEmbeddingModule,
)
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionAwaitable,
    EmbeddingBagCollectionContext,
)
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
)
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    ShardEstimator,
    Storage,
    StorageReservation,
)
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import (
    BaseRwEmbeddingSharding,
    RwPooledEmbeddingSharding,
    RwSparseFeaturesDist,
)
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.types import (
    Awaitable,
    EmbeddingModuleShardingPlan,
    LazyAwaitable,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    EmbeddingTableConfig,
    PoolingType,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Multistreamable

from embcache.collection import (
    CachedLowPrecisionEmbeddingBagCollection,
    CachedLowPrecisionEmbeddingCollection,
)
from embcache.config import TableConfig
from embcache.embedding import CachedLowPrecisionEmbedding
from embcache.memory import memory_breakdown

KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
# TorchRec's sharding of each supported type: pooled output, and sequence (unpooled) output
_POOLED = {
    ShardingType.TABLE_WISE.value: TwPooledEmbeddingSharding,
    ShardingType.ROW_WISE.value: RwPooledEmbeddingSharding,
}
_SEQUENCE = {
    ShardingType.TABLE_WISE.value: TwSequenceEmbeddingSharding,
    ShardingType.ROW_WISE.value: RwSequenceEmbeddingSharding,
}

M = TypeVar("M", bound=CachedLowPrecisionEmbeddingBagCollection)


class _CachedCollectionSharder(BaseEmbeddingSharder[M]):
    """What our two sharders share: table-wise and row-wise sharding, compute kernel
    ``customized_kernel`` (ours); a subclass names its sharded module
    (``sharded_module_type``, as TorchRec's sharders do), which names the collection it
    shards.

    ``shardable_parameters`` gives the planner one meta tensor ``[rows, dim]`` per table, the
    shape it divides into shards (the tables have no FP32 weight to show it)."""

    sharded_module_type: type[_ShardedCachedCollection]  # a property of each subclass

    def shard(
        self,
        module: M,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> _ShardedCachedCollection:
        return self.sharded_module_type(module, params, env, device)

    def shardable_parameters(self, module: M) -> dict[str, torch.Tensor]:
        return {
            c.name: torch.empty(c.num_embeddings, c.embedding_dim, device="meta")
            for c in module.embedding_bag_configs()
        }

    @property
    def module_type(self) -> type[M]:
        return self.sharded_module_type._unsharded

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(_POOLED)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [KERNEL]


class CachedEmbeddingBagCollectionSharder(
    _CachedCollectionSharder[CachedLowPrecisionEmbeddingBagCollection]
):
    """The ``ModuleSharder`` of :class:`CachedLowPrecisionEmbeddingBagCollection` (pooled), as
    TorchRec's ``EmbeddingBagCollectionSharder`` is its ``EmbeddingBagCollection``'s."""

    @property
    def sharded_module_type(self) -> type[ShardedCachedEmbeddingBagCollection]:
        return ShardedCachedEmbeddingBagCollection


class CachedEmbeddingCollectionSharder(
    _CachedCollectionSharder[CachedLowPrecisionEmbeddingCollection]
):
    """The ``ModuleSharder`` of :class:`CachedLowPrecisionEmbeddingCollection` (unpooled), as
    TorchRec's ``EmbeddingCollectionSharder`` is its ``EmbeddingCollection``'s."""

    @property
    def sharded_module_type(self) -> type[ShardedCachedEmbeddingCollection]:
        return ShardedCachedEmbeddingCollection


class CachedTableEstimator(ShardEstimator):
    """Storage and speed of each planned shard, for TorchRec's planner.

    A shard of our collections (pooled or unpooled) is given the bytes it will really
    allocate: the :class:`~embcache.config.TableConfig` of its table with the shard's rows,
    through :func:`~embcache.memory.memory_breakdown` (low-precision rows, qparams, cache
    rows, tags, priorities and set floors, LFU counts, optimizer state), in device memory
    (``hbm``) on CUDA, but for a host-placed table's storage (host memory, ``ddr``), and in
    host memory (``ddr``) on CPU. Its speed is what TorchRec's perf
    estimator gives FBGEMM's fused kernel for the same shard (it has no model of ours; the two
    step times are within a factor of about 1.2 on CPU, ``bench/results/embedding_step``; an
    unpooled collection's shards are estimated as pooled ones, TorchRec knowing unpooled
    modules by its own types). Every other module's shards get TorchRec's own estimates."""

    def __init__(
        self, topology: Topology, constraints: dict[str, ParameterConstraints] | None = None
    ) -> None:
        self._device = topology.compute_device
        self._torchrec = [
            EmbeddingPerfEstimator(topology, constraints),
            EmbeddingStorageEstimator(topology, constraints),
        ]

    def estimate(self, sharding_options, sharder_data_map=None) -> None:
        ours = [
            o
            for o in sharding_options
            if isinstance(o.module[1], CachedLowPrecisionEmbeddingBagCollection)
        ]
        for o in ours:  # estimated as TorchRec's fused kernel, then given our bytes
            o.compute_kernel = EmbeddingComputeKernel.FUSED.value
        try:
            for estimator in self._torchrec:
                estimator.estimate(sharding_options, sharder_data_map)
        finally:
            for o in ours:
                o.compute_kernel = KERNEL
        on_device = self._device == "cuda"
        for o in ours:
            config = o.module[1].embedding_bags[o.name].config
            for shard in o.shards:
                m = memory_breakdown(shard_config(config, shard.size[0]))
                shard.storage = (
                    Storage(hbm=m["device"], ddr=m["host"])
                    if on_device
                    else Storage(hbm=0, ddr=m["total"])
                )


def shard_config(config: TableConfig, rows: int) -> TableConfig:
    """The configuration of a shard of ``rows`` rows of a table with ``config``: the table's
    own for a whole table; for a row-wise shard, the table's format whatever the shard's size
    (the small-table rule is the table's), with a cache of ``cache_ratio`` times its rows."""
    if rows == config.num_embeddings:
        return config
    return dataclasses.replace(
        config,
        num_embeddings=rows,
        precision=config.stored_precision,
        cache_ratio=config.cache_ratio if config.low_precision else 0.0,
        min_rows_for_low_precision=0,
    )


def shard_bytes(config: TableConfig, rows: int) -> int:
    """Bytes a shard of ``rows`` rows of a table with ``config`` allocates."""
    return memory_breakdown(shard_config(config, rows))["total"]


def default_constraints(
    collection: CachedLowPrecisionEmbeddingBagCollection, world_size: int
) -> dict[str, ParameterConstraints]:
    """Table-wise for every table of at most its rank's share of the collection's bytes (the
    total over ``world_size``), row-wise for a larger one.

    Why not the planner's own choice: TorchRec's speed model gives every table the same
    lookup cost whatever its size and halves it per row-wise shard, so it shards every table
    row-wise; but a row-wise table adds a reduce-scatter forward and an all-gather backward
    to the all-to-all, and measured slower (``bench/results/distributed``). Table-wise sends
    least; only a table too large to leave the ranks' memory balanced is split."""
    tables = collection.tables()
    share = sum(t.memory_bytes()["total"] for t in tables) / world_size
    return {
        t.config.name: ParameterConstraints(
            sharding_types=[
                ShardingType.TABLE_WISE.value
                if t.memory_bytes()["total"] <= share
                else ShardingType.ROW_WISE.value
            ]
        )
        for t in tables
    }


def planner(
    topology: Topology,
    batch_size: int = 512,
    constraints: dict[str, ParameterConstraints] | None = None,
    storage_reservation: StorageReservation | None = None,
) -> EmbeddingShardingPlanner:
    """TorchRec's ``EmbeddingShardingPlanner`` with :class:`CachedTableEstimator`, so that it
    places our tables by their real size (``storage_reservation``: TorchRec's, by default a
    share of each device's capacity kept for the other modules)."""
    enumerator = EmbeddingEnumerator(
        topology,
        batch_size,
        constraints,
        estimator=CachedTableEstimator(topology, constraints),
    )
    return EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        enumerator=enumerator,
        storage_reservation=storage_reservation,
        constraints=constraints,
    )


Out = TypeVar("Out")
C = TypeVar("C", bound=Multistreamable)


class _ShardedCachedCollection(ShardedEmbeddingModule[KJTList, list[torch.Tensor], Out, C]):
    """This rank's part of a sharded collection of ours: what the pooled and the unpooled
    sharded collections share (the plan's checks, this rank's shards, the input distribution,
    the protocol below). A subclass names the collection it shards (``_unsharded``) and
    whether its output is pooled (``_pooled``: TorchRec's pooled shardings, else its sequence
    shardings), and makes the output (``_init_output``, ``compute``, ``output_dist``).

    Invariants:

    * A table sharded table-wise lives whole on one rank, with the state it had in the
      unsharded collection (rows, cache, counts, optimizer state, update count): its lookups
      and updates are those of the unsharded table on the same global batches.
    * A table sharded row-wise becomes one table per rank holding the rows TorchRec's
      row-wise sharding gives that rank (a contiguous block), with the unsharded rows,
      optimizer state and counts, and its own cache of ``cache_ratio`` times its rows (the
      unsharded table is flushed first). Stochastic rounding is keyed by the shard's row
      index, so a shard's rounding draws differ from the unsharded table's.
    * A collection built with ``device="meta"`` is sharded without ever being allocated:
      each rank allocates only its shards and draws their initial rows, the rows the
      unsharded table would draw (``CachedLowPrecisionEmbedding.copy_rows_from``).
    * This rank's shards are one ordinary collection of the unsharded one's kind
      (:attr:`local_collection`): one lookup and one all-or-nothing update for all of them.
    * Input and output follow the unsharded collection: a ``KeyedJaggedTensor`` of this
      rank's batch in; out, what the unsharded collection gives for it, its features in the
      unsharded order.
    * It is a :class:`dlrm.mixed_precision.MixedPrecisionEmbedding` over this rank's shards:
      ``has_nonfinite_grad``, ``unscale_grad_``, ``step`` and ``zero_grad`` act on local
      shards only (the trainer makes the decision common to all ranks). Each shard's
      gradient is that of the mean over the global batch when each rank's loss is the mean
      over its own samples (as DDP expects of the dense part): TorchRec's output
      communication divides the gradient by the world size on the way back
      (``torchrec.distributed.comm_ops.set_gradient_division``, on by default).
    """

    _unsharded: type[CachedLowPrecisionEmbeddingBagCollection]
    _pooled: bool

    def __init__(
        self,
        module: CachedLowPrecisionEmbeddingBagCollection,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        types = _POOLED if self._pooled else _SEQUENCE
        configs = module.embedding_bag_configs()
        infos: dict[tuple, list[EmbeddingShardingInfo]] = {}
        for config in configs:
            ps = table_name_to_parameter_sharding.get(config.name)
            if ps is None:
                raise ValueError(f"table '{config.name}': the sharding plan does not place it")
            if ps.sharding_type not in types:
                raise ValueError(
                    f"table '{config.name}': sharding type {ps.sharding_type} is not supported "
                    f"(choose from {', '.join(types)})"
                )
            if ps.compute_kernel != KERNEL:
                raise ValueError(
                    f"table '{config.name}': compute kernel {ps.compute_kernel} is not ours "
                    f"(use {KERNEL})"
                )
            if (
                ps.sharding_type == ShardingType.ROW_WISE.value
                and config.pooling != PoolingType.SUM
            ):
                raise ValueError(
                    f"table '{config.name}': row-wise sharding needs sum pooling "
                    f"(a mean over shards' partial bags is not their sum's mean)"
                )
            # a sequence all-to-all sends rows of one width: one sharding per dimension
            key = (ps.sharding_type,) if self._pooled else (ps.sharding_type, config.embedding_dim)
            infos.setdefault(key, []).append(_sharding_info(config, ps, self._pooled))
        shardings = [types[key[0]](infos[key], env, device) for key in infos]
        # this rank's shards of every sharding, in one collection: one lookup, one update
        self._local, self._local_dims = _local_shards(shardings, module, env.rank, device)
        self._input_dists = nn.ModuleList([s.create_input_dist() for s in shardings])
        self._output_dists = nn.ModuleList([s.create_output_dist(device) for s in shardings])
        # the input's features in the shardings' order, and how many each sharding takes
        self._features = [f for s in shardings for f in s.feature_names()]
        self._feature_splits = [len(s.feature_names()) for s in shardings]
        self._feature_order: list[int] | None = None  # input key order -> sharding order
        self._output_names = [f for c in configs for f in c.feature_names]  # unsharded order
        self._init_output(shardings, configs, device)

    def _init_output(self, shardings: list, configs: list, device: torch.device | None) -> None:
        """What the output needs of the ``shardings`` of the tables with ``configs``."""
        raise NotImplementedError

    def _sharding_context(self, input_dist: nn.Module, features: KeyedJaggedTensor):
        """The context of one sharding's step, once ``input_dist`` was given ``features``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ ShardedModule

    def input_dist(self, ctx: C, features: KeyedJaggedTensor) -> Awaitable[Awaitable[KJTList]]:
        if self._feature_order is None:
            missing = [f for f in self._features if f not in features.keys()]
            if missing:
                raise ValueError(f"features {missing} are missing from the input")
            self._feature_order = [features.keys().index(f) for f in self._features]
        with torch.no_grad():
            if features.keys() != self._features:
                features = features.permute(self._feature_order)
            parts = features.split(self._feature_splits)
            awaitables = []
            for input_dist, part in zip(self._input_dists, parts):
                awaitables.append(input_dist(part))
                ctx.sharding_contexts.append(self._sharding_context(input_dist, part))
        return KJTListSplitsAwaitable(awaitables, ctx)

    def _local_lookup(self, dist_input: KJTList):
        """The local collection's output for the features of every sharding with shards
        here, all in one forward; None if this rank has no shards."""
        present = [kjt for kjt, dim in zip(dist_input, self._local_dims) if dim]
        if not present:
            return None
        return self._local(present[0] if len(present) == 1 else KeyedJaggedTensor.concat(present))

    # ------------------------------------------------------------------ local shards

    @property
    def local_collection(self) -> CachedLowPrecisionEmbeddingBagCollection | None:
        """The collection of this rank's shards (None if the plan gives the rank none)."""
        return self._local

    def local_tables(self) -> dict[str, CachedLowPrecisionEmbedding]:
        """This rank's shards by name: the table's for a table-wise shard,
        ``"<table>@<first row>"`` for a row-wise one (so a checkpoint's keys differ between
        the ranks)."""
        return {} if self._local is None else dict(self._local.embedding_bags.items())

    # the MixedPrecisionEmbedding protocol, over this rank's shards

    def has_nonfinite_grad(self) -> bool:
        return self._local is not None and self._local.has_nonfinite_grad()

    def pending_grads(self) -> list[torch.Tensor]:
        return [] if self._local is None else self._local.pending_grads()

    def unscale_grad_(self, inv_scale: float) -> None:
        if self._local is not None:
            self._local.unscale_grad_(inv_scale)

    def step(self) -> None:
        if self._local is not None:
            self._local.step()

    def check_step(self) -> None:
        if self._local is not None:
            self._local.check_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._local is not None:
            self._local.zero_grad()

    def stats(self) -> dict[str, dict]:
        return {name: t.stats() for name, t in self.local_tables().items()}

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """Every tensor here is this rank's own (tables are buffers): DMP tells DDP to leave
        all of them alone, neither broadcast at wrapping nor averaged."""
        for name, _ in self.named_buffers(prefix):
            yield name
        for name, _ in self.named_parameters(prefix):
            yield name

    @property
    def unsharded_module_type(self) -> type[CachedLowPrecisionEmbeddingBagCollection]:
        return self._unsharded


class ShardedCachedEmbeddingBagCollection(
    _ShardedCachedCollection[KeyedTensor, EmbeddingBagCollectionContext]
):
    """This rank's part of a sharded :class:`CachedLowPrecisionEmbeddingBagCollection`
    (TorchRec's pooled table-wise and row-wise shardings; the invariants are
    :class:`_ShardedCachedCollection`'s). Its output is a ``KeyedTensor`` of this rank's
    pooled embeddings, its columns permuted to the unsharded feature order."""

    _unsharded = CachedLowPrecisionEmbeddingBagCollection
    _pooled = True

    def _init_output(self, shardings: list, configs: list, device: torch.device | None) -> None:
        self._embedding_names = [n for s in shardings for n in s.embedding_names()]
        self._embedding_dims = [d for s in shardings for d in s.embedding_dims()]
        # the columns that bring the shardings' output to the unsharded order
        self._output_dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        starts, at = {}, 0
        for name, dim in zip(self._embedding_names, self._embedding_dims):
            starts[name] = at
            at += dim
        columns = [
            i
            for name, dim in zip(self._output_names, self._output_dims)
            for i in range(starts[name], starts[name] + dim)
        ]
        self._output_columns = (
            None
            if columns == list(range(at))
            else torch.tensor(columns, dtype=torch.int64, device=device)
        )

    def create_context(self) -> EmbeddingBagCollectionContext:
        return EmbeddingBagCollectionContext()

    def _sharding_context(
        self, input_dist: nn.Module, features: KeyedJaggedTensor
    ) -> EmbeddingShardingContext:
        return EmbeddingShardingContext(batch_size_per_feature_pre_a2a=features.stride_per_key())

    def compute(
        self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList
    ) -> list[torch.Tensor]:
        """The pooled embeddings of each sharding's features on this rank's shards, one
        collection forward for all of them."""
        pooled = self._local_lookup(dist_input)
        if pooled is None:
            batch, device = dist_input[0].stride(), dist_input[0].device()
            return [_no_rows(batch, 0, device) for _ in self._local_dims]
        return [part.contiguous() for part in pooled.values().split(self._local_dims, dim=1)]

    def output_dist(
        self, ctx: EmbeddingBagCollectionContext, output: list[torch.Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        awaitable = EmbeddingBagCollectionAwaitable(
            awaitables=[
                dist_(emb, sctx)
                for dist_, sctx, emb in zip(self._output_dists, ctx.sharding_contexts, output)
            ],
            embedding_dims=self._embedding_dims,
            embedding_names=self._embedding_names,
        )
        awaitable.callbacks.append(self._unsharded_order)
        return awaitable

    def _unsharded_order(self, kt: KeyedTensor) -> KeyedTensor:
        values = kt.values()
        if self._output_columns is not None:
            values = values.index_select(1, self._output_columns)
        return KeyedTensor(keys=self._output_names, length_per_key=self._output_dims, values=values)


class ShardedCachedEmbeddingCollection(
    _ShardedCachedCollection[dict[str, JaggedTensor], EmbeddingCollectionContext]
):
    """This rank's part of a sharded :class:`CachedLowPrecisionEmbeddingCollection`
    (TorchRec's sequence table-wise and row-wise shardings, as for its own
    ``EmbeddingCollection``; the invariants are :class:`_ShardedCachedCollection`'s). Its output
    is ``{feature: JaggedTensor}`` of this rank's batch, one row per id, in the unsharded
    feature order.

    Each sharding sends back one row per id of its features (``[ids, dim]``), so its tables
    share a dimension: the tables are grouped by sharding type and dimension (TorchRec's
    ``EmbeddingCollection`` has one dimension for all; ours need not). For a row-wise table,
    TorchRec's sequence output communication puts the rows back in the input's order (the
    input's ``unbucketize_permute_tensor``); every row comes from one shard, so a row-wise
    table's rows are the unsharded lookups exactly."""

    _unsharded = CachedLowPrecisionEmbeddingCollection
    _pooled = False

    def _init_output(self, shardings: list, configs: list, device: torch.device | None) -> None:
        self._embedding_names_per_sharding = [s.embedding_names() for s in shardings]
        self._sharding_dims = [s.embedding_dims()[0] for s in shardings]

    def create_context(self) -> EmbeddingCollectionContext:
        return EmbeddingCollectionContext(sharding_contexts=[])

    def _sharding_context(
        self, input_dist: nn.Module, features: KeyedJaggedTensor
    ) -> SequenceShardingContext:
        return SequenceShardingContext(
            features_before_input_dist=features,
            unbucketize_permute_tensor=(
                input_dist.unbucketize_permute_tensor
                if isinstance(input_dist, RwSparseFeaturesDist)
                else None
            ),
        )

    def compute(self, ctx: EmbeddingCollectionContext, dist_input: KJTList) -> list[torch.Tensor]:
        """Each sharding's rows ``[ids, dim]`` on this rank's shards, its features' ids in
        order, one collection forward for all of them."""
        rows = self._local_lookup(dist_input) or {}
        out = []
        for kjt, sctx, dim in zip(dist_input, ctx.sharding_contexts, self._sharding_dims):
            sctx.lengths_after_input_dist = kjt.lengths().view(-1, kjt.stride())
            parts = [rows[f].values() for f in kjt.keys()]
            out.append(torch.cat(parts) if parts else _no_rows(0, dim, kjt.device()))
        return out

    def output_dist(
        self, ctx: EmbeddingCollectionContext, output: list[torch.Tensor]
    ) -> LazyAwaitable[dict[str, JaggedTensor]]:
        awaitable = EmbeddingCollectionAwaitable(
            awaitables_per_sharding=[
                dist_(rows, sctx)
                for dist_, sctx, rows in zip(self._output_dists, ctx.sharding_contexts, output)
            ],
            features_per_sharding=[
                sctx.features_before_input_dist for sctx in ctx.sharding_contexts
            ],
            embedding_names_per_sharding=self._embedding_names_per_sharding,
            ctx=ctx,
        )
        awaitable.callbacks.append(self._unsharded_order)
        return awaitable

    def _unsharded_order(self, out: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        return {name: out[name] for name in self._output_names}


def _no_rows(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """A sharding's output on a rank with no shards of it: zeros that require a gradient,
    as TorchRec's lookups give (``_dummy_embs_tensor``), so that the output communication is
    part of the backward graph and the rank takes part in its backward collective (without
    it the other ranks wait on a collective this rank never issues, or get another's data)."""
    return torch.zeros(rows, cols, device=device, requires_grad=True)


def _local_shards(
    shardings: list,
    module: CachedLowPrecisionEmbeddingBagCollection,
    rank: int,
    device: torch.device | None,
) -> tuple[CachedLowPrecisionEmbeddingBagCollection | None, list[int]]:
    """This rank's shards of ``shardings`` (as TorchRec's own ``create_lookup`` groups them)
    in one collection of ``module``'s kind (pooled or unpooled) on ``device``, with the
    unsharded tables' state, or their initial rows if they are on the meta device (a row-wise
    shard of table ``t`` starting at row ``r`` is named ``t@r``); and the width of each
    sharding's pooled output here (0: no shards here)."""
    unpooled = isinstance(module, CachedLowPrecisionEmbeddingCollection)
    configs, options, dims, copies = [], {}, [], []
    full = dict(module.embedding_bags.items())
    for sharding in shardings:
        row_wise = isinstance(sharding, BaseRwEmbeddingSharding)
        shards = [t for g in sharding._grouped_embedding_configs for t in g.embedding_tables]
        dims.append(sum(t.local_cols * len(t.feature_names) for t in shards))
        for t in shards:
            if t.local_rows == 0:
                raise ValueError(f"table '{t.name}': row-wise sharding leaves rank {rank} no rows")
            cfg = shard_config(full[t.name].config, t.local_rows)
            options_of_shard = {
                k: v
                for k, v in cfg.to_dict().items()
                if k not in ("num_embeddings", "embedding_dim", "name", "mode")
            }
            start = t.local_metadata.shard_offsets[0] if row_wise else None
            name = t.name if start is None else f"{t.name}@{start}"
            options[name] = options_of_shard
            copies.append((full[t.name], start))
            shape = dict(
                name=name,
                num_embeddings=t.local_rows,
                embedding_dim=t.local_cols,
                feature_names=list(t.feature_names),
            )
            configs.append(
                EmbeddingConfig(**shape)
                if unpooled
                else EmbeddingBagConfig(**shape, pooling=t.pooling)
            )
    if not configs:
        return None, dims
    # from tables on the meta device, shards are built on it too and given memory and their
    # initial rows by copy_rows_from: nothing else is allocated or drawn
    on_meta = [t.weights.is_meta for t in full.values()]
    initial = any(on_meta)
    if initial and not all(on_meta):
        raise ValueError("some tables are on the meta device and some are not: build all on one")
    kind = (
        CachedLowPrecisionEmbeddingCollection
        if unpooled
        else CachedLowPrecisionEmbeddingBagCollection
    )
    local = kind(configs, per_table=options, device="meta" if initial else None)
    for (source, start), shard in zip(copies, local.tables()):
        if initial:
            shard.copy_rows_from(source, start or 0)
        elif start is None:
            shard.load_state_dict(source.state_dict())
        else:
            source.flush()
            shard.copy_rows_from(source, start)
    if device is not None and device.type != "cpu":  # built in host memory, then moved
        local.to(device)
    return local, dims


def _sharding_info(config: EmbeddingBagConfig, ps, pooled: bool) -> EmbeddingShardingInfo:
    return EmbeddingShardingInfo(
        embedding_config=EmbeddingTableConfig(
            num_embeddings=config.num_embeddings,
            embedding_dim=config.embedding_dim,
            name=config.name,
            data_type=config.data_type,
            feature_names=list(config.feature_names),
            pooling=config.pooling if pooled else PoolingType.NONE,
            is_weighted=False,
            has_feature_processor=False,
            embedding_names=list(config.feature_names),
        ),
        param_sharding=ps,
        param=torch.empty(config.num_embeddings, config.embedding_dim, device="meta"),
        fused_params={},
    )
