// CPU kernels of the embedding cache (docs/contract.md §2-4) and their registration as torch ops.
//
// The ops are stateless functions over the state tensors that the Python module owns;
// ops that change state take them as mutable arguments and change nothing before every
// check has passed. All row arithmetic comes from embcache/rowquant.h, shared with CUDA.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__SSE4_1__)
#include <smmintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <type_traits>
#include <vector>

#include "../op_schemas.h"
#include "embcache/rowquant.h"

namespace embcache {
namespace {

enum Optimizer : int64_t { kSGD = 0, kRowwiseAdagrad = 1, kAdagrad = 2 };

// Work per parallel chunk: small batches run on one thread, since an OpenMP fork costs
// more than a few thousand row operations (and much more on an oversubscribed machine).
constexpr int64_t kGrainBags = 4096;
constexpr int64_t kGrainRows = 2048;
constexpr int64_t kGrainSets = 1024;
// The row loops: inlined into their callers' loops, so that their state stays in registers.
#define EMBCACHE_ALWAYS_INLINE inline __attribute__((always_inline))
// How many random rows ahead to prefetch.
constexpr int64_t kPrefetch = 16;

RowFormat make_format(int64_t bits, int64_t dim, bool qparams_fp16) {
  TORCH_CHECK(bits == 32 || bits == 16 || bits == 8 || bits == 4 || bits == 2,
              "embcache: unsupported number of bits ", bits);
  TORCH_CHECK(dim > 0, "embcache: embedding dim must be positive, got ", dim);
  return RowFormat{(int)bits, (int)dim, qparams_fp16};
}

void check_tensor(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype, "embcache: ", what, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "embcache: ", what,
              " must be a contiguous CPU tensor");
}

void check_table(const at::Tensor& weights, const RowFormat& f) {
  check_tensor(weights, at::kByte, "weights");
  TORCH_CHECK(weights.dim() == 2 && weights.size(1) == f.row_bytes(),
              "embcache: weights must be [rows, ", f.row_bytes(), "] bytes, got ",
              weights.sizes());
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

/// The most ways a set may have (embcache.config.MAX_ASSOCIATIVITY).
constexpr int64_t kMaxWays = 32;

struct Cache {
  int32_t* tags;
  float* rows;
  int64_t num_sets;
  int64_t ways;

  int64_t set_of(int64_t row) const { return num_sets == 0 ? -1 : set_of_row(row, num_sets); }

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

  /// The slot that holds `row`, or -1.
  int64_t find(int64_t row) const { return find_in_set(set_of(row), row); }

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

Cache make_cache(const at::Tensor& tags, const at::Tensor& rows, int64_t num_sets,
                 int64_t ways, int64_t dim) {
  check_tensor(tags, at::kInt, "cache_tags");
  check_tensor(rows, at::kFloat, "cache_rows");
  TORCH_CHECK(num_sets >= 0 && ways >= 1 && ways <= kMaxWays &&
                  tags.numel() == num_sets * ways && rows.numel() == num_sets * ways * dim,
              "embcache: cache tensors do not match ", num_sets, " sets x ", ways, " ways");
  return Cache{tags.data_ptr<int32_t>(), rows.data_ptr<float>(), num_sets, ways};
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

/// Lookups: int64 indices, and optionally one float32 weight per index.
void check_lookups(const at::Tensor& indices, const c10::optional<at::Tensor>& psw) {
  check_tensor(indices, at::kLong, "indices");
  TORCH_CHECK(indices.dim() == 1, "embcache: indices must be 1-D");
  if (psw.has_value()) {
    check_tensor(*psw, at::kFloat, "per_sample_weights");
    TORCH_CHECK(psw->numel() == indices.numel(),
                "embcache: per_sample_weights must have one weight per index");
  }
}

/// Bag b covers lookups [offsets[b], offsets[b+1]).
void check_bags(const at::Tensor& indices, const at::Tensor& offsets,
                const c10::optional<at::Tensor>& psw) {
  check_lookups(indices, psw);
  check_tensor(offsets, at::kLong, "offsets");
  TORCH_CHECK(offsets.dim() == 1 && offsets.numel() >= 1,
              "embcache: offsets must be 1-D, with the end appended");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t nb = offsets.numel() - 1;
  TORCH_CHECK(off[0] == 0 && off[nb] == indices.numel(),
              "embcache: offsets must start at 0 and end at len(indices)");
  const int64_t b = first_where(nb, [off](int64_t b) { return off[b] > off[b + 1]; });
  TORCH_CHECK(b == nb, "embcache: offsets decrease at bag ", b);
}

at::Tensor quantize_rows(const at::Tensor& values, const at::Tensor& row_ids, int64_t bits,
                         bool qparams_fp16, bool stochastic, int64_t seed, int64_t step,
                         int64_t table) {
  check_tensor(values, at::kFloat, "values");
  check_tensor(row_ids, at::kLong, "row_ids");
  TORCH_CHECK(values.dim() == 2 && row_ids.numel() == values.size(0),
              "embcache: values must be [rows, dim] with one row id per row");
  const RowFormat f = make_format(bits, values.size(1), qparams_fp16);
  const int64_t n = values.size(0);
  const float* x = values.data_ptr<float>();
  const int64_t* ids = row_ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(row_is_storable(f, x + r * f.dim, stochastic), "embcache: row ", ids[r],
                " cannot be stored in ", bits, " bits: non-finite or out of range");
  at::Tensor out = at::empty({n, (int64_t)f.row_bytes()}, values.options().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  const RoundingStream s{(uint64_t)seed, (uint32_t)step, (uint32_t)table};
  at::parallel_for(0, n, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(f, x + r * f.dim, stochastic, s, ids[r], o + r * f.row_bytes());
  });
  return out;
}

at::Tensor dequantize_rows(const at::Tensor& weights, int64_t bits, int64_t dim,
                           bool qparams_fp16) {
  const RowFormat f = make_format(bits, dim, qparams_fp16);
  check_table(weights, f);
  const int64_t n = weights.size(0);
  at::Tensor out = at::empty({n, dim}, weights.options().dtype(at::kFloat));
  const uint8_t* w = weights.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequantize_row(f, w + r * f.row_bytes(), o + r * dim);
  });
  return out;
}

/// Sorts keys (a value below 2^bits in the high 32 bits, a position in the low 32) by
/// value, stably: an LSD radix sort over the value's bits only, 8 bits a pass (positions are
/// already ascending, so they stay ascending among equal values).
void radix_sort_high(std::vector<uint64_t>& keys, int bits, std::vector<uint64_t>& tmp) {
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
std::vector<int64_t> sort_into_runs(std::vector<uint64_t>& keys, int bits,
                                    std::vector<uint64_t>& tmp) {
  radix_sort_high(keys, bits, tmp);
  std::vector<int64_t> runs;
  for (size_t k = 0; k < keys.size(); ++k)
    if (k == 0 || (keys[k] >> 32) != (keys[k - 1] >> 32)) runs.push_back((int64_t)k);
  runs.push_back((int64_t)keys.size());
  return runs;
}

/// The number of bits needed for values below n.
int bits_for(int64_t n) {
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

Bags bags_of(const at::Tensor& indices, const at::Tensor& offsets,
             const c10::optional<at::Tensor>& psw) {
  check_bags(indices, offsets, psw);
  return Bags{indices.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), offsets.numel() - 1,
              psw ? psw->data_ptr<float>() : nullptr};
}

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

/// The values of a float32 row (a cache row, or a row of an fp32 table).
struct F32Values {
  const uint8_t* p;
  float at(int j) const { return load_f32(p + 4 * j); }
#if defined(EMBCACHE_SSE)
  __m128 at4(int j) const { return _mm_loadu_ps((const float*)(p + 4 * j)); }
#endif
};

/// The values of an int8 row, code * scale + bias: a multiply and an add, as dequantize_row.
struct Int8Values {
  const uint8_t* p;
  float scale, bias;
  float at(int j) const { return (float)p[j] * scale + bias; }
#if defined(EMBCACHE_SSE)
  __m128 at4(int j) const {
    int32_t codes;
    memcpy(&codes, p + j, 4);
    const __m128 x = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(codes)));
    return _mm_add_ps(_mm_mul_ps(x, _mm_set1_ps(scale)), _mm_set1_ps(bias));
  }
#endif
};

/// add_values with `first` known at compile time.
template <bool kFirst, typename Values>
EMBCACHE_ALWAYS_INLINE void add_term(int dim, const Values& v, float s, float* acc,
                                     MaxAbs& max_abs) {
  int j = 0;
#if defined(EMBCACHE_SSE)
  const __m128 s4 = _mm_set1_ps(s);
  __m128 row_max = _mm_setzero_ps();  // the running max waits on one op per row, not four
  for (; j + 4 <= dim; j += 4) {
    const __m128 x = v.at4(j);
    row_max = MaxAbs::max_abs4(x, row_max);
    const __m128 a = kFirst ? _mm_setzero_ps() : _mm_loadu_ps(acc + j);
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
/// lanes at a time where SSE is there (the same roundings as the scalar loop).
template <typename Values>
EMBCACHE_ALWAYS_INLINE void add_values(int dim, const Values& v, const float* w, bool first,
                                       float* acc, MaxAbs& max_abs) {
  const float s = w ? *w : 1.f;  // s * x == x exactly for s == 1
  if (first)
    add_term<true>(dim, v, s, acc, max_abs);
  else
    add_term<false>(dim, v, s, acc, max_abs);
}

/// Calls fn(values_of) once, with values_of(row) the Values of a stored row computed as
/// dequantize_row computes them: fp32 and int8 rows straight from the table, other formats
/// through `buf` (dim floats). The format's branch is taken here, outside fn's loops.
template <typename Fn>
inline void with_stored_values(const RowFormat& f, float* buf, const Fn& fn) {
  if (f.bits == 32) {
    fn([](const uint8_t* row) { return F32Values{row}; });
  } else if (f.bits == 8) {
    fn([f](const uint8_t* row) {
      Int8Values v{row, 0.f, 0.f};
      load_qparams(f, row, &v.scale, &v.bias);
      return v;
    });
  } else {
    fn([f, buf](const uint8_t* row) {
      dequantize_row(f, row, buf);
      return F32Values{(const uint8_t*)buf};
    });
  }
}

/// lookup_core's pooling pass over bags [b0, b1); returns the number of cached lookups.
/// Instantiated for rows of kDim floats (0: `dim`, known at run time only; 16 is DLRM's
/// Criteo dim) and for chunks whose every bag has one lookup (Criteo's features), so that the
/// loop over lookups is short: with its rows prefetched, it is bound by its instruction count
/// as much as by memory, so a runtime dim or per-bag bookkeeping shows in its time.
template <int64_t kDim, bool kOneLookupPerBag, typename StoredValues>
int64_t pool_bags(const Bags& bags, int64_t b0, int64_t b1, int64_t dim, const Cache& cache,
                  const uint8_t* w, int64_t row_bytes, const int32_t* slot, bool mean, float* out,
                  int64_t out_stride, const StoredValues& stored_values, MaxAbs& max_abs) {
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
      add_values(dim, F32Values{v}, weight, first, acc, max_abs);
      ++hits;
    } else {
      add_values(dim, stored_values(w + idx[l] * row_bytes), weight, first, acc, max_abs);
    }
  };
  if (kOneLookupPerBag) {  // and the mean of one term is the term
    for (int64_t b = b0, l = off[b0]; b < b1; ++b, ++l) add_lookup(l, true, out + b * out_stride);
    return hits;
  }
  for (int64_t b = b0; b < b1; ++b) {
    float* acc = out + b * out_stride;
    const int64_t l0 = off[b], l1 = off[b + 1];
    if (l0 == l1) std::fill_n(acc, dim, 0.f);
    for (int64_t l = l0; l < l1; ++l) add_lookup(l, l == l0, acc);
    if (mean && l1 > l0)
      for (int64_t j = 0; j < dim; ++j) acc[j] /= (float)(l1 - l0);
  }
  return hits;
}

/// Pooled lookups (docs/contract.md §4 step 1) into out[b * out_stride + j], the slot of every
/// lookup's row (-1 if not cached) into slot[l] for the bags' lookups l, and the largest
/// |value| the lookups read into *max_abs (0 if none); returns the number of lookups that
/// found their row cached. Throws before writing if an index is out of range.
int64_t lookup_core(const RowFormat& f, const Cache& cache, const uint8_t* w, int64_t num_rows,
                    const Bags& bags, bool mean, float* out, int64_t out_stride, int32_t* slot,
                    float* max_abs) {
  const int64_t dim = f.dim;
  const int64_t* first_idx = bags.idx + bags.first();
  const int64_t n = bags.end() - bags.first();
  const int64_t bad =
      first_where(n, [&](int64_t l) { return (uint64_t)first_idx[l] >= (uint64_t)num_rows; });
  TORCH_CHECK(bad == n, "embcache: index ", bad < n ? first_idx[bad] : 0, " out of range [0, ",
              num_rows, ")");
  // Random rows are memory-latency bound, so a chunk of bags goes in two passes that keep
  // kPrefetch misses in flight: find every lookup's slot (prefetching the tags ahead), then
  // pool (prefetching ahead the cache row or the table row, whichever holds the value).
  const int64_t* idx = bags.idx;
  const int64_t* off = bags.off;
  for (int64_t l = bags.first(); l < bags.end(); ++l) slot[l] = (int32_t)cache.set_of(idx[l]);
  std::atomic<int64_t> hits{0};
  std::mutex max_abs_mutex;
  *max_abs = 0.f;
  at::parallel_for(0, bags.count, kGrainBags, [&](int64_t b0, int64_t b1) {
    // slot[l] holds the set of lookup l until its slot is found
    for (int64_t l = off[b0]; l < off[b1]; ++l) {
      if (l + kPrefetch < off[b1]) cache.prefetch_set(slot[l + kPrefetch]);
      slot[l] = (int32_t)cache.find_in_set(slot[l], idx[l]);
    }
    std::vector<float> buf(dim);
    MaxAbs chunk_max;
    int64_t local_hits = 0;
    const bool one_lookup_per_bag = off[b1] - off[b0] == b1 - b0;
    with_stored_values(f, buf.data(), [&](const auto& stored_values) {
      auto pool = [&](auto k_dim, auto k_one) {
        local_hits = pool_bags<decltype(k_dim)::value, decltype(k_one)::value>(
            bags, b0, b1, dim, cache, w, f.row_bytes(), slot, mean, out, out_stride,
            stored_values, chunk_max);
      };
      auto pool_dim = [&](auto k_dim) {
        one_lookup_per_bag ? pool(k_dim, std::true_type()) : pool(k_dim, std::false_type());
      };
      dim == 16 ? pool_dim(std::integral_constant<int64_t, 16>())
                : pool_dim(std::integral_constant<int64_t, 0>());
    });
    hits += local_hits;
    const float m = chunk_max.value();
    std::lock_guard<std::mutex> lock(max_abs_mutex);
    *max_abs = std::max(*max_abs, m);
  });
  return hits.load();
}

std::tuple<at::Tensor, at::Tensor> lookup_forward(
    const at::Tensor& weights, const at::Tensor& cache_tags, const at::Tensor& cache_rows,
    const at::Tensor& indices, const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights, int64_t bits, int64_t dim,
    bool qparams_fp16, int64_t num_sets, int64_t ways, bool mean) {
  const RowFormat f = make_format(bits, dim, qparams_fp16);
  check_table(weights, f);
  const Cache cache = make_cache(cache_tags, cache_rows, num_sets, ways, dim);
  const Bags bags = bags_of(indices, offsets, per_sample_weights);
  at::Tensor out = at::empty({bags.count, dim}, cache_rows.options());
  std::vector<int32_t> slots(indices.numel());
  float max_abs;
  const int64_t hits = lookup_core(f, cache, weights.data_ptr<uint8_t>(), weights.size(0), bags,
                                   mean, out.data_ptr<float>(), dim, slots.data(), &max_abs);
  return {out, at::scalar_tensor(hits, at::kLong)};
}

/// An uninitialized CPU tensor, made without a trip through the dispatcher (at::empty
/// costs a few microseconds).
at::Tensor new_cpu_tensor(at::IntArrayRef size, at::ScalarType dtype) {
  return at::Tensor(at::detail::empty_cpu(size, dtype));
}

/// The lookups of some bags grouped by row (docs/contract.md §4 step 2): (row << 32 | position) keys
/// sorted by row, positions ascending within a row; run r, one row's lookups, is
/// keys[starts[r] .. starts[r + 1]).
struct RowRuns {
  std::vector<uint64_t> keys;
  std::vector<int64_t> starts;
  std::vector<int64_t> bag_of;  // the bag of each lookup, by position - bags.first()

