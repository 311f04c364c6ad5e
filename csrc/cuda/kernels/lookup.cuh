// The forward kernel (docs/contract.md §4.3 step 1): one warp per bag.
#pragma once

#include "stage.cuh"

namespace embcache {
namespace EMBCACHE_GPU_NS {

/// Pooled lookups: one warp per bag, lookups in order, the sums (or maxima) in registers (a
/// tile of Chunks * 32 elements at a time); bag b is written to out[b * out_stride + j].
/// Max: each element the maximum by csrc/cpu/lookup.cpp's rule (max_bags), the position of
/// its lookup written to argmax[b * argmax_stride + j] (-1 for an empty bag); else the sum,
/// the mean if `mean`. A miss reads its row from `stage` where it holds a fresh copy, else
/// from the table w. *errors |= error bits; unless counts is null, counts[0] += the bags'
/// lookups (by the warp of bag 0) and counts[1] += cache hits.
template <int Chunks, bool Max>
__device__ __forceinline__ void pool_bags_warp(const uint8_t* w, int64_t num_rows,
                                               const int32_t* tags, const float* cache_rows,
                                               const Bags& bags, const Stage& stage,
                                               const RowFormat& f,
                                               const SetDivisor& sets, int64_t ways, bool mean,
                                               float* out, int64_t out_stride, int32_t* argmax,
                                               int64_t argmax_stride, unsigned long long* errors,
                                               unsigned long long* counts) {
  const int lane = (int)lane_id();
  const int dim = f.dim;
  const int64_t* idx = bags.idx;
  const float* psw = bags.psw;
  if (counts && lane == 0 && warp_global() == 0) {
    const int64_t lookups = bags.off[bags.first + bags.nb] - bags.off[bags.first];
    if (lookups > 0) atomicAdd(&counts[0], (unsigned long long)lookups);
  }
  for (int64_t b = warp_global(); b < bags.nb; b += warps_in_grid()) {
    float* row_out = out + b * out_stride;
    const int64_t g = bags.first + b, start = bags.off[g], end = bags.off[g + 1];
    if (!bag_is_valid(start, end, g, bags.total, bags.n)) {
      if (lane == 0) atomicOr(errors, (unsigned long long)kBadOffsets);
      for (int j = lane; j < dim; j += 32) row_out[j] = 0.f;
      continue;
    }
    unsigned long long bag_hits = 0;
    for (int tile = 0; tile < dim; tile += Chunks * 32) {
      float acc[Chunks];
      int32_t arg[Max ? Chunks : 1];  // the lookup of each maximum
#pragma unroll
      for (int k = 0; k < Chunks; ++k) acc[k] = 0.f;
#pragma unroll
      for (int k = 0; k < (Max ? Chunks : 0); ++k) arg[k] = -1;
      for (int64_t l = start; l < end; ++l) {
        // element k of this lookup's row, of value v, pooled
        auto add = [&](int k, float v, float s) {
          if constexpr (Max) {
            if (l == start || v > acc[k]) {
              acc[k] = v;
              arg[k] = (int32_t)l;
            }
          } else {
            acc[k] = psw ? acc[k] + s * v : acc[k] + v;
          }
        };
        const int64_t row = idx[l];
        if (row < 0 || row >= num_rows) {
          if (lane == 0) atomicOr(errors, (unsigned long long)kBadIndex);
          continue;
        }
        const int64_t slot = warp_find_slot(tags, sets, ways, row);
        const float s = psw ? psw[l] : 0.f;
        if (slot >= 0) {
          if (tile == 0) ++bag_hits;
          const float* v = cache_rows + slot * dim;
#pragma unroll
          for (int k = 0; k < Chunks; ++k) {
            const int j = tile + lane + 32 * k;
            if (j < dim) add(k, v[j], s);
          }
        } else {
          const uint8_t* staged = staged_row(stage, row, f.row_bytes());
          const uint8_t* r = staged ? staged : w + row * f.row_bytes();
          float scale = 0.f, bias = 0.f;
          if (f.is_int()) load_qparams(f, r, &scale, &bias);
#pragma unroll
          for (int k = 0; k < Chunks; ++k) {
            const int j = tile + lane + 32 * k;
            if (j < dim) {
              add(k, dequantize_element(f, r, j, scale, bias), s);
            }
          }
        }
      }
      const int64_t len = end - start;
#pragma unroll
      for (int k = 0; k < Chunks; ++k) {
        const int j = tile + lane + 32 * k;
        if (j < dim) row_out[j] = mean && len > 0 ? acc[k] / (float)len : acc[k];
        if constexpr (Max)
          if (j < dim) argmax[b * argmax_stride + j] = arg[k];
      }
    }
    if (counts && lane == 0 && bag_hits) atomicAdd(&counts[1], bag_hits);
  }
}

/// pool_bags_warp of sums or means.
template <int Chunks>
__global__ void pool_bags_kernel(const uint8_t* w, int64_t num_rows, const int32_t* tags,
                                 const float* cache_rows, Bags bags, Stage stage, RowFormat f,
                                 SetDivisor sets, int64_t ways, bool mean, float* out,
                                 int64_t out_stride, unsigned long long* errors,
                                 unsigned long long* counts) {
  pool_bags_warp<Chunks, false>(w, num_rows, tags, cache_rows, bags, stage, f, sets, ways, mean, out,
                                out_stride, nullptr, 0, errors, counts);
}

/// pool_bags_warp of maxima.
template <int Chunks>
__global__ void max_bags_kernel(const uint8_t* w, int64_t num_rows, const int32_t* tags,
                                const float* cache_rows, Bags bags, Stage stage, RowFormat f,
                                SetDivisor sets, int64_t ways, float* out, int64_t out_stride,
                                int32_t* argmax, int64_t argmax_stride,
                                unsigned long long* errors, unsigned long long* counts) {
  pool_bags_warp<Chunks, true>(w, num_rows, tags, cache_rows, bags, stage, f, sets, ways, false, out,
                               out_stride, argmax, argmax_stride, errors, counts);
}

void pool_bags(const TableSpec& t, const TableState& state, const Bags& bags, const Stage& stage,
               float* out, int64_t out_stride, int32_t* argmax, int64_t argmax_stride,
               unsigned long long* errors, unsigned long long* counts, Stream stream) {
  if (bags.nb == 0) return;
  if (t.pooling == kMax)
    EC_LAUNCH_TILED(max_bags_kernel, t.f.dim, grid_warps(bags.nb), block_dim(), stream,
                    state.weights, t.rows, state.cache_tags, state.cache_rows, bags, stage, t.f,
                    t.set_divisor, t.ways, out, out_stride, argmax, argmax_stride, errors, counts);
  else
    EC_LAUNCH_TILED(pool_bags_kernel, t.f.dim, grid_warps(bags.nb), block_dim(), stream,
                    state.weights, t.rows, state.cache_tags, state.cache_rows, bags, stage, t.f,
                    t.set_divisor, t.ways, t.pooling == kMean, out, out_stride, errors, counts);
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
