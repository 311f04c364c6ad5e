"""A table of more than 2^32 bytes: rows past 2^31 and past 2^32 bytes are read and updated
where they are, on the CPU ops and on the CUDA kernels (emulated), so no byte offset is
computed in 32 bits, signed or not.

The table's memory is reserved but untouched but for the rows the test writes (the state is
allocated as a table built on the meta device is when it is given memory), so the test needs
a few MB, not 4 GB."""

from __future__ import annotations

import pytest
import torch

from embcache import CachedLowPrecisionEmbedding

DIM = 256
ROW_BYTES = DIM + 8  # INT8 codes and an FP32 scale and bias
ROWS = 2**32 // ROW_BYTES + 64  # the last rows start past byte 2^32
PAST_2_31 = 2**31 // ROW_BYTES + 1  # the first row that starts past byte 2^31
LR = 0.1


def _emulator():
    try:
        import embcache._cuda_emu  # noqa: F401
    except ImportError:
        return None
    return torch.ops.embcache_emu


@pytest.fixture(scope="module")
def table():
    t = CachedLowPrecisionEmbedding(
        ROWS,
        DIM,
        precision="int8",
        qparams="fp32",
        cache_ratio=0.0,
        optimizer="sgd",
        lr=LR,
        device="meta",
    )
    t._allocate_state(None)  # reserved, not written: pages are mapped as rows are written
    t._reset_state()
    assert t.weights.nbytes > 2**32 and t.config.row_bytes == ROW_BYTES
    return t


def _rows(t: CachedLowPrecisionEmbedding, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Stores random rows at ``ids``; returns their values as stored (dequantized)."""
    values = torch.randn(len(ids), DIM, generator=torch.Generator().manual_seed(seed))
    t.weights[ids] = torch.ops.embcache.quantize_rows(values, ids, t.spec)
    return torch.ops.embcache.dequantize_rows(t.weights[ids], t.spec)


def test_rows_past_byte_2_to_the_31_and_32_are_read_and_updated_in_place(table):
    ids = torch.tensor([ROWS - 1, 3, PAST_2_31, PAST_2_31 - 1, 0])
    assert (ids * ROW_BYTES // 2**31).tolist() == [2, 0, 1, 0, 0]
    stored = _rows(table, ids, seed=0)
    pooled = table(ids, torch.arange(len(ids)))  # bags of one
    assert torch.equal(pooled, stored)
    grad = torch.randn(len(ids), DIM, generator=torch.Generator().manual_seed(1))
    pooled.backward(grad)
    table.step()
    # the update's step is 1: the new rows as the table rounds them at update 1
    expected = torch.ops.embcache.quantize_rows(stored - LR * grad, ids, table.spec, 1)
    assert torch.equal(table.weights[ids], expected)


@pytest.mark.skipif(_emulator() is None, reason="embcache._cuda_emu was not built")
def test_the_cuda_kernels_read_and_update_the_same_rows(table):
    emu = _emulator()
    ids = torch.tensor([ROWS - 2, PAST_2_31 + 5, 7])
    stored = _rows(table, ids, seed=2)
    lengths = torch.ones(len(ids), dtype=torch.int64)
    state, specs = list(table.state_tensors()), table.spec[None]
    pooled = emu.multi_lookup_forward(state, specs, ids, lengths, None, [0], len(ids), [])[0]
    assert torch.equal(pooled, stored)
    grad = torch.randn(len(ids), DIM, generator=torch.Generator().manual_seed(3))
    offsets = torch.arange(len(ids) + 1)
    rows, grads, occ, hints, ranges, _ = emu.multi_dedup_backward(
        ids, offsets, None, grad, specs, [0], None
    )
    assert rows.tolist() == sorted(ids.tolist())
    counters, counts = torch.zeros_like(table.counters), torch.zeros_like(table.device_counts())
    verdict = emu.multi_update(
        state, specs, rows, grads, occ, hints, ranges, [-1.0], [counters], [counts]
    )
    assert verdict.tolist() == [[0, -1]]
    order = ids.argsort()
    expected = torch.ops.embcache.quantize_rows((stored - LR * grad)[order], rows, table.spec, 1)
    assert torch.equal(table.weights[rows], expected)
