// The update kernels (docs/contract.md §4.3 step 3), in two phases: compute every unique
// row's new value and check it (changing nothing), then commit: state, counts, and one warp
// per touched set for the insert/evict/bypass rule.
#pragma once

#include "common.cuh"

namespace embcache {
namespace EMBCACHE_GPU_NS {

/// The first phase: one warp per unique row finds its slot (ballot), fetches the value
/// (cache row or dequantized table row) and applies the optimizer into fresh and fresh_state.
/// flags[0] |= error bits; flags[1] = min(row that cannot be stored).
__global__ void compute_update_kernel(const uint8_t* w, int64_t num_rows, const int32_t* tags,
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
/// stats[0..2] += unique hits, insertions, evictions (the other candidates bypass).
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
    unsigned long long hits = 0, ins = 0, evict = 0;
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
      }
    }
    if (hits) atomicAdd(&stats[0], hits);
    if (ins) atomicAdd(&stats[1], ins);
    if (evict) atomicAdd(&stats[2], evict);
  }
}

void compute_update(const TableSpec& t, const TableState& state, const int64_t* rows,
                    int64_t nu, const float* g, float* fresh, float* fresh_state,
                    int64_t* slots, unsigned long long* flags, Stream stream) {
  if (nu == 0) return;
  EC_LAUNCH(compute_update_kernel, grid_warps(nu), block_dim(), stream, state.weights, t.rows,
            state.cache_tags, state.cache_rows, state.optimizer_state, rows, nu, g, t.f,
            t.stochastic, t.optimizer, (float)t.lr, (float)t.eps, t.num_sets, t.ways, fresh,
            fresh_state, slots, flags);
}

void commit_update(const TableSpec& t, const TableState& state, const int64_t* rows, int64_t nu,
                   const float* fresh, const float* fresh_state, const int64_t* slots,
                   const int64_t* occ, int64_t step, unsigned long long* counts, Stream stream) {
  if (nu == 0) return;
  const bool lfu = t.lfu;
  EC_LAUNCH(commit_state_kernel, grid_warps(nu), block_dim(), stream, state.optimizer_state,
            state.counts, rows, nu, fresh_state, t.state_width(), occ, lfu);
  if (t.num_sets == 0) {
    EC_LAUNCH(commit_bypass_kernel, grid_threads(nu), block_dim(), stream, state.weights, rows,
              nu, fresh, t.f, t.stochastic, t.stream(step));
    return;
  }
  Scratch keys(nu * 8, stream), vals(nu * 8, stream);
  EC_LAUNCH(commit_keys_kernel, grid_threads(nu), block_dim(), stream, rows, nu,
            (const int32_t*)state.counts, lfu, t.num_sets, keys.as<uint64_t>(),
            vals.as<int64_t>());
  sort_pairs_u64_i64(keys.as<uint64_t>(), vals.as<int64_t>(), nu, 64, stream);
  EC_LAUNCH(commit_sets_kernel, grid_warps(nu), block_dim(), stream, state.weights,
            state.cache_tags, state.cache_rows, state.cache_priority,
            (const int32_t*)state.counts, rows, fresh, slots,
            (const uint64_t*)keys.as<uint64_t>(), (const int64_t*)vals.as<int64_t>(), nu, t.f,
            t.stochastic, lfu, t.stream(step), step, t.ways, counts);
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
