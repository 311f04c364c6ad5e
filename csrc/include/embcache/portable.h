// How the headers of csrc/include/embcache compile for each build: EMBCACHE_HD marks what
// both the CPU and the CUDA kernels run (__host__ __device__ under nvcc), and which SIMD paths
// a host build takes.
//
// Everything in these headers is plain arithmetic on plain pointers: no torch, no STL, no
// <cmath> functions whose results could differ between host and device, so the CPU kernels
// and the CUDA kernels produce bit-identical table bytes for the same seed, stochastic
// rounding included. Compile with floating-point contraction off (-ffp-contract=off, nvcc
// --fmad=false): `code * scale + bias` must be a multiply and an add, each rounded, never an
// FMA.
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
