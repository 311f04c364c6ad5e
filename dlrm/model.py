"""DLRM (Naumov et al., 2019) for Criteo-Kaggle (docs/contract.md §7).

``logit = top_mlp([x, dot_products(x, e_0, ..., e_25)])`` with ``x = bottom_mlp(dense)`` and
``e_k`` the pooled embedding of categorical feature ``cat_k``. The embeddings come from
:class:`embcache.multi_table.CachedLowPrecisionEmbeddingBags` (the ids in, a tensor out: torch
only), or from any module with TorchRec's ``EmbeddingBagCollection`` interface (called with a
``KeyedJaggedTensor``, it returns a ``KeyedTensor``). The dense part (both MLPs and the
interaction) runs in the dtype of its parameters -- FP32, or FP16 once
:class:`dlrm.mixed_precision.MixedPrecisionTrainer` has converted it, in which case every matrix
product is a tensor-core FP16 product (emulated exactly on CPU).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dlrm.mixed_precision import Linear, bmm
from dlrm.torchrec_adapter import kjt_from_ids, takes_keyed_input
from embcache.multi_table import CachedLowPrecisionEmbeddingBags

__all__ = [
    "NUM_DENSE",
    "SPARSE_KEYS",
    "TABLE_NAMES",
    "DLRMConfig",
    "PRESETS",
    "DotInteraction",
    "DLRM",
]

NUM_DENSE = 13
SPARSE_KEYS = tuple(f"cat_{i}" for i in range(26))
TABLE_NAMES = tuple(f"t_{i}" for i in range(len(SPARSE_KEYS)))  # table t_k serves feature cat_k


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
    """Layer widths. ``bottom_mlp`` includes its input width (13) and ends at the embedding
    dimension; ``top_mlp`` excludes its input width (fixed by the interaction) and ends at 1."""

    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]

    @property
    def embedding_dim(self) -> int:
        return self.bottom_mlp[-1]


PRESETS = {
    # The reference DLRM's Criteo-Kaggle configuration (docs/contract.md §7).
    "kaggle": DLRMConfig(bottom_mlp=(13, 512, 256, 64, 16), top_mlp=(512, 256, 1)),
    # The paper ("Mixed-Precision Embedding using a Cache") gives only the embedding dimension,
    # 128, for its Kaggle runs, and no MLP widths. We take the reference DLRM's other standard configuration whose
    # bottom MLP ends at 128 (its MLPerf/Terabyte one): bottom 13-512-256-128,
    # top 1024-1024-512-256-1.
    "paper": DLRMConfig(bottom_mlp=(13, 512, 256, 128), top_mlp=(1024, 1024, 512, 256, 1)),
}


class DotInteraction(nn.Module):
    """The reference DLRM's dot interaction, without self-interaction.

    ``forward(x [B, d], embeddings [B, n, d]) -> [B, d + (n+1)n/2]``: with ``t = (x, e_0, ...,
    e_{n-1})`` (``t_0 = x``), the output is ``x`` followed by ``<t_i, t_j>`` for every
    ``i > j`` in row-major order ``(1,0), (2,0), (2,1), (3,0), ...`` -- the reference's ``li, lj``
    ordering. The dot products are one batched product ``t @ t^T`` (:func:`~dlrm.mixed_precision.bmm`,
    so FP16 inputs give tensor-core FP16 products).
    """

    def __init__(self, num_embeddings: int) -> None:
        super().__init__()
        rows, cols = torch.tril_indices(num_embeddings + 1, num_embeddings + 1, offset=-1)
        self.register_buffer("_rows", rows, persistent=False)
        self.register_buffer("_cols", cols, persistent=False)

    @property
    def num_pairs(self) -> int:
        return self._rows.numel()

    def forward(self, x: Tensor, embeddings: Tensor) -> Tensor:
        t = torch.cat([x.unsqueeze(1), embeddings], dim=1)
        z = bmm(t, t.transpose(1, 2))
        return torch.cat([x, z[:, self._rows, self._cols]], dim=1)


def _mlp(widths: Sequence[int], relu_last: bool) -> nn.Sequential:
    """Linear layers with ReLU between them (and after the last iff ``relu_last``), initialised
    as the reference DLRM: ``W ~ N(0, sqrt(2 / (in + out)))``, ``b ~ N(0, sqrt(1 / out))``."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        layer = Linear(n_in, n_out)
        nn.init.normal_(layer.weight, 0.0, math.sqrt(2.0 / (n_in + n_out)))
        nn.init.normal_(layer.bias, 0.0, math.sqrt(1.0 / n_out))
        layers.append(layer)
        if relu_last or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM with a dot interaction; returns FP32 logits of shape ``[B]`` (no sigmoid).

    * ``bottom_mlp``: ``bottom[0] -> ... -> bottom[-1] = d``, ReLU after every layer (as the
      reference does).
    * ``interaction``: :class:`DotInteraction` of the bottom output and the
      ``num_sparse_features`` pooled embeddings, taken in the ``KeyedTensor``'s key order.
    * ``top_mlp``: ``d + (n+1)n/2 -> top[0] -> ... -> top[-1] = 1``, ReLU between layers, none
      after the last.

    ``embedding_collection`` takes the ids ``[B, num_sparse_features]`` and returns ``[B,
    num_sparse_features * d]``, or has TorchRec's interface (its
    ``KeyedJaggedTensor`` of the ids in, a ``KeyedTensor`` of ``num_sparse_features`` keys of
    width ``d`` out); its values may be FP32 whatever the dense dtype. The dense part
    computes in the dtype of its parameters: dense features and embeddings are cast to it on
    the way in (so in FP16 the embeddings receive FP16-valued gradients), the logit is cast to
    FP32 on the way out. Parameters are initialised as the reference DLRM's (see ``_mlp``).
    """

    def __init__(
        self,
        embedding_collection: nn.Module,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        num_sparse_features: int = len(SPARSE_KEYS),
    ) -> None:
        super().__init__()
        if top_mlp[-1] != 1:
            raise ValueError(f"the top MLP must end in 1 logit, got {tuple(top_mlp)}")
        self.embedding_collection = embedding_collection
        self.embedding_dim = bottom_mlp[-1]
        self.num_sparse_features = num_sparse_features
        self._keyed = takes_keyed_input(embedding_collection)
        if self._keyed:  # the ids' columns are its features, in its order
            configs = embedding_collection.embedding_bag_configs()
            self._feature_names = [f for c in configs for f in c.feature_names]
        else:
            dims = embedding_collection.feature_dims()
            if dims != [self.embedding_dim] * num_sparse_features:
                raise ValueError(
                    f"expected {num_sparse_features} embeddings of width {self.embedding_dim}, "
                    f"got widths {dims}"
                )
        self.bottom_mlp = _mlp(bottom_mlp, relu_last=True)
        self.interaction = DotInteraction(num_sparse_features)
        self.top_mlp = _mlp(
            (self.embedding_dim + self.interaction.num_pairs, *top_mlp), relu_last=False
        )

    @classmethod
    def from_preset(
        cls, name: str, embedding_collection: nn.Module, num_sparse_features: int = len(SPARSE_KEYS)
    ) -> DLRM:
        """A DLRM with the widths of ``PRESETS[name]`` (``"kaggle"`` or ``"paper"``)."""
        try:
            config = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
        return cls(embedding_collection, config.bottom_mlp, config.top_mlp, num_sparse_features)

    def dense_to(self, device: torch.device | str) -> DLRM:
        """Moves the dense part (both MLPs, the interaction) to ``device``; the tables stay
        where they are (e.g. on the meta device until a checkpoint fills them)."""
        for module in self.children():
            if module is not self.embedding_collection:
                module.to(device)
        return self

    @property
    def dense_dtype(self) -> torch.dtype:
        return self.bottom_mlp[0].weight.dtype

    def prefetch(self, sparse) -> None:
        """Stages the table rows that a coming forward of ``sparse`` (as :meth:`forward`
        takes it) will miss, while the current batch trains, where the collection is
        embcache's (its ``prefetch``: host-placed tables on a GPU); else nothing (a TorchRec
        module's ``prefetch`` is its pipeline's, of another kind)."""
        if not isinstance(self.embedding_collection, CachedLowPrecisionEmbeddingBags):
            return
        prefetch = self.embedding_collection.prefetch
        if self._keyed and isinstance(sparse, Tensor):
            sparse = kjt_from_ids(sparse, self._feature_names)
        prefetch(sparse)

    def forward(self, dense: Tensor, sparse) -> Tensor:
        """Logits ``[B]`` of the dense features ``[B, 13]`` and ``sparse``: the ids ``[B, n]``
        (int32 or int64, one per feature), or, for a collection with TorchRec's interface, also any
        ``KeyedJaggedTensor`` of its features (multi-hot bags)."""
        dtype = self.dense_dtype
        x = self.bottom_mlp(dense.to(dtype))
        n, d = self.num_sparse_features, self.embedding_dim
        if self._keyed:
            if isinstance(sparse, Tensor):
                sparse = kjt_from_ids(sparse, self._feature_names)
            pooled = self.embedding_collection(sparse)
            if len(pooled.keys()) != n or any(w != d for w in pooled.length_per_key()):
                raise ValueError(
                    f"expected {n} embeddings of width {d}, got widths {pooled.length_per_key()}"
                )
            pooled = pooled.values()
        else:
            pooled = self.embedding_collection(sparse)
        embeddings = pooled.reshape(-1, n, d).to(dtype)
        return self.top_mlp(self.interaction(x, embeddings)).float().squeeze(-1)
