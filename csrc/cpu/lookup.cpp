// The forward (docs/contract.md §4.3 step 1): every feature's bags pooled from its table, each
// lookup's row read from its cache slot if it is resident, else dequantized from the table.
#include <mutex>
#include <type_traits>

#include <torch/library.h>

#include "cpu_common.h"

namespace embcache {
namespace cpu {
namespace {

/// The largest |x| of the values added (0 if none; a NaN is passed over), four lanes at a
/// time where SSE is there.
class MaxAbs {
 public:
  void add(float x) {
    const float a = std::fabs(x);
    m_ = a > m_ ? a : m_;
  }
#if defined(EMBCACHE_SSE)
  /// max(|x|, m) lane by lane. maxps(a, m) is a where a > m, else m: a NaN lane of x keeps
  /// m, as add() does.
  static __m128 max_abs4(__m128 x, __m128 m) {
    return _mm_max_ps(_mm_andnot_ps(_mm_set1_ps(-0.f), x), m);
  }
  /// Adds four values known to be >= 0 (or NaN, passed over).
  void add_max4(__m128 m) { m4_ = _mm_max_ps(m, m4_); }
  float value() const {
    float lanes[4];
    _mm_storeu_ps(lanes, m4_);
    float m = m_;
    for (float a : lanes) m = a > m ? a : m;
    return m;
  }
#else
  float value() const { return m_; }
#endif