  int64_t unique_rows() const { return (int64_t)starts.size() - 1; }
};

RowRuns group_by_row(const Bags& bags) {
  const int64_t* idx = bags.idx;
  const int64_t* off = bags.off;
  const int64_t base = bags.first(), n = bags.end() - base;
  TORCH_CHECK(bags.end() < (int64_t(1) << 32), "embcache: at most 2^32 lookups per call");
  RowRuns runs;
  runs.bag_of.resize(n);
  for (int64_t b = 0; b < bags.count; ++b)
    for (int64_t l = off[b]; l < off[b + 1]; ++l) runs.bag_of[l - base] = b;
  // Sort (row, position) pairs packed in one key: rows ascending, positions in order.
  runs.keys.resize(n);
  int64_t max_row = 0;
  for (int64_t l = base; l < bags.end(); ++l) {
    TORCH_CHECK(idx[l] >= 0 && idx[l] < (int64_t(1) << 31), "embcache: index ", idx[l],
                " out of range");
    runs.keys[l - base] = ((uint64_t)idx[l] << 32) | (uint64_t)l;
    max_row = std::max(max_row, idx[l]);
  }
  std::vector<uint64_t> scratch;
  runs.starts = sort_into_runs(runs.keys, bits_for(max_row + 1), scratch);
  return runs;
}

/// The deduplicated gradient of the runs from grad_output[b * g_stride + j]: per unique row
/// (ascending) its id into rows, how often it occurs in the bags into occ, its contributions
/// summed in lookup order into grads (dim floats a row) and, given the forward's slot of
/// every lookup (lookup_slot, or nullptr), its slot into slots.
void sum_runs(const RowRuns& runs, const Bags& bags, const float* g, int64_t g_stride,
              int64_t dim, bool mean, const int32_t* lookup_slot, int64_t* rows, float* grads,
              int64_t* occ, int64_t* slots) {
  const int64_t* off = bags.off;
  const int64_t base = bags.first(), n = bags.end() - base;
  const std::vector<uint64_t>& keys = runs.keys;
  const std::vector<int64_t>& starts = runs.starts;
  auto position = [&](int64_t k) { return (int64_t)(keys[k] & 0xffffffffu); };
  at::parallel_for(0, runs.unique_rows(), kGrainRows, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      rows[u] = (int64_t)(keys[starts[u]] >> 32);
      occ[u] = starts[u + 1] - starts[u];
      if (lookup_slot) slots[u] = lookup_slot[position(starts[u])];
      float* acc = grads + u * dim;
      std::fill_n(acc, dim, 0.f);  // here, not in a pass of its own: the row is written next
      for (int64_t k = starts[u]; k < starts[u + 1]; ++k) {
        // Bags come in row order, i.e. at random: fetch the gradient kPrefetch lookups ahead.
        if (k + kPrefetch < n)
          prefetch_bytes(g + runs.bag_of[position(k + kPrefetch) - base] * g_stride,
                         dim * sizeof(float));
        const int64_t l = position(k), b = runs.bag_of[l - base];
        const float* gb = g + b * g_stride;
        if (bags.psw) {
          for (int64_t j = 0; j < dim; ++j) acc[j] += gb[j] * bags.psw[l];
        } else if (mean) {
          const float len = (float)(off[b + 1] - off[b]);
          for (int64_t j = 0; j < dim; ++j) acc[j] += gb[j] / len;
        } else {
          for (int64_t j = 0; j < dim; ++j) acc[j] += gb[j];
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dedup_backward(
    const at::Tensor& indices, const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights, const at::Tensor& grad_output,
    bool mean) {
  const Bags bags = bags_of(indices, offsets, per_sample_weights);
  check_tensor(grad_output, at::kFloat, "grad_output");
  TORCH_CHECK(grad_output.dim() == 2 && grad_output.size(0) == bags.count,
              "embcache: grad_output must be [bags, dim]");
  const int64_t dim = grad_output.size(1);
  const RowRuns runs = group_by_row(bags);
  const int64_t nu = runs.unique_rows();
  at::Tensor rows = new_cpu_tensor({nu}, at::kLong);
  at::Tensor grads = new_cpu_tensor({nu, dim}, at::kFloat);
  at::Tensor occ = new_cpu_tensor({nu}, at::kLong);
  sum_runs(runs, bags, grad_output.data_ptr<float>(), dim, dim, mean, nullptr,
           rows.data_ptr<int64_t>(), grads.data_ptr<float>(), occ.data_ptr<int64_t>(), nullptr);
  return {rows, grads, occ};
}

/// The optimizer step of one row: new value and new state from the fetched value v and
/// the gradient g (docs/contract.md §4 "Optimizers"). Writes only to `out` and `state_out`.
void optimizer_row(int64_t opt, float lr, float eps, int64_t dim, const float* v,
                   const float* g, const float* state, float* out, float* state_out) {
  if (opt == kSGD) {
    for (int64_t j = 0; j < dim; ++j) out[j] = v[j] - lr * g[j];
  } else if (opt == kRowwiseAdagrad) {
    float sum_sq = 0.f;
    for (int64_t j = 0; j < dim; ++j) sum_sq += g[j] * g[j];
    const float acc = state[0] + sum_sq / (float)dim;
    const float step = lr / (sqrtf(acc) + eps);
    for (int64_t j = 0; j < dim; ++j) out[j] = v[j] - step * g[j];
    state_out[0] = acc;
  } else {
    for (int64_t j = 0; j < dim; ++j) {
      const float acc = state[j] + g[j] * g[j];
      out[j] = v[j] - (lr / (sqrtf(acc) + eps)) * g[j];
      state_out[j] = acc;
    }
  }
}

int64_t optimizer_state_width(int64_t opt, int64_t dim) {
  return opt == kSGD ? 0 : opt == kRowwiseAdagrad ? 1 : dim;
}

/// Stable sort for the short lists of one set (ways <= 32, a few candidates): no allocation.
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

/// A row's priority once the step's counts are in (docs/contract.md §4): its LFU count, or the step (LRU).
/// cache_priority keeps this value for every resident (0 for an empty slot).
struct RowPriority {
  bool lfu;
  const int32_t* counts;
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

/// The insert/evict/bypass rule of docs/contract.md §4 for one set, given its non-resident updated rows
/// `cand` (reordered here by priority descending, ties by smaller row, i.e. original order)
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

/// One table's update inputs, checked: the unique rows (ascending), their gradients and
/// the state their new values are computed from (docs/contract.md §4 step 3, "Optimizers").
struct RowUpdate {
  RowFormat f;
  Cache cache;
  const uint8_t* w;
  int64_t num_rows;
  const int64_t* rows;
  int64_t nu;
  const float* g;
  float* st;
  int64_t sw;
  int64_t optimizer;
  float lr, eps;

  /// Row u's new value into out and new optimizer state into state_out, from its value in
  /// `slot` (or in the table if slot < 0; `buf` holds dim floats). out and state_out may be
  /// where the value and state are read from.
  void compute(int64_t u, int64_t slot, float* buf, float* out, float* state_out) const {
    const float* v = buf;
    if (slot >= 0)
      v = cache.rows + slot * f.dim;
    else
      dequantize_row(f, w + rows[u] * f.row_bytes(), buf);
    optimizer_row(optimizer, lr, eps, f.dim, v, g + u * f.dim, st + rows[u] * sw, out, state_out);
  }

  /// Prefetches what compute(u, slot) reads.
  void prefetch_sources(int64_t u, int64_t slot) const {
    cache.prefetch_value(slot, f.dim, w + rows[u] * f.row_bytes(), f.row_bytes());
    prefetch_bytes(st + rows[u] * sw, sw * sizeof(float));
  }
};

/// The update of one table's nu unique rows `rows` (ascending) with gradients g (nu x dim).
RowUpdate make_row_update(const at::Tensor& weights, const at::Tensor& cache_tags,
                          const at::Tensor& cache_rows, const at::Tensor& optimizer_state,
                          const int64_t* rows, int64_t nu, const float* g, int64_t dim,
                          int64_t bits, bool qparams_fp16, int64_t optimizer, double lr,
                          double eps, int64_t num_sets, int64_t ways) {
  const RowFormat f = make_format(bits, dim, qparams_fp16);
  check_table(weights, f);
  const Cache cache = make_cache(cache_tags, cache_rows, num_sets, ways, dim);
  check_tensor(optimizer_state, at::kFloat, "optimizer_state");
  TORCH_CHECK(optimizer >= kSGD && optimizer <= kAdagrad, "embcache: unknown optimizer ",
              optimizer);
  const int64_t num_rows = weights.size(0);
  const int64_t sw = optimizer_state_width(optimizer, dim);
  TORCH_CHECK(optimizer_state.numel() == num_rows * sw, "embcache: optimizer state size");
  TORCH_CHECK(first_where(nu, [&](int64_t u) {
                return (uint64_t)rows[u] >= (uint64_t)num_rows || (u > 0 && rows[u] <= rows[u - 1]);
              }) == nu,
              "embcache: unique rows must be ascending and in range");
  return RowUpdate{f,  cache, weights.data_ptr<uint8_t>(), num_rows, rows, nu,
                   g, optimizer_state.data_ptr<float>(), sw, optimizer,
                   (float)lr, (float)eps};
}

/// make_row_update of the rows and gradients of a one-table op, checked.
RowUpdate make_row_update(const at::Tensor& weights, const at::Tensor& cache_tags,
                          const at::Tensor& cache_rows, const at::Tensor& optimizer_state,
                          const at::Tensor& unique_rows, const at::Tensor& grads, int64_t bits,
                          bool qparams_fp16, int64_t optimizer, double lr, double eps,
                          int64_t num_sets, int64_t ways) {
  check_tensor(grads, at::kFloat, "grads");
  TORCH_CHECK(grads.dim() == 2, "embcache: grads must be [unique rows, dim]");
  check_tensor(unique_rows, at::kLong, "unique_rows");
  TORCH_CHECK(grads.size(0) == unique_rows.numel(), "embcache: one gradient row per unique row");
  return make_row_update(weights, cache_tags, cache_rows, optimizer_state,
                         unique_rows.data_ptr<int64_t>(), unique_rows.numel(),
                         grads.data_ptr<float>(), grads.size(1), bits, qparams_fp16, optimizer,
                         lr, eps, num_sets, ways);
}

/// Each unique row's slot (-1 if not cached) into sl[0..nu): the caller's hint if given
/// (hint[u]: the slots a forward found over the same cache state), else found in the sets.
void find_slots(const RowUpdate& up, const int64_t* hint, int64_t* sl) {
  if (hint) {
    const int64_t slots = up.cache.num_sets * up.cache.ways;
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

/// Runs each(u, out, state_out) on every unique row's new value and state, computed in
/// scratch buffers (the values prefetched kPrefetch rows ahead); returns the smallest row
/// whose new value cannot be stored in the table's format (non-finite, or beyond its
/// range), or -1.
template <typename Each>
int64_t for_each_new_value(const RowUpdate& up, const int64_t* sl, bool stochastic,
                           const Each& each) {
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
      each(u, out.data(), state.data());
    }
  });
  const int64_t bad = first_bad.load();
  return bad == std::numeric_limits<int64_t>::max() ? -1 : bad;
}

/// First half of a training step's update (docs/contract.md §4 step 3), changing nothing: for each
/// unique row, its slot (-1 if not cached) and the optimizer's new value and state from
/// the fetched value. Also returns the smallest row whose new value cannot be stored in
/// the table's format (non-finite, or beyond its range), or -1. `slot_hint`, if given,
/// holds each row's slot as found by a forward over the same cache state (the caller
/// vouches that the cache has not changed since); it saves searching the sets again.
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> update_prepare(
    const at::Tensor& weights, const at::Tensor& cache_tags, const at::Tensor& cache_rows,
    const at::Tensor& optimizer_state, const at::Tensor& unique_rows, const at::Tensor& grads,
    int64_t bits, bool qparams_fp16, bool stochastic, int64_t optimizer, double lr, double eps,
    int64_t num_sets, int64_t ways, const c10::optional<at::Tensor>& slot_hint) {
  const RowUpdate up = make_row_update(weights, cache_tags, cache_rows, optimizer_state,
                                       unique_rows, grads, bits, qparams_fp16, optimizer, lr,
                                       eps, num_sets, ways);
  const int64_t dim = up.f.dim, sw = up.sw;
  at::Tensor fresh = at::empty({up.nu, dim}, grads.options());
  at::Tensor fresh_state = at::empty({up.nu, sw}, grads.options());
  at::Tensor slots = at::empty({up.nu}, unique_rows.options());
  float* fr = fresh.data_ptr<float>();
  float* fs = fresh_state.data_ptr<float>();
  const int64_t* hint = nullptr;
  if (slot_hint.has_value()) {
    check_tensor(*slot_hint, at::kLong, "slot_hint");
    TORCH_CHECK(slot_hint->numel() == up.nu, "embcache: slot_hint must hold one slot per row");
    hint = slot_hint->data_ptr<int64_t>();
  }
  find_slots(up, hint, slots.data_ptr<int64_t>());
  const int64_t bad = for_each_new_value(
      up, slots.data_ptr<int64_t>(), stochastic, [&](int64_t u, const float* out, const float* st) {
        std::copy_n(out, dim, fr + u * dim);
        std::copy_n(st, sw, fs + u * sw);
      });
  return {fresh, fresh_state, slots, bad};
}

/// Whether every new value of an SGD update is storable, judged from the gradients and a
/// bound on the rows' current values (|v| <= value_bound) alone; false when that cannot
/// tell, or a gradient is not finite. |v - lr * g| <= (|v| + |lr| max|g|) (1 + 2^-24), and
/// the margins below also cover rows read back after rounding (within 2^-11 of their value).
bool surely_storable(const RowFormat& f, const float* g, int64_t n, double lr,
                     double value_bound) {
  if (!(value_bound >= 0.0)) return false;
  // max |g| over the bits: |g| orders as its bits do, and inf or NaN bits are the largest
  // (an integer max the compiler vectorizes; a float max over n values would be a chain)
  uint32_t max_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = float_bits(g[i]) & 0x7fffffffu;
    max_bits = a > max_bits ? a : max_bits;
  }
  if (max_bits >= 0x7f800000u) return false;
  const float gmax = bits_float(max_bits);
  const double m = 1.01 * (1.01 * value_bound + std::fabs(lr) * (double)gmax);
  if (f.bits == 16) return m <= 65000.0;  // binary16 keeps |x| <= 65504 finite
  // binary16 qparams: |min| and (max - min) / q_max stay finite for |x| < 30000
  if (f.is_int() && f.qparams_fp16) return m < 30000.0;
  return m < 1e37;  // fp32 values, and fp32 qparams whose range max - min stays finite
}

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

/// [unique hits, unique misses, insertions, evictions, bypasses] of one table's update (the
/// order of its counters kUniqueHits to kBypasses).
using CommitCounts = std::array<int64_t, kFlushed - kUniqueHits>;

/// Writes one table's update (docs/contract.md §4 step 3): LFU counts (and, given fresh_state, the
/// optimizer state) first; then per set, updated residents stay, candidates enter by
/// strictly higher priority, the rest bypass into the table; then the new values.
/// value_of(u, out, scratch) writes row u's new value into out (a scratch row, or its cache
/// slot; scratch holds dim floats), once per row: for a resident evicted by this update,
/// before its slot is reused.
///
/// cache_priority holds each slot's priority: for LRU the step that last updated its row,
/// for LFU a copy of its row's count (so that choosing a victim reads one set's slots, not
/// the counts of 32 random rows). cache_set_floor holds, per set, a lower bound of its
/// slots' priorities (kEmpty if a way is empty, or unknown): when no candidate of a set beats
/// it, they all bypass without the set's tags and priorities being read. Priorities only
/// rise between flushes, so a bound stays a bound; the rule makes it exact whenever it runs
/// on a set. Returns [unique hits, unique misses, insertions, evictions, bypasses].
///
/// The work goes in four passes so that random memory is touched in a prefetchable order:
/// by row, counts and every destination but those of candidates that beat their set's floor;
/// by set, the rule for those (a few percent of the rows once the cache is warm); by evicted
/// resident, its write-back (its slot and table row are cold lines, prefetched in a pass of
/// their own so that they do not stall the rule); by row, the new values.
template <typename ValueOf, typename PrefetchSources>
CommitCounts commit_core(const RowUpdate& up, uint8_t* w, int32_t* prio, int32_t* floor,
                         int32_t* cnt, const float* fresh_state, const int64_t* slot_of,
                         const int64_t* occ, bool stochastic, bool lfu, int64_t seed,
                         int64_t step, int64_t table, const ValueOf& value_of,
                         const PrefetchSources& prefetch_sources) {
  const RowFormat& f = up.f;
  const Cache& cache = up.cache;
  const int64_t dim = f.dim, nu = up.nu, sw = up.sw, ways = cache.ways;
  const int64_t* rows = up.rows;
  float* st = up.st;

  // Pass 1, by row (random lines prefetched kPrefetch rows ahead): LFU counts and prepared
  // optimizer state; each row's priority once its count is in; updated residents stay in
  // their slots with that priority; a candidate that does not beat its set's floor bypasses
  // (it could enter no way, whatever the other candidates of its set do); the others contend
  // for their sets in pass 2.
  const RoundingStream stream{(uint64_t)seed, (uint32_t)step, (uint32_t)table};
  auto store = [&](int64_t row, const float* x, const float* drawn) {
    quantize_row(f, x, stochastic, stream, row, w + row * f.row_bytes(), drawn);
  };
  std::vector<int32_t> row_prio(nu);
  std::vector<int64_t> dest(nu, kToTable);
  std::vector<uint64_t> contenders;  // (set, u) packed, u ascending
  int64_t hits = 0, bypass = 0;
  for (int64_t u = 0; u < nu; ++u) {
    if (u + kPrefetch < nu) {
      const int64_t ahead = u + kPrefetch;
      if (fresh_state) prefetch_bytes(st + rows[ahead] * sw, sw * sizeof(float), true);
      if (lfu) __builtin_prefetch(cnt + rows[ahead], 1);
      if (slot_of[ahead] >= 0) __builtin_prefetch(prio + slot_of[ahead], 1);
    }
    if (fresh_state) std::copy_n(fresh_state + u * sw, sw, st + rows[u] * sw);
    if (lfu) {
      const int64_t c = (int64_t)cnt[rows[u]] + occ[u];
      cnt[rows[u]] = (int32_t)std::min<int64_t>(c, std::numeric_limits<int32_t>::max());
    }
    row_prio[u] = RowPriority{lfu, cnt, step}(rows[u]);
    if (slot_of[u] >= 0) {
      dest[u] = slot_of[u];
      prio[slot_of[u]] = row_prio[u];
      ++hits;
    } else if (const int64_t set = cache.set_of(rows[u]); set >= 0 && row_prio[u] > floor[set]) {
      contenders.push_back(((uint64_t)set << 32) | (uint64_t)u);
    } else {
      ++bypass;
    }
  }

  // Pass 2, by set: the set rule for the contenders, each set's floor made exact.
  std::vector<uint64_t> tmp;
  // group g: contenders[starts[g] .. starts[g + 1]), one set
  const std::vector<int64_t> starts = sort_into_runs(contenders, bits_for(cache.num_sets), tmp);
  const int64_t ngroups = (int64_t)starts.size() - 1;
  auto set_of_group = [&](int64_t gi) { return (int64_t)(contenders[starts[gi]] >> 32); };
  auto prefetch_set = [&](int64_t gi) {
    prefetch_bytes(cache.tags + set_of_group(gi) * ways, ways * sizeof(int32_t), true);
    prefetch_bytes(prio + set_of_group(gi) * ways, ways * sizeof(int32_t), true);
  };
  constexpr int64_t kGroupsAhead = 8;
  std::atomic<int64_t> ins{0}, rule_bypass{0};
  std::vector<Eviction> evicted;
  std::mutex evicted_mutex;
  at::parallel_for(0, ngroups, kGrainSets, [&](int64_t g0, int64_t g1) {
    std::vector<int64_t> cand;
    std::vector<int32_t> slot_prio(ways);
    std::vector<Eviction> chunk_evicted;
    int64_t n_ins = 0, n_bypass = 0;
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
          [&](int64_t) { ++n_bypass; });
      int32_t lowest = slot_priority(cache.tags, prio, base);
      for (int64_t way = 1; way < ways; ++way)
        lowest = std::min(lowest, slot_priority(cache.tags, prio, base + way));
      floor[set] = lowest;
    }
    ins += n_ins;
    rule_bypass += n_bypass;
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
      store(ev.row, x, drawn ? &drawn[16 * (e - e0)] : nullptr);
    }
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
        store(rows[u], value.data(), drawn ? &drawn[16 * next] : nullptr);
        ++next;
      }
    }
  });
  return {hits, nu - hits, ins.load(), ne, bypass + rule_bypass.load()};
}

