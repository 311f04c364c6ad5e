"""Train to serve (embcache.export): trained tables, exported without re-quantizing, give in
FBGEMM's inference TBE the pooled outputs our own forward gives after a flush.

Oracles: FBGEMM's inference op on the exported bytes; for FP32 qparams (which FBGEMM keeps in
FP16) the served rows recomputed from the exported codes, and the stated bound."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from embcache import CachedLowPrecisionEmbedding
from embcache.export import export, inference_tbe

pytest.importorskip("fbgemm_gpu")
pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, DIM = 3000, 16
CASES = [
    ("int8", "fp16"),
    ("int4", "fp16"),
    ("int2", "fp16"),
    ("int8", "fp32"),
    ("int4", "fp32"),
    ("int2", "fp32"),
    ("fp16", "fp32"),
    ("fp32", "fp32"),
]


def _trained(precision: str, qparams: str, seed: int, mode: str = "sum", dim: int = DIM):
    """A table after a few steps: rows in the cache and in the table."""
    gen = torch.Generator().manual_seed(seed)
    table = CachedLowPrecisionEmbedding(
        ROWS,
        dim,
        precision=precision,
        qparams=qparams,
        cache_ratio=0.05,
        optimizer="rowwise_adagrad",
        lr=0.1,
        mode=mode,
        seed=seed,
        name="t",
    )
    for _ in range(5):
        ids = (torch.rand(64, 3, generator=gen) ** 3 * ROWS).long()
        table(ids).pow(2).sum().backward()
        table.step()
    assert (table.cache_tags >= 0).any()
    return table, gen


def _bags(gen, bags: int = 40):
    lengths = torch.randint(0, 5, (bags,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids = (torch.rand(int(offsets[-1]), generator=gen) ** 3 * ROWS).long()
    return ids, offsets


def _forward(table, ids, offsets):
    table.eval()
    with torch.no_grad():
        return table(ids, offsets[:-1])


@pytest.mark.parametrize("precision,qparams", CASES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_fbgemm_serves_what_was_trained(precision, qparams, mode):
    table, gen = _trained(precision, qparams, seed=len(precision) + len(qparams), mode=mode)
    before = {k: v.clone() for k, v in table.state_dict().items() if isinstance(v, torch.Tensor)}
    exported = export(table)
    after = table.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # the table is untouched

    ids, offsets = _bags(gen)
    served = inference_tbe(exported)(ids.int(), offsets.int())
    table.flush()
    ours = _forward(table, ids, offsets)
    t = exported["t"]
    if qparams == "fp16" or t.scale_bias is None:  # the same bytes: the same rows
        if mode == "sum":
            assert torch.equal(served, ours)
        else:  # FBGEMM multiplies by 1 / length where we divide: an ulp apart at most
            torch.testing.assert_close(served, ours, rtol=2.4e-7, atol=1e-9)
        return
    # FP32 qparams are kept in FP16: the served rows are the codes times FP16 scale plus FP16
    # bias, each element within 2^-11 (|code * scale| + |bias|) of ours, twice over
    bits = {"int8": 8, "int4": 4, "int2": 2}[precision]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    codes = ((t.weight.unsqueeze(-1) >> shifts) & (2**bits - 1)).reshape(ROWS, -1)[:, :DIM]
    scale, bias = table.weights[:, -8:].contiguous().view(torch.float32).unbind(1)
    exact = codes.float() * scale[:, None] + bias[:, None]
    rows = codes.float() * t.scale_bias[:, :1].float() + t.scale_bias[:, 1:].float()
    bound = 2.0**-10 * ((codes.float() * scale[:, None]).abs() + bias.abs()[:, None])
    assert ((rows - exact).abs() <= bound).all()
    reference = nn.functional.embedding_bag(ids, rows, offsets[:-1], mode=mode)
    torch.testing.assert_close(served, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        served, ours, rtol=0, atol=float(bound.max()) * 4 + 1e-6
    )  # bags of up to 4 rows


@pytest.mark.parametrize("precision", ["int4", "int2"])
def test_a_dim_of_part_bytes_is_exported_at_its_dim_and_refused_by_fbgemm(precision):
    """Dim 5 packs into whole bytes with room to spare (INT4: 3 bytes, room for 6 codes): the
    export says dim 5 (not 6 or 8), and loading it into FBGEMM's inference TBE, which packs
    whole bytes only, is refused in one line naming the table (not an assert inside FBGEMM, nor
    a TBE serving 6 columns)."""
    table, _ = _trained(precision, "fp16", seed=5, dim=5)
    exported = export(table)
    bits = {"int4": 4, "int2": 2}[precision]
    assert exported["t"].dim == 5 and exported["t"].weight.shape == (ROWS, -(-5 * bits // 8))
    with pytest.raises(ValueError, match=r"^table 't': .* multiple of \d; this one is 5$"):
        inference_tbe(exported)


def test_an_fp32_export_is_an_embedding_bag():
    table, gen = _trained("fp32", "fp32", seed=3)
    weight = export(table)["t"].weight
    ids, offsets = _bags(gen)
    bag = nn.EmbeddingBag.from_pretrained(weight, mode="sum")
    assert torch.equal(bag(ids, offsets[:-1]), _forward(table, ids, offsets))


def test_a_bias_beyond_fp16_is_refused_naming_the_table():
    table = CachedLowPrecisionEmbedding(
        ROWS,
        DIM,
        precision="int8",
        qparams="fp32",
        cache_ratio=0,
        name="huge",
        min_rows_for_low_precision=0,
    )
    weights = table.weights.clone()  # row 7's bias set beyond FP16's range
    qparams = weights[7, DIM:].contiguous().view(torch.float32)
    qparams[1] = 1e6
    weights[7, DIM:] = qparams.view(torch.uint8)
    table.weights.copy_(weights)
    with pytest.raises(ValueError, match="table 'huge': row 7"):
        export(table)


def test_a_max_pooled_table_is_exported_and_refused_by_fbgemm_by_name():
    """FBGEMM's PoolingMode has SUM, MEAN and NONE: a table pooled by max is exported with its
    mode, and loading it into the inference TBE is refused naming the table and the reason
    (not served by another pooling)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    assert "MAX" not in PoolingMode.__members__
    table, _ = _trained("int8", "fp16", seed=6, mode="max")
    exported = export(table)
    assert exported["t"].mode == "max"
    with pytest.raises(ValueError, match="^table 't': FBGEMM's inference TBE cannot pool by max"):
        inference_tbe(exported)
