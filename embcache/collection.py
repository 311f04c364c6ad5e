"""Drop-ins for TorchRec's ``EmbeddingBagCollection`` and ``EmbeddingCollection`` made of
cached low-precision tables: ``KeyedJaggedTensor`` adapters over
:class:`~embcache.multi_table.CachedLowPrecisionEmbeddingBags`, which does the work."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from embcache.multi_table import BagTable, CachedLowPrecisionEmbeddingBags

_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


class CachedLowPrecisionEmbeddingBagCollection(CachedLowPrecisionEmbeddingBags):
    """TorchRec's ``EmbeddingBagCollection`` interface over
    :class:`~embcache.multi_table.CachedLowPrecisionEmbeddingBags`: ``KeyedJaggedTensor``
    in, ``KeyedTensor`` out, so it can be passed as the ``embedding_bag_collection`` of
    ``torchrec.models.dlrm.DLRM``. Options, update, state dict and statistics are those of
    the module it adapts (``defaults`` and ``per_table`` as there; each table's pooling is its
    config's, SUM or MEAN: TorchRec's ``PoolingType`` has no MAX, so a ``BagTable`` pooled by
    max has no collection).

    ``device="meta"`` builds the tables without memory or rows (as TorchRec's own collection
    does), for ``DistributedModelParallel`` to shard: each rank then allocates and draws
    only its shards (:mod:`embcache.sharding`), the rows the unsharded table would hold.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        *,
        per_table: Mapping[str, Mapping] | None = None,
        device: torch.device | str | None = None,
        **defaults,
    ) -> None:
        for t in tables:
            if t.pooling not in _MODES:
                raise ValueError(f"table '{t.name}': pooling {t.pooling} is not supported")
        bags = [
            BagTable(
                t.name, t.num_embeddings, t.embedding_dim, tuple(t.feature_names), _MODES[t.pooling]
            )
            for t in tables
        ]
        super().__init__(bags, per_table=per_table, device=device, **defaults)
        self._configs = list(tables)

    @classmethod
    def from_bag_tables(cls, tables: Sequence[BagTable], **kwargs):
        """The collection of ``tables``, as TorchRec's ``EmbeddingBagConfig``s; ValueError
        for a table pooled by a mode that TorchRec's ``PoolingType`` lacks (max)."""
        pooling = {mode: p for p, mode in _MODES.items()}
        for t in tables:
            if t.mode not in pooling:
                raise ValueError(
                    f"table '{t.name}': mode {t.mode!r} has no TorchRec PoolingType "
                    f"(it has {', '.join(p.name for p in PoolingType)})"
                )
        configs = [
            EmbeddingBagConfig(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                feature_names=list(t.feature_names),
                pooling=pooling[t.mode],
            )
            for t in tables
        ]
        return cls(configs, **kwargs)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return False

    def _check_features(self, features: KeyedJaggedTensor) -> None:
        """The lengths of ``features`` checked (:meth:`check_lengths`), and a length_per_key
        or offset_per_key it carries agreeing with them; else a ValueError naming the
        feature. Run before a permute reads the lengths, and when the C++ forward (which does
        not read a length_per_key) has refused the input."""
        keys = features.keys()
        per_key = self.check_lengths(
            features.lengths(), features.values().numel(), features.stride(), keys
        )
        carried = features.length_per_key_or_none()
        offsets = features.offset_per_key_or_none()
        if carried is None and offsets is not None:
            carried = [b - a for a, b in zip(offsets, offsets[1:])]
        if carried is not None and list(carried) != per_key:
            carried = list(carried) + [None] * (len(per_key) - len(carried))
            f = next((f for f, (a, b) in enumerate(zip(carried, per_key)) if a != b), -1)
            raise ValueError(
                f"feature '{keys[f]}': its lengths sum to {per_key[f]}, but the "
                f"KeyedJaggedTensor's length_per_key/offset_per_key says {carried[f]}"
            )

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:  # type: ignore[override]
        """Pooled embeddings of every feature, ``[batch, sum of dims]`` as a KeyedTensor."""
        features = self._in_feature_order(features)
        try:
            pooled = super().forward(
                features.values(), features.lengths(), features.weights_or_none()
            )
        except ValueError:
            self._check_features(features)  # the KeyedJaggedTensor's own inconsistencies
            raise
        return KeyedTensor(
            keys=self.feature_names, length_per_key=self.feature_dims(), values=pooled
        )

    def prefetch(self, features: KeyedJaggedTensor) -> None:  # type: ignore[override]
        """Stages the misses of a coming :meth:`forward` of ``features`` (see
        :meth:`CachedLowPrecisionEmbeddingBags.prefetch`)."""
        features = self._in_feature_order(features)
        super().prefetch(features.values(), features.lengths())

    def _in_feature_order(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` with its keys in the collection's feature order (permuted if need be,
        extra keys dropped); a ValueError for a variable batch size or a missing feature."""
        if features.variable_stride_per_key():
            raise ValueError("variable batch size per feature is not supported")
        names, keys = self.feature_names, features.keys()
        if keys == names:
            return features
        missing = [n for n in names if n not in keys]
        if missing:
            raise ValueError(f"features {missing} are missing from the input")
        self._check_features(features)  # the permute trusts them
        return features.permute([keys.index(n) for n in names])


class CachedLowPrecisionEmbeddingCollection(CachedLowPrecisionEmbeddingBagCollection):
    """TorchRec's ``EmbeddingCollection`` interface (unpooled: ``KeyedJaggedTensor`` in, a
    ``JaggedTensor`` of one row per id for each feature out) over the same tables as
    :class:`CachedLowPrecisionEmbeddingBagCollection`, whose options, update, state dict and
    statistics it has. Its forward makes a bag of each id: feature ``f``'s ``n_f`` ids are
    bags ``[0, n_f)`` of a batch of ``max n_f`` bags, the rest empty (zeros, no gradient), so
    one table-batched call serves every feature whatever its length; the empty bags cost
    output rows when the features' lengths differ much. ``DistributedModelParallel`` shards it
    with :class:`embcache.sharding.CachedEmbeddingCollectionSharder`."""

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        *,
        per_table: Mapping[str, Mapping] | None = None,
        device: torch.device | str | None = None,
        **defaults,
    ) -> None:
        if "mode" in defaults or any("mode" in o for o in (per_table or {}).values()):
            raise ValueError("mode (pooling) does not apply to an unpooled collection")
        self._unpooled_configs = list(tables)
        bags = [
            EmbeddingBagConfig(
                name=t.name,
                embedding_dim=t.embedding_dim,
                num_embeddings=t.num_embeddings,
                feature_names=list(t.feature_names),
                pooling=PoolingType.SUM,
            )
            for t in tables
        ]
        super().__init__(bags, per_table=per_table, device=device, **defaults)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._unpooled_configs

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:  # type: ignore[override]
        """Each feature's rows, ``{feature: JaggedTensor}`` with ``features``' lengths and
        values ``[ids of the feature, dim]``."""
        features = self._in_feature_order(features)
        names, device = self.feature_names, features.values().device
        counts = features.length_per_key()
        width = max(counts, default=0)
        one_id_bags = torch.arange(width) < torch.tensor(counts, dtype=torch.int64).unsqueeze(1)
        bags = KeyedJaggedTensor(
            keys=names,
            values=features.values(),
            lengths=one_id_bags.view(-1).long().to(device),
            stride=width,
        )
        pooled = super().forward(bags)
        lengths = features.lengths().view(len(names), -1)
        return {
            n: JaggedTensor(values=pooled[n][:count], lengths=lengths[f])
            for f, (n, count) in enumerate(zip(names, counts))
        }