struct CommitState {
  uint8_t* w;
  int32_t *prio, *floor, *counts;
};

CommitState check_commit_state(const RowUpdate& up, at::Tensor& weights,
                               at::Tensor& cache_priority, at::Tensor& cache_set_floor,
                               at::Tensor& counts, bool lfu) {
  check_tensor(cache_priority, at::kInt, "cache_priority");
  check_tensor(cache_set_floor, at::kInt, "cache_set_floor");
  check_tensor(counts, at::kInt, "counts");
  TORCH_CHECK(!lfu || counts.numel() == up.num_rows, "embcache: LFU needs a count per row");
  TORCH_CHECK(cache_priority.numel() == up.cache.num_sets * up.cache.ways,
              "embcache: cache_priority must hold one priority per slot");
  TORCH_CHECK(cache_set_floor.numel() == up.cache.num_sets,
              "embcache: cache_set_floor must hold one priority per set");
  return CommitState{weights.data_ptr<uint8_t>(), cache_priority.data_ptr<int32_t>(),
                     cache_set_floor.data_ptr<int32_t>(), counts.data_ptr<int32_t>()};
}

/// Second half: writes the values update_prepare computed (see commit_core).
at::Tensor update_commit(at::Tensor& weights, at::Tensor& cache_tags, at::Tensor& cache_rows,
                         at::Tensor& cache_priority, at::Tensor& cache_set_floor,
                         at::Tensor& counts, at::Tensor& optimizer_state,
                         const at::Tensor& unique_rows, const at::Tensor& fresh,
                         const at::Tensor& fresh_state, const at::Tensor& slots,
                         const at::Tensor& occurrences, int64_t bits, bool qparams_fp16,
                         bool stochastic, bool lfu, int64_t seed, int64_t step, int64_t table,
                         int64_t num_sets, int64_t ways) {
  check_tensor(fresh, at::kFloat, "fresh");
  check_tensor(fresh_state, at::kFloat, "fresh_state");
  check_tensor(slots, at::kLong, "slots");
  check_tensor(occurrences, at::kLong, "occurrences");
  TORCH_CHECK(fresh.dim() == 2 && fresh_state.dim() == 2,
              "embcache: fresh values and state must be 2-D");
  // No optimizer step is computed here: the optimizer only sets the state's width.
  const int64_t optimizer = fresh_state.size(1) == 0 ? kSGD
                            : fresh_state.size(1) == 1 ? kRowwiseAdagrad : kAdagrad;
  const RowUpdate up = make_row_update(weights, cache_tags, cache_rows, optimizer_state,
                                       unique_rows, fresh, bits, qparams_fp16, optimizer, 0.0,
                                       0.0, num_sets, ways);
  TORCH_CHECK(fresh_state.size(0) == up.nu && slots.numel() == up.nu &&
                  occurrences.numel() == up.nu && fresh_state.size(1) == up.sw,
              "embcache: prepared update does not match the table");
  const CommitState cs =
      check_commit_state(up, weights, cache_priority, cache_set_floor, counts, lfu);
  const float* fr = fresh.data_ptr<float>();
  const int64_t dim = up.f.dim;
  const CommitCounts c = commit_core(
      up, cs.w, cs.prio, cs.floor, cs.counts, fresh_state.data_ptr<float>(),
      slots.data_ptr<int64_t>(), occurrences.data_ptr<int64_t>(), stochastic, lfu, seed, step,
      table, [&](int64_t u, float* out, float*) { std::copy_n(fr + u * dim, dim, out); },
      [&](int64_t u) { prefetch_bytes(fr + u * dim, dim * sizeof(float)); });
  return at::tensor(at::ArrayRef<int64_t>(c.data(), c.size()), at::kLong);
}

