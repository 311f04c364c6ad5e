"""The CUDA cache kernels (csrc/cuda) against the CPU ops, bit for bit.

The same kernel source runs on two backends:

* ``emu``: compiled as C++ on the warp emulator (``embcache._cuda_emu``, ops
  ``torch.ops.embcache_emu.*`` over CPU tensors): every thread a host thread, warp
  collectives in lockstep. It runs everywhere, CI included (CI machines have no GPU);
* ``cuda``: the real kernels, ``torch.ops.embcache.*`` on CUDA tensors, where torch has CUDA,
  the extension was built with them and a GPU is present (skipped otherwise).

Multi-step random training of a table driven as a batch of one, as the modules drive it
(forward, deduplicated backward, the update's dry run then its commit, evaluation forwards,
flush, training after the flush) must give bit-identical pooled outputs, hit counts,
deduplicated gradients, refused rows, table bytes, cache tags and rows, priorities, LFU counts,
optimizer state and statistics to the CPU ops with the same seed, for every precision x
rounding x policy x associativity (the CPU update taking the forward's slot hints and value
bounds, as the modules give them; the kernels find the slots themselves); plus
warp-divergence cases (sets with more candidates than ways or than 32 lanes, all-duplicate
batches, empty bags) and refused inputs.

That the kernels compile with nvcc for sm_80 and sm_90 is checked by `make cuda-check` (CI).
"""

from __future__ import annotations

import pytest
import torch

import embcache  # noqa: F401  (registers torch.ops.embcache)
from embcache import CachedLowPrecisionEmbedding
from embcache.config import COUNTERS, DEVICE_COUNTS, SPEC_FIELDS, STATE_TENSORS, TableConfig
from embcache.telemetry import PROBE_COUNTERS

CPU = torch.ops.embcache
# CPU-only ops: the hit-rate replay of bench/hit_rate.py (no CUDA kernel yet), the huge-page
# advice for host memory, the constants of the table spec, the trainer's gradient range
# (torch's reductions serve other devices) and the touched-row marking (tensor ops there).
NOT_ON_CUDA = {
    "cache_replay",
    "advise_huge_pages",
    "layout",
    "abs_range",
    "unscale_abs_range",
    "mark_sampled_rows",
}
# one implementation for every device (the CPU library's)
ANY_DEVICE = {"fold_device_counts", "count_updates", "state_placement"}
STATE = STATE_TENSORS
# The set floors are lower bounds that only the CPU commit tightens (a speed hint): not compared.
COMPARED = tuple(k for k in STATE if k != "cache_set_floor")
UNIQUE_ROW_COUNTERS = slice(COUNTERS.index("unique_hits"), COUNTERS.index("bypasses") + 1)
# The precision telemetry's probes: measured by the CPU ops only (the kernels leave them 0).
MEASURED = [i for i, name in enumerate(COUNTERS) if name not in PROBE_COUNTERS]


def _emulator_available() -> bool:
    try:
        import embcache._cuda_emu  # noqa: F401
    except ImportError:
        return False
    return True


def _cuda_kernels_available() -> bool:
    if not torch.cuda.is_available():
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("embcache::multi_lookup_forward", "CUDA")


class Backend:
    def __init__(self, name: str):
        self.name = name
        if name == "emu":
            self.ops, self.device = torch.ops.embcache_emu, torch.device("cpu")
        else:
            self.ops, self.device = torch.ops.embcache, torch.device("cuda")

    def to(self, t):
        return None if t is None else t.to(self.device)


def _backend_or_skip(name: str) -> Backend:
    """The kernels ``name`` names: "emu", "cuda", or "cpu" (the CPU ops, on the emulator's
    CPU tensors); skips the test where they are not built."""
    if name == "emu" and not _emulator_available():
        pytest.skip("embcache._cuda_emu was not built (EMBCACHE_NO_EMULATOR=1)")
    if name == "cuda" and not _cuda_kernels_available():
        pytest.skip("no GPU, or torch / embcache built without CUDA")
    b = Backend("emu" if name == "cpu" else name)
    if name == "cpu":
        b.ops = CPU
    return b


@pytest.fixture(params=["emu", "cuda"])
def backend(request) -> Backend:
    return _backend_or_skip(request.param)


@pytest.fixture(params=["cpu", "emu", "cuda"])
def any_ops(request) -> Backend:
    """Every implementation of the ops, the CPU's included: for the argument checks."""
    return _backend_or_skip(request.param)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_same(got, want, what: str) -> None:
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what}[{i}]")
        return
    if not isinstance(want, torch.Tensor):
        assert got == want, f"{what}: {got} != {want}"
        return
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (
        f"{what}: {got.dtype} {tuple(got.shape)} vs CPU {want.dtype} {tuple(want.shape)}"
    )
    g, w = bits_of(got), bits_of(want)
    if not torch.equal(g, w):
        diff = g != w
        raise AssertionError(
            f"{what}: {int(diff.sum())} elements differ, first at "
            f"{torch.nonzero(diff)[:5].tolist()}"
        )


