// Row formats, rounding and random numbers of docs/contract.md §2-4, written once for C++ and CUDA.
//
// Everything here is plain arithmetic on plain pointers: no torch, no STL, no <cmath>
// functions whose results could differ between host and device. Stored rows are
// little-endian (every target of this project is). Every function is
// EMBCACHE_HD (__host__ __device__ under nvcc), so the CPU kernels and the CUDA kernels
// produce bit-identical table bytes for the same seed, stochastic rounding included.
//
// Compile with floating-point contraction off (-ffp-contract=off, nvcc --fmad=false):
// `code * scale + bias` must be a multiply and an add, each rounded, never an FMA.
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Host builds with SSE4.1 run the four Philox blocks of stream_uniforms16 in one SIMD
// register per state word, and an integer row's min/max and int8 rounding four elements at
// a time; on CPUs with AVX2 (checked at run time; GCC and Clang), rows of 32 elements or
// more draw eight Philox blocks at a time (stream_uniforms32), and the CPU update draws rows
// of at most 16 elements two rows at a time with AVX2 (stream_uniforms32) or four with fast
// AVX-512 (has_fast_avx512, stream_uniforms16_rows4), passed to quantize_row as `drawn`.
// EMBCACHE_SIMD=sse|avx2 caps these choices (simd_cap). CUDA, the warp emulator
// (built with EMBCACHE_PORTABLE, so that the tests compare the two) and other hosts run the
// portable loops. Same bytes either way.
#if defined(__SSE4_1__) && !defined(__CUDACC__) && !defined(EMBCACHE_PORTABLE)
#define EMBCACHE_SSE 1
#include <smmintrin.h>
#if defined(__GNUC__)
#define EMBCACHE_AVX2 1
#include <immintrin.h>
#endif
#endif

#if defined(__CUDACC__)
#define EMBCACHE_HD __host__ __device__ __forceinline__
#else
#define EMBCACHE_HD inline
#endif

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

// ---------------------------------------------------------------------------------------
// Philox4x32-10 (Salmon et al., Random123) and the stream of docs/contract.md §3
// ---------------------------------------------------------------------------------------

/// Where a row's random numbers come from: key (seed), counter (step, table, row).
/// Element j of the row uses word j % 4 of philox(counter = (j / 4, row, step, table)).
struct RoundingStream {
  uint64_t seed;
  uint32_t step;
  uint32_t table;
};

/// A 32-bit word as a uniform number in [0, 1): its top 24 bits * 2^-24.
EMBCACHE_HD float word_uniform(uint32_t w) { return (float)(w >> 8) * 5.9604644775390625e-8f; }

