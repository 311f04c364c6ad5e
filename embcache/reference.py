"""A slow, plain PyTorch/Python reference of docs/contract.md §2-4: the test oracle of the kernels.

This module re-implements, independently of ``csrc/``, everything the C++ CPU kernels and
the CUDA kernels compute for one table:

* the row formats and their rounding (docs/contract.md §2-3): :func:`quantize_row` /
  :func:`dequantize_row`, nearest (round half to even) and stochastic rounding driven by
  :func:`philox4x32_10` (Random123's Philox4x32-10, checked against its known answers);
* the FP32 set-associative cache with LRU or LFU priorities, write-back, deduplicated
  gradients and the fused SGD / row-wise AdaGrad / AdaGrad update (docs/contract.md §4):
  :class:`ReferenceTable`, which holds the same state tensors, under the same names, as
  :class:`embcache.CachedLowPrecisionEmbedding`.

It is written for clarity, not speed: the docs/contract.md formulas as written, vectorized over rows only
where the order does not matter; every float32 operation a separate, rounded torch operation
(a multiply followed by an add is never fused); sums whose order matters (pooling, gradient
deduplication, row-wise AdaGrad's sum of squares) as explicit sequential loops; the float32
square root computed correctly rounded (:func:`sqrt_f32`, not ``torch.sqrt``). It shares no
code with the kernels. The tests require the kernels to agree with it bit for bit
(``tests/test_reference_vs_kernels.py``, ``tests/test_rounding.py``); a CUDA backend is to be
held to the same tests.

Where docs/contract.md is explicit the reference follows it: fp16 nearest rounding is
``tensor.half()`` for every finite result (65504 < |x| < 65520 rounds to 65504); only values
whose stored form could be non-finite are refused. A row whose scale is 0 gets codes 0; with
fp32 qparams the scale 0 is stored, with fp16 qparams 1.0 is stored (FBGEMM's SBHalf layout
does so, and docs/contract.md §2 asks for its bytes); the dequantized values are the same.

Conventions docs/design.md records, as chosen for the project (see the module docstrings):

* ``intK`` rows are ``ceil(dim*K/8)`` bytes of codes packed low bits first, then scale and bias
  (float32 little-endian, or binary16 with ``qparams="fp16"``); fp16 rows are ``dim`` binary16.
* Stochastic rounding of element ``j`` of row ``row`` at update ``step`` of table
  ``table_id``: Philox4x32-10 with key ``(seed & 0xffffffff, seed >> 32)`` and counter
  ``(j >> 2, row, step, table_id)`` (each & 0xffffffff), output word ``j & 3``,
  ``u = (word >> 8) * 2^-24``.
* The update being applied is step ``t = step_count + 1``; it keys the random stream and the
  LRU timestamps. ``flush()`` uses ``t = step_count``.
* ``cache_priority`` holds a resident's priority per slot (0 when empty): LRU its timestamp,
  LFU a copy of its row's count. The rule here reads LFU priorities from ``counts`` itself,
  so comparing ``cache_priority`` with the kernels checks that their copy stays true.
"""

from __future__ import annotations

import math
import sys

import torch

F32 = torch.float32
MASK32 = 0xFFFFFFFF
PRECISION_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4, "int2": 2}
FP16_MAX = 65504.0

assert sys.byteorder == "little", "the reference writes little-endian rows via tensor.view"


class NotStorableError(ValueError):
    """A row that cannot be stored: a non-finite value, or one whose stored form would not be
    finite (docs/contract.md §2: it is never written)."""


def f32(value) -> torch.Tensor:
    """A 0-d float32 tensor: Python floats enter the float32 arithmetic rounded once, here."""
    return torch.tensor(value, dtype=F32)


def sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (IEEE sqrtf).

    Not ``torch.sqrt`` on float32: on CPU (torch 2.13, AVX2) it is not correctly rounded
    (about 20% of random inputs are one ulp off). The square root of a float32 computed in
    float64 and rounded to float32 is the correctly rounded result (53 >= 2 * 24 + 2).
    """
    return torch.sqrt(x.to(torch.float64)).to(F32)


# ------------------------------------------------------------------------------ Philox4x32-10

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def philox4x32_10(counter, key) -> tuple[int, int, int, int]:
    """Random123's Philox4x32 with 10 rounds on Python integers.

    ``counter`` = 4 uint32 words, ``key`` = 2 uint32 words; returns the 4 output words.
    One round: ``(hi0, lo0) = M0 * c0``, ``(hi1, lo1) = M1 * c2`` (64-bit products),
    ``c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)``; the key is bumped by the Weyl constants
    between rounds.
    """
    c0, c1, c2, c3 = (int(c) & MASK32 for c in counter)
    k0, k1 = (int(k) & MASK32 for k in key)
    for rnd in range(10):
        if rnd > 0:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        p0 = PHILOX_M0 * c0
        p1 = PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
    return c0, c1, c2, c3


def uniforms(seed: int, step: int, table_id: int, row: int, dim: int) -> torch.Tensor:
    """The uniform numbers in [0, 1) of elements 0..dim-1 of a row (float32, exact)."""
    key = (seed & MASK32, (seed >> 32) & MASK32)
    out = []
    for block in range((dim + 3) // 4):
        words = philox4x32_10((block, row & MASK32, step & MASK32, table_id & MASK32), key)
        out.extend((w >> 8) * 2.0**-24 for w in words)
    return torch.tensor(out[:dim], dtype=F32)


# ------------------------------------------------------------------------------ row -> set


def murmur_fmix64(h: int) -> int:
    """The 64-bit MurmurHash3 finalizer (docs/contract.md §4)."""
    m = (1 << 64) - 1
    h &= m
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & m
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & m
    h ^= h >> 33
    return h


def set_of_row(row: int, num_sets: int) -> int:
    return murmur_fmix64(row) % num_sets


# ------------------------------------------------------------------------------ row formats


def payload_bytes(precision: str, dim: int) -> int:
    return math.ceil(dim * PRECISION_BITS[precision] / 8)


def qparam_bytes(precision: str, qparams: str = "fp32") -> int:
    if PRECISION_BITS[precision] > 8:
        return 0
    return 4 if qparams == "fp16" else 8


def row_bytes(precision: str, dim: int, qparams: str = "fp32") -> int:
    return payload_bytes(precision, dim) + qparam_bytes(precision, qparams)


def first_min(x: torch.Tensor) -> torch.Tensor:
    """Per row of x [n, dim]: min(row) as ``x[j] < m`` scanning from x[0] finds it, so that
    of two equal values (0.0 and -0.0) the first one is taken (as std::min_element)."""
    first = (x == x.amin(dim=1, keepdim=True)).to(torch.int32).argmax(dim=1, keepdim=True)
    return x.gather(1, first)[:, 0]


def first_max(x: torch.Tensor) -> torch.Tensor:
    first = (x == x.amax(dim=1, keepdim=True)).to(torch.int32).argmax(dim=1, keepdim=True)
    return x.gather(1, first)[:, 0]


def row_qparams(
    x: torch.Tensor, bits: int, qparams: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, bias, inv) of each row of x [n, dim], float32 [n] each, docs/contract.md §2:

    fp32: ``bias = min``, ``scale = (max - min) / Q``, ``inv = Q / (max - min + 1e-8)``;
    fp16: ``bias = fp16(min)``, ``scale = fp16((max - bias) / Q)``, ``inv = 1 / scale``
    (0 for a zero scale).
    """
    q = f32(2**bits - 1)
    mn, mx = first_min(x), first_max(x)
    if qparams == "fp16":
        bias = mn.half().float()
        scale = ((mx - bias) / q).half().float()
        inv = torch.where(scale == 0, f32(0.0), f32(1.0) / scale)
    else:
        rng = mx - mn
        bias = mn
        scale = rng / q
        inv = q / (rng + f32(1e-8))
    return scale, bias, inv