/// Writes every cached row back into the table and empties the cache (every set's floor
/// becomes kEmpty). Returns the number of rows written.
int64_t cache_flush(at::Tensor& weights, at::Tensor& cache_tags, const at::Tensor& cache_rows,
                    at::Tensor& cache_priority, at::Tensor& cache_set_floor, int64_t bits,
                    bool qparams_fp16, bool stochastic, int64_t seed, int64_t step,
                    int64_t table) {
  const FlushShape shape = check_cache_flush(
      weights, cache_tags, cache_rows, cache_priority, cache_set_floor, bits, qparams_fp16,
      [](const at::Tensor& t) { return t.device().is_cpu(); }, "CPU");
  const int64_t slots = shape.slots;
  if (slots == 0) return 0;
  const RowFormat f = shape.f;
  const int64_t dim = f.dim;
  int32_t* tags = cache_tags.data_ptr<int32_t>();
  const float* cr = cache_rows.data_ptr<float>();
  uint8_t* w = weights.data_ptr<uint8_t>();
  const RoundingStream stream{(uint64_t)seed, (uint32_t)step, (uint32_t)table};
  std::atomic<int64_t> written{0};
  at::parallel_for(0, slots, kGrainRows, [&](int64_t s0, int64_t s1) {
    int64_t local = 0;
    for (int64_t s = s0; s < s1; ++s) {
      if (tags[s] < 0) continue;
      quantize_row(f, cr + s * dim, stochastic, stream, tags[s], w + tags[s] * f.row_bytes());
      tags[s] = -1;
      ++local;
    }
    written += local;
  });
  cache_priority.zero_();
  cache_set_floor.fill_(kEmpty);
  return written.load();
}

