"""Row formats and rounding (docs/contract.md §2-3) of the ops ``torch.ops.embcache.quantize_rows`` /
``dequantize_rows``, against FBGEMM (the external oracle), ``tensor.half()``, hand-worked
examples, statistics, and the pure-PyTorch reference ``embcache.reference``."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import embcache  # noqa: F401  (registers torch.ops.embcache)
from embcache import reference as ref
from embcache.config import TableConfig

fbgemm_gpu = pytest.importorskip("fbgemm_gpu")  # registers torch.ops.fbgemm

ops = torch.ops.embcache
BITS = ref.PRECISION_BITS
INT_PRECISIONS = ("int8", "int4", "int2")


def spec(precision, dim, qparams="fp32", rounding="nearest", seed=0, table=0):
    """The spec of a table of rows of ``dim`` values stored in ``precision`` (the ops take a
    table's spec; its rows and cache do not matter to them)."""
    return TableConfig(
        1,
        dim,
        precision=precision,
        qparams=qparams,
        rounding=rounding,
        seed=seed,
        table_id=table,
        cache_ratio=0.0,
        min_rows_for_low_precision=1,
    ).spec()


def quantize(
    x, precision, qparams="fp32", rounding="nearest", seed=0, step=0, table=0, row_ids=None
):
    """The op, with the reference's argument names: rounded as a table of ``rounding``
    rounds at update ``step``."""
    x = x.float().contiguous()
    if row_ids is None:
        row_ids = torch.arange(x.shape[0], dtype=torch.int64)
    return ops.quantize_rows(
        x, row_ids, spec(precision, x.shape[1], qparams, rounding, seed, table), step
    )


def dequantize(w, precision, dim, qparams="fp32"):
    return ops.dequantize_rows(w, spec(precision, dim, qparams))


def assert_bytes_equal(got, want, what=""):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if not torch.equal(got, want):
        bad = torch.nonzero(got != want)
        r, c = bad[0].tolist()
        raise AssertionError(
            f"{what}: {bad.shape[0]} bytes differ; first row {r} byte {c}: "
            f"{got[r].tolist()} vs {want[r].tolist()}"
        )


def assert_f32_bits_equal(got, want, what=""):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    g, w = got.contiguous().view(torch.int32), want.contiguous().view(torch.int32)
    if not torch.equal(g, w):
        bad = torch.nonzero(g != w)
        raise AssertionError(
            f"{what}: {bad.shape[0]} values differ, first at {bad[0].tolist()}: "
            f"{got[tuple(bad[0])].item()!r} vs {want[tuple(bad[0])].item()!r}"
        )


def random_rows(gen, n, dim, spread=(-6.0, 6.0), offset=1e3):
    """Rows of varied magnitude (10^spread) and sign; 30% of them shifted by up to about
    ``offset`` times their spread (ranges small compared with the values)."""
    mag = 10.0 ** (torch.rand(n, 1, generator=gen) * (spread[1] - spread[0]) + spread[0])
    x = torch.randn(n, dim, generator=gen) * mag
    shift = (
        torch.randn(n, 1, generator=gen) * mag * (torch.rand(n, 1, generator=gen) < 0.3) * offset
    )
    return (x + shift).float()


# ----------------------------------------------------------------------------- Philox


def test_philox_known_answers():
    """Random123's kat_vectors for philox4x32-10."""
    kat = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, want in kat:
        assert ref.philox4x32_10(counter, key) == want


def test_uniforms_layout():
    """u of element j = (word j & 3 of philox((j >> 2, row, step, table), (seed lo, seed hi)) >> 8) / 2^24."""
    seed, step, table, row = (7 << 32) | 11, 5, 3, 123456
    u = ref.uniforms(seed, step, table, row, 9)
    for j in range(9):
        word = ref.philox4x32_10((j >> 2, row, step, table), (11, 7))[j & 3]
        assert u[j].item() == (word >> 8) / 2**24
    assert u.dtype == torch.float32 and bool(((u >= 0) & (u < 1)).all())


def test_murmur_fmix64():
    # fmix64(0) = 0; a value computed by hand from the constants of docs/contract.md §4
    assert ref.murmur_fmix64(0) == 0
    h = 1
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) % 2**64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) % 2**64
    h ^= h >> 33
    assert ref.murmur_fmix64(1) == h == 0xB456BCFC34C2CB2C