# ----------------------------------------------------------------------------- the twin driver


class Twin:
    """One table's state twice: on the CPU (driven by the CPU ops) and on the backend (driven by
    the kernels), as a batch of one table, stepped with the same batches; every output, state
    and counter compared each step."""

    def __init__(self, backend: Backend, rows: int, dim: int, seed: int, *, ties=False, **options):
        """``ties``: rows of a few values (halves in [-1, 1], zeros of either sign), so that
        bags pooled by max hold equal maxima in different rows."""
        options.setdefault("min_rows_for_low_precision", 0)
        options.setdefault("mode", "sum")
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(rows, dim, generator=gen) * 0.5
        if ties:
            sign = torch.randint(0, 2, (rows, dim), generator=gen) * 2.0 - 1.0
            weight = torch.randint(-2, 3, (rows, dim), generator=gen) * 0.5 * sign
        m = CachedLowPrecisionEmbedding(
            rows,
            dim,
            weight=weight,
            seed=seed * 7919 + 2**33,
            table_id=seed % 5 + 1,
            **options,
        )
        self.cfg, self.specs, self.b, self.dim = m.config, m.spec[None], backend, dim
        self.cpu = {k: getattr(m, k).clone() for k in STATE}
        self.dev = {k: backend.to(v.clone()) for k, v in self.cpu.items()}
        # the statistics, which the ops add to; the update's step is counters[steps] + 1
        self.cpu_counters = torch.zeros(len(COUNTERS), dtype=torch.int64)
        self.dev_counters = torch.zeros(len(COUNTERS), dtype=torch.int64)
        # the counts the forward and the update add to on the table's device
        self.cpu_commit = torch.zeros(len(DEVICE_COUNTS), dtype=torch.int64)
        self.dev_commit = backend.to(self.cpu_commit.clone())

    def fold(self) -> None:
        """Both sides' device counts into their counters."""
        CPU.fold_device_counts([self.cpu_counters], [self.cpu_commit])
        CPU.fold_device_counts([self.dev_counters], [self.dev_commit])

    @property
    def totals(self) -> torch.Tensor:
        """unique hits, unique misses, insertions, evictions, bypasses so far"""
        self.fold()
        return self.cpu_counters[UNIQUE_ROW_COUNTERS]

    @property
    def lookup_hits(self) -> int:
        return int(self.cpu_counters[COUNTERS.index("hits")])

    def _args(self, state):
        return [state[k] for k in STATE]

    def compare_state(self, when: str) -> None:
        for k in COMPARED:
            assert_same(self.dev[k], self.cpu[k], f"{when}: {k}")
        self.fold()
        assert_same(self.dev_counters[MEASURED], self.cpu_counters[MEASURED], f"{when}: counters")

    def forward(self, indices, offsets, psw, when, training=False):
        return group_forward([self], [0], indices, offsets, psw, when, training)

    def train_step(self, indices, offsets, psw, grad_out, when):
        group_train_step([self], [0], indices, offsets, psw, grad_out, when)

    def flush(self, when):
        want = CPU.cache_flush(self._args(self.cpu), self.specs, [self.cpu_counters])
        got = self.b.ops.cache_flush(self._args(self.dev), self.specs, [self.dev_counters])
        assert got == want, f"{when}: flushed {got} rows, CPU {want}"
        self.compare_state(when)


def trimmed(out, dims):
    """A backward's outputs (all six) cut to what its row ranges say is filled: a device's
    arrays are sized for every lookup a unique row (its gradients past the last block are
    zero, checked here); the CPU's are exact. Returns the first five."""
    rows, grads, occ, slots, ranges, _ = out
    r = ranges.cpu().tolist()
    nu = r[-1][1] if r else 0
    total = r[-1][2] + (r[-1][1] - r[-1][0]) * dims[-1] if r else 0
    assert not bool(grads[total:].any()), "gradients past the last block"
    return rows[:nu], grads[:total], occ[:nu], slots, ranges


def _states(twins, which):
    return [getattr(t, which)[k] for t in twins for k in STATE]


def group_forward(twins, feature_table, indices, offsets, psw, when, training=False):
    """Both forwards of features `feature_table` over the twins' tables, compared (lookups and
    hits counted apart and compared too); in training the counts join the twins'. Returns
    the CPU's slots and value bounds, and both sides' argmax (CPU, backend)."""
    b = twins[0].b
    specs = torch.cat([t.specs for t in twins])
    lengths = offsets[1:] - offsets[:-1]
    counted = []
    for ops, which, to in ((CPU, "cpu", lambda t: t), (b.ops, "dev", b.to)):
        counts = [to(torch.zeros(len(DEVICE_COUNTS), dtype=torch.int64)) for _ in twins]
        out = ops.multi_lookup_forward(
            _states(twins, which),
            specs,
            to(indices),
            to(lengths),
            to(psw),
            feature_table,
            lengths.numel() // len(feature_table),
            counts,
        )
        counted.append((out, counts))
    (want, want_counts), (got, got_counts) = counted
    compared = (0, 1, 4)  # all but the slot hints and value bounds, which only the CPU gives
    assert_same(
        [got[k] for k in compared], [want[k] for k in compared], f"{when}: multi_lookup_forward"
    )
    assert want[5].numel() == 0 and not bool(got[5].any()), f"{when}: error bits {got[5]}"
    assert_same([c.cpu() for c in got_counts], want_counts, f"{when}: lookups and hits")
    if training:
        for t, w, g in zip(twins, want_counts, got_counts):
            t.cpu_commit += w
            t.dev_commit += g
    return want[2], want[3], want[4], got[4]


