"""The TorchRec drop-in: KeyedJaggedTensor in, KeyedTensor out, inside torchrec's DLRM."""

import re

import pytest
import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embcache import CachedLowPrecisionEmbeddingBagCollection, EmbeddingUpdateError

CARDS = [5000, 3000, 40, 2000]


def _tables(dim=8):
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{i}"]
        )
        for i, n in enumerate(CARDS)
    ]


def _kjt(gen, batch, max_len=3):
    lengths, values = [], []
    for n in CARDS:
        length = torch.randint(0, max_len + 1, (batch,), generator=gen)
        lengths.append(length)
        values.append((torch.rand(int(length.sum()), generator=gen) ** 2 * n).long())
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(CARDS))],
        values=torch.cat(values),
        lengths=torch.cat(lengths),
    )


def test_matches_torchrec_ebc_in_fp32():
    tables = _tables()
    ref = EmbeddingBagCollection(tables=tables)
    ours = CachedLowPrecisionEmbeddingBagCollection(tables, precision="fp32", cache_ratio=0)
    for name, t in ours.embedding_bags.items():
        t.weights.copy_(ref.embedding_bags[name].weight.detach().contiguous().view(torch.uint8))
    kjt = _kjt(torch.Generator().manual_seed(0), 16)
    a, b = ref(kjt), ours(kjt)
    assert a.keys() == b.keys() and a.length_per_key() == b.length_per_key()
    torch.testing.assert_close(b.values(), a.values())


def test_a_table_read_by_two_features_trains_like_torchrec():
    """Two features of one table: their gradients are merged per row before the update (the
    step that cannot hand the update one gradient per table as the backward made it)."""
    tables = [
        EmbeddingBagConfig(
            name="t0", embedding_dim=8, num_embeddings=50, feature_names=["f0", "f1"]
        ),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=30, feature_names=["f2"]),
    ]
    ref = EmbeddingBagCollection(tables=tables)
    ours = CachedLowPrecisionEmbeddingBagCollection(tables, precision="fp32", cache_ratio=0, lr=0.1)
    for name, t in ours.embedding_bags.items():
        t.weights.copy_(ref.embedding_bags[name].weight.detach().contiguous().view(torch.uint8))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(8)
    batch = 16
    for _ in range(3):
        lengths = torch.randint(0, 4, (3 * batch,), generator=gen)
        sizes = [int(lengths[f * batch : (f + 1) * batch].sum()) for f in range(3)]
        values = torch.cat(
            [torch.randint(0, n, (k,), generator=gen) for n, k in zip([50, 50, 30], sizes)]
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "f1", "f2"], values=values, lengths=lengths
        )
        grad = torch.randn(batch, 20, generator=gen)
        ref(kjt).values().backward(grad)
        opt.step()
        opt.zero_grad()
        ours(kjt).values().backward(grad)
        ours.step()
    for name, t in ours.embedding_bags.items():
        torch.testing.assert_close(
            t.weights.view(torch.float32), ref.embedding_bags[name].weight.detach()
        )


@pytest.mark.parametrize("precision,dim", [("int8", 16), ("fp16", 8), ("fp32", 5)])
def test_forward_value_bound_is_the_largest_value_read(precision, dim):
    """The forward's per-feature bound on |value| (which lets the update skip its storability
    check) is exactly the largest |value| among the rows the feature read, cached or not."""
    gen = torch.Generator().manual_seed(3)
    ebc = CachedLowPrecisionEmbeddingBagCollection(
        _tables(dim), precision=precision, cache_ratio=0.1, min_rows_for_low_precision=0
    )
    for t in ebc.tables():  # values of either sign, the largest anywhere in a row
        with torch.no_grad():
            t.weights.copy_(
                type(t)(
                    t.config.num_embeddings,
                    dim,
                    precision=precision,
                    cache_ratio=0,
                    weight=torch.randn(t.config.num_embeddings, dim, generator=gen),
                    min_rows_for_low_precision=0,
                ).weights
            )
    for _ in range(3):  # fills the caches, which then hold rows that differ from the table
        ebc(_kjt(gen, 32)).values().square().sum().backward()
        ebc.step()
    assert all(int((t.cache_tags >= 0).sum()) > 0 for t in ebc.tables() if t.cache_tags.numel())
    kjt = _kjt(gen, 64)
    names = kjt.keys()  # one feature per table, in table order
    tables = ebc.tables()
    bounds = torch.ops.embcache.multi_lookup_forward(
        [x for t in tables for x in t.state_tensors()],
        torch.stack([t.spec for t in tables]),
        kjt.values(),
        kjt.lengths(),
        None,
        list(range(len(tables))),
        kjt.stride(),
        [],
    )[3]
    for f, name in enumerate(names):
        ids = kjt[name].values()
        current = tables[f].current_weight()
        want = current[ids].abs().max() if ids.numel() else torch.tensor(0.0)
        assert bounds[f].item() == want.item(), name


