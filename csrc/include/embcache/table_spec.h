// A table's configuration as the ops receive it, and the constants it is made of: written once
// for the CPU ops, the CUDA kernels and their torch glue. embcache/config.py mirrors every list
// here (the `layout` op returns them; tests/test_embedding.py compares the two).
//
// Python packs each table's configuration once, when the table is made
// (TableConfig.spec()): one int64 per field of EMBCACHE_SPEC_FIELDS, in that order, lr and eps
// as the bits of a float64. The ops take the specs of all their tables as one int64 CPU tensor
// [tables, kNumSpecFields] and decode each row once (decode_spec), which also checks it for
// callers that bypass Python. No torch, no STL: the CUDA kernels include this too.
#pragma once

#include <stdint.h>
#include <string.h>

#include "embcache/rowquant.h"

namespace embcache {

// Each list is an X-macro, X(enumerator, name): the enum and the names come from one place.

/// The row formats (docs/contract.md §2): name, bits per value.
#define EMBCACHE_FORMATS(X) X(fp32, 32) X(fp16, 16) X(int8, 8) X(int4, 4) X(int2, 2)

/// The fused optimizers (docs/contract.md §4.5), by their codes 0, 1, 2.
#define EMBCACHE_OPTIMIZERS(X) X(kSGD, sgd) X(kRowwiseAdagrad, rowwise_adagrad) X(kAdagrad, adagrad)

/// How a bag is pooled (nn.EmbeddingBag's modes), by their codes 0, 1, 2: the sum of its rows,
/// their mean, or their element-wise maximum (docs/design.md, "Max pooling").
#define EMBCACHE_POOLINGS(X) X(kSum, sum) X(kMean, mean) X(kMax, max)

/// A table's statistics: an int64 CPU tensor of kNumCounters that the ops add to in place.
/// kProbedRows .. kProbedExpectedUpE6: the precision telemetry (embcache/rounding_probe.h),
/// measured by the CPU ops (the CUDA kernels leave them 0).
#define EMBCACHE_COUNTERS(X)                                                                  \
  X(kLookups, lookups) X(kHits, hits) X(kSteps, steps) X(kUniqueRows, unique_rows)           \
  X(kUniqueHits, unique_hits) X(kUniqueMisses, unique_misses) X(kInsertions, insertions)     \
  X(kEvictions, evictions) X(kBypasses, bypasses) X(kFlushed, flushed)                       \
  X(kProbedRows, probed_rows) X(kProbedErrorSumE9, probed_error_sum_e9)                      \
  X(kProbedErrorMaxE9, probed_error_max_e9) X(kProbedUp, probed_up)                          \
  X(kProbedDown, probed_down) X(kProbedExpectedUpE6, probed_expected_up_e6)

/// The counts the ops add to on a table's device, in the order of its device_counts (an int64
/// tensor beside its state, which fold_device_counts moves into its counters): the training
/// forwards' lookups and hits, then the commits' unique hits, insertions and evictions (every
/// other unique row a commit updated bypassed the cache). On a GPU no op reads them back.
enum DeviceCount {
  kDeviceLookups,
  kDeviceHits,
  kCommitHits,
  kCommitInsertions,
  kCommitEvictions,
  kNumDeviceCounts
};

/// The two tiers of a table's state (docs/design.md, "Host placement"): its storage (what is
/// as wide as its rows: the stored rows, and AdaGrad's per-element state), which may lie in
/// pinned host memory that a GPU reads and writes in place; and its cache, which lies on the
/// op's device, with the values of at most one a row (LFU counts, row-wise AdaGrad's
/// accumulators) that every update reads and writes, for cached rows too.
#define EMBCACHE_STATE_TIERS(X) X(kStorage, storage) X(kCache, cache)

/// A table's state tensors, in the order the ops take them (kNumStateTensors per table, table
/// after table, in one Tensor[]), each with its tier: X(enumerator, name, tier). The names are
/// those of the table module's buffers; this list and state_tier are the one place that says
/// which tensor is storage and which is cache (embcache.config.STATE_TENSORS, STATE_TIERS and
/// TableConfig.storage_tensors mirror them). optimizer_state's tier is that of per-element
/// state; state_tier places a state of one value a row in the cache's.
#define EMBCACHE_STATE_TENSORS(X)                                                              \
  X(kWeights, weights, kStorage) X(kCacheTags, cache_tags, kCache)                            \
  X(kCacheRows, cache_rows, kCache) X(kCachePriority, cache_priority, kCache)                 \
  X(kCacheSetFloor, cache_set_floor, kCache) X(kCounts, counts, kCache)                       \
  X(kOptimizerState, optimizer_state, kStorage)

/// The fields of a table's spec:
///   rows: the table's rows; dim: values per row; bits and qparams_fp16: the row format;
///   stochastic: 1 for stochastic rounding, 0 for nearest; optimizer: an Optimizer;
///   lr, eps: the optimizer's float64 values, as their bits; lfu: the bits of the table's LFU
///   counts (32, 16 or 8) if it keeps them (an LFU policy and a cache), so that its priorities
///   are counts, else 0 (its priorities are update steps);
///   num_sets, ways: the cache's geometry (num_sets * ways slots; 0 sets: no cache);
///   seed, table: the key and table number of the rounding stream; pooling: a Pooling.
#define EMBCACHE_SPEC_FIELDS(X)                                                                \
  X(kRows, rows) X(kDim, dim) X(kBits, bits) X(kQparamsFp16, qparams_fp16)                    \
  X(kStochastic, stochastic) X(kOptimizer, optimizer) X(kLr, lr) X(kEps, eps) X(kLfu, lfu)    \
  X(kNumSets, num_sets) X(kWays, ways) X(kSeed, seed) X(kTable, table) X(kPooling, pooling)

#define EMBCACHE_ENUMERATOR(e, name) e,
enum Optimizer : int { EMBCACHE_OPTIMIZERS(EMBCACHE_ENUMERATOR) kNumOptimizers };
enum Pooling : int { EMBCACHE_POOLINGS(EMBCACHE_ENUMERATOR) kNumPoolings };
enum Counter : int { EMBCACHE_COUNTERS(EMBCACHE_ENUMERATOR) kNumCounters };
enum StateTier : int { EMBCACHE_STATE_TIERS(EMBCACHE_ENUMERATOR) kNumStateTiers };
#define EMBCACHE_STATE_ENUMERATOR(e, name, tier) e,
enum StateTensor : int { EMBCACHE_STATE_TENSORS(EMBCACHE_STATE_ENUMERATOR) kNumStateTensors };
#undef EMBCACHE_STATE_ENUMERATOR
enum SpecField : int { EMBCACHE_SPEC_FIELDS(EMBCACHE_ENUMERATOR) kNumSpecFields };
#undef EMBCACHE_ENUMERATOR

#define EMBCACHE_NAME(e, name) #name,
constexpr const char* kOptimizerNames[] = {EMBCACHE_OPTIMIZERS(EMBCACHE_NAME)};
constexpr const char* kPoolingNames[] = {EMBCACHE_POOLINGS(EMBCACHE_NAME)};
constexpr const char* kCounterNames[] = {EMBCACHE_COUNTERS(EMBCACHE_NAME)};
constexpr const char* kStateTierNames[] = {EMBCACHE_STATE_TIERS(EMBCACHE_NAME)};
#define EMBCACHE_STATE_NAME(e, name, tier) #name,
#define EMBCACHE_STATE_TIER(e, name, tier) tier,
constexpr const char* kStateTensorNames[] = {EMBCACHE_STATE_TENSORS(EMBCACHE_STATE_NAME)};
/// Each state tensor's tier, in EMBCACHE_STATE_TENSORS order.
constexpr StateTier kStateTensorTiers[] = {EMBCACHE_STATE_TENSORS(EMBCACHE_STATE_TIER)};
#undef EMBCACHE_STATE_NAME
#undef EMBCACHE_STATE_TIER

/// State tensor `i`'s tier in a table whose optimizer keeps `state_width` values a row: its
/// kStateTensorTiers entry, but an optimizer state of at most one value a row is read and
/// written for every updated row, cached or not, so it goes with the cache: a hit then
/// touches no host memory, for 4 bytes a row on the device.
constexpr StateTier state_tier(int i, int64_t state_width) {
  return i == kOptimizerState && state_width <= 1 ? kCache : kStateTensorTiers[i];
}
constexpr const char* kSpecFieldNames[] = {EMBCACHE_SPEC_FIELDS(EMBCACHE_NAME)};
#undef EMBCACHE_NAME
#define EMBCACHE_FORMAT_NAME(name, bits) #name,
#define EMBCACHE_FORMAT_BITS(name, bits) bits,
constexpr const char* kFormatNames[] = {EMBCACHE_FORMATS(EMBCACHE_FORMAT_NAME)};
constexpr int64_t kFormatBits[] = {EMBCACHE_FORMATS(EMBCACHE_FORMAT_BITS)};
#undef EMBCACHE_FORMAT_NAME
#undef EMBCACHE_FORMAT_BITS

/// The most ways a set may have (embcache.config.MAX_ASSOCIATIVITY): on a GPU one warp holds a
/// set, one lane per way.
constexpr int64_t kMaxWays = 32;
static_assert(kMaxWays <= 32, "a set must fit the lanes of one warp");

/// Whether a set of `ways` ways is allowed: a power of two in [1, kMaxWays].
EMBCACHE_HD bool is_valid_ways(int64_t ways) {
  return ways >= 1 && ways <= kMaxWays && (ways & (ways - 1)) == 0;
}

/// Whether `bits` is the bits of one of EMBCACHE_FORMATS.
EMBCACHE_HD bool is_format_bits(int64_t bits) {
#define EMBCACHE_IS_BITS(name, b) bits == b ||
  return EMBCACHE_FORMATS(EMBCACHE_IS_BITS) false;
#undef EMBCACHE_IS_BITS
}

/// FP32 accumulators per row: 0 (SGD), 1 (row-wise AdaGrad), dim (AdaGrad).
EMBCACHE_HD int64_t optimizer_state_width(int optimizer, int64_t dim) {
  return optimizer == kSGD ? 0 : optimizer == kRowwiseAdagrad ? 1 : dim;
}

/// A table's spec, decoded.
struct TableSpec {
  int64_t rows;
  RowFormat f;
  bool stochastic;
  int optimizer;
  double lr, eps;
  int count_bits;  // of its LFU counts: 32, 16 or 8 (LfuCounts); 0 without
  int64_t num_sets, ways;
  uint64_t seed;
  uint32_t table;
  int pooling;  // a Pooling
  SetDivisor set_divisor;  // num_sets as a divisor (set_of_row)

