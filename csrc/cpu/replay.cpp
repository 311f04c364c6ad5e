// The hit-rate replay of bench/hit_rate.py (cache_replay of csrc/op_schemas.h): a stream of
// training steps through the cache alone, with the set rule of the update
// (csrc/cpu/set_rule.h) and no row values.
#include <torch/library.h>

#include "cpu_common.h"
#include "set_rule.h"

namespace embcache {
namespace cpu {
namespace {

/// Replays a stream of training steps of one table through its cache (cache_replay of
/// csrc/op_schemas.h): every argument checked before anything is written.
void cache_replay(at::Tensor& cache_tags, at::Tensor& cache_priority, at::Tensor& counts,
                  const at::Tensor& spec, const at::Tensor& indices,
                  const at::Tensor& step_offsets, at::Tensor& counters) {
  const TableSpec t = decode_table_spec(spec);
  const int64_t num_sets = t.num_sets, ways = t.ways;
  const bool lfu = t.lfu();
  auto check = [&](const at::Tensor& x, int64_t numel, const char* what,
                   at::ScalarType dtype = at::kInt) {
    kCpu.check(x, dtype, what);
    TORCH_CHECK(x.numel() == numel, "embcache: ", what, " must hold ", numel, " values, got ",
                x.numel());
  };
  check(cache_tags, t.slots(), "cache_tags");
  check(cache_priority, t.slots(), "cache_priority");
  check(counts, lfu ? t.rows : 0, "counts", counts_dtype(t));
  kCpu.check(indices, at::kLong, "indices");
  kCpu.check(step_offsets, at::kLong, "step_offsets");
  int64_t* counter = tables_counters(counters, 1, false)[0];
  const int64_t* idx = indices.data_ptr<int64_t>();
  const int64_t* so = step_offsets.data_ptr<int64_t>();
  const int64_t nsteps = step_offsets.numel() - 1;
  TORCH_CHECK(nsteps >= 0 && so[0] == 0 && so[nsteps] == indices.numel(),
              "embcache: step_offsets must run from 0 to len(indices)");
  for (int64_t l = 0; l < indices.numel(); ++l)
    TORCH_CHECK(idx[l] >= 0 && idx[l] < t.rows, "embcache: index ", idx[l],
                " out of range [0, ", t.rows, ")");
  int32_t* tags = cache_tags.data_ptr<int32_t>();
  int32_t* prio = cache_priority.data_ptr<int32_t>();
  const LfuCounts cnt{counts.data_ptr(), t.count_bits};
  const Cache cache{tags, nullptr, t.set_divisor, ways};
  int64_t max_index = 0;
  for (int64_t l = 0; l < indices.numel(); ++l) max_index = std::max(max_index, idx[l]);
  const int index_bits = bits_for(max_index + 1);
  // Buffers reused across steps.
  std::vector<uint64_t> keys, set_keys, tmp;
  std::vector<int64_t> rows, occ, cand;
  std::vector<int32_t> slot_prio(ways);
  for (int64_t s = 0; s < nsteps; ++s) {
    const int64_t step = counter[kSteps] + 1;
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
    if (lfu)
      for (int64_t u = 0; u < nu; ++u) cnt.add(rows[u], occ[u]);
    int64_t hits = 0, unique_hits = 0, ins = 0, evict = 0;
    set_keys.clear();  // (set, u) packed
    if (num_sets > 0)  // (no cache: every updated row bypasses)
      for (int64_t u = 0; u < nu; ++u)
        set_keys.push_back(((uint64_t)set_of_row(rows[u], t.set_divisor) << 32) | (uint64_t)u);
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
          [](int64_t) {});
    }
    const int64_t counts[kNumDeviceCounts] = {so[s + 1] - so[s], hits, unique_hits, ins, evict};
    counter[kSteps] += 1;
    counter[kUniqueRows] += nu;
    fold_counts(counter, counts);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(embcache, CPU, m) { m.impl("cache_replay", &cache_replay); }

}  // namespace cpu
}  // namespace embcache
