// The CUDA cache kernels (csrc/cuda/cache_kernels.cuh) compiled as plain C++ on the warp
// emulator (csrc/cuda/warp_emulator.h) and registered as torch.ops.embcache_emu.* over CPU
// tensors, with the schemas of torch.ops.embcache.*. It exists so that machines without a
// GPU (CI) execute the kernel code and compare it bit for bit with the CPU ops
// (tests/test_cuda_kernels.py). "Device memory" is host memory; the sorts and the scan that
// CUB does on a GPU are std:: algorithms here, outside the emulated kernels.
#include <Python.h>

#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#define EMBCACHE_GPU_NS emu
#include "../cuda/cache_api.h"

namespace embcache {
namespace emu {

// Two warps per block, and few blocks, so that grid-stride loops and several warps per block
// are exercised on small test sizes.
constexpr int64_t kThreadsPerBlock = 64;
inline int64_t grid_for(int64_t blocks) { return std::max<int64_t>(1, std::min<int64_t>(blocks, 3)); }

inline void* dev_alloc(size_t bytes, Stream) {
  void* p = std::malloc(bytes);
  if (!p) throw std::bad_alloc();
  return p;
}
inline void dev_free(void* p, Stream) { std::free(p); }
inline void dev_fill(void* p, int byte, size_t bytes, Stream) { std::memset(p, byte, bytes); }
// The kernels' waits for the device (each copy_to_host is one on a GPU), counted for the tests
// of what a training step waits for (read_backs()).
std::atomic<int64_t> read_backs{0};
inline void copy_to_host(void* dst, const void* src, size_t bytes, Stream) {
  ++read_backs;
  std::memcpy(dst, src, bytes);
}
inline void copy_to_device(void* dst, const void* src, size_t bytes, Stream) { std::memcpy(dst, src, bytes); }

// Stable, and ordering by the keys' bits [begin_bit, end_bit) only, as CUB's radix sort: a
// key with other bits set sorts here as it would on a GPU.
inline void sort_pairs_u64_i64(uint64_t* keys, int64_t* vals, int64_t n, int begin_bit,
                               int end_bit, Stream) {
  const uint64_t mask = end_bit - begin_bit >= 64 ? ~0ull : (1ull << (end_bit - begin_bit)) - 1;
  auto radix = [&](uint64_t k) { return (k >> begin_bit) & mask; };
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return radix(keys[a]) < radix(keys[b]); });
  std::vector<uint64_t> k(n);
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) {
    k[i] = keys[order[i]];
    v[i] = vals[order[i]];
  }
  std::copy(k.begin(), k.end(), keys);
  std::copy(v.begin(), v.end(), vals);
}

inline void exclusive_sum_i64(const int64_t* in, int64_t* out, int64_t n, Stream) {
  int64_t acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = acc;
    acc += in[i];
  }
}

}  // namespace emu
}  // namespace embcache

#define EC_LAUNCH(kernel, grid, block, stream, ...) \
  ec_emu::launch(&kernel, grid, block, __VA_ARGS__)

#include "../cuda/cache_kernels.cuh"

namespace embcache {
namespace emu {
inline bool on_device(const at::Tensor& t) { return t.device().is_cpu(); }
inline Stream current_stream() { return nullptr; }
constexpr const char* kDeviceName = "CPU (emulated CUDA)";
#define EMBCACHE_DEVICE_GUARD(t) (void)(t)
}  // namespace emu
}  // namespace embcache

#include "../cuda/torch_ops.h"
#include "../op_schemas.h"

TORCH_LIBRARY(embcache_emu, m) {
  embcache::define_cache_ops(m);
  // How many times the kernels' host code has waited for the device (copy_to_host) so far.
  m.def("read_backs() -> int", [] { return embcache::emu::read_backs.load(); });
}

TORCH_LIBRARY_IMPL(embcache_emu, CPU, m) { EMBCACHE_IMPL_ALL_OPS(m); }

// Importing `embcache._cuda_emu` loads this library, which registers the ops above.
extern "C" PyObject* PyInit__cuda_emu(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cuda_emu", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