def test_per_table_overrides_and_small_tables():
    ours = CachedLowPrecisionEmbeddingBagCollection(
        _tables(),
        precision="int8",
        cache_ratio=0.05,
        per_table={"t1": {"precision": "int4", "policy": "lru"}},
    )
    cfg = {n: t.config for n, t in ours.embedding_bags.items()}
    assert cfg["t0"].stored_precision == "int8" and cfg["t1"].stored_precision == "int4"
    assert cfg["t1"].policy == "lru"
    assert cfg["t2"].stored_precision == "fp32" and cfg["t2"].num_slots == 0  # 40 rows < 1000
    assert [c.table_id for c in cfg.values()] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="nope"):
        CachedLowPrecisionEmbeddingBagCollection(_tables(), per_table={"nope": {}})


@pytest.mark.parametrize("cache_ratio", [0.0, 0.1])  # with a cache, SGD judges from gradients
@pytest.mark.parametrize(
    "precision,bad", [("fp16", 1e6), ("int8", float("inf")), ("int8", float("nan"))]
)
def test_step_is_all_or_nothing_across_tables(precision, bad, cache_ratio):
    ours = CachedLowPrecisionEmbeddingBagCollection(
        _tables(), precision=precision, lr=1.0, cache_ratio=cache_ratio
    )
    kjt = _kjt(torch.Generator().manual_seed(1), 8)
    out = ours(kjt).values()
    grad = torch.zeros_like(out)
    grad[:, -8:] = bad  # only the last table gets an update it cannot store
    out.backward(grad)
    before = {k: v.clone() for k, v in ours.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(EmbeddingUpdateError, match="t3"):
        ours.step()
    after = ours.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _train_dlrm(embedding_lr, dense_lr, steps=60):
    """torchrec's DLRM over cached INT8 tables fit to labels that depend on the ids alone (a
    random label per id of feature f0; every sample one id per feature, skewed so the cache
    is used), the dense part trained by Adagrad with ``dense_lr`` or frozen (``None``).
    Returns the losses and t0's statistics."""
    torch.manual_seed(0)
    ebc = CachedLowPrecisionEmbeddingBagCollection(
        _tables(),
        precision="int8",
        rounding="stochastic",
        cache_ratio=0.05,
        associativity=32,
        policy="lfu",
        optimizer="rowwise_adagrad",
        lr=embedding_lr,
    )
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=4,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    gen = torch.Generator().manual_seed(0)
    batch = 256
    ids = [(torch.rand(batch, generator=gen) ** 2 * min(n, 300)).long() for n in CARDS]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(CARDS))],
        values=torch.cat(ids),
        lengths=torch.ones(len(CARDS) * batch, dtype=torch.int64),
    )
    dense = torch.randn(batch, 4, generator=gen)
    labels = torch.randint(0, 2, (CARDS[0],), generator=gen).float()[ids[0]]
    if dense_lr is None:
        for p in model.parameters():
            p.requires_grad_(False)
    opt = torch.optim.Adagrad(model.parameters(), lr=dense_lr or 0.0)
    losses = []
    for _ in range(steps):
        logits = model(dense, kjt).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ebc.step()
        losses.append(loss.item())
    return losses, ebc.stats()["t0"]


