// One table's update (docs/contract.md §4.3 step 3), shared by its two phases: the check of
// every table (csrc/cpu/update.cpp) and the commit (csrc/cpu/commit.cpp).
#pragma once

#include <array>

#include "cpu_common.h"
#include "embcache/optimizer.h"

namespace embcache {
namespace cpu {

/// The optimizer step of one row: new value and new state from the fetched value v and
/// the gradient g, by the arithmetic of embcache/optimizer.h (docs/contract.md §4.5). Writes
/// only to `out` and `state_out`, after reading what it needs of v and state (they may be
/// the same memory).
inline void optimizer_row(int opt, float lr, float eps, int64_t dim, const float* v,
                          const float* g, const float* state, float* out, float* state_out) {
  if (opt == kSGD) {
    for (int64_t j = 0; j < dim; ++j) out[j] = descend(v[j], lr, g[j]);
  } else if (opt == kRowwiseAdagrad) {
    const float acc = rowwise_adagrad_accumulator(state[0], sum_of_squares(g, dim), dim);
    const float step = adagrad_step(lr, eps, acc);
    for (int64_t j = 0; j < dim; ++j) out[j] = descend(v[j], step, g[j]);
    state_out[0] = acc;
  } else {
    for (int64_t j = 0; j < dim; ++j) {
      const float acc = adagrad_accumulator(state[j], g[j]);
      out[j] = descend(v[j], adagrad_step(lr, eps, acc), g[j]);
      state_out[j] = acc;
    }
  }
}

/// One table's update: its nu unique rows (ascending, in range), their gradients g (nu x dim)
/// and the state their new values are computed from.
struct RowUpdate {
  RowFormat f;
  Cache cache;
  const uint8_t* w;
  const int64_t* rows;
  int64_t nu;
  const float* g;
  float* st;
  int64_t sw;
  int optimizer;
  float lr, eps;

  /// Row u's new value into out and new optimizer state into state_out, from its value in
  /// `slot` (or in the table if slot < 0; `buf` holds dim floats). out and state_out may be
  /// where the value and state are read from.
  void compute(int64_t u, int64_t slot, float* buf, float* out, float* state_out) const {
    const float* v = buf;
    if (slot >= 0)
      v = cache.rows + slot * f.dim;
    else
      dequantize_row(f, w + rows[u] * f.row_bytes(), buf);
    optimizer_row(optimizer, lr, eps, f.dim, v, g + u * f.dim, st + rows[u] * sw, out, state_out);
  }

  /// Prefetches what compute(u, slot) reads.
  void prefetch_sources(int64_t u, int64_t slot) const {
    cache.prefetch_value(slot, f.dim, w + rows[u] * f.row_bytes(), f.row_bytes());
    prefetch_bytes(st + rows[u] * sw, sw * sizeof(float));
  }
};

/// The update of a table with `spec` and state `s` by its nu unique rows `rows` with
/// gradients g; the rows are checked to be ascending and in range.
inline RowUpdate make_row_update(const TableSpec& spec, const TableState& s, const int64_t* rows,
                                 int64_t nu, const float* g) {
  const int64_t num_rows = spec.rows;
  TORCH_CHECK(first_where(nu, [&](int64_t u) {
                return (uint64_t)rows[u] >= (uint64_t)num_rows || (u > 0 && rows[u] <= rows[u - 1]);
              }) == nu,
              "embcache: unique rows must be ascending and in range");
  return RowUpdate{spec.f,           table_cache(spec, s), s.weights,
                   rows,             nu,                   g,
                   s.optimizer_state, spec.state_width(),  spec.optimizer,
                   (float)spec.lr,   (float)spec.eps};
}

/// One table's commit counts: its unique hits, insertions and evictions, in the order of
/// DeviceCount from kCommitHits (embcache/table_spec.h).
constexpr int kNumCommitCounts = kNumDeviceCounts - kCommitHits;
using CommitCounts = std::array<int64_t, kNumCommitCounts>;

/// Writes one table's update `up` into its state `s`: each unique row's new value (computed
/// where it is written) and optimizer state, its LFU count, and the cache's insertions,
/// evictions and bypasses. slot_of[u] is row u's slot (-1 if not cached) as the cache is now,
/// occ[u] how often it occurs in the batch; `step` keys the rounding and is LRU's priority.
/// *probe adds the rows written to the table that is_probed(row, step) picks.
CommitCounts commit_update(const RowUpdate& up, const TableSpec& spec, const TableState& s,
                           const int64_t* slot_of, const int64_t* occ, int64_t step,
                           RoundingProbe* probe);

}  // namespace cpu
}  // namespace embcache
