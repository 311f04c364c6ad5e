"""Train to serve: trained tables in the form inference engines load, without re-quantizing.

:func:`export` gives each table's rows as they are stored, with the cache written back
(rounded into the stored format as at eviction; the table itself is not changed):

* ``fp32``: ``weight`` float32 ``[rows, dim]``, what ``nn.EmbeddingBag.from_pretrained`` takes;
* ``fp16``: ``weight`` float16 ``[rows, dim]``;
* ``int8`` / ``int4`` / ``int2``: ``weight`` uint8 ``[rows, ceil(dim * bits / 8)]``, the codes
  packed low bits first (FBGEMM's packing), and ``scale_bias`` float16 ``[rows, 2]``.

:func:`inference_tbe` loads them into FBGEMM's inference TBE
(``IntNBitTableBatchedEmbeddingBagsCodegen``, the engine of TorchRec's quantized inference
collections), which keeps one FP16 scale and bias per row. The codes are ours exactly. Tables
with FP16 qparams (the default) keep their scale and bias bit for bit, so the served rows are
the trained ones; with ``qparams="fp32"``, scale and bias are rounded to FP16 (to
nearest), which moves an element by at most ``2^-11 * (|code * scale| + |bias|)`` plus the
same for the product: about 0.1% of the row's range. A bias beyond FP16's range cannot be
served that way and is refused.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from embcache.config import PRECISION_BITS
from embcache.embedding import CachedLowPrecisionEmbedding

_FP16_MAX = 65504.0


@dataclasses.dataclass(frozen=True)
class ExportedTable:
    """One table ready to serve (see the module's docstring)."""

    precision: str
    weight: Tensor
    scale_bias: Tensor | None
    mode: str  # pooling: "sum", "mean" or "max"
    dim: int  # not the codes' width: INT4 dim 5 fills 3 bytes, room for 6 codes

    @property
    def rows(self) -> int:
        return self.weight.shape[0]


def export(module: nn.Module) -> dict[str, ExportedTable]:
    """Every table of ``module`` (a :class:`CachedLowPrecisionEmbedding` or a collection of
    them) by name, as it would be after a flush; ``module`` is left as it is. The peak memory
    is one table's state more (its rows are written back on a copy)."""
    if isinstance(module, CachedLowPrecisionEmbedding):
        tables = {module.config.name: module}
    else:
        tables = dict(module.embedding_bags.items())
    return {name: _export_table(name, table) for name, table in tables.items()}


def _export_table(name: str, table: CachedLowPrecisionEmbedding) -> ExportedTable:
    config = table.config
    if (table.cache_tags >= 0).any():  # write the cache back on a copy, as flush() would
        table = CachedLowPrecisionEmbedding.from_state(table.state_dict())
        table.flush()
    rows = table.weights.detach().cpu()
    precision = config.stored_precision
    if precision in ("fp32", "fp16"):
        dtype = torch.float32 if precision == "fp32" else torch.float16
        weight = rows.contiguous().view(dtype).reshape(config.num_embeddings, -1).clone()
        return ExportedTable(precision, weight, None, config.mode, config.embedding_dim)
    codes = rows[:, : config.payload_bytes].clone()
    qparams = rows[:, config.payload_bytes :].contiguous()
    if config.qparams_fp16:
        scale_bias = qparams.view(torch.float16).clone()
    else:
        scale_bias32 = qparams.view(torch.float32)
        too_large = scale_bias32.abs() > _FP16_MAX
        if too_large.any():
            row = int(too_large.any(dim=1).nonzero()[0])
            raise ValueError(
                f"table '{name}': row {row}'s scale or bias is beyond FP16's range; it cannot "
                "be served with FP16 qparams"
            )
        scale_bias = scale_bias32.to(torch.float16)
    return ExportedTable(precision, codes, scale_bias, config.mode, config.embedding_dim)


def inference_tbe(tables: dict[str, ExportedTable]):
    """FBGEMM's inference TBE (``IntNBitTableBatchedEmbeddingBagsCodegen``, CPU, FP32 output)
    holding ``tables`` in order, one feature per table; its forward takes
    ``(indices, offsets)`` over the features one after another, as TBE does. The tables must
    pool alike (all sum or all mean: FBGEMM's ``PoolingMode`` has SUM, MEAN and NONE, no
    MAX, so a table pooled by max is refused), and an INT4 / INT2 table's row must fill whole
    bytes (dim a multiple of 2 / 4: FBGEMM's rule)."""
    for name, t in tables.items():
        if t.mode not in ("sum", "mean"):
            raise ValueError(
                f"table '{name}': FBGEMM's inference TBE cannot pool by {t.mode} (its "
                "PoolingMode has SUM, MEAN and NONE)"
            )
        codes_per_byte = 8 // PRECISION_BITS[t.precision]
        if t.scale_bias is not None and t.dim % codes_per_byte:
            raise ValueError(
                f"table '{name}': FBGEMM's inference TBE takes {t.precision} rows of whole "
                f"bytes, so a dim that is a multiple of {codes_per_byte}; this one is {t.dim}"
            )
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen,
    )

    modes = {t.mode for t in tables.values()}
    if len(modes) != 1:
        raise ValueError(f"the tables pool differently ({sorted(modes)}): one TBE pools one way")
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[
            (name, t.rows, t.dim, SparseType(t.precision), EmbeddingLocation.HOST)
            for name, t in tables.items()
        ],
        device="cpu",
        pooling_mode=PoolingMode.SUM if modes == {"sum"} else PoolingMode.MEAN,
        output_dtype=SparseType.FP32,
    )
    tbe.initialize_weights()  # allocates them; assigned below
    tbe.assign_embedding_weights(
        [
            (
                t.weight.contiguous().view(torch.uint8),
                None if t.scale_bias is None else t.scale_bias.contiguous().view(torch.uint8),
            )
            for t in tables.values()
        ]
    )
    return tbe
