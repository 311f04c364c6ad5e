// The commit of one table's update (docs/contract.md §4.3 step 3), run by multi_update
// (csrc/cpu/update.cpp) once every table's update is known to be storable.
#include <map>
#include <memory>
#include <mutex>

#include "set_rule.h"
#include "update.h"

namespace embcache {
namespace cpu {
namespace {

/// How many rows one Philox call draws the uniforms of when an update stores rows of format
/// f into the table: with stochastic rounding of rows of at most 16 elements, 4 on CPUs with
/// fast AVX-512 and 2 with AVX2; 0 where each row draws its own as it is stored.
int rows_per_draw(const RowFormat& f, bool stochastic) {
#if defined(EMBCACHE_AVX2)
  if (stochastic && f.bits != 32 && f.dim <= 16) return has_fast_avx512() ? 4 : has_avx2() ? 2 : 0;
#endif
  return 0;
}

/// The uniforms of each of `rows` (16 per row, in order: quantize_row's `drawn`), per_draw
/// = rows_per_draw(...) > 0 rows per Philox call: one wide call serves several short rows.
std::unique_ptr<float[]> draw_row_uniforms(const RoundingStream& s,
                                           const std::vector<int64_t>& rows, int per_draw) {
  const size_t n = rows.size();
  std::unique_ptr<float[]> u(new float[16 * (n + 3)]);  // and room for the last call's extras
  for (size_t r = 0; r < n; r += per_draw) {
    int64_t group[4];  // past the end, the last row again
    for (int k = 0; k < per_draw; ++k) group[k] = rows[std::min(r + k, n - 1)];
#if defined(EMBCACHE_AVX2)
    if (per_draw == 4)
      stream_uniforms16_rows4(s, group, &u[16 * r]);
    else
      stream_uniforms32(s, group[0], 0, group[1], 0, &u[16 * r]);
#endif
  }
  return u;
}

/// The slot that each updated row's new value goes to (or kToTable, or kDone once written).
constexpr int64_t kToTable = -1, kDone = -2;

/// A resident that an update evicts: its row, its slot, and its index among the updated
/// rows (-1 if it was not updated: its value is the one in its slot).
struct Eviction {
  int64_t row, slot, u;
};

}  // namespace

/// commit_update (update.h): LFU counts first; then per set, updated residents stay,
/// candidates enter by strictly higher priority, the rest bypass into the table; then the new
/// values and optimizer state, each row's computed once, where it is written: for a resident
/// evicted by this update, before its slot is reused.
///
/// cache_priority holds each slot's priority: for LRU the step that last updated its row,
/// for LFU a copy of its row's count (so that choosing a victim reads one set's slots, not
/// the counts of 32 random rows). cache_set_floor holds, per set, a lower bound of its
/// slots' priorities (kEmpty if a way is empty, or unknown): when no candidate of a set beats
/// it, they all bypass without the set's tags and priorities being read. Priorities only
/// rise between flushes, so a bound stays a bound; the rule makes it exact whenever it runs
/// on a set (docs/design.md, "Set floors").
///
/// The work goes in four passes so that random memory is touched in a prefetchable order:
/// by row, counts and every destination but those of candidates that beat their set's floor;
/// by set, the rule for those (a few percent of the rows once the cache is warm); by evicted
/// resident, its write-back (its slot and table row are cold lines, prefetched in a pass of
/// their own so that they do not stall the rule); by row, the new values.
CommitCounts commit_update(const RowUpdate& up, const TableSpec& spec, const TableState& s,
                           const int64_t* slot_of, const int64_t* occ, int64_t step,
                           RoundingProbe* probe) {
  const RowFormat& f = up.f;
  const Cache& cache = up.cache;
  const int64_t dim = f.dim, nu = up.nu, ways = cache.ways;
  const int64_t* rows = up.rows;
  uint8_t* w = s.weights;
  int32_t* prio = s.cache_priority;
  int32_t* floor = s.cache_set_floor;
  const LfuCounts cnt = s.counts;
  const bool lfu = spec.lfu(), stochastic = spec.stochastic;
  // Row u's new value into out (a scratch row, or its cache slot; scratch holds dim floats)
  // and its new optimizer state in place: read, then written, so once per row.
  auto value_of = [&](int64_t u, float* out, float* scratch) {
    up.compute(u, slot_of[u], scratch, out, up.st + rows[u] * up.sw);
  };
  auto prefetch_sources = [&](int64_t u) { up.prefetch_sources(u, slot_of[u]); };

  // Pass 1, by row (random lines prefetched kPrefetch rows ahead): LFU counts; each row's
  // priority once its count is in; updated residents stay in their slots with that priority;
  // a candidate that does not beat its set's floor bypasses (it could enter no way, whatever
  // the other candidates of its set do); the others contend for their sets in pass 2.
  const RoundingStream stream = spec.stream(step);
  // Each thread's chunk probes into its own RoundingProbe, merged under probe_mutex.
  std::mutex probe_mutex;
  auto store = [&](int64_t row, const float* x, const float* drawn, RoundingProbe& probed) {
    quantize_row(f, x, stochastic, stream, row, w + row * f.row_bytes(), drawn);
    if (is_probed(row, step)) probed.add(f, x, w + row * f.row_bytes(), stochastic);
  };
  auto merge_probe = [&](const RoundingProbe& probed) {
    const std::lock_guard<std::mutex> lock(probe_mutex);
    probe->merge(probed);
  };
  std::vector<int32_t> row_prio(nu);
  std::vector<int64_t> dest(nu, kToTable);
  // Rows are distinct, so chunks of them touch distinct counts and slots: a table alone
  // (not inside a collection's parallel loop over tables) spreads this pass over the threads.
  // Each chunk's contenders, (set, u) packed, u ascending, by the chunk's first row; then
  // all of them in chunk order.
  std::map<int64_t, std::vector<uint64_t>> chunk_contenders;
  std::mutex chunk_mutex;
  std::atomic<int64_t> n_hits{0};
  at::parallel_for(0, nu, kGrainRows, [&](int64_t u0, int64_t u1) {
    std::vector<uint64_t> mine;
    int64_t chunk_hits = 0;
    for (int64_t u = u0; u < u1; ++u) {
      if (u + kPrefetch < u1) {
        const int64_t ahead = u + kPrefetch;
        if (lfu) __builtin_prefetch(cnt.address(rows[ahead]), 1);
        if (slot_of[ahead] >= 0) __builtin_prefetch(prio + slot_of[ahead], 1);
      }
      if (lfu) cnt.add(rows[u], occ[u]);
      row_prio[u] = RowPriority{lfu, cnt, step}(rows[u]);
      if (slot_of[u] >= 0) {
        dest[u] = slot_of[u];
        prio[slot_of[u]] = row_prio[u];
        ++chunk_hits;
      } else if (const int64_t set = cache.set_of(rows[u]);
                 set >= 0 && row_prio[u] > floor[set]) {
        mine.push_back(((uint64_t)set << 32) | (uint64_t)u);
      }  // else it bypasses (counted as a miss not inserted)
    }
    n_hits += chunk_hits;
    const std::lock_guard<std::mutex> lock(chunk_mutex);
    chunk_contenders[u0] = std::move(mine);
  });
  std::vector<uint64_t> contenders;
  for (const auto& [u0, c] : chunk_contenders)
    contenders.insert(contenders.end(), c.begin(), c.end());
  const int64_t hits = n_hits.load();

  // Pass 2, by set: the set rule for the contenders, each set's floor made exact.
  std::vector<uint64_t> tmp;
  // group g: contenders[starts[g] .. starts[g + 1]), one set
  const std::vector<int64_t> starts = sort_into_runs(contenders, bits_for(cache.num_sets()), tmp);
  const int64_t ngroups = (int64_t)starts.size() - 1;
  auto set_of_group = [&](int64_t gi) { return (int64_t)(contenders[starts[gi]] >> 32); };
  auto prefetch_set = [&](int64_t gi) {
    prefetch_bytes(cache.tags + set_of_group(gi) * ways, ways * sizeof(int32_t), true);
    prefetch_bytes(prio + set_of_group(gi) * ways, ways * sizeof(int32_t), true);
  };
  constexpr int64_t kGroupsAhead = 8;
  std::atomic<int64_t> ins{0};
  std::vector<Eviction> evicted;
  std::mutex evicted_mutex;
  at::parallel_for(0, ngroups, kGrainSets, [&](int64_t g0, int64_t g1) {
    std::vector<int64_t> cand;
    std::vector<int32_t> slot_prio(ways);
    std::vector<Eviction> chunk_evicted;
    int64_t n_ins = 0;
    for (int64_t gi = g0; gi < std::min(g1, g0 + kGroupsAhead); ++gi) prefetch_set(gi);
    for (int64_t gi = g0; gi < g1; ++gi) {
      if (gi + kGroupsAhead < g1) prefetch_set(gi + kGroupsAhead);
      cand.clear();
      for (int64_t k = starts[gi]; k < starts[gi + 1]; ++k)
        cand.push_back((int64_t)(contenders[k] & 0xffffffffu));
      const int64_t set = set_of_group(gi), base = set * ways;
      apply_set_rule(
          cand, [&](int64_t u) -> int64_t { return row_prio[u]; },
          [&](int64_t way) { return slot_priority(cache.tags, prio, base + way); },
          ways, slot_prio,
          [&](int64_t u, int64_t way) {  // u enters way, evicting its resident if any
            const int64_t slot = base + way, old = cache.tags[slot];
            if (old >= 0) {
              // A resident updated in this step goes to the table with its new value
              // (then it is done), any other with the value in its slot.
              const int64_t* r = std::lower_bound(rows, rows + nu, old);
              const bool updated = r != rows + nu && *r == old;
              chunk_evicted.push_back({old, slot, updated ? r - rows : -1});
              if (updated) dest[r - rows] = kDone;
            }
            cache.tags[slot] = (int32_t)rows[u];
            prio[slot] = row_prio[u];
            dest[u] = slot;
            ++n_ins;
          },
          [](int64_t) {});
      int32_t lowest = slot_priority(cache.tags, prio, base);
      for (int64_t way = 1; way < ways; ++way)
        lowest = std::min(lowest, slot_priority(cache.tags, prio, base + way));
      floor[set] = lowest;
    }
    ins += n_ins;
    const std::lock_guard<std::mutex> lock(evicted_mutex);
    evicted.insert(evicted.end(), chunk_evicted.begin(), chunk_evicted.end());
  });

  // Pass 3, by evicted resident: its value into the table, before pass 4 reuses its slot
  // (the rows are distinct, so the order does not matter).
  const int per_draw = rows_per_draw(f, stochastic);
  auto prefetch_eviction = [&](const Eviction& e) {
    if (e.u >= 0)
      prefetch_sources(e.u);
    else
      prefetch_bytes(cache.rows + e.slot * dim, dim * sizeof(float));
    prefetch_bytes(w + e.row * f.row_bytes(), f.row_bytes(), true);
  };
  const int64_t ne = (int64_t)evicted.size();
  at::parallel_for(0, ne, kGrainRows, [&](int64_t e0, int64_t e1) {
    std::vector<float> value(dim), scratch(dim);
    RoundingProbe probed;
    std::unique_ptr<float[]> drawn;
    if (per_draw > 0) {
      std::vector<int64_t> table_rows;
      for (int64_t e = e0; e < e1; ++e) table_rows.push_back(evicted[e].row);
      drawn = draw_row_uniforms(stream, table_rows, per_draw);
    }
    for (int64_t e = e0; e < std::min(e1, e0 + kPrefetch); ++e) prefetch_eviction(evicted[e]);
    for (int64_t e = e0; e < e1; ++e) {
      if (e + kPrefetch < e1) prefetch_eviction(evicted[e + kPrefetch]);
      const Eviction& ev = evicted[e];
      const float* x = cache.rows + ev.slot * dim;
      if (ev.u >= 0) {
        value_of(ev.u, value.data(), scratch.data());
        x = value.data();
      }
      store(ev.row, x, drawn ? &drawn[16 * (e - e0)] : nullptr, probed);
    }
    merge_probe(probed);
  });

  // Pass 4, by row: every new value to its destination, sources and destinations
  // prefetched kPrefetch rows ahead.
  auto prefetch_row = [&](int64_t u) {
    prefetch_sources(u);
    if (dest[u] >= 0)
      prefetch_bytes(cache.rows + dest[u] * dim, dim * sizeof(float), true);
    else if (dest[u] == kToTable)
      prefetch_bytes(w + rows[u] * f.row_bytes(), f.row_bytes(), true);
  };
  at::parallel_for(0, nu, kGrainRows, [&](int64_t u0, int64_t u1) {
    std::vector<float> value(dim), scratch(dim);
    RoundingProbe probed;
    std::unique_ptr<float[]> drawn;  // the uniforms of the rows of [u0, u1) bound for the table
    if (per_draw > 0) {
      std::vector<int64_t> table_rows;
      for (int64_t u = u0; u < u1; ++u)
        if (dest[u] == kToTable) table_rows.push_back(rows[u]);
      drawn = draw_row_uniforms(stream, table_rows, per_draw);
    }
    int64_t next = 0;  // rows of [u0, u) stored into the table
    for (int64_t u = u0; u < std::min(u1, u0 + kPrefetch); ++u) prefetch_row(u);
    for (int64_t u = u0; u < u1; ++u) {
      if (u + kPrefetch < u1) prefetch_row(u + kPrefetch);
      if (dest[u] >= 0) {
        value_of(u, cache.rows + dest[u] * dim, scratch.data());
      } else if (dest[u] == kToTable) {
        value_of(u, value.data(), scratch.data());
        store(rows[u], value.data(), drawn ? &drawn[16 * next] : nullptr, probed);
        ++next;
      }
    }
    merge_probe(probed);
  });
  return {hits, ins.load(), ne};
}

}  // namespace cpu
}  // namespace embcache
