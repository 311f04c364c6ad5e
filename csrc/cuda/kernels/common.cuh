// What the cache kernels share: warp helpers, error flags, launch geometry and device scratch
// memory. The kernels are written once for two builds:
//
//  * nvcc (csrc/cuda/cache_cuda.cu): real __global__ kernels, CUB sorts and scans;
//  * host C++ (csrc/emulated/emu_ops.cpp) on csrc/cuda/warp_emulator.h: every thread of a
//    block a host thread, warp collectives in lockstep, std:: sorts and scans. CI machines
//    without a GPU run the kernels this way.
//
// The including file provides, before including csrc/cuda/cache_kernels.cuh, in namespace
// embcache::EMBCACHE_GPU_NS: kThreadsPerBlock, grid_for(), dev_alloc/dev_free,
// dev_fill(p, byte, bytes), copy_to_host (waits for the stream), copy_to_device (from host
// memory the caller may reuse at once), sort_pairs_u64_i64 (stable, over the keys' bits
// [begin_bit, end_bit): the others are zero), exclusive_sum_i64, and the macro
// EC_LAUNCH(kernel, grid, block, stream, args...) that launches and checks.
//
// Bit-identity with the CPU ops (csrc/cpu) comes from: the same row arithmetic
// (embcache/rowquant.h: rows are written by warp_quantize_row, element by element the
// arithmetic of quantize_row with the same uniforms) and optimizer arithmetic
// (embcache/optimizer.h), the same order of every floating-point sum (pooling and gradient
// sums in lookup order, the row-wise AdaGrad sum of squares in element order), no FMA (nvcc
// --fmad=false, -ffp-contract=off), IEEE division and square root, and sorts that reproduce
// the CPU's order.
//
// Warp-uniform control flow: every loop that contains a collective (ballot, shuffle,
// __syncwarp) has a trip count that is the same on all 32 lanes of the warp.
#pragma once

#include <stdint.h>


#if !defined(__CUDACC__)
#include "../warp_emulator.h"
#endif

#include "../cache_api.h"
#include "embcache/rowquant.h"
#include "embcache/table_spec.h"

