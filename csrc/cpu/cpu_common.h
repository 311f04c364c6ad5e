// What the CPU ops share: their device for the argument checks of csrc/tables.h, prefetching,
// the cache's sets, sorting into runs, bags of lookups and the scheduling of tables over
// threads. All row arithmetic comes from embcache/rowquant.h, shared with CUDA.
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>

#if defined(__SSE4_1__)
#include <smmintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

#include "../tables.h"
#include "embcache/rowquant.h"
#include "embcache/table_spec.h"

namespace embcache {
namespace cpu {

// Work per parallel chunk: small batches run on one thread, since an OpenMP fork costs
// more than a few thousand row operations (and much more on an oversubscribed machine).
constexpr int64_t kGrainBags = 256;
constexpr int64_t kGrainRows = 2048;
constexpr int64_t kGrainSets = 1024;
// The row loops: inlined into their callers' loops, so that their state stays in registers.
#define EMBCACHE_ALWAYS_INLINE inline __attribute__((always_inline))
// How many random rows ahead to prefetch.
constexpr int64_t kPrefetch = 16;
// Bytes of prefetched rows one pass over lookups may leave waiting in cache (a part of L2).
constexpr int64_t kPassBytes = 256 << 10;
// A forward output larger than this is written past the caches (docs/design.md, "Streamed
// output"): it would not stay there until it is read, and each line written through them is
// first read from memory.
constexpr int64_t kStreamOutputBytes = 4 << 20;

inline bool on_cpu(const at::Tensor& t) { return t.device().is_cpu(); }

/// The CPU ops' device, for the checks of csrc/tables.h.
inline constexpr DeviceKind kCpu{on_cpu, "CPU"};

/// An uninitialized CPU tensor, made without a trip through the dispatcher (at::empty
/// costs a few microseconds).
inline at::Tensor new_cpu_tensor(at::IntArrayRef size, at::ScalarType dtype) {
  return at::Tensor(at::detail::empty_cpu(size, dtype));
}

/// Asks for every cache line that [p, p + bytes) touches (for writing if `write`; none if
/// bytes is 0, e.g. SGD's empty optimizer state). A row need not start on a line: an int8
/// row of dim 16 is 24 bytes, and one in four spans two.
inline void prefetch_bytes(const void* p, int64_t bytes, bool write = false) {
  constexpr uintptr_t kLine = 64;
  if (bytes <= 0) return;
  const uintptr_t first = (uintptr_t)p & ~(kLine - 1), end = (uintptr_t)p + bytes;
  for (uintptr_t line = first; line < end; line += kLine) {
    if (write)
      __builtin_prefetch((const void*)line, 1);
    else
      __builtin_prefetch((const void*)line, 0);
  }
}

/// A table's cache: slot s * ways + w is way w of set s (docs/contract.md §4.1).
struct Cache {
  int32_t* tags;
  float* rows;
  SetDivisor sets;  // sets.d sets (0: no cache)
  int64_t ways;

  int64_t num_sets() const { return (int64_t)sets.d; }
  int64_t set_of(int64_t row) const { return sets.d == 0 ? -1 : set_of_row(row, sets); }

  /// The slot of set `set` that holds `row`, or -1 (a row is in at most one slot). With
  /// SSE, all ways are compared, four at a time, and the hit taken from the mask: an early
  /// exit's branch would be mispredicted about once a lookup, since the way is random.
  int64_t find_in_set(int64_t set, int64_t row) const {
    if (set < 0) return -1;
    const int32_t* t = tags + set * ways;
#if defined(__SSE2__)
    if (ways % 4 == 0) {
      const __m128i key = _mm_set1_epi32((int32_t)row);
      uint32_t hit = 0;  // bit w: way w holds row (ways <= kMaxWays)
      for (int64_t w = 0; w < ways; w += 4) {
        const __m128i eq = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i*)(t + w)), key);
        hit |= (uint32_t)_mm_movemask_ps(_mm_castsi128_ps(eq)) << w;
      }
      return hit ? set * ways + __builtin_ctz(hit) : -1;
    }
#endif
    for (int64_t w = 0; w < ways; ++w)
      if (t[w] == row) return set * ways + w;
    return -1;
  }

  void prefetch_set(int64_t set) const {
    if (set >= 0) prefetch_bytes(tags + set * ways, ways * sizeof(int32_t));
  }

  /// Prefetches a row's value: its cache row if it has a slot, else its table row.
  void prefetch_value(int64_t slot, int64_t dim, const uint8_t* table_row,
                      int64_t row_bytes) const {
    if (slot >= 0)
      prefetch_bytes(rows + slot * dim, dim * sizeof(float));
    else
      prefetch_bytes(table_row, row_bytes);
  }
};

