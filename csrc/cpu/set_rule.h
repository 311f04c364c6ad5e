// The set rule of docs/contract.md §4.3 step 3, shared by the update's commit (csrc/cpu/commit.cpp)
// and the hit-rate replay (csrc/cpu/replay.cpp): which of a set's candidates enter which ways.
#pragma once

#if defined(__SSE4_1__)
#include <smmintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "embcache/table_spec.h"

namespace embcache {
namespace cpu {

/// Stable sort for the short lists of one set (at most kMaxWays ways, a few candidates): no
/// allocation.
template <typename Less>
void stable_insertion_sort(std::vector<int64_t>& v, Less less) {
  for (size_t i = 1; i < v.size(); ++i) {
    const int64_t x = v[i];
    size_t j = i;
    for (; j > 0 && less(x, v[j - 1]); --j) v[j] = v[j - 1];
    v[j] = x;
  }
}

// An empty way's priority, below every resident's (counts are >= 0, steps >= 1).
constexpr int32_t kEmpty = std::numeric_limits<int32_t>::min();

/// A row's priority once the step's counts are in (docs/contract.md §4): its LFU count, or the
/// step (LRU). cache_priority keeps this value for every resident (0 for an empty slot).
struct RowPriority {
  bool lfu;
  LfuCounts counts;
  int64_t step;
  int32_t operator()(int64_t row) const { return lfu ? counts[row] : (int32_t)step; }
};

/// The priority of a slot for the set rule: the resident's, or kEmpty.
inline int32_t slot_priority(const int32_t* tags, const int32_t* prio, int64_t slot) {
  return tags[slot] < 0 ? kEmpty : prio[slot];
}

/// The first of the `ways` (a power of two) of lowest priority.
inline int64_t lowest_way(const int32_t* p, int64_t ways) {
#if defined(__SSE4_1__)
  if (ways >= 4) {  // the minimum in every lane, then the first lane that holds it
    __m128i m = _mm_loadu_si128((const __m128i*)p);
    for (int64_t w = 4; w < ways; w += 4)
      m = _mm_min_epi32(m, _mm_loadu_si128((const __m128i*)(p + w)));
    m = _mm_min_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_min_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    for (int64_t w = 0;; w += 4) {
      const __m128i eq = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i*)(p + w)), m);
      const int mask = _mm_movemask_ps(_mm_castsi128_ps(eq));
      if (mask) return w + __builtin_ctz(mask);
    }
  }
#endif
  int64_t best = 0;
  for (int64_t w = 1; w < ways; ++w)
    if (p[w] < p[best]) best = w;
  return best;
}

/// The insert/evict/bypass rule of docs/contract.md §4 for one set, given its non-resident
/// updated rows `cand` (reordered here by priority descending, ties by smaller row, i.e. original order)
/// and the priorities of its ways (empty = kEmpty). Candidate k meets the way of k-th
/// lowest priority (ties: lower way) and enters iff its priority is strictly higher; once one
/// fails, every later one would too (candidates descend, ways ascend), so the k-th way is
/// found by selection on demand rather than by sorting all ways. A taken way is marked with
/// the highest priority, which no candidate exceeds, so it is never chosen to be replaced.
template <typename CandPrio, typename WayPrio, typename Enter, typename Bypass>
void apply_set_rule(std::vector<int64_t>& cand, CandPrio cand_prio, WayPrio way_prio,
                    int64_t ways, std::vector<int32_t>& slot_prio,
                    Enter enter, Bypass bypass) {
  auto higher = [&](int64_t a, int64_t b) { return cand_prio(a) > cand_prio(b); };
  if (cand.size() <= 32)
    stable_insertion_sort(cand, higher);
  else
    std::stable_sort(cand.begin(), cand.end(), higher);
  for (int64_t way = 0; way < ways; ++way) slot_prio[way] = way_prio(way);
  size_t k = 0;
  for (; k < cand.size() && (int64_t)k < ways; ++k) {
    const int64_t best = lowest_way(slot_prio.data(), ways);
    if (!(cand_prio(cand[k]) > slot_prio[best])) break;
    slot_prio[best] = std::numeric_limits<int32_t>::max();
    enter(cand[k], best);
  }
  for (; k < cand.size(); ++k) bypass(cand[k]);
}

}  // namespace cpu
}  // namespace embcache