  /// Whether it keeps LFU counts (an LFU policy and a cache): its priorities are counts,
  /// else update steps.
  EMBCACHE_HD bool lfu() const { return count_bits != 0; }
  EMBCACHE_HD int64_t slots() const { return num_sets * ways; }
  EMBCACHE_HD int64_t state_width() const { return optimizer_state_width(optimizer, f.dim); }
  /// The rounding stream of update `step` (docs/design.md, "Random stream").
  EMBCACHE_HD RoundingStream stream(int64_t step) const {
    return RoundingStream{seed, (uint32_t)step, table};
  }
};

/// A table's LFU counts (docs/contract.md §4): int32, int16 or int8 (`bits` 32, 16 or 8, as
/// the table's spec says). A count saturates at its type's largest value (2^(bits - 1) - 1):
/// rows counted past it tie, and a tie keeps the resident.
struct LfuCounts {
  void* p;
  int bits;

  EMBCACHE_HD int32_t operator[](int64_t row) const {
    return bits == 8    ? (int32_t) static_cast<const int8_t*>(p)[row]
           : bits == 16 ? (int32_t) static_cast<const int16_t*>(p)[row]
                        : static_cast<const int32_t*>(p)[row];
  }
  /// Adds `occurrences` (>= 0) to the row's count, saturating; returns the new count.
  EMBCACHE_HD int32_t add(int64_t row, int64_t occurrences) const {
    const int64_t most = (int64_t(1) << (bits - 1)) - 1, c = (*this)[row] + occurrences;
    const int32_t count = (int32_t)(c < most ? c : most);
    if (bits == 8)
      static_cast<int8_t*>(p)[row] = (int8_t)count;
    else if (bits == 16)
      static_cast<int16_t*>(p)[row] = (int16_t)count;
    else
      static_cast<int32_t*>(p)[row] = count;
    return count;
  }
  /// The row's count's address (to prefetch).
  EMBCACHE_HD const void* address(int64_t row) const {
    return static_cast<const char*>(p) + row * (bits / 8);
  }
};

/// A table's state tensors' data (device pointers on a GPU).
struct TableState {
  uint8_t* weights;
  int32_t* cache_tags;
  float* cache_rows;
  int32_t* cache_priority;
  int32_t* cache_set_floor;
  LfuCounts counts;
  float* optimizer_state;
};

/// Decodes spec `s` (kNumSpecFields int64) into *out. Returns -1, or the first SpecField
/// whose value is out of its range (then *out is not to be used).
inline int decode_spec(const int64_t* s, TableSpec* out) {
  auto flag = [](int64_t v) { return v == 0 || v == 1; };
  auto real = [](int64_t v) {
    double d;
    memcpy(&d, &v, sizeof d);
    return d;
  };
  const int64_t rows = s[kRows], dim = s[kDim], ways = s[kWays], sets = s[kNumSets];
  if (!(rows > 0 && rows < (int64_t(1) << 31) - 1)) return kRows;  // tags are int32
  if (!(dim > 0 && dim < (int64_t(1) << 24))) return kDim;
  if (!is_format_bits(s[kBits])) return kBits;
  if (!flag(s[kQparamsFp16])) return kQparamsFp16;
  if (!flag(s[kStochastic])) return kStochastic;
  if (!(s[kOptimizer] >= 0 && s[kOptimizer] < kNumOptimizers)) return kOptimizer;
  const double lr = real(s[kLr]), eps = real(s[kEps]);
  if (!(lr - lr == 0.0)) return kLr;  // finite
  if (!(eps - eps == 0.0 && eps > 0.0)) return kEps;
  if (!(s[kLfu] == 0 || s[kLfu] == 8 || s[kLfu] == 16 || s[kLfu] == 32)) return kLfu;
  if (!is_valid_ways(ways)) return kWays;
  if (!(sets >= 0 && sets <= rows && sets * ways <= rows)) return kNumSets;
  if (!(s[kSeed] >= 0)) return kSeed;
  if (!(s[kTable] >= 0 && s[kTable] < (int64_t(1) << 32))) return kTable;
  if (!(s[kPooling] >= 0 && s[kPooling] < kNumPoolings)) return kPooling;
  *out = TableSpec{rows,
                   RowFormat{(int)s[kBits], (int)dim, s[kQparamsFp16] != 0},
                   s[kStochastic] != 0,
                   (int)s[kOptimizer],
                   lr,
                   eps,
                   (int)s[kLfu],
                   sets,
                   ways,
                   (uint64_t)s[kSeed],
                   (uint32_t)s[kTable],
                   (int)s[kPooling],
                   SetDivisor::of((uint64_t)sets)};
  return -1;
}

}  // namespace embcache
