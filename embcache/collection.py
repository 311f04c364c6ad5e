"""A drop-in for TorchRec's ``EmbeddingBagCollection`` made of cached low-precision tables."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from embcache.embedding import CachedLowPrecisionEmbedding

_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


class CachedLowPrecisionEmbeddingBagCollection(nn.Module):
    """TorchRec's ``EmbeddingBagCollection`` interface over :class:`CachedLowPrecisionEmbedding`
    tables: ``KeyedJaggedTensor`` in, ``KeyedTensor`` out, so it can be passed as the
    ``embedding_bag_collection`` of ``torchrec.models.dlrm.DLRM``.

    ``defaults`` are table options (precision, rounding, cache_ratio, associativity, policy,
    optimizer, lr, qparams, seed, min_rows_for_low_precision, ...); ``per_table`` maps a table
    name to options that override them. Table ``i`` gets ``table_id=i``, so tables sharing a
    seed draw independent rounding streams. Tables below ``min_rows_for_low_precision`` rows
    (default 1000) stay FP32 without cache.

    The update is sparse and fused: after ``loss.backward()`` call :meth:`step` (or
    :meth:`zero_grad` to skip). ``has_nonfinite_grad`` / ``unscale_grad_`` let a mixed-
    precision trainer make one overflow decision over dense and embedding gradients.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        *,
        per_table: Optional[Mapping[str, Mapping]] = None,
        **defaults,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("CachedLowPrecisionEmbeddingBagCollection needs at least one table")
        per_table = dict(per_table or {})
        unknown = set(per_table) - {t.name for t in tables}
        if unknown:
            raise ValueError(f"per_table names unknown tables: {sorted(unknown)}")
        self._configs = list(tables)
        self.embedding_bags = nn.ModuleDict()
        seen: set[str] = set()
        for i, t in enumerate(tables):
            if t.pooling not in _MODES:
                raise ValueError(f"table '{t.name}': pooling {t.pooling} is not supported")
            for f in t.feature_names:
                if f in seen:
                    raise ValueError(f"table '{t.name}': feature '{f}' is used by two tables")
                seen.add(f)
            options = {**defaults, **per_table.get(t.name, {})}
            self.embedding_bags[t.name] = CachedLowPrecisionEmbedding(
                t.num_embeddings,
                t.embedding_dim,
                mode=_MODES[t.pooling],
                name=t.name,
                table_id=i,
                include_last_offset=True,
                **options,
            )

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return False

    def tables(self) -> list[CachedLowPrecisionEmbedding]:
        return list(self.embedding_bags.values())

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        by_feature = features.to_dict()
        keys, dims, pooled = [], [], []
        for config, table in zip(self._configs, self.embedding_bags.values()):
            for name in config.feature_names:
                if name not in by_feature:
                    raise ValueError(f"table '{config.name}': feature '{name}' is missing from the input")
                f = by_feature[name]
                pooled.append(table(f.values(), f.offsets(), f.weights_or_none()))
                keys.append(name)
                dims.append(config.embedding_dim)
        return KeyedTensor(keys=keys, length_per_key=dims, values=torch.cat(pooled, dim=1))

    # -------------------------------------------------------------- the sparse optimizer

    def has_nonfinite_grad(self) -> bool:
        return any(t.has_nonfinite_grad() for t in self.tables())

    def unscale_grad_(self, inv_scale: float) -> None:
        for t in self.tables():
            t.unscale_grad_(inv_scale)

    def step(self) -> None:
        """Apply every table's stored gradient, all or nothing: if any table refuses its
        update (non-finite or unstorable values), no table is changed and the
        :class:`~embcache.EmbeddingUpdateError` names the table."""
        prepared = [(t, t._prepare_step()) for t in self.tables()]
        for t, p in prepared:
            if p is not None:
                t._commit_step(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in self.tables():
            t.zero_grad()

    def flush(self) -> int:
        return sum(t.flush() for t in self.tables())

    # -------------------------------------------------------------- reporting

    def stats(self) -> dict[str, dict]:
        return {name: t.stats() for name, t in self.embedding_bags.items()}

    def memory_bytes(self) -> dict[str, dict]:
        return {name: t.memory_bytes() for name, t in self.embedding_bags.items()}

    def compression_factor(self) -> float:
        """The paper's factor over all tables: total bytes / (FP32 tables + optimizer state)."""
        total = fp32 = 0
        for t in self.tables():
            mem = t.memory_bytes()
            total += mem["total"]
            fp32 += t.config.num_embeddings * t.config.embedding_dim * 4 + mem["optimizer_state"]
        return total / fp32