/// The uniforms of elements [16 * chunk, 16 * chunk + 16) of row `row`: u[i] is element
/// 16 * chunk + i, i.e. word i % 4 of Philox4x32-10 block 4 * chunk + i / 4, whose counter
/// is (4 * chunk + i / 4, row, step, table) and key the seed.
EMBCACHE_HD void stream_uniforms16(const RoundingStream& s, int64_t row, int64_t chunk,
                                   float* u) {
  uint32_t k0 = (uint32_t)s.seed, k1 = (uint32_t)(s.seed >> 32);
#if defined(EMBCACHE_SSE)
  // Lane b holds block b. A round: (hi, lo) = M0 * x0 and M1 * x2 as 64-bit products
  // (even lanes, then odd lanes shifted down), then x = (hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0).
  const int c = (int)(4 * chunk);
  __m128i x0 = _mm_setr_epi32(c, c + 1, c + 2, c + 3), x1 = _mm_set1_epi32((int)row),
          x2 = _mm_set1_epi32((int)s.step), x3 = _mm_set1_epi32((int)s.table);
  const __m128i m0 = _mm_set1_epi32((int)0xD2511F53u), m1 = _mm_set1_epi32((int)0xCD9E8D57u);
  auto mul_hi_lo = [](__m128i a, __m128i m, __m128i* lo) {
    const __m128i even = _mm_mul_epu32(a, m), odd = _mm_mul_epu32(_mm_srli_epi64(a, 32), m);
    *lo = _mm_blend_epi16(even, _mm_slli_epi64(odd, 32), 0xCC);
    return _mm_blend_epi16(_mm_srli_epi64(even, 32), odd, 0xCC);
  };
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    __m128i lo0, lo1;
    const __m128i hi0 = mul_hi_lo(x0, m0, &lo0), hi1 = mul_hi_lo(x2, m1, &lo1);
    x0 = _mm_xor_si128(_mm_xor_si128(hi1, x1), _mm_set1_epi32((int)k0));
    x2 = _mm_xor_si128(_mm_xor_si128(hi0, x3), _mm_set1_epi32((int)k1));
    x1 = lo1;
    x3 = lo0;
  }
  const __m128 scale = _mm_set1_ps(5.9604644775390625e-8f);  // word_uniform, four at a time
  __m128 w0 = _mm_mul_ps(_mm_cvtepi32_ps(_mm_srli_epi32(x0, 8)), scale);
  __m128 w1 = _mm_mul_ps(_mm_cvtepi32_ps(_mm_srli_epi32(x1, 8)), scale);
  __m128 w2 = _mm_mul_ps(_mm_cvtepi32_ps(_mm_srli_epi32(x2, 8)), scale);
  __m128 w3 = _mm_mul_ps(_mm_cvtepi32_ps(_mm_srli_epi32(x3, 8)), scale);
  _MM_TRANSPOSE4_PS(w0, w1, w2, w3);  // now w_b = the four words of block b
  _mm_storeu_ps(u, w0);
  _mm_storeu_ps(u + 4, w1);
  _mm_storeu_ps(u + 8, w2);
  _mm_storeu_ps(u + 12, w3);
#else
  uint32_t x0[4], x1[4], x2[4], x3[4];
  for (int b = 0; b < 4; ++b) {
    x0[b] = (uint32_t)(4 * chunk + b);
    x1[b] = (uint32_t)row;
    x2[b] = s.step;
    x3[b] = s.table;
  }
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    for (int b = 0; b < 4; ++b) {
      const uint64_t p0 = (uint64_t)0xD2511F53u * x0[b], p1 = (uint64_t)0xCD9E8D57u * x2[b];
      const uint32_t n0 = (uint32_t)(p1 >> 32) ^ x1[b] ^ k0;
      const uint32_t n2 = (uint32_t)(p0 >> 32) ^ x3[b] ^ k1;
      x0[b] = n0;
      x1[b] = (uint32_t)p1;
      x2[b] = n2;
      x3[b] = (uint32_t)p0;
    }
  }
  for (int b = 0; b < 4; ++b) {
    u[4 * b + 0] = word_uniform(x0[b]);
    u[4 * b + 1] = word_uniform(x1[b]);
    u[4 * b + 2] = word_uniform(x2[b]);
    u[4 * b + 3] = word_uniform(x3[b]);
  }
#endif
}

#if defined(EMBCACHE_AVX2)
#define EMBCACHE_TARGET_AVX2 __attribute__((target("avx2")))

