"""embcache: low-precision (FP16/INT8/INT4/INT2) embedding tables behind an FP32 cache.

See docs/contract.md §2-5 for the numerics. Public API:

* :class:`CachedLowPrecisionEmbedding` — one table, ``nn.EmbeddingBag``-compatible.
* :class:`CachedLowPrecisionUnpooledEmbedding` — the same table, ``nn.Embedding``-compatible.
* :class:`CachedLowPrecisionEmbeddingBags` — several tables (features) in one module, one
  table-batched call per phase, plain tensors in and out (torch only); :class:`BagTable`, a
  table of it.
* :class:`CachedLowPrecisionEmbeddingBagCollection` — TorchRec ``EmbeddingBagCollection``
  drop-in (``KeyedJaggedTensor`` in, ``KeyedTensor`` out); :class:`CachedLowPrecisionEmbeddingCollection`,
  ``EmbeddingCollection``'s (unpooled: a ``JaggedTensor`` per feature out).
* :func:`compression_factor` — the paper's memory compression factor (Appendix A);
  :func:`memory_breakdown` and :func:`fp32_bytes`, its numerator's parts and its denominator.
* :func:`swap` and :class:`TableOptimizer` — ours in place of a model's ``nn.EmbeddingBag``,
  ``nn.Embedding`` and TorchRec ``EmbeddingBagCollection`` / ``EmbeddingCollection`` tables,
  in one call, and one ``step()`` for them.
* :func:`plan` — each table's precision and cache chosen to fit a memory budget, from a sample
  of training ids (:mod:`embcache.planner`).
"""

from embcache.config import TableConfig
from embcache.embedding import CachedLowPrecisionEmbedding, check_state_dict
from embcache.group import EmbeddingUpdateError
from embcache.memory import compression_factor, fp32_bytes, memory_breakdown
from embcache.multi_table import BagTable, CachedLowPrecisionEmbeddingBags
from embcache.planner import plan
from embcache.swap import TableOptimizer, swap
from embcache.unpooled import CachedLowPrecisionUnpooledEmbedding

__all__ = [
    "TableConfig",
    "BagTable",
    "CachedLowPrecisionEmbedding",
    "CachedLowPrecisionEmbeddingBags",
    "CachedLowPrecisionEmbeddingBagCollection",
    "CachedLowPrecisionEmbeddingCollection",
    "CachedLowPrecisionUnpooledEmbedding",
    "EmbeddingUpdateError",
    "check_state_dict",
    "compression_factor",
    "fp32_bytes",
    "memory_breakdown",
    "plan",
    "swap",
    "TableOptimizer",
]


def __getattr__(name: str):
    # The collection needs TorchRec; a table and everything else do not, so that `import
    # embcache` works where only torch is installed (a GPU machine without TorchRec).
    if name in (
        "CachedLowPrecisionEmbeddingBagCollection",
        "CachedLowPrecisionEmbeddingCollection",
    ):
        from embcache import collection

        return getattr(collection, name)
    raise AttributeError(f"module 'embcache' has no attribute {name!r}")