/// Replays a stream of training steps through the cache alone, with the rule of
/// update_commit and no row values (the hit-rate benchmark). Step s looks up
/// indices[step_offsets[s] .. step_offsets[s+1]); its lookups count as hits when their row
/// is cached before the step's update, as in a training forward. Steps are numbered from
/// first_step. Returns [lookups, hits, unique rows, unique hits, insertions, evictions,
/// bypasses].
at::Tensor cache_replay(at::Tensor& cache_tags, at::Tensor& cache_priority, at::Tensor& counts,
                        const at::Tensor& indices, const at::Tensor& step_offsets, bool lfu,
                        int64_t num_sets, int64_t ways, int64_t first_step) {
  check_tensor(cache_tags, at::kInt, "cache_tags");
  check_tensor(cache_priority, at::kInt, "cache_priority");
  check_tensor(counts, at::kInt, "counts");
  check_tensor(indices, at::kLong, "indices");
  check_tensor(step_offsets, at::kLong, "step_offsets");
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
  Cache cache{tags, nullptr, num_sets, ways};
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

// ---------------------------------------------------------------------------------------
// Table-batched ops: one call for all tables of a collection, tables in parallel (the
// per-table kernels above run single-threaded inside the parallel region). Feature f of a
// KeyedJaggedTensor is bags [f * batch, (f + 1) * batch) of the global offsets and is looked
// up in table feature_table[f]. Per-table settings come as parallel lists.
// ---------------------------------------------------------------------------------------

/// The cost of touching `n` random rows of a table of `rows` rows: bigger tables miss more
/// levels of the memory hierarchy.
int64_t row_work(int64_t n, int64_t rows) { return n * (1 + bits_for(rows)); }

/// Runs fn(i) for every i in [0, cost.size()) on the intra-op threads: the costliest first,
/// each thread taking the next item when it is done. (Criteo tables differ in size 10^6-fold,
/// so at::parallel_for's static split into equal index ranges leaves threads idle.)
template <typename Fn>
void for_each_by_cost(const std::vector<int64_t>& cost, const Fn& fn) {
  const int64_t n = (int64_t)cost.size();
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

/// The bags of nf features of `batch` bags each, checked.
Bags feature_bags(const at::Tensor& indices, const at::Tensor& offsets,
                  const c10::optional<at::Tensor>& psw, int64_t nf, int64_t batch) {
  TORCH_CHECK(batch >= 0 && offsets.numel() == nf * batch + 1,
              "embcache: offsets must have features * batch + 1 entries");
  return bags_of(indices, offsets, psw);
}

/// Column offsets of the features in the [batch, sum of dims] output.
std::vector<int64_t> column_offsets(at::IntArrayRef dims) {
  std::vector<int64_t> col(dims.size() + 1, 0);
  for (size_t f = 0; f < dims.size(); ++f) col[f + 1] = col[f] + dims[f];
  return col;
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
/// bags' offsets, every lookup's slot (int32, -1 if not cached), and per feature the largest
/// |value| its lookups read (float32; multi_update's value bound). Adds each feature's lookups
/// and hits to its table's counters.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> multi_lookup_forward(
    at::TensorList weights, at::TensorList cache_tags, at::TensorList cache_rows,
    const at::Tensor& indices, const at::Tensor& lengths,
    const c10::optional<at::Tensor>& per_sample_weights, at::IntArrayRef feature_table,
    at::IntArrayRef bits, at::IntArrayRef dims, at::IntArrayRef qparams_fp16,
    at::IntArrayRef num_sets, at::IntArrayRef ways, at::IntArrayRef mean, int64_t batch,
    at::TensorList counters) {
  const int64_t nf = (int64_t)feature_table.size();
  const std::vector<int64_t*> table_counters = tables_counters(counters, weights.size(), true);
  check_lookups(indices, per_sample_weights);
  const FeatureOffsets bags_of_feature(lengths, nf, batch, indices.numel());  // valid bags
  const at::Tensor& offsets = bags_of_feature.offsets;
  std::vector<int64_t> feature_dims(nf);
  for (int64_t f = 0; f < nf; ++f) feature_dims[f] = dims[feature_table[f]];
  const std::vector<int64_t> col = column_offsets(feature_dims);
  at::Tensor out = new_cpu_tensor({batch, col[nf]}, at::kFloat);
  std::vector<int64_t> hits(nf);
  at::Tensor slots = new_cpu_tensor({indices.numel()}, at::kInt);
  at::Tensor max_abs = new_cpu_tensor({nf}, at::kFloat);
  const Bags all{indices.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), nf * batch,
                 per_sample_weights ? per_sample_weights->data_ptr<float>() : nullptr};
  std::vector<int64_t> lookups(nf), cost(nf);
  for (int64_t f = 0; f < nf; ++f) {
    lookups[f] = bags_of_feature.first(f + 1) - bags_of_feature.first(f);
    cost[f] = row_work(lookups[f], weights[feature_table[f]].size(0));
  }
  for_each_by_cost(cost, [&](int64_t f) {
    bags_of_feature.fill(f);
    const int64_t t = feature_table[f];
    const RowFormat fmt = make_format(bits[t], dims[t], qparams_fp16[t] != 0);
    check_table(weights[t], fmt);
    const Cache cache = make_cache(cache_tags[t], cache_rows[t], num_sets[t], ways[t], dims[t]);
    const Bags bags{all.idx, all.off + f * batch, batch, all.psw};
    hits[f] = lookup_core(fmt, cache, weights[t].data_ptr<uint8_t>(), weights[t].size(0), bags,
                          mean[t] != 0, out.data_ptr<float>() + col[f], col[nf],
                          slots.data_ptr<int32_t>(), max_abs.data_ptr<float>() + f);
  });
  for (int64_t f = 0; f < nf && !table_counters.empty(); ++f) {
    table_counters[feature_table[f]][kLookups] += lookups[f];
    table_counters[feature_table[f]][kHits] += hits[f];
  }
  return {out, offsets, slots, max_abs};
}

/// Every feature's deduplicated gradient from the gradient of multi_lookup_forward's output,
/// [batch, sum of dims], in one set of tensors (the layout multi_update takes): (rows,
/// grads, occurrences, slots, row_starts). Feature f's unique rows (ascending) are
/// rows[row_starts[f] .. row_starts[f + 1]), with their occurrences (and, given the
/// forward's lookup_slots, their slots; else slots is empty) at the same positions; their
/// gradients are a block of rows x dims[f] floats in the 1-D grads, blocks in feature order.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> multi_dedup_backward(
    const at::Tensor& indices, const at::Tensor& offsets,
    const c10::optional<at::Tensor>& per_sample_weights, const at::Tensor& grad_output,
    at::IntArrayRef dims, at::IntArrayRef mean, int64_t batch,
    const c10::optional<at::Tensor>& lookup_slots) {
  const int64_t nf = (int64_t)dims.size();
  const Bags all = feature_bags(indices, offsets, per_sample_weights, nf, batch);
  const std::vector<int64_t> col = column_offsets(dims);
  check_tensor(grad_output, at::kFloat, "grad_output");
  TORCH_CHECK(grad_output.dim() == 2 && grad_output.size(0) == batch &&
                  grad_output.size(1) == col[nf],
              "embcache: grad_output must be [batch, sum of dims]");
  const int32_t* lookup_slot = nullptr;
  if (lookup_slots.has_value()) {
    check_tensor(*lookup_slots, at::kInt, "lookup_slots");
    TORCH_CHECK(lookup_slots->numel() == indices.numel(),
                "embcache: lookup_slots must hold one slot per index");
    lookup_slot = lookup_slots->data_ptr<int32_t>();
  }
  auto bags = [&](int64_t f) { return Bags{all.idx, all.off + f * batch, batch, all.psw}; };
  std::vector<int64_t> cost(nf);
  for (int64_t f = 0; f < nf; ++f) cost[f] = all.off[(f + 1) * batch] - all.off[f * batch];
  // Group each feature's lookups by row; then, with every feature's number of unique rows
  // known, one tensor of each kind for all of them (each tensor is made, handed to Python
  // and back, and freed every step); then sum into them.
  std::vector<RowRuns> runs(nf);
  for_each_by_cost(cost, [&](int64_t f) { runs[f] = group_by_row(bags(f)); });
  at::Tensor row_starts = new_cpu_tensor({nf + 1}, at::kLong);
  int64_t* rs = row_starts.data_ptr<int64_t>();
  std::vector<int64_t> block(nf + 1, 0);
  rs[0] = 0;
  for (int64_t f = 0; f < nf; ++f) {
    rs[f + 1] = rs[f] + runs[f].unique_rows();
    block[f + 1] = block[f] + runs[f].unique_rows() * dims[f];
  }
  at::Tensor rows = new_cpu_tensor({rs[nf]}, at::kLong);
  at::Tensor grads = new_cpu_tensor({block[nf]}, at::kFloat);
  at::Tensor occ = new_cpu_tensor({rs[nf]}, at::kLong);
  at::Tensor slots = new_cpu_tensor({lookup_slot ? rs[nf] : 0}, at::kLong);
  for_each_by_cost(cost, [&](int64_t f) {
    sum_runs(runs[f], bags(f), grad_output.data_ptr<float>() + col[f], col[nf], dims[f],
             mean[f] != 0, lookup_slot, rows.data_ptr<int64_t>() + rs[f],
             grads.data_ptr<float>() + block[f], occ.data_ptr<int64_t>() + rs[f],
             lookup_slot ? slots.data_ptr<int64_t>() + rs[f] : nullptr);
  });
  return {rows, grads, occ, slots, row_starts};
}