/// (hi, lo) 32-bit halves of the 64-bit products a * m, lane by lane.
EMBCACHE_TARGET_AVX2 inline __m256i mul_hi_lo8(__m256i a, __m256i m, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

/// stream_uniforms16 of two chunks at once: chunk_a of row_a into u[0..16), chunk_b of row_b
/// into u[16..32); the eight Philox blocks side by side, one per lane, in the same rounds.
/// Only for CPUs with AVX2 (has_avx2()).
EMBCACHE_TARGET_AVX2 inline void stream_uniforms32(const RoundingStream& s, int64_t row_a,
                                                   int64_t chunk_a, int64_t row_b,
                                                   int64_t chunk_b, float* u) {
  uint32_t k0 = (uint32_t)s.seed, k1 = (uint32_t)(s.seed >> 32);
  const int a = (int)(4 * chunk_a), b = (int)(4 * chunk_b), ra = (int)row_a, rb = (int)row_b;
  __m256i x0 = _mm256_setr_epi32(a, a + 1, a + 2, a + 3, b, b + 1, b + 2, b + 3),
          x1 = _mm256_setr_epi32(ra, ra, ra, ra, rb, rb, rb, rb),
          x2 = _mm256_set1_epi32((int)s.step), x3 = _mm256_set1_epi32((int)s.table);
  const __m256i m0 = _mm256_set1_epi32((int)0xD2511F53u), m1 = _mm256_set1_epi32((int)0xCD9E8D57u);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    __m256i lo0, lo1;
    const __m256i hi0 = mul_hi_lo8(x0, m0, &lo0), hi1 = mul_hi_lo8(x2, m1, &lo1);
    x0 = _mm256_xor_si256(_mm256_xor_si256(hi1, x1), _mm256_set1_epi32((int)k0));
    x2 = _mm256_xor_si256(_mm256_xor_si256(hi0, x3), _mm256_set1_epi32((int)k1));
    x1 = lo1;
    x3 = lo0;
  }
  const __m256 scale = _mm256_set1_ps(5.9604644775390625e-8f);  // word_uniform, eight at a time
  const __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x0, 8)), scale);
  const __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x1, 8)), scale);
  const __m256 w2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x2, 8)), scale);
  const __m256 w3 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x3, 8)), scale);
  // 4x4 transposes in each 128-bit half: b_k = the four words of block k of chunk a (low
  // half) and of chunk b (high half)
  const __m256 t0 = _mm256_unpacklo_ps(w0, w1), t1 = _mm256_unpackhi_ps(w0, w1);
  const __m256 t2 = _mm256_unpacklo_ps(w2, w3), t3 = _mm256_unpackhi_ps(w2, w3);
  const __m256 b0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 b1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 b2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 b3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  _mm256_storeu_ps(u, _mm256_permute2f128_ps(b0, b1, 0x20));       // chunk a, blocks 0, 1
  _mm256_storeu_ps(u + 8, _mm256_permute2f128_ps(b2, b3, 0x20));   // chunk a, blocks 2, 3
  _mm256_storeu_ps(u + 16, _mm256_permute2f128_ps(b0, b1, 0x31));  // chunk b, blocks 0, 1
  _mm256_storeu_ps(u + 24, _mm256_permute2f128_ps(b2, b3, 0x31));  // chunk b, blocks 2, 3
}

/// The widest SIMD the CPU paths may use, asked once: EMBCACHE_SIMD=sse (SSE4.1 only) or
/// avx2 caps it, so that tests can compare every path's bytes on one machine; otherwise
/// whatever the CPU has. 1 = SSE4.1, 2 = AVX2, 3 = AVX-512.
inline int simd_cap() {
  static const int cap = [] {
    const char* v = getenv("EMBCACHE_SIMD");
    return !v ? 3 : strcmp(v, "sse") == 0 ? 1 : strcmp(v, "avx2") == 0 ? 2 : 3;
  }();
  return cap;
}

/// Whether this CPU runs AVX2 (asked once).
inline bool has_avx2() {
  static const bool yes = simd_cap() >= 2 && __builtin_cpu_supports("avx2");
  return yes;
}

#define EMBCACHE_TARGET_AVX512 __attribute__((target("avx512f")))

// GCC 12's AVX-512 intrinsics start some results from _mm512_undefined_*(), which its
// -Wuninitialized then reports in our code (GCC bug 105593, fixed in 12.3).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

