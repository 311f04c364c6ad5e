"""The bytes of a table (docs/contract.md §5), from its configuration alone: the one formula
that a table's ``memory_bytes()``, a collection's, the sharding planner's estimate and the
compression factor all use."""

from __future__ import annotations

from embcache.config import TableConfig

# the state tensor (embcache.config.STATE_TENSORS) that holds each component of the bytes
COMPONENT_TENSORS = {
    "table_payload": "weights",
    "table_qparams": "weights",
    "cache_rows": "cache_rows",
    "cache_tags": "cache_tags",
    "cache_priority": "cache_priority",
    "cache_set_floor": "cache_set_floor",
    "lfu_counts": "counts",
    "optimizer_state": "optimizer_state",
}


def memory_breakdown(config: TableConfig) -> dict:
    """Bytes by component that a table with this configuration allocates (docs/contract.md §5):
    table payload and qparams, FP32 cache rows, int32 tags and priorities per slot, an int32
    priority floor per set, int32 LFU counts per table row, FP32 optimizer accumulators for
    every row; ``total`` is their sum. ``device`` and ``host`` split ``total`` by where it
    lives: ``host`` is the storage (:attr:`TableConfig.storage_tensors`: the stored rows, and
    AdaGrad's per-element state) of a table with ``placement="host"``, in pinned host memory; ``device`` is the rest, in the memory of the
    device the table runs on (host memory too for a table on the CPU)."""
    rows, dim, slots = config.num_embeddings, config.embedding_dim, config.num_slots
    parts = {
        "table_payload": rows * config.payload_bytes,
        "table_qparams": rows * config.qparam_bytes,
        "cache_rows": slots * dim * 4,
        "cache_tags": slots * 4,
        "cache_priority": slots * 4,
        "cache_set_floor": config.num_sets * 4,
        "lfu_counts": rows * config.counts_dtype.itemsize if config.keeps_counts else 0,
        "optimizer_state": rows * config.optimizer_state_width * 4,
    }
    host = 0
    if config.placement == "host":
        storage = config.storage_tensors
        host = sum(b for k, b in parts.items() if COMPONENT_TENSORS[k] in storage)
    parts["total"] = sum(parts.values())
    parts["device"] = parts["total"] - host
    parts["host"] = host
    return parts


def fp32_bytes(config: TableConfig) -> int:
    """Bytes of the same table stored in FP32 without a cache, with the same optimizer state:
    the compression factor's denominator."""
    fp32_rows = config.num_embeddings * config.embedding_dim * 4
    return fp32_rows + memory_breakdown(config)["optimizer_state"]


def compression_factor(config: TableConfig) -> float:
    """(payload + qparams + cache rows + tags + priorities + set floors + LFU counts +
    optimizer state) / (FP32 table + the same optimizer state). E.g. dim 128: fp16 0.5, int8
    0.2656."""
    return memory_breakdown(config)["total"] / fp32_bytes(config)
