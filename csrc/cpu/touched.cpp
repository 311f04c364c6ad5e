// The touched-row telemetry's marking (embcache/telemetry.py, TouchedSample) on the CPU: which
// sampled rows a committed update wrote, without the tensor ops that cost a step several
// passes over its unique rows and a wake-up of the threads for each.
#include <torch/library.h>

#include <algorithm>

#include "cpu_common.h"

namespace embcache {
namespace cpu {
namespace {

/// touched[k] |= (sample_keys[k]'s row is among table tables[i]'s unique rows in this
/// update) for every sample key k = (table << 32 | row) of one of the tables; sample_keys
/// ascending, table tables[i]'s unique rows unique_rows[row_starts[i] .. row_starts[i + 1])
/// ascending. One pass on the calling thread: the work is too small to share.
void mark_sampled_rows(const at::Tensor& unique_rows, at::IntArrayRef row_starts,
                       at::IntArrayRef tables, const at::Tensor& sample_keys,
                       const at::Tensor& touched) {
  kCpu.check(unique_rows, at::kLong, "unique_rows");
  kCpu.check(sample_keys, at::kLong, "sample_keys");
  kCpu.check(touched, at::kBool, "touched");
  TORCH_CHECK(touched.numel() == sample_keys.numel(),
              "embcache: touched must hold one flag per sample key");
  TORCH_CHECK(row_starts.size() == tables.size() + 1 && row_starts.front() == 0 &&
                  row_starts.back() == unique_rows.numel(),
              "embcache: row_starts must have len(tables) + 1 entries, from 0 to the rows");
  const int64_t* rows = unique_rows.data_ptr<int64_t>();
  const uint64_t* keys = (const uint64_t*)sample_keys.data_ptr<int64_t>();
  const uint64_t* keys_end = keys + sample_keys.numel();
  bool* flag = touched.data_ptr<bool>();
  for (size_t i = 0; i < tables.size(); ++i) {
    TORCH_CHECK(row_starts[i] <= row_starts[i + 1], "embcache: row_starts decrease at ", i);
    const uint64_t table = (uint64_t)tables[i];
    const uint64_t* k = std::lower_bound(keys, keys_end, table << 32);
    const int64_t* r = rows + row_starts[i];
    const int64_t* r_end = rows + row_starts[i + 1];
    // Both ascending: each sample row is searched for from where the previous one was.
    for (; k != keys_end && (*k >> 32) == table && r != r_end; ++k) {
      const int64_t row = (int64_t)(*k & 0xffffffffu);
      r = std::lower_bound(r, r_end, row);
      if (r != r_end && *r == row) flag[k - keys] = true;
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(embcache, CPU, m) { m.impl("mark_sampled_rows", &mark_sampled_rows); }

}  // namespace cpu
}  // namespace embcache
