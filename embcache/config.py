"""The knobs of one low-precision cached table, validated once (docs/contract.md §2-4), and
the constants the kernels share with Python.

A :class:`TableConfig` is what a user asked for; its properties apply the rule that small
tables stay plain FP32 without cache and give the layout the kernels work on, and
:meth:`TableConfig.spec` packs it for the ops. Every invalid value raises ``ValueError``
naming the table, the field and the value.

The lists below marked "as csrc/include/embcache/table_spec.h" mirror that header, the one
definition the C++ ops and CUDA kernels compile; ``torch.ops.embcache.layout()`` returns the
header's, and a test checks that the two agree.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import torch

# as csrc/include/embcache/table_spec.h: EMBCACHE_FORMATS, EMBCACHE_OPTIMIZERS, kMaxWays
PRECISION_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4, "int2": 2}
OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad")
MAX_ASSOCIATIVITY = 32
ROUNDINGS = ("nearest", "stochastic")
POLICIES = ("lru", "lfu")
LFU_COUNT_BITS = (16, 32, 8)
# Where a table's storage (TableConfig.storage_tensors) lies: with its cache on the table's
# device, or in pinned host memory that a GPU reads and writes in place (docs/design.md, "Host
# placement")
PLACEMENTS = ("device", "host")
# TableConfig fields newer than some checkpoints, with the value those checkpoints' tables had
ADDED_FIELDS = {"lfu_count_bits": 32, "placement": "device"}
QPARAMS = ("fp32", "fp16")
# as csrc/include/embcache/table_spec.h: EMBCACHE_POOLINGS, a bag's pooling by its code
MODES = ("sum", "mean", "max")

# as csrc/include/embcache/table_spec.h: EMBCACHE_COUNTERS, a table's statistics counters
COUNTERS = (
    "lookups",
    "hits",
    "steps",
    "unique_rows",
    "unique_hits",
    "unique_misses",
    "insertions",
    "evictions",
    "bypasses",
    "flushed",
    "probed_rows",
    "probed_error_sum_e9",
    "probed_error_max_e9",
    "probed_up",
    "probed_down",
    "probed_expected_up_e6",
)
# as csrc/include/embcache/table_spec.h: DeviceCount, what a table's device counts hold (the
# forward and the update add to them on the table's device; they are folded into COUNTERS
# when read)
DEVICE_COUNTS = ("lookups", "hits", "unique_hits", "insertions", "evictions")
# as csrc/include/embcache/table_spec.h: EMBCACHE_STATE_TENSORS, a table's state tensors (the
# table module's buffers) in the order the ops take them, and each one's tier: "storage" (what
# is as wide as the rows: in pinned host memory for placement="host") or "cache" (on the
# table's device whatever its placement); optimizer_state's is per-element state's
# (TableConfig.storage_tensors applies state_tier's rule)
STATE_TENSORS = (
    "weights",
    "cache_tags",
    "cache_rows",
    "cache_priority",
    "cache_set_floor",
    "counts",
    "optimizer_state",
)
STATE_TIERS = ("storage", "cache", "cache", "cache", "cache", "cache", "storage")
# as csrc/include/embcache/table_spec.h: EMBCACHE_SPEC_FIELDS, the fields of TableConfig.spec()
SPEC_FIELDS = (
    "rows",
    "dim",
    "bits",
    "qparams_fp16",
    "stochastic",
    "optimizer",
    "lr",
    "eps",
    "lfu",
    "num_sets",
    "ways",
    "seed",
    "table",
    "pooling",
)


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One table: ``num_embeddings x embedding_dim`` rows stored in ``precision`` behind an
    FP32 cache of ``floor(cache_ratio * num_embeddings)`` rows (rounded down to a multiple of
    ``associativity``), ``policy`` LRU or LFU, trained by ``optimizer`` with ``lr``.

    ``seed`` keys the stochastic rounding stream together with ``table_id``; tables with
    fewer than ``min_rows_for_low_precision`` rows are stored FP32 without cache. An LFU
    table counts each row's occurrences in ``lfu_count_bits`` (16, 32 or 8) bits, saturating
    at the largest count they hold. ``mode`` pools a bag by sum, mean or max; its default here is
    TorchRec's, SUM, while :class:`~embcache.CachedLowPrecisionEmbedding` defaults to
    ``nn.EmbeddingBag``'s, mean.

    ``placement`` says where the table's storage (its stored rows, and AdaGrad's per-element
    state: :attr:`storage_tensors`) lives when the table is on a GPU: ``"device"``, in GPU
    memory with its cache, or ``"host"``, in pinned host memory that the GPU reads and writes
    in place, the cache (with the LFU counts and row-wise AdaGrad's accumulators) staying in
    GPU memory. It changes where bytes live, never their
    values, so it is not part of a table's identity: a checkpoint loads across placements.
    """

    num_embeddings: int
    embedding_dim: int
    precision: str = "int8"
    rounding: str = "stochastic"
    cache_ratio: float = 0.05
    associativity: int = 32
    policy: str = "lfu"
    lfu_count_bits: int = 16
    optimizer: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    mode: str = "sum"
    qparams: str = "fp16"
    placement: str = "device"
    seed: int = 0
    min_rows_for_low_precision: int = 1000
    name: str = "table"
    table_id: int = 0

    @classmethod
    def of(cls, num_embeddings: int, embedding_dim: int, **options) -> TableConfig:
        """The configuration of ``options`` (the fields below); ``ValueError`` naming the
        table and the option for one that is not a field (rather than a ``TypeError``)."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"num_embeddings", "embedding_dim"}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(
                f"table '{options.get('name', cls.name)}': unknown option {unknown[0]!r} "
                f"(options: {', '.join(sorted(fields))})"
            )
        return cls(num_embeddings, embedding_dim, **options)

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            value = getattr(self, field)
            return ValueError(f"table '{self.name}': {field}={value!r} {why}")

        for field, choices in (
            ("precision", tuple(PRECISION_BITS)),
            ("rounding", ROUNDINGS),
            ("policy", POLICIES),
            ("optimizer", OPTIMIZERS),
            ("qparams", QPARAMS),
            ("mode", MODES),
            ("lfu_count_bits", LFU_COUNT_BITS),
            ("placement", PLACEMENTS),
        ):
            if getattr(self, field) not in choices:
                raise bad(field, f"is not one of {', '.join(map(str, choices))}")
        if not isinstance(self.num_embeddings, int) or not 0 < self.num_embeddings < 2**31 - 1:
            raise bad("num_embeddings", "must be an integer in [1, 2^31 - 2]")
        if not isinstance(self.embedding_dim, int) or self.embedding_dim <= 0:
            raise bad("embedding_dim", "must be a positive integer")
        if not (isinstance(self.cache_ratio, (int, float)) and 0 <= self.cache_ratio < 1):
            raise bad("cache_ratio", "must be in [0, 1)")
        a = self.associativity
        if not isinstance(a, int) or a < 1 or a > MAX_ASSOCIATIVITY or a & (a - 1):
            raise bad("associativity", f"must be a power of two in [1, {MAX_ASSOCIATIVITY}]")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise bad("lr", "must be finite and non-negative")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise bad("eps", "must be finite and positive")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise bad("seed", "must be an integer in [0, 2^63)")
        if not isinstance(self.table_id, int) or not 0 <= self.table_id < 2**32:
            raise bad("table_id", "must be an integer in [0, 2^32)")

    @property
    def low_precision(self) -> bool:
        """False for tables small enough to stay FP32 without cache (docs/contract.md §4.4)."""
        return self.num_embeddings >= self.min_rows_for_low_precision

    @property
    def bits(self) -> int:
        return PRECISION_BITS[self.precision] if self.low_precision else 32

    @property
    def stored_precision(self) -> str:
        return self.precision if self.low_precision else "fp32"

    @property
    def ways(self) -> int:
        return self.associativity

    @property
    def keeps_counts(self) -> bool:
        """Whether the table keeps an LFU count per row: an LFU policy and a cache."""
        return self.policy == "lfu" and self.num_slots > 0

    @property
    def counts_dtype(self) -> torch.dtype:
        """The dtype of the LFU counts (signed: a count saturates at 2^(bits - 1) - 1); int32
        for the empty counts of a table that keeps none, as its spec says."""
        if not self.keeps_counts:
            return torch.int32
        return {8: torch.int8, 16: torch.int16, 32: torch.int32}[self.lfu_count_bits]

    @property
    def num_slots(self) -> int:
        """Cache capacity C: floor(cache_ratio * rows), rounded down to a multiple of W."""
        if not self.low_precision:
            return 0
        c = math.floor(self.cache_ratio * self.num_embeddings)
        return c - c % self.associativity

    @property
    def num_sets(self) -> int:
        return self.num_slots // self.associativity

    @property
    def qparams_fp16(self) -> bool:
        return self.qparams == "fp16"

    @property
    def payload_bytes(self) -> int:
        """Bytes of one row's values (codes packed low bits first for integer formats)."""
        return math.ceil(self.embedding_dim * self.bits / 8)

    @property
    def qparam_bytes(self) -> int:
        """Bytes of one row's scale and bias (integer formats only)."""
        if self.bits > 8:
            return 0
        return 4 if self.qparams_fp16 else 8

    @property
    def row_bytes(self) -> int:
        return self.payload_bytes + self.qparam_bytes

    @property
    def optimizer_state_width(self) -> int:
        """FP32 accumulators per row: 0 (SGD), 1 (row-wise AdaGrad), dim (AdaGrad)."""
        return {"sgd": 0, "rowwise_adagrad": 1, "adagrad": self.embedding_dim}[self.optimizer]

    @property
    def storage_tensors(self) -> tuple[str, ...]:
        """The state tensors of the storage tier, in pinned host memory for
        ``placement="host"`` (csrc/include/embcache/table_spec.h, ``state_tier``): those of
        :data:`STATE_TIERS`'s storage tier, but an optimizer state of at most one value a row,
        which every update reads and writes (for a cached row too), goes with the cache."""
        per_row_state = self.optimizer_state_width <= 1
        return tuple(
            name
            for name, tier in zip(STATE_TENSORS, STATE_TIERS)
            if tier == "storage" and not (name == "optimizer_state" and per_row_state)
        )

    def spec(self) -> torch.Tensor:
        """The table as the ops take it: one int64 per field of :data:`SPEC_FIELDS`, lr and eps
        as the bits of their float64 values (csrc/include/embcache/table_spec.h)."""
        fields = {
            "rows": self.num_embeddings,
            "dim": self.embedding_dim,
            "bits": self.bits,
            "qparams_fp16": int(self.qparams_fp16),
            "stochastic": int(self.rounding == "stochastic"),
            "optimizer": OPTIMIZERS.index(self.optimizer),
            "lr": _float64_bits(self.lr),
            "eps": _float64_bits(self.eps),
            "lfu": self.lfu_count_bits if self.keeps_counts else 0,
            "num_sets": self.num_sets,
            "ways": self.ways,
            "seed": self.seed,
            "table": self.table_id,
            "pooling": MODES.index(self.mode),
        }
        return torch.tensor([fields[f] for f in SPEC_FIELDS], dtype=torch.int64)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def identity(self) -> dict:
        """:meth:`to_dict` without the fields that say where the table lives rather than what
        it computes (:data:`WHERE_FIELDS`): what a checkpoint's table must share with the
        table it loads into."""
        return {k: v for k, v in self.to_dict().items() if k not in WHERE_FIELDS}


# TableConfig fields that place a table's bytes without changing them: a checkpoint loads into
# a table that differs from it in these
WHERE_FIELDS = ("placement",)


def _float64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]
