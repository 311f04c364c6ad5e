// A small CUDA warp emulator: the kernels of csrc/cuda compiled as plain C++ and run on the
// host, so that CI machines without a GPU execute the real kernel code (the approach of
// numba's CUDA simulator and HIP-CPU).
//
// A launch runs the blocks of the grid one after the other; the threads of a block are
// fibers (ucontext) on the calling thread, switched cooperatively at barriers, as HIP-CPU
// does (with an OS thread per CUDA thread, every barrier phase would wake 31 threads through
// the kernel). Warp collectives run in lockstep: each lane writes its value into the warp's
// exchange slots, waits at the warp barrier, reads, and waits again.
// __syncthreads is a block barrier. A thread that returns from the kernel leaves its warp's
// and block's barriers (as an exited CUDA thread does), and its ballot bit reads 0. Between
// two barriers the lanes of a warp run one after the other, so code that relies on lanes
// seeing each other's writes without __syncwarp/__syncthreads is not guaranteed to work.
//
// Only what the kernels of this project use is provided: 1-D grids and blocks of a
// multiple of 32 threads, full-warp masks (shuffles may use a `width`), no shared memory.
// A collective that not every live lane of the warp reaches is a deadlock: the scheduler
// sees that no thread can make progress and aborts with a message.
#pragma once

#if defined(__CUDACC__)
#error "warp_emulator.h is for host C++ builds of the kernels, not for nvcc"
#endif

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ucontext.h>

#include <exception>
#include <functional>
#include <memory>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local uint3 threadIdx = {0, 0, 0};
inline thread_local uint3 blockIdx = {0, 0, 0};
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace ec_emu {

// ---- fibers: the threads of a block, switched cooperatively at barriers ----

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;
  unsigned tid = 0;
  bool done = false;
};

/// A barrier whose participants can leave (as exited CUDA threads do). Waiting = yielding
/// to the scheduler until the phase completes.
struct Barrier {
  int expected = 0;
  int arrived = 0;
  uint64_t generation = 0;
};

struct Warp {
  Barrier bar;
  uint64_t value[32];
  bool live[32];
};

struct Scheduler {
  ucontext_t main;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  Barrier block_bar;
  std::vector<Warp> warps;
  uint64_t progress = 0;  // arrivals, completed phases and finished fibers
  std::function<void()> body;
};

inline thread_local Scheduler* sched = nullptr;

inline void yield_to_scheduler() {
  Fiber* f = sched->current;
  swapcontext(&f->ctx, &sched->main);
}

inline void barrier_wait(Barrier& b) {
  ++sched->progress;
  if (++b.arrived >= b.expected) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  const uint64_t gen = b.generation;
  while (b.generation == gen) yield_to_scheduler();
}

inline void barrier_drop(Barrier& b) {
  --b.expected;
  if (b.arrived > 0 && b.arrived >= b.expected) {
    b.arrived = 0;
    ++b.generation;
  }
}

inline Warp& my_warp() { return sched->warps[threadIdx.x >> 5]; }
inline unsigned my_lane() { return threadIdx.x & 31u; }

inline void fiber_entry() {
  Fiber* f = sched->current;
  sched->body();
  // Leave the collectives of this block: an exited thread no longer holds them up.
  Warp& w = my_warp();
  w.live[my_lane()] = false;
  barrier_drop(w.bar);
  barrier_drop(sched->block_bar);
  f->done = true;
  ++sched->progress;
  // returning resumes uc_link (the scheduler)
}

