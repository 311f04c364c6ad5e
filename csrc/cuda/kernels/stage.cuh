// Staging (docs/design.md, "Prefetch"): copies of the stored rows a batch will miss, put into
// a hash table in device memory in one launch (stage_rows_kernel), read by the forward and
// the update in place of the table's (staged_row), and marked stale by an update that may
// have written their rows (unstage_kernel).
#pragma once

#include "common.cuh"

namespace embcache {
namespace EMBCACHE_GPU_NS {

/// The fresh copy of `row` (of `bytes` stored bytes) that `stage` holds for its table, or
/// null (also where a stage's rows are too narrow for it: a stage of other tables). All lanes
/// of a warp may call it with the same row (the same answer).
__device__ __forceinline__ const uint8_t* staged_row(const Stage& stage, int64_t row,
                                                     int64_t bytes) {
  if (!stage.slots || bytes > stage.stride) return nullptr;
  const int64_t copy = find_staged(stage.slots, stage.mask, stage_key(stage.table, row));
  return copy < 0 ? nullptr : stage.rows + copy * stage.stride;
}

/// Puts `key` into the stage (mask + 1 entries `slots`): returns the index of its copy,
/// taken from *copies, if this call put it there, or -1 if it was there already (or the
/// stage is full, which its size rules out).
__device__ __forceinline__ int64_t insert_staged(int64_t* slots, int64_t mask, int64_t key,
                                                 unsigned long long* copies) {
  int64_t h = stage_hash(key, mask);
  for (int64_t probe = 0; probe <= mask; ++probe, h = (h + 1) & mask) {
    const unsigned long long before =
        atomicCAS(reinterpret_cast<unsigned long long*>(slots + 2 * h),
                  (unsigned long long)kNoStagedRow, (unsigned long long)key);
    if (before == (unsigned long long)kNoStagedRow) {
      const int64_t copy = (int64_t)atomicAdd(copies, 1ull);
      slots[2 * h + 1] = copy;
      return copy;
    }
    if (before == (unsigned long long)key) return -1;
  }
  return -1;
}

/// The staging, one warp per bag of every feature (bag g is feature g / batch's, looked up in
/// tables[feature_table[f]]): each lookup of a staged table's valid row that is not cached
/// puts its key into the stage, and the warp that put it copies the row (by words where the
/// row is a whole number of them).
__global__ void stage_rows_kernel(const StagedTable* tables, const int64_t* feature_table,
                                  Bags bags, int64_t batch, int64_t* slots, int64_t mask,
                                  unsigned long long* copies, uint8_t* rows, int64_t stride) {
  const unsigned lane = lane_id();
  for (int64_t b = warp_global(); b < bags.nb; b += warps_in_grid()) {
    const int64_t g = bags.first + b, start = bags.off[g], end = bags.off[g + 1];
    const int64_t position = feature_table[g / batch];
    const StagedTable& T = tables[position];
    if (!T.staged || !bag_is_valid(start, end, g, bags.total, bags.n)) continue;
    const int64_t bytes = T.t.f.row_bytes();
    for (int64_t l = start; l < end; ++l) {
      const int64_t row = bags.idx[l];
      if (row < 0 || row >= T.t.rows) continue;
      if (warp_find_slot(T.state.cache_tags, T.t.set_divisor, T.t.ways, row) >= 0) continue;
      int64_t copy = -1;
      if (lane == 0) copy = insert_staged(slots, mask, stage_key(position, row), copies);
      copy = __shfl_sync(kFullMask, copy, 0);
      if (copy < 0) continue;
      const uint8_t* from = T.state.weights + row * bytes;
      uint8_t* to = rows + copy * stride;
      if (bytes % 4 == 0) {
        for (int64_t j = lane; j < bytes / 4; j += 32)
          reinterpret_cast<uint32_t*>(to)[j] = reinterpret_cast<const uint32_t*>(from)[j];
      } else {
        for (int64_t j = lane; j < bytes; j += 32) to[j] = from[j];
      }
    }
  }
}

void stage_misses(const StagedTable* tables, int64_t nt, const Bags& bags, int64_t batch,
                  int64_t nf, const int64_t* feature_table, int64_t* slots, int64_t mask,
                  uint8_t* rows, int64_t stride, Stream stream) {
  if (bags.n == 0 || batch == 0) return;
  const DeviceArray<StagedTable> placed(tables, nt, stream);
  const DeviceArray<int64_t> features(feature_table, nf, stream);
  Scratch copies(sizeof(unsigned long long), stream);
  dev_fill(copies.p, 0, sizeof(unsigned long long), stream);
  Bags all = bags;
  all.first = 0;
  all.nb = nf * batch;
  EC_LAUNCH(stage_rows_kernel, grid_warps(all.nb), block_dim(), stream, placed.get(),
            features.get(), all, batch, slots, mask, copies.as<unsigned long long>(), rows,
            stride);
}

/// One thread per entry of a stage: its key after the update (key_after_update).
__global__ void unstage_kernel(int64_t* slots, int64_t n, const int64_t* rows, int64_t nrows,
                               const int64_t* ranges, const int64_t* range_of, int64_t nt) {
  for (int64_t h = thread_global(); h < n; h += threads_in_grid())
    slots[2 * h] = key_after_update(slots[2 * h], rows, nrows, ranges, range_of, nt);
}

void unstage_rows(int64_t* slots, int64_t n, const int64_t* rows, int64_t nrows,
                  const int64_t* ranges, const int64_t* range_of, int64_t nt, Stream stream) {
  if (n == 0 || nt == 0) return;
  const DeviceArray<int64_t> where(range_of, nt, stream);
  EC_LAUNCH(unstage_kernel, grid_threads(n), block_dim(), stream, slots, n, rows, nrows, ranges,
            where.get(), nt);
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