# ----------------------------------------------------------------------------- external oracles


def check_dequantize_close_to_fbgemm(ours, fb, stored, bits, dim, qparams):
    nb = math.ceil(dim * bits / 8)
    sb = stored[:, nb:].clone().view(torch.float16 if qparams == "fp16" else torch.float32).double()
    product = ref.unpack_codes(stored[:, :nb], bits, dim).double() * sb[:, :1]
    # |round(round(p) + b) - round(p + b)| <= half an ulp of p plus an ulp of the result
    tol = product.abs() * 2.0**-24 + fb.double().abs() * 2.0**-23 + 1e-45
    far = int(((ours.double() - fb.double()).abs() > tol).sum())
    assert far == 0, f"{far} dequantized values differ from FBGEMM's by more than one rounding"
    assert_f32_bits_equal(ours, ref.dequantize_rows(stored, f"int{bits}", dim, qparams))


def signed_zero_rows(dim):
    """Rows whose min (or max) is both 0.0 and -0.0: the first one in the row is taken, as
    std::min_element does (the stored bias keeps its sign bit)."""
    rows = [torch.full((dim,), -0.0), torch.full((dim,), 0.0)]
    # zeros at positions 0 and 1, or 1 and 4 (which a 4-lane SIMD scan meets in the other order)
    for i, k in ((0, 1), (1, 4)):
        if dim <= k:
            continue
        for a, b in ((0.0, -0.0), (-0.0, 0.0)):
            for tail in (1.0, -1.0):
                r = torch.full((dim,), tail)
                r[i], r[k] = a, b
                rows.append(r)
                rows.append(r.flip(0))
    return torch.stack(rows)


INT8_DIMS = (1, 2, 3, 5, 7, 8, 16, 17, 31, 64, 127, 200)


@pytest.mark.parametrize("dim", INT8_DIMS)
def test_int8_nearest_equals_fbgemm(dim):
    gen = torch.Generator().manual_seed(dim)
    x = random_rows(gen, 300, dim, spread=(-12.0, 30.0))
    special = torch.stack(
        [
            torch.full((dim,), 0.0),
            torch.full((dim,), -3.25),
            torch.full((dim,), 1e30),  # constant
            torch.linspace(-1.0, 1.0, dim),
            torch.linspace(5.0, 5.0 + 1e-6, dim),  # tiny range
            torch.linspace(-1e37, 1e37, dim),
            torch.linspace(1e-38, 3e-38, dim),  # huge / tiny values
            torch.arange(dim, dtype=torch.float32) % 256,  # exact codes
        ]
    )
    x = torch.cat([x, special, signed_zero_rows(dim)])
    want = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(x)
    assert_bytes_equal(quantize(x, "int8"), want, f"int8 dim {dim}")
    assert_bytes_equal(
        ref.quantize_rows(x, range(x.shape[0]), "int8"), want, f"reference int8 dim {dim}"
    )
    # FBGEMM's dequantization fuses code * scale + bias into an FMA; ours rounds the
    # product first (project convention), so the two agree up to one rounding of the product
    check_dequantize_close_to_fbgemm(
        dequantize(want, "int8", dim),
        torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(want),
        want,
        8,
        dim,
        "fp32",
    )


NBIT_DIMS = (8, 16, 24, 64, 128, 200)


@pytest.mark.parametrize("bits", (4, 2))
@pytest.mark.parametrize("dim", NBIT_DIMS)
def test_nbit_fp16_qparams_nearest_equals_fbgemm_sbhalf(bits, dim):
    gen = torch.Generator().manual_seed(100 * bits + dim)
    # values whose fp16 scale is a normal or subnormal binary16 (not 0: see the test below)
    x = random_rows(gen, 400, dim, spread=(-3.0, 2.5), offset=10.0)
    x = torch.cat(
        [x, torch.linspace(-1.0, 1.0, dim)[None], (torch.arange(dim) % (2**bits)).float()[None]]
    )
    precision = f"int{bits}"
    want = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(x, bits)
    assert_bytes_equal(quantize(x, precision, "fp16"), want, f"{precision} dim {dim}")
    assert_bytes_equal(
        ref.quantize_rows(x, range(x.shape[0]), precision, "fp16"),
        want,
        f"reference {precision} dim {dim}",
    )
    fb = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(want, bits)
    check_dequantize_close_to_fbgemm(
        dequantize(want, precision, dim, "fp16"), fb, want, bits, dim, "fp16"
    )


