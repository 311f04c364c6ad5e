// Torch glue over csrc/cuda/cache_api.h: the ops of csrc/cpu/embcache_cpu.cpp (same
// schemas, same results bit for bit) implemented by the cache kernels. Included by
//   * csrc/cuda/binding.cpp   (EMBCACHE_GPU_NS = gpu: CUDA tensors, the current stream);
//   * csrc/emulated/emu_ops.cpp (EMBCACHE_GPU_NS = emu: CPU tensors, kernels on the emulator),
// which define, before including this file, in namespace embcache::EMBCACHE_GPU_NS:
//   bool on_device(const at::Tensor&);   Stream current_stream();   const char* kDeviceName;
// and the macro EMBCACHE_DEVICE_GUARD(tensor) (makes the tensor's device current).
// The multi_* (table-batched) ops loop over the tables on the host.
#pragma once

#include <ATen/ATen.h>

#include <limits>
#include <tuple>
#include <vector>

#include "../op_schemas.h"
#include "cache_api.h"

namespace embcache {
namespace EMBCACHE_GPU_NS {
namespace ops {

inline RowFormat make_format(int64_t bits, int64_t dim, bool qparams_fp16) {
  TORCH_CHECK(bits == 32 || bits == 16 || bits == 8 || bits == 4 || bits == 2,
              "embcache: unsupported number of bits ", bits);
  TORCH_CHECK(dim > 0, "embcache: embedding dim must be positive, got ", dim);
  return RowFormat{(int)bits, (int)dim, qparams_fp16};
}

inline void check_tensor(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype, "embcache: ", what, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && on_device(t), "embcache: ", what,
              " must be a contiguous ", kDeviceName, " tensor");
}

inline void check_table(const at::Tensor& weights, const RowFormat& f) {
  check_tensor(weights, at::kByte, "weights");
  TORCH_CHECK(weights.dim() == 2 && weights.size(1) == f.row_bytes(),
              "embcache: weights must be [rows, ", f.row_bytes(), "] bytes, got ",
              weights.sizes());
}

inline void check_cache(const at::Tensor& tags, const at::Tensor& rows, int64_t num_sets,
                        int64_t ways, int64_t dim) {
  check_tensor(tags, at::kInt, "cache_tags");
  check_tensor(rows, at::kFloat, "cache_rows");
  TORCH_CHECK(num_sets >= 0 && ways >= 1 && tags.numel() == num_sets * ways &&
                  rows.numel() == num_sets * ways * dim,
              "embcache: cache tensors do not match ", num_sets, " sets x ", ways, " ways");
  TORCH_CHECK(ways <= 32, "embcache: associativity above 32 is not supported on ", kDeviceName);
}

inline void check_bags(const at::Tensor& indices, const at::Tensor& offsets,
                       const c10::optional<at::Tensor>& psw) {
  check_tensor(indices, at::kLong, "indices");
  check_tensor(offsets, at::kLong, "offsets");
  TORCH_CHECK(indices.dim() == 1 && offsets.dim() == 1 && offsets.numel() >= 1,
              "embcache: indices and offsets must be 1-D, offsets with the end appended");
  if (psw.has_value()) {
    check_tensor(*psw, at::kFloat, "per_sample_weights");
    TORCH_CHECK(psw->numel() == indices.numel(),
                "embcache: per_sample_weights must have one weight per index");
  }
}

inline RoundingStream rounding_stream(int64_t seed, int64_t step, int64_t table) {
  return RoundingStream{(uint64_t)seed, (uint32_t)step, (uint32_t)table};
}

inline at::Tensor quantize_rows(const at::Tensor& values, const at::Tensor& row_ids, int64_t bits,
                                bool qparams_fp16, bool stochastic, int64_t seed, int64_t step,
                                int64_t table) {
  EMBCACHE_DEVICE_GUARD(values);
  check_tensor(values, at::kFloat, "values");
  check_tensor(row_ids, at::kLong, "row_ids");
  TORCH_CHECK(values.dim() == 2 && row_ids.numel() == values.size(0),
              "embcache: values must be [rows, dim] with one row id per row");
  const RowFormat f = make_format(bits, values.size(1), qparams_fp16);
  const int64_t n = values.size(0);
  at::Tensor out = at::empty({n, (int64_t)f.row_bytes()}, values.options().dtype(at::kByte));
  const int64_t bad = EMBCACHE_GPU_NS::quantize_rows(
      values.data_ptr<float>(), row_ids.data_ptr<int64_t>(), n, f, stochastic,
      rounding_stream(seed, step, table), out.data_ptr<uint8_t>(), current_stream());
  TORCH_CHECK(bad < 0, "embcache: row ", bad < 0 ? 0 : row_ids[bad].item<int64_t>(),
              " cannot be stored in ", bits, " bits: non-finite or out of range");
  return out;
}

inline at::Tensor dequantize_rows(const at::Tensor& weights, int64_t bits, int64_t dim,
                                  bool qparams_fp16) {
  EMBCACHE_DEVICE_GUARD(weights);
  const RowFormat f = make_format(bits, dim, qparams_fp16);
  check_table(weights, f);
  at::Tensor out = at::empty({weights.size(0), dim}, weights.options().dtype(at::kFloat));
  EMBCACHE_GPU_NS::dequantize_rows(weights.data_ptr<uint8_t>(), weights.size(0), f,
                                   out.data_ptr<float>(), current_stream());
  return out;
}

inline std::tuple<at::Tensor, at::Tensor> lookup_forward(
    const at::Tensor& weights, const at::Tensor& cache_tags, const at::Tensor& cache_rows,
    const at::Tensor& indices, const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights, int64_t bits, int64_t dim,
    bool qparams_fp16, int64_t num_sets, int64_t ways, bool mean) {
  EMBCACHE_DEVICE_GUARD(weights);
  const RowFormat f = make_format(bits, dim, qparams_fp16);
  check_table(weights, f);
  check_cache(cache_tags, cache_rows, num_sets, ways, dim);
  check_bags(indices, offsets, per_sample_weights);
  const int64_t nb = offsets.numel() - 1;
  TORCH_CHECK(nb > 0 || indices.numel() == 0,
              "embcache: offsets must start at 0 and end at len(indices)");
  at::Tensor out = at::empty({nb, dim}, cache_rows.options());
  const int64_t hits = EMBCACHE_GPU_NS::lookup_forward(
      weights.data_ptr<uint8_t>(), weights.size(0), cache_tags.data_ptr<int32_t>(),
      cache_rows.data_ptr<float>(), indices.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
      nb, 0, indices.numel(),
      per_sample_weights ? per_sample_weights->data_ptr<float>() : nullptr, f, num_sets, ways,
      mean, out.data_ptr<float>(), dim, current_stream());
  return {out, at::scalar_tensor(hits, at::kLong)};
}

struct DedupTensors {
  at::TensorOptions long_opts, float_opts;
  int64_t dim;
  at::Tensor rows, grads, occ;
};

inline DedupOutputs dedup_alloc(void* ctx, int64_t nu) {
  auto* t = static_cast<DedupTensors*>(ctx);
  t->rows = at::empty({nu}, t->long_opts);
  t->grads = at::empty({nu, t->dim}, t->float_opts);
  t->occ = at::empty({nu}, t->long_opts);
  return DedupOutputs{t->rows.data_ptr<int64_t>(), t->grads.data_ptr<float>(),
                      t->occ.data_ptr<int64_t>()};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> dedup_backward(
    const at::Tensor& indices, const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights, const at::Tensor& grad_output,
    bool mean) {
  EMBCACHE_DEVICE_GUARD(indices);
  check_bags(indices, offsets, per_sample_weights);
  check_tensor(grad_output, at::kFloat, "grad_output");
  const int64_t nb = offsets.numel() - 1;
  TORCH_CHECK(grad_output.dim() == 2 && grad_output.size(0) == nb,
              "embcache: grad_output must be [bags, dim]");
  TORCH_CHECK(nb > 0 || indices.numel() == 0,
              "embcache: offsets must start at 0 and end at len(indices)");
  DedupTensors t{indices.options(), grad_output.options(), grad_output.size(1), {}, {}, {}};
  EMBCACHE_GPU_NS::dedup_backward(
      indices.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), nb, 0, indices.numel(),
      per_sample_weights ? per_sample_weights->data_ptr<float>() : nullptr,
      grad_output.data_ptr<float>(), t.dim, (int)t.dim, mean, &dedup_alloc, &t,
      current_stream());
  return {t.rows, t.grads, t.occ};
}

inline int64_t optimizer_state_width(int64_t opt, int64_t dim) {
  return opt == 0 ? 0 : opt == 1 ? 1 : dim;
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> update_prepare(
    const at::Tensor& weights, const at::Tensor& cache_tags, const at::Tensor& cache_rows,
    const at::Tensor& optimizer_state, const at::Tensor& unique_rows, const at::Tensor& grads,
    int64_t bits, bool qparams_fp16, bool stochastic, int64_t optimizer, double lr,
    double eps, int64_t num_sets, int64_t ways,
    const c10::optional<at::Tensor>& /*slot_hint: the kernel finds the slots itself*/) {
  EMBCACHE_DEVICE_GUARD(weights);
  check_tensor(grads, at::kFloat, "grads");
  TORCH_CHECK(grads.dim() == 2, "embcache: grads must be [unique rows, dim]");
  const int64_t dim = grads.size(1);
  const RowFormat f = make_format(bits, dim, qparams_fp16);
  check_table(weights, f);
  check_cache(cache_tags, cache_rows, num_sets, ways, dim);
  check_tensor(unique_rows, at::kLong, "unique_rows");
  check_tensor(optimizer_state, at::kFloat, "optimizer_state");
  TORCH_CHECK(optimizer >= 0 && optimizer <= 2, "embcache: unknown optimizer ", optimizer);
  const int64_t nu = unique_rows.numel(), num_rows = weights.size(0);
  const int64_t sw = optimizer_state_width(optimizer, dim);
  TORCH_CHECK(grads.size(0) == nu, "embcache: one gradient row per unique row");
  TORCH_CHECK(optimizer_state.numel() == num_rows * sw, "embcache: optimizer state size");
  at::Tensor fresh = at::empty({nu, dim}, grads.options());
  at::Tensor fresh_state = at::empty({nu, sw}, grads.options());
  at::Tensor slots = at::empty({nu}, unique_rows.options());
  const int64_t bad = EMBCACHE_GPU_NS::update_prepare(
      weights.data_ptr<uint8_t>(), num_rows, cache_tags.data_ptr<int32_t>(),
      cache_rows.data_ptr<float>(), optimizer_state.data_ptr<float>(),
      unique_rows.data_ptr<int64_t>(), nu, grads.data_ptr<float>(), f, stochastic, (int)optimizer,
      (float)lr, (float)eps, num_sets, ways, fresh.data_ptr<float>(),
      fresh_state.data_ptr<float>(), slots.data_ptr<int64_t>(), current_stream());
  return {fresh, fresh_state, slots, bad};
}

/// As on the CPU, except that cache_set_floor is left alone: the kernels apply the set rule
/// to every set, and as priorities only rise between flushes the floors stay lower bounds.
inline at::Tensor update_commit(at::Tensor& weights, at::Tensor& cache_tags,
                                at::Tensor& cache_rows, at::Tensor& cache_priority,
                                at::Tensor& /*cache_set_floor*/, at::Tensor& counts, at::Tensor& optimizer_state,
                                const at::Tensor& unique_rows, const at::Tensor& fresh,
                                const at::Tensor& fresh_state, const at::Tensor& slots,
                                const at::Tensor& occurrences, int64_t bits, bool qparams_fp16,
                                bool stochastic, bool lfu, int64_t seed, int64_t step,
                                int64_t table, int64_t num_sets, int64_t ways) {
  EMBCACHE_DEVICE_GUARD(weights);
  check_tensor(fresh, at::kFloat, "fresh");
  check_tensor(fresh_state, at::kFloat, "fresh_state");
  check_tensor(slots, at::kLong, "slots");
  check_tensor(occurrences, at::kLong, "occurrences");
  check_tensor(unique_rows, at::kLong, "unique_rows");
  check_tensor(cache_priority, at::kInt, "cache_priority");
  check_tensor(counts, at::kInt, "counts");
  check_tensor(optimizer_state, at::kFloat, "optimizer_state");
  TORCH_CHECK(fresh.dim() == 2 && fresh_state.dim() == 2,
              "embcache: fresh values and state must be 2-D");
  const int64_t dim = fresh.size(1), nu = unique_rows.numel();
  const RowFormat f = make_format(bits, dim, qparams_fp16);
  check_table(weights, f);
  check_cache(cache_tags, cache_rows, num_sets, ways, dim);
  const int64_t num_rows = weights.size(0), sw = fresh_state.size(1);
  TORCH_CHECK(fresh.size(0) == nu && fresh_state.size(0) == nu && slots.numel() == nu &&
                  occurrences.numel() == nu && optimizer_state.numel() == num_rows * sw,
              "embcache: prepared update does not match the table");
  TORCH_CHECK(!lfu || counts.numel() == num_rows, "embcache: LFU needs a count per row");
  TORCH_CHECK(cache_priority.numel() == num_sets * ways,
              "embcache: cache_priority must hold one priority per slot");
  at::Tensor stats = at::zeros({5}, at::kLong);
  EMBCACHE_GPU_NS::update_commit(
      weights.data_ptr<uint8_t>(), cache_tags.data_ptr<int32_t>(), cache_rows.data_ptr<float>(),
      cache_priority.data_ptr<int32_t>(), counts.data_ptr<int32_t>(),
      optimizer_state.data_ptr<float>(), unique_rows.data_ptr<int64_t>(), nu,
      fresh.data_ptr<float>(), fresh_state.data_ptr<float>(), sw, slots.data_ptr<int64_t>(),
      occurrences.data_ptr<int64_t>(), f, stochastic, lfu, rounding_stream(seed, step, table),
      step, num_sets, ways, stats.data_ptr<int64_t>(), current_stream());
  return stats;
}

inline int64_t cache_flush(at::Tensor& weights, at::Tensor& cache_tags,
                           const at::Tensor& cache_rows, at::Tensor& cache_priority,
                           at::Tensor& cache_set_floor, int64_t bits, bool qparams_fp16, bool stochastic, int64_t seed,
                           int64_t step, int64_t table) {
  EMBCACHE_DEVICE_GUARD(weights);
  const FlushShape shape =
      check_cache_flush(weights, cache_tags, cache_rows, cache_priority, cache_set_floor, bits,
                        qparams_fp16, &on_device, kDeviceName);
  const int64_t slots = shape.slots;
  if (slots == 0) return 0;
  const RowFormat f = shape.f;
  const int64_t written = EMBCACHE_GPU_NS::cache_flush(
      weights.data_ptr<uint8_t>(), cache_tags.data_ptr<int32_t>(), cache_rows.data_ptr<float>(),
      slots, f, stochastic, rounding_stream(seed, step, table), current_stream());
  cache_priority.zero_();
  cache_set_floor.fill_(std::numeric_limits<int32_t>::min());
  return written;
}

// ---- table-batched ops: the per-table kernels, table after table ----
// Feature f of a KeyedJaggedTensor is bags [f * batch, (f + 1) * batch) of the global offsets,
// looked up in table feature_table[f]; its pooled output is the columns [col[f], col[f+1]) of
// one [batch, sum of dims] tensor.

/// The offsets on the host, checked as the CPU ops check them.
inline at::Tensor features_host_offsets(const at::Tensor& indices, const at::Tensor& offsets,
                                        const c10::optional<at::Tensor>& psw, int64_t nf,
                                        int64_t batch) {
  check_bags(indices, offsets, psw);
  TORCH_CHECK(batch >= 0 && offsets.numel() == nf * batch + 1,
              "embcache: offsets must have features * batch + 1 entries");
  at::Tensor host = offsets.to(at::kCPU).contiguous();
  const int64_t* off = host.data_ptr<int64_t>();
  const int64_t nb = offsets.numel() - 1;
  TORCH_CHECK(off[0] == 0 && off[nb] == indices.numel(),
              "embcache: offsets must start at 0 and end at len(indices)");
  for (int64_t b = 0; b < nb; ++b)
    TORCH_CHECK(off[b] <= off[b + 1], "embcache: offsets decrease at bag ", b);
  return host;
}

inline std::vector<int64_t> column_offsets(const std::vector<int64_t>& dims) {
  std::vector<int64_t> col(dims.size() + 1, 0);
  for (size_t f = 0; f < dims.size(); ++f) col[f + 1] = col[f] + dims[f];
  return col;
}

/// The third and fourth outputs, every lookup's slot and each feature's value bound, are
/// empty here: the CUDA update finds the slots and checks the values itself, so it takes no
/// slot hints (an empty hint means none) and no value bounds.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> multi_lookup_forward(
    at::TensorList weights, at::TensorList cache_tags, at::TensorList cache_rows,
    const at::Tensor& indices, const at::Tensor& lengths,
    const c10::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef bits, at::IntArrayRef dims, at::IntArrayRef qparams_fp16,
    at::IntArrayRef num_sets, at::IntArrayRef ways, at::IntArrayRef mean, int64_t batch,
    at::TensorList counters) {
  EMBCACHE_DEVICE_GUARD(indices);
  const int64_t nf = (int64_t)feature_table.size();
  const std::vector<int64_t*> table_counters = tables_counters(counters, weights.size(), true);
  TORCH_CHECK(lengths.dim() == 1 && on_device(lengths) &&
                  (lengths.scalar_type() == at::kInt || lengths.scalar_type() == at::kLong),
              "embcache: lengths must be a 1-D int32 or int64 ", kDeviceName, " tensor");
  const at::Tensor offsets =
      at::cat({at::zeros({1}, lengths.options().dtype(at::kLong)), lengths.cumsum(0, at::kLong)});
  const at::Tensor off_host =
      features_host_offsets(indices, offsets, per_sample_weights, nf, batch);
  const int64_t* oh = off_host.data_ptr<int64_t>();
  std::vector<int64_t> feature_dims(nf);
  for (int64_t f = 0; f < nf; ++f) feature_dims[f] = dims[feature_table[f]];
  const std::vector<int64_t> col = column_offsets(feature_dims);
  at::Tensor out = at::empty({batch, col[nf]}, indices.options().dtype(at::kFloat));
  std::vector<int64_t> hits(nf);
  for (int64_t f = 0; f < nf; ++f) {
    const int64_t t = feature_table[f];
    const RowFormat fmt = make_format(bits[t], dims[t], qparams_fp16[t] != 0);
    check_table(weights[t], fmt);
    check_cache(cache_tags[t], cache_rows[t], num_sets[t], ways[t], dims[t]);
    if (batch == 0) continue;
    hits[f] = EMBCACHE_GPU_NS::lookup_forward(
        weights[t].data_ptr<uint8_t>(), weights[t].size(0), cache_tags[t].data_ptr<int32_t>(),
        cache_rows[t].data_ptr<float>(), indices.data_ptr<int64_t>(),
        offsets.data_ptr<int64_t>() + f * batch, batch, oh[f * batch], oh[(f + 1) * batch],
        per_sample_weights ? per_sample_weights->data_ptr<float>() : nullptr, fmt, num_sets[t],
        ways[t], mean[t] != 0, out.data_ptr<float>() + col[f], col[nf], current_stream());
  }
  for (int64_t f = 0; f < nf && !table_counters.empty(); ++f) {
    table_counters[feature_table[f]][kLookups] += oh[(f + 1) * batch] - oh[f * batch];
    table_counters[feature_table[f]][kHits] += hits[f];
  }
  return {out, offsets, at::empty({0}, indices.options().dtype(at::kInt)),
          at::empty({0}, at::kFloat)};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> multi_dedup_backward(
    const at::Tensor& indices, const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights, const at::Tensor& grad_output,
    at::IntArrayRef dims, at::IntArrayRef mean, int64_t batch,
    const c10::optional<at::Tensor>& /*lookup_slots: no hints on CUDA*/) {
  EMBCACHE_DEVICE_GUARD(indices);
  const int64_t nf = (int64_t)dims.size();
  const at::Tensor off_host =
      features_host_offsets(indices, offsets, per_sample_weights, nf, batch);
  const int64_t* oh = off_host.data_ptr<int64_t>();
  const std::vector<int64_t> col = column_offsets(std::vector<int64_t>(dims.begin(), dims.end()));
  check_tensor(grad_output, at::kFloat, "grad_output");
  TORCH_CHECK(grad_output.dim() == 2 && grad_output.size(0) == batch &&
                  grad_output.size(1) == col[nf],
              "embcache: grad_output must be [batch, sum of dims]");
  // Each feature deduplicated on its own, then concatenated into the one-tensor-per-kind
  // layout (gradient_blocks) that the CPU op makes directly.
  std::vector<at::Tensor> rows(nf), grads(nf), occ(nf);
  at::Tensor row_starts = at::empty({nf + 1}, at::kLong);
  int64_t* rs = row_starts.data_ptr<int64_t>();
  rs[0] = 0;
  for (int64_t f = 0; f < nf; ++f) {
    DedupTensors t{indices.options(), grad_output.options(), dims[f], {}, {}, {}};
    if (batch == 0) {
      dedup_alloc(&t, 0);
    } else {
      EMBCACHE_GPU_NS::dedup_backward(
          indices.data_ptr<int64_t>(), offsets.data_ptr<int64_t>() + f * batch, batch,
          oh[f * batch], oh[(f + 1) * batch],
          per_sample_weights ? per_sample_weights->data_ptr<float>() : nullptr,
          grad_output.data_ptr<float>() + col[f], col[nf], (int)dims[f], mean[f] != 0,
          &dedup_alloc, &t, current_stream());
    }
    rows[f] = t.rows;
    grads[f] = t.grads.reshape({-1});
    occ[f] = t.occ;
    rs[f + 1] = rs[f] + t.rows.numel();
  }
  if (nf == 0)
    return {at::empty({0}, indices.options()), at::empty({0}, grad_output.options()),
            at::empty({0}, indices.options()), at::empty({0}, indices.options()), row_starts};
  return {at::cat(rows), at::cat(grads), at::cat(occ), at::empty({0}, indices.options()),
          row_starts};
}

inline std::vector<int64_t> multi_update(
    at::TensorList weights, at::TensorList cache_tags, at::TensorList cache_rows,
    at::TensorList cache_priority, at::TensorList cache_set_floor, at::TensorList counts,
    at::TensorList optimizer_state, const at::Tensor& unique_rows, const at::Tensor& grads,
    const at::Tensor& occurrences, const at::Tensor& slot_hints /*unused on CUDA*/,
    at::IntArrayRef row_starts, at::ArrayRef<double> /*value_bounds: unused on CUDA*/,
    at::IntArrayRef dims, at::IntArrayRef bits,
    at::IntArrayRef qparams_fp16, at::IntArrayRef stochastic,
    at::IntArrayRef optimizer, at::ArrayRef<double> lr, at::ArrayRef<double> eps,
    at::IntArrayRef lfu, at::IntArrayRef seed, at::IntArrayRef table, at::IntArrayRef num_sets,
    at::IntArrayRef ways, at::TensorList counters, bool commit) {
  const int64_t nt = (int64_t)weights.size();
  TORCH_CHECK((int64_t)dims.size() == nt, "embcache: one dim per table");
  const std::vector<int64_t> block =
      gradient_blocks(unique_rows, grads, occurrences, slot_hints, row_starts, dims);
  const std::vector<int64_t*> table_counters = tables_counters(counters, nt, false);
  // table t's part of the gradient
  std::vector<at::Tensor> table_rows(nt), table_grads(nt), table_occ(nt);
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t n = row_starts[t + 1] - row_starts[t];
    table_rows[t] = unique_rows.narrow(0, row_starts[t], n);
    table_grads[t] = grads.narrow(0, block[t], n * dims[t]).view({n, dims[t]});
    table_occ[t] = occurrences.narrow(0, row_starts[t], n);
  }
  std::vector<at::Tensor> fresh(nt), fresh_state(nt), slots(nt);
  std::vector<int64_t> bad(nt);
  bool any_bad = false;
  for (int64_t t = 0; t < nt; ++t) {
    std::tie(fresh[t], fresh_state[t], slots[t], bad[t]) = update_prepare(
        weights[t], cache_tags[t], cache_rows[t], optimizer_state[t], table_rows[t], table_grads[t],
        bits[t], qparams_fp16[t] != 0, stochastic[t] != 0, optimizer[t], lr[t], eps[t],
        num_sets[t], ways[t], c10::nullopt);
    any_bad = any_bad || bad[t] >= 0;
  }
  if (any_bad || !commit) return bad;
  for (int64_t t = 0; t < nt; ++t) {
    at::Tensor w = weights[t], tags = cache_tags[t], rows = cache_rows[t],
               ts = cache_priority[t], floor = cache_set_floor[t], cnt = counts[t],
               st = optimizer_state[t];
    int64_t* counter = table_counters[t];
    const at::Tensor c = update_commit(
        w, tags, rows, ts, floor, cnt, st, table_rows[t], fresh[t], fresh_state[t], slots[t],
        table_occ[t], bits[t], qparams_fp16[t] != 0, stochastic[t] != 0, lfu[t] != 0,
        seed[t], counter[kSteps] + 1, table[t], num_sets[t], ways[t]);
    count_commit(counter, table_rows[t].numel(), c.data_ptr<int64_t>());
  }
  return bad;
}

}  // namespace ops
}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache

/// m.impl for every op of the embcache library.
#define EMBCACHE_IMPL_ALL_OPS(m)                                               \
  do {                                                                         \
    namespace o = embcache::EMBCACHE_GPU_NS::ops;                              \
    m.impl("quantize_rows", &o::quantize_rows);                                \
    m.impl("dequantize_rows", &o::dequantize_rows);                            \
    m.impl("lookup_forward", &o::lookup_forward);                              \
    m.impl("dedup_backward", &o::dedup_backward);                              \
    m.impl("update_prepare", &o::update_prepare);                              \
    m.impl("update_commit", &o::update_commit);                                \
    m.impl("multi_lookup_forward", &o::multi_lookup_forward);                  \
    m.impl("multi_dedup_backward", &o::multi_dedup_backward);                  \
    m.impl("multi_update", &o::multi_update);                                  \
    m.impl("cache_flush", &o::cache_flush);                                    \
  } while (0)