def group_train_step(twins, feature_table, indices, offsets, psw, grad_out, when):
    """A training step of the twins' tables, one feature per table (feature_table: the
    tables in order): forward, backward, the update's dry run then its commit, each op on
    both sides, every output and state compared. Returns whether the update was refused."""
    b = twins[0].b
    specs = torch.cat([t.specs for t in twins])
    lookup_slots, bounds, want_argmax, got_argmax = group_forward(
        twins, feature_table, indices, offsets, psw, when, training=True
    )
    want = CPU.multi_dedup_backward(
        indices, offsets, psw, grad_out, specs, feature_table, lookup_slots, want_argmax
    )
    got = b.ops.multi_dedup_backward(
        b.to(indices),
        b.to(offsets),
        b.to(psw),
        b.to(grad_out),
        specs,
        feature_table,
        None,
        got_argmax,
    )
    keep = (0, 1, 2, 4)  # all but the slots, which only the CPU forward gives
    dims = [twins[t].dim for t in feature_table]
    cut = trimmed(got, dims)
    assert_same([cut[k] for k in keep], [want[k] for k in keep], f"{when}: multi_dedup_backward")
    assert want[5].numel() == 0 and not bool(got[5].any()), f"{when}: error bits {got[5]}"
    rows, grads, occ, slots, ranges = want[:5]
    got_backward = got
    for commit in (False, True):  # the dry run changes nothing; then both commit
        want = CPU.multi_update(
            _states(twins, "cpu"),
            specs,
            rows,
            grads,
            occ,
            slots,
            ranges,
            bounds.tolist(),
            [t.cpu_counters for t in twins],
            [t.cpu_commit for t in twins],
            None,
            commit,
        )
        got = b.ops.multi_update(  # from the device's own backward, sized for every lookup
            _states(twins, "dev"),
            specs,
            *got_backward[:3],
            b.to(torch.empty(0, dtype=torch.int64)),
            got_backward[4],
            [-1.0] * len(twins),
            [t.dev_counters for t in twins],
            [t.dev_commit for t in twins],
            None,
            commit,
        )
        assert got.tolist() == want.tolist(), f"{when}: verdict {got}, CPU {want}"
        refused = bool((want[:, 1] >= 0).any())
        if commit and not refused:  # the caller counts an applied update
            unique = (ranges[:, 1] - ranges[:, 0]).tolist()
            CPU.count_updates([t.cpu_counters for t in twins], unique)
            CPU.count_updates([t.dev_counters for t in twins], unique)
        for t in twins:
            t.compare_state(f"{when}: multi_update(commit={commit}), table {t.cfg.table_id}")
        if refused:
            return True
    return False


def make_batch(gen, rows, perm, bags, max_len, psw):
    lengths = torch.randint(0, max_len + 1, (bags,), generator=gen)
    lengths[torch.randint(0, bags, (2,), generator=gen)] = 0  # empty bags for sure
    n = int(lengths.sum())
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    indices = perm[(u**3 * rows).long().clamp(max=rows - 1)]  # skewed: duplicates, hot sets
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    w = (torch.randn(n, generator=gen) * 0.75 + 0.5) if psw else None
    return indices, offsets, w


def run_training(
    backend,
    *,
    rows,
    dim,
    sets,
    ways,
    steps,
    seed,
    psw=False,
    bags=24,
    max_len=6,
    **options,
):
    cache_ratio = (sets * ways + 0.5) / rows
    twin = Twin(backend, rows, dim, seed, associativity=ways, cache_ratio=cache_ratio, **options)
    twin.compare_state("initial")
    gen = torch.Generator().manual_seed(seed + 1)
    perm = torch.randperm(rows, generator=gen)
    for s in range(steps):
        indices, offsets, w = make_batch(gen, rows, perm, bags, max_len, psw)
        grad_out = torch.randn(bags, dim, generator=gen) * 0.35
        twin.train_step(indices, offsets, w, grad_out, f"step {s + 1}")
        if s % 3 == 2:  # an evaluation forward
            indices, offsets, w = make_batch(gen, rows, perm, bags, max_len, psw)
            twin.forward(indices, offsets, w, f"step {s + 1}: evaluation forward")
            twin.compare_state(f"step {s + 1}: after an evaluation forward")
    twin.flush("flush")
    indices, offsets, w = make_batch(gen, rows, perm, bags, max_len, psw)
    twin.train_step(
        indices, offsets, w, torch.randn(bags, dim, generator=gen) * 0.35, "step after flush"
    )
    return twin