/// stream_uniforms16 of chunk 0 of four rows at once (u[16 * r .. 16 * r + 16) for rows[r]):
/// sixteen Philox blocks, lanes 4r .. 4r + 3 the four blocks of rows[r]. Only for CPUs with
/// AVX-512F (called where has_fast_avx512()).
EMBCACHE_TARGET_AVX512 inline void stream_uniforms16_rows4(const RoundingStream& s,
                                                           const int64_t* rows, float* u) {
  const int r0 = (int)rows[0], r1 = (int)rows[1], r2 = (int)rows[2], r3 = (int)rows[3];
  __m512i x0 = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3),
          x1 = _mm512_setr_epi32(r0, r0, r0, r0, r1, r1, r1, r1, r2, r2, r2, r2, r3, r3, r3, r3),
          x2 = _mm512_set1_epi32((int)s.step), x3 = _mm512_set1_epi32((int)s.table);
  const __m512i m0 = _mm512_set1_epi32((int)0xD2511F53u), m1 = _mm512_set1_epi32((int)0xCD9E8D57u);
  __m512i k0 = _mm512_set1_epi32((int)(uint32_t)s.seed),
          k1 = _mm512_set1_epi32((int)(uint32_t)(s.seed >> 32));
  const __m512i w0 = _mm512_set1_epi32((int)0x9E3779B9u), w1 = _mm512_set1_epi32((int)0xBB67AE85u);
  // The 64-bit products of the even lanes and of the odd lanes (shifted down), split into
  // their high and low words back in lane order, one permute each.
  const __m512i hi = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  const __m512i lo = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 = _mm512_add_epi32(k0, w0);
      k1 = _mm512_add_epi32(k1, w1);
    }
    const __m512i e0 = _mm512_mul_epu32(x0, m0), o0 = _mm512_mul_epu32(_mm512_srli_epi64(x0, 32), m0);
    const __m512i e1 = _mm512_mul_epu32(x2, m1), o1 = _mm512_mul_epu32(_mm512_srli_epi64(x2, 32), m1);
    x0 = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi32(e1, hi, o1), x1, k0, 0x96);  // a^b^c
    x2 = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi32(e0, hi, o0), x3, k1, 0x96);
    x1 = _mm512_permutex2var_epi32(e1, lo, o1);
    x3 = _mm512_permutex2var_epi32(e0, lo, o0);
  }
  const __m512 scale = _mm512_set1_ps(5.9604644775390625e-8f);  // word_uniform, 16 at a time
  const __m512 v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x0, 8)), scale);
  const __m512 v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x1, 8)), scale);
  const __m512 v2 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x2, 8)), scale);
  const __m512 v3 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x3, 8)), scale);
  // 4x4 transposes in each 128-bit lane (lane r: b_j = the four words of block j of rows[r]),
  // then a 4x4 transpose of the 128-bit lanes (row r's blocks 0-3 together)
  const __m512 t0 = _mm512_unpacklo_ps(v0, v1), t1 = _mm512_unpackhi_ps(v0, v1);
  const __m512 t2 = _mm512_unpacklo_ps(v2, v3), t3 = _mm512_unpackhi_ps(v2, v3);
  const __m512 b0 = _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512 b1 = _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m512 b2 = _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512 b3 = _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m512 c0 = _mm512_shuffle_f32x4(b0, b1, _MM_SHUFFLE(2, 0, 2, 0));  // b0 r0 r2, b1 r0 r2
  const __m512 c1 = _mm512_shuffle_f32x4(b0, b1, _MM_SHUFFLE(3, 1, 3, 1));  // b0 r1 r3, b1 r1 r3
  const __m512 c2 = _mm512_shuffle_f32x4(b2, b3, _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 c3 = _mm512_shuffle_f32x4(b2, b3, _MM_SHUFFLE(3, 1, 3, 1));
  _mm512_storeu_ps(u, _mm512_shuffle_f32x4(c0, c2, _MM_SHUFFLE(2, 0, 2, 0)));       // row 0
  _mm512_storeu_ps(u + 16, _mm512_shuffle_f32x4(c1, c3, _MM_SHUFFLE(2, 0, 2, 0)));  // row 1
  _mm512_storeu_ps(u + 32, _mm512_shuffle_f32x4(c0, c2, _MM_SHUFFLE(3, 1, 3, 1)));  // row 2
  _mm512_storeu_ps(u + 48, _mm512_shuffle_f32x4(c1, c3, _MM_SHUFFLE(3, 1, 3, 1)));  // row 3
}
#pragma GCC diagnostic pop

/// Whether this CPU runs AVX-512F without lowering its clock for long after 512-bit
/// multiplies (asked once). AVX512-VBMI2 is taken as the sign: Intel since Ice Lake and AMD
/// since Zen 4 have it; Skylake-SP and Cascade Lake, whose cores slow down for milliseconds
/// after such code, do not.
inline bool has_fast_avx512() {
  static const bool yes = simd_cap() >= 3 && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512vbmi2");
  return yes;
}
#endif

