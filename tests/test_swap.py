"""embcache.swap and TableOptimizer: a model's nn.EmbeddingBag and TorchRec
EmbeddingBagCollection tables replaced in one call, carrying their weights; with FP32 tables
and no cache the swapped model trains exactly as the original does with SGD (the oracle)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import embcache


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.EmbeddingBag(3000, 8, mode="mean", sparse=True)
        self.users = nn.EmbeddingBag(50, 8, mode="sum", sparse=True, padding_idx=0)
        self.head = nn.Linear(16, 1)

    def forward(self, items, users):
        return self.head(torch.cat([self.items(items), self.users(users)], 1)).squeeze(1)


def _batch(gen):
    items = (torch.rand(32, 3, generator=gen) ** 3 * 3000).long()
    users = torch.randint(0, 50, (32, 2), generator=gen)
    return items, users, torch.randint(0, 2, (32,), generator=gen).float()


def test_fp32_swap_trains_like_the_original_with_sgd():
    torch.manual_seed(0)
    original = TwoTower()
    swapped = copy.deepcopy(original)
    summary = embcache.swap(swapped, precision="fp32", cache_ratio=0, lr=0.1)
    assert isinstance(swapped.items, embcache.CachedLowPrecisionEmbedding)
    assert set(summary) == {"items", "users"}
    assert [n for n, _ in swapped.named_parameters()] == ["head.weight", "head.bias"]
    opt = torch.optim.SGD(original.parameters(), lr=0.1)
    dense, tables = torch.optim.SGD(swapped.parameters(), lr=0.1), embcache.TableOptimizer(swapped)
    gen = torch.Generator().manual_seed(1)
    loss_fn = nn.functional.binary_cross_entropy_with_logits
    for _ in range(5):
        items, users, labels = _batch(gen)
        a, b = original(items, users), swapped(items, users)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        loss_fn(a, labels).backward()
        loss_fn(b, labels).backward()
        opt.step()
        opt.zero_grad()
        dense.step()
        tables.step()
        dense.zero_grad()
        tables.zero_grad()
    for name in ("items", "users"):
        ours, theirs = getattr(swapped, name).weight, getattr(original, name).weight.detach()
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_max_pooled_bag_is_swapped_and_trains_like_the_original():
    """nn.EmbeddingBag(mode="max"), with padding_idx: the swapped table pools and trains as
    the original does (FP32, no cache, SGD)."""
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    original = nn.ModuleDict({"bag": nn.EmbeddingBag(40, 6, mode="max", padding_idx=3)})
    swapped = copy.deepcopy(original)
    embcache.swap(swapped, precision="fp32", cache_ratio=0, lr=0.5)
    assert swapped["bag"].mode == "max"
    opt, tables = torch.optim.SGD(original.parameters(), lr=0.5), embcache.TableOptimizer(swapped)
    for _ in range(3):
        ids = torch.randint(0, 40, (16, 4), generator=gen)
        a, b = original["bag"](ids), swapped["bag"](ids)
        assert torch.equal(a, b)
        grad = torch.randn(a.shape, generator=gen)
        a.backward(grad)
        b.backward(grad)
        opt.step()
        opt.zero_grad()
        tables.step()
    assert torch.equal(swapped["bag"].weight, original["bag"].weight.detach())


def test_a_low_precision_swap_reports_what_it_saved():
    model = TwoTower()
    users_weight = model.users.weight.detach().clone()
    summary = embcache.swap(
        model, precision="int8", cache_ratio=0.05, per_table={"items": {"precision": "int4"}}
    )
    items, users = summary["items"], summary["users"]
    assert items["precision"] == "int4" and items["cache_slots"] == 128  # 150, in sets of 32
    assert items["bytes_before"] == 3000 * 8 * 4 and items["bytes_after"] < items["bytes_before"]
    assert items["bytes_after"] == model.items.memory_bytes()["total"]
    assert users["precision"] == "fp32"  # 50 rows: under the minimum, kept FP32, exactly
    assert torch.equal(model.users.weight, users_weight)


def test_what_cannot_be_swapped_is_refused_before_anything_changes():
    model = nn.ModuleDict(
        {"bag": nn.EmbeddingBag(100, 4), "seq": nn.Embedding(100, 4, scale_grad_by_freq=True)}
    )
    with pytest.raises(ValueError, match="seq: nn.Embedding with scale_grad_by_freq"):
        embcache.swap(model)
    assert isinstance(model["bag"], nn.EmbeddingBag)  # untouched


def test_a_torchrec_collection_is_swapped_with_its_weights():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=2000, feature_names=["f"])
        ]
    )
    model = nn.ModuleDict({"ebc": ebc})
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([1, 5, 7, 1999]), lengths=torch.tensor([2, 0, 2])
    )
    expected = ebc(kjt).values().detach()
    summary = embcache.swap(model, precision="fp32", cache_ratio=0)
    assert set(summary) == {"t"}
    assert torch.equal(model["ebc"](kjt).values(), expected)
    tables = embcache.TableOptimizer(model)
    assert tables.units == [model["ebc"]]


class ManyTables(nn.Module):
    """Tables on their own and a collection of ours, as a swapped model has them."""

    def __init__(self):
        super().__init__()
        options = dict(cache_ratio=0.1, optimizer="rowwise_adagrad", lr=0.5, mode="sum")
        self.singles = nn.ModuleList(
            embcache.CachedLowPrecisionEmbedding(
                n, 8, precision=p, name=f"s_{i}", table_id=i, **options
            )
            for i, (n, p) in enumerate([(2000, "int8"), (1500, "fp16"), (3000, "int4")])
        )
        bags = [embcache.BagTable(f"c_{i}", 1200 + i, 8) for i in range(2)]
        self.bags = embcache.CachedLowPrecisionEmbeddingBags(bags, precision="int8", lr=0.5)

    def forward(self, ids):
        pooled = [t(ids[:, i : i + 1]) for i, t in enumerate(self.singles)]
        return torch.cat([*pooled, self.bags(ids[:, 3:])], 1)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def test_table_optimizer_updates_every_table_in_one_call_all_or_nothing(monkeypatch):
    """TableOptimizer.step() is one table-batched update for tables on their own and a
    collection's together, with the same result as stepping each unit by itself; and a step
    one table refuses changes no table (not only those after it)."""
    import embcache.group

    gen = torch.Generator().manual_seed(5)
    model = ManyTables()
    alone = copy.deepcopy(model)
    calls = []
    ops = embcache.group._ops

    class Counting:
        def __getattr__(self, name):
            if name == "multi_update":
                calls.append(name)
            return getattr(ops, name)

    for _ in range(3):
        ids = (torch.rand(16, 5, generator=gen) ** 2 * 1200).long()
        grad = torch.randn(16, 40, generator=gen)
        (model(ids) * grad).sum().backward()
        (alone(ids) * grad).sum().backward()
        monkeypatch.setattr(embcache.group, "_ops", Counting())
        embcache.TableOptimizer(model).step()
        monkeypatch.setattr(embcache.group, "_ops", ops)
        for unit in [*alone.singles, alone.bags]:
            unit.step()
        theirs = _state(alone)
        assert all(torch.equal(v, theirs[k]) for k, v in _state(model).items())
    assert calls == ["multi_update"] * 3

    ids = torch.zeros(4, 5, dtype=torch.long)
    grad = torch.zeros(4, 40)
    grad[:, 8:16] = float("inf")  # the second unit's gradient: refused, and so the step
    (model(ids) * grad).sum().backward()
    before = _state(model)
    with pytest.raises(embcache.EmbeddingUpdateError, match="table 's_1': non-finite"):
        embcache.TableOptimizer(model).step()
    after = _state(model)
    assert all(torch.equal(v, after[k]) for k, v in before.items())
