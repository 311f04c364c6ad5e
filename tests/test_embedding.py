"""CachedLowPrecisionEmbedding against independent oracles: nn.EmbeddingBag + torch.optim.SGD,
FBGEMM's CPU TBE, its own state_dict, and the bad-input contract (docs/contract.md §4-5)."""

import copy
import io

import pytest
import torch
from torch import nn

from embcache import CachedLowPrecisionEmbedding, EmbeddingUpdateError, reference


def _skewed_batch(gen, rows, bags, max_len):
    lengths = torch.randint(0, max_len + 1, (bags,), generator=gen)
    n = int(lengths.sum())
    indices = (torch.rand(n, generator=gen) ** 3 * rows).long()
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return indices, offsets


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _step_beside(ours, ref, opt, indices, offsets, grad, psw=None):
    """One training step of ``ours`` and of ``ref`` (an nn.EmbeddingBag with its SGD ``opt``)
    on the same bags and output gradient; their outputs agree."""
    out_ref = ref(indices, offsets, per_sample_weights=psw)
    out = ours(indices, offsets, per_sample_weights=psw)
    # nn.EmbeddingBag's kernels and SGD's add may fuse multiply-adds: a few ulps of the
    # summands (|x| ~ 4 after some steps) apart
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=4e-6)
    opt.zero_grad()
    out_ref.backward(grad)
    opt.step()
    out.backward(grad)
    ours.step()


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_fp32_sgd_equals_embedding_bag(mode, weighted):
    if weighted and mode == "mean":
        pytest.skip("nn.EmbeddingBag supports per-sample weights with mode='sum' only")
    gen = torch.Generator().manual_seed(1)
    rows, dim = 300, 5
    ref = nn.EmbeddingBag(rows, dim, mode=mode, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(rows, dim, generator=gen))
    opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    ours = CachedLowPrecisionEmbedding(
        rows,
        dim,
        precision="fp32",
        cache_ratio=0,
        mode=mode,
        lr=0.3,
        weight=ref.weight.detach().clone(),
        min_rows_for_low_precision=0,
    )
    for _ in range(6):
        indices, offsets = _skewed_batch(gen, rows, 32, 4)
        psw = torch.rand(indices.numel(), generator=gen) if weighted else None
        grad = torch.randn(32, dim, generator=gen)
        _step_beside(ours, ref, opt, indices, offsets, grad, psw)
        torch.testing.assert_close(ours.current_weight(), ref.weight.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dim", [16, 5])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_as_many_lookups_as_bags_is_not_one_per_bag(dim, mode):
    """Empty bags and bags of two, as many lookups as bags in all: pooled as nn.EmbeddingBag
    pools them (a shortcut for one lookup per bag must not take them)."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(50, dim, generator=gen)
    ours = CachedLowPrecisionEmbedding(
        50, dim, precision="fp32", cache_ratio=0, mode=mode, weight=weight.clone(),
        min_rows_for_low_precision=0,
    )  # fmt: skip
    lengths = torch.tensor([0, 2] * 300)  # any even run of bags: as many lookups as bags
    offsets = torch.cumsum(lengths, 0) - lengths
    indices = torch.randint(0, 50, (600,), generator=gen)
    want = nn.EmbeddingBag(50, dim, mode=mode, _weight=weight)(indices, offsets)
    torch.testing.assert_close(ours(indices, offsets), want, rtol=1e-6, atol=1e-6)


def test_per_sample_weight_gradient_matches_embedding_bag():
    gen = torch.Generator().manual_seed(2)
    ref = nn.EmbeddingBag(100, 4, mode="sum")
    ours = CachedLowPrecisionEmbedding(
        100,
        4,
        mode="sum",
        precision="fp32",
        cache_ratio=0,
        weight=ref.weight.detach().clone(),
        min_rows_for_low_precision=0,
    )
    indices, offsets = _skewed_batch(gen, 100, 16, 5)
    psw_a = torch.rand(indices.numel(), generator=gen, requires_grad=True)
    psw_b = psw_a.detach().clone().requires_grad_()
    grad = torch.randn(16, 4, generator=gen)
    ref(indices, offsets, per_sample_weights=psw_a).backward(grad)
    ours(indices, offsets, per_sample_weights=psw_b).backward(grad)
    torch.testing.assert_close(psw_b.grad, psw_a.grad)


def test_one_table_trains_the_same_on_one_thread_and_on_two():
    """A table alone runs its kernels' loops across the threads (chunks of bags, of unique
    rows and of cache sets): its outputs and every byte of its state are those of one thread."""
    threads = torch.get_num_threads()

    def train(n):
        torch.set_num_threads(n)
        gen = torch.Generator().manual_seed(0)
        table = CachedLowPrecisionEmbedding(
            200_000, 16, precision="int8", rounding="stochastic", cache_ratio=0.05,
            associativity=8, policy="lfu", lr=0.5, seed=7, min_rows_for_low_precision=0,
        )  # fmt: skip
        outs = []
        for _ in range(3):  # ~15k unique rows and ~1,250 sets with contenders a step
            out = table(
                torch.randint(0, 200_000, (16384,), generator=gen), torch.arange(0, 16384, 4)
            )
            out.backward(torch.randn(out.shape, generator=gen))
            table.step()
            outs.append(out.detach())
        return outs, table.state_dict()

    try:
        (one_outs, one_state), (two_outs, two_state) = train(1), train(2)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one_outs, two_outs))
    assert one_state.keys() == two_state.keys()
    for key, value in one_state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, two_state[key]), key


def test_fp32_rowwise_adagrad_equals_fbgemm_tbe():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    gen = torch.Generator().manual_seed(3)
    rows, dim, bags = 2000, 8, 64
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.1,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )
    ours = CachedLowPrecisionEmbedding(
        rows,
        dim,
        mode="sum",
        precision="fp32",
        cache_ratio=0,
        optimizer="rowwise_adagrad",
        lr=0.1,
        eps=1e-8,
        weight=tbe.split_embedding_weights()[0].detach().clone(),
    )
    for _ in range(5):
        indices, offsets = _skewed_batch(gen, rows, bags, 3)
        grad = torch.randn(bags, dim, generator=gen)
        tbe(indices, torch.cat([offsets, torch.tensor([indices.numel()])])).backward(grad)
        ours(indices, offsets).backward(grad)
        ours.step()
    torch.testing.assert_close(
        ours.current_weight(), tbe.split_embedding_weights()[0].detach(), rtol=0, atol=1e-6
    )
    fb_state = tbe.split_optimizer_states()[0][0].reshape(-1)
    torch.testing.assert_close(ours.optimizer_state, fb_state, rtol=1e-6, atol=0)


def _train(module, gen, steps, rows):
    for _ in range(steps):
        indices, offsets = _skewed_batch(gen, rows, 48, 4)
        out = module(indices, offsets)
        out.backward(torch.randn(out.shape, generator=gen) * 0.1)
        module.step()


@pytest.mark.parametrize("precision,policy", [("int8", "lfu"), ("int4", "lru"), ("fp16", "lfu")])
def test_state_dict_resumes_bit_identically(precision, policy):
    kw = dict(
        precision=precision,
        policy=policy,
        rounding="stochastic",
        cache_ratio=0.1,
        associativity=4,
        optimizer="rowwise_adagrad",
        lr=0.05,
        seed=7,
    )
    a = CachedLowPrecisionEmbedding(2000, 6, **kw)
    _train(a, torch.Generator().manual_seed(0), 5, 2000)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = CachedLowPrecisionEmbedding(2000, 6, **{**kw, "seed": 7})
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    _train(a, torch.Generator().manual_seed(1), 5, 2000)
    _train(b, torch.Generator().manual_seed(1), 5, 2000)
    _assert_same_state(_state(a), _state(b))


def test_load_state_dict_from_another_configuration_is_refused():
    a = CachedLowPrecisionEmbedding(2000, 6, precision="int8", lr=0.1)
    b = CachedLowPrecisionEmbedding(2000, 6, precision="int8", lr=0.2)
    before = _state(b)
    with pytest.raises(ValueError, match="lr"):
        b.load_state_dict(a.state_dict())
    _assert_same_state(before, _state(b))


def test_evaluation_forward_changes_nothing():
    m = CachedLowPrecisionEmbedding(2000, 4, precision="int8", cache_ratio=0.1, associativity=2)
    _train(m, torch.Generator().manual_seed(0), 3, 2000)
    before = _state(m)
    m.eval()
    with torch.no_grad():
        m(torch.randint(0, 2000, (50,)), torch.arange(0, 50, 5))
    out = m(torch.randint(0, 2000, (50,)), torch.arange(0, 50, 5))
    assert not out.requires_grad
    m.step()
    _assert_same_state(before, _state(m))


def test_flush_puts_every_row_in_the_table():
    m = CachedLowPrecisionEmbedding(
        2000, 4, precision="fp32", cache_ratio=0.2, associativity=8, policy="lru", lr=0.1
    )
    _train(m, torch.Generator().manual_seed(0), 4, 2000)
    resident = int((m.cache_tags >= 0).sum())
    assert resident > 0
    expected = m.current_weight()
    assert m.flush() == resident
    assert bool((m.cache_tags < 0).all())
    table = m.weights.view(torch.float32).view(2000, 4)
    assert torch.equal(table, expected)


# ----------------------------------------------------------------------------- bad input


def _bad_calls():
    ok_idx, ok_off = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    return {
        "negative index": ((torch.tensor([1, -2, 3]), ok_off), "index -2"),
        "index too large": ((torch.tensor([1, 2000, 3]), ok_off), "index 2000"),
        "decreasing offsets": ((ok_idx, torch.tensor([0, 2, 1])), "offsets decrease"),
        "offsets beyond input": ((ok_idx, torch.tensor([0, 4])), "offsets decrease"),
        "offsets not at zero": ((ok_idx, torch.tensor([1, 2])), "start at 0"),
        "one offset not at zero": ((ok_idx, torch.tensor([3])), "start at 0"),
        "last: offsets beyond input": ((ok_idx, torch.tensor([0, 4, 3])), "exceed len.input.=3"),
        "last: last offset beyond input": (
            (ok_idx, torch.tensor([0, 4])),
            r"in \[0, len.input.=3\]",
        ),
        "last: one offset": ((ok_idx, torch.tensor([3])), "start at 0"),
        "float indices": ((torch.tensor([1.0, 2.0]), ok_off), "int64 or int32"),
        "missing offsets": ((ok_idx, None), "offsets are required"),
        "wrong weights": ((ok_idx, ok_off, torch.ones(2)), "per_sample_weights"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_is_refused_and_changes_nothing(case):
    args, message = _bad_calls()[case]
    m = CachedLowPrecisionEmbedding(2000, 4, precision="int8", cache_ratio=0.1, name="users")
    _train(m, torch.Generator().manual_seed(0), 2, 2000)
    m.include_last_offset = case.startswith("last:")  # offsets then end with len(input)
    before, stats = _state(m), m.stats()
    with pytest.raises(ValueError, match=message) as err:
        m(*args)
    assert "users" in str(err.value)
    _assert_same_state(before, _state(m))
    assert m.stats() == stats  # not even the lookups were counted


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_non_finite_gradient_step_is_refused_and_changes_nothing(poison):
    m = CachedLowPrecisionEmbedding(2000, 4, precision="int8", cache_ratio=0.1, name="ads")
    gen = torch.Generator().manual_seed(0)
    _train(m, gen, 2, 2000)
    out = m(torch.tensor([3, 4, 5]), torch.tensor([0, 2]))
    grad = torch.ones_like(out)
    grad[1, 2] = poison
    out.backward(grad)
    before = _state(m)
    assert m.has_nonfinite_grad()
    with pytest.raises(EmbeddingUpdateError, match="ads.*row 5"):
        m.step()
    _assert_same_state(before, _state(m))
    m.zero_grad()
    m.step()
    _assert_same_state(before, _state(m))


def test_unstorable_update_is_refused_and_changes_nothing():
    m = CachedLowPrecisionEmbedding(2000, 4, precision="fp16", cache_ratio=0.1, lr=1.0, name="t")
    out = m(torch.tensor([7, 8]), torch.tensor([0, 1]))
    out.backward(torch.tensor([[1.0, 0, 0, 0], [1e6, 0, 0, 0]]))
    before = _state(m)
    with pytest.raises(EmbeddingUpdateError, match="fp16 cannot store.*row 8"):
        m.step()
    _assert_same_state(before, _state(m))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(cache_ratio=1.0), "cache_ratio=1.0"),
        (dict(cache_ratio=-0.1), "cache_ratio=-0.1"),
        (dict(associativity=3), "associativity=3"),
        (dict(associativity=64), "associativity=64"),
        (dict(precision="int3"), "precision='int3'"),
        (dict(rounding="up"), "rounding='up'"),
        (dict(policy="fifo"), "policy='fifo'"),
        (dict(optimizer="adam"), "optimizer='adam'"),
    ],
)
def test_invalid_configuration_names_table_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        CachedLowPrecisionEmbedding(2000, 4, name="items", **kwargs)
    assert "items" in str(err.value)


def test_small_tables_stay_fp32_without_cache():
    m = CachedLowPrecisionEmbedding(999, 8, precision="int2", cache_ratio=0.5)
    assert m.config.stored_precision == "fp32" and m.config.num_slots == 0
    assert m.weights.shape == (999, 32)


def test_deepcopy_and_independent_tables():
    m = CachedLowPrecisionEmbedding(2000, 4, precision="int8")
    c = copy.deepcopy(m)
    _train(m, torch.Generator().manual_seed(0), 1, 2000)
    assert not torch.equal(m.weights, c.weights)


def test_python_mirrors_the_kernels_table_spec():
    """embcache.config mirrors csrc/include/embcache/table_spec.h, the one definition the C++
    ops and CUDA kernels compile: formats and their bits, optimizers, the associativity limit,
    counters, state tensors (the table's buffers, in order) with their tiers (storage or
    cache: the seam of host placement) and the fields of a spec."""
    from embcache import config

    formats, bits, optimizers, poolings, counters, state, tiers, fields, max_ways = (
        torch.ops.embcache.layout()
    )
    assert list(zip(formats, bits)) == list(config.PRECISION_BITS.items())
    assert tuple(optimizers) == config.OPTIMIZERS
    assert tuple(poolings) == config.MODES
    assert max_ways == config.MAX_ASSOCIATIVITY
    assert tuple(counters) == config.COUNTERS
    assert tuple(state) == config.STATE_TENSORS
    assert tuple(tiers) == config.STATE_TIERS
    assert tuple(n for n, t in zip(state, tiers) if t == "storage") == (
        "weights",
        "optimizer_state",
    )
    assert tuple(fields) == config.SPEC_FIELDS
    m = CachedLowPrecisionEmbedding(3000, 4, cache_ratio=0.1, policy="lfu")
    assert [name for name, _ in m.named_buffers()] == list(config.STATE_TENSORS)
    assert m.spec.tolist()[config.SPEC_FIELDS.index("num_sets")] == m.config.num_sets


@pytest.mark.parametrize(
    "field,value",
    [("ways", 3), ("bits", 5), ("optimizer", 3), ("num_sets", 10**6), ("dim", 0), ("pooling", 3)],
)
def test_the_ops_refuse_a_bad_spec(field, value):
    """A caller that bypasses Python (and TableConfig's checks) gets its spec checked in C++,
    before anything is read or written."""
    from embcache.config import SPEC_FIELDS

    m = CachedLowPrecisionEmbedding(3000, 4, cache_ratio=0.1)
    spec = m.spec.clone()
    spec[SPEC_FIELDS.index(field)] = value
    before = _state(m)
    with pytest.raises(RuntimeError, match=f"table 0: spec field {field} is out of range"):
        torch.ops.embcache.cache_flush(list(m.state_tensors()), spec[None], [m.counters.clone()])
    _assert_same_state(before, _state(m))


# --------------------------------------------------------------------------- nn.EmbeddingBag's doors


def test_from_pretrained_is_embedding_bags_and_trains_like_it():
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(300, 6, generator=gen)
    ref = nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode="sum", sparse=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    ours = CachedLowPrecisionEmbedding.from_pretrained(
        weight, mode="sum", precision="fp32", cache_ratio=0, lr=0.2, min_rows_for_low_precision=0
    )
    assert torch.equal(ours.weight, weight)
    for _ in range(4):
        indices, offsets = _skewed_batch(gen, 300, 16, 3)
        grad = torch.randn(16, 6, generator=gen)
        _step_beside(ours, ref, opt, indices, offsets, grad)
    torch.testing.assert_close(ours.weight, ref.weight.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4", "int2"])
def test_from_pretrained_rounds_by_the_tables_rule(precision):
    weight = torch.randn(2000, 8, generator=torch.Generator().manual_seed(3))
    table = CachedLowPrecisionEmbedding.from_pretrained(
        weight, precision=precision, rounding="nearest", qparams="fp16"
    )
    stored = reference.quantize_rows(weight, range(2000), precision, "fp16")
    assert torch.equal(table.weights, stored)
    assert torch.equal(table.weight, reference.dequantize_rows(stored, precision, 8, "fp16"))


def test_weight_is_every_rows_current_value_cache_included():
    """After training with a cache, ``weight`` holds what a forward reads for each row: the
    kernels' lookup of single-row bags is the oracle."""
    gen = torch.Generator().manual_seed(5)
    table = CachedLowPrecisionEmbedding(3000, 8, precision="int8", cache_ratio=0.05, lr=0.3)
    for _ in range(4):
        indices, offsets = _skewed_batch(gen, 3000, 64, 3)
        table(indices, offsets).pow(2).sum().backward()
        table.step()
    assert (table.cache_tags >= 0).any()
    table.eval()
    with torch.no_grad():
        each_row = table(torch.arange(3000).view(-1, 1))
    assert torch.equal(table.weight, each_row)


@pytest.mark.parametrize("option", ["precisoin", "_freeze"])  # _freeze: nn.Embedding's
def test_an_unknown_option_is_a_value_error_naming_it(option):
    with pytest.raises(ValueError, match=f"table 'mine': unknown option '{option}'"):
        CachedLowPrecisionEmbedding(100, 4, name="mine", **{option: 1})


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_padding_idx_is_embedding_bags(mode):
    """Entries equal to padding_idx are left out of their bag (mean does not count them) and
    its row is never updated: nn.EmbeddingBag(padding_idx=...) + SGD over several steps."""
    gen = torch.Generator().manual_seed(11)
    weight, pad = torch.randn(200, 5, generator=gen), 7
    ref = nn.EmbeddingBag.from_pretrained(
        weight.clone(), freeze=False, mode=mode, sparse=True, padding_idx=pad
    )
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    ours = CachedLowPrecisionEmbedding.from_pretrained(
        weight, precision="fp32", mode=mode, lr=0.2, padding_idx=pad - 200
    )
    for _ in range(4):
        indices, offsets = _skewed_batch(gen, 200, 24, 4)
        indices[torch.rand(indices.shape, generator=gen) < 0.3] = pad
        indices[offsets[1]] = pad  # a bag of padding only (if one entry long)
        grad = torch.randn(24, 5, generator=gen)
        _step_beside(ours, ref, opt, indices, offsets, grad)
    torch.testing.assert_close(ours.weight, ref.weight.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(ours.weight[pad], weight[pad])  # never updated


def test_three_backwards_before_a_step_sum_in_the_order_they_came():
    """A table's gradient in three parts (three backwards, one step): each row's gradient is
    ((0 + g0) + g1) + g2 in float32, the order fixed on every device (no atomics); the oracle
    adds each backward's own deduplicated gradient row by row."""
    gen = torch.Generator().manual_seed(9)
    table = CachedLowPrecisionEmbedding(
        500, 4, precision="fp32", cache_ratio=0, lr=1.0, min_rows_for_low_precision=0
    )
    before = table.weight
    expected = torch.zeros(500, 4)
    for _ in range(3):
        indices, offsets = _skewed_batch(gen, 500, 40, 5)
        grad = torch.randn(40, 4, generator=gen) * 10 ** torch.randint(
            -3, 4, (40, 1), generator=gen
        )
        one = CachedLowPrecisionEmbedding(
            500, 4, precision="fp32", cache_ratio=0, weight=before, min_rows_for_low_precision=0
        )
        one(indices, offsets).backward(grad)
        (part,) = one.group.pending(one)
        for row, g in zip(part.rows.tolist(), part.grads):
            expected[row] = expected[row] + g  # float32, part after part
        table(indices, offsets).backward(grad)
    assert len(table.group.pending(table)) == 3
    table.step()  # SGD with lr 1: w - g, exactly where g's rows are
    assert torch.equal(table.weight, before - expected)


def test_a_dropped_table_is_freed_at_once_and_a_copy_is_its_own():
    """No reference cycle keeps a dropped table (and its gigabytes) alive until Python's cycle
    collector runs: with the collector off, ``del`` frees it, trained or not; a deep copy's
    group drives the copy, and a pickled table comes back driving itself."""
    import gc
    import weakref

    gen = torch.Generator().manual_seed(0)
    m = CachedLowPrecisionEmbedding(500, 4, precision="int8", cache_ratio=0.1)
    m(torch.randint(0, 500, (8, 3), generator=gen)).sum().backward()
    m.step()
    c = copy.deepcopy(m)
    assert c.group.tables == [c] and m.group.tables == [m]
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.group.tables == [loaded]
    gc.disable()
    try:
        refs = [weakref.ref(x) for x in (m, c, loaded)]
        del m, c, loaded
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()
