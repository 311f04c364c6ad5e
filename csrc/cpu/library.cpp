// The torch.ops.embcache library of `embcache._C`: the table ops' schemas (csrc/op_schemas.h;
// each csrc/cpu/*.cpp registers its CPU kernels, csrc/cuda/binding.cpp the CUDA ones), the
// constants of the table spec for Python to compare with its own, the huge-page advice for
// host memory, and, for every device, the fold of the device counts into the counters and the
// placement rule of a table's state.
#include <Python.h>

#include <torch/library.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "../op_schemas.h"
#include "../tables.h"
#include "embcache/table_spec.h"

namespace embcache {
namespace {

template <size_t N>
std::vector<std::string> names(const char* const (&list)[N]) {
  return std::vector<std::string>(list, list + N);
}

/// csrc/include/embcache/table_spec.h's lists, which embcache/config.py mirrors: (format
/// names, their bits, optimizer names, pooling names, counter names, state tensor names, each
/// state tensor's tier, spec field names, the most ways a set may have).
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<std::string>,
           std::vector<std::string>, std::vector<std::string>, std::vector<std::string>,
           std::vector<std::string>, std::vector<std::string>, int64_t>
layout() {
  std::vector<std::string> tiers;
  for (StateTier tier : kStateTensorTiers) tiers.push_back(kStateTierNames[tier]);
  return {names(kFormatNames),
          std::vector<int64_t>(std::begin(kFormatBits), std::end(kFormatBits)),
          names(kOptimizerNames),
          names(kPoolingNames),
          names(kCounterNames),
          names(kStateTensorNames),
          tiers,
          names(kSpecFieldNames),
          kMaxWays};
}

/// Where each table's storage lies, "device" or "host" (kPlacementNames), by the rule every op
/// checks its tables' state with (state_placement in csrc/tables.h), whatever the device: the
/// error an op would raise otherwise. `state` holds kNumStateTensors tensors a table, as the
/// ops take it. Reads no tensor's data.
std::vector<std::string> state_placements(at::TensorList state) {
  TORCH_CHECK(state.size() % kNumStateTensors == 0, "embcache: state must hold ",
              kNumStateTensors, " tensors per table, got ", state.size());
  std::vector<std::string> out;
  for (size_t t = 0; t * kNumStateTensors < state.size(); ++t)
    out.push_back(kPlacementNames[(int)state_placement(state.data() + t * kNumStateTensors, t)]);
  return out;
}

/// Asks Linux to back the tensor's whole 2 MiB pages with transparent huge pages. Random
/// rows of a table of hundreds of MB otherwise miss the TLB on nearly every access, and
/// each miss adds a page walk to the lookup's memory access. Only pages not yet touched
/// are affected, so call it on a fresh torch.empty. Returns whether the kernel took the
/// advice (false off Linux, with THP disabled, or for a tensor smaller than a huge page).
bool advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(),
              "embcache: advise_huge_pages needs a contiguous CPU tensor");
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = (uintptr_t)t.data_ptr(), end = begin + t.nbytes();
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  return last > first && madvise((void*)first, last - first, MADV_HUGEPAGE) == 0;
#else
  return false;
#endif
}

/// fold_device_counts (csrc/op_schemas.h), for tensors on any device: one read-back of all
/// of them where they share a device.
void fold_device_counts(at::TensorList counters, at::TensorList device_counts) {
  const std::vector<int64_t*> counter = tables_counters(counters, device_counts.size(), false);
  for (size_t t = 0; t < counter.size(); ++t) {
    const at::Tensor& c = device_counts[t];
    TORCH_CHECK(c.scalar_type() == at::kLong && c.numel() == kNumDeviceCounts, "embcache: table ",
                t, ": device_counts must be int64 of ", kNumDeviceCounts, ", got ",
                c.scalar_type(), " ", c.sizes());
  }
  if (counter.empty()) return;
  const bool one_device = std::all_of(device_counts.begin(), device_counts.end(), [&](const at::Tensor& c) {
    return c.device() == device_counts[0].device();
  });
  std::vector<at::Tensor> host;
  if (one_device) {
    host = at::stack(device_counts).to(at::kCPU).contiguous().unbind(0);
  } else {
    for (const at::Tensor& c : device_counts) host.push_back(c.to(at::kCPU).contiguous());
  }
  for (size_t t = 0; t < counter.size(); ++t) {
    fold_counts(counter[t], host[t].contiguous().data_ptr<int64_t>());
    device_counts[t].zero_();
  }
}

/// count_updates (csrc/op_schemas.h).
void count_updates(at::TensorList counters, at::IntArrayRef unique_rows) {
  const std::vector<int64_t*> counter = tables_counters(counters, unique_rows.size(), false);
  for (size_t t = 0; t < counter.size(); ++t) {
    counter[t][kSteps] += 1;
    counter[t][kUniqueRows] += unique_rows[t];
  }
}

}  // namespace

TORCH_LIBRARY(embcache, m) {
  define_cache_ops(m);
  define_cpu_only_ops(m);
  m.def("layout() -> (str[], int[], str[], str[], str[], str[], str[], str[], int)", &layout);
  m.def("state_placement(Tensor[] state) -> str[]");
  m.def("advise_huge_pages(Tensor t) -> bool");
}

TORCH_LIBRARY_IMPL(embcache, CPU, m) { m.impl("advise_huge_pages", &advise_huge_pages); }

TORCH_LIBRARY_IMPL(embcache, CompositeExplicitAutograd, m) {
  m.impl("fold_device_counts", &fold_device_counts);
  m.impl("count_updates", &count_updates);
  m.impl("state_placement", &state_placements);
}

}  // namespace embcache

// Importing `embcache._C` loads this library, which registers the ops.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