def storable(
    x: torch.Tensor, precision: str, qparams: str = "fp32", rounding: str = "nearest"
) -> torch.Tensor:
    """Per row of x [n, dim]: whether every value the row could be stored as is finite.

    docs/contract.md §2: a non-finite value is never written. fp16: the nearest binary16 (``x.half()``)
    must be finite, and for stochastic rounding both neighbours (so |x| <= 65504). Integer
    formats: the range and the scale and bias as stored must be finite.
    """
    x = x.to(F32)
    ok = torch.isfinite(x).all(dim=1)
    bits = PRECISION_BITS[precision]
    if bits == 16:
        if rounding == "stochastic":
            ok &= (x.abs() <= FP16_MAX).all(dim=1)
        else:
            ok &= torch.isfinite(x.half()).all(dim=1)
    elif bits <= 8 and x.shape[0] > 0:
        mn, mx = first_min(x), first_max(x)
        ok &= torch.isfinite(mx - mn)
        if qparams == "fp16":
            bias = mn.half()
            ok &= torch.isfinite(bias)
            ok &= torch.isfinite(((mx - bias.float()) / f32(2**bits - 1)).half())
    return ok


def check_storable(
    x: torch.Tensor, precision: str, qparams: str = "fp32", rounding: str = "nearest"
) -> None:
    """Raise :class:`NotStorableError` naming the first row of x [n, dim] that cannot be stored."""
    ok = storable(x, precision, qparams, rounding)
    if not bool(ok.all()):
        bad = int(torch.nonzero(~ok)[0])
        raise NotStorableError(
            f"row {bad} cannot be stored as {precision}: non-finite or out of range"
        )


def round_codes(y: torch.Tensor, q: int, rounding: str, u: torch.Tensor | None) -> torch.Tensor:
    """Integer codes of y (float32), clamped to [0, q]: nearest = half to even (torch.round);
    stochastic = floor(y) + 1 with probability y - floor(y) (``u < y - floor(y)``)."""
    if rounding == "nearest":
        r = torch.round(y)
    else:
        lo = torch.floor(y)
        r = torch.where(u < (y - lo), lo + 1, lo)
    return r.clamp(0, q).to(torch.uint8)


def stochastic_round_codes(y: torch.Tensor, u: torch.Tensor, q: int) -> torch.Tensor:
    return round_codes(y, q, "stochastic", u)


