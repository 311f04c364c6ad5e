"""The C++ kernels (through CachedLowPrecisionEmbedding) against the pure-PyTorch reference.

Over random training steps (skewed indices with duplicates, multi-hot and empty bags,
optional per-sample weights) the module and :class:`embcache.reference.ReferenceTable` must
agree BIT FOR BIT after every step: pooled outputs, deduplicated gradients, table bytes, cache
tags / rows / priorities, LFU counts, optimizer state, step count and statistics; and after a
final flush. The cache invariants of docs/contract.md §4 are checked on the module's state as well.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from embcache import CachedLowPrecisionEmbedding, EmbeddingUpdateError
from embcache import reference as ref
from embcache.config import COUNTERS, DEVICE_COUNTS

PRECISIONS = ("fp32", "fp16", "int8", "int4", "int2")
ASSOCIATIVITIES = (1, 2, 4, 8, 16, 32)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that equality also distinguishes -0.0 from 0.0 (and compares NaNs)."""
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    return t


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype} {tuple(got.shape)} vs reference {want.dtype} {tuple(want.shape)}"
    )
    if not torch.equal(bits_of(got), bits_of(want)):
        diff = bits_of(got) != bits_of(want)
        where = torch.nonzero(diff)[:5].tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} elements differ, first at {where}")


STATE = ("weights", "cache_tags", "cache_rows", "cache_priority", "counts", "optimizer_state")


def assert_same_state(module, table: ref.ReferenceTable, when: str) -> None:
    for name in STATE:
        assert_bits_equal(getattr(module, name), getattr(table, name), f"{when}: {name}")
    assert int(module.step_count) == table.step_count, f"{when}: step_count"
    want = table.stats()  # its counters (the precision telemetry's probes included)
    got = module.stats()
    assert {k: got[k] for k in want} == want, f"{when}: stats"


def check_cache_invariants(module, when: str) -> None:
    cfg = module.config
    tags = module.cache_tags.tolist()
    resident = [t for t in tags if t >= 0]
    assert len(resident) == len(set(resident)), f"{when}: a row is resident twice"
    for slot, tag in enumerate(tags):
        if tag >= 0:
            assert 0 <= tag < cfg.num_embeddings
            assert ref.set_of_row(tag, cfg.num_sets) == slot // cfg.ways, (
                f"{when}: row {tag} sits in set {slot // cfg.ways}, "
                f"belongs to set {ref.set_of_row(tag, cfg.num_sets)}"
            )
    if cfg.num_slots:
        prio = module.cache_priority.tolist()
        counts = module.counts.tolist()
        for slot, tag in enumerate(tags):
            if tag < 0:
                assert prio[slot] == 0, f"{when}: empty slot {slot} has a priority"
            elif cfg.policy == "lru":
                assert 1 <= prio[slot] <= int(module.step_count), (
                    f"{when}: timestamp of slot {slot}"
                )
            else:
                assert prio[slot] == counts[tag], (
                    f"{when}: slot {slot} priority is not row {tag}'s count"
                )
        # Each set's floor is a lower bound of its slots' priorities (an empty way: INT32_MIN).
        lowest = torch.where(
            module.cache_tags < 0, torch.iinfo(torch.int32).min, module.cache_priority
        )
        lowest = lowest.view(cfg.num_sets, cfg.ways).amin(dim=1)
        above = torch.nonzero(module.cache_set_floor > lowest).flatten().tolist()
        assert not above, f"{when}: sets {above[:5]} have a floor above their lowest priority"


def make_batch(
    gen: torch.Generator,
    rows: int,
    perm: torch.Tensor,
    bags: int = 32,
    max_len: int = 8,
    with_psw: bool = False,
):
    """Skewed multi-hot bags (duplicates, empty bags), nn.EmbeddingBag offsets; max_len=None:
    one id per bag (Criteo's features, which the kernels pool in a loop of their own)."""
    if max_len is None:
        lengths = torch.ones(bags, dtype=torch.int64)
    else:
        lengths = torch.randint(0, max_len + 1, (bags,), generator=gen)
        lengths[torch.randint(0, bags, (2,), generator=gen)] = 0  # a few empty bags for sure
    n = int(lengths.sum())
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    indices = perm[(u**3 * rows).long().clamp(max=rows - 1)]  # hot rows spread over the sets
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    psw = (torch.randn(n, generator=gen) * 0.75 + 0.5) if with_psw else None
    return indices, offsets, psw