def degenerate_rows(dim):
    return torch.stack(
        [
            torch.full((dim,), 0.0),
            torch.full((dim,), 1.0),
            torch.full((dim,), -7.5),
            torch.full((dim,), 3000.9),  # fp16(min) != min: not degenerate, scale > 0
            torch.linspace(1.0, 1.0 + 1e-7, dim),  # fp16 scale underflows to 0
        ]
    )


@pytest.mark.parametrize("bits", (4, 2))
def test_nbit_degenerate_rows_same_values_as_fbgemm(bits):
    """Constant rows (and rows whose fp16 scale underflows): same codes, same bias and same
    dequantized values as FBGEMM (only the stored scale may differ, see the next test)."""
    dim = 16
    x = degenerate_rows(dim)
    precision = f"int{bits}"
    got, want = (
        quantize(x, precision, "fp16"),
        torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(x, bits),
    )
    nb = dim * bits // 8
    assert_bytes_equal(got[:, :nb], want[:, :nb], "codes")
    assert_bytes_equal(got[:, nb + 2 :], want[:, nb + 2 :], "bias")
    assert_f32_bits_equal(
        dequantize(got, precision, dim, "fp16"),
        torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(want, bits),
        "values",
    )
    # A constant row gives codes 0 and, with fp16 qparams, the stored scale 1.0 (FBGEMM's)
    assert got[:3, :nb].eq(0).all() and got[:3, nb : nb + 2].view(torch.float16).eq(1.0).all()


@pytest.mark.parametrize("bits", (4, 2))
def test_nbit_degenerate_rows_bit_identical_to_fbgemm(bits):
    x = degenerate_rows(16)
    assert_bytes_equal(
        quantize(x, f"int{bits}", "fp16"),
        torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(x, bits),
    )


def all_finite_halves() -> torch.Tensor:
    """Every finite non-negative binary16 value, as float32."""
    return torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()


def as_rows(x: torch.Tensor, dim: int = 64) -> torch.Tensor:
    pad = (-x.numel()) % dim
    return torch.cat([x, torch.zeros(pad)]).reshape(-1, dim)


def test_fp16_nearest_equals_half():
    h = all_finite_halves()  # subnormals included
    mids = ((h[:-1].double() + h[1:].double()) / 2).float()  # exact ties (12 bits)
    assert bool(((mids.double() * 2) == (h[:-1].double() + h[1:].double())).all())
    up, down = (
        torch.nextafter(mids, torch.tensor(math.inf)),
        torch.nextafter(mids, torch.tensor(0.0)),
    )
    gen = torch.Generator().manual_seed(0)
    rnd = torch.exp(torch.rand(20000, generator=gen) * 30 - 25)  # 2^-36 .. 2^7 and around
    tiny = torch.tensor([2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26, 3 * 2.0**-26, 1e-30, 1.4e-45])
    top = torch.tensor([65504.0, 65503.99, 65488.0, 65496.0, 65495.99, 65472.0])
    x = torch.cat([h, mids, up, down, rnd, tiny, top])
    x = torch.cat([x, -x])
    rows = as_rows(x)
    got = quantize(rows, "fp16").view(torch.float16)
    assert torch.equal(got.view(torch.int16), rows.half().view(torch.int16))
    ties = as_rows(mids)
    assert torch.equal(quantize(ties, "fp16"), ties.half().view(torch.uint8))  # ties to even
    # the reference is tensor.half() by construction; its stored bytes are the op's
    assert torch.equal(
        ref.quantize_rows(rows, range(rows.shape[0]), "fp16"), rows.half().view(torch.uint8)
    )


def test_fp16_nearest_just_above_max_rounds_to_max():
    x = torch.tensor([[65504.5, -65510.0, 65519.99, 1.0]])
    assert torch.equal(quantize(x, "fp16"), x.half().view(torch.uint8))


