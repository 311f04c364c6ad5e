// The host API of the cache kernels (csrc/cuda/kernels/*.cuh), one function per phase: plain
// functions over a table's decoded spec and raw device pointers, no CUDA or torch types, so
// the torch glue compiles without nvcc and the same declarations serve the CUDA build
// (namespace embcache::gpu) and the warp-emulator build (namespace embcache::emu, see
// csrc/emulated/emu_ops.cpp).
//
// Every function checks every launch and throws std::runtime_error on a CUDA error or on
// invalid input found by a kernel (bad offsets, out-of-range indices, unsorted unique
// rows); functions that change state validate first and change nothing when they throw.
#pragma once

#include <stdint.h>

#include "embcache/rowquant.h"
#include "embcache/table_spec.h"

#ifndef EMBCACHE_GPU_NS
#define EMBCACHE_GPU_NS gpu
#endif

namespace embcache {
namespace EMBCACHE_GPU_NS {

using Stream = void*;  // a cudaStream_t (unused by the emulator)

/// out[r] = the row x[r] stored in format f. Returns -1, or the first position r whose row
/// cannot be stored (nothing is guaranteed about out then).
int64_t quantize_rows(const float* x, const int64_t* ids, int64_t n, RowFormat f,
                      bool stochastic, RoundingStream s, uint8_t* out, Stream stream);

void dequantize_rows(const uint8_t* w, int64_t n, RowFormat f, float* out, Stream stream);

/// Writes every cached row back (rounded with `s`) and empties the tags; returns the number
/// of rows written. (The caller zeroes the cache rows and priorities.)
int64_t flush_cache(const TableSpec& t, const TableState& state, RoundingStream s,
                    Stream stream);

/// Bags of lookups: bag b covers positions [off[b], off[b+1]) of idx and psw (psw may be
/// null); the nb bags must tile positions [lo, hi) (checked by the kernels). A feature of a
/// KeyedJaggedTensor is such a view of the global arrays.
struct Bags {
  const int64_t* idx;
  const int64_t* off;
  int64_t nb, lo, hi;
  const float* psw;
};

/// The forward: the bags pooled from table `t` (sum, or mean if t.mean) into
/// out[b * out_stride + j]; returns the number of lookups that found their row cached.
int64_t pool_bags(const TableSpec& t, const TableState& state, const Bags& bags, float* out,
                  int64_t out_stride, Stream stream);

/// Where dedup_bags writes its outputs once it knows the number of unique rows.
struct DedupOutputs {
  int64_t* rows;   // [nu]
  float* grads;    // [nu, dim]
  int64_t* occ;    // [nu]
};
using DedupAlloc = DedupOutputs (*)(void* ctx, int64_t nu);

/// The backward: the gradient per unique row of the bags, rows ascending, contributions
/// summed in lookup order; the gradient of bag b is g[b * g_stride + j]. Returns nu.
int64_t dedup_bags(const Bags& bags, const float* g, int64_t g_stride, int dim, bool mean,
                   DedupAlloc alloc, void* alloc_ctx, Stream stream);

/// The update's first phase (changes nothing): every unique row's slot, new value and new
/// optimizer state. Returns the smallest row whose new value cannot be stored, or -1.
int64_t compute_update(const TableSpec& t, const TableState& state, const int64_t* rows,
                       int64_t nu, const float* g, float* fresh, float* fresh_state,
                       int64_t* slots, Stream stream);

/// The update's second phase: writes what compute_update computed: optimizer state, LFU
/// counts, then one warp per touched set applies the insert/evict/bypass rule; update `step`
/// keys the rounding and is LRU's priority. stats_out (host, 5 entries) = [unique hits,
/// unique misses, insertions, evictions, bypasses].
void commit_update(const TableSpec& t, const TableState& state, const int64_t* rows, int64_t nu,
                   const float* fresh, const float* fresh_state, const int64_t* slots,
                   const int64_t* occ, int64_t step, int64_t* stats_out, Stream stream);

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