/// The uniforms of one row's elements, 16 (a chunk) at a time, in increasing chunks; drawn
/// two chunks at a time where stream_uniforms32 exists and the row has both.
struct RowUniforms {
  const RoundingStream& stream;
  int64_t row;
  int dim;
  int64_t first = 0, count = 0;  // u holds chunks [first, first + count)
#if defined(EMBCACHE_AVX2)
  float u[32];
#else
  float u[16];
#endif

  // A constructor leaves u uninitialized: brace-initializing the aggregate would zero it
  // for every row quantized, work comparable to quantizing a short row.
  EMBCACHE_HD RowUniforms(const RoundingStream& s, int64_t r, int d) : stream(s), row(r), dim(d) {}

  /// Takes chunk 0's uniforms as already drawn (u0[0..16)).
  EMBCACHE_HD void set_first_chunk(const float* u0) {
    for (int i = 0; i < 16; ++i) u[i] = u0[i];
    first = 0;
    count = 1;
  }

  EMBCACHE_HD const float* chunk(int64_t c) {
    if (c < first || c >= first + count) {
      first = c;
#if defined(EMBCACHE_AVX2)
      if (16 * (c + 1) < dim && has_avx2()) {
        stream_uniforms32(stream, row, c, row, c + 1, u);
        count = 2;
        return u;
      }
#endif
      stream_uniforms16(stream, row, c, u);
      count = 1;
    }
    return u + 16 * (c - first);
  }
};

/// 64-bit MurmurHash3 finalizer: row -> set.
EMBCACHE_HD uint64_t murmur_fmix64(uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h;
}

EMBCACHE_HD int64_t set_of_row(int64_t row, int64_t num_sets) {
  return (int64_t)(murmur_fmix64((uint64_t)row) % (uint64_t)num_sets);
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
  if (f.bits == 32) return load_f32(row + 4 * j);
  if (f.bits == 16) return half_to_float(load_u16(row + 2 * j));
  return (float)load_code(f, row, j) * scale + bias;
}

/// out[0..dim) = the stored row as float32 (the format's branch taken once per row).
EMBCACHE_HD void dequantize_row(const RowFormat& f, const uint8_t* row, float* out) {
  if (f.bits == 32) {
    memcpy(out, row, 4 * (size_t)f.dim);
    return;
  }
  if (f.bits == 16) {
    for (int j = 0; j < f.dim; ++j) out[j] = half_to_float(load_u16(row + 2 * j));
    return;
  }
  float scale, bias;
  load_qparams(f, row, &scale, &bias);
  if (f.bits == 8) {
    for (int j = 0; j < f.dim; ++j) out[j] = (float)row[j] * scale + bias;
    return;
  }
  for (int j = 0; j < f.dim; ++j) out[j] = (float)load_code(f, row, j) * scale + bias;
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
    for (int j = 0; j < f.dim; ++j) {
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
  float scale, bias, inv;
  uint8_t* q = row + f.payload_bytes();
  if (f.qparams_fp16) {
    const uint16_t bias_h = float_to_half_rn(mn);
    bias = half_to_float(bias_h);
    const uint16_t scale_h = float_to_half_rn((mx - bias) / (float)q_max);
    scale = half_to_float(scale_h);
    inv = scale == 0.f ? 0.f : 1.f / scale;
    // A zero scale (constant row, or a range below the smallest half) gives all codes 0,
    // and is stored as 1.0, as FBGEMM's SBHalf layout does; the values are the same.
    store_u16(q, scale == 0.f ? (uint16_t)0x3c00u : scale_h);
    store_u16(q + 2, bias_h);
  } else {
    const float range = mx - mn;
    bias = mn;
    scale = range / (float)q_max;
    inv = (float)q_max / (range + 1e-8f);
    store_f32(q, scale);
    store_f32(q + 4, bias);
  }
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
    if (m == 16 && lg == 0) {  // round_code on four lanes, then 16 codes packed into bytes
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
      const __m128i bytes =
          _mm_packus_epi16(_mm_packs_epi32(c[0], c[1]), _mm_packs_epi32(c[2], c[3]));
      _mm_storeu_si128((__m128i*)(row + j0), bytes);
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
