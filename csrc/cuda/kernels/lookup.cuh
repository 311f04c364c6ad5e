// The forward kernel (docs/contract.md §4.3 step 1): one warp per bag.
#pragma once

#include "common.cuh"

namespace embcache {
namespace EMBCACHE_GPU_NS {

/// Pooled lookups: one warp per bag, lanes over the elements, lookups in order; bag b is
/// written to out[b * out_stride + j]. counters[0] |= error bits, counters[1] += cache hits.
__global__ void pool_bags_kernel(const uint8_t* w, int64_t num_rows, const int32_t* tags,
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

int64_t pool_bags(const TableSpec& t, const TableState& state, const Bags& bags, float* out,
                  int64_t out_stride, Stream stream) {
  if (bags.nb == 0) return 0;
  Scratch counters(2 * sizeof(unsigned long long), stream);
  dev_zero(counters.p, 2 * sizeof(unsigned long long), stream);
  EC_LAUNCH(pool_bags_kernel, grid_warps(bags.nb), block_dim(), stream, state.weights,
            t.rows, state.cache_tags, state.cache_rows, bags.idx, bags.off, bags.nb, bags.lo,
            bags.hi, bags.psw, t.f, t.num_sets, t.ways, t.mean, out, out_stride,
            counters.as<unsigned long long>());
  unsigned long long host[2];
  copy_to_host(host, counters.p, sizeof(host), stream);
  throw_errors(host[0]);
  return (int64_t)host[1];
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