def cache_ratio_for(rows: int, ways: int, sets: int) -> float:
    return (sets * ways + 0.5) / rows


def run_training(
    steps: int = 8,
    rows: int = 300,
    dim: int = 5,
    sets: int = 3,
    lr: float = 0.05,
    psw: bool = False,
    seed: int = 0,
    flush_at_end: bool = True,
    bags: int = 32,
    max_len: int = 8,
    ties: bool = False,
    **options,
) -> tuple:
    """``ties``: rows of a few values (halves in [-1, 1], zeros of either sign), so that bags
    pooled by max hold equal maxima in different rows."""
    ways = options.setdefault("associativity", 4)
    if "cache_ratio" not in options:
        options["cache_ratio"] = cache_ratio_for(rows, ways, sets)
    options.setdefault("min_rows_for_low_precision", 0)
    options.setdefault("mode", "sum")  # the cases name mean and max where they test them
    options.setdefault("seed", (seed * 2654435761 + 12345) % 2**62 + 2**33)  # both key words
    options.setdefault("table_id", seed % 5 + 1)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, dim, generator=gen) * 0.5
    if ties:
        sign = torch.randint(0, 2, (rows, dim), generator=gen) * 2.0 - 1.0
        weight = torch.randint(-2, 3, (rows, dim), generator=gen) * 0.5 * sign
    module = CachedLowPrecisionEmbedding(rows, dim, weight=weight, lr=lr, **options)
    table = ref.ReferenceTable(module.config, module.weights.clone())
    # the initial rows are rounded to nearest, as the reference would
    assert_bits_equal(
        module.weights,
        ref.quantize_rows(weight, range(rows), table.precision, table.qparams),
        "initial weights",
    )
    assert_same_state(module, table, "initial")
    perm = torch.randperm(rows, generator=gen)
    grad_scale = 1.0 / math.sqrt(8)
    for s in range(steps):
        when = f"step {s + 1}"
        indices, offsets, w = make_batch(gen, rows, perm, bags, max_len, with_psw=psw)
        out = module(indices, offsets, w)
        want, _ = table.forward(indices, offsets, w)
        assert_bits_equal(out.detach(), want, f"{when}: forward output")
        grad_out = torch.randn(out.shape, generator=gen) * grad_scale
        out.backward(grad_out)
        table.backward(grad_out)
        (pending,) = module.group.pending(module)
        for got, exp, name in zip(pending, table.pending, ("rows", "grads", "occurrences")):
            assert_bits_equal(got, exp, f"{when}: deduplicated {name}")
        module.step()
        table.step()
        assert_same_state(module, table, when)
        check_cache_invariants(module, when)
        if s % 2 == 1:  # an evaluation forward changes no state at all
            indices, offsets, w = make_batch(gen, rows, perm, bags, max_len, with_psw=psw)
            module.eval()
            with torch.no_grad():
                out = module(indices, offsets, w)
            module.train()
            want, _ = table.forward(indices, offsets, w, training=False)
            assert_bits_equal(out, want, f"{when}: evaluation forward")
            assert_same_state(module, table, f"{when}: after an evaluation forward")
    if flush_at_end:
        before = module.current_weight()
        assert_bits_equal(before, table.current_weight(), "current_weight before flush")
        resident = module.cache_tags[module.cache_tags >= 0].long()
        assert module.flush() == table.flush() == resident.numel()
        assert_same_state(module, table, "after flush")
        assert bool((module.cache_tags == -1).all())
        after = ref.dequantize_rows(module.weights, table.precision, dim, table.qparams)
        assert_bits_equal(module.current_weight(), after, "current_weight after flush")
        check_flush_rounding(before, after, resident, table)
        # training goes on after a flush: the emptied cache fills again
        for s in range(2):
            indices, offsets, w = make_batch(gen, rows, perm, bags, max_len, with_psw=psw)
            out = module(indices, offsets, w)
            assert_bits_equal(
                out.detach(), table.forward(indices, offsets, w)[0], "forward after flush"
            )
            grad_out = torch.randn(out.shape, generator=gen) * grad_scale
            out.backward(grad_out)
            table.backward(grad_out)
            module.step()
            table.step()
            assert_same_state(module, table, f"step {s + 1} after flush")
            check_cache_invariants(module, f"step {s + 1} after flush")
    return module, table


