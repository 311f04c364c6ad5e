// The update of every table (docs/contract.md §4.3 step 3), all or nothing (docs/design.md,
// "All-or-nothing"): first each table's slots and a check that all its new values can be
// stored, changing nothing; then, only if every table can take its update, each table's
// commit (csrc/cpu/commit.cpp).
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "update.h"

namespace embcache {
namespace cpu {
namespace {

/// Each unique row's slot (-1 if not cached) into sl[0..nu): the caller's hint if given
/// (hint[u]: the slots a forward found over the same cache state), else found in the sets.
void find_slots(const RowUpdate& up, const int64_t* hint, int64_t* sl) {
  if (hint) {
    const int64_t slots = up.cache.num_sets() * up.cache.ways;
    const int64_t u =
        first_where(up.nu, [&](int64_t u) { return hint[u] < -1 || hint[u] >= slots; });
    TORCH_CHECK(u == up.nu, "embcache: slot_hint ", u < up.nu ? hint[u] : 0, " is not a slot");
    std::copy(hint, hint + up.nu, sl);
    return;
  }
  // the set of each row until its slot is found (tags prefetched kPrefetch rows ahead)
  for (int64_t u = 0; u < up.nu; ++u) sl[u] = up.cache.set_of(up.rows[u]);
  for (int64_t u = 0; u < up.nu; ++u) {
    if (u + kPrefetch < up.nu) up.cache.prefetch_set(sl[u + kPrefetch]);
    sl[u] = up.cache.find_in_set(sl[u], up.rows[u]);
  }
}

/// The smallest row whose new value cannot be stored in the table's format (non-finite, or
/// beyond its range), or -1: every new value computed in scratch buffers, nothing written
/// (the values prefetched kPrefetch rows ahead).
int64_t first_unstorable(const RowUpdate& up, const int64_t* sl, bool stochastic) {
  std::atomic<int64_t> first_bad{std::numeric_limits<int64_t>::max()};
  at::parallel_for(0, up.nu, kGrainRows, [&](int64_t u0, int64_t u1) {
    std::vector<float> buf(up.f.dim), out(up.f.dim), state(up.sw);
    for (int64_t u = u0; u < std::min(u1, u0 + kPrefetch); ++u) up.prefetch_sources(u, sl[u]);
    for (int64_t u = u0; u < u1; ++u) {
      if (u + kPrefetch < u1) up.prefetch_sources(u + kPrefetch, sl[u + kPrefetch]);
      up.compute(u, sl[u], buf.data(), out.data(), state.data());
      if (!row_is_storable(up.f, out.data(), stochastic)) {
        int64_t cur = first_bad.load();
        while (up.rows[u] < cur && !first_bad.compare_exchange_weak(cur, up.rows[u])) {
        }
      }
    }
  });
  const int64_t bad = first_bad.load();
  return bad == std::numeric_limits<int64_t>::max() ? -1 : bad;
}

/// The largest |change| one update can make to an element, whatever the row's optimizer
/// state, given the largest |gradient| gmax (finite); (1% margins cover float rounding).
///   SGD: |lr| gmax.
///   row-wise AdaGrad: the step lr / (sqrt(acc) + eps) with acc >= sum_j g_j^2 / dim times
///     |g_j| <= sqrt(sum_j g_j^2) is at most |lr| sqrt(dim) -- or, for a row whose squares
///     underflow (every |g_j| < 1e-18), |lr| 1e-18 / eps.
///   AdaGrad: acc_j >= g_j^2, so |lr| (or |lr| 1e-18 / eps likewise).
double max_change(const TableSpec& t, float gmax) {
  const double lr = std::fabs(t.lr);
  if (t.optimizer == kSGD) return lr * (double)gmax;
  const double tiny = 1e-18 / t.eps;  // eps > 0 (decode_specs checks it)
  const double bound = t.optimizer == kRowwiseAdagrad ? std::sqrt((double)t.f.dim) : 1.0;
  return 1.01 * lr * std::max(bound, tiny);
}

/// Whether every new value of an update is storable, judged from the gradients and a bound
/// on the rows' current values (|v| <= value_bound) alone (max_change); false when that
/// cannot tell, or a gradient is not finite. |v - change| <= (|v| + |change|) (1 + 2^-24), and
/// the margins below also cover rows read back after rounding (within 2^-11 of their value).
bool surely_storable(const TableSpec& t, const float* g, int64_t n, double value_bound) {
  if (!(value_bound >= 0.0)) return false;
  // max |g| over the bits: |g| orders as its bits do, and inf or NaN bits are the largest
  // (an integer max the compiler vectorizes; a float max over n values would be a chain)
  uint32_t max_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = float_bits(g[i]) & 0x7fffffffu;
    max_bits = a > max_bits ? a : max_bits;
  }
  if (max_bits >= 0x7f800000u) return false;
  const double m = 1.01 * (1.01 * value_bound + max_change(t, bits_float(max_bits)));
  const RowFormat& f = t.f;
  if (f.bits == 16) return m <= 65000.0;  // binary16 keeps |x| <= 65504 finite
  // binary16 qparams: |min| and (max - min) / q_max stay finite for |x| < 30000
  if (f.is_int() && f.qparams_fp16) return m < 30000.0;
  return m < 1e37;  // fp32 values, and fp32 qparams whose range max - min stays finite
}

/// Every table's update, all or nothing: first each table's slots and a check that all its
/// new values can be stored (from the gradients alone when there are slot hints and
/// value_bounds[t] >= 0 bounds |v| of the table's rows, as the forward that found the hints
/// read them: surely_storable; else by computing them); then, if no table has a row it
/// cannot store, each table's commit, which computes every new value where it writes it
/// (tables in parallel, costliest first in both phases). The gradient is in
/// multi_dedup_backward's layout (see gradient_ranges); slot_hints holds every row's slot as
/// the forward found it, or is empty for none. Table t's update is step
/// counters[t][kSteps] + 1; its commit adds to its device_counts and its probe counters (as
/// op_schemas.h says). Returns the verdict: per table no error bits (bad unique rows raise
/// here) and the smallest row it cannot store, or -1. With commit false, or a non-zero word
/// in the gate, it stops after the check. Stages are ignored: on the CPU none holds anything.
at::Tensor multi_update(at::TensorList state, const at::Tensor& specs,
                        const at::Tensor& unique_rows, const at::Tensor& grads,
                        const at::Tensor& occurrences, const at::Tensor& slot_hints,
                        const at::Tensor& row_ranges, at::ArrayRef<double> value_bounds,
                        at::TensorList counters, at::TensorList device_counts,
                        const c10::optional<at::Tensor>& gate, bool commit,
                        const c10::optional<at::Tensor>& /*staged_slots*/,
                        const c10::optional<at::Tensor>& /*staged_rows*/,
                        at::IntArrayRef /*staged_table*/) {
  const UpdateArgs a = update_args(state, specs, unique_rows, grads, occurrences, slot_hints,
                                   row_ranges, value_bounds, counters, device_counts, gate, kCpu,
                                   true);
  const Tables& tables = a.tables;
  const std::vector<TableSpec>& spec = tables.spec;
  const std::vector<RowRange>& range = a.ranges;
  const int64_t nt = (int64_t)spec.size();
  const bool hinted = slot_hints.numel() > 0;
  std::vector<RowUpdate> updates;
  std::vector<int64_t> cost(nt);
  for (int64_t t = 0; t < nt; ++t) {
    updates.push_back(make_row_update(spec[t], tables.state[t],
                                      unique_rows.data_ptr<int64_t>() + range[t].first,
                                      range[t].end - range[t].first,
                                      grads.data_ptr<float>() + range[t].value));
    cost[t] = row_work(updates[t].nu, spec[t].rows);
  }
  std::vector<std::vector<int64_t>> slots(nt);
  std::vector<int64_t> bad(nt, -1);
  for_each_by_cost(cost, [&](int64_t t) {
    const RowUpdate& up = updates[t];
    slots[t].resize(up.nu);
    find_slots(up, hinted ? slot_hints.data_ptr<int64_t>() + range[t].first : nullptr,
               slots[t].data());
    if (hinted && surely_storable(spec[t], up.g, up.nu * up.f.dim, value_bounds[t])) return;
    bad[t] = first_unstorable(up, slots[t].data(), spec[t].stochastic);
  });
  at::Tensor verdict = at::zeros({nt, 2}, at::kLong);
  int64_t* v = verdict.data_ptr<int64_t>();
  for (int64_t t = 0; t < nt; ++t) v[2 * t + 1] = bad[t];
  const int64_t* gate_words = gate.has_value() ? gate->data_ptr<int64_t>() : nullptr;
  const int64_t ngate = gate.has_value() ? gate->numel() : 0;
  const bool gated = std::any_of(gate_words, gate_words + ngate, [](int64_t w) { return w != 0; });
  if (!commit || gated || std::any_of(bad.begin(), bad.end(), [](int64_t b) { return b >= 0; }))
    return verdict;
  for_each_by_cost(cost, [&](int64_t t) {
    int64_t* counter = tables.counters[t];
    RoundingProbe probe;
    const CommitCounts c =
        commit_update(updates[t], spec[t], tables.state[t], slots[t].data(),
                      occurrences.data_ptr<int64_t>() + range[t].first, counter[kSteps] + 1,
                      &probe);
    for (int i = 0; i < kNumCommitCounts; ++i) a.device_counts[t][kCommitHits + i] += c[i];
    count_probe(counter, probe);
  });
  return verdict;
}

}  // namespace

TORCH_LIBRARY_IMPL(embcache, CPU, m) { m.impl("multi_update", &multi_update); }

}  // namespace cpu
}  // namespace embcache