# ----------------------------------------------------------------------------- tests


def test_emulator_schemas_match_cpu_ops():
    """torch.ops.embcache_emu has the schemas of torch.ops.embcache (so the kernels stay in
    step with the CPU ops: the CUDA binding shares the emulator's glue), every op but
    NOT_ON_CUDA and ANY_DEVICE."""
    if not _emulator_available():
        pytest.skip("embcache._cuda_emu was not built (EMBCACHE_NO_EMULATOR=1)")
    names = {
        n.split("::")[1]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("embcache::")
    }
    assert "multi_update" in names
    for name in sorted(names - NOT_ON_CUDA - ANY_DEVICE):
        assert hasattr(torch.ops.embcache_emu, name), f"{name} has no kernel implementation"
        cpu = str(getattr(torch.ops.embcache, name).default._schema)
        emu = str(getattr(torch.ops.embcache_emu, name).default._schema)
        assert emu.replace("embcache_emu::", "embcache::") == cpu, name


PRECISIONS = ("fp32", "fp16", "int8", "int4", "int2")
MATRIX = [
    (p, r, pol, w)
    for p in PRECISIONS
    for r in ("nearest", "stochastic")
    for pol in ("lru", "lfu")
    for w in (1, 2, 4, 8, 16, 32)
]
OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad")