def test_torchrec_dlrm_learns_through_cached_int8_tables():
    """The embeddings learn: with the dense part frozen, only the tables' step() can lower
    the loss of labels that depend on the ids alone, and it does so clearly; with the tables
    frozen (lr 0) instead, training the dense part does not come near it."""
    losses, stats = _train_dlrm(embedding_lr=0.1, dense_lr=None)
    assert losses[-1] < 0.5 * losses[0]
    assert stats["hits"] > 0 and stats["insertions"] > 0 and stats["steps"] == 60
    frozen, _ = _train_dlrm(embedding_lr=0.0, dense_lr=0.05)
    assert frozen[0] == losses[0]  # the same model and data
    assert losses[-1] < 0.5 * frozen[-1]


@pytest.mark.parametrize("bad", ["too_big", "negative", "negative_length"])
def test_bad_ids_name_table_and_feature_and_change_nothing(bad):
    ours = CachedLowPrecisionEmbeddingBagCollection(_tables(), precision="int8", cache_ratio=0.05)
    kjt = _kjt(torch.Generator().manual_seed(3), 8)
    ours(kjt).values().sum().backward()
    ours.step()  # some rows cached, counts and statistics non-zero
    values, lengths = kjt.values().clone(), kjt.lengths().clone()
    at = int(kjt.lengths()[:8].sum()) + 1  # a lookup of feature f1 (table t1, 3000 rows)
    if bad == "too_big":
        values[at], expected = 3000, "table 't1': feature 'f1' has index 3000"
    elif bad == "negative":
        values[at], expected = -1, "table 't1': feature 'f1' has index -1"
    else:
        lengths[9], lengths[10] = -1, lengths[10] + lengths[9] + 1
        expected = "negative length"
    broken = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=lengths)
    before = {k: v.clone() for k, v in ours.state_dict().items() if isinstance(v, torch.Tensor)}
    stats = ours.stats()
    with pytest.raises(ValueError, match=expected):
        ours(broken)
    after = ours.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert ours.stats() == stats


def _bytes(module):
    """Every tensor of the module's state as bytes (NaN-safe, exact)."""
    return {
        k: v.detach().clone().contiguous().view(-1).view(torch.uint8)
        for k, v in module.state_dict().items()
        if isinstance(v, torch.Tensor)
    }


def _assert_same_bytes(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_two_tables_with_one_name_are_refused():
    tables = _tables()
    tables[2] = EmbeddingBagConfig(
        name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f2"]
    )
    with pytest.raises(ValueError, match="table 't1' is named by two tables"):
        CachedLowPrecisionEmbeddingBagCollection(tables, precision="int8")


def _inconsistent_kjt(kjt, case):
    """``kjt`` (features f0..f3, batch 8) broken as ``case`` says (keys in the forward's order
    or another one), and the message expected."""
    order = [3, 1, 0, 2] if case.endswith("keys_permuted") else [0, 1, 2, 3]
    keys = [f"f{i}" for i in order]
    lengths = kjt.lengths().view(4, 8)
    parts = kjt.values().split([int(n) for n in lengths.sum(1)])
    values = torch.cat([parts[i] for i in order])
    lengths = lengths[order].reshape(-1).clone()
    per_key = [int(n) for n in lengths.view(4, 8).sum(1)]  # in the order of keys
    total = sum(per_key)
    extra = {}
    if case.startswith("one_value_too_many"):
        values = torch.cat([values, values[:1]])
        expected = f"lengths sum to {total} but there are {total + 1} ids: 1 ids are left"
        expected += f" after the last feature '{keys[-1]}'"
    elif case.startswith("one_length_too_long"):
        lengths[9] += 1  # the second key's second sample claims an id more than there are
        ends = torch.tensor(per_key).cumsum(0) + torch.tensor([0, 1, 1, 1])
        first_past = keys[int(torch.nonzero(ends > total)[0])]
        expected = f"lengths sum to {total + 1} but there are {total} ids: feature "
        expected += f"'{first_past}' runs past the end of the ids"
    elif case.startswith("length_per_key"):
        # lengths and values agree; the carried per-key sums give the second key an id more
        extra["length_per_key"] = [per_key[0], per_key[1] + 1, per_key[2] - 1, per_key[3]]
        expected = f"feature '{keys[1]}': its lengths sum to {per_key[1]}, but the "
        expected += f"KeyedJaggedTensor's length_per_key/offset_per_key says {per_key[1] + 1}"
    else:  # one length fewer than features x batch
        lengths = torch.cat([lengths[:1] + lengths[-1], lengths[1:-1]])
        extra["stride"] = 8
        expected = "31 lengths, expected one per feature and sample: 4 features x batch 8"
    broken = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, **extra)
    return broken, expected