def fp16_neighbours(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a >= 0 (float32, finite), the binary16 values lo <= a <= hi, lo the largest binary16
    not above a and hi the next binary16 after lo (as float16 tensors)."""
    h = a.half()  # nearest; one of the two neighbours
    bits = h.view(torch.int16)
    lo_bits = torch.where(h.float() > a, bits - 1, bits)
    return lo_bits.view(torch.float16), (lo_bits + 1).view(torch.float16)


def stochastic_round_fp16(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """docs/contract.md §3 for binary16: magnitude hi with probability (|x| - lo) / (hi - lo), else lo;
    the sign of x is kept."""
    a = x.abs()
    lo, hi = fp16_neighbours(a)
    p = (a - lo.float()) / (hi.float() - lo.float())
    mag = torch.where(u < p, hi, lo)
    return torch.where(torch.signbit(x), -mag, mag)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [n, dim] -> bytes [n, ceil(dim*bits/8)]: element j goes to byte j // (8/bits) at
    bit offset (j % (8/bits)) * bits; unused high bits of the last byte are 0."""
    per = 8 // bits
    n, dim = codes.shape
    padded = torch.zeros(n, math.ceil(dim / per) * per, dtype=torch.int64)
    padded[:, :dim] = codes.to(torch.int64)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return (padded.view(n, -1, per) << shifts).sum(dim=2).to(torch.uint8)


def unpack_codes(payload: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """bytes [n, payload] -> codes int64 [n, dim] (inverse of :func:`pack_codes`)."""
    per = 8 // bits
    j = torch.arange(dim)
    byte = payload[:, j // per].to(torch.int64)
    return (byte >> ((j % per) * bits)) & (2**bits - 1)


def quantize_rows(
    values: torch.Tensor,
    row_ids,
    precision: str,
    qparams: str = "fp32",
    rounding: str = "nearest",
    seed: int = 0,
    step: int = 0,
    table_id: int = 0,
) -> torch.Tensor:
    """The stored bytes (uint8 ``[n, row_bytes]``) of the float32 rows ``values`` [n, dim]
    (the reference of ``torch.ops.embcache.quantize_rows``), docs/contract.md §2-3.

    ``seed, step, table_id`` and ``row_ids`` key the stochastic rounding (unused for nearest).
    Raises :class:`NotStorableError` if any row cannot be stored (nothing is returned).
    """
    x = values.detach().to(F32).contiguous()
    n, dim = x.shape
    row_ids = [int(r) for r in row_ids]
    check_storable(x, precision, qparams, rounding)
    bits = PRECISION_BITS[precision]
    stochastic = rounding == "stochastic"
    if bits == 32:
        return x.clone().view(torch.uint8)
    if stochastic:
        u = (
            torch.stack([uniforms(seed, step, table_id, r, dim) for r in row_ids])
            if n
            else x.clone()
        )
    if bits == 16:
        h = stochastic_round_fp16(x, u) if stochastic else x.half()
        return h.contiguous().view(torch.uint8)
    if n == 0:
        return torch.empty(0, row_bytes(precision, dim, qparams), dtype=torch.uint8)
    scale, bias, inv = row_qparams(x, bits, qparams)
    y = (x - bias[:, None]) * inv[:, None]
    codes = round_codes(y, 2**bits - 1, rounding, u if stochastic else None)
    qdtype = torch.float16 if qparams == "fp16" else F32
    if qparams == "fp16":  # a zero scale is stored as 1.0, as FBGEMM does (codes stay 0)
        scale = torch.where(scale == 0, f32(1.0), scale)
    tail = torch.stack([scale, bias], dim=1).to(qdtype).contiguous().view(torch.uint8)
    return torch.cat([pack_codes(codes, bits), tail], dim=1)


PROBE_EVERY = 32  # as csrc/include/embcache/rounding_probe.h: kProbeEvery
PROBE_COUNTERS = (
    "probed_rows",
    "probed_error_sum_e9",
    "probed_error_max_e9",
    "probed_up",
    "probed_down",
    "probed_expected_up_e6",
)


def rounding_probe(
    values: torch.Tensor, stored: torch.Tensor, precision: str, qparams: str, rounding: str
) -> dict:
    """The precision telemetry of rows ``values`` [n, dim] as ``stored`` [n, row_bytes] holds
    them (csrc/include/embcache/rounding_probe.h, the counters ``probed_*``): rows probed;
    per row the mean of ``|x - stored| / (max x - min x)`` (x 1e9, rounded), summed; the
    largest such element error (x 1e9); elements rounded up and down (binary16: to the
    neighbour above or below; integer codes: the code above or below ``(x - bias) * inv``);
    per row the sum of each element's chance of being rounded up (x 1e6, rounded; stochastic
    rounding only), summed. Rows of a constant value add no error."""
    bits = PRECISION_BITS[precision]
    n, dim = values.shape
    if bits == 32 or n == 0:
        return dict.fromkeys(PROBE_COUNTERS, 0)
    x = values.to(F32)
    v = dequantize_rows(stored, precision, dim, qparams)
    rng = first_max(x).double() - first_min(x).double()
    varying = rng > 0
    # element errors in float32 relative to the range, summed per row in float64
    per_range = torch.where(varying, 1.0 / rng, 1.0).float()
    e = (v - x).abs() * per_range[:, None]
    error_e9 = torch.floor((e.double().sum(dim=1) / dim) * 1e9 + 0.5).long()
    worst_e9 = torch.floor(e.amax(dim=1).double() * 1e9 + 0.5).long()
    if bits == 16:  # the neighbour above or below the value
        moved_up, moved_down = v > x, v < x
        a = x.abs()
        lo, hi = fp16_neighbours(a)
        away = (a.double() - lo.double()) / (hi.double() - lo.double())
        chance = torch.where(a == lo.float(), 0.0, torch.where(x > 0, away, 1.0 - away))
    else:  # the code above or below the value rounded, (x - bias) * inv
        _, bias, inv = row_qparams(x, bits, qparams)
        y = (x - bias[:, None]) * inv[:, None]
        codes = unpack_codes(stored[:, : payload_bytes(precision, dim)], bits, dim).to(F32)
        moved_up, moved_down = codes > y, codes < y
        below = torch.floor(y)
        chance = torch.where((y <= 0) | (below >= 2**bits - 1), 0.0, y - below).double()
    if rounding == "stochastic":
        expected_e6 = torch.floor(chance.sum(dim=1) * 1e6 + 0.5).long()
    else:
        expected_e6 = torch.zeros(n, dtype=torch.int64)
    return {
        "probed_rows": n,
        "probed_error_sum_e9": int(error_e9[varying].sum()),
        "probed_error_max_e9": int(worst_e9[varying].max()) if bool(varying.any()) else 0,
        "probed_up": int(moved_up.sum()),
        "probed_down": int(moved_down.sum()),
        "probed_expected_up_e6": int(expected_e6.sum()),
    }


def quantize_row(
    x: torch.Tensor,
    precision: str,
    qparams: str = "fp32",
    rounding: str = "nearest",
    seed: int = 0,
    step: int = 0,
    table_id: int = 0,
    row: int = 0,
) -> torch.Tensor:
    """The stored bytes (uint8 ``[row_bytes]``) of one float32 row x [dim]; ``row`` is its id."""
    return quantize_rows(
        x.reshape(1, -1), [row], precision, qparams, rounding, seed, step, table_id
    )[0]


def fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy with its own, row-major storage (so that .view() to a wider dtype is allowed)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def dequantize_rows(
    weights: torch.Tensor, precision: str, dim: int, qparams: str = "fp32"
) -> torch.Tensor:
    """float32 ``[n, dim]`` values of stored rows ``weights`` [n, row_bytes]:
    ``code * scale + bias`` (a multiply, then an add, each rounded) for integer formats."""
    w = fresh_copy(weights)  # own, aligned storage for the views below
    n = w.shape[0]
    bits = PRECISION_BITS[precision]
    if bits == 32:
        return w.view(F32).reshape(n, dim)
    if bits == 16:
        return w.view(torch.float16).reshape(n, dim).float()
    nb = payload_bytes(precision, dim)
    qdtype = torch.float16 if qparams == "fp16" else F32
    sb = fresh_copy(w[:, nb:]).view(qdtype).float()
    scale, bias = sb[:, 0:1], sb[:, 1:2]
    codes = unpack_codes(w[:, :nb], bits, dim)
    product = codes.to(F32) * scale
    return product + bias


def dequantize_row(
    stored: torch.Tensor, precision: str, dim: int, qparams: str = "fp32"
) -> torch.Tensor:
    """float32 ``[dim]`` values of one stored row."""
    return dequantize_rows(stored.reshape(1, -1), precision, dim, qparams)[0]


# ------------------------------------------------------------------------------ the table


class ReferenceTable:
    """One table as docs/contract.md §4 describes it, holding the state tensors of
    :class:`embcache.CachedLowPrecisionEmbedding` under the same names: ``weights``,
    ``cache_tags``, ``cache_rows``, ``cache_priority``, ``counts``, ``optimizer_state``,
    ``step_count`` (a Python int here).

    A training step is ``forward(indices, offsets, psw)``, ``backward(grad_out)``, ``step()``.
    ``offsets`` are nn.EmbeddingBag's: the start of each bag (the end is ``len(indices)``).
    """

    def __init__(self, config, weights: torch.Tensor) -> None:
        cfg = config
        self.config = cfg
        self.dim = cfg.embedding_dim
        self.num_rows = cfg.num_embeddings
        low_precision = cfg.num_embeddings >= cfg.min_rows_for_low_precision  # contract.md §4.4
        self.precision = cfg.precision if low_precision else "fp32"
        self.qparams = cfg.qparams
        self.rounding = cfg.rounding
        self.ways = cfg.associativity
        capacity = math.floor(cfg.cache_ratio * cfg.num_embeddings) if low_precision else 0
        capacity -= capacity % self.ways
        self.num_slots = capacity
        self.num_sets = capacity // self.ways
        self.lfu = cfg.policy == "lfu"
        width = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": self.dim}[cfg.optimizer]
        self.state_width = width
        expected = (self.num_rows, row_bytes(self.precision, self.dim, self.qparams))
        if tuple(weights.shape) != expected or weights.dtype != torch.uint8:
            raise ValueError(
                f"weights must be uint8 {expected}, got {weights.dtype} {tuple(weights.shape)}"
            )
        self.weights = weights.clone()
        self.cache_tags = torch.full((self.num_slots,), -1, dtype=torch.int32)
        self.cache_rows = torch.zeros(self.num_slots, self.dim, dtype=F32)
        self.cache_priority = torch.zeros(self.num_slots, dtype=torch.int32)
        has_counts = self.lfu and self.num_slots > 0
        self.counts = torch.zeros(self.num_rows if has_counts else 0, dtype=cfg.counts_dtype)
        self.optimizer_state = torch.zeros(self.num_rows * width, dtype=F32)
        self.step_count = 0
        self._stats = dict.fromkeys(
            (
                "lookups",
                "hits",
                "steps",
                "unique_rows",
                "unique_hits",
                "unique_misses",
                "insertions",
                "evictions",
                "bypasses",
                "flushed",
                *PROBE_COUNTERS,
            ),
            0,
        )
        self._saved = None
        self.pending = None  # (unique rows ascending, gradients, occurrences) after backward

    # ------------------------------------------------------------------ cache lookups

    def slot_of(self, row: int, tags: list | None = None) -> int:
        """The slot holding ``row`` (searched only in its own set), or -1."""
        if self.num_sets == 0:
            return -1
        tags = self.cache_tags.tolist() if tags is None else tags
        base = set_of_row(row, self.num_sets) * self.ways
        for way in range(self.ways):
            if tags[base + way] == row:
                return base + way
        return -1

    def stored_rows(self, rows: list) -> torch.Tensor:
        """The dequantized table copies of ``rows`` [n, dim] (stale for resident rows)."""
        return dequantize_rows(
            self.weights[torch.tensor(rows, dtype=torch.int64)],
            self.precision,
            self.dim,
            self.qparams,
        )

    def fetch_rows(self, rows: list, tags: list | None = None) -> tuple[torch.Tensor, list]:
        """(FP32 values [n, dim], resident? per row): the cache copy of a resident row, else
        the dequantized table row (docs/contract.md §4 step 1)."""
        tags = self.cache_tags.tolist() if tags is None else tags
        values = self.stored_rows(rows) if rows else torch.zeros(0, self.dim)
        resident = []
        for u, row in enumerate(rows):
            slot = self.slot_of(row, tags)
            if slot >= 0:
                values[u] = self.cache_rows[slot]
            resident.append(slot >= 0)
        return values, resident

    def current_weight(self) -> torch.Tensor:
        """The FP32 value of every row as a forward sees it (cache over table)."""
        out = dequantize_rows(self.weights, self.precision, self.dim, self.qparams)
        for slot, tag in enumerate(self.cache_tags.tolist()):
            if tag >= 0:
                out[tag] = self.cache_rows[slot]
        return out

    # ------------------------------------------------------------------ forward / backward

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        training: bool = True,
    ) -> tuple[torch.Tensor, int]:
        """Pooled bags [B, dim] and the number of lookups that found their row cached.

        Max: element-wise, the bag's first row, each element replaced by a later row's where
        that is greater (``>``: the first of equal values stays, a NaN only when it is first),
        and the lookup each element came from remembered for the backward; an empty bag is 0."""
        idx = indices.reshape(-1).tolist()
        starts = offsets.reshape(-1).tolist() + [len(idx)]
        psw = (
            None if per_sample_weights is None else per_sample_weights.detach().to(F32).reshape(-1)
        )
        mode = self.config.mode
        if psw is not None and mode != "sum":
            raise ValueError("per_sample_weights are only supported with mode='sum'")
        unique = sorted(set(idx))
        values, resident = self.fetch_rows(unique)
        value_of = {row: (values[u], resident[u]) for u, row in enumerate(unique)}
        nbags = len(starts) - 1
        out = torch.zeros(nbags, self.dim, dtype=F32)
        argmax = torch.full((nbags, self.dim), -1, dtype=torch.int64)  # max: each one's lookup
        hits = 0
        for b in range(nbags):
            acc = torch.zeros(self.dim, dtype=F32)  # 0.0, then each lookup added in order
            for j in range(starts[b], starts[b + 1]):
                v, hit = value_of[idx[j]]
                hits += hit
                if mode == "max":
                    take = (v > acc) | (j == starts[b])
                    acc = torch.where(take, v, acc)
                    argmax[b] = torch.where(take, j, argmax[b])
                else:
                    acc = acc + (psw[j] * v if psw is not None else v)
            n = starts[b + 1] - starts[b]
            if mode == "mean" and n > 0:
                acc = acc / f32(float(n))
            out[b] = acc
        if training:
            self._stats["lookups"] += len(idx)
            self._stats["hits"] += hits
            self._saved = (idx, starts, psw, argmax)
        return out, hits

    def backward(self, grad_out: torch.Tensor) -> None:
        """Deduplicated gradient of the last training forward (docs/contract.md §4 step 2): unique rows
        ascending; each row's gradient summed from 0.0 in increasing lookup position. Max: a
        lookup's contribution is its bag's gradient where the forward took the element from
        it, 0 elsewhere."""
        if self.pending is not None:
            raise RuntimeError("the reference supports one backward per step")
        idx, starts, psw, argmax = self._saved
        grad_out = grad_out.detach().to(F32)
        mode = self.config.mode
        bag_of = []
        for b in range(len(starts) - 1):
            bag_of.extend([b] * (starts[b + 1] - starts[b]))
        rows = sorted(set(idx))
        position = {r: u for u, r in enumerate(rows)}
        grads = [torch.zeros(self.dim, dtype=F32) for _ in rows]
        occ = [0] * len(rows)
        for j, row in enumerate(idx):  # lookup order = increasing position
            b = bag_of[j]
            if psw is not None:
                contrib = grad_out[b] * psw[j]
            elif mode == "max":
                contrib = torch.where(argmax[b] == j, grad_out[b], f32(0.0))
            elif mode == "mean":
                contrib = grad_out[b] / f32(float(starts[b + 1] - starts[b]))
            else:
                contrib = grad_out[b]
            u = position[row]
            grads[u] = grads[u] + contrib
            occ[u] += 1
        self.pending = (
            torch.tensor(rows, dtype=torch.int64),
            torch.stack(grads) if grads else torch.zeros(0, self.dim),
            torch.tensor(occ, dtype=torch.int64),
        )

    # ------------------------------------------------------------------ the update

    def _optimize(self, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor):
        """New values and optimizer state of the rows (v, g: [n, dim]; state [n, width])."""
        cfg = self.config
        lr, eps = f32(cfg.lr), f32(cfg.eps)
        if cfg.optimizer == "sgd":
            return v - lr * g, state
        if cfg.optimizer == "rowwise_adagrad":
            sum_sq = torch.zeros(v.shape[0], dtype=F32)
            for j in range(self.dim):  # sequential: g_0^2 + g_1^2 + ... in order
                sum_sq = sum_sq + g[:, j] * g[:, j]
            acc = state[:, 0] + sum_sq / f32(float(self.dim))
            step = lr / (sqrt_f32(acc) + eps)
            return v - step[:, None] * g, acc[:, None]
        acc = state + g * g
        return v - (lr / (sqrt_f32(acc) + eps)) * g, acc

    def _store(self, rows: list, values: list, step: int) -> None:
        """Round the FP32 rows down into the table (stream: their row ids at ``step``)."""
        if not rows:
            return
        cfg = self.config
        ids = torch.tensor(rows, dtype=torch.int64)
        x = torch.stack(values)
        self.weights[ids] = quantize_rows(
            x, rows, self.precision, self.qparams, self.rounding, cfg.seed, step, cfg.table_id
        )
        # the precision telemetry, on the rows (row + step) % PROBE_EVERY == 0 picks
        probed = (ids + step) % PROBE_EVERY == 0
        probe = rounding_probe(
            x[probed], self.weights[ids[probed]], self.precision, self.qparams, self.rounding
        )
        st = self._stats
        for name, value in probe.items():
            st[name] = max(st[name], value) if name == "probed_error_max_e9" else st[name] + value

    def _slot_priority(self, slot: int, tags: list):
        if tags[slot] < 0:
            return -math.inf
        return int(self.counts[tags[slot]]) if self.lfu else int(self.cache_priority[slot])

    def step(self) -> None:
        """Apply the pending gradient as update t = step_count + 1 (docs/contract.md §4 step 3)."""
        if self.pending is None:
            return
        rows_t, grads, occ_t = self.pending
        rows, occ = rows_t.tolist(), occ_t.tolist()
        n = len(rows)
        t = self.step_count + 1
        tags = self.cache_tags.tolist()
        slots = [self.slot_of(r, tags) for r in rows]
        fetched, _ = self.fetch_rows(rows, tags)
        w = self.state_width
        state = self.optimizer_state.view(-1, w)[rows_t] if w else torch.zeros(n, 0)
        new, new_state = self._optimize(fetched, grads.to(F32), state)
        check_storable(new, self.precision, self.qparams, self.rounding)  # else change nothing

        if w:
            self.optimizer_state.view(-1, w)[rows_t] = new_state
        if self.lfu and self.num_slots > 0:
            for r, o in zip(rows, occ):
                self.counts[r] = min(int(self.counts[r]) + o, torch.iinfo(self.counts.dtype).max)

        to_store_rows, to_store_values = [], []  # each row is written at most once per step

        def store(row, value):
            to_store_rows.append(row)
            to_store_values.append(value.clone())

        hits = insertions = evictions = bypasses = 0
        if self.num_sets == 0:
            for u, r in enumerate(rows):
                store(r, new[u])
            bypasses = n
        else:
            by_set: dict[int, list[int]] = {}
            for u, r in enumerate(rows):
                by_set.setdefault(set_of_row(r, self.num_sets), []).append(u)

            def cand_priority(u):
                return int(self.counts[rows[u]]) if self.lfu else t

            for s in sorted(by_set):
                candidates = []
                for u in by_set[s]:
                    if slots[u] >= 0:  # a resident: stays, with its new value and priority
                        self.cache_rows[slots[u]] = new[u]
                        self.cache_priority[slots[u]] = cand_priority(u)
                        hits += 1
                    else:
                        candidates.append(u)

                # candidates by priority descending, ties smaller row id first
                candidates.sort(key=lambda u: (-cand_priority(u), rows[u]))
                # slots by priority ascending (empty = -inf), ties lower way first
                base = s * self.ways
                prio = [self._slot_priority(base + way, tags) for way in range(self.ways)]
                order = sorted(range(self.ways), key=lambda way: (prio[way], way))
                for k, u in enumerate(candidates):
                    if k < self.ways and cand_priority(u) > prio[order[k]]:
                        slot = base + order[k]
                        old = tags[slot]
                        if old >= 0:  # write-back of the evicted row
                            store(old, self.cache_rows[slot])
                            evictions += 1
                        tags[slot] = rows[u]
                        self.cache_tags[slot] = rows[u]
                        self.cache_rows[slot] = new[u]
                        self.cache_priority[slot] = cand_priority(u)
                        insertions += 1
                    else:  # bypass: the new value goes straight to the table
                        store(rows[u], new[u])
                        bypasses += 1
        assert len(set(to_store_rows)) == len(to_store_rows)
        self._store(to_store_rows, to_store_values, t)
        self.step_count = t
        self.pending = None
        self.last_step_counts = [hits, n - hits, insertions, evictions, bypasses]
        st = self._stats
        st["steps"] += 1
        st["unique_rows"] += n
        st["unique_hits"] += hits
        st["unique_misses"] += n - hits
        st["insertions"] += insertions
        st["evictions"] += evictions
        st["bypasses"] += bypasses

    def flush(self) -> int:
        """Round every cached row into the table (stream step = step_count), empty the cache."""
        resident = [(slot, tag) for slot, tag in enumerate(self.cache_tags.tolist()) if tag >= 0]
        self._store(
            [tag for _, tag in resident],
            [self.cache_rows[slot].clone() for slot, _ in resident],
            self.step_count,
        )
        written = len(resident)
        self.cache_tags.fill_(-1)
        self.cache_rows.zero_()
        self.cache_priority.zero_()
        self._stats["flushed"] += written
        return written

    def stats(self) -> dict:
        s = dict(self._stats)
        s["misses"] = s["lookups"] - s["hits"]
        s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        return s
