"""The modules on a CUDA device give the same state as on the CPU, with no change of API
(runs only where torch has CUDA and a GPU; the kernels themselves are tested on the warp
emulator everywhere, in test_cuda_kernels.py)."""

import copy

import pytest
import torch

from embcache import CachedLowPrecisionEmbedding
from embcache.telemetry import PROBE_COUNTERS, rounding_figures

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not hasattr(torch.ops.embcache, "multi_lookup_forward"),
    reason="needs a CUDA GPU and a CUDA build of the kernels",
)


@pytest.mark.parametrize(
    "precision,policy,ways", [("int8", "lfu", 32), ("fp16", "lru", 4), ("int4", "lfu", 1)]
)
def test_module_on_cuda_matches_cpu(precision, policy, ways):
    cpu = CachedLowPrecisionEmbedding(
        5000,
        12,
        mode="sum",
        precision=precision,
        policy=policy,
        associativity=ways,
        cache_ratio=0.1,
        rounding="stochastic",
        lr=0.05,
        seed=3,
    )
    gpu = copy.deepcopy(cpu).cuda()
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        idx = (torch.rand(600, generator=gen) ** 3 * 5000).long()
        off = torch.arange(0, 600, 3)
        grad = torch.randn(200, 12, generator=gen) * 0.1
        a, b = cpu(idx, off), gpu(idx.cuda(), off.cuda())
        assert torch.equal(a, b.cpu())
        a.backward(grad)
        b.backward(grad.cuda())
        cpu.step()
        gpu.step()
    for (name, x), (_, y) in zip(cpu.state_dict().items(), gpu.state_dict().items()):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y.cpu()), name
    # the precision telemetry is measured on the CPU only
    cpu_only = {*PROBE_COUNTERS, *rounding_figures(dict.fromkeys(PROBE_COUNTERS, 0))}
    mine, theirs = cpu.stats(), gpu.stats()
    assert {k: v for k, v in mine.items() if k not in cpu_only} == {
        k: v for k, v in theirs.items() if k not in cpu_only
    }
