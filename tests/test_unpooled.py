"""CachedLowPrecisionUnpooledEmbedding, nn.Embedding's drop-in. Oracles: nn.Embedding(sparse)
+ SGD for an FP32 table without a cache (several steps, a padding row included); for low
precision behind a cache, our bag table fed bags of one id (tested against nn.EmbeddingBag and
the pure-PyTorch reference elsewhere), bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import embcache
from embcache import CachedLowPrecisionEmbedding, CachedLowPrecisionUnpooledEmbedding

ROWS, DIM, PAD = 400, 6, 7


def test_fp32_sgd_equals_nn_embedding_with_a_padding_row():
    gen = torch.Generator().manual_seed(0)
    ref = nn.Embedding(ROWS, DIM, padding_idx=PAD, sparse=True)
    with torch.no_grad():  # a padding row that is not zero, as from_pretrained may give one
        ref.weight.copy_(torch.randn(ROWS, DIM, generator=gen))
    ours = CachedLowPrecisionUnpooledEmbedding.from_pretrained(
        ref.weight.detach().clone(), precision="fp32", cache_ratio=0, padding_idx=PAD, lr=0.2
    )
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    for shape in [(16,), (8, 5), (4, 3, 2), (8, 5), (16,)]:
        ids = torch.randint(0, ROWS, shape, generator=gen)
        ids.view(-1)[::3] = PAD
        grad = torch.randn(*shape, DIM, generator=gen)
        a, b = ref(ids), ours(ids)
        assert b.shape == (*shape, DIM)
        # SGD's add and the sparse gradient's coalescing may round apart: a few ulps
        torch.testing.assert_close(b, a, rtol=1e-6, atol=4e-6)
        opt.zero_grad()
        a.backward(grad)
        opt.step()
        b.backward(grad)
        ours.step()
    torch.testing.assert_close(ours.weight, ref.weight.detach(), rtol=1e-6, atol=4e-6)
    assert torch.equal(ours.weight[PAD], ref.weight.detach()[PAD])  # never updated


@pytest.mark.parametrize("precision,policy", [("int8", "lfu"), ("int4", "lru"), ("fp16", "lfu")])
def test_low_precision_equals_bags_of_one_id(precision, policy):
    options = dict(precision=precision, policy=policy, cache_ratio=0.1, rounding="stochastic")
    options.update(optimizer="rowwise_adagrad", lr=0.1, padding_idx=PAD, seed=3)
    ours = CachedLowPrecisionUnpooledEmbedding(ROWS, DIM, **options)
    bags = CachedLowPrecisionEmbedding(ROWS, DIM, mode="sum", **options)
    bags.load_state_dict(ours.state_dict())
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = (torch.rand(12, 4, generator=gen) ** 3 * ROWS).long()
        ids[0, 0] = PAD
        grad = torch.randn(12, 4, DIM, generator=gen)
        a = ours(ids)
        b = bags(ids.reshape(-1, 1)).reshape(12, 4, DIM)
        padded = (ids == PAD).unsqueeze(-1)  # a bag of the padding id alone is empty: zeros
        assert torch.equal(a, torch.where(padded, ours.weight[PAD], b))
        a.backward(grad)
        b.backward(grad)
        ours.step()
        bags.step()
    for (name, x), (_, y) in zip(ours.state_dict().items(), bags.state_dict().items()):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
    assert ours.stats() == bags.stats()


def test_what_does_not_apply_is_refused_naming_it():
    with pytest.raises(ValueError, match="table 'seq': mode does not apply"):
        CachedLowPrecisionUnpooledEmbedding(ROWS, DIM, name="seq", mode="mean")
    with pytest.raises(ValueError, match="include_last_offset does not apply"):
        CachedLowPrecisionUnpooledEmbedding(ROWS, DIM, include_last_offset=True)
    table = CachedLowPrecisionUnpooledEmbedding(ROWS, DIM, name="seq")
    with pytest.raises(ValueError, match="table 'seq': input must be an int64 or int32"):
        table(torch.zeros(3))
    with pytest.raises(ValueError, match=r"table 'seq': index 400 is out of range \[0, 400\)"):
        table(torch.tensor([[1, 400]]))


def test_swap_replaces_nn_embedding_and_keeps_its_padding_row():
    model = nn.ModuleDict({"seq": nn.Embedding(ROWS, DIM, padding_idx=PAD)})
    weight = model["seq"].weight.detach().clone()
    summary = embcache.swap(model, precision="fp32", cache_ratio=0)
    assert isinstance(model["seq"], CachedLowPrecisionUnpooledEmbedding)
    assert summary["seq"]["rows"] == ROWS and model["seq"].padding_idx == PAD
    assert torch.equal(model["seq"].weight, weight)
    ids = torch.tensor([[PAD, 3], [5, PAD]])
    assert torch.equal(model["seq"](ids), weight[ids])
