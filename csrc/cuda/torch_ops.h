// Torch glue over csrc/cuda/cache_api.h: the ops of csrc/op_schemas.h (same schemas and
// results as the CPU ops of csrc/cpu, bit for bit) implemented by the cache kernels: the
// forward launches feature after feature, the update every table at once. Included by
//   * csrc/cuda/binding.cpp   (EMBCACHE_GPU_NS = gpu: CUDA tensors, the current stream);
//   * csrc/emulated/emu_ops.cpp (EMBCACHE_GPU_NS = emu: CPU tensors, kernels on the emulator),
// which define, before including this file, in namespace embcache::EMBCACHE_GPU_NS:
//   bool on_device(const at::Tensor&);   Stream current_stream();   const char* kDeviceName;
// and the macro EMBCACHE_DEVICE_GUARD(tensor) (makes the tensor's device current).
//
// The kernels find the update's slots and check its values themselves, so these ops give no
// slot hints or value bounds (multi_lookup_forward's third and fourth outputs are empty) and
// ignore those they are given.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "../tables.h"
#include "cache_api.h"

namespace embcache {
namespace EMBCACHE_GPU_NS {
namespace ops {

/// This build's device, for the checks of csrc/tables.h.
inline constexpr DeviceKind kDevice{on_device, kDeviceName};

inline at::Tensor quantize_rows(const at::Tensor& values, const at::Tensor& row_ids,
                                const at::Tensor& spec, c10::optional<int64_t> step) {
  EMBCACHE_DEVICE_GUARD(values);
  const QuantizeArgs a = quantize_args(values, row_ids, spec, step, kDevice);
  const int64_t n = values.size(0);
  at::Tensor out = at::empty({n, (int64_t)a.f.row_bytes()}, values.options().dtype(at::kByte));
  const int64_t bad = EMBCACHE_GPU_NS::quantize_rows(values.data_ptr<float>(),
                                                     row_ids.data_ptr<int64_t>(), n, a.f,
                                                     a.stochastic, a.stream,
                                                     out.data_ptr<uint8_t>(), current_stream());
  TORCH_CHECK(bad < 0, "embcache: row ", bad < 0 ? 0 : row_ids[bad].item<int64_t>(),
              " cannot be stored in ", a.f.bits, " bits: non-finite or out of range");
  return out;
}

inline at::Tensor dequantize_rows(const at::Tensor& weights, const at::Tensor& spec) {
  EMBCACHE_DEVICE_GUARD(weights);
  const RowFormat f = dequantize_args(weights, spec, kDevice);
  at::Tensor out =
      at::empty({weights.size(0), (int64_t)f.dim}, weights.options().dtype(at::kFloat));
  EMBCACHE_GPU_NS::dequantize_rows(weights.data_ptr<uint8_t>(), weights.size(0), f,
                                   out.data_ptr<float>(), current_stream());
  return out;
}

/// As on the CPU: every table's state is checked before any is written. The kernels leave
/// cache_set_floor alone but for the flush's reset: they apply the set rule to every set, and
/// as priorities only rise between flushes the floors stay lower bounds.
inline std::vector<int64_t> cache_flush(at::TensorList state, const at::Tensor& specs,
                                        at::TensorList counters) {
  const Tables tables = op_tables(state, specs, counters, false, kDevice);
  std::vector<int64_t> written;
  for (size_t t = 0; t < tables.spec.size(); ++t) {
    const at::Tensor* x = state.data() + t * kNumStateTensors;
    EMBCACHE_DEVICE_GUARD(x[kCacheTags]);
    const RoundingStream s = tables.spec[t].stream(tables.counters[t][kSteps]);
    written.push_back(flush_cache(tables.spec[t], tables.state[t], s, current_stream()));
    x[kCacheRows].zero_();
    x[kCachePriority].zero_();
    x[kCacheSetFloor].fill_(std::numeric_limits<int32_t>::min());
    tables.counters[t][kFlushed] += written.back();
  }
  return written;
}

/// A buffer of n device words, zeroed, for the kernels' flags and counts (cache_api.h).
inline at::Tensor flag_words(const at::Tensor& like, int64_t n) {
  return at::zeros({n}, like.options().dtype(at::kLong));
}
inline unsigned long long* words(const at::Tensor& flags) {
  return reinterpret_cast<unsigned long long*>(flags.data_ptr<int64_t>());
}

/// Every tensor an op reads or writes on the device of the tables' caches (a host-placed table's
/// storage is in pinned host memory beside it: csrc/tables.h, state_placement).
inline void check_same_device(const Tables& tables, at::TensorList state, const at::Tensor& x,
                              const char* what) {
  TORCH_CHECK(tables.spec.empty() || x.device() == state[kCacheTags].device(), "embcache: ",
              what, " is on ", x.device(), ", the tables on ", state[kCacheTags].device());
}

/// The op's bags: nf features of `batch` bags over `offsets` (checked here: its length; its
/// values by the kernels); feature f is first = f * batch.
inline Bags op_bags(const at::Tensor& indices, const at::Tensor& offsets,
                    const c10::optional<at::Tensor>& psw, int64_t nf, int64_t batch) {
  check_lookups(indices, psw, kDevice);
  kDevice.check(offsets, at::kLong, "offsets");
  TORCH_CHECK(offsets.dim() == 1 && offsets.device() == indices.device(),
              "embcache: offsets must be 1-D, with the end appended, on the device of indices");
  TORCH_CHECK(batch >= 0 && offsets.numel() == nf * batch + 1,
              "embcache: offsets must have features * batch + 1 entries");
  TORCH_CHECK(nf * batch > 0 || indices.numel() == 0,
              "embcache: offsets must start at 0 and end at len(indices)");
  return Bags{indices.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), 0, nf * batch,
              nf * batch, indices.numel(), psw ? psw->data_ptr<float>() : nullptr};
}

/// The bags' offsets (int64, the end appended) from their lengths, checked: 1-D int32 or
/// int64 on the device.
inline at::Tensor offsets_of(const at::Tensor& lengths) {
  TORCH_CHECK(lengths.dim() == 1 && on_device(lengths) &&
                  (lengths.scalar_type() == at::kInt || lengths.scalar_type() == at::kLong),
              "embcache: lengths must be a 1-D int32 or int64 ", kDeviceName, " tensor");
  return at::cat({at::zeros({1}, lengths.options().dtype(at::kLong)), lengths.cumsum(0, at::kLong)});
}

/// Table position t's view of a stage (checked: check_stage), or none.
inline Stage stage_of(const c10::optional<at::Tensor>& slots,
                      const c10::optional<at::Tensor>& rows, int64_t t) {
  if (!slots.has_value()) return kNoStage;
  return Stage{slots->data_ptr<int64_t>(), slots->size(0) - 1, rows->data_ptr<uint8_t>(),
               rows->size(1), t};
}

/// The forward: every feature's bags launched on the stream, each adding its lookups and
/// hits to its table's device counts; nothing is read back (the error bits are returned).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
multi_lookup_forward(at::TensorList state, const at::Tensor& specs, const at::Tensor& indices,
                     const at::Tensor& lengths,
                     const c10::optional<at::Tensor>& per_sample_weights,
                     at::IntArrayRef feature_table, int64_t batch,
                     at::TensorList device_counts, const c10::optional<at::Tensor>& staged_slots,
                     const c10::optional<at::Tensor>& staged_rows) {
  EMBCACHE_DEVICE_GUARD(indices);
  const Tables tables = op_tables(state, specs, {}, true, kDevice);
  const std::vector<int64_t*> counts =
      tables_device_counts(device_counts, state, tables.spec.size(), true, kDevice);
  const std::vector<TableSpec>& spec = tables.spec;
  const int64_t nf = (int64_t)feature_table.size();
  const std::vector<int64_t> col = feature_columns(feature_table, spec);
  const std::vector<int64_t> argmax_col =
      argmax_columns(feature_table, spec, per_sample_weights.has_value());
  TORCH_CHECK(argmax_col[nf] == 0 || indices.numel() <= INT32_MAX,
              "embcache: at most 2^31 - 1 lookups per call with max pooling");
  check_same_device(tables, state, indices, "indices");
  TORCH_CHECK(staged_slots.has_value() == staged_rows.has_value(),
              "embcache: a stage is staged_slots and staged_rows together");
  if (staged_slots.has_value()) check_stage(*staged_slots, *staged_rows, indices.numel(), kDevice);
  const at::Tensor offsets = offsets_of(lengths);
  Bags bags = op_bags(indices, offsets, per_sample_weights, nf, batch);
  at::Tensor out = at::empty({batch, col[nf]}, indices.options().dtype(at::kFloat));
  at::Tensor argmax = at::empty({batch, argmax_col[nf]}, indices.options().dtype(at::kInt));
  const at::Tensor errors = flag_words(indices, 1);
  for (int64_t f = 0; f < nf && batch > 0; ++f) {
    const int64_t t = feature_table[f];
    bags.first = f * batch;
    bags.nb = batch;
    pool_bags(spec[t], tables.state[t], bags, stage_of(staged_slots, staged_rows, t),
              out.data_ptr<float>() + col[f], col[nf],
              argmax.data_ptr<int32_t>() + argmax_col[f], argmax_col[nf], words(errors),
              counts.empty() ? nullptr : (unsigned long long*)counts[t] + kDeviceLookups,
              current_stream());
  }
  return {out, offsets, at::empty({0}, indices.options().dtype(at::kInt)),
          at::empty({0}, at::kFloat), argmax, errors};
}

/// The stage of the lookups' misses in the tables `staged_tables` (stage_misses), made in
/// one launch; nothing is read back.
inline std::tuple<at::Tensor, at::Tensor> stage_misses(at::TensorList state,
                                                       const at::Tensor& specs,
                                                       const at::Tensor& indices,
                                                       const at::Tensor& lengths,
                                                       at::IntArrayRef feature_table,
                                                       int64_t batch,
                                                       at::IntArrayRef staged_tables) {
  EMBCACHE_DEVICE_GUARD(indices);
  const Tables tables = op_tables(state, specs, {}, true, kDevice);
  const int64_t nf = (int64_t)feature_table.size(), nt = (int64_t)tables.spec.size();
  feature_columns(feature_table, tables.spec);
  TORCH_CHECK(nt <= kMaxStagedTables, "embcache: at most ", kMaxStagedTables,
              " tables per stage, got ", nt);
  check_same_device(tables, state, indices, "indices");
  const at::Tensor offsets = offsets_of(lengths);  // (the bags point into it)
  const Bags bags = op_bags(indices, offsets, c10::nullopt, nf, batch);
  std::vector<StagedTable> staged(nt);
  for (int64_t t = 0; t < nt; ++t) staged[t] = StagedTable{tables.spec[t], tables.state[t], false};
  int64_t widest = 0;
  for (int64_t t : staged_tables) {
    TORCH_CHECK(t >= 0 && t < nt, "embcache: staged_tables holds ", t, ", not a table of ", nt);
    staged[t].staged = true;
    widest = std::max<int64_t>(widest, tables.spec[t].f.row_bytes());
  }
  const int64_t n = indices.numel(), stride = (widest + 15) / 16 * 16;
  int64_t entries = 2;  // a power of two, at least twice the lookups
  while (entries < 2 * n) entries *= 2;
  const at::Tensor slots = at::full({entries, 2}, kNoStagedRow, indices.options());
  const at::Tensor rows = at::empty({n, stride}, indices.options().dtype(at::kByte));
  if (stride > 0)
    EMBCACHE_GPU_NS::stage_misses(staged.data(), nt, bags, batch, nf, feature_table.data(),
                                  slots.data_ptr<int64_t>(), entries - 1,
                                  rows.data_ptr<uint8_t>(), stride, current_stream());
  return {slots, rows};
}

/// unstage_rows on the device: nothing read back.
inline void unstage_rows(const at::Tensor& slots, const at::Tensor& unique_rows,
                         const at::Tensor& row_ranges, at::IntArrayRef range_of_table) {
  EMBCACHE_DEVICE_GUARD(slots);
  check_unstage_args(slots, unique_rows, row_ranges, range_of_table, kDevice);
  TORCH_CHECK(unique_rows.device() == slots.device() && row_ranges.device() == slots.device(),
              "embcache: the stage and the update must be on one device");
  EMBCACHE_GPU_NS::unstage_rows(slots.data_ptr<int64_t>(), slots.size(0),
                                unique_rows.data_ptr<int64_t>(), unique_rows.numel(),
                                row_ranges.data_ptr<int64_t>(), range_of_table.data(),
                                (int64_t)range_of_table.size(), current_stream());
}

/// The backward, read back nowhere: outputs sized for every lookup a unique row (grads for
/// the widest feature, zero past the last feature's block), the features' ranges on the
/// device, and the error bits returned (csrc/op_schemas.h).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
multi_dedup_backward(const at::Tensor& indices, const at::Tensor& offsets,
                     const c10::optional<at::Tensor>& per_sample_weights,
                     const at::Tensor& grad_output, const at::Tensor& specs,
                     at::IntArrayRef feature_table,
                     const c10::optional<at::Tensor>& /*lookup_slots*/,
                     const c10::optional<at::Tensor>& argmax) {
  EMBCACHE_DEVICE_GUARD(indices);
  const DedupArgs a =
      dedup_args(grad_output, specs, feature_table, per_sample_weights, argmax, kDevice);
  const int64_t nf = (int64_t)a.dims.size(), batch = a.batch, n = indices.numel();
  TORCH_CHECK(grad_output.device() == indices.device(),
              "embcache: grad_output must be on the device of indices");
  TORCH_CHECK(!a.argmax || argmax->device() == indices.device(),
              "embcache: argmax must be on the device of indices");
  const Bags bags = op_bags(indices, offsets, per_sample_weights, nf, batch);
  const int64_t widest = a.dims.empty() ? 0 : *std::max_element(a.dims.begin(), a.dims.end());
  const at::Tensor rows = at::empty({n}, indices.options());
  const at::Tensor grads = at::zeros({n * widest}, grad_output.options());
  const at::Tensor occ = at::empty({n}, indices.options());
  const at::Tensor ranges = at::zeros({nf, 3}, indices.options());
  const at::Tensor errors = flag_words(indices, 1);
  dedup_features(bags, batch, nf, feature_table.data(), a.spec.data(),
                 grad_output.data_ptr<float>(), a.col[nf], a.argmax, a.argmax_col.data(),
                 DedupOutputs{rows.data_ptr<int64_t>(), grads.data_ptr<float>(),
                              occ.data_ptr<int64_t>()},
                 ranges.data_ptr<int64_t>(), words(errors), current_stream());
  return {rows, grads, occ, at::empty({0}, indices.options()), ranges, errors};
}

/// As on the CPU: every table's update is computed and checked (into buffers), and committed
/// only if every table can take it and the gate is all 0; that decision is made on the
/// device (update_tables' `go`), so nothing is read back: the verdict is returned.
inline at::Tensor multi_update(at::TensorList state, const at::Tensor& specs,
                               const at::Tensor& unique_rows, const at::Tensor& grads,
                               const at::Tensor& occurrences, const at::Tensor& slot_hints,
                               const at::Tensor& row_ranges,
                               at::ArrayRef<double> value_bounds, at::TensorList counters,
                               at::TensorList device_counts,
                               const c10::optional<at::Tensor>& gate, bool commit,
                               const c10::optional<at::Tensor>& staged_slots,
                               const c10::optional<at::Tensor>& staged_rows,
                               at::IntArrayRef staged_table) {
  EMBCACHE_DEVICE_GUARD(unique_rows);
  const UpdateArgs a = update_args(state, specs, unique_rows, grads, occurrences, slot_hints,
                                   row_ranges, value_bounds, counters, device_counts, gate,
                                   kDevice, false);
  const Tables& tables = a.tables;
  const std::vector<TableSpec>& spec = tables.spec;
  const int64_t nt = (int64_t)spec.size();
  check_same_device(tables, state, unique_rows, "unique_rows");
  TORCH_CHECK(staged_slots.has_value() == staged_rows.has_value() &&
                  (int64_t)staged_table.size() == (staged_slots.has_value() ? nt : 0),
              "embcache: a stage is staged_slots, staged_rows and a staged_table entry per table");
  if (staged_slots.has_value()) check_stage(*staged_slots, *staged_rows, -1, kDevice);
  // Every table's part of the op (UpdateTable; its rows placed on the device from row_ranges)
  std::vector<UpdateTable> parts(nt);
  int64_t state_stride = 0;
  for (int64_t t = 0; t < nt; ++t) {
    const Stage stage = staged_slots.has_value() && staged_table[t] >= 0
                            ? stage_of(staged_slots, staged_rows, staged_table[t])
                            : kNoStage;
    parts[t] = UpdateTable{spec[t], tables.state[t], 0, 0, 0, tables.counters[t][kSteps] + 1, 0,
                           (unsigned long long*)a.device_counts[t], stage};
    state_stride = std::max(state_stride, spec[t].state_width());
  }
  const UpdateRows r{unique_rows.data_ptr<int64_t>(), unique_rows.numel(),
                     row_ranges.data_ptr<int64_t>(), grads.numel(), state_stride};
  const at::Tensor fresh = at::empty_like(grads);
  const at::Tensor fresh_state = at::empty({r.n * state_stride}, grads.options());
  const at::Tensor slots = at::empty_like(unique_rows);
  // The verdict: table t's [error bits, the smallest row it cannot store (~0: none)] at 2t.
  const at::Tensor verdict = flag_words(unique_rows, 2 * nt);
  verdict.view({nt, 2}).select(1, 1).fill_(-1);
  const bool gated = gate.has_value() && gate->numel() > 0;
  update_tables(parts.data(), nt, r, grads.data_ptr<float>(), fresh.data_ptr<float>(),
                fresh_state.data_ptr<float>(), slots.data_ptr<int64_t>(),
                occurrences.data_ptr<int64_t>(), words(verdict), commit,
                gated ? gate->data_ptr<int64_t>() : nullptr, gated ? gate->numel() : 0,
                current_stream());
  return verdict.view({nt, 2});
}

}  // namespace ops
}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache

/// m.impl for every op of csrc/op_schemas.h.
#define EMBCACHE_IMPL_ALL_OPS(m)                                      \
  do {                                                                \
    namespace o = embcache::EMBCACHE_GPU_NS::ops;                     \
    m.impl("quantize_rows", &o::quantize_rows);                       \
    m.impl("dequantize_rows", &o::dequantize_rows);                   \
    m.impl("multi_lookup_forward", &o::multi_lookup_forward);         \
    m.impl("multi_dedup_backward", &o::multi_dedup_backward);         \
    m.impl("multi_update", &o::multi_update);                         \
    m.impl("cache_flush", &o::cache_flush);                           \
    m.impl("stage_misses", &o::stage_misses);                         \
    m.impl("unstage_rows", &o::unstage_rows);                         \
  } while (0)
