// The schemas of the cache ops, written once: the CPU library (torch.ops.embcache, whose
// CUDA implementations register under the same names) and the emulated CUDA kernels
// (torch.ops.embcache_emu) define the same ops.
#pragma once

#include <torch/library.h>

#include <vector>

#include "embcache/rowquant.h"

namespace embcache {

/// A table's statistics, which the table-batched ops add to: an int64 CPU tensor of
/// kNumCounters counters in the order of _STAT_NAMES in embcache/embedding.py.
enum Counter : int64_t {
  kLookups, kHits, kSteps, kUniqueRows, kUniqueHits, kUniqueMisses, kInsertions, kEvictions,
  kBypasses, kFlushed, kNumCounters
};

/// The counters of one table, checked.
inline int64_t* counters_data(const at::Tensor& counters) {
  TORCH_CHECK(counters.scalar_type() == at::kLong && counters.device().is_cpu() &&
                  counters.is_contiguous() && counters.numel() == kNumCounters,
              "embcache: counters must be a contiguous int64 CPU tensor of ", kNumCounters);
  return counters.data_ptr<int64_t>();
}

/// Every table's counters; none if the list is empty and `optional`.
inline std::vector<int64_t*> tables_counters(at::TensorList counters, size_t num_tables,
                                             bool optional) {
  TORCH_CHECK(counters.size() == num_tables || (optional && counters.empty()),
              "embcache: counters must be one tensor per table", optional ? ", or none" : "");
  std::vector<int64_t*> out;
  for (const at::Tensor& c : counters) out.push_back(counters_data(c));
  return out;
}

/// Counts one applied update of `unique_rows` rows, with its commit's five counts
/// (kUniqueHits to kBypasses, in order).
inline void count_commit(int64_t* counter, int64_t unique_rows, const int64_t* commit_counts) {
  counter[kSteps] += 1;
  counter[kUniqueRows] += unique_rows;
  for (int64_t i = 0; i < kFlushed - kUniqueHits; ++i) counter[kUniqueHits + i] += commit_counts[i];
}

/// A table-batched gradient (multi_dedup_backward's output, multi_update's input), checked:
/// table t's unique rows are unique_rows[row_starts[t] .. row_starts[t + 1]), with their
/// occurrences (and slot hints, unless slot_hints is empty) at the same positions, and their
/// gradients a block of rows x dims[t] floats in the 1-D grads, the blocks in table order.
/// Returns where each block starts in grads, then grads.numel().
inline std::vector<int64_t> gradient_blocks(const at::Tensor& unique_rows, const at::Tensor& grads,
                                            const at::Tensor& occurrences,
                                            const at::Tensor& slot_hints,
                                            at::IntArrayRef row_starts, at::IntArrayRef dims) {
  const size_t nt = dims.size();
  TORCH_CHECK(row_starts.size() == nt + 1 && row_starts[0] == 0,
              "embcache: row_starts must hold 0, then where each next table's rows start");
  std::vector<int64_t> block(nt + 1, 0);
  for (size_t t = 0; t < nt; ++t) {
    TORCH_CHECK(row_starts[t + 1] >= row_starts[t], "embcache: row_starts decrease at table ", t);
    block[t + 1] = block[t] + (row_starts[t + 1] - row_starts[t]) * dims[t];
  }
  auto check = [&](const at::Tensor& x, at::ScalarType dtype, int64_t numel, const char* what) {
    TORCH_CHECK(x.scalar_type() == dtype && x.dim() == 1 && x.is_contiguous() &&
                    x.numel() == numel && x.device() == unique_rows.device(),
                "embcache: ", what, " must be a contiguous 1-D ", c10::toString(dtype),
                " tensor of ", numel, " values on the device of unique_rows");
  };
  check(unique_rows, at::kLong, row_starts[nt], "unique_rows");
  check(occurrences, at::kLong, row_starts[nt], "occurrences");
  if (slot_hints.numel() > 0) check(slot_hints, at::kLong, row_starts[nt], "slot_hints");
  check(grads, at::kFloat, block[nt], "grads");
  return block;
}

/// What check_cache_flush found: the number of cache slots and the table's row format.
struct FlushShape {
  int64_t slots;  // cache_tags.numel()
  RowFormat f;    // the table's row format (dim 0 when there are no slots: nothing to write)
};

/// cache_flush's arguments, checked before anything is written, by the CPU op and the
/// CUDA/emulated op alike. Every tensor must be contiguous, on the device of weights and
/// accepted by `on_device` (the op's kind of device, named `device` in messages):
///   * cache_tags: int32, one tag per slot; the slots fix the cache's size;
///   * cache_rows: float32, dim values per slot (dim > 0 when there are slots);
///   * cache_priority: int32, one priority per slot;
///   * cache_set_floor: int32, 1-D, one floor per set. The op is not told the number of
///     ways, so the number of sets is checked as far as the slots allow: none without slots,
///     else a positive divisor of the slots with at most 32 ways (slots / sets) per set;
///   * weights: uint8 [rows, row bytes] in the format of bits, qparams_fp16 and dim (its
///     dtype and device only when there are no slots, as then dim is unknown).
template <typename OnDevice>
FlushShape check_cache_flush(const at::Tensor& weights, const at::Tensor& cache_tags,
                             const at::Tensor& cache_rows, const at::Tensor& cache_priority,
                             const at::Tensor& cache_set_floor, int64_t bits,
                             bool qparams_fp16, const OnDevice& on_device,
                             const char* device) {
  auto check = [&](const at::Tensor& x, at::ScalarType dtype, const char* what) {
    TORCH_CHECK(x.scalar_type() == dtype, "embcache: ", what, " must be ", dtype, ", got ",
                x.scalar_type());
    TORCH_CHECK(x.is_contiguous() && on_device(x) && x.device() == weights.device(),
                "embcache: ", what, " must be a contiguous ", device,
                " tensor on the device of weights");
  };
  check(weights, at::kByte, "weights");
  check(cache_tags, at::kInt, "cache_tags");
  check(cache_rows, at::kFloat, "cache_rows");
  check(cache_priority, at::kInt, "cache_priority");
  check(cache_set_floor, at::kInt, "cache_set_floor");
  const int64_t slots = cache_tags.numel();
  const int64_t dim = slots == 0 ? 0 : cache_rows.numel() / slots;
  TORCH_CHECK(cache_rows.numel() == slots * dim && (slots == 0 || dim > 0),
              "embcache: cache_rows must hold dim values for each of the ", slots,
              " slots, got ", cache_rows.numel(), " values");
  TORCH_CHECK(cache_priority.numel() == slots, "embcache: cache_priority must hold one "
              "priority for each of the ", slots, " slots, got ", cache_priority.numel());
  const int64_t sets = cache_set_floor.numel();
  TORCH_CHECK(cache_set_floor.dim() == 1 &&
                  (slots == 0 ? sets == 0 : sets > 0 && slots % sets == 0 && slots / sets <= 32),
              "embcache: cache_set_floor must be 1-D with one floor per set (the ", slots,
              " slots in sets of at most 32 ways), got shape ", cache_set_floor.sizes());
  TORCH_CHECK(bits == 32 || bits == 16 || bits == 8 || bits == 4 || bits == 2,
              "embcache: unsupported number of bits ", bits);
  const RowFormat f{(int)bits, (int)dim, qparams_fp16};
  TORCH_CHECK(slots == 0 || (weights.dim() == 2 && weights.size(1) == f.row_bytes()),
              "embcache: weights must be [rows, ", f.row_bytes(), "] bytes, got ",
              weights.sizes());
  return FlushShape{slots, f};
}

inline void define_cache_ops(torch::Library& m) {
  m.def("quantize_rows(Tensor values, Tensor row_ids, int bits, bool qparams_fp16, "
        "bool stochastic, int seed, int step, int table) -> Tensor");
  m.def("dequantize_rows(Tensor weights, int bits, int dim, bool qparams_fp16) -> Tensor");
  m.def("lookup_forward(Tensor weights, Tensor cache_tags, Tensor cache_rows, "
        "Tensor indices, Tensor offsets, Tensor? per_sample_weights, int bits, int dim, "
        "bool qparams_fp16, int num_sets, int ways, bool mean) -> (Tensor, Tensor)");
  m.def("dedup_backward(Tensor indices, Tensor offsets, Tensor? per_sample_weights, "
        "Tensor grad_output, bool mean) -> (Tensor, Tensor, Tensor)");
  m.def("update_prepare(Tensor weights, Tensor cache_tags, Tensor cache_rows, "
        "Tensor optimizer_state, Tensor unique_rows, Tensor grads, int bits, "
        "bool qparams_fp16, bool stochastic, int optimizer, float lr, float eps, "
        "int num_sets, int ways, Tensor? slot_hint=None) "
        "-> (Tensor, Tensor, Tensor, int)");
  m.def("update_commit(Tensor(a!) weights, Tensor(b!) cache_tags, Tensor(c!) cache_rows, "
        "Tensor(d!) cache_priority, Tensor(g!) cache_set_floor, Tensor(e!) counts, "
        "Tensor(f!) optimizer_state, Tensor unique_rows, Tensor fresh, Tensor fresh_state, Tensor slots, "
        "Tensor occurrences, int bits, bool qparams_fp16, bool stochastic, bool lfu, "
        "int seed, int step, int table, int num_sets, int ways) -> Tensor");
  // Bags come as lengths (int32 or int64), feature after feature; returns (pooled, the bags'
  // int64 offsets with the end appended, each lookup's slot, each feature's value bound) and
  // adds each feature's lookups and hits to its table's counters (none if the list is empty).
  m.def("multi_lookup_forward(Tensor[] weights, Tensor[] cache_tags, Tensor[] cache_rows, "
        "Tensor indices, Tensor lengths, Tensor? per_sample_weights, int[] feature_table, "
        "int[] bits, int[] dims, int[] qparams_fp16, int[] num_sets, int[] ways, int[] mean, "
        "int batch, Tensor(h!)[] counters) -> (Tensor, Tensor, Tensor, Tensor)");
  // Every feature's deduplicated gradient in gradient_blocks's layout: (unique_rows, grads,
  // occurrences, slots (empty without lookup_slots), row_starts).
  m.def("multi_dedup_backward(Tensor indices, Tensor offsets, Tensor? per_sample_weights, "
        "Tensor grad_output, int[] dims, int[] mean, int batch, Tensor? lookup_slots=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Prepares every table's update, then commits all of them only if every table can take
  // its update: returns per table the smallest row it cannot store or -1; if any table has
  // such a row, no state is changed. Table t's update is step counters[t][kSteps] + 1; a
  // commit adds to its counters. With commit=false it only prepares and checks (a dry run:
  // nothing is changed either way).
  m.def("multi_update(Tensor(a!)[] weights, Tensor(b!)[] cache_tags, Tensor(c!)[] cache_rows, "
        "Tensor(d!)[] cache_priority, Tensor(g!)[] cache_set_floor, Tensor(e!)[] counts, "
        "Tensor(f!)[] optimizer_state, "
        "Tensor unique_rows, Tensor grads, Tensor occurrences, Tensor slot_hints, "
        "int[] row_starts, float[] value_bounds, int[] dims, int[] bits, "
        "int[] qparams_fp16, int[] stochastic, int[] optimizer, float[] lr, float[] eps, "
        "int[] lfu, int[] seed, int[] table, int[] num_sets, int[] ways, Tensor(h!)[] counters, "
        "bool commit=True) -> int[]");
  m.def("cache_flush(Tensor(a!) weights, Tensor(b!) cache_tags, Tensor cache_rows, "
        "Tensor(c!) cache_priority, Tensor(d!) cache_set_floor, int bits, bool qparams_fp16, bool stochastic, "
        "int seed, int step, int table) -> int");
}

}  // namespace embcache
