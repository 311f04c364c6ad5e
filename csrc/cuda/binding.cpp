// The torch binding of the CUDA cache kernels: the ops of torch.ops.embcache for CUDA
// tensors (the dispatcher picks them by device). Thin: the glue is csrc/cuda/torch_ops.h,
// shared with the warp-emulator build that CI runs; the kernels are in cache_cuda.cu.
// Compiled into embcache._C only when torch has CUDA and nvcc is found (setup.py).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cache_api.h"

namespace embcache {
namespace gpu {
inline bool on_device(const at::Tensor& t) { return t.device().is_cuda(); }
inline Stream current_stream() { return (void*)c10::cuda::getCurrentCUDAStream().stream(); }
constexpr const char* kDeviceName = "CUDA";
/// The CUDA device of `t`, or none for a tensor in host memory (the pinned storage of a
/// host-placed table, docs/design.md "Host placement"): the guard then keeps the current one.
inline c10::optional<c10::Device> cuda_device_of(const at::Tensor& t) {
  return t.is_cuda() ? c10::optional<c10::Device>(t.device()) : c10::nullopt;
}
#define EMBCACHE_DEVICE_GUARD(t) const c10::cuda::OptionalCUDAGuard device_guard_(cuda_device_of(t))

// The kernels' scratch memory comes from PyTorch's caching allocator, ordered on the op's
// stream: one pool for torch and the kernels.
inline void* torch_alloc(size_t bytes, Stream s) {
  return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(s));
}
inline void torch_free(void* p) { c10::cuda::CUDACachingAllocator::raw_delete(p); }
const bool allocator_installed = (set_allocator(Allocator{torch_alloc, torch_free}), true);
}  // namespace gpu
}  // namespace embcache

#include "torch_ops.h"

TORCH_LIBRARY_IMPL(embcache, CUDA, m) { EMBCACHE_IMPL_ALL_OPS(m); }
