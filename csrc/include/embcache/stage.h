// A stage's keys (docs/design.md, "Prefetch"): a stage holds copies of stored rows that a
// batch's lookups will miss, made ahead on a side stream, so that the forward and the update
// read them from device memory rather than across PCIe. Its entries are sorted by key:
// (t << 49) | (row << 1) | stale, t the table's position in its group, so that a row is found
// by binary search; bit 0 says an update has written the row since the copy was made (the
// copy is then never read). kNoStagedRow, above every key, fills the places of lookups that
// stage nothing.
#pragma once

#include "portable.h"

namespace embcache {

constexpr int kStagedRowShift = 1;
constexpr int kStagedTableShift = 49;
constexpr int64_t kNoStagedRow = INT64_MAX;
/// Rows and table positions a key can hold.
constexpr int64_t kMaxStagedRows = int64_t(1) << (kStagedTableShift - kStagedRowShift);
constexpr int64_t kMaxStagedTables = int64_t(1) << (63 - kStagedTableShift);

/// The key of a fresh copy of row `row` of the table at position `table`.
EMBCACHE_HD int64_t stage_key(int64_t table, int64_t row) {
  return (table << kStagedTableShift) | (row << kStagedRowShift);
}
EMBCACHE_HD int64_t staged_table(int64_t key) { return key >> kStagedTableShift; }
EMBCACHE_HD int64_t staged_row_id(int64_t key) {
  return (key >> kStagedRowShift) & (kMaxStagedRows - 1);
}
/// The key with its copy marked stale (it keeps its place in the order).
EMBCACHE_HD int64_t stale_key(int64_t key) { return key | 1; }

/// The first of keys[0..n) (ascending) not below `key` (n if none).
EMBCACHE_HD int64_t lower_bound_key(const int64_t* keys, int64_t n, int64_t key) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + ((hi - lo) >> 1);
    if (keys[mid] < key) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/// Whether `row` is among rows[first..end) (ascending): an update's unique rows of a table.
EMBCACHE_HD bool holds_sorted(const int64_t* rows, int64_t first, int64_t end, int64_t row) {
  const int64_t at = first + lower_bound_key(rows + first, end - first, row);
  return at < end && rows[at] == row;
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
