// The host API of the cache kernels (csrc/cuda/kernels/*.cuh), one function per phase: plain
// functions over a table's decoded spec and raw device pointers, no CUDA or torch types, so
// the torch glue compiles without nvcc and the same declarations serve the CUDA build
// (namespace embcache::gpu) and the warp-emulator build (namespace embcache::emu, see
// csrc/emulated/emu_ops.cpp).
//
// The functions only enqueue work on the given stream: none waits for the device. What the
// host must learn from the device (error bits, rows that cannot be stored) the kernels write
// into device buffers the caller passes and reads when it next waits for the device
// (docs/design.md, "No wait inside a step"); counts stay on the device, in each table's
// device_counts; sizes that depend on the data (the backward's unique rows) stay there too,
// the outputs sized for the most there can be. The exceptions: quantize_rows and
// flush_cache, off the training step, read their own result.
// Launch errors throw std::runtime_error at once.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <stdexcept>
#include <string>

#include "embcache/rowquant.h"
#include "embcache/stage.h"
#include "embcache/table_spec.h"

#ifndef EMBCACHE_GPU_NS
#define EMBCACHE_GPU_NS gpu
#endif

namespace embcache {
namespace EMBCACHE_GPU_NS {

using Stream = void*;  // a cudaStream_t (unused by the emulator)

/// Where scratch memory comes from: the torch binding installs PyTorch's caching allocator
/// (memory ordered on the op's stream), so that the kernels and torch share one pool. The
/// emulator allocates from the heap and needs none.
struct Allocator {
  void* (*alloc)(size_t bytes, Stream stream);
  void (*free)(void* p);
};
void set_allocator(Allocator a);

/// out[r] = the row x[r] stored in format f. Returns -1, or the first position r whose row
/// cannot be stored (nothing is guaranteed about out then).
int64_t quantize_rows(const float* x, const int64_t* ids, int64_t n, RowFormat f,
                      bool stochastic, RoundingStream s, uint8_t* out, Stream stream);

void dequantize_rows(const uint8_t* w, int64_t n, RowFormat f, float* out, Stream stream);

/// Writes every cached row back (rounded with `s`) and empties the tags; returns the number
/// of rows written. (The caller zeroes the cache rows and priorities.)
int64_t flush_cache(const TableSpec& t, const TableState& state, RoundingStream s,
                    Stream stream);

/// Error bits the kernels OR into flags[kErrorFlag]; the caller throws after reading them
/// (throw_errors).
enum ErrorBits : unsigned long long {
  kBadIndex = 1,        // an index < 0 or >= rows
  kBadOffsets = 2,      // offsets not starting at 0, decreasing, or not ending at len(indices)
  kBadUniqueRows = 4,   // unique rows not ascending or out of range
  kBadRanges = 8,       // row ranges not ascending, overlapping, or past the arrays
};
constexpr int kErrorFlag = 0;

/// Throws std::runtime_error naming the first error among `bits` (none: returns).
inline void throw_errors(unsigned long long bits) {
  const char* what = (bits & kBadOffsets) ? "offsets must start at 0, not decrease and end at len(indices)"
                     : (bits & kBadIndex) ? "an index is out of range"
                     : (bits & kBadUniqueRows) ? "unique rows must be ascending and in range"
                     : (bits & kBadRanges) ? "row ranges must be ascending, disjoint and within the arrays"
                                           : nullptr;
  if (what) throw std::runtime_error(std::string("embcache (cuda): ") + what);
}

/// One feature's bags: bags [first, first + nb) of the op's global offsets `off`, over the
/// op's n lookups `idx` and per-sample weights `psw` (or null). Every bag must lie in [0, n),
/// the op's first bag start at 0 and its last (bag total - 1) end at n: the kernels check
/// this, and as consecutive bags share an offset, the op's bags then tile [0, n).
struct Bags {
  const int64_t* idx;
  const int64_t* off;
  int64_t first, nb, total, n;
  const float* psw;
};

/// A stage as a kernel reads it (embcache/stage.h): mask + 1 (key, copy) entries `slots`,
/// the copies at rows + copy * stride; `table` is the position of the table whose rows the
/// kernel looks for. slots null: no stage (every miss reads the table).
struct Stage {
  const int64_t* slots;
  int64_t mask;
  const uint8_t* rows;
  int64_t stride, table;
};
constexpr Stage kNoStage{nullptr, 0, nullptr, 0, 0};

/// One table of a staging (stage_misses): where its rows are, and whether to stage them (a
/// host-placed table's; a table in device memory gains nothing from a copy).
struct StagedTable {
  TableSpec t;
  TableState state;
  bool staged;
};

/// Stages the misses of nf features (feature f: bags [f * batch, (f + 1) * batch) of `bags`,
/// which holds them all, in tables[feature_table[f]]), in one launch: every lookup of a
/// staged table whose row is valid and not cached puts stage_key(position, row) into the
/// stage `slots` (mask + 1 entries, every one kNoStagedRow before: the caller fills them),
/// and the lookup that puts a key first copies the row's stored bytes to the next free row
/// of `rows` (stride bytes each, at least the widest row, a multiple of 16; as many as the
/// lookups). Lookups are not checked here: the forward reports bad ones, and an invalid row
/// or bag stages nothing.
void stage_misses(const StagedTable* tables, int64_t nt, const Bags& bags, int64_t batch,
                  int64_t nf, const int64_t* feature_table, int64_t* slots, int64_t mask,
                  uint8_t* rows, int64_t stride, Stream stream);

/// Marks stale (stale_key) every entry of a stage (n (key, copy) pairs `slots`) whose row an
/// update of the table at its position may have written (key_after_update: the table's part
/// of the update is row_ranges[range_of[t]] of its nrows unique `rows`; -1: none).
void unstage_rows(int64_t* slots, int64_t n, const int64_t* rows, int64_t nrows,
                  const int64_t* ranges, const int64_t* range_of, int64_t nt, Stream stream);

/// The forward: the bags pooled from table `t` (by t.pooling) into out[b * out_stride + j];
/// for max, the position in idx of each element's lookup into argmax[b * argmax_stride + j]
/// (-1 for an empty bag; argmax is not read otherwise). A miss reads its row from `stage`
/// where it holds a fresh copy, else from the table. *errors |= error bits; unless `counts`
/// is null, counts[0] += the bags' lookups and counts[1] += those that found their row cached
/// (a table's device counts from kDeviceLookups).
void pool_bags(const TableSpec& t, const TableState& state, const Bags& bags, const Stage& stage,
               float* out, int64_t out_stride, int32_t* argmax, int64_t argmax_stride,
               unsigned long long* errors, unsigned long long* counts, Stream stream);

/// Where dedup_features writes its outputs, allocated by the caller for n lookups: every
/// lookup a unique row (rows and occ [n]), grads [n x the widest feature dim], zero.
struct DedupOutputs {
  int64_t* rows;
  float* grads;
  int64_t* occ;
};

/// The backward of a forward's nf features: feature f is bags [f * batch, (f + 1) * batch)
/// of `bags` (which holds them all: first 0, nb = total), looked up in table feature_table[f]
/// (its spec gives the dim and the pooling mode); the gradient of the feature's bag b is
/// g[b * g_stride + (the feature's column) + j], the features' columns side by side in their
/// order; a max-pooled feature's element goes to the lookup that the forward's argmax
/// (argmax_col: host, nf + 1 column offsets, csrc/tables.h argmax_columns) names. Writes,
/// feature after feature, the unique rows ascending, their occurrences and their gradient
/// rows (contributions summed in lookup order), and `ranges` (device, [nf, 3]: each
/// feature's unique rows and first gradient value, csrc/tables.h RowRange); *errors |=
/// error bits. One sort and one summing launch for every feature, and no read-back: the
/// sizes stay on the device.
void dedup_features(const Bags& bags, int64_t batch, int64_t nf, const int64_t* feature_table,
                    const TableSpec* specs, const float* g, int64_t g_stride,
                    const int32_t* argmax, const int64_t* argmax_col, DedupOutputs out,
                    int64_t* ranges, unsigned long long* errors, Stream stream);

/// One table of a batched update (the update of every table of an op in a few launches):
/// its unique rows are [row_start, row_end) of the op's `rows` (ascending), with their
/// occurrences and slots at the same positions; their gradients and new values
/// [row_end - row_start, dim] start at value_start of `g` and `fresh`; `step` is the
/// update's number (it keys the rounding and is LRU's priority). The row fields are placed
/// on the device from the op's ranges (UpdateRows); the host leaves them 0. An uncached row's
/// value is read from `stage` where it holds a fresh copy, else from the table.
struct UpdateTable {
  TableSpec t;
  TableState state;
  int64_t row_start, row_end, value_start, step;
  int64_t set_start;  // the table's first set in the op's numbering of sets (update_tables)
  unsigned long long* device_counts;  // its DeviceCount words, the commit's from kCommitHits
  Stage stage;
};

/// The rows of a batched update, on the device: n unique rows (`rows`, ascending within each
/// table), each table's part given by `ranges` ([nt, 3], csrc/tables.h RowRange: checked by
/// the kernels, kBadRanges), within grads_numel gradient values; row u's new optimizer state
/// at u * state_stride of fresh_state (the widest state width of the tables).
struct UpdateRows {
  const int64_t* rows;
  int64_t n;
  const int64_t* ranges;
  int64_t grads_numel, state_stride;
};

/// The most sets the cached tables of one commit may have together: the commit sorts
/// (set << 31 | priority) keys of 64 bits.
constexpr int64_t kMaxCommitSets = (int64_t(1) << 33) - 1;

/// The update of nt tables in a few launches, in two phases. First (changing nothing) every
/// unique row's slot, new value and new optimizer state, into fresh, fresh_state and slots;
/// table t's verdict: verdict[2t] |= error bits, verdict[2t + 1] = min(verdict[2t + 1], a row
/// whose new value cannot be stored) (the caller sets those to ~0 first). Then, if `commit`,
/// the commit, whose launches all do nothing unless every table's verdict is clean and the
/// ngate words of `gate` are 0 (a decision made on the device): optimizer state, LFU counts,
/// then one warp per touched set decides the insert/evict/bypass rule (one sort orders every
/// table's candidates) and one warp per unique row writes it into its slot or its table row.
/// Table t's device_counts += its unique hits, insertions and evictions, on the device.
/// Throws, before any launch, if a commit's cached tables have more than kMaxCommitSets sets
/// together.
void update_tables(const UpdateTable* tables, int64_t nt, const UpdateRows& r, const float* g,
                   float* fresh, float* fresh_state, int64_t* slots, const int64_t* occ,
                   unsigned long long* verdict, bool commit, const int64_t* gate, int64_t ngate,
                   Stream stream);

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