@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
def test_fp16_overflow_raises(rounding):
    for v in (65520.0, -70000.0, 1e30):
        x = torch.tensor([[1.0, v, 2.0]])
        with pytest.raises(RuntimeError, match="row 0 cannot be stored in 16 bits"):
            quantize(x, "fp16", rounding=rounding)
        with pytest.raises(ref.NotStorableError, match="row 0 cannot be stored as fp16"):
            ref.quantize_rows(x, [0], "fp16", rounding=rounding)
    # stochastic rounding of |x| > 65504 could produce infinity: refused
    x = torch.tensor([[65510.0]])
    with pytest.raises(RuntimeError, match="row 0 cannot be stored in 16 bits"):
        quantize(x, "fp16", rounding="stochastic", seed=1, step=1)
    with pytest.raises(ref.NotStorableError, match="row 0 cannot be stored as fp16"):
        ref.quantize_rows(x, [0], "fp16", rounding="stochastic")


# ----------------------------------------------------------------------------- hand-worked examples


def test_packing_low_bits_first():
    """Element j in byte j // (8/k) at bit offset (j % (8/k)) * k; unused bits 0."""
    # a row with min 0 and max Q has scale 1 and codes = values
    x4 = torch.tensor([[1.0, 2.0, 15.0, 0.0, 3.0]])
    x2 = torch.tensor([[1.0, 2.0, 3.0, 0.0, 1.0]])
    want4 = [0x21, 0x0F, 0x03]
    want2 = [0b00111001, 0b00000001]
    for x, prec, want in ((x4, "int4", want4), (x2, "int2", want2)):
        for got in (quantize(x, prec), ref.quantize_rows(x, [0], prec)):
            assert got[0, : len(want)].tolist() == want, prec
            scale, bias = got[0, len(want) :].clone().view(torch.float32).tolist()
            assert (scale, bias) == (1.0, 0.0)
    # the float32 layout: little-endian IEEE bits
    x = torch.tensor([[1.0, -2.0]])
    assert quantize(x, "fp32")[0].tolist() == [0, 0, 128, 63, 0, 0, 0, 192]
    assert quantize(x, "fp16")[0].tolist() == [0, 60, 0, 192]


def test_int_nearest_ties_to_even():
    """With fp16 qparams and a power-of-two scale, y = (x - bias) / scale is exact: the
    halves k + 0.5 go to the even code."""
    # min 0, max 63.75 = 255 * 0.25: bias 0, scale 0.25, inv 4
    x = torch.tensor([[0.0, 63.75, 0.125, 0.375, 0.625, 0.875, 10.125, 10.375]])
    for got in (quantize(x, "int8", "fp16"), ref.quantize_rows(x, [0], "int8", "fp16")):
        assert got[0, :8].tolist() == [0, 255, 0, 2, 2, 4, 40, 42]
        assert got[0, 8:].clone().view(torch.float16).tolist() == [0.25, 0.0]


def test_int_qparams_formulas():
    """docs/contract.md §2 in float32: scale = (max - min) / Q, bias = min, y = (x - min) * (Q / (range + 1e-8));
    fp16 qparams: bias = fp16(min), scale = fp16((max - bias) / Q)."""
    x = torch.tensor([[0.3, -1.7, 2.9, 0.0, 1.1]])
    mn, mx = torch.tensor(-1.7), torch.tensor(2.9)
    for prec in INT_PRECISIONS:
        q = torch.tensor(float(2 ** BITS[prec] - 1))
        got = quantize(x, prec)
        nb = ref.payload_bytes(prec, 5)
        scale, bias = got[0, nb:].clone().view(torch.float32)
        assert scale.item() == ((mx - mn) / q).item() and bias.item() == mn.item()
        y = (x[0] - mn) * (q / ((mx - mn) + torch.tensor(1e-8)))
        codes = ref.unpack_codes(got[:, :nb], BITS[prec], 5)[0]
        assert codes.tolist() == torch.round(y).clamp(0, q).long().tolist()
        got16 = quantize(x, prec, "fp16")
        scale16, bias16 = got16[0, nb:].clone().view(torch.float16).float()
        assert bias16.item() == mn.half().float().item()
        assert scale16.item() == ((mx - bias16) / q).half().float().item()
    # constant row: scale 0, codes 0, exact values back
    c = torch.full((1, 7), -2.5)
    for prec in INT_PRECISIONS:
        for qp in ("fp32", "fp16"):
            got = quantize(c, prec, qp)
            nb = ref.payload_bytes(prec, 7)
            assert bool((got[0, :nb] == 0).all())
            assert torch.equal(dequantize(got, prec, 7, qp), c)