 private:
  float m_ = 0.f;
#if defined(EMBCACHE_SSE)
  __m128 m4_ = _mm_setzero_ps();
#endif
};

/// add_values with `first` known at compile time; kStream (with kFirst, and acc 16-byte
/// aligned): the term is stored past the caches (non-temporal stores).
template <bool kFirst, bool kStream, typename Values>
EMBCACHE_ALWAYS_INLINE void add_term(int dim, const Values& v, float s, float* acc,
                                     MaxAbs& max_abs) {
  static_assert(!kStream || kFirst, "only a bag's first term is streamed");
  int j = 0;
#if defined(EMBCACHE_SSE)
  const __m128 s4 = _mm_set1_ps(s);
  __m128 row_max = _mm_setzero_ps();  // the running max waits on one op per row, not four
  for (; j + 4 <= dim; j += 4) {
    const __m128 x = v.at4(j);
    row_max = MaxAbs::max_abs4(x, row_max);
    const __m128 a = kFirst ? _mm_setzero_ps() : _mm_loadu_ps(acc + j);
    if (kStream)
      _mm_stream_ps(acc + j, _mm_add_ps(a, _mm_mul_ps(s4, x)));
    else
      _mm_storeu_ps(acc + j, _mm_add_ps(a, _mm_mul_ps(s4, x)));
  }
  max_abs.add_max4(row_max);
#endif
  for (; j < dim; ++j) {
    const float x = v.at(j);
    max_abs.add(x);
    acc[j] = (kFirst ? 0.f : acc[j]) + s * x;
  }
}

/// acc[j] = (first ? 0 : acc[j]) + w * v.at(j) for j < dim (w == nullptr: + v.at(j)), each
/// value also added to max_abs. The first term is added to +0.f, as a sum from zero would be
/// (it turns -0.f into +0.f). acc may be a cold output row: the first term does not read it
/// (a load that misses would stall the loop, where a store does not), and later terms read
/// it in the 16-byte pieces that were written, so that the store buffer serves them. Four
/// lanes at a time where SSE is there (the same roundings as the scalar loop). kStream: the
/// term is a bag's first and only one, stored past the caches (add_term).
template <bool kStream, typename Values>
EMBCACHE_ALWAYS_INLINE void add_values(int dim, const Values& v, const float* w, bool first,
                                       float* acc, MaxAbs& max_abs) {
  const float s = w ? *w : 1.f;  // s * x == x exactly for s == 1
  if constexpr (kStream)
    add_term<true, true>(dim, v, s, acc, max_abs);
  else if (first)
    add_term<true, false>(dim, v, s, acc, max_abs);
  else
    add_term<false, false>(dim, v, s, acc, max_abs);
}

/// dst[0 .. dim) = src[0 .. dim), past the caches where SSE is there (dim a multiple of 4,
/// dst 16-byte aligned).
EMBCACHE_ALWAYS_INLINE void stream_row(float* dst, const float* src, int64_t dim) {
#if defined(EMBCACHE_SSE)
  for (int64_t j = 0; j < dim; j += 4) _mm_stream_ps(dst + j, _mm_loadu_ps(src + j));
#else
  std::copy_n(src, dim, dst);
#endif
}

/// lookup_core's pooling pass over bags [b0, b1); returns the number of cached lookups.
/// Instantiated for rows of kDim floats (0: `dim`, known at run time only; 16 is DLRM's
/// Criteo dim) and for chunks whose every bag has one lookup (Criteo's features), so that the
/// loop over lookups is short: with its rows prefetched, it is bound by its instruction count
/// as much as by memory, so a runtime dim or per-bag bookkeeping shows in its time. kStream
/// (output rows 16-byte aligned, dim a multiple of 4): each bag's row is written past the
/// caches, once: a one-lookup bag's term as it is computed, a longer bag's sum from a row
/// of this thread's after its last term.
template <int64_t kDim, bool kOneLookupPerBag, bool kStream, typename StoredValues>
int64_t pool_bags(const Bags& bags, int64_t b0, int64_t b1, int64_t dim, const Cache& cache,
                  const uint8_t* w, int64_t row_bytes, const int32_t* slot, bool mean, float* out,
                  int64_t out_stride, const StoredValues& stored_values, MaxAbs& max_abs) {
  constexpr bool kStreamTerm = kStream && kOneLookupPerBag;
  if (kDim) dim = kDim;
  const int64_t* idx = bags.idx;
  const int64_t* off = bags.off;
  const float* psw = bags.psw;
  const float* cache_rows = cache.rows;
  const int64_t end = off[b1];
  auto prefetch_value = [&](int64_t l) {
    cache.prefetch_value(slot[l], dim, w + idx[l] * row_bytes, row_bytes);
  };
  for (int64_t l = off[b0]; l < std::min(end, off[b0] + kPrefetch); ++l) prefetch_value(l);
  int64_t hits = 0;
  auto add_lookup = [&](int64_t l, bool first, float* acc) {
    if (l + kPrefetch < end) prefetch_value(l + kPrefetch);
    const float* weight = psw ? psw + l : nullptr;
    if (slot[l] >= 0) {
      const uint8_t* v = (const uint8_t*)(cache_rows + slot[l] * dim);
      add_values<kStreamTerm>(dim, RowValues<32>{v}, weight, first, acc, max_abs);
      ++hits;
    } else {
      add_values<kStreamTerm>(dim, stored_values(w + idx[l] * row_bytes), weight, first, acc,
                              max_abs);
    }
  };
  if (kOneLookupPerBag) {  // and the mean of one term is the term
    for (int64_t b = b0, l = off[b0]; b < b1; ++b, ++l) add_lookup(l, true, out + b * out_stride);
    return hits;
  }
  std::vector<float> sum(kStream ? dim : 0);
  for (int64_t b = b0; b < b1; ++b) {
    float* acc = kStream ? sum.data() : out + b * out_stride;
    const int64_t l0 = off[b], l1 = off[b + 1];
    if (l0 == l1) std::fill_n(acc, dim, 0.f);
    for (int64_t l = l0; l < l1; ++l) add_lookup(l, l == l0, acc);
    if (mean && l1 > l0)
      for (int64_t j = 0; j < dim; ++j) acc[j] /= (float)(l1 - l0);
    if (kStream) stream_row(out + b * out_stride, acc, dim);
  }
  return hits;
}

/// lookup_core's pooling pass for max-pooled bags [b0, b1) (docs/design.md, "Max pooling"):
/// out[b * out_stride + j] the element-wise maximum of the bag's rows and
/// argmax[b * argmax_stride + j] the position of the lookup it came from, by nn.EmbeddingBag's
/// rule: the bag's first value, replaced by each later one that is greater (so the first of
/// equal values stays, and a NaN only if it comes first); an empty bag gives 0, position -1.
/// Returns the number of cached lookups.
template <typename StoredValues>
int64_t max_bags(const Bags& bags, int64_t b0, int64_t b1, int64_t dim, const Cache& cache,
                 const uint8_t* w, int64_t row_bytes, const int32_t* slot, float* out,
                 int64_t out_stride, int32_t* argmax, int64_t argmax_stride,
                 const StoredValues& stored_values, MaxAbs& max_abs) {
  int64_t hits = 0;
  for (int64_t b = b0; b < b1; ++b) {
    float* acc = out + b * out_stride;
    int32_t* arg = argmax + b * argmax_stride;
    const int64_t l0 = bags.off[b], l1 = bags.off[b + 1];
    std::fill_n(acc, dim, 0.f);
    std::fill_n(arg, dim, -1);
    for (int64_t l = l0; l < l1; ++l) {
      auto take = [&](const auto& v) {
        for (int j = 0; j < (int)dim; ++j) {
          const float x = v.at(j);
          max_abs.add(x);
          if (l == l0 || x > acc[j]) {
            acc[j] = x;
            arg[j] = (int32_t)l;
          }
        }
      };
      if (slot[l] >= 0) {
        take(RowValues<32>{(const uint8_t*)(cache.rows + slot[l] * dim)});
        ++hits;
      } else {
        take(stored_values(w + bags.idx[l] * row_bytes));
      }
    }
  }
  return hits;
}

/// Pooled lookups (docs/contract.md §4 step 1) into out[b * out_stride + j], pooled by
/// `pooling` (max: each element's lookup into argmax[b * argmax_stride + j], max_bags), the
/// slot of every lookup's row (-1 if not cached) into slot[l] for the bags' lookups l, and the
/// largest |value| the lookups read into *max_abs (0 if none); returns the number of lookups
/// that found their row cached. Throws before writing if an index is out of range. With
/// `stream` (every out row 16-byte aligned, dim a multiple of 4), sums and means are written
/// past the caches.
int64_t lookup_core(const RowFormat& f, const Cache& cache, const uint8_t* w, int64_t num_rows,
                    const Bags& bags, int pooling, float* out, int64_t out_stride,
                    int32_t* argmax, int64_t argmax_stride, int32_t* slot, float* max_abs,
                    bool stream) {
  const int64_t dim = f.dim;
  const int64_t* first_idx = bags.idx + bags.first();
  const int64_t n = bags.end() - bags.first();
  const int64_t bad =
      first_where(n, [&](int64_t l) { return (uint64_t)first_idx[l] >= (uint64_t)num_rows; });
  TORCH_CHECK(bad == n, "embcache: index ", bad < n ? first_idx[bad] : 0, " out of range [0, ",
              num_rows, ")");
  // Random rows are memory-latency bound. A chunk of bags goes in runs of at most
  // pass_lookups lookups, each in two loops: find every lookup's slot (the tag sets
  // prefetched kPrefetch lookups ahead), prefetching the value's row (cache or table) as soon
  // as its slot is known, so that a miss's two dependent reads overlap with the other
  // lookups'; then pool, the run's values waiting in cache (kPassBytes of them at most).
  const int64_t* idx = bags.idx;
  const int64_t* off = bags.off;
  const int64_t row_bytes = f.row_bytes();
  const int64_t pass_lookups =
      std::max<int64_t>(kPrefetch, kPassBytes / std::max<int64_t>(row_bytes, 4 * dim));
  std::atomic<int64_t> hits{0};
  std::mutex max_abs_mutex;
  *max_abs = 0.f;
  at::parallel_for(0, bags.count, kGrainBags, [&](int64_t c0, int64_t c1) {
    MaxAbs chunk_max;
    int64_t local_hits = 0;
    for (int64_t b0 = c0, b1 = c0; b0 < c1; b0 = b1) {
      // the longest run of bags from b0 within pass_lookups lookups, at least one bag
      const int64_t* past = std::upper_bound(off + b0 + 1, off + c1 + 1, off[b0] + pass_lookups);
      b1 = std::max(b0 + 1, (int64_t)(past - off) - 1);
      const int64_t l0 = off[b0], l1 = off[b1];
      // slot[l] holds the set of lookup l until its slot is found
      for (int64_t l = l0; l < l1; ++l) slot[l] = (int32_t)cache.set_of(idx[l]);
      for (int64_t l = l0; l < l1; ++l) {
        if (l + kPrefetch < l1) cache.prefetch_set(slot[l + kPrefetch]);
        slot[l] = (int32_t)cache.find_in_set(slot[l], idx[l]);
        cache.prefetch_value(slot[l], dim, w + idx[l] * row_bytes, row_bytes);
      }
      // every bag one lookup (as many lookups as bags is not enough: an empty bag and a bag
      // of two are as many)
      const int64_t nb = b1 - b0;
      const bool one_lookup_per_bag =
          first_where(nb, [&](int64_t i) { return off[b0 + i + 1] - off[b0 + i] != 1; }) == nb;
      with_row_values(f, [&](const auto& stored_values) {
        if (pooling == kMax) {
          local_hits += max_bags(bags, b0, b1, dim, cache, w, row_bytes, slot, out, out_stride,
                                 argmax, argmax_stride, stored_values, chunk_max);
          return;
        }
        auto pool = [&](auto k_dim, auto k_one, auto k_stream) {
          local_hits +=
              pool_bags<decltype(k_dim)::value, decltype(k_one)::value, decltype(k_stream)::value>(
                  bags, b0, b1, dim, cache, w, row_bytes, slot, pooling == kMean, out,
                  out_stride, stored_values, chunk_max);
        };
        auto pool_dim = [&](auto k_dim) {
          const std::true_type yes;
          const std::false_type no;
          if (one_lookup_per_bag)
            stream ? pool(k_dim, yes, yes) : pool(k_dim, yes, no);
          else
            stream ? pool(k_dim, no, yes) : pool(k_dim, no, no);
        };
        dim == 16 ? pool_dim(std::integral_constant<int64_t, 16>())
                  : pool_dim(std::integral_constant<int64_t, 0>());
      });
    }
#if defined(EMBCACHE_SSE)
    if (stream) _mm_sfence();  // the streamed rows ordered before the threads join
#endif
    hits += local_hits;
    const float m = chunk_max.value();
    std::lock_guard<std::mutex> lock(max_abs_mutex);
    *max_abs = std::max(*max_abs, m);
  });
  return hits.load();
}

/// The bags of nf features of `batch` bags each, given by their lengths: where each feature's
/// lookups start (first(f); first(nf) = total), checked (no length is negative, they sum to
/// `total`), and the int64 offsets with the end appended. The offsets where features begin
/// are written here; fill(f) writes the rest of feature f's, so that the thread about to
/// read them writes them, in parallel, and no serial pass over every bag precedes the lookups.
class FeatureOffsets {
 public:
  FeatureOffsets(const at::Tensor& lengths, int64_t nf, int64_t batch, int64_t total)
      : lengths_(lengths.contiguous()), batch_(batch), first_(nf + 1, 0) {
    TORCH_CHECK(lengths.dim() == 1 && lengths.device().is_cpu() &&
                    (lengths.scalar_type() == at::kInt || lengths.scalar_type() == at::kLong),
                "embcache: lengths must be a 1-D int32 or int64 CPU tensor");
    TORCH_CHECK(batch >= 0 && lengths.numel() == nf * batch,
                "embcache: lengths must have features * batch entries");
    AT_DISPATCH_INDEX_TYPES(lengths_.scalar_type(), "FeatureOffsets", [&] {
      const index_t* l = lengths_.data_ptr<index_t>();
      const int64_t n = nf * batch;
      const int64_t b = first_where(n, [l](int64_t i) { return l[i] < 0; });
      TORCH_CHECK(b == n, "embcache: bag ", b, " has negative length ", b < n ? (int64_t)l[b] : 0);
      for (int64_t f = 0; f < nf; ++f)
        first_[f + 1] = std::accumulate(l + f * batch, l + (f + 1) * batch, first_[f]);
    });
    TORCH_CHECK(first_[nf] == total, "embcache: lengths sum to ", first_[nf],
                ", not len(indices)=", total);
    offsets = new_cpu_tensor({nf * batch + 1}, at::kLong);
    for (int64_t f = 0; f <= nf; ++f) offsets.data_ptr<int64_t>()[f * batch] = first_[f];
  }