@pytest.mark.parametrize("precision,rounding,policy,ways", MATRIX)
def test_training_matches_cpu(backend, precision, rounding, policy, ways):
    i = MATRIX.index((precision, rounding, policy, ways))
    dims = (3, 5, 8, 7, 4, 6, 33)  # 33: more elements than lanes
    twin = run_training(
        backend,
        rows=120 + 37 * (i % 5),
        dim=dims[i % len(dims)],
        sets=max(2, 12 // ways),
        ways=ways,
        steps=4,
        seed=1000 + i,
        psw=(i % 3 == 0),
        mode=("sum", "mean", "max" if i % 2 == 0 else "sum")[i % 3],
        precision=precision,
        rounding=rounding,
        policy=policy,
        optimizer=OPTIMIZERS[i % 3],
        lr=0.05,
        qparams=("fp16" if (i % 4 == 1 and precision in ("int8", "int4", "int2")) else "fp32"),
    )
    hits, misses, ins, evict, bypass = twin.totals.tolist()
    assert hits > 0 and ins > 0 and evict + bypass > 0, twin.totals  # every path taken


@pytest.mark.parametrize("bits", [16, 8])
def test_narrow_lfu_counts_saturate_alike(backend, bits):
    """16-bit and 8-bit LFU counts (saturating at 2^(bits - 1) - 1), started near the top so
    that rows saturate and then tie with the residents: the kernels agree with the CPU bit
    for bit."""
    rows, dim, top = 200, 4, 2 ** (bits - 1) - 1
    twin = Twin(
        backend,
        rows,
        dim,
        23,
        associativity=4,
        cache_ratio=(8 * 4 + 0.5) / rows,
        lfu_count_bits=bits,
    )
    counts = twin.cpu["counts"]
    assert counts.element_size() * 8 == bits and counts.numel() == rows
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    start = torch.randint(top - 7, top + 1, (rows,), generator=gen).to(counts.dtype)
    for state in (twin.cpu, twin.dev):
        state["counts"].copy_(start)
    perm = torch.randperm(rows, generator=gen)
    for s in range(4):
        indices, offsets, w = make_batch(gen, rows, perm, 24, 6, False)
        twin.train_step(indices, offsets, w, torch.randn(24, dim, generator=gen), f"step {s + 1}")
    assert int((twin.cpu["counts"] == top).sum()) > 10
    hits, misses, ins, evict, bypass = twin.totals.tolist()
    assert hits > 0 and ins > 0 and bypass > 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("ways", [1, 4, 32])
def test_more_candidates_than_ways_and_lanes(backend, policy, ways):
    """One or two sets and ~100 distinct rows a step: far more candidates than ways and than
    the 32 lanes of the warp handling the set (several rounds of ballots)."""
    twin = run_training(
        backend,
        rows=400,
        dim=6,
        sets=1 if ways == 32 else 2,
        ways=ways,
        steps=3,
        seed=7 + ways,
        bags=40,
        max_len=8,
        precision="int4",
        rounding="stochastic",
        policy=policy,
        optimizer="rowwise_adagrad",
        lr=0.1,
    )
    hits, misses, ins, evict, bypass = twin.totals.tolist()
    assert hits > 0 and ins > 0 and bypass > 0 and twin.lookup_hits > 0
    assert evict > 0 or policy == "lfu"  # LFU residents rarely lose to a newcomer here


@pytest.mark.parametrize(
    "psw,mode", [(False, "sum"), (True, "sum"), (False, "mean"), (False, "max")]
)
def test_rows_wider_than_a_register_tile(backend, psw, mode):
    """dim 300: more elements than a warp sums in registers at once (8 x 32), so the forward's
    and the backward's sums run in two tiles, the second one partial."""
    twin = run_training(
        backend,
        rows=150,
        dim=300,
        sets=4,
        ways=4,
        steps=3,
        seed=11,
        psw=psw,
        mode=mode,
        precision="int8",
        rounding="stochastic",
        policy="lfu",
        optimizer="adagrad",
        lr=0.05,
    )
    hits, misses, ins, evict, bypass = twin.totals.tolist()
    assert hits > 0 and ins > 0 and twin.lookup_hits > 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_all_duplicate_batches_and_empty_bags(backend, policy):
    twin = Twin(
        backend,
        300,
        5,
        3,
        associativity=4,
        cache_ratio=0.1,
        policy=policy,
        precision="int8",
        rounding="stochastic",
        optimizer="adagrad",
        lr=0.1,
    )
    gen = torch.Generator().manual_seed(3)
    for s in range(3):  # every lookup the same row
        indices = torch.full((30,), 17 + s, dtype=torch.int64)
        offsets = torch.tensor([0, 0, 10, 10, 30, 30])
        twin.train_step(
            indices, offsets, None, torch.randn(5, 5, generator=gen), f"all-duplicate step {s + 1}"
        )
    # only empty bags, and no bags at all
    twin.train_step(
        torch.empty(0, dtype=torch.int64),
        torch.zeros(4, dtype=torch.int64),
        None,
        torch.randn(3, 5, generator=gen),
        "empty bags",
    )
    twin.train_step(
        torch.empty(0, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
        None,
        torch.randn(0, 5, generator=gen),
        "no bags",
    )
    twin.flush("flush")


@pytest.mark.parametrize(
    "precision,dim", [("fp32", 5), ("int8", 5), ("int2", 7), ("fp16", 70)], ids=str
)
def test_max_pooling_ties_nans_and_empty_bags(backend, precision, dim):
    """Max pooling over rows of a few values (equal maxima in different rows and in repeats
    of one row, zeros of either sign), with empty bags and bags of one row repeated: the
    kernels take the CPU's maxima, argmax and gradients bit for bit; then a NaN in a cached
    row and one in a table row, read in an evaluation forward."""
    rows = 80
    twin = Twin(
        backend,
        rows,
        dim,
        31 + dim,
        ties=True,
        mode="max",
        precision=precision,
        associativity=4,
        cache_ratio=(3 * 4 + 0.5) / rows,
        optimizer="adagrad",
        lr=0.5,
    )
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    perm = torch.randperm(rows, generator=gen)
    for s in range(4):
        indices, offsets, _ = make_batch(gen, rows, perm, 24, 6, False)
        indices[: indices.numel() // 4] = indices[0]  # one row, repeated in bags
        twin.train_step(indices, offsets, None, torch.randn(24, dim, generator=gen), f"step {s}")
    twin.flush("flush")
    indices, offsets, _ = make_batch(gen, rows, perm, 24, 6, False)
    twin.train_step(indices, offsets, None, torch.randn(24, dim, generator=gen), "after flush")
    hits, misses, ins, evict, bypass = twin.totals.tolist()
    assert hits > 0 and ins > 0 and twin.lookup_hits > 0
    resident = int(twin.cpu["cache_tags"][twin.cpu["cache_tags"] >= 0][0])
    slot = int(torch.nonzero(twin.cpu["cache_tags"] == resident)[0])
    stored = next(r for r in range(rows) if r not in twin.cpu["cache_tags"].tolist())
    for state in (twin.cpu, twin.dev):
        state["cache_rows"][slot, 0] = float("nan")
    if precision == "fp32":
        for state in (twin.cpu, twin.dev):
            state["weights"][stored].view(torch.float32)[1] = float("nan")
    indices = torch.tensor([resident, stored, stored, resident, 1, resident, 2, stored])
    offsets = torch.tensor([0, 2, 4, 4, 5, 8])  # NaN first, NaN later, empty, one, three
    twin.forward(indices, offsets, None, "NaN rows")


def test_a_row_thousands_of_times_in_a_batch(backend):
    """Criteo's small columns and missing ids: one row in 4,000 of a batch's 4,200 lookups,
    its gradient a sum of 4,000 terms in lookup order (as the CPU sums it), with mean bags."""
    twin = Twin(
        backend,
        500,
        40,
        5,
        mode="mean",
        associativity=8,
        cache_ratio=0.05,
        precision="int4",
        rounding="stochastic",
        optimizer="rowwise_adagrad",
        lr=0.05,
    )
    gen = torch.Generator().manual_seed(5)
    for s in range(2):
        indices = torch.randint(0, 500, (4200,), generator=gen)
        indices[torch.randperm(4200, generator=gen)[:4000]] = 42
        offsets = torch.arange(0, 4201, 21)  # 200 bags, the end appended
        twin.train_step(
            indices, offsets, None, torch.randn(200, 40, generator=gen) * 0.1, f"hot step {s + 1}"
        )
    twin.flush("flush")


def test_no_cache_and_saturated_counts(backend):
    twin = Twin(backend, 100, 4, 11, cache_ratio=0.0, precision="fp16", rounding="stochastic")
    gen = torch.Generator().manual_seed(11)
    indices, offsets, _ = make_batch(gen, 100, torch.arange(100), 10, 5, False)
    twin.train_step(indices, offsets, None, torch.randn(10, 4, generator=gen), "no cache")
    twin = Twin(
        backend, 200, 4, 12, cache_ratio=0.05, associativity=2, policy="lfu", lfu_count_bits=32
    )
    for state in (twin.cpu, twin.dev):
        state["counts"].fill_(2**31 - 3)
    indices, offsets, _ = make_batch(gen, 200, torch.arange(200), 20, 6, False)
    twin.train_step(indices, offsets, None, torch.randn(20, 4, generator=gen), "saturating")


def test_refused_inputs_change_nothing(backend):
    """Out-of-range indices, bad bags, unsorted rows and unstorable values are refused, as on
    the CPU, and change nothing."""
    twin = Twin(backend, 50, 4, 5, associativity=2, cache_ratio=0.2, precision="fp16")
    b = backend
    bad_batches = [
        (torch.tensor([1, 50]), torch.tensor([0, 1, 2])),  # index out of range
        (torch.tensor([1, -1]), torch.tensor([0, 1, 2])),  # negative index
        (torch.tensor([1, 2]), torch.tensor([0, 2, 1])),  # decreasing offsets
        (torch.tensor([1, 2]), torch.tensor([0, 1, 3])),  # beyond len(indices)
    ]
    refused = (
        r"index -?\d+ out of range|an index is out of range|offsets must start at 0|"
        r"negative length|lengths sum to|offsets decrease"
    )
    for idx, off in bad_batches:
        lengths = off[1:] - off[:-1]
        with pytest.raises(RuntimeError, match=refused):
            CPU.multi_lookup_forward(
                twin._args(twin.cpu), twin.specs, idx, lengths, None, [0], 2, []
            )
        # the device's forward does not wait for its kernels: it returns their error bits
        counts = b.to(torch.zeros(len(DEVICE_COUNTS), dtype=torch.int64))
        errors = b.ops.multi_lookup_forward(
            twin._args(twin.dev), twin.specs, b.to(idx), b.to(lengths), None, [0], 2, [counts]
        )[5]
        bit = 1 if bool((idx < 0).any() | (idx >= 50).any()) else 2  # cache_api.h ErrorBits
        assert errors.tolist() == [bit], (idx, off, errors)
        if int(idx.min()) >= 0 and int(idx.max()) < 50:  # the backward's sort checks bags too
            errors = b.ops.multi_dedup_backward(
                b.to(idx), b.to(off), None, b.to(torch.zeros(2, 4)), twin.specs, [0]
            )[5]
            assert errors.tolist() == [2]
    # a huge gradient: fp16 cannot store the new value; the update reports the smallest such row
    rows = torch.tensor([3, 8, 20])
    grads = torch.tensor([[0.0] * 4, [-1e9] * 4, [1e9] * 4])
    occ = torch.ones(3, dtype=torch.int64)
    none = torch.empty(0, dtype=torch.int64)

    def update(on_device, rows, grads, occ, ranges, commit=True):
        """multi_update of the twin's table, by the CPU ops or on the device."""
        to = b.to if on_device else (lambda t: t)
        ops, state, counters, counts = (
            (b.ops, twin.dev, twin.dev_counters, twin.dev_commit)
            if on_device
            else (CPU, twin.cpu, twin.cpu_counters, twin.cpu_commit)
        )
        return ops.multi_update(
            twin._args(state),
            twin.specs,
            to(rows),
            to(grads.flatten()),
            to(occ),
            to(none),
            to(torch.tensor(ranges)),
            [-1.0],
            [counters],
            [counts],
            None,
            commit,
        )

    for commit in (False, True):
        want = update(False, rows, grads, occ, [[0, 3, 0]], commit)
        got = update(True, rows, grads, occ, [[0, 3, 0]], commit)
        assert want.tolist() == got.tolist() == [[0, 8]]

    unsorted = (torch.tensor([8, 3]), grads[:2], occ[:2], [[0, 2, 0]])
    with pytest.raises(RuntimeError, match="unique rows must be ascending"):
        update(False, *unsorted)
    # the device's update decides on the device: its verdict holds the error bit, and the
    # rows are not committed
    verdict = update(True, *unsorted)
    assert verdict[0, 0].item() == 4  # kBadUniqueRows
    # a table's rows said to run past the arrays: refused on the CPU, flagged on the device
    # (kBadRanges), and not committed either way
    past = (rows, grads, occ, [[0, 4, 0]])
    with pytest.raises(RuntimeError, match="row_ranges of table 0"):
        update(False, *past)
    verdict = update(True, *past)
    assert verdict[0, 0].item() == 8
    twin.compare_state("after refused calls")


# Wrong set floors for 5 sets of 4 ways: one int32 floor per set, in one dimension.
BAD_FLOORS = {
    "6 sets": ((6,), torch.int32),
    "none": ((0,), torch.int32),
    "2-D": ((5, 1), torch.int32),
    "40 sets": ((40,), torch.int32),
    "int64": ((5,), torch.int64),
}


@pytest.mark.parametrize("floor_shape,floor_dtype", BAD_FLOORS.values(), ids=BAD_FLOORS.keys())
def test_flush_refuses_a_misshaped_set_floor(any_ops, floor_shape, floor_dtype):
    """cache_flush checks cache_set_floor (int32, one floor per set) with the rest of the state
    before it writes anything: a floor of another shape or dtype is refused, the message names
    it, and no tensor changes (a dirty cache: a flush would write rows back)."""
    b = any_ops
    twin = run_training(
        b, rows=90, dim=5, sets=5, ways=4, steps=2, seed=41, precision="int8", policy="lfu"
    )
    c, state = twin.cfg, twin.dev
    assert (c.num_sets, c.num_slots) == (5, 20) and bool((state["cache_tags"] >= 0).any())
    floor = torch.full(floor_shape, -(2**31), dtype=floor_dtype, device=b.device)
    tensors = [floor if k == "cache_set_floor" else state[k] for k in STATE]
    before = [bits_of(t).clone() for t in tensors]
    counters = twin.dev_counters.clone()
    with pytest.raises(RuntimeError, match="cache_set_floor"):
        b.ops.cache_flush(tensors, twin.specs, [twin.dev_counters])
    for name, was, t in zip(STATE, before, tensors):
        assert torch.equal(bits_of(t), was), f"{name} changed"
    assert torch.equal(twin.dev_counters, counters)
    twin.compare_state("after a refused flush")


def test_weights_off_a_16_byte_boundary_are_refused(any_ops):
    """The CUDA kernels read an fp32 or fp16 table's values as words, so every op requires the
    weights to start at a 16-byte boundary (every allocation does; a view may not): refused
    before anything is written, the message naming the table and the rule."""
    b = any_ops
    twin = run_training(
        b, rows=90, dim=5, sets=5, ways=4, steps=2, seed=43, precision="fp32", policy="lru"
    )
    state = twin.dev
    weights = state["weights"]
    buffer = torch.empty(weights.numel() + 16, dtype=torch.uint8, device=b.device)
    shifted = buffer[4 : 4 + weights.numel()].view(weights.shape)
    shifted.copy_(weights)
    tensors = [shifted if k == "weights" else state[k] for k in STATE]
    before = [bits_of(t).clone() for t in tensors]
    with pytest.raises(RuntimeError, match="table 0: weights must start at a 16-byte boundary"):
        b.ops.cache_flush(tensors, twin.specs, [twin.dev_counters])
    for name, was, t in zip(STATE, before, tensors):
        assert torch.equal(bits_of(t), was), f"{name} changed"


@pytest.mark.parametrize("qparams", ["fp32", "fp16"])
def test_quantize_dequantize_rows(backend, qparams):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(70, 37, generator=gen) * 3
    x[5] = 1.25  # a constant row
    # Signed zeros as a row's extreme: the stored bias (or the range) comes from the first
    # zero, as the CPU's loop finds it, whichever lane of a warp holds it.
    x[6:8] = x[6:8].abs()
    x[6, [3, 35]] = torch.tensor([-0.0, 0.0])
    x[7, [1, 33, 36]] = torch.tensor([0.0, -0.0, -0.0])
    x[8] = -x[8].abs()
    x[8, [2, 20]] = torch.tensor([-0.0, 0.0])
    ids = torch.randperm(1000, generator=gen)[:70]
    for precision in PRECISIONS:
        for rounding in ("nearest", "stochastic"):
            options = dict(precision=precision, rounding=rounding, qparams=qparams, seed=99)
            spec = TableConfig(1000, 37, table_id=3, **options).spec()
            for step in (None, 4):
                want = CPU.quantize_rows(x, ids, spec, step)
                got = backend.ops.quantize_rows(backend.to(x), backend.to(ids), spec, step)
                assert_same(got, want, f"quantize_rows {precision} {rounding} step {step}")
                assert_same(
                    backend.ops.dequantize_rows(got, spec),
                    CPU.dequantize_rows(want, spec),
                    f"dequantize_rows {precision}",
                )
    with pytest.raises(RuntimeError, match="row 0 cannot be stored in 8 bits"):
        backend.ops.quantize_rows(
            backend.to(torch.full((2, 3), float("nan"))),
            backend.to(torch.arange(2)),
            TableConfig(1000, 3, precision="int8").spec(),
        )


def test_table_batched_ops(backend):
    """The ops over several tables, several features per table, pooled by sum, mean and max
    side by side, give the CPU's results."""
    b = backend
    twins = [
        Twin(b, 90, 4, 20, associativity=4, cache_ratio=0.2, precision="int8"),
        Twin(
            b,
            60,
            6,
            21,
            mode="mean",
            associativity=1,
            cache_ratio=0.1,
            precision="fp16",
            policy="lfu",
        ),
        Twin(b, 70, 3, 22, ties=True, mode="max", associativity=2, cache_ratio=0.2),
    ]
    gen = torch.Generator().manual_seed(20)
    batch, feature_table = 5, [0, 2, 1, 0, 2]
    rows = [(90, 60, 70)[t] for t in feature_table]
    lengths = torch.randint(0, 4, (len(feature_table) * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    indices = torch.cat(
        [
            torch.randint(0, rows[i // batch], (int(lengths[i]),), generator=gen)
            for i in range(len(feature_table) * batch)
        ]
    )
    specs = torch.cat([t.specs for t in twins])

    def lookup(ops, states, dev, counters):
        return ops.multi_lookup_forward(
            [x for s in states for x in (s[k] for k in STATE)],
            specs,
            dev(indices),
            dev(lengths),
            None,
            feature_table,
            batch,
            counters,
        )

    want_counters = [torch.zeros(len(DEVICE_COUNTS), dtype=torch.int64) for _ in twins]
    got_counters = [b.to(torch.zeros(len(DEVICE_COUNTS), dtype=torch.int64)) for _ in twins]
    want = lookup(CPU, [t.cpu for t in twins], lambda t: t, want_counters)
    got = lookup(b.ops, [t.dev for t in twins], b.to, got_counters)
    compared = (0, 1, 4)  # only the CPU op gives slot hints and value bounds
    assert_same([got[k] for k in compared], [want[k] for k in compared], "multi_lookup_forward")
    assert want[1].tolist() == offsets.tolist()
    assert want[4].shape == (batch, 2 * 3)  # the two max-pooled features' columns
    per_feature = lengths.view(len(feature_table), batch).sum(1).tolist()
    assert [c[0].item() for c in want_counters] == [
        per_feature[0] + per_feature[3],
        per_feature[2],
        per_feature[1] + per_feature[4],
    ]
    assert_same([c.cpu() for c in got_counters], want_counters, "multi_lookup_forward counts")
    dims = [twins[t].dim for t in feature_table]
    grad = torch.randn(batch, sum(dims), generator=gen)
    want = CPU.multi_dedup_backward(
        indices, offsets, None, grad, specs, feature_table, None, want[4]
    )
    got = b.ops.multi_dedup_backward(
        b.to(indices), b.to(offsets), None, b.to(grad), specs, feature_table, None, got[4]
    )
    assert_same(trimmed(got, dims), want[:5], "multi_dedup_backward")


def test_tables_trained_together(backend):
    """Several tables updated by one op (the kernels batch every table's update: one sort for
    every cached table's sets): LFU and LRU caches, tables without a cache, every optimizer,
    a table without lookups in a step, and a step that one table refuses for all."""
    b = backend
    # rows, dim, sets, ways, options
    tables = [
        (90, 4, 3, 4, dict(precision="int8", optimizer="rowwise_adagrad")),
        (60, 6, 6, 1, dict(precision="fp16", policy="lru", mode="mean")),
        (50, 3, 0, 1, dict(precision="fp32", optimizer="adagrad")),
        (300, 5, 2, 32, dict(precision="int4", rounding="nearest")),
        (70, 33, 0, 1, dict(precision="int8")),
        (
            110,
            7,
            2,
            8,
            dict(precision="int2", policy="lru", qparams="fp16", optimizer="rowwise_adagrad"),
        ),
    ]
    twins = [
        Twin(
            b,
            rows,
            dim,
            40 + t,
            associativity=ways,
            cache_ratio=(sets * ways + 0.5) / rows,
            lr=0.05,
            **options,
        )
        for t, (rows, dim, sets, ways, options) in enumerate(tables)
    ]
    num_sets = [int(t.specs[0, SPEC_FIELDS.index("num_sets")]) for t in twins]
    assert num_sets == [sets for _, _, sets, _, _ in tables], num_sets
    gen = torch.Generator().manual_seed(40)
    perms = [torch.randperm(rows, generator=gen) for rows, *_ in tables]
    feature_table, batch = list(range(len(tables))), 16
    refused = 0
    for s in range(6):
        psw = s % 2 == 1
        parts = [
            make_batch(gen, rows, perm, batch, 5, psw) for (rows, *_), perm in zip(tables, perms)
        ]
        if s == 2:  # table 4 is not looked up
            parts[4] = (
                torch.empty(0, dtype=torch.int64),
                torch.zeros(batch + 1, dtype=torch.int64),
                torch.empty(0) if psw else None,
            )
        indices = torch.cat([p[0] for p in parts])
        lengths = torch.cat([p[1][1:] - p[1][:-1] for p in parts])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        w = torch.cat([p[2] for p in parts]) if psw else None
        grad_out = torch.randn(batch, sum(t.dim for t in twins), generator=gen) * 0.35
        if s == 4:  # the FP16 table's new values overflow: every table's update is refused
            grad_out[:, 4:10] = 1e7
        refused += group_train_step(
            twins, feature_table, indices, offsets, w, grad_out, f"step {s + 1}"
        )
    assert refused == 1
    totals = sum(t.totals for t in twins)
    hits, misses, ins, evict, bypass = totals.tolist()
    assert hits > 0 and ins > 0 and evict > 0 and bypass > 0, totals
