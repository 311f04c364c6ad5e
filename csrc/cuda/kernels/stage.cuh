// Staging (docs/design.md, "Prefetch"): copies of the stored rows a batch will miss, made
// ahead into device memory (keys, sort, copy), read by the forward and the update in place of
// the table's (staged_row), and marked stale by an update that may have written their rows.
#pragma once

#include "common.cuh"

namespace embcache {
namespace EMBCACHE_GPU_NS {

/// The fresh copy of `row` (of `bytes` stored bytes) that `stage` holds for its table, or
/// null (also where a stage's rows are too narrow for it: a stage of other tables). All lanes
/// of a warp may call it with the same row (the same answer).
__device__ __forceinline__ const uint8_t* staged_row(const Stage& stage, int64_t row,
                                                     int64_t bytes) {
  if (!stage.keys || bytes > stage.stride) return nullptr;
  const int64_t key = stage_key(stage.table, row);
  const int64_t k = lower_bound_key(stage.keys, stage.n, key);
  return k < stage.n && stage.keys[k] == key ? stage.rows + k * stage.stride : nullptr;
}

/// Staging, step 1, one warp per bag of every feature (bag g is feature g / batch's, looked
/// up in tables[feature_table[f]]): each lookup of a staged table's valid row that is not
/// cached gets its key at its place in `keys`.
__global__ void stage_keys_kernel(const StagedTable* tables, const int64_t* feature_table,
                                  Bags bags, int64_t batch, int64_t* keys) {
  const unsigned lane = lane_id();
  for (int64_t b = warp_global(); b < bags.nb; b += warps_in_grid()) {
    const int64_t g = bags.first + b, start = bags.off[g], end = bags.off[g + 1];
    const int64_t position = feature_table[g / batch];
    const StagedTable& T = tables[position];
    if (!T.staged || !bag_is_valid(start, end, g, bags.total, bags.n)) continue;
    for (int64_t l = start; l < end; ++l) {
      const int64_t row = bags.idx[l];
      if (row < 0 || row >= T.t.rows) continue;
      const int64_t slot = warp_find_slot(T.state.cache_tags, T.t.set_divisor, T.t.ways, row);
      if (lane == 0 && slot < 0) keys[l] = stage_key(position, row);
    }
  }
}

/// Staging, step 3, one warp per sorted entry that is the first of its key: the row's stored
/// bytes copied from its table (tables[position]) into rows + k * stride, by words where
/// the row is a whole number of them.
__global__ void stage_copy_kernel(const StagedTable* tables, const int64_t* keys, int64_t n,
                                  uint8_t* rows, int64_t stride) {
  const unsigned lane = lane_id();
  for (int64_t k = warp_global(); k < n; k += warps_in_grid()) {
    const int64_t key = keys[k];
    if (key == kNoStagedRow || (k > 0 && keys[k - 1] == key)) continue;
    const StagedTable& T = tables[staged_table(key)];
    const int64_t bytes = T.t.f.row_bytes();
    const uint8_t* from = T.state.weights + staged_row_id(key) * bytes;
    uint8_t* to = rows + k * stride;
    if (bytes % 4 == 0) {
      for (int64_t j = lane; j < bytes / 4; j += 32)
        reinterpret_cast<uint32_t*>(to)[j] = reinterpret_cast<const uint32_t*>(from)[j];
    } else {
      for (int64_t j = lane; j < bytes; j += 32) to[j] = from[j];
    }
  }
}

void stage_misses(const StagedTable* tables, int64_t nt, const Bags& bags, int64_t batch,
                  int64_t nf, const int64_t* feature_table, int64_t* keys, uint8_t* rows,
                  int64_t stride, Stream stream) {
  const int64_t n = bags.n;
  if (n == 0 || batch == 0) return;
  const DeviceArray<StagedTable> placed(tables, nt, stream);
  const DeviceArray<int64_t> features(feature_table, nf, stream);
  Bags all = bags;
  all.first = 0;
  all.nb = nf * batch;
  EC_LAUNCH(stage_keys_kernel, grid_warps(all.nb), block_dim(), stream, placed.get(),
            features.get(), all, batch, keys);
  // The keys as unsigned: kNoStagedRow, the largest, sorts last; bit 63 is always 0.
  Scratch positions(n * 8, stream);
  sort_pairs_u64_i64(reinterpret_cast<uint64_t*>(keys), positions.as<int64_t>(), n, 0, 63,
                     stream);
  EC_LAUNCH(stage_copy_kernel, grid_warps(n), block_dim(), stream, placed.get(), keys, n, rows,
            stride);
}

/// One thread per entry of a stage: key_after_update.
__global__ void unstage_kernel(int64_t* keys, int64_t n, const int64_t* rows, int64_t nrows,
                               const int64_t* ranges, const int64_t* range_of, int64_t nt) {
  for (int64_t k = thread_global(); k < n; k += threads_in_grid())
    keys[k] = key_after_update(keys[k], rows, nrows, ranges, range_of, nt);
}

void unstage_rows(int64_t* keys, int64_t n, const int64_t* rows, int64_t nrows,
                  const int64_t* ranges, const int64_t* range_of, int64_t nt, Stream stream) {
  if (n == 0 || nt == 0) return;
  const DeviceArray<int64_t> where(range_of, nt, stream);
  EC_LAUNCH(unstage_kernel, grid_threads(n), block_dim(), stream, keys, n, rows, nrows, ranges,
            where.get(), nt);
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
