// Row formats and their rounding (docs/contract.md §2-3), and the set hash of the cache
// (§4.1), written once for C++ and CUDA (csrc/include/embcache/portable.h). Stored rows are
// little-endian (every target of this project is).
#pragma once

#include "embcache/portable.h"
#include "embcache/random_stream.h"

namespace embcache {

// ---------------------------------------------------------------------------------------
// Bit casts and IEEE binary16
// ---------------------------------------------------------------------------------------

EMBCACHE_HD uint32_t float_bits(float f) {
  union { float f; uint32_t u; } v;
  v.f = f;
  return v.u;
}

EMBCACHE_HD float bits_float(uint32_t u) {
  union { float f; uint32_t u; } v;
  v.u = u;
  return v.f;
}

EMBCACHE_HD bool is_finite(float f) { return (float_bits(f) & 0x7f800000u) != 0x7f800000u; }

/// binary16 bits -> float (exact).
EMBCACHE_HD float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    const float mag = (float)man * 5.9604644775390625e-8f;
    return bits_float(float_bits(mag) | sign);
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

/// float -> binary16 bits, magnitude truncated toward zero (|f| must be < 65536 and finite).
EMBCACHE_HD uint16_t half_bits_toward_zero(uint32_t abs_bits) {
  if (abs_bits < 0x33800000u) return 0;  // |f| < 2^-24: below the smallest subnormal
  if (abs_bits < 0x38800000u) {           // subnormal half: floor(|f| * 2^24)
    const uint32_t exp = abs_bits >> 23;
    const uint32_t man = (abs_bits & 0x7fffffu) | 0x800000u;
    return (uint16_t)(man >> (126u - exp));
  }
  const uint32_t exp = (abs_bits >> 23) - 112u;
  return (uint16_t)((exp << 10) | ((abs_bits & 0x7fffffu) >> 13));
}

/// float -> binary16 bits, round to nearest even (what `tensor.half()` does).
EMBCACHE_HD uint16_t float_to_half_rn(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (a < 0x33000000u) return sign;             // < 2^-25 rounds to zero
  uint32_t q, rem, half;
  if (a < 0x38800000u) {
    const uint32_t exp = a >> 23;
    const uint32_t man = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;
    q = man >> shift;
    rem = man & ((1u << shift) - 1u);
    half = 1u << (shift - 1u);
  } else {
    q = (((a >> 23) - 112u) << 10) | ((a & 0x7fffffu) >> 13);
    rem = a & 0x1fffu;
    half = 0x1000u;
  }
  if (rem > half || (rem == half && (q & 1u))) q += 1u;  // a carry moves into the exponent
  return sign | (uint16_t)q;
}

/// 64-bit MurmurHash3 finalizer: row -> set.
EMBCACHE_HD uint64_t murmur_fmix64(uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h;
}

/// The high 64 bits of a * b.
EMBCACHE_HD uint64_t mul_hi64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return (uint64_t)(((unsigned __int128)a * b) >> 64);
#endif
}

/// A table's set count d as a divisor: rem(x) == x % d for every uint64 x (d >= 1), by a
/// multiply and shifts (Granlund and Montgomery, "Division by invariant integers using
/// multiplication", 1994: the round-up method, whose 65-bit multiplier for some d is kept as
/// its low 64 bits and an add step). A 64-bit `%` is a long instruction sequence on a GPU,
/// and every lookup's chain of loads waits for one. d == 0: a table without a cache.
struct SetDivisor {
  uint64_t d = 0;
  uint64_t magic = 0;  // 0: d is a power of two, x / d == x >> shift
  uint32_t shift = 0;
  bool add = false;  // the multiplier is 2^64 + magic

  static SetDivisor of(uint64_t d) {
    SetDivisor v;
    v.d = d;
    if (d == 0) return v;
    uint32_t l = 0;  // floor(log2(d))
    while (l < 63 && (d >> (l + 1)) != 0) ++l;
    v.shift = l;
    if ((d & (d - 1)) == 0) return v;
    // 2^l < d < 2^(l+1): m = floor(2^(64+l) / d) < 2^64, r its remainder
    const unsigned __int128 p = (unsigned __int128)1 << (64 + l);
    const uint64_t m = (uint64_t)(p / d), r = (uint64_t)(p % d);
    if (d - r < (uint64_t(1) << l)) {
      v.magic = m + 1;  // ceil(2^(64+l) / d): exact for every 64-bit x
    } else {  // ceil(2^(65+l) / d) - 2^64 = 2m + 1 - 2^64 (r <= d - 2^l < d / 2), plus x
      v.magic = 2 * m + 1;
      v.add = true;
    }
    return v;
  }

