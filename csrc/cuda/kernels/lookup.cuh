// The forward kernel (docs/contract.md §4.3 step 1): one warp per bag.
#pragma once

#include "common.cuh"

namespace embcache {
namespace EMBCACHE_GPU_NS {

/// Pooled lookups: one warp per bag, lookups in order, the sums in registers (a tile of
/// Chunks * 32 elements at a time); bag b is written to out[b * out_stride + j].
/// *errors |= error bits, *hits += cache hits.
template <int Chunks>
__global__ void pool_bags_kernel(const uint8_t* w, int64_t num_rows, const int32_t* tags,
                                 const float* cache_rows, Bags bags, RowFormat f,
                                 SetDivisor sets, int64_t ways, bool mean, float* out,
                                 int64_t out_stride, unsigned long long* errors,
                                 unsigned long long* hits) {
  const int lane = (int)lane_id();
  const int dim = f.dim;
  const int64_t* idx = bags.idx;
  const float* psw = bags.psw;
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
      for (int64_t l = start; l < end; ++l) {
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
            if (j < dim) acc[k] = psw ? acc[k] + s * v[j] : acc[k] + v[j];
          }
        } else {
          const uint8_t* r = w + row * f.row_bytes();
          float scale = 0.f, bias = 0.f;
          if (f.is_int()) load_qparams(f, r, &scale, &bias);
#pragma unroll
          for (int k = 0; k < Chunks; ++k) {
            const int j = tile + lane + 32 * k;
            if (j < dim) {
              const float v = dequantize_element(f, r, j, scale, bias);
              acc[k] = psw ? acc[k] + s * v : acc[k] + v;
            }
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
                  t.set_divisor, t.ways, t.mean, out, out_stride, errors, hits);
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
