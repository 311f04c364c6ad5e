// The cache kernels of docs/contract.md §2-4 for a GPU, written once for two builds:
//
//  * nvcc (csrc/cuda/cache_cuda.cu): real __global__ kernels, CUB sorts and scans;
//  * host C++ (csrc/emulated/emu_ops.cpp) on csrc/cuda/warp_emulator.h: every thread of a
//    block a host thread, warp collectives in lockstep, std:: sorts and scans. CI machines
//    without a GPU run the kernels this way.
//
// The including file provides, before including this header, in namespace
// embcache::EMBCACHE_GPU_NS: kThreadsPerBlock, grid_for(), dev_alloc/dev_free/dev_zero,
// copy_to_host, sort_keys_u64, sort_pairs_u64_i64 (stable), exclusive_sum_i64, and the
// macro EC_LAUNCH(kernel, grid, block, stream, args...) that launches and checks.
//
// Bit-identity with the CPU ops (csrc/cpu/embcache_cpu.cpp) comes from: the same row
// arithmetic (embcache/rowquant.h; stored rows are written by quantize_row itself, one lane
// per row), the same order of every floating-point sum (pooling and gradient sums in lookup
// order, the row-wise AdaGrad sum of squares in element order), no FMA (nvcc --fmad=false,
// -ffp-contract=off), IEEE division and square root, and sorts that reproduce the CPU's order.
//
// Warp-uniform control flow: every loop that contains a collective (ballot, shuffle,
// __syncwarp) has a trip count that is the same on all 32 lanes of the warp.
#pragma once

#include <stdint.h>

#include <stdexcept>
#include <string>

#if !defined(__CUDACC__)
#include "warp_emulator.h"
#endif

#include "cache_api.h"
#include "embcache/rowquant.h"

#ifndef EMBCACHE_GPU_NS
#define EMBCACHE_GPU_NS gpu
#endif

