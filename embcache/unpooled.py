"""``nn.Embedding``'s drop-in: one row per id, unpooled, from a cached low-precision table.

An unpooled lookup is a pooled one whose every bag holds one id, so
:class:`CachedLowPrecisionUnpooledEmbedding` is a :class:`CachedLowPrecisionEmbedding` (same
formats, cache, optimizers, all-or-nothing :meth:`step`, state dict and statistics) whose
forward makes those bags: the same kernels run, and nothing new is stored.
"""

from __future__ import annotations

import torch

from embcache.config import TableConfig
from embcache.embedding import CachedLowPrecisionEmbedding, check_torch_options


class CachedLowPrecisionUnpooledEmbedding(CachedLowPrecisionEmbedding):
    """``nn.Embedding(num_embeddings, embedding_dim, padding_idx=...)`` with its rows stored in
    FP16/INT8/INT4/INT2 behind an FP32 cache: ``forward(input)`` gives ``[*input.shape, dim]``,
    row ``input[...]`` at each position, for int64 or int32 ids of any shape. As with
    ``nn.Embedding``, a position whose id is ``padding_idx`` gets that row's current value and
    no gradient, and that row is never updated (it starts at zero unless initial rows are
    given). The update is :meth:`step`'s, as for every table of this package; ``mode``
    (pooling) and ``include_last_offset`` do not apply and are refused."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **options,
    ) -> None:
        """``nn.Embedding``'s arguments, positional in its order, then the keyword-only ones of
        :class:`CachedLowPrecisionEmbedding` (``weight`` and the fields of
        :class:`~embcache.config.TableConfig`); ``_freeze=True`` is refused, as that class
        refuses the options it cannot honour."""
        name = options.get("name", TableConfig.name)
        for option in ("mode", "include_last_offset"):
            if option in options:
                raise ValueError(f"table '{name}': {option} does not apply to an unpooled table")
        check_torch_options(name, _freeze=_freeze)
        super().__init__(
            num_embeddings,
            embedding_dim,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            "sum",  # bags of one id: the mode changes nothing (and old checkpoints say sum)
            sparse,
            _weight,
            padding_idx=padding_idx,
            device=device,
            dtype=dtype,
            **options,
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Rows ``[*input.shape, dim]`` (FP32). In training mode the backward stores the
        per-row gradient for :meth:`step`."""
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"table '{self.config.name}': input must be an int64 or int32 tensor, got "
                f"{getattr(input, 'dtype', type(input))}"
            )
        ids = input.reshape(-1)
        out = super().forward(ids, torch.arange(ids.numel(), device=ids.device))
        if self.padding_idx is not None:  # its bags came out empty: zeros, no gradient
            padded = (ids == self.padding_idx).unsqueeze(1)
            out = torch.where(padded, self._padding_row(), out)
        return out.reshape(*input.shape, self.config.embedding_dim)

    def _padding_row(self) -> torch.Tensor:
        """The padding row's current value (cache over table) ``[1, dim]``, read as an
        evaluation lookup: it counts nothing and takes no gradient."""
        with torch.no_grad():
            return self.group.lookup(
                torch.full((1,), self.padding_idx, device=self.device),  # (no copy)
                torch.ones(1, dtype=torch.int64, device=self.device),
                None,
                [self.group.position(self)],
                1,
                False,
            )
