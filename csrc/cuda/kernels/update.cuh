// The update kernels (docs/contract.md §4.3 step 3), in two phases: compute every unique
// row's new value and check it (changing nothing), then commit: state and counts, one warp
// per touched set deciding the insert/evict/bypass rule, one warp per row moving the rows.
#pragma once

#include <string>
#include <vector>

#include "stage.cuh"
#include "embcache/optimizer.h"

namespace embcache {
namespace EMBCACHE_GPU_NS {

/// The table of unique row u of the op's rows.
__device__ __forceinline__ int64_t table_of_row(const UpdateTable* tables, int64_t nt, int64_t u) {
  return last_at<UpdateTable, &UpdateTable::row_start>(tables, nt, u);
}

/// Whether position u of the op's unique rows belongs to table T (else it lies in a gap
/// between tables' rows, or past the last: padding that no kernel reads).
__device__ __forceinline__ bool holds_row(const UpdateTable& T, int64_t u) {
  return u >= T.row_start && u < T.row_end;
}

/// Places each table's rows (row_start, row_end, value_start) from the op's row ranges
/// ([nt, 3], csrc/tables.h RowRange), checked (one thread: a handful of tables): ascending,
/// disjoint, within the n unique rows and the grads_numel gradient values. A table whose
/// range is not gets none, and flags[2t] |= kBadRanges.
__global__ void place_tables_kernel(UpdateTable* tables, int64_t nt, const int64_t* ranges,
                                    int64_t n, int64_t grads_numel, unsigned long long* flags) {
  if (thread_global() != 0) return;
  int64_t past = 0;
  for (int64_t t = 0; t < nt; ++t) {
    UpdateTable& T = tables[t];
    const int64_t first = ranges[3 * t], end = ranges[3 * t + 1], value = ranges[3 * t + 2];
    const bool ok = first >= past && end >= first && end <= n && value >= 0 &&
                    value <= grads_numel && (end - first) * T.t.f.dim <= grads_numel - value;
    if (!ok) flags[2 * t] |= (unsigned long long)kBadRanges;
    T.row_start = ok ? first : past;
    T.row_end = ok ? end : past;
    T.value_start = ok ? value : 0;
    past = T.row_end;
  }
}

/// The table of set `set` in the commit's numbering.
__device__ __forceinline__ int64_t table_of_set(const UpdateTable* tables, int64_t nt, int64_t set) {
  return last_at<UpdateTable, &UpdateTable::set_start>(tables, nt, set);
}

/// The first phase: one warp per unique row finds its slot (ballot), fetches the value
/// (cache row, or the dequantized row of the table's stage or of the table) and applies the optimizer into fresh and fresh_state
/// (row u's state at u * state_stride). Table k's flags[2k] |= error bits; flags[2k + 1] =
/// min(row that cannot be stored).
__global__ void compute_update_kernel(const UpdateTable* tables, int64_t nt, const int64_t* rows,
                                      int64_t n, const float* g, float* fresh,
                                      float* fresh_state, int64_t state_stride, int64_t* slots,
                                      unsigned long long* flags) {
  const unsigned lane = lane_id();
  for (int64_t u = warp_global(); u < n; u += warps_in_grid()) {
    const int64_t k = table_of_row(tables, nt, u);
    const UpdateTable& T = tables[k];
    if (!holds_row(T, u)) continue;
    const RowFormat f = T.t.f;
    const int dim = f.dim;
    const int64_t i = u - T.row_start;  // the row's position in its table's rows
    const int64_t row = rows[u];
    if (row < 0 || row >= T.t.rows || (i > 0 && rows[u - 1] >= row)) {
      if (lane == 0) atomicOr(&flags[2 * k], (unsigned long long)kBadUniqueRows);
      continue;
    }
    const int64_t slot = warp_find_slot(T.state.cache_tags, T.t.set_divisor, T.t.ways, row);
    if (lane == 0) slots[u] = slot;
    const float* cv = slot >= 0 ? T.state.cache_rows + slot * dim : nullptr;
    const uint8_t* staged = slot < 0 ? staged_row(T.stage, row, f.row_bytes()) : nullptr;
    const uint8_t* tr = staged ? staged : T.state.weights + row * f.row_bytes();
    float scale = 0.f, bias = 0.f;
    if (slot < 0 && f.is_int()) load_qparams(f, tr, &scale, &bias);
    const float* gu = g + T.value_start + i * dim;
    float* out = fresh + T.value_start + i * dim;
    const float* state = T.state.optimizer_state;
    const float lr = (float)T.t.lr, eps = (float)T.t.eps;
    if (T.t.optimizer == kSGD) {
      for (int j = (int)lane; j < dim; j += 32) {
        const float v = cv ? cv[j] : dequantize_element(f, tr, j, scale, bias);
        out[j] = descend(v, lr, gu[j]);
      }
    } else if (T.t.optimizer == kRowwiseAdagrad) {
      float sum_sq = 0.f;  // in element order, as the CPU sums it
      if (lane == 0) sum_sq = sum_of_squares(gu, dim);
      sum_sq = __shfl_sync(kFullMask, sum_sq, 0);
      const float acc = rowwise_adagrad_accumulator(state[row], sum_sq, dim);
      const float step = adagrad_step(lr, eps, acc);
      for (int j = (int)lane; j < dim; j += 32) {
        const float v = cv ? cv[j] : dequantize_element(f, tr, j, scale, bias);
        out[j] = descend(v, step, gu[j]);
      }
      if (lane == 0) fresh_state[u * state_stride] = acc;
    } else {
      float* fs = fresh_state + u * state_stride;
      for (int j = (int)lane; j < dim; j += 32) {
        const float v = cv ? cv[j] : dequantize_element(f, tr, j, scale, bias);
        const float acc = adagrad_accumulator(state[row * dim + j], gu[j]);
        out[j] = descend(v, adagrad_step(lr, eps, acc), gu[j]);
        fs[j] = acc;
      }
    }
    __syncwarp(kFullMask);
    if (!warp_row_is_storable(f, out, T.t.stochastic) && lane == 0)
      atomicMin(&flags[2 * k + 1], (unsigned long long)row);
  }
}

/// The commit's decision, on the device: *go = 1 iff no table's verdict (compute_update_kernel's
/// flags: error bits at 2t, ~0 at 2t + 1 when every row is storable) refuses and every word of
/// the gate is 0. The commit kernels do nothing unless *go.
__global__ void decide_commit_kernel(const unsigned long long* verdict, int64_t nt,
                                     const int64_t* gate, int64_t ngate, int* go) {
  if (thread_global() != 0) return;
  bool ok = true;
  for (int64_t t = 0; t < nt; ++t) ok = ok && verdict[2 * t] == 0 && verdict[2 * t + 1] == ~0ull;
  for (int64_t i = 0; i < ngate; ++i) ok = ok && gate[i] == 0;
  *go = ok ? 1 : 0;
}

/// The commit, step 1, one warp per unique row: its optimizer state and (LFU) count, and
/// (keys non-null) its sort key, grouping the updated rows by set, candidates of a set in
/// priority order: (set << 31) | (INT32_MAX - count) for LFU, set << 31 for LRU, and
/// no_set << 31 (after every set) for a table without a cache and for the positions of no
/// table; the values (unique-row positions, ascending) break ties, since the sort is stable.
__global__ void commit_rows_kernel(const UpdateTable* tables, int64_t nt, const int64_t* rows,
                                   int64_t n, const float* fresh_state, int64_t state_stride,
                                   const int64_t* occ, uint64_t no_set, uint64_t* keys,
                                   int64_t* vals, const int* go) {
  if (!*go) return;
  const unsigned lane = lane_id();
  for (int64_t u = warp_global(); u < n; u += warps_in_grid()) {
    const UpdateTable& T = tables[table_of_row(tables, nt, u)];
    if (!holds_row(T, u)) {
      if (keys && lane == 0) {
        keys[u] = no_set << 31;
        vals[u] = u;
      }
      continue;
    }
    const int64_t row = rows[u], sw = T.t.state_width();
    float* state = T.state.optimizer_state;
    const float* fs = fresh_state + u * state_stride;
    for (int64_t j = lane; j < sw; j += 32) state[row * sw + j] = fs[j];
    if (lane != 0) continue;
    const int32_t count = T.t.lfu() ? T.state.counts.add(row, occ[u]) : 0;
    if (!keys) continue;
    const uint64_t set = T.t.num_sets == 0
                             ? no_set
                             : (uint64_t)(T.set_start + set_of_row(row, T.t.set_divisor));
    const uint64_t inv = T.t.lfu() ? (uint64_t)(0x7fffffff - count) : 0;
    keys[u] = (set << 31) | inv;
    vals[u] = u;
  }
}

/// The commit, step 2: one warp per touched set (the warp at the first sorted position of
/// the set; the others return) decides docs/contract.md §4's rule and writes the set's tags
/// and priorities: updated residents stay, with their new priority; the slots are ranked by
/// priority (empty first, ties by way) with shuffles; candidate k (k-th non-resident in
/// priority order) replaces the slot of rank k iff its priority is strictly higher; other
/// candidates bypass into the table. No row is moved here: for each unique row u it sets
/// dest[u] (the cache slot its new value goes to; -1, as set before: the table) and, for an
/// insertion, evicted[u] (the row whose cached value it writes back first; -1: none). An
/// updated resident that an insertion evicts goes to the table straight from its new value.
/// Each table's device_counts += its unique hits, insertions, evictions (the other
/// candidates bypass). Keys of set no_set (tables without a cache) are left as they are: all bypass.
__global__ void decide_sets_kernel(const UpdateTable* tables, int64_t nt, const int64_t* rows,
                                   const int64_t* slot_of, const uint64_t* keys,
                                   const int64_t* vals, int64_t nu, uint64_t no_set,
                                   int64_t* dest, int64_t* evicted, const int* go) {
  if (!*go) return;
  const unsigned lane = lane_id();
  const int64_t kEmpty = INT64_MIN;
  for (int64_t first = warp_global(); first < nu; first += warps_in_grid()) {
    const uint64_t set = keys[first] >> 31;
    if (set == no_set) continue;
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
    const UpdateTable& T = tables[table_of_set(tables, nt, (int64_t)set)];
    const bool lfu = T.t.lfu();
    const int64_t ways = T.t.ways, step = T.step;
    int32_t* tags = T.state.cache_tags;
    int32_t* priority = T.state.cache_priority;
    const LfuCounts counts = T.state.counts;
    const int64_t base = ((int64_t)set - T.set_start) * ways;
    unsigned long long hits = 0, ins = 0, evict = 0;
    // 1. Updated residents stay, with their new value and priority (LRU: the step; LFU:
    //    a copy of the row's count, so that step 2 reads no random counts). Lane w learns
    //    which updated row (if any) holds way w.
    int64_t resident_of_way = -1;
    for (int64_t c0 = first; c0 < end; c0 += 32) {
      const int64_t k = c0 + lane;
      const int64_t u = k < end ? vals[k] : -1;
      const int64_t slot = k < end ? slot_of[u] : -1;
      if (slot >= 0) {
        priority[slot] = lfu ? counts[rows[u]] : (int32_t)step;
        dest[u] = slot;
      }
      unsigned resident = __ballot_sync(kFullMask, slot >= 0);
      hits += __popc(resident);
      for (; resident; resident &= resident - 1) {
        const int src = __ffs(resident) - 1;
        const int64_t ru = __shfl_sync(kFullMask, u, src);
        const int64_t way = __shfl_sync(kFullMask, slot, src) - base;
        if ((int64_t)lane == way) resident_of_way = ru;
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
      const int64_t victim = __shfl_sync(kFullMask, resident_of_way, way);
      const int64_t row = cand ? rows[u] : -1;
      const int64_t p = !cand ? 0 : lfu ? (int64_t)counts[row] : step;
      const bool insert = cand && r < ways && p > slot_prio;
      const int64_t slot = base + way;
      const int32_t old = insert ? tags[slot] : -1;
      if (insert) {
        tags[slot] = (int32_t)row;
        priority[slot] = (int32_t)p;
        dest[u] = slot;
        if (victim >= 0) dest[victim] = -1;  // its new value, to the table
        else if (old >= 0) evicted[u] = old;
      }
      ins += __popc(__ballot_sync(kFullMask, insert));
      evict += __popc(__ballot_sync(kFullMask, old >= 0));
    }
    if (lane == 0) {  // the counts are the warp's (ballots)
      unsigned long long* commit = T.device_counts;
      if (hits) atomicAdd(&commit[kCommitHits], hits);
      if (ins) atomicAdd(&commit[kCommitInsertions], ins);
      if (evict) atomicAdd(&commit[kCommitEvictions], evict);
    }
  }
}

/// The commit, step 3: one warp per unique row moves it where decide_sets_kernel said: an
/// insertion first writes the row it evicts back to the table (quantized, warp_quantize_row),
/// then copies the new value into the slot; a resident's new value goes into its slot; any
/// other row is quantized into the table. Every slot and table row has one writer, and an
/// evicted slot is read only by the warp that overwrites it.
__global__ void write_rows_kernel(const UpdateTable* tables, int64_t nt, const int64_t* rows,
                                  int64_t n, const float* fresh, const int64_t* dest,
                                  const int64_t* evicted, const int* go) {
  if (!*go) return;
  const int lane = (int)lane_id();
  for (int64_t u = warp_global(); u < n; u += warps_in_grid()) {
    const UpdateTable& T = tables[table_of_row(tables, nt, u)];
    if (!holds_row(T, u)) continue;
    const RowFormat f = T.t.f;
    const int dim = f.dim;
    const float* value = fresh + T.value_start + (u - T.row_start) * dim;
    const int64_t slot = dest[u];
    const RoundingStream s = T.t.stream(T.step);
    if (slot < 0) {
      const int64_t row = rows[u];
      warp_quantize_row(f, value, T.t.stochastic, s, row, T.state.weights + row * f.row_bytes());
      continue;
    }
    float* cached = T.state.cache_rows + slot * dim;
    const int64_t old = evicted[u];
    if (old >= 0) {
      warp_quantize_row(f, cached, T.t.stochastic, s, old, T.state.weights + old * f.row_bytes());
      __syncwarp(kFullMask);  // the evicted row is read before the slot is overwritten
    }
    for (int j = lane; j < dim; j += 32) cached[j] = value[j];
  }
}

/// The bits of n's binary representation (0 for 0).
inline int bit_length(uint64_t n) {
  int bits = 0;
  for (; n; n >>= 1) ++bits;
  return bits;
}

void update_tables(const UpdateTable* tables, int64_t nt, const UpdateRows& r, const float* g,
                   float* fresh, float* fresh_state, int64_t* slots, const int64_t* occ,
                   unsigned long long* verdict, bool commit, const int64_t* gate, int64_t ngate,
                   Stream stream) {
  if (nt == 0) return;
  // The tables, their sets numbered for the commit's one sort, in device memory once for
  // both phases; their rows are placed there (place_tables_kernel).
  std::vector<UpdateTable> numbered(tables, tables + nt);
  int64_t sets = 0;
  bool any_lfu = false;
  for (UpdateTable& t : numbered) {
    t.set_start = sets;
    sets += t.t.num_sets;
    any_lfu = any_lfu || t.t.lfu();
  }
  if (commit && sets > kMaxCommitSets)
    throw std::runtime_error("embcache (cuda): the cached tables of one update have " +
                             std::to_string(sets) + " sets together, more than the " +
                             std::to_string(kMaxCommitSets) + " one commit can order");
  const DeviceArray<UpdateTable> placed(numbered.data(), nt, stream);
  const UpdateTable* d = placed.get();
  EC_LAUNCH(place_tables_kernel, 1, block_dim(), stream, const_cast<UpdateTable*>(d), nt,
            r.ranges, r.n, r.grads_numel, verdict);
  const int64_t n = r.n;
  if (n == 0) return;
  EC_LAUNCH(compute_update_kernel, grid_warps(n), block_dim(), stream, d, nt, r.rows, n, g,
            fresh, fresh_state, r.state_stride, slots, verdict);
  if (!commit) return;
  Scratch go_word(sizeof(int), stream);
  const int* go = go_word.as<int>();
  EC_LAUNCH(decide_commit_kernel, 1, block_dim(), stream, (const unsigned long long*)verdict, nt,
            gate, ngate, go_word.as<int>());
  const uint64_t no_set = (uint64_t)sets;
  // dest and evicted (decide_sets_kernel), -1 (every byte 0xff): each row to the table.
  Scratch moves(n * 16, stream);
  dev_fill(moves.p, 0xff, n * 16, stream);
  int64_t* dest = moves.as<int64_t>();
  int64_t* evicted = dest + n;
  if (sets == 0) {
    EC_LAUNCH(commit_rows_kernel, grid_warps(n), block_dim(), stream, d, nt, r.rows, n,
              (const float*)fresh_state, r.state_stride, occ, no_set, (uint64_t*)nullptr,
              (int64_t*)nullptr, go);
  } else {
    Scratch keys(n * 8, stream), vals(n * 8, stream);
    EC_LAUNCH(commit_rows_kernel, grid_warps(n), block_dim(), stream, d, nt, r.rows, n,
              (const float*)fresh_state, r.state_stride, occ, no_set, keys.as<uint64_t>(),
              vals.as<int64_t>(), go);
    // Only the bits that vary: the priority's (LFU) and the set's, up to no_set.
    sort_pairs_u64_i64(keys.as<uint64_t>(), vals.as<int64_t>(), n, any_lfu ? 0 : 31,
                       31 + bit_length(no_set), stream);
    EC_LAUNCH(decide_sets_kernel, grid_warps(n), block_dim(), stream, d, nt, r.rows,
              (const int64_t*)slots, (const uint64_t*)keys.as<uint64_t>(),
              (const int64_t*)vals.as<int64_t>(), n, no_set, dest, evicted, go);
  }
  EC_LAUNCH(write_rows_kernel, grid_warps(n), block_dim(), stream, d, nt, r.rows, n,
            (const float*)fresh, (const int64_t*)dest, (const int64_t*)evicted, go);
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
