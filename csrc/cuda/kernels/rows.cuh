// Row conversion and write-back kernels: values to stored rows and back (docs/contract.md
// §2-3), and the flush that rounds every cached row into its table.
#pragma once

#include "common.cuh"

namespace embcache {
namespace EMBCACHE_GPU_NS {

/// quantize_rows: one warp per row. flags[0] = min bad row position (~0: none).
__global__ void quantize_rows_kernel(const float* x, const int64_t* ids, int64_t n, RowFormat f,
                                     bool stochastic, RoundingStream s, uint8_t* out,
                                     unsigned long long* first_bad) {
  for (int64_t r = warp_global(); r < n; r += warps_in_grid()) {
    const float* xr = x + r * f.dim;
    if (!warp_row_is_storable(f, xr, stochastic)) {
      if (lane_id() == 0) atomicMin(first_bad, (unsigned long long)r);
      continue;
    }
    warp_quantize_row(f, xr, stochastic, s, ids[r], out + r * f.row_bytes());
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

/// flush: one warp per slot writes its row back (warp_quantize_row) and empties it;
/// counter[0] += rows.
__global__ void flush_kernel(uint8_t* w, int32_t* tags, const float* cache_rows, int64_t slots,
                             RowFormat f, bool stochastic, RoundingStream s,
                             unsigned long long* counter) {
  for (int64_t i = warp_global(); i < slots; i += warps_in_grid()) {
    const int32_t tag = tags[i];  // the same on every lane
    if (tag < 0) continue;
    warp_quantize_row(f, cache_rows + i * f.dim, stochastic, s, tag,
                      w + (int64_t)tag * f.row_bytes());
    __syncwarp(kFullMask);  // every lane has read the tag
    if (lane_id() == 0) {
      tags[i] = -1;
      atomicAdd(counter, 1ull);
    }
  }
}

int64_t quantize_rows(const float* x, const int64_t* ids, int64_t n, RowFormat f,
                      bool stochastic, RoundingStream s, uint8_t* out, Stream stream) {
  if (n == 0) return -1;
  Scratch flag(sizeof(unsigned long long), stream);
  dev_fill(flag.p, 0xff, sizeof(unsigned long long), stream);  // ~0: no bad row
  EC_LAUNCH(quantize_rows_kernel, grid_warps(n), block_dim(), stream, x, ids, n, f,
            stochastic, s, out, flag.as<unsigned long long>());
  unsigned long long bad = 0;
  copy_to_host(&bad, flag.p, sizeof(bad), stream);
  return bad == ~0ull ? -1 : (int64_t)bad;
}

void dequantize_rows(const uint8_t* w, int64_t n, RowFormat f, float* out, Stream stream) {
  if (n == 0) return;
  EC_LAUNCH(dequantize_rows_kernel, grid_warps(n), block_dim(), stream, w, n, f, out);
}

int64_t flush_cache(const TableSpec& t, const TableState& state, RoundingStream s,
                    Stream stream) {
  const int64_t slots = t.slots();
  if (slots == 0) return 0;
  Scratch counter(sizeof(unsigned long long), stream);
  dev_fill(counter.p, 0, sizeof(unsigned long long), stream);
  EC_LAUNCH(flush_kernel, grid_warps(slots), block_dim(), stream, state.weights,
            state.cache_tags, state.cache_rows, slots, t.f, t.stochastic, s,
            counter.as<unsigned long long>());
  unsigned long long host = 0;
  copy_to_host(&host, counter.p, sizeof(host), stream);
  return (int64_t)host;
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