  EMBCACHE_HD uint64_t quotient(uint64_t x) const {
    if (magic == 0) return x >> shift;
    const uint64_t t = mul_hi64(magic, x);
    return add ? (((x - t) >> 1) + t) >> shift : t >> shift;
  }

  EMBCACHE_HD uint64_t rem(uint64_t x) const { return x - quotient(x) * d; }
};

/// The set of `row` in a cache of sets.d sets (sets.d >= 1): murmur_fmix64(row) % sets.d.
EMBCACHE_HD int64_t set_of_row(int64_t row, const SetDivisor& sets) {
  return (int64_t)sets.rem(murmur_fmix64((uint64_t)row));
}

// ---------------------------------------------------------------------------------------
// Row formats (docs/contract.md §2)
// ---------------------------------------------------------------------------------------

/// One table's row layout. `bits` is 32 (fp32), 16 (fp16), 8, 4 or 2 (integer codes).
/// Integer rows are [codes packed low bits first | scale | bias], scale and bias float32
/// (8 bytes) or, with qparams_fp16, binary16 (4 bytes): FBGEMM's fused row-wise layouts.
struct RowFormat {
  int bits;
  int dim;
  bool qparams_fp16;

  EMBCACHE_HD bool is_int() const { return bits <= 8; }
  EMBCACHE_HD int payload_bytes() const {
    return bits == 32 ? 4 * dim : bits == 16 ? 2 * dim : (dim * bits + 7) / 8;
  }
  EMBCACHE_HD int qparam_bytes() const { return is_int() ? (qparams_fp16 ? 4 : 8) : 0; }
  EMBCACHE_HD int row_bytes() const { return payload_bytes() + qparam_bytes(); }
};

// Unaligned little-endian loads and stores (rows of odd byte lengths are not aligned).
EMBCACHE_HD float load_f32(const uint8_t* p) {
  float f;
  memcpy(&f, p, 4);
  return f;
}

EMBCACHE_HD void store_f32(uint8_t* p, float f) { memcpy(p, &f, 4); }

EMBCACHE_HD uint16_t load_u16(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return h;
}

EMBCACHE_HD void store_u16(uint8_t* p, uint16_t h) { memcpy(p, &h, 2); }

/// A value of type T loaded from, or stored to, an address aligned to T: one word access on
/// a GPU, where memcpy from a byte pointer compiles to one access per byte; memcpy on the host
/// (x86-64 and AArch64 are little-endian, as the GPU is). An fp32 or fp16 table's rows are
/// aligned to their values (its weights start at a 16-byte boundary, csrc/tables.h).
template <class T>
EMBCACHE_HD T load_aligned(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const T*>(p);
#else
  T v;
  memcpy(&v, p, sizeof v);
  return v;
#endif
}
template <class T>
EMBCACHE_HD void store_aligned(uint8_t* p, T v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<T*>(p) = v;
#else
  memcpy(p, &v, sizeof v);
#endif
}

/// The row's scale and bias as floats.
EMBCACHE_HD void load_qparams(const RowFormat& f, const uint8_t* row, float* scale,
                              float* bias) {
  const uint8_t* q = row + f.payload_bytes();
  if (f.qparams_fp16) {
    *scale = half_to_float(load_u16(q));
    *bias = half_to_float(load_u16(q + 2));
  } else {
    *scale = load_f32(q);
    *bias = load_f32(q + 4);
  }
}

/// log2 of the codes per byte: 0 (int8), 1 (int4), 2 (int2). Shifts, not divisions.
EMBCACHE_HD int log2_codes_per_byte(int bits) { return bits == 8 ? 0 : bits == 4 ? 1 : 2; }

EMBCACHE_HD int load_code(const RowFormat& f, const uint8_t* row, int j) {
  const int lg = log2_codes_per_byte(f.bits);
  const int shift = (j & ((1 << lg) - 1)) * f.bits;
  return (row[j >> lg] >> shift) & ((1 << f.bits) - 1);
}