@pytest.mark.parametrize(
    "case",
    [
        "one_value_too_many",
        "one_value_too_many_keys_permuted",
        "one_length_too_long",
        "one_length_too_long_keys_permuted",
        "length_per_key_disagrees_keys_permuted",
        "lengths_not_one_per_feature_and_sample",
        "lengths_not_one_per_feature_and_sample_keys_permuted",
    ],
)
def test_lengths_that_do_not_fit_the_values_name_the_feature_and_change_nothing(case):
    """A KeyedJaggedTensor whose lengths do not add up to its values (or to the per-key sums
    it carries) is refused with a ValueError naming the feature, before the forward reads a
    row or counts a lookup, also when its keys come in another order (the forward permutes
    them, which reads the lengths)."""
    ours = CachedLowPrecisionEmbeddingBagCollection(_tables(), precision="int8", cache_ratio=0.05)
    kjt = _kjt(torch.Generator().manual_seed(3), 8)
    ours(kjt).values().sum().backward()
    ours.step()  # some rows cached, counts and statistics non-zero
    broken, expected = _inconsistent_kjt(kjt, case)
    before, stats = _bytes(ours), ours.stats()
    assert all(s["lookups"] > 0 for s in stats.values())
    with pytest.raises(ValueError, match=re.escape(expected)):
        ours(broken)
    _assert_same_bytes(before, _bytes(ours))
    assert ours.stats() == stats
    assert ours.pending_grads() == []


def test_ids_changed_before_backward_are_refused_and_nothing_is_stored():
    """The backward deduplicates the ids the forward read: if the caller's id tensor changed
    in place in between, autograd refuses the backward and no table holds a gradient."""
    ours = CachedLowPrecisionEmbeddingBagCollection(_tables(), precision="int8", cache_ratio=0.05)
    kjt = _kjt(torch.Generator().manual_seed(4), 8)
    out = ours(kjt).values()
    kjt.values()[0] += 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    assert ours.pending_grads() == []


def test_tables_see_the_gradient_their_collection_stored():
    """The collection keeps a backward's gradient as one record; each table's own methods
    see their part of it: one table's zero_grad skips that table alone, and the
    collection's step still applies the others exactly as an unskipped step would."""
    options = dict(precision="int8", cache_ratio=0.05, policy="lfu", lr=0.5)
    ours = CachedLowPrecisionEmbeddingBagCollection(_tables(), **options)
    twin = CachedLowPrecisionEmbeddingBagCollection(_tables(), **options)
    gen = torch.Generator().manual_seed(6)
    kjt = _kjt(gen, 32)
    grad = torch.randn(32, 8 * len(CARDS), generator=gen)
    for module in (ours, twin):
        module(kjt).values().backward(grad)
    skipped = ours.embedding_bags["t1"]
    (part,) = skipped.pending_grads()
    assert torch.equal(part, twin.embedding_bags["t1"].pending_grads()[0])
    before = {k: v.clone() for k, v in skipped.state_dict().items() if isinstance(v, torch.Tensor)}
    skipped.zero_grad()
    assert skipped.pending_grads() == [] and len(ours.pending_grads()) == len(CARDS) - 1
    ours.step()
    twin.step()
    assert ours.pending_grads() == []
    a, b = _state(ours), _state(twin)
    for key in a:
        if key.startswith("embedding_bags.t1."):
            assert torch.equal(a[key], before[key.removeprefix("embedding_bags.t1.")]), key
        else:
            assert torch.equal(a[key], b[key]), key
    assert skipped.stats()["steps"] == 0 and twin.embedding_bags["t1"].stats()["steps"] == 1