def test_every_half_decodes_exactly():
    """All 65,536 binary16 patterns, read four at a time (dim 16), four at a time and one at a
    time (dim 6), and one at a time (dim 2): finite values and infinities as torch converts
    them; NaNs keep their sign and payload (man << 13 under an all-ones exponent)."""
    h = torch.arange(65536, dtype=torch.int64)
    nan = ((h >> 10) & 31 == 31) & (h & 0x3FF != 0)
    want = torch.where(nan, h & 0x8000, h).sub(65536 * (h >= 32768)).to(torch.int16)
    want = want.view(torch.float16).float().view(torch.int32)  # no NaN: torch is the oracle
    nan_bits = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)
    want = torch.where(nan, nan_bits.sub(2**32 * (nan_bits >= 2**31)).to(torch.int32), want)
    for dim in (16, 6, 2):
        rows = -(-65536 // dim)
        padded = torch.cat([h, h[: rows * dim - 65536]])
        stored = padded.sub(65536 * (padded >= 32768)).to(torch.int16).view(torch.uint8)
        got = dequantize(stored.reshape(rows, 2 * dim), "fp16", dim).reshape(-1)[:65536]
        bad = torch.nonzero(got.view(torch.int32) != want)
        assert bad.numel() == 0, f"dim {dim}: half {hex(int(bad[0]))} decodes wrong"


def test_dequantize_is_multiply_then_add():
    """code * scale + bias as two rounded float32 operations, not a fused multiply-add:
    on random codes and qparams the op equals the reference, and differs from an FMA."""
    gen = torch.Generator().manual_seed(1)
    n, dim = 2000, 13
    for prec in INT_PRECISIONS:
        for qp in ("fp32", "fp16"):
            nb = ref.payload_bytes(prec, dim)
            payload = torch.randint(0, 256, (n, nb), generator=gen, dtype=torch.int64).to(
                torch.uint8
            )
            sb = (torch.randn(n, 2, generator=gen) * 3).to(
                torch.float16 if qp == "fp16" else torch.float32
            )
            w = torch.cat([payload, sb.view(torch.uint8)], dim=1)
            got = dequantize(w, prec, dim, qp)
            assert_f32_bits_equal(got, ref.dequantize_rows(w, prec, dim, qp), f"{prec} {qp}")
            codes = ref.unpack_codes(payload, BITS[prec], dim).double()
            s, b = sb.double()[:, :1], sb.double()[:, 1:]
            fused = (codes * s + b).float()  # one rounding: what an FMA gives
            if prec == "int8" and qp == "fp32":
                assert not torch.equal(got, fused)
    # fp32 and fp16 rows are the stored values
    x = torch.randn(50, 7, generator=gen)
    assert_f32_bits_equal(dequantize(x.view(torch.uint8), "fp32", 7), x)
    h = x.half()
    assert_f32_bits_equal(dequantize(h.view(torch.uint8), "fp16", 7), h.float())


# ----------------------------------------------------------------------------- stochastic rounding


def draws(x, precision, qparams="fp32", copies=256, steps=8, seed=99, table=3):
    """Stochastic roundings of the row x: `copies` row ids at each of `steps` steps
    -> stored bytes [steps * copies, row_bytes]."""
    rows = x.reshape(1, -1).expand(copies, -1).contiguous()
    ids = torch.arange(1000, 1000 + copies, dtype=torch.int64)
    return torch.cat(
        [
            quantize(rows, precision, qparams, "stochastic", seed, step, table, ids)
            for step in range(1, steps + 1)
        ]
    )


@pytest.mark.parametrize("qparams", ("fp32", "fp16"))
@pytest.mark.parametrize("precision", INT_PRECISIONS)
def test_stochastic_codes_neighbours_and_unbiased(precision, qparams):
    gen = torch.Generator().manual_seed(BITS[precision])
    dim = 16
    x = torch.randn(dim, generator=gen)
    bits = BITS[precision]
    q = 2**bits - 1
    nb = ref.payload_bytes(precision, dim)
    stored = draws(x, precision, qparams)
    n = stored.shape[0]
    nearest = quantize(x[None], precision, qparams)
    # the qparams are those of nearest rounding: only the codes are random
    assert bool((stored[:, nb:] == nearest[:, nb:]).all())
    scale, bias, inv = ref.row_qparams(x[None], bits, qparams)
    y = (x - bias) * inv
    lo = torch.floor(y)
    codes = ref.unpack_codes(stored[:, :nb], bits, dim).double()
    # only the two neighbouring codes
    assert bool(((codes == lo.clamp(0, q)) | (codes == (lo + 1).clamp(0, q))).all())
    # unbiased: E[code] = y (inside [0, Q]), within 5 standard errors
    inside = (y >= 0) & (y <= q)
    p = (y - lo).double()
    se = torch.sqrt(p * (1 - p) / n)
    err = (codes.mean(0) - y.double()).abs()
    assert bool((err[inside] <= 5 * se[inside] + 1e-9).all()), (err, se)
    # both outcomes really occur where p is not tiny
    mixed = inside & (p > 0.1) & (p < 0.9)
    assert bool(mixed.any())
    assert bool((codes[:, mixed].std(0) > 0).all())
    # and the dequantized mean is x (up to the 1e-8 of the fp32 inverse scale)
    values = dequantize(stored, precision, dim, qparams).double()
    tol = 5 * scale.double() * se + 1e-6 * (1 + x.abs().double())
    assert bool(((values.mean(0) - x.double()).abs()[inside] <= tol[inside]).all())


def test_stochastic_fp16_neighbours_and_unbiased():
    gen = torch.Generator().manual_seed(5)
    dim = 32
    x = torch.randn(dim, generator=gen) * torch.exp(torch.randn(dim, generator=gen) * 4)
    x[:4] = torch.tensor([3e-8, -1e-7, 2.0**-24 * 0.5, 65503.0])  # subnormal range, near max
    x[4] = 1.0  # exact: never moves
    stored = draws(x, "fp16").view(torch.float16).float().double()
    n = stored.shape[0]
    a = x.abs()
    lo, hi = ref.fp16_neighbours(a)
    lo, hi = lo.double(), hi.double()
    sign = torch.where(torch.signbit(x), -1.0, 1.0).double()
    # the two neighbours only, adjacent binary16 values bracketing x, sign kept
    assert bool(((stored == sign * lo) | (stored == sign * hi)).all())
    assert bool(((lo <= a.double()) & (a.double() <= hi)).all())
    assert bool(((hi.half().view(torch.int16) - lo.half().view(torch.int16)) == 1).all())
    assert bool((stored[:, 4] == 1.0).all())
    p = (a.double() - lo) / (hi - lo)
    se = (hi - lo) * torch.sqrt(p * (1 - p) / n)
    err = (stored.mean(0) - x.double()).abs()
    assert bool((err <= 5 * se + 1e-12).all()), (err, se)
    mixed = (p > 0.1) & (p < 0.9)
    assert bool(mixed.sum() > dim // 2)
    assert bool((stored[:, mixed].std(0) > 0).all())


def test_stochastic_fp16_edges_equal_reference():
    """Stochastic binary16 rounding of every finite half, of the points halfway between
    neighbours and one float either side, and of values below 2^-24 and near 65504: the
    op's bytes (rows of 64, four lanes at a time) are the reference's."""
    h = all_finite_halves()
    mids = ((h[:-1].double() + h[1:].double()) / 2).float()
    beside = [torch.nextafter(mids, torch.tensor(v)) for v in (math.inf, 0.0)]
    tiny = torch.tensor([2.0**-25, 2.0**-26, 3 * 2.0**-26, 1e-30, 1.4e-45, 2.0**-24 * 0.999])
    x = torch.cat([h, mids, *beside, tiny, torch.tensor([65504.0, 65503.99, 65488.0])])
    rows = as_rows(torch.cat([x, -x]))
    ids = torch.arange(rows.shape[0], dtype=torch.int64)
    got = quantize(rows, "fp16", rounding="stochastic", seed=3, step=7, row_ids=ids)
    want = ref.quantize_rows(rows, ids, "fp16", "fp32", "stochastic", 3, 7, 0)
    assert_bytes_equal(got, want, "fp16 stochastic")


@pytest.mark.parametrize("precision", ("fp16",) + INT_PRECISIONS)
def test_stochastic_deterministic_and_keyed(precision):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=gen)
    ids = torch.tensor([5, 77, 2**31 - 2])
    args = dict(precision=precision, rounding="stochastic", row_ids=ids)
    base = quantize(x, seed=2**40 + 17, step=9, table=4, **args)
    assert torch.equal(base, quantize(x, seed=2**40 + 17, step=9, table=4, **args))
    variants = {
        "step": quantize(x, seed=2**40 + 17, step=10, table=4, **args),
        "seed": quantize(x, seed=2**40 + 18, step=9, table=4, **args),
        "seed high word": quantize(x, seed=2**41 + 17, step=9, table=4, **args),
        "table": quantize(x, seed=2**40 + 17, step=9, table=5, **args),
        "row": quantize(
            x,
            seed=2**40 + 17,
            step=9,
            table=4,
            precision=precision,
            rounding="stochastic",
            row_ids=ids + 1,
        ),
    }
    for what, other in variants.items():
        for r in range(3):
            assert not torch.equal(base[r], other[r]), (
                f"{precision}: same draw after changing the {what}"
            )
    # nearest ignores the stream
    n1 = quantize(x, precision, seed=1, step=1, table=1, row_ids=ids)
    assert torch.equal(n1, quantize(x, precision, seed=2, step=3, table=4, row_ids=ids + 9))


# ----------------------------------------------------------------------------- reference == op

FORMATS = [(p, "fp32") for p in BITS] + [(p, "fp16") for p in INT_PRECISIONS]


@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
@pytest.mark.parametrize("precision,qparams", FORMATS)
def test_reference_quantize_equals_op(precision, qparams, rounding):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{precision}{qparams}{rounding}".encode()))
    for dim in (1, 2, 3, 5, 7, 8, 13, 16, 33):
        fp16 = qparams == "fp16" or precision == "fp16"
        x = random_rows(gen, 40, dim, (-4.0, 2.5) if fp16 else (-8.0, 8.0), 10.0 if fp16 else 1e3)
        x[0] = 0.0
        x[1, :] = -1.25
        zeros = signed_zero_rows(dim)
        x[2 : 2 + zeros.shape[0]] = zeros
        ids = torch.randint(0, 2**62, (40,), generator=gen)
        seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        step = int(torch.randint(0, 2**40, (1,), generator=gen))
        table = int(torch.randint(0, 2**32, (1,), generator=gen))
        got = quantize(x, precision, qparams, rounding, seed, step, table, ids)
        want = ref.quantize_rows(x, ids, precision, qparams, rounding, seed, step, table)
        assert_bytes_equal(got, want, f"{precision} {qparams} {rounding} dim {dim}")
        assert_f32_bits_equal(
            dequantize(got, precision, dim, qparams),
            ref.dequantize_rows(got, precision, dim, qparams),
            "dequantized",
        )


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
@pytest.mark.parametrize("precision,qparams", FORMATS)
def test_non_finite_row_raises(precision, qparams, rounding):
    for bad in (math.nan, math.inf, -math.inf):
        for at in (0, 4):
            x = torch.randn(3, 5)
            x[1, at] = bad
            with pytest.raises(RuntimeError, match=f"row 1 cannot be stored in {BITS[precision]} "):
                quantize(x, precision, qparams, rounding, 1, 1, 1)
            with pytest.raises(
                ref.NotStorableError, match=f"row 1 cannot be stored as {precision}"
            ):
                ref.quantize_rows(x, range(3), precision, qparams, rounding, 1, 1, 1)


def test_int_range_overflow_raises():
    """A finite row whose range (max - min) overflows float32 cannot get a finite scale."""
    x = torch.tensor([[-3e38, 3e38, 0.0]])
    for prec in INT_PRECISIONS:
        with pytest.raises(RuntimeError, match=f"row 0 cannot be stored in {BITS[prec]} bits"):
            quantize(x, prec)
        with pytest.raises(ref.NotStorableError, match=f"row 0 cannot be stored as {prec}"):
            ref.quantize_rows(x, [0], prec)
    # fp16 qparams: a bias beyond the binary16 range
    y = torch.tensor([[-1e6, 0.0]])
    with pytest.raises(RuntimeError, match="row 0 cannot be stored in 8 bits"):
        quantize(y, "int8", "fp16")
    with pytest.raises(ref.NotStorableError, match="row 0 cannot be stored as int8"):
        ref.quantize_rows(y, [0], "int8", "fp16")


def test_reference_mutation_is_caught():
    """The reference comparisons can fail: a reference that draws from the wrong Philox
    stream disagrees with the op."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, generator=gen)
    good = ref.quantize_rows(x, range(4), "int8", rounding="stochastic", seed=1, step=2)
    orig = ref.uniforms
    try:
        ref.uniforms = lambda seed, step, table, row, dim: orig(seed, step + 1, table, row, dim)
        bad = ref.quantize_rows(x, range(4), "int8", rounding="stochastic", seed=1, step=2)
    finally:
        ref.uniforms = orig
    op = quantize(x, "int8", rounding="stochastic", seed=1, step=2)
    assert torch.equal(op, good) and not torch.equal(op, bad)


# Trains small tables of several formats and dims for a few steps, flushes, and prints a
# digest of every tensor of their state.
_TRAIN_AND_DIGEST = """
import hashlib, torch
from embcache import CachedLowPrecisionEmbedding
digest, gen = hashlib.sha256(), torch.Generator().manual_seed(0)
for precision, dim in (("int8", 16), ("fp16", 12), ("int8", 40), ("int4", 72)):
    m = CachedLowPrecisionEmbedding(3000, dim, precision=precision, rounding="stochastic",
                                    cache_ratio=0.05, associativity=8, policy="lfu", lr=0.5,
                                    seed=7, min_rows_for_low_precision=0)
    for _ in range(4):
        out = m(torch.randint(0, 3000, (256,), generator=gen), torch.arange(0, 256, 2))
        out.backward(torch.randn(out.shape, generator=gen))
        m.step()
    m.flush()
    for _, v in sorted(m.state_dict().items()):
        if isinstance(v, torch.Tensor):
            digest.update(v.contiguous().view(torch.uint8).numpy().tobytes())
print(digest.hexdigest())
"""


def _trained_digest(simd):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "EMBCACHE_SIMD"}
    if simd:
        env["EMBCACHE_SIMD"] = simd
    done = subprocess.run(
        [sys.executable, "-c", _TRAIN_AND_DIGEST],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


_SIMD_LEVELS = {1: "SSE4.1", 2: "AVX2", 3: "AVX-512F with VBMI2"}


def _widest_simd_path() -> int | None:
    """The path the CPU code takes with no EMBCACHE_SIMD cap, as csrc/include/embcache/
    random_stream.h picks it (simd_cap, has_avx2, has_fast_avx512): 3 with AVX-512F and
    AVX512-VBMI2, 2 with AVX2, 1 otherwise on x86-64 (setup.py builds with SSE4.2); 0 on
    other machines (portable loops only); None if the CPU's flags cannot be read."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return 0
    try:
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    flags = set(line.split(":", 1)[1].split())
    if "avx512f" in flags and {"avx512_vbmi2", "avx512vbmi2"} & flags:
        return 3
    return 2 if "avx2" in flags else 1


@pytest.mark.parametrize("simd,cap", [("sse", 1), ("avx2", 2)])
def test_every_simd_path_stores_the_same_bytes(simd, cap):
    """The update draws stochastic rounding's uniforms with SSE, AVX2 (two chunks or two rows
    per call) or AVX-512 (four rows per call), as the CPU allows; EMBCACHE_SIMD caps the
    choice, so each narrower path the CPU has must give the bytes of the widest. A cap at or
    above what the CPU has selects the widest path itself: nothing to compare, skipped."""
    widest = _widest_simd_path()
    if widest is None:
        pytest.skip("cannot read the CPU's flags from /proc/cpuinfo")
    if cap >= widest:
        pytest.skip(
            f"EMBCACHE_SIMD={simd} takes the path this CPU takes anyway "
            f"({_SIMD_LEVELS.get(widest, 'portable loops')}): it would compare a path with itself"
        )
    assert _trained_digest(simd) == _trained_digest(None)