/// Runs kernel(args...) over a 1-D grid of 1-D blocks: the blocks one after the other, the
/// threads of a block as fibers on the calling thread.
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
  const int threads = (int)block.x;
  if (threads <= 0 || threads % 32 != 0 || block.y != 1 || block.z != 1 || grid.y != 1 ||
      grid.z != 1) {
    fprintf(stderr, "warp_emulator: only 1-D launches of whole warps are emulated\n");
    abort();
  }
  if (grid.x == 0) return;
  constexpr size_t kStack = 256 * 1024;
  Scheduler s;
  Scheduler* outer = sched;
  sched = &s;
  s.fibers.resize(threads);
  s.warps.resize(threads / 32);
  // Fiber stacks, kept between launches (uninitialised memory, touched only as used).
  static thread_local std::unique_ptr<char[]> stacks;
  static thread_local size_t stacks_size = 0;
  if (stacks_size < (size_t)threads * kStack) {
    stacks.reset(new char[(size_t)threads * kStack]);
    stacks_size = (size_t)threads * kStack;
  }
  std::exception_ptr error;
  s.body = [&] {
    try {
      kernel(args...);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  };
  const uint3 saved_tid = threadIdx, saved_bid = blockIdx;
  const dim3 saved_bdim = blockDim, saved_gdim = gridDim;
  blockDim = block;
  gridDim = grid;
  for (unsigned b = 0; b < grid.x; ++b) {
    s.block_bar = Barrier{threads, 0, 0};
    for (auto& w : s.warps) {
      w.bar = Barrier{32, 0, 0};
      for (int l = 0; l < 32; ++l) w.live[l] = true;
    }
    for (int t = 0; t < threads; ++t) {
      Fiber& f = s.fibers[t];
      f.tid = (unsigned)t;
      f.done = false;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = stacks.get() + (size_t)t * kStack;
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = &s.main;
      makecontext(&f.ctx, &fiber_entry, 0);
    }
    blockIdx = uint3{b, 0, 0};
    int remaining = threads;
    while (remaining > 0) {
      const uint64_t before = s.progress;
      for (auto& f : s.fibers) {
        if (f.done) continue;
        threadIdx = uint3{f.tid, 0, 0};
        s.current = &f;
        swapcontext(&s.main, &f.ctx);
        if (f.done) --remaining;
      }
      if (remaining > 0 && s.progress == before) {
        fprintf(stderr, "warp_emulator: deadlock (a collective or barrier not reached by every live thread)\n");
        abort();
      }
    }
  }
  sched = outer;
  threadIdx = saved_tid;
  blockIdx = saved_bid;
  blockDim = saved_bdim;
  gridDim = saved_gdim;
  if (error) std::rethrow_exception(error);
}

template <class T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "exchange of at most 8 bytes");
  uint64_t u = 0;
  memcpy(&u, &v, sizeof(T));
  return u;
}

template <class T>
inline T from_bits(uint64_t u) {
  T v;
  memcpy(&v, &u, sizeof(T));
  return v;
}

}  // namespace ec_emu

inline void __syncthreads() { ec_emu::barrier_wait(ec_emu::sched->block_bar); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  (void)mask;
  ec_emu::barrier_wait(ec_emu::my_warp().bar);
}

template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  (void)mask;
  ec_emu::Warp& w = ec_emu::my_warp();
  const unsigned lane = ec_emu::my_lane();
  w.value[lane] = ec_emu::to_bits(var);
  ec_emu::barrier_wait(w.bar);
  const unsigned src = (lane & ~(unsigned)(width - 1)) + ((unsigned)src_lane & (unsigned)(width - 1));
  const T out = ec_emu::from_bits<T>(w.value[src]);
  ec_emu::barrier_wait(w.bar);
  return out;
}

template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  const unsigned lane = ec_emu::my_lane();
  return __shfl_sync(mask, var, (int)((lane ^ (unsigned)lane_mask) & (unsigned)(width - 1)), width);
}

template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const unsigned lane = ec_emu::my_lane();
  const unsigned in_group = lane & (unsigned)(width - 1);
  // Lanes whose source lies beyond their group keep their own value, as on a GPU.
  const unsigned src = in_group + delta < (unsigned)width ? in_group + delta : in_group;
  return __shfl_sync(mask, var, (int)src, width);
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  (void)mask;
  ec_emu::Warp& w = ec_emu::my_warp();
  w.value[ec_emu::my_lane()] = predicate ? 1u : 0u;
  ec_emu::barrier_wait(w.bar);
  unsigned out = 0;
  for (int l = 0; l < 32; ++l)
    if (w.live[l] && w.value[l]) out |= 1u << l;
  ec_emu::barrier_wait(w.bar);
  return out;
}

inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }

inline int __all_sync(unsigned mask, int predicate) {
  ec_emu::Warp& w = ec_emu::my_warp();
  unsigned live = 0;
  const unsigned b = __ballot_sync(mask, predicate);
  for (int l = 0; l < 32; ++l)
    if (w.live[l]) live |= 1u << l;
  return (b & live) == live;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }

template <class T>
inline T atomicAdd(T* address, T val) {
  return __atomic_fetch_add(address, val, __ATOMIC_SEQ_CST);
}

template <class T>
inline T atomicMin(T* address, T val) {
  T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (val < old &&
         !__atomic_compare_exchange_n(address, &old, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}

template <class T>
inline T atomicOr(T* address, T val) {
  return __atomic_fetch_or(address, val, __ATOMIC_SEQ_CST);
}

/// Writes val where *address == compare; returns the old value either way.
template <class T>
inline T atomicCAS(T* address, T compare, T val) {
  __atomic_compare_exchange_n(address, &compare, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