namespace embcache {
namespace EMBCACHE_GPU_NS {

constexpr unsigned kFullMask = 0xffffffffu;

enum Optimizer : int { kSGD = 0, kRowwiseAdagrad = 1, kAdagrad = 2 };

// Error bits a kernel reports in flags[0]; the host throws after reading them.
enum ErrorBits : unsigned long long {
  kBadIndex = 1,        // an index < 0 or >= rows
  kBadOffsets = 2,      // offsets not starting at 0, decreasing, or not ending at len(indices)
  kBadUniqueRows = 4,   // unique rows not ascending or out of range
};

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
__device__ __forceinline__ int64_t warp_find_slot(const int32_t* tags, int64_t num_sets,
                                                  int64_t ways, int64_t row) {
  if (num_sets == 0) return -1;
  const int64_t base = set_of_row(row, num_sets) * ways;
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

// ---------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------

/// quantize_rows: one thread per row. flags[0] = min bad row position + 1 (0: none).
__global__ void quantize_rows_kernel(const float* x, const int64_t* ids, int64_t n, RowFormat f,
                                     bool stochastic, RoundingStream s, uint8_t* out,
                                     unsigned long long* first_bad) {
  for (int64_t r = thread_global(); r < n; r += threads_in_grid()) {
    const float* xr = x + r * f.dim;
    if (!row_is_storable(f, xr, stochastic)) {
      atomicMin(first_bad, (unsigned long long)r);
      continue;
    }
    quantize_row(f, xr, stochastic, s, ids[r], out + r * f.row_bytes());
  }
}

/// dequantize_rows: one warp per row, one lane per element.
__global__ void dequantize_rows_kernel(const uint8_t* w, int64_t n, RowFormat f, float* out) {
  for (int64_t r = warp_global(); r < n; r += warps_in_grid()) {
    const uint8_t* row = w + r * f.row_bytes();
    float scale = 0.f, bias = 0.f;
    if (f.is_int()) load_qparams(f, row, &scale, &bias);
    for (int j = (int)lane_id(); j < f.dim; j += 32)
      out[r * f.dim + j] = dequantize_element(f, row, j, scale, bias);
  }
}

/// Bag b covers positions [off[b], off[b+1]) of idx (and psw); the bags must tile [lo, hi).
__device__ __forceinline__ bool bag_is_valid(int64_t start, int64_t end, int64_t b, int64_t nb,
                                             int64_t lo, int64_t hi) {
  return lo <= start && start <= end && end <= hi && (b != 0 || start == lo) &&
         (b != nb - 1 || end == hi);
}

/// Pooled lookups: one warp per bag, lanes over the elements, lookups in order; bag b is
/// written to out[b * out_stride + j]. counters[0] |= error bits, counters[1] += cache hits.
__global__ void lookup_forward_kernel(const uint8_t* w, int64_t num_rows, const int32_t* tags,
                                      const float* cache_rows, const int64_t* idx,
                                      const int64_t* off, int64_t nb, int64_t lo, int64_t hi,
                                      const float* psw, RowFormat f, int64_t num_sets,
                                      int64_t ways, bool mean, float* out, int64_t out_stride,
                                      unsigned long long* counters) {
  const unsigned lane = lane_id();
  const int dim = f.dim;
  for (int64_t b = warp_global(); b < nb; b += warps_in_grid()) {
    float* acc = out + b * out_stride;
    for (int j = (int)lane; j < dim; j += 32) acc[j] = 0.f;
    const int64_t start = off[b], end = off[b + 1];
    if (!bag_is_valid(start, end, b, nb, lo, hi)) {
      if (lane == 0) atomicOr(&counters[0], (unsigned long long)kBadOffsets);
      continue;
    }
    unsigned long long hits = 0;
    for (int64_t l = start; l < end; ++l) {
      const int64_t row = idx[l];
      if (row < 0 || row >= num_rows) {
        if (lane == 0) atomicOr(&counters[0], (unsigned long long)kBadIndex);
        continue;
      }
      const int64_t slot = warp_find_slot(tags, num_sets, ways, row);
      const float s = psw ? psw[l] : 0.f;
      if (slot >= 0) {
        ++hits;
        const float* v = cache_rows + slot * dim;
        for (int j = (int)lane; j < dim; j += 32) acc[j] = psw ? acc[j] + s * v[j] : acc[j] + v[j];
      } else {
        const uint8_t* r = w + row * f.row_bytes();
        float scale = 0.f, bias = 0.f;
        if (f.is_int()) load_qparams(f, r, &scale, &bias);
        for (int j = (int)lane; j < dim; j += 32) {
          const float v = dequantize_element(f, r, j, scale, bias);
          acc[j] = psw ? acc[j] + s * v : acc[j] + v;
        }
      }
    }
    const int64_t len = end - start;
    if (mean && len > 0)
      for (int j = (int)lane; j < dim; j += 32) acc[j] /= (float)len;
    if (lane == 0 && hits) atomicAdd(&counters[1], hits);
  }
}

/// Backward, step 1: the bag of every lookup and the packed sort keys (row << 32 | position),
/// for positions [lo, hi) stored at [0, hi - lo). One thread per bag. flags[0] |= error bits.
__global__ void dedup_keys_kernel(const int64_t* idx, const int64_t* off, int64_t nb, int64_t lo,
                                  int64_t hi, int64_t* bag_of, uint64_t* keys,
                                  unsigned long long* flags) {
  for (int64_t b = thread_global(); b < nb; b += threads_in_grid()) {
    const int64_t start = off[b], end = off[b + 1];
    if (!bag_is_valid(start, end, b, nb, lo, hi)) {
      atomicOr(&flags[0], (unsigned long long)kBadOffsets);
      continue;
    }
    for (int64_t l = start; l < end; ++l) {
      const int64_t row = idx[l];
      if (row < 0 || row >= (int64_t(1) << 31)) atomicOr(&flags[0], (unsigned long long)kBadIndex);
      bag_of[l - lo] = b;
      keys[l - lo] = ((uint64_t)row << 32) | (uint64_t)l;
    }
  }
}

/// Backward, step 2: 1 where a new row starts in the sorted keys.
__global__ void segment_flags_kernel(const uint64_t* keys, int64_t n, int shift, int64_t* flag) {
  for (int64_t k = thread_global(); k < n; k += threads_in_grid())
    flag[k] = (k == 0 || (keys[k] >> shift) != (keys[k - 1] >> shift)) ? 1 : 0;
}

/// Backward, step 3: starts[u] = the position of unique row u; counters[1] = unique rows.
__global__ void segment_starts_kernel(const int64_t* flag, const int64_t* excl, int64_t n,
                                      int64_t* starts, unsigned long long* counters) {
  for (int64_t k = thread_global(); k < n; k += threads_in_grid()) {
    if (flag[k]) starts[excl[k]] = k;
    if (k == n - 1) {
      counters[1] = (unsigned long long)(excl[k] + flag[k]);
      starts[excl[k] + flag[k]] = n;
    }
  }
}

/// Backward, step 4: one warp per unique row sums its contributions in lookup order; the
/// gradient of bag b is g[b * g_stride + j].
__global__ void dedup_sum_kernel(const uint64_t* keys, const int64_t* starts, int64_t nu,
                                 const int64_t* bag_of, int64_t lo, const int64_t* off,
                                 const float* psw, const float* g, int64_t g_stride, int dim,
                                 bool mean, int64_t* rows, float* grads, int64_t* occ) {
  const unsigned lane = lane_id();
  for (int64_t u = warp_global(); u < nu; u += warps_in_grid()) {
    const int64_t s = starts[u], e = starts[u + 1];
    if (lane == 0) {
      rows[u] = (int64_t)(keys[s] >> 32);
      occ[u] = e - s;
    }
    for (int j = (int)lane; j < dim; j += 32) {
      float acc = 0.f;
      for (int64_t k = s; k < e; ++k) {
        const int64_t l = (int64_t)(keys[k] & 0xffffffffu), b = bag_of[l - lo];
        const float gb = g[b * g_stride + j];
        if (psw) {
          acc += gb * psw[l];
        } else if (mean) {
          const float len = (float)(off[b + 1] - off[b]);
          acc += gb / len;
        } else {
          acc += gb;
        }
      }
      grads[u * dim + j] = acc;
    }
  }
}

/// The first half of the update: one warp per unique row finds its slot (ballot), fetches
/// the value (cache row or dequantized table row) and applies the optimizer.
/// flags[0] |= error bits; flags[1] = min(row that cannot be stored).
__global__ void update_prepare_kernel(const uint8_t* w, int64_t num_rows, const int32_t* tags,
                                      const float* cache_rows, const float* state,
                                      const int64_t* rows, int64_t nu, const float* g,
                                      RowFormat f, bool stochastic, int opt, float lr,
                                      float eps, int64_t num_sets, int64_t ways, float* fresh,
                                      float* fresh_state, int64_t* slots,
                                      unsigned long long* flags) {
  const unsigned lane = lane_id();
  const int dim = f.dim;
  for (int64_t u = warp_global(); u < nu; u += warps_in_grid()) {
    const int64_t row = rows[u];
    if (row < 0 || row >= num_rows || (u > 0 && rows[u - 1] >= row)) {
      if (lane == 0) atomicOr(&flags[0], (unsigned long long)kBadUniqueRows);
      continue;
    }
    const int64_t slot = warp_find_slot(tags, num_sets, ways, row);
    if (lane == 0) slots[u] = slot;
    const float* cv = slot >= 0 ? cache_rows + slot * dim : nullptr;
    const uint8_t* tr = w + row * f.row_bytes();
    float scale = 0.f, bias = 0.f;
    if (slot < 0 && f.is_int()) load_qparams(f, tr, &scale, &bias);
    const float* gu = g + u * dim;
    float* out = fresh + u * dim;
    if (opt == kSGD) {
      for (int j = (int)lane; j < dim; j += 32) {
        const float v = cv ? cv[j] : dequantize_element(f, tr, j, scale, bias);
        out[j] = v - lr * gu[j];
      }
    } else if (opt == kRowwiseAdagrad) {
      float sum_sq = 0.f;  // in element order, as the CPU sums it
      if (lane == 0)
        for (int j = 0; j < dim; ++j) sum_sq += gu[j] * gu[j];
      sum_sq = __shfl_sync(kFullMask, sum_sq, 0);
      const float acc = state[row] + sum_sq / (float)dim;
      const float step = lr / (sqrtf(acc) + eps);
      for (int j = (int)lane; j < dim; j += 32) {
        const float v = cv ? cv[j] : dequantize_element(f, tr, j, scale, bias);
        out[j] = v - step * gu[j];
      }
      if (lane == 0) fresh_state[u] = acc;
    } else {
      for (int j = (int)lane; j < dim; j += 32) {
        const float v = cv ? cv[j] : dequantize_element(f, tr, j, scale, bias);
        const float acc = state[row * dim + j] + gu[j] * gu[j];
        out[j] = v - (lr / (sqrtf(acc) + eps)) * gu[j];
        fresh_state[u * dim + j] = acc;
      }
    }
    __syncwarp(kFullMask);
    if (!warp_row_is_storable(f, out, stochastic) && lane == 0)
      atomicMin(&flags[1], (unsigned long long)row);
  }
}

/// The commit, step 1: optimizer state and (LFU) counts of every updated row. One warp per
/// unique row.
__global__ void commit_state_kernel(float* state, int32_t* counts, const int64_t* rows,
                                    int64_t nu, const float* fresh_state, int64_t sw,
                                    const int64_t* occ, bool lfu) {
  const unsigned lane = lane_id();
  for (int64_t u = warp_global(); u < nu; u += warps_in_grid()) {
    const int64_t row = rows[u];
    for (int64_t j = lane; j < sw; j += 32) state[row * sw + j] = fresh_state[u * sw + j];
    if (lfu && lane == 0) {
      const int64_t c = (int64_t)counts[row] + occ[u];
      counts[row] = (int32_t)(c < 0x7fffffff ? c : 0x7fffffff);
    }
  }
}

/// The commit without a cache: every updated row bypasses. One thread per row.
__global__ void commit_bypass_kernel(uint8_t* w, const int64_t* rows, int64_t nu,
                                     const float* fresh, RowFormat f, bool stochastic,
                                     RoundingStream s) {
  for (int64_t u = thread_global(); u < nu; u += threads_in_grid())
    quantize_row(f, fresh + u * f.dim, stochastic, s, rows[u], w + rows[u] * f.row_bytes());
}

/// The commit, step 2: sort keys grouping the updated rows by set, candidates of a set in
/// priority order: (set << 31) | (INT32_MAX - count) for LFU, set << 31 for LRU; the values
/// (unique-row positions, ascending) break ties, since the sort is stable.
__global__ void commit_keys_kernel(const int64_t* rows, int64_t nu, const int32_t* counts,
                                   bool lfu, int64_t num_sets, uint64_t* keys, int64_t* vals) {
  for (int64_t u = thread_global(); u < nu; u += threads_in_grid()) {
    const uint64_t set = (uint64_t)set_of_row(rows[u], num_sets);
    const uint64_t inv = lfu ? (uint64_t)(0x7fffffff - counts[rows[u]]) : 0;
    keys[u] = (set << 31) | inv;
    vals[u] = u;
  }
}

/// The commit, step 3: one warp per touched set (the warp at the first sorted position of
/// the set; the others return) applies docs/contract.md §4: updated residents take their new value;
/// the slots are ranked by priority (empty first, ties by way) with shuffles; candidate k
/// (k-th non-resident in priority order) replaces the slot of rank k iff its priority is
/// strictly higher, writing the evicted row back; other candidates bypass into the table.
/// Every row written to the table is quantized by one lane with quantize_row.
/// stats[0..3] += unique hits, insertions, evictions, bypasses.
__global__ void commit_sets_kernel(uint8_t* w, int32_t* tags, float* cache_rows,
                                   int32_t* priority, const int32_t* counts,
                                   const int64_t* rows, const float* fresh,
                                   const int64_t* slot_of, const uint64_t* keys,
                                   const int64_t* vals, int64_t nu, RowFormat f,
                                   bool stochastic, bool lfu, RoundingStream s, int64_t step,
                                   int64_t ways, unsigned long long* stats) {
  const unsigned lane = lane_id();
  const int dim = f.dim;
  const int64_t kEmpty = INT64_MIN;
  for (int64_t first = warp_global(); first < nu; first += warps_in_grid()) {
    const uint64_t set = keys[first] >> 31;
    if (first > 0 && (keys[first - 1] >> 31) == set) continue;  // not the set's first row
    // The end of the set's rows: the first later position of another set (ballot search).
    int64_t end = nu;
    for (int64_t c0 = first + 1; c0 < nu; c0 += 32) {
      const int64_t k = c0 + lane;
      const unsigned m = __ballot_sync(kFullMask, k < nu && (keys[k] >> 31) != set);
      if (m) {
        end = c0 + (__ffs(m) - 1);
        break;
      }
    }
    const int64_t base = (int64_t)set * ways;
    unsigned long long hits = 0, ins = 0, evict = 0, bypass = 0;
    // 1. Updated residents stay, with their new value and priority (LRU: the step; LFU:
    //    a copy of the row's count, so that step 2 reads no random counts).
    for (int64_t c0 = first; c0 < end; c0 += 32) {
      const int64_t k = c0 + lane;
      if (k < end) {
        const int64_t u = vals[k], slot = slot_of[u];
        if (slot >= 0) {
          for (int j = 0; j < dim; ++j) cache_rows[slot * dim + j] = fresh[u * dim + j];
          priority[slot] = lfu ? counts[rows[u]] : (int32_t)step;
          ++hits;
        }
      }
    }
    __syncwarp(kFullMask);
    // 2. Rank the slots by priority ascending, ties by way: lane w holds way w.
    int64_t prio = INT64_MAX;
    if ((int64_t)lane < ways) {
      prio = tags[base + lane] < 0 ? kEmpty : (int64_t)priority[base + lane];
    }
    int rank = 0;
    for (int o = 0; o < 32; ++o) {
      const int64_t p = __shfl_sync(kFullMask, prio, o);
      if (o < ways && (p < prio || (p == prio && o < (int)lane))) ++rank;
    }
    // Lane r learns the way of rank r and its priority.
    int way_of_rank = 0;
    for (int o = 0; o < 32; ++o) {
      const int r = __shfl_sync(kFullMask, rank, o);
      if (o < ways && r == (int)lane) way_of_rank = o;
    }
    const int64_t prio_of_rank = __shfl_sync(kFullMask, prio, way_of_rank);
    // 3. Candidates in priority order: the k-th may take the slot of rank k.
    int64_t before = 0;
    for (int64_t c0 = first; c0 < end; c0 += 32) {
      const int64_t k = c0 + lane;
      const int64_t u = k < end ? vals[k] : -1;
      const bool cand = k < end && slot_of[u] < 0;
      const unsigned m = __ballot_sync(kFullMask, cand);
      const int64_t r = before + __popc(m & ((1u << lane) - 1u));
      before += __popc(m);
      const int src = r < 32 ? (int)r : 0;
      const int way = __shfl_sync(kFullMask, way_of_rank, src);
      const int64_t slot_prio = __shfl_sync(kFullMask, prio_of_rank, src);
      if (!cand) continue;
      const int64_t row = rows[u];
      const int64_t p = lfu ? (int64_t)counts[row] : step;
      if (r < ways && p > slot_prio) {
        const int64_t slot = base + way;
        const int32_t old = tags[slot];
        if (old >= 0) {
          quantize_row(f, cache_rows + slot * dim, stochastic, s, old,
                       w + (int64_t)old * f.row_bytes());
          ++evict;
        }
        tags[slot] = (int32_t)row;
        for (int j = 0; j < dim; ++j) cache_rows[slot * dim + j] = fresh[u * dim + j];
        priority[slot] = (int32_t)p;
        ++ins;
      } else {
        quantize_row(f, fresh + u * dim, stochastic, s, row, w + row * f.row_bytes());
        ++bypass;
      }
    }
    if (hits) atomicAdd(&stats[0], hits);
    if (ins) atomicAdd(&stats[1], ins);
    if (evict) atomicAdd(&stats[2], evict);
    if (bypass) atomicAdd(&stats[3], bypass);
  }
}

/// flush: one thread per slot writes its row back and empties it; counter[0] += rows.
__global__ void flush_kernel(uint8_t* w, int32_t* tags, const float* cache_rows, int64_t slots,
                             RowFormat f, bool stochastic, RoundingStream s,
                             unsigned long long* counter) {
  for (int64_t i = thread_global(); i < slots; i += threads_in_grid()) {
    const int32_t tag = tags[i];
    if (tag < 0) continue;
    quantize_row(f, cache_rows + i * f.dim, stochastic, s, tag, w + (int64_t)tag * f.row_bytes());
    tags[i] = -1;
    atomicAdd(counter, 1ull);
  }
}

// ---------------------------------------------------------------------------------------
// Host orchestration (pointers are device pointers; `stream` is a cudaStream_t or unused)
// ---------------------------------------------------------------------------------------

inline dim3 grid_threads(int64_t n) { return dim3((unsigned)grid_for((n + kThreadsPerBlock - 1) / kThreadsPerBlock)); }
inline dim3 grid_warps(int64_t n) { return grid_threads(n * 32); }
inline dim3 block_dim() { return dim3((unsigned)kThreadsPerBlock); }

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

inline void fail(const std::string& msg) { throw std::runtime_error("embcache (cuda): " + msg); }

inline void throw_errors(unsigned long long bits) {
  if (bits & kBadOffsets) fail("offsets must start at 0, not decrease and end at len(indices)");
  if (bits & kBadIndex) fail("an index is out of range");
  if (bits & kBadUniqueRows) fail("unique rows must be ascending and in range");
}

/// Returns -1, or the first row position whose values cannot be stored.
int64_t quantize_rows(const float* x, const int64_t* ids, int64_t n, RowFormat f,
                             bool stochastic, RoundingStream s, uint8_t* out, Stream stream) {
  if (n == 0) return -1;
  Scratch flag(sizeof(unsigned long long), stream);
  unsigned long long none = ~0ull;
  copy_to_device(flag.p, &none, sizeof(none), stream);
  EC_LAUNCH(quantize_rows_kernel, grid_threads(n), block_dim(), stream, x, ids, n, f,
            stochastic, s, out, flag.as<unsigned long long>());
  unsigned long long bad = 0;
  copy_to_host(&bad, flag.p, sizeof(bad), stream);
  return bad == ~0ull ? -1 : (int64_t)bad;
}

void dequantize_rows(const uint8_t* w, int64_t n, RowFormat f, float* out, Stream stream) {
  if (n == 0) return;
  EC_LAUNCH(dequantize_rows_kernel, grid_warps(n), block_dim(), stream, w, n, f, out);
}

/// Pools [nb, dim] into out; returns the number of lookups that hit the cache.
int64_t lookup_forward(const uint8_t* w, int64_t num_rows, const int32_t* tags,
                       const float* cache_rows, const int64_t* idx, const int64_t* off,
                       int64_t nb, int64_t lo, int64_t hi, const float* psw, RowFormat f,
                       int64_t num_sets, int64_t ways, bool mean, float* out,
                       int64_t out_stride, Stream stream) {
  if (ways > 32) fail("associativity above 32 is not supported on CUDA");
  if (nb == 0) return 0;
  Scratch counters(2 * sizeof(unsigned long long), stream);
  dev_zero(counters.p, 2 * sizeof(unsigned long long), stream);
  EC_LAUNCH(lookup_forward_kernel, grid_warps(nb), block_dim(), stream, w, num_rows, tags,
            cache_rows, idx, off, nb, lo, hi, psw, f, num_sets, ways, mean, out, out_stride,
            counters.as<unsigned long long>());
  unsigned long long host[2];
  copy_to_host(host, counters.p, sizeof(host), stream);
  throw_errors(host[0]);
  return (int64_t)host[1];
}

int64_t dedup_backward(const int64_t* idx, const int64_t* off, int64_t nb, int64_t lo,
                       int64_t hi, const float* psw, const float* g, int64_t g_stride, int dim,
                       bool mean, DedupAlloc alloc, void* alloc_ctx, Stream stream) {
  if (hi >= (int64_t(1) << 32)) fail("at most 2^32 lookups per call");
  if (lo < 0 || hi < lo) fail("bad range of lookups");
  const int64_t n = hi - lo;
  Scratch keys(n * 8, stream), bag_of(n * 8, stream), starts((n + 1) * 8, stream);
  Scratch counters(2 * sizeof(unsigned long long), stream);
  dev_zero(counters.p, 2 * sizeof(unsigned long long), stream);
  unsigned long long* cnt = counters.as<unsigned long long>();
  // Sort (row, position) pairs packed in one key: rows ascending, positions in order.
  if (nb > 0)
    EC_LAUNCH(dedup_keys_kernel, grid_threads(nb), block_dim(), stream, idx, off, nb, lo, hi,
              bag_of.as<int64_t>(), keys.as<uint64_t>(), cnt);
  if (n > 0) {
    sort_keys_u64(keys.as<uint64_t>(), n, stream);
    Scratch flag(n * 8, stream), excl(n * 8, stream);
    EC_LAUNCH(segment_flags_kernel, grid_threads(n), block_dim(), stream,
              (const uint64_t*)keys.as<uint64_t>(), n, 32, flag.as<int64_t>());
    exclusive_sum_i64(flag.as<int64_t>(), excl.as<int64_t>(), n, stream);
    EC_LAUNCH(segment_starts_kernel, grid_threads(n), block_dim(), stream,
              (const int64_t*)flag.as<int64_t>(), (const int64_t*)excl.as<int64_t>(), n,
              starts.as<int64_t>(), cnt);
  }
  unsigned long long host[2];
  copy_to_host(host, counters.p, sizeof(host), stream);
  throw_errors(host[0]);
  const int64_t nu = (int64_t)host[1];
  const DedupOutputs out = alloc(alloc_ctx, nu);
  if (nu > 0)
    EC_LAUNCH(dedup_sum_kernel, grid_warps(nu), block_dim(), stream,
              (const uint64_t*)keys.as<uint64_t>(), (const int64_t*)starts.as<int64_t>(), nu,
              (const int64_t*)bag_of.as<int64_t>(), lo, off, psw, g, g_stride, dim, mean,
              out.rows, out.grads, out.occ);
  return nu;
}

/// The first half of the update; returns the smallest row that cannot be stored, or -1.
int64_t update_prepare(const uint8_t* w, int64_t num_rows, const int32_t* tags,
                              const float* cache_rows, const float* state, const int64_t* rows,
                              int64_t nu, const float* g, RowFormat f, bool stochastic, int opt,
                              float lr, float eps, int64_t num_sets, int64_t ways, float* fresh,
                              float* fresh_state, int64_t* slots, Stream stream) {
  if (ways > 32) fail("associativity above 32 is not supported on CUDA");
  if (nu == 0) return -1;
  Scratch flags(2 * sizeof(unsigned long long), stream);
  unsigned long long init[2] = {0ull, ~0ull};
  copy_to_device(flags.p, init, sizeof(init), stream);
  EC_LAUNCH(update_prepare_kernel, grid_warps(nu), block_dim(), stream, w, num_rows, tags,
            cache_rows, state, rows, nu, g, f, stochastic, opt, lr, eps, num_sets, ways, fresh, fresh_state,
            slots, flags.as<unsigned long long>());
  unsigned long long host[2];
  copy_to_host(host, flags.p, sizeof(host), stream);
  throw_errors(host[0]);
  return host[1] == ~0ull ? -1 : (int64_t)host[1];
}

/// The second half: writes the prepared update. stats_out = [unique hits, unique misses,
/// insertions, evictions, bypasses] (host memory).
void update_commit(uint8_t* w, int32_t* tags, float* cache_rows, int32_t* priority,
                          int32_t* counts, float* state, const int64_t* rows, int64_t nu,
                          const float* fresh, const float* fresh_state, int64_t sw,
                          const int64_t* slots, const int64_t* occ, RowFormat f,
                          bool stochastic, bool lfu, RoundingStream s, int64_t step,
                          int64_t num_sets, int64_t ways, int64_t* stats_out, Stream stream) {
  if (ways > 32) fail("associativity above 32 is not supported on CUDA");
  for (int i = 0; i < 5; ++i) stats_out[i] = 0;
  if (nu == 0) return;
  EC_LAUNCH(commit_state_kernel, grid_warps(nu), block_dim(), stream, state, counts, rows, nu,
            fresh_state, sw, occ, lfu);
  if (num_sets == 0) {
    EC_LAUNCH(commit_bypass_kernel, grid_threads(nu), block_dim(), stream, w, rows, nu, fresh,
              f, stochastic, s);
    stats_out[1] = nu;
    stats_out[4] = nu;
    return;
  }
  Scratch keys(nu * 8, stream), vals(nu * 8, stream), st(4 * sizeof(unsigned long long), stream);
  dev_zero(st.p, 4 * sizeof(unsigned long long), stream);
  EC_LAUNCH(commit_keys_kernel, grid_threads(nu), block_dim(), stream, rows, nu,
            (const int32_t*)counts, lfu, num_sets, keys.as<uint64_t>(), vals.as<int64_t>());
  sort_pairs_u64_i64(keys.as<uint64_t>(), vals.as<int64_t>(), nu, stream);
  EC_LAUNCH(commit_sets_kernel, grid_warps(nu), block_dim(), stream, w, tags, cache_rows,
            priority, (const int32_t*)counts, rows, fresh, slots,
            (const uint64_t*)keys.as<uint64_t>(), (const int64_t*)vals.as<int64_t>(), nu, f,
            stochastic, lfu, s, step, ways, st.as<unsigned long long>());
  unsigned long long host[4];
  copy_to_host(host, st.p, sizeof(host), stream);
  stats_out[0] = (int64_t)host[0];
  stats_out[1] = nu - (int64_t)host[0];
  stats_out[2] = (int64_t)host[1];
  stats_out[3] = (int64_t)host[2];
  stats_out[4] = (int64_t)host[3];
}

/// Writes every cached row back and empties the cache; returns the number of rows written.
/// (The caller zeroes the priorities.)
int64_t cache_flush(uint8_t* w, int32_t* tags, const float* cache_rows, int64_t slots,
                           RowFormat f, bool stochastic, RoundingStream s, Stream stream) {
  if (slots == 0) return 0;
  Scratch counter(sizeof(unsigned long long), stream);
  dev_zero(counter.p, sizeof(unsigned long long), stream);
  EC_LAUNCH(flush_kernel, grid_threads(slots), block_dim(), stream, w, tags, cache_rows, slots,
            f, stochastic, s, counter.as<unsigned long long>());
  unsigned long long host = 0;
  copy_to_host(&host, counter.p, sizeof(host), stream);
  return (int64_t)host;
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