  int64_t first(int64_t f) const { return first_[f]; }

  void fill(int64_t f) const {
    int64_t* off = offsets.data_ptr<int64_t>() + f * batch_;
    AT_DISPATCH_INDEX_TYPES(lengths_.scalar_type(), "FeatureOffsets::fill", [&] {
      const index_t* l = lengths_.data_ptr<index_t>();
      int64_t o = first_[f];
      for (int64_t b = 1; b < batch_; ++b) {
        o += l[f * batch_ + b - 1];
        off[b] = o;
      }
    });
  }

  at::Tensor offsets;

 private:
  at::Tensor lengths_;
  int64_t batch_;
  std::vector<int64_t> first_;
};

/// All features' pooled embeddings as one [batch, sum of their tables' dims] tensor, the
/// bags' offsets, every lookup's slot (int32, -1 if not cached), per feature the largest
/// |value| its lookups read (float32; multi_update's value bound), and the max-pooled
/// features' argmax (csrc/op_schemas.h); bad input raises, so its errors are empty. Adds
/// each feature's lookups and hits to its table's device_counts. Features run in parallel,
/// costliest first. A stage is ignored: on the CPU none holds anything (stage_misses).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
multi_lookup_forward(at::TensorList state, const at::Tensor& specs, const at::Tensor& indices,
                     const at::Tensor& lengths,
                     const c10::optional<at::Tensor>& per_sample_weights,
                     at::IntArrayRef feature_table, int64_t batch,
                     at::TensorList device_counts, const c10::optional<at::Tensor>& /*staged_slots*/,
                     const c10::optional<at::Tensor>& /*staged_rows*/) {
  const Tables tables = op_tables(state, specs, {}, true, kCpu);
  const std::vector<int64_t*> counts =
      tables_device_counts(device_counts, state, tables.spec.size(), true, kCpu);
  const std::vector<TableSpec>& spec = tables.spec;
  const int64_t nf = (int64_t)feature_table.size();
  const std::vector<int64_t> col = feature_columns(feature_table, spec);
  const std::vector<int64_t> argmax_col =
      argmax_columns(feature_table, spec, per_sample_weights.has_value());
  check_lookups(indices, per_sample_weights, kCpu);
  TORCH_CHECK(argmax_col[nf] == 0 || indices.numel() <= INT32_MAX,
              "embcache: at most 2^31 - 1 lookups per call with max pooling");
  const FeatureOffsets bags_of_feature(lengths, nf, batch, indices.numel());  // valid bags
  const at::Tensor& offsets = bags_of_feature.offsets;
  at::Tensor out = new_cpu_tensor({batch, col[nf]}, at::kFloat);
  // An output too large to stay in cache until it is read goes past the caches, where every
  // row of it starts on 16 bytes (streaming stores take aligned addresses).
  const bool stream = batch * col[nf] * (int64_t)sizeof(float) > kStreamOutputBytes &&
                      ((uintptr_t)out.data_ptr<float>() & 15) == 0 &&
                      std::all_of(col.begin(), col.end(), [](int64_t c) { return c % 4 == 0; });
  std::vector<int64_t> hits(nf);
  at::Tensor slots = new_cpu_tensor({indices.numel()}, at::kInt);
  at::Tensor max_abs = new_cpu_tensor({nf}, at::kFloat);
  at::Tensor argmax = new_cpu_tensor({batch, argmax_col[nf]}, at::kInt);
  const Bags all{indices.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), nf * batch,
                 per_sample_weights ? per_sample_weights->data_ptr<float>() : nullptr};
  std::vector<int64_t> lookups(nf), cost(nf);
  for (int64_t f = 0; f < nf; ++f) {
    lookups[f] = bags_of_feature.first(f + 1) - bags_of_feature.first(f);
    cost[f] = row_work(lookups[f], spec[feature_table[f]].rows);
  }
  for_each_by_cost(cost, [&](int64_t f) {
    bags_of_feature.fill(f);
    const int64_t t = feature_table[f];
    const Bags bags{all.idx, all.off + f * batch, batch, all.psw};
    const TableState& table = tables.state[t];
    hits[f] = lookup_core(spec[t].f, table_cache(spec[t], table), table.weights,
                          spec[t].rows, bags, spec[t].pooling, out.data_ptr<float>() + col[f],
                          col[nf], argmax.data_ptr<int32_t>() + argmax_col[f], argmax_col[nf],
                          slots.data_ptr<int32_t>(), max_abs.data_ptr<float>() + f, stream);
  });
  for (int64_t f = 0; f < nf && !counts.empty(); ++f) {
    counts[feature_table[f]][kDeviceLookups] += lookups[f];
    counts[feature_table[f]][kDeviceHits] += hits[f];
  }
  return {out, offsets, slots, max_abs, argmax, at::empty({0}, at::kLong)};
}

}  // namespace

TORCH_LIBRARY_IMPL(embcache, CPU, m) { m.impl("multi_lookup_forward", &multi_lookup_forward); }

}  // namespace cpu
}  // namespace embcache