def test_evaluation_forward_changes_nothing():
    ours = CachedLowPrecisionEmbeddingBagCollection(
        _tables(), precision="int8", cache_ratio=0.05, policy="lfu"
    )
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        ours(_kjt(gen, 16)).values().sum().backward()
        ours.step()
    before, stats = _state(ours), ours.stats()
    assert all(s["lookups"] > 0 for s in stats.values())
    ours.eval()
    out = ours(_kjt(gen, 16)).values()
    assert not out.requires_grad
    ours.step()
    assert ours.stats() == stats
    after = _state(ours)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _state(module):
    return {k: v.clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(
    "schedule",
    ["plain", "forward_ahead_of_step", "flush_before_step", "two_forwards", "near_fp16_max"],
)
def test_table_batched_step_equals_one_table_at_a_time(schedule):
    """The collection's update (which reuses the forward's cache slots and value bound while
    the cache is unchanged, and computes new values where it writes them) leaves the same
    bytes as its tables trained one by one (slots searched anew, values checked first), also
    when the cache changes between a forward and the step that applies its gradient, and when
    values so close to the format's limit that the bound cannot vouch for them must be checked."""
    options = dict(precision="int8", cache_ratio=0.005, associativity=4, policy="lfu", lr=0.5)
    if schedule == "near_fp16_max":
        options["precision"] = "fp16"
    ours = CachedLowPrecisionEmbeddingBagCollection(_tables(4), **options)
    alone = CachedLowPrecisionEmbeddingBagCollection(_tables(4), **options)
    if (
        schedule == "near_fp16_max"
    ):  # |v| up to 64000: storable, but above what the bound vouches for
        for module in (ours, alone):
            for t in module.tables():
                values = torch.empty(t.weights.shape[0], 4).uniform_(
                    -64000, 64000, generator=torch.Generator().manual_seed(3)
                )
                t.weights.copy_(
                    values.half().view(torch.uint8).view(t.weights.shape)
                    if t.config.bits == 16
                    else values.view(torch.uint8).view(t.weights.shape)
                )
    gen = torch.Generator().manual_seed(7)
    batches = [_kjt(gen, 64) for _ in range(16)]
    grads = [torch.randn(64, 4 * len(CARDS), generator=gen) for _ in batches]

    def forward(module, k):
        return module(batches[k]).values()

    def step(module):
        if module is ours:
            module.step()
        else:  # each table's own step: its gradient alone, never with slot hints
            for t in module.tables():
                t.step()

    for module in (ours, alone):
        k = 0
        while k + 1 < len(batches):
            if schedule in ("plain", "near_fp16_max"):
                forward(module, k).backward(grads[k])
                step(module)
            elif schedule == "forward_ahead_of_step":  # forward k+1 sees the cache before step k
                out = forward(module, k)
                out_next = forward(module, k + 1)
                out.backward(grads[k])
                step(module)
                out_next.backward(grads[k + 1])
                step(module)
                k += 1
            elif schedule == "flush_before_step":
                forward(module, k).backward(grads[k])
                module.flush()
                step(module)
            else:  # two forwards, one step: gradients merged per table
                forward(module, k).backward(grads[k])
                forward(module, k + 1).backward(grads[k + 1])
                step(module)
                k += 1
            k += 1
    if schedule != "near_fp16_max":
        changes = sum(t.stats()["evictions"] + t.stats()["flushed"] for t in ours.tables())
        assert changes > 0  # the cache did change under the pending gradients
    a, b = _state(ours), _state(alone)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert ours.stats() == alone.stats()  # counted by the table-batched op / table by table


def test_a_dropped_collection_frees_its_tables_at_once():
    """No reference cycle between the collection's group and its tables: with Python's cycle
    collector off, dropping a trained collection frees every table."""
    import gc
    import weakref

    ebc = CachedLowPrecisionEmbeddingBagCollection(_tables(), precision="int8", cache_ratio=0.1)
    ebc(_kjt(torch.Generator().manual_seed(0), 16)).values().sum().backward()
    ebc.step()
    gc.disable()
    try:
        refs = [weakref.ref(t) for t in ebc.tables()]
        del ebc
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def _unpooled_configs():
    from torchrec.modules.embedding_configs import EmbeddingConfig

    return [
        EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=300, feature_names=["a", "b"]),
        EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=50, feature_names=["c"]),
    ]


