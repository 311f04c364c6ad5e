"""The tables' Python driver (embcache.group) on the emulated CUDA kernels: their host code is
the CUDA build's, their "device" the CPU. Tests take the ``emulated`` fixture (conftest.py) to
run the group's cache ops on ``torch.ops.embcache_emu`` and the rest on the CPU library."""

import pytest
import torch

from embcache import CachedLowPrecisionEmbeddingBags

try:
    import embcache._cuda_emu  # noqa: F401

    EMU = torch.ops.embcache_emu
except ImportError:  # pragma: no cover
    EMU = None

needs_emulator = pytest.mark.skipif(EMU is None, reason="embcache._cuda_emu was not built")

# the ops with a kernel (csrc/op_schemas.h define_cache_ops)
CACHE_OPS = {
    "multi_lookup_forward",
    "multi_dedup_backward",
    "multi_update",
    "cache_flush",
    "stage_misses",
    "unstage_rows",
}


class Emulated:
    """torch.ops.embcache with the cache ops served by the emulated CUDA kernels."""

    def __init__(self, cpu_ops):
        self.cpu_ops = cpu_ops

    def __getattr__(self, name):
        return getattr(EMU if name in CACHE_OPS else self.cpu_ops, name)


def comparable_stats(module) -> dict:
    """A module's tables' statistics but the precision probes, which only the CPU ops measure."""
    probes = ("probed_", "rounding_error", "rounded_up", "expected_up")
    return {
        name: {k: v for k, v in stats.items() if not k.startswith(probes)}
        for name, stats in module.stats().items()
    }


def small_bags(tables, seed: int = 0, **options) -> CachedLowPrecisionEmbeddingBags:
    """The emulator tests' module of ``tables``: INT8 behind a 10% 4-way LFU cache, row-wise
    AdaGrad (``options`` override), its rows drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    defaults = dict(
        precision="int8",
        cache_ratio=0.1,
        associativity=4,
        policy="lfu",
        min_rows_for_low_precision=0,
        optimizer="rowwise_adagrad",
        lr=0.05,
    )
    return CachedLowPrecisionEmbeddingBags(tables, **{**defaults, **options})