def check_flush_rounding(before, after, resident, table) -> None:
    """After flush the table alone holds every row: rows that were not cached are unchanged,
    cached rows changed only by their rounding into the table's format (FP32: exactly)."""
    dim = before.shape[1]
    cached = torch.zeros(before.shape[0], dtype=torch.bool)
    cached[resident] = True
    assert_bits_equal(after[~cached], before[~cached], "rows not cached are unchanged by flush")
    if table.precision == "fp32":
        assert_bits_equal(after, before, "fp32 flush is exact")
        return
    x, y = before[cached], after[cached]
    if table.precision == "fp16":
        tol = x.abs() * 2.0**-10 + 2.0**-24  # one binary16 ulp (subnormals included)
    else:
        bits = ref.PRECISION_BITS[table.precision]
        rng = x.amax(1, keepdim=True) - x.amin(1, keepdim=True)
        step = rng / (2**bits - 1)
        if table.qparams == "fp16":
            step = step * (1 + 2.0**-10) + x.abs().amax(1, keepdim=True) * 2.0**-10
        tol = step * (1.0 if table.rounding == "stochastic" else 0.5) + 1e-6 * (1 + x.abs())
    assert bool(((y - x).abs() <= tol).all()), "a flushed row moved by more than its rounding"
    assert dim == x.shape[1]


# ----------------------------------------------------------------------------- the matrix

MATRIX = [
    (precision, rounding, policy, ways)
    for precision in PRECISIONS
    for rounding in ("nearest", "stochastic")
    for policy in ("lru", "lfu")
    for ways in ASSOCIATIVITIES
]


