// The arguments of the table ops, checked once for both backends (the CPU ops of csrc/cpu and
// the CUDA glue of csrc/cuda/torch_ops.h): each op decodes its tables' specs
// (csrc/include/embcache/table_spec.h) and checks their state, its counters and its other
// tensors here, before it reads or writes anything.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <vector>

#include "embcache/rounding_probe.h"
#include "embcache/stage.h"
#include "embcache/table_spec.h"

namespace embcache {

/// The kind of device an op's implementation runs on: the tensors it takes, and its name in
/// messages.
struct DeviceKind {
  bool (*holds)(const at::Tensor&);
  const char* name;

  /// Checks a tensor argument: of `dtype`, contiguous, on this kind of device.
  void check(const at::Tensor& t, at::ScalarType dtype, const char* what) const {
    TORCH_CHECK(t.scalar_type() == dtype, "embcache: ", what, " must be ", dtype, ", got ",
                t.scalar_type());
    TORCH_CHECK(t.is_contiguous() && holds(t), "embcache: ", what, " must be a contiguous ", name,
                " tensor");
  }
};

/// Every table's spec, decoded and checked: `specs` is a contiguous int64 CPU tensor
/// [tables, kNumSpecFields] (the tables' TableConfig.spec(), stacked).
inline std::vector<TableSpec> decode_specs(const at::Tensor& specs) {
  TORCH_CHECK(specs.scalar_type() == at::kLong && specs.device().is_cpu() &&
                  specs.is_contiguous() && specs.dim() == 2 && specs.size(1) == kNumSpecFields,
              "embcache: specs must be a contiguous int64 CPU tensor [tables, ", kNumSpecFields,
              "], got ", specs.scalar_type(), " ", specs.sizes(), " on ", specs.device());
  std::vector<TableSpec> out(specs.size(0));
  const int64_t* s = specs.data_ptr<int64_t>();
  for (size_t t = 0; t < out.size(); ++t) {
    const int64_t* row = s + t * kNumSpecFields;
    const int bad = decode_spec(row, &out[t]);
    TORCH_CHECK(bad < 0, "embcache: table ", t, ": spec field ", kSpecFieldNames[bad < 0 ? 0 : bad],
                " is out of range: ", row[bad < 0 ? 0 : bad]);
  }
  return out;
}

/// One table's spec, decoded and checked: its TableConfig.spec() ([kNumSpecFields]), or a
/// specs tensor of that one table ([1, kNumSpecFields]).
inline TableSpec decode_table_spec(const at::Tensor& spec) {
  const std::vector<TableSpec> s = decode_specs(spec.dim() == 1 ? spec.unsqueeze(0) : spec);
  TORCH_CHECK(s.size() == 1, "embcache: spec must be one table's, got ", s.size(), " tables");
  return s[0];
}

/// The dtype of a table's LFU counts (LfuCounts): int8, int16 or int32; int32 for the empty
/// counts of a table that keeps none.
inline at::ScalarType counts_dtype(const TableSpec& spec) {
  return spec.count_bits == 8 ? at::kChar : spec.count_bits == 16 ? at::kShort : at::kInt;
}

/// Where a table's storage lies (docs/design.md, "Host placement"): with its cache, in the
/// memory of the op's device (kDevice), or in pinned host memory beside a GPU (kHost), which
/// the kernels read and write in place: under CUDA's unified virtual addressing a pinned CPU
/// tensor's address is valid on the GPU. The names are embcache.config.PLACEMENTS'.
enum class Placement : int { kDevice, kHost };
constexpr const char* kPlacementNames[] = {"device", "host"};

/// A tensor's memory, for messages: "cuda:0", "cpu", "cpu (pinned)".
inline std::string memory_of(const at::Tensor& v) {
  const std::string d = v.device().str();
  return v.is_cpu() && v.numel() > 0 && v.is_pinned() ? d + " (pinned)" : d;
}

/// Where table `t`'s state tensors `x` (kNumStateTensors, in EMBCACHE_STATE_TENSORS order)
/// lie, checked by their tiers (state_tier: the optimizer's values a row are optimizer_state's
/// elements over weights' rows), the seam between storage and cache:
///   * its cache tensors on one device, the op's: that of cache_tags;
///   * its storage tensors all in one place: on that same device (Placement::kDevice), or,
///     where that device is not the CPU, in pinned host memory (Placement::kHost: weights
///     pinned, and the others with them). A storage tensor without elements has no memory to
///     place, so a CPU one goes with pinned weights.
/// On the CPU (and on the warp emulator, whose "device" is the CPU) a table is therefore all
/// CPU tensors, pinned or not, as before. Otherwise one error naming the table and the tensor.
inline Placement state_placement(const at::Tensor* x, size_t t) {
  const at::Device op = x[kCacheTags].device();
  const bool host = !op.is_cpu() && x[kWeights].is_cpu() && x[kWeights].is_pinned();
  const int64_t rows = x[kWeights].size(0);
  const int64_t width = rows > 0 ? x[kOptimizerState].numel() / rows : 0;
  for (int i = 0; i < kNumStateTensors; ++i) {
    const at::Tensor& v = x[i];
    if (state_tier(i, width) == kCache) {
      TORCH_CHECK(v.device() == op, "embcache: table ", t, ": ", kStateTensorNames[i], " is on ",
                  memory_of(v), ": a table's cache tensors (its cache, LFU counts and an "
                  "optimizer state of one value a row) must all be on the device of its "
                  "cache_tags, ", op);
    } else if (host) {
      TORCH_CHECK(v.is_cpu() && (v.numel() == 0 || v.is_pinned()), "embcache: table ", t, ": ",
                  kStateTensorNames[i], " is on ", memory_of(v),
                  ": its weights are in pinned host memory, and a table's storage (weights, "
                  "and an optimizer state of a value an element) must all be there");
    } else {
      TORCH_CHECK(v.device() == op, "embcache: table ", t, ": ", kStateTensorNames[i], " is on ",
                  memory_of(v), ": a table's storage must be on the device of its cache, ", op,
                  op.is_cpu() ? "" : ", or all of it in pinned host memory");
    }
  }
  return host ? Placement::kHost : Placement::kDevice;
}

/// The state of every table with `specs`, checked: `state` holds kNumStateTensors tensors per
/// table, table t's tensor i at state[t * kNumStateTensors + i] in EMBCACHE_STATE_TENSORS
/// order. Each must be contiguous, of its dtype and shape: weights uint8 [rows, row bytes];
/// cache_tags and cache_priority int32 [slots]; cache_rows float32 [slots, dim];
/// cache_set_floor int32 [num_sets]; counts of counts_dtype [rows] if the table keeps LFU
/// counts, else int32 [0]; optimizer_state float32 [rows * state width]. Its cache must be on
/// `device`, and its storage with it or in pinned host memory (state_placement: each table's
/// placement goes to `placement` if given). The weights start at a 16-byte boundary (every
/// allocation does), so that the rows of an fp32 or fp16 table are aligned to their values
/// (the CUDA kernels read them as words).
inline std::vector<TableState> table_states(at::TensorList state,
                                            const std::vector<TableSpec>& specs,
                                            const DeviceKind& device,
                                            std::vector<Placement>* placement = nullptr) {
  TORCH_CHECK(state.size() == specs.size() * kNumStateTensors, "embcache: state must hold ",
              kNumStateTensors, " tensors per table (", specs.size(), " tables), got ",
              state.size());
  std::vector<TableState> out;
  for (size_t t = 0; t < specs.size(); ++t) {
    const TableSpec& spec = specs[t];
    const at::Tensor* x = state.data() + t * kNumStateTensors;
    auto check = [&](int i, at::ScalarType dtype, at::IntArrayRef shape) {
      const at::Tensor& v = x[i];
      TORCH_CHECK(v.scalar_type() == dtype && v.sizes() == shape && v.is_contiguous(),
                  "embcache: table ", t, ": ", kStateTensorNames[i], " must be a contiguous ",
                  dtype, " tensor of shape ", shape, ", got ", v.scalar_type(), " ", v.sizes(),
                  v.is_contiguous() ? "" : " (not contiguous)");
    };
    const int64_t slots = spec.slots();
    check(kWeights, at::kByte, {spec.rows, spec.f.row_bytes()});
    check(kCacheTags, at::kInt, {slots});
    check(kCacheRows, at::kFloat, {slots, spec.f.dim});
    check(kCachePriority, at::kInt, {slots});
    check(kCacheSetFloor, at::kInt, {spec.num_sets});
    check(kCounts, counts_dtype(spec), {spec.lfu() ? spec.rows : 0});
    check(kOptimizerState, at::kFloat, {spec.rows * spec.state_width()});
    TORCH_CHECK(device.holds(x[kCacheTags]), "embcache: table ", t, ": its cache must be on a ",
                device.name, " device for these ops, got cache_tags on ", memory_of(x[kCacheTags]));
    const Placement where = state_placement(x, t);
    if (placement) placement->push_back(where);
    TORCH_CHECK(reinterpret_cast<uintptr_t>(x[kWeights].data_ptr()) % 16 == 0, "embcache: table ",
                t, ": weights must start at a 16-byte boundary (a view into another tensor may not)");
    out.push_back(TableState{x[kWeights].data_ptr<uint8_t>(), x[kCacheTags].data_ptr<int32_t>(),
                             x[kCacheRows].data_ptr<float>(), x[kCachePriority].data_ptr<int32_t>(),
                             x[kCacheSetFloor].data_ptr<int32_t>(),
                             LfuCounts{x[kCounts].data_ptr(), spec.count_bits},
                             x[kOptimizerState].data_ptr<float>()});
  }
  return out;
}

/// Every table's counters: a contiguous int64 CPU tensor of kNumCounters each; none if the
/// list is empty and `optional` (an evaluation forward counts nothing).
inline std::vector<int64_t*> tables_counters(at::TensorList counters, size_t tables,
                                             bool optional) {
  TORCH_CHECK(counters.size() == tables || (optional && counters.empty()),
              "embcache: counters must be one tensor per table", optional ? ", or none" : "");
  std::vector<int64_t*> out;
  for (const at::Tensor& c : counters) {
    TORCH_CHECK(c.scalar_type() == at::kLong && c.device().is_cpu() && c.is_contiguous() &&
                    c.numel() == kNumCounters,
                "embcache: counters must be contiguous int64 CPU tensors of ", kNumCounters);
    out.push_back(c.data_ptr<int64_t>());
  }
  return out;
}

/// An op's tables, checked: their specs decoded, their state (table_states), their counters
/// (tables_counters) and where each one's storage lies.
struct Tables {
  std::vector<TableSpec> spec;
  std::vector<TableState> state;
  std::vector<int64_t*> counters;
  std::vector<Placement> placement;
};

inline Tables op_tables(at::TensorList state, const at::Tensor& specs, at::TensorList counters,
                        bool counters_optional, const DeviceKind& device) {
  Tables t{decode_specs(specs), {}, {}, {}};
  t.state = table_states(state, t.spec, device, &t.placement);
  t.counters = tables_counters(counters, t.spec.size(), counters_optional);
  return t;
}

/// Adds a table's device counts (kNumDeviceCounts, summed over any number of forwards and
/// commits) to its counters: the lookups and hits; of the unique rows counted but not yet
/// classified (kUniqueRows less kUniqueHits and kUniqueMisses), the commits' unique hits are
/// the hits, the others misses, and the misses not inserted were bypassed (kBypasses).
inline void fold_counts(int64_t* counter, const int64_t* device_counts) {
  counter[kLookups] += device_counts[kDeviceLookups];
  counter[kHits] += device_counts[kDeviceHits];
  const int64_t unclassified = counter[kUniqueRows] - counter[kUniqueHits] - counter[kUniqueMisses];
  const int64_t hits = device_counts[kCommitHits], inserted = device_counts[kCommitInsertions];
  counter[kUniqueHits] += hits;
  counter[kUniqueMisses] += unclassified - hits;
  counter[kInsertions] += inserted;
  counter[kEvictions] += device_counts[kCommitEvictions];
  counter[kBypasses] += unclassified - hits - inserted;
}

/// Adds the probes of the rows a commit or a flush wrote (counters kProbedRows ..
/// kProbedExpectedUpE6).
inline void count_probe(int64_t* counter, const RoundingProbe& p) {
  counter[kProbedRows] += p.rows;
  counter[kProbedErrorSumE9] += p.error_sum_e9;
  counter[kProbedErrorMaxE9] = std::max(counter[kProbedErrorMaxE9], p.error_max_e9);
  counter[kProbedUp] += p.up;
  counter[kProbedDown] += p.down;
  counter[kProbedExpectedUpE6] += p.expected_up_e6;
}

/// One table's part of a table-batched gradient (multi_dedup_backward's output, multi_update's
/// input): its unique rows are positions [first, end) of unique_rows, with their occurrences
/// (and slot hints) at the same positions, and their gradients (end - first) x dim floats of
/// the 1-D grads from `value`.
struct RowRange {
  int64_t first, end, value;
};

/// A table-batched gradient, checked: unique_rows, occurrences and (unless empty) slot_hints
/// 1-D int64 of one length, grads 1-D float32, row_ranges int64 [tables, 3] (RowRange), all
/// on `device`. Where the host can read them (`host_ranges`, the CPU ops) returns the ranges,
/// checked: ascending, disjoint and within the arrays; a GPU's kernels check them instead
/// (kBadRanges) and this returns none.
inline std::vector<RowRange> gradient_ranges(const at::Tensor& unique_rows, const at::Tensor& grads,
                                             const at::Tensor& occurrences,
                                             const at::Tensor& slot_hints,
                                             const at::Tensor& row_ranges,
                                             const std::vector<TableSpec>& specs,
                                             const DeviceKind& device, bool host_ranges) {
  const int64_t nt = (int64_t)specs.size(), n = unique_rows.numel();
  auto check = [&](const at::Tensor& x, at::ScalarType dtype, int64_t numel, const char* what) {
    TORCH_CHECK(x.scalar_type() == dtype && x.dim() == 1 && x.is_contiguous() &&
                    (numel < 0 || x.numel() == numel) && device.holds(x) &&
                    x.device() == unique_rows.device(),
                "embcache: ", what, " must be a contiguous 1-D ", c10::toString(dtype), " ",
                device.name, " tensor", numel < 0 ? "" : " of the length of unique_rows",
                " on its device");
  };
  check(unique_rows, at::kLong, -1, "unique_rows");
  check(occurrences, at::kLong, n, "occurrences");
  if (slot_hints.numel() > 0) check(slot_hints, at::kLong, n, "slot_hints");
  check(grads, at::kFloat, -1, "grads");
  device.check(row_ranges, at::kLong, "row_ranges");
  TORCH_CHECK(row_ranges.dim() == 2 && row_ranges.size(0) == nt && row_ranges.size(1) == 3 &&
                  row_ranges.device() == unique_rows.device(),
              "embcache: row_ranges must be [tables, 3] = [", nt, ", 3] on the device of "
              "unique_rows, got ", row_ranges.sizes());
  std::vector<RowRange> out;
  if (!host_ranges) return out;
  const int64_t* r = row_ranges.data_ptr<int64_t>();
  int64_t past = 0;
  for (int64_t t = 0; t < nt; ++t) {
    const RowRange g{r[3 * t], r[3 * t + 1], r[3 * t + 2]};
    TORCH_CHECK(g.first >= past && g.end >= g.first && g.end <= n && g.value >= 0 &&
                    g.value + (g.end - g.first) * specs[t].f.dim <= grads.numel(),
                "embcache: row_ranges of table ", t, " (", g.first, ", ", g.end, ", ", g.value,
                ") must follow the previous table's rows and lie within unique_rows (", n,
                ") and grads (", grads.numel(), ")");
    past = g.end;
    out.push_back(g);
  }
  return out;
}

/// Every table's device counts (DeviceCount): a contiguous int64 tensor of kNumDeviceCounts on
/// the op's device (that of the table's cache, where its weights may be in host memory), which
/// the op adds to; none if the list is empty and `optional` (an evaluation forward counts
/// nothing).
inline std::vector<int64_t*> tables_device_counts(at::TensorList device_counts,
                                                  at::TensorList state, size_t tables,
                                                  bool optional, const DeviceKind& device) {
  TORCH_CHECK(device_counts.size() == tables || (optional && device_counts.empty()),
              "embcache: device_counts must be one tensor per table", optional ? ", or none" : "");
  std::vector<int64_t*> out;
  for (size_t t = 0; t < device_counts.size(); ++t) {
    const at::Tensor& c = device_counts[t];
    const at::Device where = state[t * kNumStateTensors + kCacheTags].device();
    TORCH_CHECK(c.scalar_type() == at::kLong && c.is_contiguous() &&
                    c.numel() == kNumDeviceCounts && device.holds(c) && c.device() == where,
                "embcache: table ", t, ": device_counts must be a contiguous int64 ", device.name,
                " tensor of ", kNumDeviceCounts, " on the device of the table's cache, ", where,
                ", got ", c.scalar_type(), " ", c.sizes(), " on ", c.device());
    out.push_back(c.data_ptr<int64_t>());
  }
  return out;
}

/// A gate (multi_update): int64 words on `device` of which any non-zero one stops the commit,
/// or none.
inline void check_gate(const c10::optional<at::Tensor>& gate, const at::Tensor& like,
                       const DeviceKind& device) {
  if (!gate.has_value()) return;
  device.check(*gate, at::kLong, "gate");
  TORCH_CHECK(gate->dim() == 1 && gate->device() == like.device(),
              "embcache: gate must be 1-D, on the device of unique_rows");
}

/// multi_update's tables and gradient, checked: op_tables, one value bound per table, each
/// table's part of the gradient (gradient_ranges: none where the host cannot read them), its
/// device counts and the gate.
struct UpdateArgs {
  Tables tables;
  std::vector<RowRange> ranges;
  std::vector<int64_t*> device_counts;  // table t's, on its device (tables_device_counts)
};

inline UpdateArgs update_args(at::TensorList state, const at::Tensor& specs,
                              const at::Tensor& unique_rows, const at::Tensor& grads,
                              const at::Tensor& occurrences, const at::Tensor& slot_hints,
                              const at::Tensor& row_ranges, at::ArrayRef<double> value_bounds,
                              at::TensorList counters, at::TensorList device_counts,
                              const c10::optional<at::Tensor>& gate, const DeviceKind& device,
                              bool host_ranges) {
  UpdateArgs a{op_tables(state, specs, counters, false, device), {}, {}};
  const size_t nt = a.tables.spec.size();
  TORCH_CHECK(value_bounds.size() == nt, "embcache: one value bound per table");
  a.device_counts = tables_device_counts(device_counts, state, nt, false, device);
  a.ranges = gradient_ranges(unique_rows, grads, occurrences, slot_hints, row_ranges,
                             a.tables.spec, device, host_ranges);
  check_gate(gate, unique_rows, device);
  return a;
}

/// Column offsets of features of these dims in a [batch, sum of dims] output.
inline std::vector<int64_t> column_offsets(const std::vector<int64_t>& dims) {
  std::vector<int64_t> col(dims.size() + 1, 0);
  for (size_t f = 0; f < dims.size(); ++f) col[f + 1] = col[f] + dims[f];
  return col;
}

/// Each feature's dim (that of its table), checked: feature_table[f] names one of the tables.
inline std::vector<int64_t> feature_dims(at::IntArrayRef feature_table,
                                         const std::vector<TableSpec>& specs) {
  std::vector<int64_t> dims;
  for (size_t f = 0; f < feature_table.size(); ++f) {
    const int64_t t = feature_table[f];
    TORCH_CHECK(t >= 0 && t < (int64_t)specs.size(), "embcache: feature ", f, " names table ", t,
                ", not one of the ", specs.size(), " tables");
    dims.push_back(specs[t].f.dim);
  }
  return dims;
}

/// The column offsets of the features in a [batch, sum of their tables' dims] output.
inline std::vector<int64_t> feature_columns(at::IntArrayRef feature_table,
                                            const std::vector<TableSpec>& specs) {
  return column_offsets(feature_dims(feature_table, specs));
}

/// The column offsets of the max-pooled features in the forward's argmax (docs/design.md,
/// "Max pooling"), an int32 [batch, sum of those features' dims]: feature f's columns start at
/// col[f]; a feature pooled otherwise has none (col[f + 1] == col[f]). Refuses per-sample
/// weights (`weighted`) with a max-pooled feature, as nn.EmbeddingBag does.
inline std::vector<int64_t> argmax_columns(at::IntArrayRef feature_table,
                                           const std::vector<TableSpec>& specs, bool weighted) {
  std::vector<int64_t> dims = feature_dims(feature_table, specs);
  for (size_t f = 0; f < dims.size(); ++f)
    if (specs[feature_table[f]].pooling != kMax) dims[f] = 0;
  std::vector<int64_t> col = column_offsets(dims);
  TORCH_CHECK(!weighted || col.back() == 0,
              "embcache: per_sample_weights are only supported with mode='sum', not with max");
  return col;
}

/// multi_dedup_backward's tables and gradient, checked: grad_output is float32 [batch, sum of
/// the features' dims] on `device`; with max-pooled features, `argmax` is the forward's
/// (int32 [batch, argmax_col.back()] on `device`), else it is not read.
struct DedupArgs {
  std::vector<TableSpec> spec;
  std::vector<int64_t> dims;        // of each feature
  std::vector<int64_t> col;         // column_offsets(dims)
  std::vector<int64_t> argmax_col;  // argmax_columns
  const int32_t* argmax;            // nullptr without max-pooled features
  int64_t batch;
};

inline DedupArgs dedup_args(const at::Tensor& grad_output, const at::Tensor& specs,
                            at::IntArrayRef feature_table, const c10::optional<at::Tensor>& psw,
                            const c10::optional<at::Tensor>& argmax, const DeviceKind& device) {
  DedupArgs a{decode_specs(specs), {}, {}, {}, nullptr, 0};
  a.dims = feature_dims(feature_table, a.spec);
  a.col = column_offsets(a.dims);
  a.argmax_col = argmax_columns(feature_table, a.spec, psw.has_value());
  device.check(grad_output, at::kFloat, "grad_output");
  TORCH_CHECK(grad_output.dim() == 2 && grad_output.size(1) == a.col.back(),
              "embcache: grad_output must be [batch, sum of the features' dims] = [batch, ",
              a.col.back(), "], got ", grad_output.sizes());
  a.batch = grad_output.size(0);
  if (a.argmax_col.back() > 0) {
    TORCH_CHECK(argmax.has_value(), "embcache: max-pooled features need the forward's argmax");
    device.check(*argmax, at::kInt, "argmax");
    TORCH_CHECK(argmax->dim() == 2 && argmax->size(0) == a.batch &&
                    argmax->size(1) == a.argmax_col.back(),
                "embcache: argmax must be [batch, sum of the max-pooled features' dims] = [",
                a.batch, ", ", a.argmax_col.back(), "], got ", argmax->sizes());
    a.argmax = argmax->data_ptr<int32_t>();
  }
  return a;
}

/// Lookups: int64 1-D indices, and optionally one float32 weight per index, on `device`.
inline void check_lookups(const at::Tensor& indices, const c10::optional<at::Tensor>& psw,
                          const DeviceKind& device) {
  device.check(indices, at::kLong, "indices");
  TORCH_CHECK(indices.dim() == 1, "embcache: indices must be 1-D");
  if (psw.has_value()) {
    device.check(*psw, at::kFloat, "per_sample_weights");
    TORCH_CHECK(psw->numel() == indices.numel(),
                "embcache: per_sample_weights must have one weight per index");
  }
}

/// A stage (stage_misses' outputs, csrc/include/embcache/stage.h), checked: int64 slots
/// [entries, 2], entries a power of two and at least twice the rows, and uint8 rows [copies,
/// stride] on `device`, the stride a multiple of 16 (rows stay aligned to their values) and
/// the rows starting at a 16-byte boundary; `lookups`, if not negative, the lookups it must
/// be the stage of (a copy for each).
inline void check_stage(const at::Tensor& slots, const at::Tensor& rows, int64_t lookups,
                        const DeviceKind& device) {
  device.check(slots, at::kLong, "staged_slots");
  device.check(rows, at::kByte, "staged_rows");
  const int64_t entries = slots.dim() == 2 ? slots.size(0) : 0;
  TORCH_CHECK(slots.dim() == 2 && slots.size(1) == 2 && entries > 0 &&
                  (entries & (entries - 1)) == 0 && rows.dim() == 2 &&
                  entries >= 2 * rows.size(0) && rows.size(1) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0,
              "embcache: a stage is int64 slots [a power of two, at least twice the rows, 2] "
              "and uint8 rows [n, a multiple of 16] starting at a 16-byte boundary, got ",
              slots.sizes(), " and ", rows.sizes());
  TORCH_CHECK(lookups < 0 || rows.size(0) == lookups, "embcache: the stage holds ",
              rows.size(0), " copies, for as many lookups; this call has ", lookups);
}

/// unstage_rows's arguments, checked: a stage's slots, an update's int64 unique rows and its
/// row ranges [parts, 3] on `device`, and for each table position of the stage a part or -1.
inline void check_unstage_args(const at::Tensor& slots, const at::Tensor& rows,
                               const at::Tensor& ranges, at::IntArrayRef range_of,
                               const DeviceKind& device) {
  device.check(slots, at::kLong, "staged_slots");
  TORCH_CHECK(slots.dim() == 2 && slots.size(1) == 2,
              "embcache: staged_slots must be [entries, 2], got ", slots.sizes());
  device.check(rows, at::kLong, "unique_rows");
  device.check(ranges, at::kLong, "row_ranges");
  TORCH_CHECK(ranges.dim() == 2 && ranges.size(1) == 3,
              "embcache: row_ranges must be [parts, 3], got ", ranges.sizes());
  for (int64_t r : range_of)
    TORCH_CHECK(r >= -1 && r < ranges.size(0), "embcache: range_of_table holds ", r,
                ", not a part of the ", ranges.size(0), " row ranges or -1");
}

/// quantize_rows's arguments, checked, and how it rounds.
struct QuantizeArgs {
  RowFormat f;
  bool stochastic;
  RoundingStream stream;
};

/// quantize_rows's arguments, checked: float32 values [rows, the spec's dim] and one int64 row
/// id per row on `device`. Rounded as the table rounds at update `step`, or to nearest
/// without a step.
inline QuantizeArgs quantize_args(const at::Tensor& values, const at::Tensor& row_ids,
                                  const at::Tensor& spec, c10::optional<int64_t> step,
                                  const DeviceKind& device) {
  const TableSpec t = decode_table_spec(spec);
  device.check(values, at::kFloat, "values");
  device.check(row_ids, at::kLong, "row_ids");
  TORCH_CHECK(values.dim() == 2 && values.size(1) == t.f.dim && row_ids.numel() == values.size(0),
              "embcache: values must be [rows, ", t.f.dim, "] with one row id per row, got ",
              values.sizes(), " and ", row_ids.numel(), " row ids");
  return QuantizeArgs{t.f, step.has_value() && t.stochastic, t.stream(step.value_or(0))};
}

/// dequantize_rows's arguments, checked: uint8 weights [rows, row bytes] on `device`, in the
/// format of `spec`; returns that format.
inline RowFormat dequantize_args(const at::Tensor& weights, const at::Tensor& spec,
                                 const DeviceKind& device) {
  const RowFormat f = decode_table_spec(spec).f;
  device.check(weights, at::kByte, "weights");
  TORCH_CHECK(weights.dim() == 2 && weights.size(1) == f.row_bytes(),
              "embcache: weights must be [rows, ", f.row_bytes(), "] bytes, got ",
              weights.sizes());
  return f;
}

}  // namespace embcache