/// Element j of a stored row, as float32.
EMBCACHE_HD float dequantize_element(const RowFormat& f, const uint8_t* row, int j,
                                     float scale, float bias) {
  if (f.bits == 32) return load_aligned<float>(row + 4 * j);
  if (f.bits == 16) return half_to_float(load_aligned<uint16_t>(row + 2 * j));
  return (float)load_code(f, row, j) * scale + bias;
}

#if defined(EMBCACHE_SSE)
/// half_to_float of four binary16 values, one per 32-bit lane: the same bits for every
/// input, NaN payloads included.
inline __m128 halves_to_float(__m128i h) {
  const __m128i exp_man = _mm_and_si128(h, _mm_set1_epi32(0x7fff));
  const __m128i exp = _mm_and_si128(h, _mm_set1_epi32(0x7c00));
  const __m128i rebias = _mm_set1_epi32(112 << 23);
  // normal: the exponent rebiased by 112; infinity and NaN: by 112 twice, to 255
  __m128i mag = _mm_add_epi32(_mm_slli_epi32(exp_man, 13), rebias);
  mag = _mm_add_epi32(mag, _mm_and_si128(_mm_cmpeq_epi32(exp, _mm_set1_epi32(0x7c00)), rebias));
  // zero and subnormal: man * 2^-24, exact in float
  const __m128 tiny = _mm_mul_ps(_mm_cvtepi32_ps(exp_man), _mm_set1_ps(5.9604644775390625e-8f));
  const __m128 is_tiny = _mm_castsi128_ps(_mm_cmpeq_epi32(exp, _mm_setzero_si128()));
  const __m128 m = _mm_blendv_ps(_mm_castsi128_ps(mag), tiny, is_tiny);
  const __m128i sign = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
  return _mm_or_ps(m, _mm_castsi128_ps(sign));
}

/// halves_to_float of the four binary16 values at p.
inline __m128 half4_to_float(const uint8_t* p) {
  int64_t packed;
  memcpy(&packed, p, 8);
  return halves_to_float(_mm_cvtepu16_epi32(_mm_cvtsi64_si128(packed)));
}

