// The hit-rate replay of bench/hit_rate.py: a stream of training steps through the cache
// alone, with the set rule of the update (csrc/cpu/set_rule.h) and no row values.
#include <torch/library.h>

#include "cpu_common.h"
#include "set_rule.h"

namespace embcache {
namespace cpu {
namespace {

/// Replays a stream of training steps through the cache alone, with the rule of the
/// update's commit and no row values (the hit-rate benchmark). Step s looks up
/// indices[step_offsets[s] .. step_offsets[s+1]); its lookups count as hits when their row
/// is cached before the step's update, as in a training forward. Steps are numbered from
/// first_step. Returns [lookups, hits, unique rows, unique hits, insertions, evictions,
/// bypasses].
at::Tensor cache_replay(at::Tensor& cache_tags, at::Tensor& cache_priority, at::Tensor& counts,
                        const at::Tensor& indices, const at::Tensor& step_offsets, bool lfu,
                        int64_t num_sets, int64_t ways, int64_t first_step) {
  kCpu.check(cache_tags, at::kInt, "cache_tags");
  kCpu.check(cache_priority, at::kInt, "cache_priority");
  kCpu.check(counts, at::kInt, "counts");
  kCpu.check(indices, at::kLong, "indices");
  kCpu.check(step_offsets, at::kLong, "step_offsets");
  TORCH_CHECK(is_valid_ways(ways), "embcache: ways must be a power of two in [1, ", kMaxWays,
              "], got ", ways);
  TORCH_CHECK(num_sets > 0 && cache_tags.numel() == num_sets * ways,
              "embcache: cache_tags must hold num_sets * ways slots");
  TORCH_CHECK(cache_priority.numel() == num_sets * ways,
              "embcache: cache_priority must hold one priority per slot");
  const int64_t* idx = indices.data_ptr<int64_t>();
  const int64_t* so = step_offsets.data_ptr<int64_t>();
  const int64_t nsteps = step_offsets.numel() - 1;
  TORCH_CHECK(nsteps >= 0 && so[0] == 0 && so[nsteps] == indices.numel(),
              "embcache: step_offsets must run from 0 to len(indices)");
  for (int64_t l = 0; l < indices.numel(); ++l)
    TORCH_CHECK(idx[l] >= 0 && idx[l] < (int64_t(1) << 31) && (!lfu || idx[l] < counts.numel()),
                "embcache: index ", idx[l], " out of range");
  int32_t* tags = cache_tags.data_ptr<int32_t>();
  int32_t* prio = cache_priority.data_ptr<int32_t>();
  int32_t* cnt = counts.data_ptr<int32_t>();
  const Cache cache{tags, nullptr, num_sets, ways};
  int64_t hits = 0, unique = 0, unique_hits = 0, ins = 0, evict = 0, bypass = 0;
  int64_t max_index = 0;
  for (int64_t l = 0; l < indices.numel(); ++l) max_index = std::max(max_index, idx[l]);
  const int index_bits = bits_for(max_index + 1);
  // Buffers reused across steps.
  std::vector<uint64_t> keys, set_keys, tmp;
  std::vector<int64_t> rows, occ, cand;
  std::vector<int32_t> slot_prio(ways);
  for (int64_t s = 0; s < nsteps; ++s) {
    const int64_t step = first_step + s;
    const RowPriority priority_of_row{lfu, cnt, step};
    keys.clear();
    for (int64_t l = so[s]; l < so[s + 1]; ++l) keys.push_back((uint64_t)idx[l] << 32);
    radix_sort_high(keys, index_bits, tmp);
    rows.clear();
    occ.clear();
    for (size_t k = 0; k < keys.size(); ++k) {
      if (k == 0 || keys[k] != keys[k - 1]) {
        rows.push_back((int64_t)(keys[k] >> 32));
        occ.push_back(0);
      }
      ++occ.back();
    }
    const int64_t nu = (int64_t)rows.size();
    unique += nu;
    if (lfu)
      for (int64_t u = 0; u < nu; ++u)
        cnt[rows[u]] = (int32_t)std::min<int64_t>((int64_t)cnt[rows[u]] + occ[u],
                                                  std::numeric_limits<int32_t>::max());
    set_keys.resize(nu);  // (set, u) packed
    for (int64_t u = 0; u < nu; ++u)
      set_keys[u] = ((uint64_t)set_of_row(rows[u], num_sets) << 32) | (uint64_t)u;
    const std::vector<int64_t> starts = sort_into_runs(set_keys, bits_for(num_sets), tmp);
    for (size_t gi = 0; gi + 1 < starts.size(); ++gi) {
      const int64_t base = (int64_t)(set_keys[starts[gi]] >> 32) * ways;
      cand.clear();
      for (int64_t k = starts[gi]; k < starts[gi + 1]; ++k) {
        const int64_t u = (int64_t)(set_keys[k] & 0xffffffffu);
        const int64_t slot = cache.find_in_set(base / ways, rows[u]);
        if (slot >= 0) {  // resident before the update: all its lookups of the step hit
          prio[slot] = priority_of_row(rows[u]);
          ++unique_hits;
          hits += occ[u];
        } else {
          cand.push_back(u);
        }
      }
      apply_set_rule(
          cand, [&](int64_t u) -> int64_t { return priority_of_row(rows[u]); },
          [&](int64_t way) { return slot_priority(tags, prio, base + way); },
          ways, slot_prio,
          [&](int64_t u, int64_t way) {
            evict += tags[base + way] >= 0;
            tags[base + way] = (int32_t)rows[u];
            prio[base + way] = priority_of_row(rows[u]);
            ++ins;
          },
          [&](int64_t) { ++bypass; });
    }
  }
  return at::tensor({indices.numel(), hits, unique, unique_hits, ins, evict, bypass}, at::kLong);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(embcache, m) {
  m.def("cache_replay(Tensor(a!) cache_tags, Tensor(b!) cache_priority, Tensor(c!) counts, "
        "Tensor indices, Tensor step_offsets, bool lfu, int num_sets, int ways, "
        "int first_step) -> Tensor");
}

TORCH_LIBRARY_IMPL(embcache, CPU, m) { m.impl("cache_replay", &cache_replay); }

}  // namespace cpu
}  // namespace embcache
