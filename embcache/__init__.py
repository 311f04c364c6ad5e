"""embcache: low-precision (FP16/INT8/INT4/INT2) embedding tables behind an FP32 cache.

See docs/contract.md §2-5 for the numerics. Public API:

* :class:`CachedLowPrecisionEmbedding` — one table, ``nn.EmbeddingBag``-compatible.
* :class:`CachedLowPrecisionEmbeddingBagCollection` — TorchRec ``EmbeddingBagCollection``
  drop-in (``KeyedJaggedTensor`` in, ``KeyedTensor`` out).
* :func:`compression_factor` — the paper's memory compression factor (Appendix A).
"""

from embcache.collection import CachedLowPrecisionEmbeddingBagCollection
from embcache.config import TableConfig
from embcache.embedding import (
    CachedLowPrecisionEmbedding,
    EmbeddingUpdateError,
    check_state_dict,
)
from embcache.memory import compression_factor, memory_breakdown

__all__ = [
    "TableConfig",
    "CachedLowPrecisionEmbedding",
    "CachedLowPrecisionEmbeddingBagCollection",
    "EmbeddingUpdateError",
    "check_state_dict",
    "compression_factor",
    "memory_breakdown",
]