def _sequences(gen, batch=5):
    """Features of different total lengths (empty sequences included)."""
    lengths = torch.randint(0, 4, (3 * batch,), generator=gen)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(keys=["a", "b", "c"], values=values, lengths=lengths)


def test_unpooled_collection_trains_like_torchrec_embedding_collection_in_fp32():
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from embcache import CachedLowPrecisionEmbeddingCollection

    torch.manual_seed(0)
    ref = EmbeddingCollection(_unpooled_configs())
    weights = {t: {"weight": ref.embeddings[t].weight.detach().clone()} for t in ("t0", "t1")}
    ours = CachedLowPrecisionEmbeddingCollection(
        _unpooled_configs(), precision="fp32", cache_ratio=0, lr=0.1, per_table=weights
    )
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        kjt = _sequences(gen)
        a, b = ref(kjt), ours(kjt)
        assert sorted(b) == ["a", "b", "c"]
        for k in "abc":
            assert torch.equal(b[k].lengths(), a[k].lengths())
            torch.testing.assert_close(b[k].values(), a[k].values(), rtol=1e-6, atol=1e-6)
        loss = [
            sum((o[k].values() * (i + 1)).pow(2).sum() for i, k in enumerate("abc")) for o in (a, b)
        ]
        opt.zero_grad()
        loss[0].backward()
        opt.step()
        loss[1].backward()
        ours.step()
    for t in ("t0", "t1"):
        torch.testing.assert_close(
            ours.embedding_bags[t].weight, ref.embeddings[t].weight.detach(), rtol=1e-6, atol=1e-6
        )


def test_unpooled_collection_equals_its_tables_fed_one_id_a_bag():
    """Low precision behind a cache: each feature's rows are its table's lookups of one id a bag
    (the unpooled table, tested bit for bit elsewhere), and only real ids are counted."""
    from embcache import CachedLowPrecisionEmbeddingCollection

    ours = CachedLowPrecisionEmbeddingCollection(
        _unpooled_configs(), precision="int8", cache_ratio=0.2, min_rows_for_low_precision=0
    )
    ours.eval()
    kjt = _sequences(torch.Generator().manual_seed(2))
    out = ours(kjt)
    for k, t in (("a", "t0"), ("b", "t0"), ("c", "t1")):
        ids = kjt[k].values()
        table = ours.embedding_bags[t]
        expected = table(ids.long(), torch.arange(ids.numel() + 1))
        assert torch.equal(out[k].values(), expected)
    ours.train()
    ours(kjt)
    lookups = sum(t.stats()["lookups"] for t in ours.tables())
    assert lookups == kjt.values().numel()


def test_swap_replaces_a_torchrec_embedding_collection_with_its_weights():
    from torchrec.modules.embedding_modules import EmbeddingCollection

    import embcache

    model = torch.nn.ModuleDict({"seq": EmbeddingCollection(_unpooled_configs())})
    kjt = _sequences(torch.Generator().manual_seed(3))
    before = model["seq"](kjt)
    summary = embcache.swap(model, precision="fp32", cache_ratio=0)
    assert isinstance(model["seq"], embcache.CachedLowPrecisionEmbeddingCollection)
    assert set(summary) == {"t0", "t1"}
    after = model["seq"](kjt)
    for k in "abc":
        assert torch.equal(after[k].values(), before[k].values().detach())


def test_a_max_pooled_bag_table_has_no_torchrec_collection():
    """TorchRec's PoolingType has SUM, MEAN and NONE: a BagTable pooled by max is refused by
    name (rather than pooled another way)."""
    from torchrec.modules.embedding_configs import PoolingType

    from embcache import BagTable

    assert "MAX" not in PoolingType.__members__
    tables = [BagTable("a", 100, 4), BagTable("m", 100, 4, mode="max")]
    with pytest.raises(ValueError, match="^table 'm': mode 'max' has no TorchRec PoolingType"):
        CachedLowPrecisionEmbeddingBagCollection.from_bag_tables(tables)
