// The random stream of stochastic rounding (docs/contract.md §3, docs/design.md "Random
// stream"): Philox4x32-10, portable and, on x86-64 hosts, SIMD (csrc/include/embcache/
// portable.h says which paths a build takes). Every path gives the same words.
#pragma once

#include "embcache/portable.h"

namespace embcache {

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

/// The uniforms of elements [4 * block, 4 * block + 4) of row `row`: the four words of
/// Philox4x32-10 block `block`, whose counter is (block, row, step, table) and key the seed.
EMBCACHE_HD void philox_uniforms4(const RoundingStream& s, int64_t row, int64_t block, float* u) {
  uint32_t k0 = (uint32_t)s.seed, k1 = (uint32_t)(s.seed >> 32);
  uint32_t x0 = (uint32_t)block, x1 = (uint32_t)row, x2 = s.step, x3 = s.table;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = (uint64_t)0xD2511F53u * x0, p1 = (uint64_t)0xCD9E8D57u * x2;
    x0 = (uint32_t)(p1 >> 32) ^ x1 ^ k0;
    x2 = (uint32_t)(p0 >> 32) ^ x3 ^ k1;
    x1 = (uint32_t)p1;
    x3 = (uint32_t)p0;
  }
  u[0] = word_uniform(x0);
  u[1] = word_uniform(x1);
  u[2] = word_uniform(x2);
  u[3] = word_uniform(x3);
}

/// The uniforms of elements [16 * chunk, 16 * chunk + 16) of row `row`: u[i] is element
/// 16 * chunk + i, i.e. word i % 4 of Philox4x32-10 block 4 * chunk + i / 4, whose counter
/// is (4 * chunk + i / 4, row, step, table) and key the seed.
EMBCACHE_HD void stream_uniforms16(const RoundingStream& s, int64_t row, int64_t chunk,
                                   float* u) {
#if defined(EMBCACHE_SSE)
  uint32_t k0 = (uint32_t)s.seed, k1 = (uint32_t)(s.seed >> 32);
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
  for (int b = 0; b < 4; ++b) philox_uniforms4(s, row, 4 * chunk + b, u + 4 * b);
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

}  // namespace embcache