@pytest.mark.parametrize("precision,rounding,policy,ways", MATRIX)
def test_training_matches_reference(precision, rounding, policy, ways):
    i = MATRIX.index((precision, rounding, policy, ways))
    dims = (3, 5, 8, 7, 4, 6)
    run_training(
        steps=10,
        rows=200 + 37 * (i % 9),
        dim=dims[i % len(dims)],
        seed=1000 + i,
        sets=max(2, 24 // ways),
        psw=(i % 3 == 0),
        precision=precision,
        rounding=rounding,
        policy=policy,
        associativity=ways,
    )


EXTRA = [
    # optimizers, on formats with and without qparams
    dict(
        precision="int8",
        rounding="stochastic",
        policy="lfu",
        associativity=4,
        optimizer="rowwise_adagrad",
    ),
    dict(
        precision="int4",
        rounding="nearest",
        policy="lru",
        associativity=8,
        optimizer="rowwise_adagrad",
    ),
    dict(
        precision="fp16",
        rounding="stochastic",
        policy="lru",
        associativity=2,
        optimizer="rowwise_adagrad",
    ),
    dict(
        precision="fp32",
        rounding="nearest",
        policy="lfu",
        associativity=1,
        optimizer="rowwise_adagrad",
    ),
    dict(precision="int8", rounding="nearest", policy="lru", associativity=16, optimizer="adagrad"),
    dict(
        precision="int2", rounding="stochastic", policy="lfu", associativity=32, optimizer="adagrad"
    ),
    dict(precision="fp16", rounding="nearest", policy="lfu", associativity=4, optimizer="adagrad"),
    dict(
        precision="fp32", rounding="stochastic", policy="lru", associativity=8, optimizer="adagrad"
    ),
    # qparams fp16
    dict(precision="int8", rounding="nearest", policy="lfu", associativity=2, qparams="fp16"),
    dict(precision="int8", rounding="stochastic", policy="lru", associativity=8, qparams="fp16"),
    dict(precision="int4", rounding="stochastic", policy="lfu", associativity=4, qparams="fp16"),
    dict(precision="int4", rounding="nearest", policy="lru", associativity=32, qparams="fp16"),
    dict(precision="int2", rounding="stochastic", policy="lru", associativity=1, qparams="fp16"),
    dict(
        precision="int2",
        rounding="nearest",
        policy="lfu",
        associativity=16,
        qparams="fp16",
        optimizer="rowwise_adagrad",
    ),
    # mode mean
    dict(precision="int8", rounding="stochastic", policy="lfu", associativity=8, mode="mean"),
    dict(precision="fp16", rounding="stochastic", policy="lru", associativity=4, mode="mean"),
    dict(
        precision="int4",
        rounding="nearest",
        policy="lfu",
        associativity=1,
        mode="mean",
        optimizer="adagrad",
    ),
    dict(
        precision="int2",
        rounding="stochastic",
        policy="lru",
        associativity=32,
        mode="mean",
        qparams="fp16",
    ),
    # mode max
    dict(precision="int8", rounding="stochastic", policy="lfu", associativity=4, mode="max"),
    dict(precision="fp16", rounding="nearest", policy="lru", associativity=2, mode="max"),
    dict(
        precision="int4",
        rounding="stochastic",
        policy="lru",
        associativity=8,
        mode="max",
        optimizer="rowwise_adagrad",
        qparams="fp16",
    ),
    dict(
        precision="int2",
        rounding="nearest",
        policy="lfu",
        associativity=16,
        mode="max",
        optimizer="adagrad",
    ),
    dict(precision="fp32", rounding="nearest", policy="lfu", associativity=4, mode="max"),
    # no cache at all (every row bypasses), and a table small enough to stay FP32 uncached
    dict(precision="int8", rounding="stochastic", policy="lfu", associativity=4, cache_ratio=0.0),
    dict(precision="fp16", rounding="nearest", policy="lru", associativity=32, cache_ratio=0.0),
    dict(
        precision="int4",
        rounding="stochastic",
        policy="lfu",
        associativity=8,
        min_rows_for_low_precision=1000,
    ),
]


@pytest.mark.parametrize("options", EXTRA, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_training_matches_reference_options(options):
    i = EXTRA.index(options)
    options = dict(options)
    mode = options.get("mode", "sum")
    ways = options["associativity"]
    run_training(
        steps=10,
        rows=211 + 29 * i,
        dim=(3, 8, 5, 6)[i % 4],
        seed=5000 + i,
        sets=max(2, 24 // ways),
        psw=mode == "sum" and i % 2 == 0,
        ties=mode == "max" and i % 2 == 0,
        **options,
    )


DIM_16 = [
    dict(precision="int8", rounding="stochastic", policy="lfu", associativity=8),
    dict(precision="fp32", rounding="nearest", policy="lru", associativity=4, cache_ratio=0.0),
    dict(precision="fp16", rounding="stochastic", policy="lfu", associativity=2, mode="mean"),
    dict(precision="int4", rounding="nearest", policy="lru", associativity=16, qparams="fp16"),
    dict(precision="int8", rounding="stochastic", policy="lru", associativity=4, mode="max"),
]


@pytest.mark.parametrize("max_len", [None, 3], ids=("one-id-per-bag", "multi-hot"))
@pytest.mark.parametrize(
    "options", DIM_16, ids=("int8", "fp32-uncached", "fp16-mean", "int4", "int8-max")
)
def test_dim_16_and_one_id_per_bag(options, max_len):
    """The row length and bag shape that the forward kernel has loops of its own for."""
    seed = 7000 + 10 * DIM_16.index(options) + (max_len or 0)
    run_training(
        steps=6,
        rows=400,
        dim=16,
        seed=seed,
        sets=max(2, 24 // options["associativity"]),
        max_len=max_len,
        psw=options.get("mode", "sum") == "sum",
        **options,
    )


@pytest.mark.parametrize(
    "options",
    [
        dict(
            precision="int8",
            rounding="stochastic",
            policy="lfu",
            associativity=4,
            optimizer="rowwise_adagrad",
        ),
        dict(precision="fp16", rounding="stochastic", policy="lru", associativity=2, mode="mean"),
    ],
    ids=("int8-lfu", "fp16-lru-mean"),
)
def test_large_batches_parallel_paths(options):
    """Batches big enough that the kernels split bags, unique rows and sets over threads
    (more than 4096 bags, 2048 unique rows, 1024 sets touched per step)."""
    module, _ = run_training(
        steps=3,
        rows=30000,
        dim=4,
        sets=2500,
        bags=6000,
        max_len=4,
        seed=21,
        psw=options.get("mode") != "mean",
        **options,
    )
    s = module.stats()
    assert s["unique_rows"] / s["steps"] > 2048 and s["evictions"] > 0 and s["bypasses"] > 0


@pytest.mark.parametrize(
    "max_len,psw,mode",
    [
        (None, False, "sum"),
        (None, True, "sum"),
        (3, True, "sum"),
        (3, False, "mean"),
        (3, False, "max"),
    ],
    ids=("one-id", "one-id-weighted", "multi-hot-weighted", "multi-hot-mean", "multi-hot-max"),
)
def test_an_output_past_the_caches_is_the_same(max_len, psw, mode):
    """A forward output over 4 MiB is written with streaming stores (kStreamOutputBytes in
    csrc/cpu/cpu_common.h): one-id bags term by term, longer bags (and empty ones) once
    summed; 20,000 bags x 64 floats, cached rows and missed ones."""
    module, _ = run_training(
        steps=2,
        rows=5000,
        dim=64,
        sets=40,
        bags=20000,
        max_len=max_len,
        seed=33 + psw + 2 * (max_len or 0),
        psw=psw,
        mode=mode,
        precision="int8",
        rounding="stochastic",
        policy="lfu",
        associativity=8,
    )
    assert 20000 * 64 * 4 > 4 << 20
    s = module.stats()
    assert 0 < s["hits"] < s["lookups"]


def test_stats_and_state_actually_exercised():
    """The training configuration above does make sets overflow: hits, insertions,
    evictions and bypasses all happen, for LRU and LFU (else the comparison proves little)."""
    for policy in ("lru", "lfu"):
        for ways in (1, 8, 32):
            module, table = run_training(
                steps=6,
                rows=256,
                dim=4,
                seed=7,
                sets=max(2, 24 // ways),
                precision="int8",
                rounding="stochastic",
                policy=policy,
                associativity=ways,
                flush_at_end=False,
            )
            s = module.stats()
            for key in ("unique_hits", "insertions", "evictions", "bypasses"):
                assert s[key] > 0, (policy, ways, key, s)
            assert s["hits"] > 0


def test_lfu_counts_saturate():
    module = CachedLowPrecisionEmbedding(
        64,
        4,
        precision="int8",
        cache_ratio=0.5,
        associativity=4,
        policy="lfu",
        lfu_count_bits=32,
        min_rows_for_low_precision=0,
    )
    table = ref.ReferenceTable(module.config, module.weights.clone())
    module.counts[5] = 2**31 - 3
    table.counts[5] = 2**31 - 3
    indices = torch.tensor([5, 5, 5, 5, 5, 9])
    offsets = torch.tensor([0, 3])
    out = module(indices, offsets)
    table.forward(indices, offsets)
    g = torch.ones_like(out)
    out.backward(g)
    table.backward(g)
    module.step()
    table.step()
    assert int(module.counts[5]) == 2**31 - 1
    assert_same_state(module, table, "saturated counts")


@pytest.mark.parametrize("precision,bad", [("fp16", 1e7), ("int8", math.inf), ("fp32", math.nan)])
def test_refused_update_changes_nothing(precision, bad):
    """An update whose result cannot be stored (beyond fp16, or a non-finite gradient) is
    refused by both, with every piece of state unchanged."""
    module, table = run_training(
        steps=3,
        rows=200,
        dim=4,
        seed=11,
        precision=precision,
        rounding="stochastic",
        policy="lfu",
        associativity=4,
        optimizer="rowwise_adagrad" if precision == "int8" else "sgd",
        flush_at_end=False,
    )
    snapshot = {name: getattr(module, name).clone() for name in STATE}
    indices, offsets = torch.tensor([1, 2, 3, 2]), torch.tensor([0, 2])
    out = module(indices, offsets)
    table.forward(indices, offsets)
    grad = torch.ones_like(out)
    grad[1, 0] = bad
    out.backward(grad)
    table.backward(grad)
    what = "new value that fp16 cannot store" if precision == "fp16" else "non-finite gradient"
    with pytest.raises(EmbeddingUpdateError, match=f"table 'table': {what} .*row 2; nothing"):
        module.step()  # row 2: the smallest refused row (bag 1 reads rows 3 and 2)
    with pytest.raises(ref.NotStorableError, match=f"cannot be stored as {precision}"):
        table.step()
    for name in STATE:
        assert_bits_equal(getattr(module, name), snapshot[name], f"refused step: {name}")
    table.pending = None
    assert int(module.step_count) == table.step_count == 3
    for name in STATE:
        assert_bits_equal(getattr(module, name), getattr(table, name), f"refused step: {name}")


def test_step_with_only_empty_bags():
    """A batch of empty bags: zero outputs, no updated row, but the update still counts."""
    module, table = run_training(
        steps=2,
        rows=200,
        dim=3,
        seed=13,
        precision="int4",
        rounding="stochastic",
        policy="lru",
        associativity=2,
        flush_at_end=False,
    )
    indices, offsets = torch.zeros(0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    out = module(indices, offsets)
    want, _ = table.forward(indices, offsets)
    assert_bits_equal(out.detach(), want, "empty bags")
    assert not bool(want.any())
    out.backward(torch.ones_like(out))
    table.backward(torch.ones_like(out))
    module.step()
    table.step()
    assert_same_state(module, table, "after a step of empty bags")


def test_hand_made_lru_set_overflow():
    """A direct small example of §4 step 3 with LRU, checked against numbers worked out by
    hand (not only against the reference): one set of 2 ways, 3 new rows in one step."""
    module = CachedLowPrecisionEmbedding(
        64,
        2,
        precision="fp32",
        cache_ratio=2 / 64,
        associativity=2,
        policy="lru",
        min_rows_for_low_precision=0,
    )
    assert module.config.num_sets == 1
    out = module(torch.tensor([10, 3, 7, 3]), torch.tensor([0]))
    out.backward(torch.ones_like(out))
    module.step()
    # all priorities equal (t = 1): smaller row ids first, so 3 and 7 enter, 10 bypasses
    assert sorted(module.cache_tags.tolist()) == [3, 7]
    s = module.stats()
    assert (s["insertions"], s["bypasses"], s["evictions"], s["unique_misses"]) == (2, 1, 0, 3)
    assert module.cache_priority.tolist() == [1, 1]
    out = module(torch.tensor([20]), torch.tensor([0]))
    out.backward(torch.ones_like(out))
    module.step()
    # t = 2 > 1: row 20 evicts the resident of the lower way (ties: lower way first)
    assert module.cache_tags.tolist()[0] == 20 and module.cache_priority.tolist() == [2, 1]
    assert module.stats()["evictions"] == 1


def test_reference_can_fail(monkeypatch):
    """The comparison is sharp: a reference with one float32 operation rounded differently
    (SGD as a fused multiply-add, computed in float64) is caught."""

    def fused_sgd(self, v, g, state):
        return (v.double() - self.config.lr * g.double()).float(), state

    monkeypatch.setattr(ref.ReferenceTable, "_optimize", fused_sgd)
    with pytest.raises(AssertionError):
        run_training(
            steps=4,
            rows=200,
            dim=5,
            seed=3,
            precision="fp32",
            rounding="nearest",
            policy="lru",
            associativity=4,
            lr=0.0123,
        )


def test_device_counts_wait_on_the_table_until_read():
    """The forward leaves its lookups and hits, the update its commits' hits, insertions and
    evictions in the table's device counts (on a GPU, so that nothing is read back);
    ``stats()`` and the checkpoint fold them in. Folded once after many steps, the statistics are those of the
    reference, folded after every step (the fold is a sum), and they survive a checkpoint."""
    options = dict(precision="int8", cache_ratio=0.1, associativity=4, policy="lfu", seed=5)
    options["min_rows_for_low_precision"] = 0
    module = CachedLowPrecisionEmbedding(400, 4, **options)
    table = ref.ReferenceTable(module.config, module.weights.clone())
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    for _ in range(8):
        ids = (torch.rand(300, generator=gen) ** 3 * 400).long()
        offsets = torch.arange(0, 300, 3)
        grad = torch.randn(100, 4, generator=gen)
        module(ids, offsets).backward(grad)
        module.step()
        table.forward(ids, offsets, None)
        table.backward(grad)
        table.step()
    counters = dict(zip(COUNTERS, module.counters.tolist()))
    assert counters["steps"] == 8 and counters["unique_rows"] > 0
    assert counters["unique_hits"] == counters["unique_misses"] == counters["insertions"] == 0
    assert counters["lookups"] == counters["hits"] == 0
    waiting = dict(zip(DEVICE_COUNTS, module.device_counts().tolist()))
    assert waiting["lookups"] == 8 * 300 and waiting["unique_hits"] > 0  # not yet folded
    twin = copy.deepcopy(module)
    saved = module.state_dict()  # folds
    assert module.device_counts().tolist() == [0] * len(DEVICE_COUNTS)
    want = table.stats()
    for m in (twin, CachedLowPrecisionEmbedding.from_state(saved)):
        got = m.stats()
        assert {k: got[k] for k in want} == want
        assert got["bypasses"] > 0 and got["evictions"] > 0


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("rows,cache_ratio", [(300, 0.0), (20, 0.5)])
def test_narrow_lfu_counts_on_a_table_without_counts(rows, cache_ratio, bits):
    """A table that keeps no counts (no cache, or too small for low precision) with narrow
    LFU counts trains as the reference: the option only narrows counts there are."""
    module = CachedLowPrecisionEmbedding(
        rows, 4, precision="int8", cache_ratio=cache_ratio, lfu_count_bits=bits, associativity=2
    )
    assert not module.config.keeps_counts and module.counts.numel() == 0
    table = ref.ReferenceTable(module.config, module.weights.clone())
    ids, offsets, grad = torch.tensor([1, 5, 5, 9]), torch.tensor([0, 2]), torch.randn(2, 4)
    module(ids, offsets).backward(grad)
    module.step()
    table.forward(ids, offsets, None)
    table.backward(grad)
    table.step()
    assert_same_state(module, table, "one step")


@pytest.mark.parametrize("bits", [16, 8])
def test_narrow_lfu_counts_saturate_as_the_reference(bits):
    """16-bit (8-bit) LFU counts saturate at 2^15 - 1 (2^7 - 1) and then tie (a tie keeps the
    resident): started near the top, the module follows the reference bit for bit as rows
    saturate."""
    rows, dim, top = 300, 4, 2 ** (bits - 1) - 1
    module = CachedLowPrecisionEmbedding(
        rows,
        dim,
        precision="int8",
        cache_ratio=0.1,
        associativity=4,
        lfu_count_bits=bits,
        min_rows_for_low_precision=0,
        seed=3,
    )
    table = ref.ReferenceTable(module.config, module.weights.clone())
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    start = torch.randint(top - 67, top + 1, (rows,), generator=gen).to(module.counts.dtype)
    module.counts.copy_(start)
    table.counts.copy_(start)
    for step in range(5):
        ids = (torch.rand(240, generator=gen) ** 2 * rows).long()
        offsets = torch.arange(0, 240, 4)
        grad = torch.randn(60, dim, generator=gen)
        module(ids, offsets).backward(grad)
        module.step()
        table.forward(ids, offsets, None)
        table.backward(grad)
        table.step()
        assert_same_state(module, table, f"step {step + 1}")
    assert module.counts.element_size() * 8 == bits and int((module.counts == top).sum()) > 10
    s = module.stats()
    assert s["unique_hits"] > 0 and s["insertions"] > 0