namespace embcache {
namespace EMBCACHE_GPU_NS {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ unsigned lane_id() { return threadIdx.x & 31u; }

__device__ __forceinline__ int64_t warp_global() {
  return ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
}

__device__ __forceinline__ int64_t warps_in_grid() {
  return ((int64_t)gridDim.x * blockDim.x) >> 5;
}

__device__ __forceinline__ int64_t thread_global() {
  return (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t threads_in_grid() { return (int64_t)gridDim.x * blockDim.x; }

/// The slot holding `row` (or -1): lane w reads the tag of way w, a ballot finds the match.
/// Called by all 32 lanes with the same row.
__device__ __forceinline__ int64_t warp_find_slot(const int32_t* tags, const SetDivisor& sets,
                                                  int64_t ways, int64_t row) {
  if (sets.d == 0) return -1;
  const int64_t base = set_of_row(row, sets) * ways;
  const unsigned lane = lane_id();
  const bool match = (int64_t)lane < ways && (int64_t)tags[base + lane] == row;
  const unsigned m = __ballot_sync(kFullMask, match);
  return m ? base + (__ffs(m) - 1) : -1;
}

__device__ __forceinline__ float warp_min(float v) {
  for (int d = 16; d >= 1; d >>= 1) {
    const float o = __shfl_xor_sync(kFullMask, v, d);
    v = o < v ? o : v;
  }
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int d = 16; d >= 1; d >>= 1) {
    const float o = __shfl_xor_sync(kFullMask, v, d);
    v = o > v ? o : v;
  }
  return v;
}

/// row_is_storable(f, x, stochastic) computed by a warp (same answer: with every value finite, the
/// minimum and maximum are order-independent up to the sign of a zero, which no check sees).
__device__ __forceinline__ bool warp_row_is_storable(const RowFormat& f, const float* x,
                                                     bool stochastic) {
  const unsigned lane = lane_id();
  const float fp16_limit = stochastic ? 65504.f : 65519.996f;  // as row_is_storable
  bool bad = false;
  float mn = x[0], mx = x[0];
  for (int j = (int)lane; j < f.dim; j += 32) {
    const float v = x[j];
    if (!is_finite(v)) bad = true;
    if (f.bits == 16 && (v > fp16_limit || v < -fp16_limit)) bad = true;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }
  if (__any_sync(kFullMask, bad)) return false;
  mn = warp_min(mn);
  mx = warp_max(mx);
  if (f.is_int()) {
    if (!is_finite(mx - mn)) return false;
    if (f.qparams_fp16) {
      const uint16_t bias_h = float_to_half_rn(mn);
      if ((bias_h & 0x7c00u) == 0x7c00u) return false;
      const float scale = (mx - half_to_float(bias_h)) / (float)((1 << f.bits) - 1);
      if ((float_to_half_rn(scale) & 0x7c00u) == 0x7c00u) return false;
    }
  }
  return true;
}

/// The first of x[0..n) equal to v in lane order of a warp's strided pass (v == 0: which
/// zero comes first, +0 or -0): what the loops of row_min_max keep among equal extremes.
__device__ __forceinline__ float warp_first_equal(const float* x, int n, float v) {
  int first = n;
  for (int j = (int)lane_id(); j < n; j += 32)
    if (x[j] == v && j < first) first = j;
  for (int d = 16; d >= 1; d >>= 1) {
    const int o = __shfl_xor_sync(kFullMask, first, d);
    first = o < first ? o : first;
  }
  return x[first];
}

/// quantize_row(f, x, stochastic, s, row_id, out) computed by a warp, all 32 lanes calling
/// it with the same arguments: the same bytes. Lane l takes the elements' groups of four
/// (one Philox block of uniforms each) l, l + 32, ..., and writes their bytes. Requires
/// row_is_storable(f, x, stochastic).
__device__ __noinline__ void warp_quantize_row(const RowFormat& f, const float* x,
                                               bool stochastic, const RoundingStream& s,
                                               int64_t row_id, uint8_t* out) {
  const unsigned lane = lane_id();
  const int dim = f.dim;
  if (f.bits == 32) {
    for (int j = (int)lane; j < dim; j += 32) store_aligned<float>(out + 4 * j, x[j]);
    return;
  }
  float u[4] = {0.f, 0.f, 0.f, 0.f};
  if (f.bits == 16) {
    for (int g = (int)lane; 4 * g < dim; g += 32) {
      if (stochastic) philox_uniforms4(s, row_id, g, u);
      for (int i = 0; i < 4 && 4 * g + i < dim; ++i) {
        const int j = 4 * g + i;
        const uint32_t b = float_bits(x[j]);
        const uint16_t h = stochastic ? (uint16_t)((b >> 16) & 0x8000u) |
                                            half_stochastic_magnitude(b & 0x7fffffffu, u[i])
                                      : float_to_half_rn(x[j]);
        store_aligned<uint16_t>(out + 2 * j, h);
      }
    }
    return;
  }
  // The range: the order-free extremes, then (for a zero) the first of the equal zeros.
  float mn = x[0], mx = x[0];
  for (int j = (int)lane; j < dim; j += 32) {
    mn = x[j] < mn ? x[j] : mn;
    mx = x[j] > mx ? x[j] : mx;
  }
  mn = warp_min(mn);
  mx = warp_max(mx);
  if (mn == 0.f) mn = warp_first_equal(x, dim, mn);
  if (mx == 0.f) mx = warp_first_equal(x, dim, mx);
  const int q_max = (1 << f.bits) - 1;
  const RowQparams qp = row_qparams(f, mn, mx);
  const float bias = qp.bias, inv = qp.inv;
  if (lane == 0) store_qparams(f, qp, out + f.payload_bytes());
  // Group g's four codes fill 4 * bits / 8 bytes from byte (4 * g * bits) / 8: one word
  // (little-endian, code i at bit i * bits), stored whole where it lies in the payload and at
  // an address aligned to its size, else byte by byte up to the payload's end.
  const int lg = log2_codes_per_byte(f.bits), per_byte = 1 << lg;
  const int group_bytes = 4 / per_byte;
  for (int g = (int)lane; 4 * g < dim; g += 32) {
    if (stochastic) philox_uniforms4(s, row_id, g, u);
    uint32_t word = 0;  // elements past the row's end: zero bits
    for (int i = 0; i < 4 && 4 * g + i < dim; ++i)
      word |= (uint32_t)round_code((x[4 * g + i] - bias) * inv, stochastic, u[i], q_max)
              << (i * f.bits);
    uint8_t* at = out + ((4 * g) >> lg);
    const bool whole = (at - out) + group_bytes <= f.payload_bytes() &&
                       reinterpret_cast<uintptr_t>(at) % group_bytes == 0;
    if (whole && group_bytes == 4) {
      store_aligned<uint32_t>(at, word);
    } else if (whole && group_bytes == 2) {
      store_aligned<uint16_t>(at, (uint16_t)word);
    } else {
      for (int b = 0; b < group_bytes && (at - out) + b < f.payload_bytes(); ++b)
        at[b] = (uint8_t)(word >> (8 * b));
    }
  }
}

/// Whether bag g of an op's `total` bags over n lookups, positions [start, end), is valid
/// (cache_api.h's Bags): checked by every kernel that reads a bag, before it reads it.
__device__ __forceinline__ bool bag_is_valid(int64_t start, int64_t end, int64_t g,
                                             int64_t total, int64_t n) {
  return 0 <= start && start <= end && end <= n && (g != 0 || start == 0) &&
         (g != total - 1 || end == n);
}

/// Sums kept in registers: a warp covers a row in tiles of Chunks * 32 elements, lane
/// `lane` holding elements tile + lane + 32 * k, k < Chunks (the row's elements in order, so
/// each element is summed in the same order as with one pass per element). Kernels that
/// keep them take Chunks as a template parameter and are launched with tile_chunks(dim):
/// the fewest of 1, 2, 4 or 8 that hold the row in one tile (8 for wider rows), so that a
/// narrow row holds no registers for elements it does not have.
inline int tile_chunks(int dim) { return dim <= 32 ? 1 : dim <= 64 ? 2 : dim <= 128 ? 4 : 8; }

/// EC_LAUNCH of kernel<tile_chunks(dim)>.
#define EC_LAUNCH_TILED(kernel, dim, grid, block, stream, ...)                   \
  do {                                                                          \
    switch (tile_chunks(dim)) {                                                 \
      case 1: EC_LAUNCH(kernel<1>, grid, block, stream, __VA_ARGS__); break;    \
      case 2: EC_LAUNCH(kernel<2>, grid, block, stream, __VA_ARGS__); break;    \
      case 4: EC_LAUNCH(kernel<4>, grid, block, stream, __VA_ARGS__); break;    \
      default: EC_LAUNCH(kernel<8>, grid, block, stream, __VA_ARGS__); break;   \
    }                                                                           \
  } while (0)

inline dim3 grid_threads(int64_t n) {
  return dim3((unsigned)grid_for((n + kThreadsPerBlock - 1) / kThreadsPerBlock));
}
inline dim3 grid_warps(int64_t n) { return grid_threads(n * 32); }
inline dim3 block_dim() { return dim3((unsigned)kThreadsPerBlock); }

/// The last of items[0..n) whose field `start` is at or before x (binary search; the
/// starts ascending): the table or feature that holds row, set or unique row x, as one that
/// holds none of them starts where the next one does.
template <class Item, int64_t Item::*start>
__device__ __forceinline__ int64_t last_at(const Item* items, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (items[mid].*start <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

/// Device scratch memory, freed on scope exit.
struct Scratch {
  Stream stream;
  void* p = nullptr;
  Scratch(size_t bytes, Stream s) : stream(s) { p = bytes ? dev_alloc(bytes, s) : nullptr; }
  ~Scratch() {
    if (p) dev_free(p, stream);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

/// A copy of items[0..n) in device memory (the per-table or per-feature descriptors of a
/// batched launch: one async copy), freed on scope exit.
template <class Item>
struct DeviceArray {
  Scratch mem;
  DeviceArray(const Item* items, int64_t n, Stream stream) : mem(n * sizeof(Item), stream) {
    copy_to_device(mem.p, items, n * sizeof(Item), stream);
  }
  const Item* get() const { return mem.as<const Item>(); }
};


}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
