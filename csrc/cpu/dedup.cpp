// The backward (docs/contract.md §4.3 step 2): every feature's gradient deduplicated, i.e.
// grouped by row and summed per unique row in lookup order, in one set of tensors for all
// features (the layout multi_update takes).
#include <torch/library.h>

#include "cpu_common.h"

namespace embcache {
namespace cpu {
namespace {

/// Bag b covers lookups [offsets[b], offsets[b+1]).
void check_bags(const at::Tensor& indices, const at::Tensor& offsets,
                const c10::optional<at::Tensor>& psw) {
  check_lookups(indices, psw, kCpu);
  kCpu.check(offsets, at::kLong, "offsets");
  TORCH_CHECK(offsets.dim() == 1 && offsets.numel() >= 1,
              "embcache: offsets must be 1-D, with the end appended");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t nb = offsets.numel() - 1;
  TORCH_CHECK(off[0] == 0 && off[nb] == indices.numel(),
              "embcache: offsets must start at 0 and end at len(indices)");
  const int64_t b = first_where(nb, [off](int64_t b) { return off[b] > off[b + 1]; });
  TORCH_CHECK(b == nb, "embcache: offsets decrease at bag ", b);
}

/// The lookups of some bags grouped by row (docs/contract.md §4 step 2): (row << 32 | position) keys
/// sorted by row, positions ascending within a row; run r, one row's lookups, is
/// keys[starts[r] .. starts[r + 1]).
struct RowRuns {
  std::vector<uint64_t> keys;
  std::vector<int64_t> starts;
  std::vector<int64_t> bag_of;  // the bag of each lookup, by position - bags.first()

