"""The precision telemetry (embcache.telemetry): the rounding probes' figures against what
rounding must give, the untouched-row share against the rows really updated, and
checkpoints with and without the telemetry. (The probes' counters are compared exactly with
the pure-PyTorch reference in tests/test_reference_vs_kernels.py.)"""

from __future__ import annotations

import pytest
import torch

from embcache import CachedLowPrecisionEmbedding
from embcache.group import mark_with_tensor_ops
from embcache.telemetry import PROBE_COUNTERS, TOUCHED_SAMPLE_ROWS

BITS = {"int8": 8, "int4": 4, "int2": 2}


def _train(table, steps, gen, ids_per_step=512, bag=4):
    """Random sum-pooled training; returns the rows updated, ascending."""
    rows = table.config.num_embeddings
    updated = []
    for _ in range(steps):
        idx = torch.randint(0, rows, (ids_per_step,), generator=gen)
        out = table(idx, torch.arange(0, ids_per_step, bag))
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
        table.step()
        updated.append(idx)
    return torch.cat(updated).unique()


@pytest.mark.parametrize("precision", ["int8", "int4", "int2", "fp16"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_rounding_figures_are_what_the_rounding_must_give(precision, rounding):
    gen = torch.Generator().manual_seed(sum(map(ord, precision + rounding)))
    table = CachedLowPrecisionEmbedding(
        4000,
        24,
        precision=precision,
        rounding=rounding,
        cache_ratio=0.05,
        min_rows_for_low_precision=0,
        lr=0.5,
        seed=int(torch.randint(0, 2**31, (1,), generator=gen)),
    )
    _train(table, 24, gen)
    table.flush()
    s = table.stats()
    moved = s["probed_up"] + s["probed_down"]
    # a 32nd of the rows written, give or take the sampling of rows by (row + step)
    written = s["bypasses"] + s["evictions"] + s["flushed"]
    assert written / 48 < s["probed_rows"] < written / 20
    assert moved > 20 * s["probed_rows"]  # most elements move
    assert 0 < s["rounding_error_mean"] <= s["rounding_error_max"]
    if precision in BITS:  # relative to the range: within one code step, half of one if nearest
        step = 1 / (2 ** BITS[precision] - 1)
        assert s["rounding_error_max"] <= (step if rounding == "stochastic" else step / 2) * 1.0001
        assert s["rounding_error_mean"] < step / 2
    if rounding == "stochastic":  # the rounded-up share is the expected one
        expected = s["expected_up_share"]
        assert 0.2 < expected < 0.8
        assert abs(s["rounded_up_share"] - expected) < 5 * (0.25 / moved) ** 0.5
    else:
        assert s["expected_up_share"] == 0.0


def test_untouched_share_counts_the_rows_never_updated():
    gen = torch.Generator().manual_seed(5)
    rows = TOUCHED_SAMPLE_ROWS - 56  # every row followed
    small = CachedLowPrecisionEmbedding(rows, 8, min_rows_for_low_precision=0)
    assert small.stats()["untouched_share"] == 1.0
    updated = _train(small, 3, gen, ids_per_step=60)
    assert small.stats()["untouched_share"] == pytest.approx(1 - updated.numel() / rows)
    large = CachedLowPrecisionEmbedding(200_000, 4, min_rows_for_low_precision=0)
    updated = _train(large, 6, gen, ids_per_step=20_000, bag=8)
    share = 1 - updated.numel() / 200_000
    assert abs(large.stats()["untouched_share"] - share) < 5 * (0.25 / TOUCHED_SAMPLE_ROWS) ** 0.5


@pytest.mark.parametrize("seed", range(4))
def test_marking_on_the_cpu_equals_the_tensor_ops(seed):
    """mark_sampled_rows (the CPU's C++ pass) against mark_with_tensor_ops (every other
    device's), on random samples and updates of some of the tables, with rows that the
    samples share, miss, and hold first and last."""
    gen = torch.Generator().manual_seed(seed)
    tables = 7
    sizes = torch.randint(1, 3000, (tables,), generator=gen).tolist()
    samples = [torch.randperm(n, generator=gen)[: min(n, 40)].sort().values for n in sizes]
    keys = torch.cat([(t << 32) | s for t, s in enumerate(samples)])
    before = torch.rand(keys.numel(), generator=gen) < 0.2
    chosen = sorted(torch.randperm(tables, generator=gen)[:5].tolist())
    parts = []
    for t in chosen:
        take = torch.rand(sizes[t], generator=gen) < torch.rand(1, generator=gen)
        take[samples[t][:2]] = True  # a sampled row, surely; the first one updated
        parts.append(torch.nonzero(take).flatten())
    if seed == 0:
        parts[1] = parts[1][:0]  # a table with no rows in this update
    rows = torch.cat(parts)
    row_starts = [0] + torch.tensor([p.numel() for p in parts]).cumsum(0).tolist()
    ours, theirs = before.clone(), before.clone()
    torch.ops.embcache.mark_sampled_rows(rows, row_starts, chosen, keys, ours)
    mark_with_tensor_ops(rows, row_starts, chosen, keys, theirs)
    assert torch.equal(ours, theirs)
    assert ours.sum() > before.sum()


def test_checkpoints_carry_the_telemetry_and_older_ones_load():
    gen = torch.Generator().manual_seed(6)
    a = CachedLowPrecisionEmbedding(900, 8, min_rows_for_low_precision=0, lr=0.3)
    _train(a, 4, gen, ids_per_step=100)
    b = CachedLowPrecisionEmbedding(900, 8, min_rows_for_low_precision=0, lr=0.3)
    b.load_state_dict(a.state_dict())
    assert b.stats() == a.stats()
    # from before the telemetry: no probes, no touched rows
    old = a.state_dict()
    extra = old["_extra_state"]
    extra["stats"] = {k: v for k, v in extra["stats"].items() if k not in PROBE_COUNTERS}
    del extra["touched"]
    c = CachedLowPrecisionEmbedding(900, 8, min_rows_for_low_precision=0, lr=0.3)
    c.load_state_dict(old)
    assert all(c.stats()[k] == 0 for k in PROBE_COUNTERS)
    assert c.stats()["untouched_share"] == 1.0
    assert c.stats()["steps"] == a.stats()["steps"]


@pytest.mark.parametrize("touched", [[5, 3], [-1], [10**6], ["7"], "all"])
def test_bad_touched_rows_are_refused_and_change_nothing(touched):
    gen = torch.Generator().manual_seed(7)
    a = CachedLowPrecisionEmbedding(900, 8, min_rows_for_low_precision=0, name="ads")
    _train(a, 2, gen, ids_per_step=100)
    b = CachedLowPrecisionEmbedding(900, 8, min_rows_for_low_precision=0, name="ads")
    before = {k: v.clone() for k, v in b.state_dict().items() if isinstance(v, torch.Tensor)}
    stats = b.stats()
    state = a.state_dict()
    state["_extra_state"]["touched"] = touched
    with pytest.raises(ValueError, match="table 'ads': the saved touched rows"):
        b.load_state_dict(state)
    assert b.stats() == stats
    for k, v in b.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, before[k]), k
