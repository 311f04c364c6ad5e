// The forward kernel (docs/contract.md §4.3 step 1): one warp per bag.
#pragma once

#include "common.cuh"

namespace embcache {
namespace EMBCACHE_GPU_NS {

/// Pooled lookups: one warp per bag, lookups in order, the sums in registers (a tile of
/// Chunks * 32 elements at a time); bag b is written to out[b * out_stride + j].
/// *errors |= error bits, *hits += cache hits. The lookups come 32 at a time: lane i reads
/// the i-th one's row, weight and set (one round of loads, and each lane hashes one row);
/// then the warp has kLoadsInFlight lookups' tag reads in flight, then their rows' reads,
/// before adding them in order.
template <int Chunks>
__global__ void pool_bags_kernel(const uint8_t* w, int64_t num_rows, const int32_t* tags,
                                 const float* cache_rows, Bags bags, RowFormat f,
                                 int64_t num_sets, int64_t ways, bool mean, float* out,
                                 int64_t out_stride, unsigned long long* errors,
                                 unsigned long long* hits) {
  const int lane = (int)lane_id();
  const int dim = f.dim;
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
#pragma unroll
      for (int k = 0; k < Chunks; ++k) acc[k] = 0.f;
      for (int64_t l0 = start; l0 < end; l0 += 32) {
        const int n = end - l0 < 32 ? (int)(end - l0) : 32;
        // Lane i: lookup l0 + i's row (-1: out of range, it adds nothing), weight and set.
        int64_t my_row = -1, my_set = 0;
        float my_weight = 0.f;
        if (lane < n) {
          my_row = bags.idx[l0 + lane];
          if (my_row < 0 || my_row >= num_rows) {
            if (tile == 0) atomicOr(errors, (unsigned long long)kBadIndex);
            my_row = -1;
          } else if (num_sets > 0) {
            my_set = set_of_row(my_row, num_sets);
          }
          if (bags.psw) my_weight = bags.psw[l0 + lane];
        }
        for (int i0 = 0; i0 < n; i0 += kLoadsInFlight) {
          int64_t row[kLoadsInFlight], base[kLoadsInFlight];
          int32_t tag[kLoadsInFlight];
#pragma unroll
          for (int i = 0; i < kLoadsInFlight; ++i) {
            row[i] = __shfl_sync(kFullMask, my_row, (i0 + i) & 31);
            base[i] = __shfl_sync(kFullMask, my_set, (i0 + i) & 31) * ways;
            if (i0 + i >= n) row[i] = -1;
            tag[i] = row[i] >= 0 && num_sets > 0 && lane < ways ? tags[base[i] + lane] : -1;
          }
          int64_t slot[kLoadsInFlight];
#pragma unroll
          for (int i = 0; i < kLoadsInFlight; ++i) {
            const unsigned m = __ballot_sync(kFullMask, row[i] >= 0 && tag[i] == row[i]);
            slot[i] = m ? base[i] + (__ffs(m) - 1) : -1;
          }
          float v[kLoadsInFlight][Chunks];
#pragma unroll
          for (int i = 0; i < kLoadsInFlight; ++i) {
            const float* cached = slot[i] >= 0 ? cache_rows + slot[i] * dim : nullptr;
            const uint8_t* r = row[i] >= 0 ? w + row[i] * f.row_bytes() : nullptr;
            float scale = 0.f, bias = 0.f;
            if (!cached && r && f.is_int()) load_qparams(f, r, &scale, &bias);
#pragma unroll
            for (int k = 0; k < Chunks; ++k) {
              const int j = tile + lane + 32 * k;
              v[i][k] = j >= dim || !r ? 0.f
                        : cached       ? cached[j]
                                       : dequantize_element(f, r, j, scale, bias);
            }
          }
#pragma unroll
          for (int i = 0; i < kLoadsInFlight; ++i) {
            const float s = __shfl_sync(kFullMask, my_weight, (i0 + i) & 31);
            if (row[i] < 0) continue;
            if (tile == 0 && slot[i] >= 0) ++bag_hits;
#pragma unroll
            for (int k = 0; k < Chunks; ++k)
              acc[k] = bags.psw ? acc[k] + s * v[i][k] : acc[k] + v[i][k];
          }
        }
      }
      const int64_t len = end - start;
#pragma unroll
      for (int k = 0; k < Chunks; ++k) {
        const int j = tile + lane + 32 * k;
        if (j < dim) row_out[j] = mean && len > 0 ? acc[k] / (float)len : acc[k];
      }
    }
    if (lane == 0 && bag_hits) atomicAdd(hits, bag_hits);
  }
}

void pool_bags(const TableSpec& t, const TableState& state, const Bags& bags, float* out,
               int64_t out_stride, unsigned long long* errors, unsigned long long* hits,
               Stream stream) {
  if (bags.nb == 0) return;
  EC_LAUNCH_TILED(pool_bags_kernel, t.f.dim, grid_warps(bags.nb), block_dim(), stream,
                  state.weights, t.rows, state.cache_tags, state.cache_rows, bags, t.f,
                  t.num_sets, t.ways, t.mean, out, out_stride, errors, hits);
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
