"""CachedLowPrecisionEmbeddingBags, the torch-only module of several tables: its pooled rows
and its update against ``F.embedding_bag`` at FP32 without a cache (one-hot ``[batch,
features]`` ids, and multi-hot feature-major ids with lengths, weights and mean pooling), and
bad input refused by name with nothing changed."""

import re

import pytest
import torch
import torch.nn.functional as F

from embcache import BagTable, CachedLowPrecisionEmbeddingBags

pytestmark = pytest.mark.usefixtures("one_thread")

# t_b serves two features, so a table's features and the output's columns are told apart
TABLES = [
    BagTable("t_a", 1200, 4, ("f_0",)),
    BagTable("t_b", 50, 8, ("f_1", "f_2"), mode="mean"),
    BagTable("t_c", 3000, 4),
]


def _ours(gen, tables=TABLES, **options):
    weights = {
        t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=gen) for t in tables
    }
    module = CachedLowPrecisionEmbeddingBags(
        tables,
        per_table={n: {"weight": w} for n, w in weights.items()},
        **{"precision": "fp32", "cache_ratio": 0.0, "optimizer": "sgd", "lr": 1.0, **options},
    )
    return module, weights


def _features(tables=TABLES):
    return [(t, f) for t in tables for f in t.feature_names]


def _reference(tables, weights, ids, lengths, psw, batch):
    """Each feature's ``F.embedding_bag`` of its ids, concatenated; the weights are leaves."""
    out, start = [], 0
    for f, (table, _) in enumerate(_features(tables)):
        count = lengths[f * batch : (f + 1) * batch]
        n = int(count.sum())
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), count.cumsum(0)[:-1]])
        w = None if psw is None else psw[start : start + n]
        out.append(
            F.embedding_bag(
                ids[start : start + n],
                weights[table.name],
                offsets,
                mode=table.mode,
                per_sample_weights=w,
            )
        )
        start += n
    return torch.cat(out, 1)


@pytest.mark.parametrize("input", ["one_hot", "multi_hot", "weighted", "max"])
def test_pooled_rows_and_the_update_are_embedding_bags(input):
    gen = torch.Generator().manual_seed(["one_hot", "multi_hot", "weighted", "max"].index(input))
    tables = TABLES
    if input == "weighted":  # per-sample weights need sum pooling
        tables = [
            BagTable(t.name, t.num_embeddings, t.embedding_dim, t.feature_names) for t in TABLES
        ]
    if input == "max":  # multi-hot, t_c pooled by max beside sum and mean
        tables = [*TABLES[:2], BagTable("t_c", 3000, 4, mode="max")]
    ours, weights = _ours(gen, tables)
    leaves = {n: w.clone().requires_grad_() for n, w in weights.items()}
    batch, features = 6, _features(tables)
    if input == "one_hot":
        ids2d = torch.stack(
            [torch.randint(0, t.num_embeddings, (batch,), generator=gen) for t, _ in features], 1
        )
        got = ours(ids2d)
        ids, lengths, psw = ids2d.t().reshape(-1), torch.ones(len(features) * batch).long(), None
    else:
        lengths = torch.randint(0, 4, (len(features) * batch,), generator=gen)
        per_feature = lengths.view(len(features), batch).sum(1)
        ids = torch.cat(
            [
                torch.randint(0, t.num_embeddings, (int(n),), generator=gen)
                for (t, _), n in zip(features, per_feature)
            ]
        )
        psw = torch.rand(ids.numel(), generator=gen) if input == "weighted" else None
        got = ours(ids.int(), lengths, psw)
    want = _reference(tables, leaves, ids, lengths, psw, batch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grad_out = torch.randn(got.shape, generator=gen)
    (got * grad_out).sum().backward()
    (want * grad_out).sum().backward()
    ours.step()
    for name, table in ours.embedding_bags.items():
        expected = weights[name] - leaves[name].grad  # SGD, lr 1
        torch.testing.assert_close(table.current_weight(), expected, rtol=1e-6, atol=1e-6)


def _state(module):
    return {k: v.clone() for k, v in module.state_dict().items() if torch.is_tensor(v)}


@pytest.mark.parametrize(
    "case, message",
    [
        ("id_out_of_range", "table 't_b': feature 'f_2' has index 50, out of range [0, 50)"),
        ("negative_id", "table 't_a': feature 'f_0' has index -1"),
        ("too_few_columns", "ids without lengths must be [batch, 4]"),
        ("lengths_past_the_ids", "feature 't_c' runs past the end of the ids"),
        ("weights_of_another_shape", "per_sample_weights must have the shape of ids (5, 4)"),
        ("float_ids", "ids must be int64 or int32"),
    ],
)
def test_bad_input_names_the_table_or_feature_and_changes_nothing(case, message):
    gen = torch.Generator().manual_seed(3)
    ours, _ = _ours(gen, precision="int8", cache_ratio=0.1, min_rows_for_low_precision=0)
    ids = torch.stack(
        [torch.randint(0, t.num_embeddings, (5,), generator=gen) for t, _ in _features()], 1
    )
    ours(ids).sum().backward()
    ours.step()  # rows cached, counts and statistics non-zero
    args = {
        "id_out_of_range": lambda: (
            ids.index_put((torch.tensor([3]), torch.tensor([2])), torch.tensor(50)),
        ),
        "negative_id": lambda: (
            ids.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(-1)),
        ),
        "too_few_columns": lambda: (ids[:, :3],),
        "lengths_past_the_ids": lambda: (
            ids.t().reshape(-1)[:-1],
            torch.ones(20, dtype=torch.long),
        ),
        "weights_of_another_shape": lambda: (ids, None, torch.ones(5, 3)),
        "float_ids": lambda: (ids.float(),),
    }[case]()
    before, stats = _state(ours), ours.stats()
    with pytest.raises(ValueError, match=re.escape(message)):
        ours(*args)
    after = _state(ours)
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert ours.stats() == stats and ours.pending_grads() == []


@pytest.mark.parametrize("mode", ["mean", "max"])
def test_per_sample_weights_are_refused_unless_the_table_sums(mode):
    """As nn.EmbeddingBag: per-sample weights with mean or max pooling are refused, naming the
    table, and nothing changes."""
    tables = [BagTable("t_a", 100, 4), BagTable("t_m", 100, 4, mode=mode)]
    ours, _ = _ours(torch.Generator().manual_seed(3), tables)
    before = _state(ours)
    message = f"^table 't_m': per_sample_weights are only supported with mode='sum' \\(got mode='{mode}'\\)"
    with pytest.raises(ValueError, match=message):
        ours(torch.zeros(5, 2, dtype=torch.int64), per_sample_weights=torch.ones(5, 2))
    assert all(torch.equal(v, before[k]) for k, v in _state(ours).items())
