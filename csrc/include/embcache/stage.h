// A stage (docs/design.md, "Prefetch"): copies of the stored rows a batch's lookups will
// miss, made ahead on a side stream, so that the forward and the update read them from
// device memory rather than across PCIe. It is an open-addressing hash table of `slots`
// entries (a power of two, at least twice the lookups, so that a probe ends at an empty
// entry), each an int64 pair (key, copy): key = stage_key(table position, row), with bit 0
// set once an update has written the row since the copy was made (the copy is then never
// read), or kNoStagedRow for an empty entry; copy = the index of the row's stored bytes in
// the stage's rows. Probed linearly from stage_hash(key).
#pragma once

#include "embcache/rowquant.h"

namespace embcache {

constexpr int kStagedRowShift = 1;
constexpr int kStagedTableShift = 49;
constexpr int64_t kNoStagedRow = INT64_MAX;
/// Table positions a key can hold.
constexpr int64_t kMaxStagedTables = int64_t(1) << (63 - kStagedTableShift);

/// The key of a fresh copy of row `row` of the table at position `table`.
EMBCACHE_HD int64_t stage_key(int64_t table, int64_t row) {
  return (table << kStagedTableShift) | (row << kStagedRowShift);
}
EMBCACHE_HD int64_t staged_table(int64_t key) { return key >> kStagedTableShift; }
EMBCACHE_HD int64_t staged_row_id(int64_t key) {
  return (key >> kStagedRowShift) & ((int64_t(1) << (kStagedTableShift - kStagedRowShift)) - 1);
}
/// The key with its copy marked stale.
EMBCACHE_HD int64_t stale_key(int64_t key) { return key | 1; }
/// Where a key's probe starts in a stage of mask + 1 entries.
EMBCACHE_HD int64_t stage_hash(int64_t key, int64_t mask) {
  return (int64_t)(murmur_fmix64((uint64_t)key) & (uint64_t)mask);
}

/// The copy that the stage (slots: mask + 1 (key, copy) pairs) holds of `key`, or -1. (At
/// most mask + 1 probes, should a stage have no empty entry.)
EMBCACHE_HD int64_t find_staged(const int64_t* slots, int64_t mask, int64_t key) {
  int64_t h = stage_hash(key, mask);
  for (int64_t probe = 0; probe <= mask; ++probe, h = (h + 1) & mask) {
    const int64_t k = slots[2 * h];
    if (k == key) return slots[2 * h + 1];
    if (k == kNoStagedRow) return -1;
  }
  return -1;
}

/// Whether `row` is among rows[first..end) (ascending): an update's unique rows of a table.
EMBCACHE_HD bool holds_sorted(const int64_t* rows, int64_t first, int64_t end, int64_t row) {
  int64_t lo = first, hi = end;  // the first position not below row
  while (lo < hi) {
    const int64_t mid = lo + ((hi - lo) >> 1);
    if (rows[mid] < row) lo = mid + 1;
    else hi = mid;
  }
  return lo < end && rows[lo] == row;
}

/// Entry `key` of a stage after an update: stale if the update's part of its table holds its
/// row. Table position t's part is rows[ranges[3r] .. ranges[3r + 1]) (ascending) of the
/// update's nrows unique rows, r = range_of[t] (t < nt; -1: the update has none); a part not
/// within the rows makes every entry of its table stale (the update may have written any).
EMBCACHE_HD int64_t key_after_update(int64_t key, const int64_t* rows, int64_t nrows,
                                     const int64_t* ranges, const int64_t* range_of, int64_t nt) {
  const int64_t t = staged_table(key), row = staged_row_id(key);
  if (key == kNoStagedRow || key != stage_key(t, row) || t >= nt || range_of[t] < 0) return key;
  const int64_t first = ranges[3 * range_of[t]], end = ranges[3 * range_of[t] + 1];
  const bool sound = first >= 0 && first <= end && end <= nrows;
  return !sound || holds_sorted(rows, first, end, row) ? stale_key(key) : key;
}

}  // namespace embcache