  int64_t unique_rows() const { return (int64_t)starts.size() - 1; }
};

RowRuns group_by_row(const Bags& bags) {
  const int64_t* idx = bags.idx;
  const int64_t* off = bags.off;
  const int64_t base = bags.first(), n = bags.end() - base;
  TORCH_CHECK(bags.end() < (int64_t(1) << 32), "embcache: at most 2^32 lookups per call");
  RowRuns runs;
  runs.bag_of.resize(n);
  for (int64_t b = 0; b < bags.count; ++b)
    for (int64_t l = off[b]; l < off[b + 1]; ++l) runs.bag_of[l - base] = b;
  // Sort (row, position) pairs packed in one key: rows ascending, positions in order.
  runs.keys.resize(n);
  int64_t max_row = 0;
  for (int64_t l = base; l < bags.end(); ++l) {
    TORCH_CHECK(idx[l] >= 0 && idx[l] < (int64_t(1) << 31), "embcache: index ", idx[l],
                " out of range");
    runs.keys[l - base] = ((uint64_t)idx[l] << 32) | (uint64_t)l;
    max_row = std::max(max_row, idx[l]);
  }
  std::vector<uint64_t> scratch;
  runs.starts = sort_into_runs(runs.keys, bits_for(max_row + 1), scratch);
  return runs;
}

/// The deduplicated gradient of the runs from grad_output[b * g_stride + j]: per unique row
/// (ascending) its id into rows, how often it occurs in the bags into occ, its contributions
/// summed in lookup order into grads (dim floats a row) and, given the forward's slot of
/// every lookup (lookup_slot, or nullptr), its slot into slots. Bags pooled by `pooling`; for
/// max, lookup l of bag b contributes element j where argmax[b * argmax_stride + j] == l, and
/// 0 elsewhere (which leaves a sum from +0 as it is).
void sum_runs(const RowRuns& runs, const Bags& bags, const float* g, int64_t g_stride,
              int64_t dim, int pooling, const int32_t* argmax, int64_t argmax_stride,
              const int32_t* lookup_slot, int64_t* rows, float* grads, int64_t* occ,
              int64_t* slots) {
  const int64_t* off = bags.off;
  const int64_t base = bags.first(), n = bags.end() - base;
  const std::vector<uint64_t>& keys = runs.keys;
  const std::vector<int64_t>& starts = runs.starts;
  auto position = [&](int64_t k) { return (int64_t)(keys[k] & 0xffffffffu); };
  at::parallel_for(0, runs.unique_rows(), kGrainRows, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      rows[u] = (int64_t)(keys[starts[u]] >> 32);
      occ[u] = starts[u + 1] - starts[u];
      if (lookup_slot) slots[u] = lookup_slot[position(starts[u])];
      float* acc = grads + u * dim;
      std::fill_n(acc, dim, 0.f);  // here, not in a pass of its own: the row is written next
      for (int64_t k = starts[u]; k < starts[u + 1]; ++k) {
        // Bags come in row order, i.e. at random: fetch the gradient kPrefetch lookups ahead.
        if (k + kPrefetch < n)
          prefetch_bytes(g + runs.bag_of[position(k + kPrefetch) - base] * g_stride,
                         dim * sizeof(float));
        const int64_t l = position(k), b = runs.bag_of[l - base];
        const float* gb = g + b * g_stride;
        if (bags.psw) {
          for (int64_t j = 0; j < dim; ++j) acc[j] += gb[j] * bags.psw[l];
        } else if (pooling == kMax) {
          const int32_t* ab = argmax + b * argmax_stride;
          for (int64_t j = 0; j < dim; ++j) acc[j] += ab[j] == l ? gb[j] : 0.f;
        } else if (pooling == kMean) {
          const float len = (float)(off[b + 1] - off[b]);
          for (int64_t j = 0; j < dim; ++j) acc[j] += gb[j] / len;
        } else {
          for (int64_t j = 0; j < dim; ++j) acc[j] += gb[j];
        }
      }
    }
  });
}

/// Every feature's deduplicated gradient from grad_output, the gradient of
/// multi_lookup_forward's output [batch, sum of the features' dims]: (rows, grads,
/// occurrences, slots, row_ranges, errors). Feature f's unique rows (ascending) are
/// rows[row_ranges[f][0] .. row_ranges[f][1]), with their occurrences (and, given the
/// forward's lookup_slots, their slots; else slots is empty) at the same positions; their
/// gradients are a block of rows x dim floats in the 1-D grads from row_ranges[f][2], blocks
/// in feature order, every array filled exactly. Bad input raises, so errors is empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
multi_dedup_backward(
    const at::Tensor& indices, const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights, const at::Tensor& grad_output,
    const at::Tensor& specs, at::IntArrayRef feature_table,
    const c10::optional<at::Tensor>& lookup_slots, const c10::optional<at::Tensor>& argmax) {
  const DedupArgs a =
      dedup_args(grad_output, specs, feature_table, per_sample_weights, argmax, kCpu);
  const std::vector<int64_t>& dims = a.dims;
  const std::vector<int64_t>& col = a.col;
  const int64_t nf = (int64_t)dims.size(), batch = a.batch;
  check_bags(indices, offsets, per_sample_weights);
  TORCH_CHECK(offsets.numel() == nf * batch + 1,
              "embcache: offsets must have features * batch + 1 entries");
  const Bags all{indices.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), nf * batch,
                 per_sample_weights ? per_sample_weights->data_ptr<float>() : nullptr};
  const int32_t* lookup_slot = nullptr;
  if (lookup_slots.has_value()) {
    kCpu.check(*lookup_slots, at::kInt, "lookup_slots");
    TORCH_CHECK(lookup_slots->numel() == indices.numel(),
                "embcache: lookup_slots must hold one slot per index");
    lookup_slot = lookup_slots->data_ptr<int32_t>();
  }
  auto bags = [&](int64_t f) { return Bags{all.idx, all.off + f * batch, batch, all.psw}; };
  std::vector<int64_t> cost(nf);
  for (int64_t f = 0; f < nf; ++f) cost[f] = all.off[(f + 1) * batch] - all.off[f * batch];
  // Group each feature's lookups by row; then, with every feature's number of unique rows
  // known, one tensor of each kind for all of them (each tensor is made, handed to Python
  // and back, and freed every step); then sum into them.
  std::vector<RowRuns> runs(nf);
  for_each_by_cost(cost, [&](int64_t f) { runs[f] = group_by_row(bags(f)); });
  std::vector<int64_t> rs(nf + 1, 0), block(nf + 1, 0);
  at::Tensor row_ranges = new_cpu_tensor({nf, 3}, at::kLong);
  int64_t* ranges = row_ranges.data_ptr<int64_t>();
  for (int64_t f = 0; f < nf; ++f) {
    rs[f + 1] = rs[f] + runs[f].unique_rows();
    block[f + 1] = block[f] + runs[f].unique_rows() * dims[f];
    ranges[3 * f] = rs[f];
    ranges[3 * f + 1] = rs[f + 1];
    ranges[3 * f + 2] = block[f];
  }
  at::Tensor rows = new_cpu_tensor({rs[nf]}, at::kLong);
  at::Tensor grads = new_cpu_tensor({block[nf]}, at::kFloat);
  at::Tensor occ = new_cpu_tensor({rs[nf]}, at::kLong);
  at::Tensor slots = new_cpu_tensor({lookup_slot ? rs[nf] : 0}, at::kLong);
  for_each_by_cost(cost, [&](int64_t f) {
    sum_runs(runs[f], bags(f), grad_output.data_ptr<float>() + col[f], col[nf], dims[f],
             a.spec[feature_table[f]].pooling, a.argmax + a.argmax_col[f], a.argmax_col[nf],
             lookup_slot, rows.data_ptr<int64_t>() + rs[f],
             grads.data_ptr<float>() + block[f], occ.data_ptr<int64_t>() + rs[f],
             lookup_slot ? slots.data_ptr<int64_t>() + rs[f] : nullptr);
  });
  return {rows, grads, occ, slots, row_ranges, at::empty({0}, at::kLong)};
}

}  // namespace

TORCH_LIBRARY_IMPL(embcache, CPU, m) { m.impl("multi_dedup_backward", &multi_dedup_backward); }

}  // namespace cpu
}  // namespace embcache