/// Every table's update, all or nothing: first each table's slots and a check that all its
/// new values can be stored (from the gradients alone when there are slot hints, the
/// optimizer is SGD and value_bounds[t] >= 0 bounds |v| of the table's rows, as the forward
/// that found the hints read them; else by computing them); then, if no table has a row it
/// cannot store, each table's commit, which computes every new value where it writes it
/// (tables in parallel, costliest first in both phases). The gradient is in
/// multi_dedup_backward's layout (see gradient_blocks); slot_hints holds every row's slot as
/// the forward found it, or is empty for none. Table t's update is step
/// counters[t][kSteps] + 1; its commit adds to its counters. Returns per table the smallest
/// row it cannot store, or -1. With commit false it stops after the check (a dry run).
std::vector<int64_t> multi_update(
    at::TensorList weights, at::TensorList cache_tags, at::TensorList cache_rows,
    at::TensorList cache_priority, at::TensorList cache_set_floor, at::TensorList counts,
    at::TensorList optimizer_state, const at::Tensor& unique_rows, const at::Tensor& grads,
    const at::Tensor& occurrences, const at::Tensor& slot_hints, at::IntArrayRef row_starts,
    at::ArrayRef<double> value_bounds, at::IntArrayRef dims, at::IntArrayRef bits,
    at::IntArrayRef qparams_fp16, at::IntArrayRef stochastic, at::IntArrayRef optimizer,
    at::ArrayRef<double> lr, at::ArrayRef<double> eps, at::IntArrayRef lfu,
    at::IntArrayRef seed, at::IntArrayRef table, at::IntArrayRef num_sets, at::IntArrayRef ways,
    at::TensorList counters, bool commit) {
  const int64_t nt = (int64_t)weights.size();
  TORCH_CHECK((int64_t)value_bounds.size() == nt && (int64_t)dims.size() == nt,
              "embcache: one value bound and one dim per table");
  const std::vector<int64_t> block =
      gradient_blocks(unique_rows, grads, occurrences, slot_hints, row_starts, dims);
  TORCH_CHECK(unique_rows.device().is_cpu(), "embcache: the gradient must be on the CPU");
  const bool hinted = slot_hints.numel() > 0;
  const std::vector<int64_t*> table_counters = tables_counters(counters, nt, false);
  std::vector<RowUpdate> updates;
  std::vector<int64_t> cost(nt);
  for (int64_t t = 0; t < nt; ++t) {
    updates.push_back(make_row_update(
        weights[t], cache_tags[t], cache_rows[t], optimizer_state[t],
        unique_rows.data_ptr<int64_t>() + row_starts[t], row_starts[t + 1] - row_starts[t],
        grads.data_ptr<float>() + block[t], dims[t], bits[t], qparams_fp16[t] != 0,
        optimizer[t], lr[t], eps[t], num_sets[t], ways[t]));
    cost[t] = row_work(updates[t].nu, weights[t].size(0));
  }
  std::vector<std::vector<int64_t>> slots(nt);
  std::vector<int64_t> bad(nt, -1);
  for_each_by_cost(cost, [&](int64_t t) {
    const RowUpdate& up = updates[t];
    slots[t].resize(up.nu);
    find_slots(up, hinted ? slot_hints.data_ptr<int64_t>() + row_starts[t] : nullptr,
               slots[t].data());
    if (hinted && optimizer[t] == kSGD &&
        surely_storable(up.f, up.g, up.nu * up.f.dim, lr[t], value_bounds[t]))
      return;
    bad[t] = for_each_new_value(up, slots[t].data(), stochastic[t] != 0,
                                [](int64_t, const float*, const float*) {});
  });
  if (!commit || std::any_of(bad.begin(), bad.end(), [](int64_t b) { return b >= 0; }))
    return bad;
  for_each_by_cost(cost, [&](int64_t t) {
    const RowUpdate& up = updates[t];
    at::Tensor w = weights[t], prio = cache_priority[t], floor = cache_set_floor[t],
               cnt = counts[t];
    const CommitState cs = check_commit_state(up, w, prio, floor, cnt, lfu[t] != 0);
    const int64_t* sl = slots[t].data();
    int64_t* counter = table_counters[t];
    // The new value (and optimizer state) computed in place: read, then written.
    const CommitCounts c = commit_core(
        up, cs.w, cs.prio, cs.floor, cs.counts, nullptr, sl,
        occurrences.data_ptr<int64_t>() + row_starts[t], stochastic[t] != 0, lfu[t] != 0,
        seed[t], counter[kSteps] + 1, table[t],
        [&](int64_t u, float* out, float* scratch) {
          up.compute(u, sl[u], scratch, out, up.st + up.rows[u] * up.sw);
        },
        [&](int64_t u) { up.prefetch_sources(u, sl[u]); });
    count_commit(counter, up.nu, c.data());
  });
  return bad;
}

