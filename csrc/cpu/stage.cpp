// Staging on the CPU (csrc/op_schemas.h stage_misses, unstage_rows): a CPU op's tables are
// all in the memory it runs in, so there is nothing to stage; unstage_rows applies the rule
// of csrc/include/embcache/stage.h to any stage (the reference for the kernels').
#include <torch/library.h>

#include "cpu_common.h"

namespace embcache {
namespace cpu {
namespace {

/// Nothing staged: two empty entries, no rows. The arguments are checked as the forward
/// checks them.
std::tuple<at::Tensor, at::Tensor> stage_misses(at::TensorList state, const at::Tensor& specs,
                                                const at::Tensor& indices,
                                                const at::Tensor& lengths,
                                                at::IntArrayRef feature_table, int64_t batch,
                                                at::IntArrayRef /*staged_tables*/) {
  const Tables tables = op_tables(state, specs, {}, true, kCpu);
  check_lookups(indices, c10::nullopt, kCpu);
  feature_columns(feature_table, tables.spec);
  TORCH_CHECK(batch >= 0 && lengths.dim() == 1 &&
                  lengths.numel() == (int64_t)feature_table.size() * batch,
              "embcache: lengths must hold features * batch bag sizes");
  return {at::full({2, 2}, kNoStagedRow, indices.options()), at::empty({0, 16}, at::kByte)};
}

void unstage_rows(const at::Tensor& slots, const at::Tensor& unique_rows,
                  const at::Tensor& row_ranges, at::IntArrayRef range_of_table) {
  check_unstage_args(slots, unique_rows, row_ranges, range_of_table, kCpu);
  int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t h = 0; h < slots.size(0); ++h)
    s[2 * h] = key_after_update(s[2 * h], unique_rows.data_ptr<int64_t>(), unique_rows.numel(),
                                row_ranges.data_ptr<int64_t>(), range_of_table.data(),
                                (int64_t)range_of_table.size());
}

}  // namespace

TORCH_LIBRARY_IMPL(embcache, CPU, m) {
  m.impl("stage_misses", &stage_misses);
  m.impl("unstage_rows", &unstage_rows);
}

}  // namespace cpu
}  // namespace embcache