inline Cache table_cache(const TableSpec& spec, const TableState& s) {
  return Cache{s.cache_tags, s.cache_rows, spec.set_divisor, spec.ways};
}

/// The first i in [0, n) where bad(i), or n. Inputs are almost always good, so the first
/// pass only asks whether any is bad, without a branch per element, so that it vectorizes
/// (GCC 12 vectorizes the OR of unsigned lanes, not of bools; comparing int64 lanes needs
/// SSE4.2): the index and offset checks run on every step's every lookup.
template <typename Bad>
int64_t first_where(int64_t n, const Bad& bad) {
  unsigned any = 0;
  for (int64_t i = 0; i < n; ++i) any |= (unsigned)bad(i);
  if (!any) return n;
  int64_t i = 0;
  while (!bad(i)) ++i;
  return i;
}

/// Sorts keys (a value below 2^bits in the high 32 bits, a position in the low 32) by
/// value, stably: an LSD radix sort over the value's bits only, 8 bits a pass (positions are
/// already ascending, so they stay ascending among equal values).
inline void radix_sort_high(std::vector<uint64_t>& keys, int bits, std::vector<uint64_t>& tmp) {
  tmp.resize(keys.size());
  for (int shift = 32; shift < 32 + bits; shift += 8) {
    size_t count[257] = {0};
    for (uint64_t k : keys) ++count[((k >> shift) & 0xff) + 1];
    for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
    for (uint64_t k : keys) tmp[count[(k >> shift) & 0xff]++] = k;
    keys.swap(tmp);
  }
}

/// Sorts keys as radix_sort_high does and returns where each run of equal values starts,
/// then keys.size(): run r is keys[runs[r] .. runs[r + 1]), positions ascending.
inline std::vector<int64_t> sort_into_runs(std::vector<uint64_t>& keys, int bits,
                                           std::vector<uint64_t>& tmp) {
  radix_sort_high(keys, bits, tmp);
  std::vector<int64_t> runs;
  for (size_t k = 0; k < keys.size(); ++k)
    if (k == 0 || (keys[k] >> 32) != (keys[k - 1] >> 32)) runs.push_back((int64_t)k);
  runs.push_back((int64_t)keys.size());
  return runs;
}

/// The number of bits needed for values below n.
inline int bits_for(int64_t n) {
  int b = 0;
  while (b < 63 && (int64_t(1) << b) < n) ++b;
  return b;
}

/// Bags of lookups over global arrays: bag b covers positions [off[b], off[b+1]) of idx
/// (and psw, if any). A feature of a KeyedJaggedTensor is such a view into its arrays.
struct Bags {
  const int64_t* idx;
  const int64_t* off;
  int64_t count;
  const float* psw;

  int64_t first() const { return off[0]; }
  int64_t end() const { return off[count]; }
};

/// The cost of touching `n` random rows of a table of `rows` rows: bigger tables miss more
/// levels of the memory hierarchy.
inline int64_t row_work(int64_t n, int64_t rows) { return n * (1 + bits_for(rows)); }

/// Runs fn(i) for every i in [0, cost.size()) on the intra-op threads: the costliest first,
/// each thread taking the next item when it is done. (Criteo tables differ in size 10^6-fold,
/// so at::parallel_for's static split into equal index ranges leaves threads idle.) The
/// per-table kernels inside then run single-threaded; a single item runs outside any
/// parallel region instead, so that its kernel's own loops use the threads (one table
/// alone, as a drop-in nn.EmbeddingBag is).
template <typename Fn>
void for_each_by_cost(const std::vector<int64_t>& cost, const Fn& fn) {
  const int64_t n = (int64_t)cost.size();
  if (n == 1) return fn(0);
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(order[i]);
  });
}

}  // namespace cpu
}  // namespace embcache
