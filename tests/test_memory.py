"""Memory accounting (docs/contract.md §5): the formula, the bytes really allocated, and the paper's points."""

import pytest

from embcache import CachedLowPrecisionEmbedding, TableConfig, compression_factor, memory_breakdown


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4", "int2"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_memory_bytes_are_the_tensors_bytes_and_the_formula(precision, policy, optimizer):
    m = CachedLowPrecisionEmbedding(
        3000,
        12,
        precision=precision,
        policy=policy,
        optimizer=optimizer,
        cache_ratio=0.1,
        associativity=8,
        qparams="fp16" if precision == "int4" else "fp32",
    )
    mem = m.memory_bytes()
    allocated = sum(b.nbytes for b in m.buffers())
    assert mem["total"] == allocated
    assert mem == memory_breakdown(m.config)
    assert m.compression_factor() == pytest.approx(compression_factor(m.config), rel=0, abs=0)


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(precision="fp16", cache_ratio=0), 0.5),
        (dict(precision="int8", cache_ratio=0), 0.265625),
        # paper ≈ 0.374; ours keeps a 4-byte priority per slot too (0.0008 more at 10%)
        (dict(precision="int8", cache_ratio=0.1, policy="lfu"), 0.375),
    ],
)
def test_paper_reference_points_dim_128(kwargs, expected):
    cfg = TableConfig(1_000_000, 128, **kwargs)
    assert compression_factor(cfg) == pytest.approx(expected, abs=5e-4)


def test_optimizer_state_counts_on_both_sides():
    sgd = compression_factor(TableConfig(100_000, 64, precision="int8", cache_ratio=0))
    full = compression_factor(
        TableConfig(100_000, 64, precision="int8", cache_ratio=0, optimizer="adagrad")
    )
    assert full > sgd  # AdaGrad's FP32 accumulators (dim per row) are not compressed
    assert full == pytest.approx((100_000 * (64 + 8 + 64 * 4)) / (100_000 * 64 * 8))
