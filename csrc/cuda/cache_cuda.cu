// The cache kernels (cache_kernels.cuh) for a real GPU: the backend of the host
// orchestration (scratch memory from the installed allocator, CUB sorts and scan) and the
// launch macro, which checks every launch. No torch headers: the torch binding is csrc/cuda/binding.cpp.
//
// Build with --fmad=false (no FMA contraction): results are bit-identical to the CPU ops.
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <stdexcept>
#include <string>

#include "cache_api.h"

namespace embcache {
namespace gpu {

constexpr int64_t kThreadsPerBlock = 256;

inline int64_t grid_for(int64_t blocks) {
  return blocks < 1 ? 1 : blocks > (int64_t(1) << 20) ? (int64_t(1) << 20) : blocks;
}

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("embcache (cuda): ") + what + ": " + cudaGetErrorString(e));
}

inline cudaStream_t as_stream(Stream s) { return static_cast<cudaStream_t>(s); }

// Scratch memory from the allocator the torch binding installs (cache_api.h).
Allocator allocator{nullptr, nullptr};
void set_allocator(Allocator a) { allocator = a; }

inline void* dev_alloc(size_t bytes, Stream s) {
  if (!allocator.alloc) throw std::runtime_error("embcache (cuda): no allocator installed");
  return bytes ? allocator.alloc(bytes, s) : nullptr;
}
inline void dev_free(void* p, Stream) {
  if (p) allocator.free(p);
}
inline void dev_fill(void* p, int byte, size_t bytes, Stream s) {
  check(cudaMemsetAsync(p, byte, bytes, as_stream(s)), "cudaMemsetAsync");
}
inline void copy_to_host(void* dst, const void* src, size_t bytes, Stream s) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, as_stream(s)), "cudaMemcpyAsync");
  check(cudaStreamSynchronize(as_stream(s)), "cudaStreamSynchronize");
}

// From pageable host memory: the copy is staged before the call returns, so the caller may
// reuse `src` at once; the stream is not waited for.
inline void copy_to_device(void* dst, const void* src, size_t bytes, Stream s) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, as_stream(s)), "cudaMemcpyAsync");
}

// Pairs sorted by the keys' bits [begin_bit, end_bit), in place through double buffers (CUB
// radix sort is stable).
inline void sort_pairs_u64_i64(uint64_t* keys, int64_t* vals, int64_t n, int begin_bit,
                               int end_bit, Stream s) {
  uint64_t* kalt = static_cast<uint64_t*>(dev_alloc(n * sizeof(uint64_t), s));
  int64_t* valt = static_cast<int64_t*>(dev_alloc(n * sizeof(int64_t), s));
  cub::DoubleBuffer<uint64_t> kb(keys, kalt);
  cub::DoubleBuffer<int64_t> vb(vals, valt);
  size_t temp = 0;
  check(cub::DeviceRadixSort::SortPairs(nullptr, temp, kb, vb, n, begin_bit, end_bit, as_stream(s)),
        "cub sort");
  void* t = dev_alloc(temp, s);
  check(cub::DeviceRadixSort::SortPairs(t, temp, kb, vb, n, begin_bit, end_bit, as_stream(s)), "cub sort");
  if (kb.Current() != keys)
    check(cudaMemcpyAsync(keys, kb.Current(), n * sizeof(uint64_t), cudaMemcpyDeviceToDevice,
                          as_stream(s)), "cudaMemcpyAsync");
  if (vb.Current() != vals)
    check(cudaMemcpyAsync(vals, vb.Current(), n * sizeof(int64_t), cudaMemcpyDeviceToDevice,
                          as_stream(s)), "cudaMemcpyAsync");
  dev_free(t, s);
  dev_free(valt, s);
  dev_free(kalt, s);
}

inline void exclusive_sum_i64(const int64_t* in, int64_t* out, int64_t n, Stream s) {
  size_t temp = 0;
  check(cub::DeviceScan::ExclusiveSum(nullptr, temp, in, out, n, as_stream(s)), "cub scan");
  void* t = dev_alloc(temp, s);
  check(cub::DeviceScan::ExclusiveSum(t, temp, in, out, n, as_stream(s)), "cub scan");
  dev_free(t, s);
}

}  // namespace gpu
}  // namespace embcache

#define EC_LAUNCH(kernel, grid, block, stream, ...)                                   \
  do {                                                                                \
    kernel<<<(grid), (block), 0, ::embcache::gpu::as_stream(stream)>>>(__VA_ARGS__); \
    ::embcache::gpu::check(cudaGetLastError(), "launch of " #kernel);                 \
  } while (0)

#include "cache_kernels.cuh"
