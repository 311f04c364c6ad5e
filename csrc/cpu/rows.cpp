// Row conversion and write-back: values to stored rows and back (docs/contract.md §2-3), and
// the flush that rounds every cached row into its table (docs/design.md, "flush()").
#include <torch/library.h>

#include <mutex>

#include "cpu_common.h"
#include "set_rule.h"

namespace embcache {
namespace cpu {
namespace {

at::Tensor quantize_rows(const at::Tensor& values, const at::Tensor& row_ids,
                         const at::Tensor& spec, c10::optional<int64_t> step) {
  const QuantizeArgs a = quantize_args(values, row_ids, spec, step, kCpu);
  const RowFormat f = a.f;
  const int64_t n = values.size(0);
  const float* x = values.data_ptr<float>();
  const int64_t* ids = row_ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(row_is_storable(f, x + r * f.dim, a.stochastic), "embcache: row ", ids[r],
                " cannot be stored in ", f.bits, " bits: non-finite or out of range");
  at::Tensor out = at::empty({n, (int64_t)f.row_bytes()}, values.options().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(f, x + r * f.dim, a.stochastic, a.stream, ids[r], o + r * f.row_bytes());
  });
  return out;
}

at::Tensor dequantize_rows(const at::Tensor& weights, const at::Tensor& spec) {
  const RowFormat f = dequantize_args(weights, spec, kCpu);
  const int64_t n = weights.size(0), dim = f.dim;
  at::Tensor out = at::empty({n, dim}, weights.options().dtype(at::kFloat));
  const uint8_t* w = weights.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequantize_row(f, w + r * f.row_bytes(), o + r * dim);
  });
  return out;
}

/// Writes table t's cached rows back (rounded with the stream of the table's current step)
/// and empties its cache: tags -1, rows and priorities 0, every set's floor kEmpty. Returns
/// the number of rows written. *probe adds those that is_probed(row, step) picks.
int64_t flush_table(const TableSpec& spec, const TableState& s, int64_t step,
                    RoundingProbe* probe) {
  const RowFormat f = spec.f;
  const int64_t slots = spec.slots(), dim = f.dim;
  int32_t* tags = s.cache_tags;
  const RoundingStream stream = spec.stream(step);
  std::atomic<int64_t> written{0};
  std::mutex probe_mutex;
  at::parallel_for(0, slots, kGrainRows, [&](int64_t s0, int64_t s1) {
    int64_t local = 0;
    RoundingProbe probed;
    for (int64_t i = s0; i < s1; ++i) {
      if (tags[i] < 0) continue;
      const float* x = s.cache_rows + i * dim;
      uint8_t* row = s.weights + tags[i] * f.row_bytes();
      quantize_row(f, x, spec.stochastic, stream, tags[i], row);
      if (is_probed(tags[i], step)) probed.add(f, x, row, spec.stochastic);
      tags[i] = -1;
      ++local;
    }
    written += local;
    const std::lock_guard<std::mutex> lock(probe_mutex);
    probe->merge(probed);
  });
  std::fill_n(s.cache_rows, slots * dim, 0.f);
  std::fill_n(s.cache_priority, slots, 0);
  std::fill_n(s.cache_set_floor, spec.num_sets, kEmpty);
  return written.load();
}

/// Flushes every table (cache_flush of csrc/op_schemas.h), each table's state checked before
/// any is written.
std::vector<int64_t> cache_flush(at::TensorList state, const at::Tensor& specs,
                                 at::TensorList counters) {
  const Tables tables = op_tables(state, specs, counters, false, kCpu);
  std::vector<int64_t> written;
  for (size_t t = 0; t < tables.spec.size(); ++t) {
    RoundingProbe probe;
    written.push_back(
        flush_table(tables.spec[t], tables.state[t], tables.counters[t][kSteps], &probe));
    tables.counters[t][kFlushed] += written.back();
    count_probe(tables.counters[t], probe);
  }
  return written;
}

}  // namespace

TORCH_LIBRARY_IMPL(embcache, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("dequantize_rows", &dequantize_rows);
  m.impl("cache_flush", &cache_flush);
}

}  // namespace cpu
}  // namespace embcache