/// Asks Linux to back the tensor's whole 2 MiB pages with transparent huge pages. Random
/// rows of a table of hundreds of MB otherwise miss the TLB on nearly every access, and
/// each miss adds a page walk to the lookup's memory access. Only pages not yet touched
/// are affected, so call it on a fresh torch.empty. Returns whether the kernel took the
/// advice (false off Linux, with THP disabled, or for a tensor smaller than a huge page).
bool advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(),
              "embcache: advise_huge_pages needs a contiguous CPU tensor");
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = (uintptr_t)t.data_ptr(), end = begin + t.nbytes();
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  return last > first && madvise((void*)first, last - first, MADV_HUGEPAGE) == 0;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(embcache, m) {
  define_cache_ops(m);
  m.def("advise_huge_pages(Tensor t) -> bool");
  m.def("cache_replay(Tensor(a!) cache_tags, Tensor(b!) cache_priority, Tensor(c!) counts, "
        "Tensor indices, Tensor step_offsets, bool lfu, int num_sets, int ways, "
        "int first_step) -> Tensor");
}

TORCH_LIBRARY_IMPL(embcache, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("dequantize_rows", &dequantize_rows);
  m.impl("lookup_forward", &lookup_forward);
  m.impl("dedup_backward", &dedup_backward);
  m.impl("update_prepare", &update_prepare);
  m.impl("update_commit", &update_commit);
  m.impl("multi_lookup_forward", &multi_lookup_forward);
  m.impl("multi_dedup_backward", &multi_dedup_backward);
  m.impl("multi_update", &multi_update);
  m.impl("cache_replay", &cache_replay);
  m.impl("cache_flush", &cache_flush);
  m.impl("advise_huge_pages", &advise_huge_pages);
}

}  // namespace embcache

// Importing `embcache._C` loads this library, which registers the ops above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