/// float_to_half_rn on four lanes (one binary16 value per 32-bit lane): the same bits for
/// every input. Rounding is explicit (_mm_round_ps), so the MXCSR mode does not matter.
inline __m128i float4_to_half_rn(__m128 x) {
  const __m128i b = _mm_castps_si128(x);
  const __m128i sign = _mm_and_si128(_mm_srli_epi32(b, 16), _mm_set1_epi32(0x8000));
  const __m128i a = _mm_and_si128(b, _mm_set1_epi32(0x7fffffff));
  // normal: nearest-even at bit 13 as an add (a carry moves into the exponent), rebiased
  const __m128i lsb = _mm_and_si128(_mm_srli_epi32(a, 13), _mm_set1_epi32(1));
  const __m128i rounded = _mm_add_epi32(_mm_add_epi32(a, _mm_set1_epi32(0xfff)), lsb);
  __m128i h = _mm_sub_epi32(_mm_srli_epi32(rounded, 13), _mm_set1_epi32(112 << 10));
  // below 2^-14 (zero and subnormal results): rint(|x| * 2^24), exact scaling
  const __m128 scaled = _mm_mul_ps(_mm_castsi128_ps(a), _mm_set1_ps(16777216.f));
  const __m128i tiny = _mm_cvttps_epi32(
      _mm_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  h = _mm_blendv_epi8(h, tiny, _mm_cmplt_epi32(a, _mm_set1_epi32(0x38800000)));
  h = _mm_blendv_epi8(h, _mm_set1_epi32(0x7c00), _mm_cmpgt_epi32(a, _mm_set1_epi32(0x477fefff)));
  h = _mm_blendv_epi8(h, _mm_set1_epi32(0x7e00), _mm_cmpgt_epi32(a, _mm_set1_epi32(0x7f800000)));
  return _mm_or_si128(h, sign);
}

/// sign | half_stochastic_magnitude(|x|, u) on four lanes (|x| <= 65504 and finite, u in
/// [0, 1)): the same bits. The magnitude truncated toward zero is lo; x == lo exactly gives
/// p == 0, which no u is below, so that case needs no branch.
inline __m128i half4_stochastic(__m128 x, __m128 u) {
  const __m128i b = _mm_castps_si128(x);
  const __m128i sign = _mm_and_si128(_mm_srli_epi32(b, 16), _mm_set1_epi32(0x8000));
  const __m128i a = _mm_and_si128(b, _mm_set1_epi32(0x7fffffff));
  const __m128 ax = _mm_castsi128_ps(a);
  __m128i lo = _mm_sub_epi32(_mm_srli_epi32(a, 13), _mm_set1_epi32(112 << 10));
  const __m128i tiny = _mm_cvttps_epi32(_mm_mul_ps(ax, _mm_set1_ps(16777216.f)));  // floor
  lo = _mm_blendv_epi8(lo, tiny, _mm_cmplt_epi32(a, _mm_set1_epi32(0x38800000)));
  const __m128 lo_f = halves_to_float(lo);
  const __m128i next = _mm_add_epi32(lo, _mm_set1_epi32(1));
  const __m128 hi_f = _mm_blendv_ps(halves_to_float(next), _mm_set1_ps(65536.f),
                                    _mm_castsi128_ps(_mm_cmpeq_epi32(lo, _mm_set1_epi32(0x7bff))));
  const __m128 p = _mm_div_ps(_mm_sub_ps(ax, lo_f), _mm_sub_ps(hi_f, lo_f));
  const __m128i up = _mm_castps_si128(_mm_cmplt_ps(u, p));  // all ones: round up
  return _mm_or_si128(_mm_sub_epi32(lo, up), sign);
}

/// The codes of elements j .. j + 3 of an integer row of `bits` bits (j a multiple of 4), as
/// load_code reads them.
inline __m128i load_codes4(int bits, const uint8_t* row, int j) {
  if (bits == 8) {
    int32_t codes;
    memcpy(&codes, row + j, 4);
    return _mm_cvtepu8_epi32(_mm_cvtsi32_si128(codes));
  }
  // lane k holds packed >> (k * bits), computed as packed * 2^((3 - k) * bits) >> (3 * bits):
  // packed < 2^(4 * bits), so no product overflows
  const uint32_t packed = bits == 4 ? load_u16(row + (j >> 1)) : row[j >> 2];
  const __m128i spread =
      bits == 4 ? _mm_setr_epi32(1 << 12, 1 << 8, 1 << 4, 1) : _mm_setr_epi32(1 << 6, 1 << 4, 1 << 2, 1);
  const __m128i lanes = _mm_mullo_epi32(_mm_set1_epi32((int32_t)packed), spread);
  return _mm_and_si128(_mm_srl_epi32(lanes, _mm_cvtsi32_si128(3 * bits)),
                       _mm_set1_epi32((1 << bits) - 1));
}
#endif

/// The values of a stored row of kBits bits (32, 16, or an integer format whose scale and
/// bias the caller loads), as dequantize_element computes them: at(j) one at a time and, where
/// SSE is there, at4(j) elements j .. j + 3 (j a multiple of 4), with the same roundings.
template <int kBits>
struct RowValues {
  const uint8_t* p;
  float scale = 1.f, bias = 0.f;

  EMBCACHE_HD float at(int j) const {
    if (kBits == 32) return load_f32(p + 4 * j);
    if (kBits == 16) return half_to_float(load_u16(p + 2 * j));
    return (float)load_code(RowFormat{kBits, 0, false}, p, j) * scale + bias;
  }
#if defined(EMBCACHE_SSE)
  __m128 at4(int j) const {
    if (kBits == 32) return _mm_loadu_ps((const float*)(p + 4 * j));
    if (kBits == 16) return half4_to_float(p + 2 * j);
    const __m128 x = _mm_cvtepi32_ps(load_codes4(kBits, p, j));
    return _mm_add_ps(_mm_mul_ps(x, _mm_set1_ps(scale)), _mm_set1_ps(bias));
  }
#endif
};

/// RowValues of `row`, a stored row of format f (f.bits == kBits), its qparams loaded.
template <int kBits>
EMBCACHE_HD RowValues<kBits> row_values(const RowFormat& f, const uint8_t* row) {
  RowValues<kBits> v{row};
  if (kBits <= 8) load_qparams(f, row, &v.scale, &v.bias);
  return v;
}

/// Calls fn(values_of) once, with values_of(row) the RowValues of a stored row of format f:
/// the format's branch taken here, outside fn's loops.
template <typename Fn>
EMBCACHE_HD void with_row_values(const RowFormat& f, const Fn& fn) {
  switch (f.bits) {
    case 32: return fn([f](const uint8_t* row) { return row_values<32>(f, row); });
    case 16: return fn([f](const uint8_t* row) { return row_values<16>(f, row); });
    case 8: return fn([f](const uint8_t* row) { return row_values<8>(f, row); });
    case 4: return fn([f](const uint8_t* row) { return row_values<4>(f, row); });
    default: return fn([f](const uint8_t* row) { return row_values<2>(f, row); });
  }
}

/// out[0..dim) = the stored row as float32.
EMBCACHE_HD void dequantize_row(const RowFormat& f, const uint8_t* row, float* out) {
  if (f.bits == 32) {
    memcpy(out, row, 4 * (size_t)f.dim);
    return;
  }
  with_row_values(f, [&](const auto& values_of) {
    const auto v = values_of(row);
    int j = 0;
#if defined(EMBCACHE_SSE)
    for (; j + 4 <= f.dim; j += 4) _mm_storeu_ps(out + j, v.at4(j));
#endif
    for (; j < f.dim; ++j) out[j] = v.at(j);
  });
}

/// Whether a float32 row can be stored in format f: every value finite and, for fp16,
/// finite after rounding (nearest: |x| < 65520, what `tensor.half()` keeps finite;
/// stochastic: |x| <= 65504, since a value above could round up to infinity); for integer
/// rows a finite range and, with fp16 qparams, a finite binary16 bias and scale.
EMBCACHE_HD bool row_is_storable(const RowFormat& f, const float* x, bool stochastic) {
  const float fp16_limit = stochastic ? 65504.f : 65519.996f;  // largest float below 65520
  float mn = x[0], mx = x[0];
  for (int j = 0; j < f.dim; ++j) {
    if (!is_finite(x[j])) return false;
    if (f.bits == 16 && (x[j] > fp16_limit || x[j] < -fp16_limit)) return false;
    mn = x[j] < mn ? x[j] : mn;
    mx = x[j] > mx ? x[j] : mx;
  }
  if (f.is_int()) {
    if (!is_finite(mx - mn)) return false;
    if (f.qparams_fp16) {  // binary16 bias and scale must be finite
      const uint16_t bias_h = float_to_half_rn(mn);
      if ((bias_h & 0x7c00u) == 0x7c00u) return false;
      const float scale = (mx - half_to_float(bias_h)) / (float)((1 << f.bits) - 1);
      if ((float_to_half_rn(scale) & 0x7c00u) == 0x7c00u) return false;
    }
  }
  return true;
}

/// The smallest and largest of the finite x[0..n), as the loops mn = x[j] < mn ? x[j] : mn
/// and mx = x[j] > mx ? x[j] : mx from x[0] find them: of equal zeros, the first one.
EMBCACHE_HD void row_min_max(const float* x, int n, float* min_out, float* max_out) {
  float mn = x[0], mx = x[0];
#if defined(EMBCACHE_SSE)
  if (n >= 8) {  // four lanes, each by the same rule (minps(a, b) = a < b ? a : b)
    __m128 vmn = _mm_loadu_ps(x), vmx = vmn;
    int j = 4;
    for (; j + 4 <= n; j += 4) {
      const __m128 v = _mm_loadu_ps(x + j);
      vmn = _mm_min_ps(v, vmn);
      vmx = _mm_max_ps(v, vmx);
    }
    float lane_mn[4], lane_mx[4];
    _mm_storeu_ps(lane_mn, vmn);
    _mm_storeu_ps(lane_mx, vmx);
    mn = lane_mn[0];
    mx = lane_mx[0];
    for (int k = 1; k < 4; ++k) {
      mn = lane_mn[k] < mn ? lane_mn[k] : mn;
      mx = lane_mx[k] > mx ? lane_mx[k] : mx;
    }
    for (; j < n; ++j) {
      mn = x[j] < mn ? x[j] : mn;
      mx = x[j] > mx ? x[j] : mx;
    }
    // Any order finds the same non-zero extremes; which zero comes first needs the loop.
    if (mn != 0.f && mx != 0.f) {
      *min_out = mn;
      *max_out = mx;
      return;
    }
    mn = mx = x[0];
  }
#endif
  for (int j = 1; j < n; ++j) {
    mn = x[j] < mn ? x[j] : mn;
    mx = x[j] > mx ? x[j] : mx;
  }
  *min_out = mn;
  *max_out = mx;
}

/// Round x >= 0 (as bits, < 65536) to one of its binary16 neighbours with probability
/// proportional to closeness (docs/contract.md §3): hi with probability (x - lo) / (hi - lo).
EMBCACHE_HD uint16_t half_stochastic_magnitude(uint32_t abs_bits, float u) {
  const uint16_t lo = half_bits_toward_zero(abs_bits);
  const float x = bits_float(abs_bits);
  const float lo_f = half_to_float(lo);
  if (x == lo_f) return lo;
  const float hi_f = lo == 0x7bffu ? 65536.f : half_to_float((uint16_t)(lo + 1));
  const float p = (x - lo_f) / (hi_f - lo_f);
  return u < p ? (uint16_t)(lo + 1) : lo;
}

/// Round y to an integer code in [0, q_max]: nearest-even, or stochastic with uniform u.
/// Written as selects, not branches: stochastic decisions are coin flips to a predictor.
EMBCACHE_HD int round_code(float y, bool stochastic, float u, int q_max) {
  float r;
  if (stochastic) {
    const float near = rintf(y);
    const float lo = near - (float)(near > y);  // floor(y), in a form compilers vectorize
    r = lo + (float)(u < y - lo);
  } else {
    r = rintf(y);
  }
  r = r > 0.f ? r : 0.f;  // also maps NaN to 0 (maxss)
  r = r < (float)q_max ? r : (float)q_max;  // (minss)
  return (int)r;
}

/// An integer row's quantization parameters, from its extremes mn and mx: the scale and bias
/// its codes decode with, and inv, what the codes are computed with ((x - bias) * inv).
/// With fp16 qparams scale and bias are binary16 (scale_h, bias_h); a zero scale (a constant
/// row, or a range below the smallest half) gives all codes 0 and is stored as 1.0, as
/// FBGEMM's SBHalf layout does: the values are the same.
struct RowQparams {
  float scale, bias, inv;
  uint16_t scale_h, bias_h;
};

EMBCACHE_HD RowQparams row_qparams(const RowFormat& f, float mn, float mx) {
  const int q_max = (1 << f.bits) - 1;
  RowQparams qp{0.f, 0.f, 0.f, 0, 0};
  if (f.qparams_fp16) {
    qp.bias_h = float_to_half_rn(mn);
    qp.bias = half_to_float(qp.bias_h);
    qp.scale_h = float_to_half_rn((mx - qp.bias) / (float)q_max);
    qp.scale = half_to_float(qp.scale_h);
    qp.inv = qp.scale == 0.f ? 0.f : 1.f / qp.scale;
  } else {
    const float range = mx - mn;
    qp.bias = mn;
    qp.scale = range / (float)q_max;
    qp.inv = (float)q_max / (range + 1e-8f);
  }
  return qp;
}

/// Writes qp at q (the row's bytes after its codes), in f's layout.
EMBCACHE_HD void store_qparams(const RowFormat& f, const RowQparams& qp, uint8_t* q) {
  if (f.qparams_fp16) {
    store_u16(q, qp.scale == 0.f ? (uint16_t)0x3c00u : qp.scale_h);
    store_u16(q + 2, qp.bias_h);
  } else {
    store_f32(q, qp.scale);
    store_f32(q + 4, qp.bias);
  }
}

/// Store the float32 row x into `row` in format f, rounding as asked. Requires
/// row_is_storable(f, x, stochastic). `row_id` and `stream` key the stochastic rounding (docs/contract.md §3);
/// `drawn`, if given, holds the row's first 16 uniforms, already drawn from them.
EMBCACHE_HD void quantize_row(const RowFormat& f, const float* x, bool stochastic,
                              const RoundingStream& stream, int64_t row_id, uint8_t* row,
                              const float* drawn = nullptr) {
  if (f.bits == 32) {
    for (int j = 0; j < f.dim; ++j) store_f32(row + 4 * j, x[j]);
    return;
  }
  RowUniforms uniforms{stream, row_id, f.dim};
  if (drawn) uniforms.set_first_chunk(drawn);
  const float* u = nullptr;  // with stochastic rounding, the uniforms of elements j0 .. j0 + 15
  if (f.bits == 16) {
    int j = 0;
#if defined(EMBCACHE_SSE)
    for (; j + 4 <= f.dim; j += 4) {
      if (stochastic && (j & 15) == 0) u = uniforms.chunk(j >> 4);
      const __m128 v = _mm_loadu_ps(x + j);
      const __m128i h =
          stochastic ? half4_stochastic(v, _mm_loadu_ps(u + (j & 15))) : float4_to_half_rn(v);
      _mm_storel_epi64((__m128i*)(row + 2 * j), _mm_packus_epi32(h, h));
    }
#endif
    for (; j < f.dim; ++j) {
      uint16_t h;
      if (stochastic) {
        if ((j & 15) == 0) u = uniforms.chunk(j >> 4);
        const uint32_t b = float_bits(x[j]);
        h = (uint16_t)((b >> 16) & 0x8000u) | half_stochastic_magnitude(b & 0x7fffffffu, u[j & 15]);
      } else {
        h = float_to_half_rn(x[j]);
      }
      store_u16(row + 2 * j, h);
    }
    return;
  }
  const int q_max = (1 << f.bits) - 1;
  float mn, mx;
  row_min_max(x, f.dim, &mn, &mx);
  const RowQparams qp = row_qparams(f, mn, mx);
  const float bias = qp.bias, inv = qp.inv;
  store_qparams(f, qp, row + f.payload_bytes());
  // 16 elements at a time: their uniforms first (4 Philox blocks), then a loop the compiler
  // can vectorize.
  const int lg = log2_codes_per_byte(f.bits);
  if (lg > 0)
    for (int b = 0; b < f.payload_bytes(); ++b) row[b] = 0;
  int code[16];
  for (int j0 = 0; j0 < f.dim; j0 += 16) {
    const int m = f.dim - j0 < 16 ? f.dim - j0 : 16;
    if (stochastic) u = uniforms.chunk(j0 >> 4);
#if defined(EMBCACHE_SSE)
    if (m == 16) {  // round_code on four lanes, then 16 codes packed into bytes
      const __m128 vbias = _mm_set1_ps(bias), vinv = _mm_set1_ps(inv), one = _mm_set1_ps(1.f);
      __m128i c[4];
      for (int k = 0; k < 4; ++k) {
        const __m128 y = _mm_mul_ps(_mm_sub_ps(_mm_loadu_ps(x + j0 + 4 * k), vbias), vinv);
        __m128 r = _mm_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (stochastic) {
          const __m128 lo = _mm_sub_ps(r, _mm_and_ps(_mm_cmpgt_ps(r, y), one));
          r = _mm_add_ps(lo, _mm_and_ps(_mm_cmplt_ps(_mm_loadu_ps(u + 4 * k), _mm_sub_ps(y, lo)), one));
        }
        r = _mm_min_ps(_mm_max_ps(r, _mm_setzero_ps()), _mm_set1_ps((float)q_max));
        c[k] = _mm_cvttps_epi32(r);
      }
      __m128i bytes =
          _mm_packus_epi16(_mm_packs_epi32(c[0], c[1]), _mm_packs_epi32(c[2], c[3]));
      if (lg == 0) {
        _mm_storeu_si128((__m128i*)(row + j0), bytes);
        continue;
      }
      // byte pairs (even code, odd code) -> even | odd << bits, as 16-bit lanes, packed back
      // into bytes: once for int4, twice for int2 (2-bit codes to nibbles, then to bytes)
      if (lg == 2) {
        bytes = _mm_maddubs_epi16(bytes, _mm_set1_epi16(0x0401));
        bytes = _mm_packus_epi16(bytes, bytes);
      }
      bytes = _mm_maddubs_epi16(bytes, _mm_set1_epi16(0x1001));
      bytes = _mm_packus_epi16(bytes, bytes);
      if (lg == 1) {
        _mm_storel_epi64((__m128i*)(row + (j0 >> 1)), bytes);
      } else {
        const int32_t packed = _mm_cvtsi128_si32(bytes);
        memcpy(row + (j0 >> 2), &packed, 4);
      }
      continue;
    }
#endif
    for (int i = 0; i < m; ++i)
      code[i] = round_code((x[j0 + i] - bias) * inv, stochastic, stochastic ? u[i] : 0.f, q_max);
    if (lg == 0) {
      for (int i = 0; i < m; ++i) row[j0 + i] = (uint8_t)code[i];
    } else {
      for (int i = 0; i < m; ++i) {
        const int j = j0 + i;
        row[j >> lg] |= (uint8_t)(code[i] << ((j & ((1 << lg) - 1)) * f.bits));
      }
    }
  }
}

}  // namespace embcache
