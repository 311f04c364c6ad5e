// The schemas of the table ops, written once: the CPU library (torch.ops.embcache, whose CUDA
// implementations register under the same names) and the emulated CUDA kernels
// (torch.ops.embcache_emu) define the same ops (define_cache_ops); the CPU library alone
// defines define_cpu_only_ops.
//
// Table-batched ops take their tables as `state` (kNumStateTensors tensors per table, in the
// order of EMBCACHE_STATE_TENSORS, table after table), `specs` (one spec row per table,
// csrc/include/embcache/table_spec.h), `counters` (one int64 CPU tensor per table, which
// the op adds to) and `device_counts` (one int64 tensor of DeviceCount per table, on the
// device of its state, which the op adds to without reading them back). Feature f of a KeyedJaggedTensor is bags [f * batch, (f + 1) * batch) of the
// lookups and is looked up in table feature_table[f]. A single table is such a batch of one.
#pragma once

#include <torch/library.h>

namespace embcache {

inline void define_cache_ops(torch::Library& m) {
  // Row conversion, in the format of one table's spec ([kNumSpecFields], or [1,
  // kNumSpecFields]): float32 values [rows, dim] to stored rows, row_ids[r] being row r's
  // row of the table (it keys the rounding stream; any int64). With a step, rounded as the
  // table rounds at update `step` (the spec's rounding and stream, as an eviction then
  // rounds); without one, to nearest (a table's initial rows). Then stored rows [rows, row
  // bytes] back to float32.
  m.def("quantize_rows(Tensor values, Tensor row_ids, Tensor spec, int? step=None) -> Tensor");
  m.def("dequantize_rows(Tensor weights, Tensor spec) -> Tensor");
  // Bags come as lengths (int32 or int64), feature after feature; returns (pooled
  // [batch, sum of the features' dims], the bags' int64 offsets with the end appended, each
  // lookup's slot, each feature's value bound, argmax, errors) and adds each feature's lookups
  // and hits to its table's device_counts (none if the list is empty). argmax: int32 [batch,
  // sum of the max-pooled features' dims] (csrc/tables.h, argmax_columns), the position in
  // indices of the lookup each max-pooled element came from, -1 for an empty bag (no columns,
  // no memory, without such features). Bad indices or offsets: the CPU op raises; the CUDA
  // op, which does not wait for its kernels, writes nothing out of bounds and returns their
  // error bits (cache_api.h ErrorBits) in `errors`, int64 [1] on the device (empty from the
  // CPU op), for the caller to read when it next waits for the device. staged_slots and
  // staged_rows: a stage of these lookups (stage_misses), from which a miss reads its row
  // where it holds a fresh copy (the same bytes as the table's); the CPU op ignores them.
  m.def("multi_lookup_forward(Tensor[] state, Tensor specs, Tensor indices, Tensor lengths, "
        "Tensor? per_sample_weights, int[] feature_table, int batch, "
        "Tensor(a!)[] device_counts, Tensor? staged_slots=None, Tensor? staged_rows=None) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The stage of a forward's misses (docs/design.md, "Prefetch"; csrc/include/embcache/
  // stage.h), for the forward and the update of these lookups to read in place of the
  // tables' storage: (staged_slots int64 [entries, 2], the hash table of (key, copy),
  // staged_rows uint8 [lookups, stride], the copies). Arguments as multi_lookup_forward's;
  // table positions are those of `specs`. Only the misses of the tables at positions
  // `staged_tables` are staged (the caller's choice: host-placed tables gain, a table in
  // device memory does not); the CPU op, whose tables are all in its own memory, stages
  // nothing. Changes nothing and waits for nothing; bad input stages nothing (the forward
  // reports it).
  m.def("stage_misses(Tensor[] state, Tensor specs, Tensor indices, Tensor lengths, "
        "int[] feature_table, int batch, int[] staged_tables) -> (Tensor, Tensor)");
  // Marks stale every entry of a stage whose row an update may have written: table position
  // t's part of the update is row_ranges[range_of_table[t]] of unique_rows (multi_update's
  // arguments; -1: none).
  m.def("unstage_rows(Tensor(a!) staged_slots, Tensor unique_rows, Tensor row_ranges, "
        "int[] range_of_table) -> ()");
  // Every feature's deduplicated gradient, features in the role of multi_update's tables:
  // (unique_rows, grads, occurrences, slots (empty without lookup_slots), row_ranges,
  // errors). row_ranges: int64 [features, 3] on the device of indices, feature f's unique
  // rows [row_ranges[f][0], row_ranges[f][1]) and where its gradient rows start in grads
  // (csrc/tables.h RowRange). The CPU op sizes every array exactly and raises on bad input
  // (errors empty); the CUDA op, which does not wait for its kernels, sizes them for every
  // lookup a unique row (grads: lookups x the widest dim, zero past the last block), so that
  // the ranges say what is filled, and returns its error bits in errors (int64 [1]). A
  // max-pooled feature's element goes to the lookup the forward's argmax names (required
  // with such features).
  m.def("multi_dedup_backward(Tensor indices, Tensor offsets, Tensor? per_sample_weights, "
        "Tensor grad_output, Tensor specs, int[] feature_table, Tensor? lookup_slots=None, "
        "Tensor? argmax=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Table t's gradient is row_ranges[t] (multi_dedup_backward's layout; ranges ascending and
  // disjoint, gaps allowed). Checks every table's update, then commits all of them only if
  // every table can take its update and every word of `gate` (int64 on the tables' device,
  // e.g. the caller's own decision and the forwards' errors) is 0. Returns the verdict, int64 [tables, 2] on the
  // tables' device: per table its error bits (cache_api.h ErrorBits; the CPU op raises
  // instead) and the smallest row it cannot store or -1. The CUDA op does not wait for its
  // kernels (the gate is applied on the device): the update committed iff `commit`, every
  // verdict row is (0, -1) and the gate is all 0, which the caller learns when it reads them.
  // Table t's update is step counters[t][kSteps] + 1; the caller counts an applied update
  // (count_updates). A commit adds its unique hits, insertions and evictions to
  // device_counts[t]. With commit=false it only checks (a dry run: nothing is changed).
  // staged_slots and staged_rows: a stage (that of the gradient's forward: stage_misses), in
  // which table t is at position staged_table[t] (-1: not in it; one per table); an uncached
  // row is read from it where it holds a fresh copy. The CPU op ignores them.
  m.def("multi_update(Tensor(a!)[] state, Tensor specs, Tensor unique_rows, Tensor grads, "
        "Tensor occurrences, Tensor slot_hints, Tensor row_ranges, float[] value_bounds, "
        "Tensor(b!)[] counters, Tensor(c!)[] device_counts, Tensor? gate=None, "
        "bool commit=True, Tensor? staged_slots=None, Tensor? staged_rows=None, "
        "int[] staged_table=[]) -> Tensor");
  // Writes every cached row back into its table (rounded with the stream of step
  // counters[t][kSteps]) and empties the caches; returns the rows written per table, which
  // it adds to their counters.
  m.def("cache_flush(Tensor(a!)[] state, Tensor specs, Tensor(b!)[] counters) -> int[]");
}

/// The ops of the CPU library only (torch.ops.embcache): no CUDA kernel, or (fold_device_counts)
/// one implementation for every device.
inline void define_cpu_only_ops(torch::Library& m) {
  // Moves each table's device counts into its counters: reads them back from their device
  // (one read for all), adds them (csrc/tables.h, fold_counts) and zeroes them.
  m.def("fold_device_counts(Tensor(a!)[] counters, Tensor(b!)[] device_counts) -> ()");
  // Counts one applied update (multi_update) of each table: its steps, and its unique rows.
  m.def("count_updates(Tensor(a!)[] counters, int[] unique_rows) -> ()");
  // The hit-rate replay of bench/hit_rate.py: a stream of training steps of one table (its
  // spec, as quantize_rows takes it) through its cache alone, with the rule of the update's
  // commit and no row values. Step s looks up indices[step_offsets[s] .. step_offsets[s+1]);
  // a lookup hits when its row is cached before the step's update, as in a training forward.
  // Steps are numbered on from counters[kSteps] (step counters[kSteps] + 1 first, as
  // multi_update). It changes the cache's tags and priorities and the LFU counts as training
  // does, and adds to `counters` what training would: every counter but kFlushed.
  m.def("cache_replay(Tensor(a!) cache_tags, Tensor(b!) cache_priority, Tensor(c!) counts, "
        "Tensor spec, Tensor indices, Tensor step_offsets, Tensor(d!) counters) -> ()");
  // The touched-row telemetry (embcache/telemetry.py): touched[k] |= whether sample key
  // k = (table << 32 | row), keys ascending, is among the unique rows (each table's
  // ascending) that an update of tables[i] committed, rows
  // unique_rows[row_starts[i] .. row_starts[i + 1]). On other devices the group does it
  // with tensor ops.
  m.def("mark_sampled_rows(Tensor unique_rows, int[] row_starts, int[] tables, "
        "Tensor sample_keys, Tensor(a!) touched) -> ()");
  // The overflow check's gradient range (dlrm's trainer): (max |g|, min non-zero |g|) over
  // contiguous float32 tensors, in one pass on all threads; NaN in any makes both NaN, and
  // with no non-zero element the min is inf (0 and inf with no element at all).
  m.def("abs_range(Tensor[] tensors) -> (float, float)");
  // The same range after multiplying every element in place by `scale` (as g.mul_(scale)
  // would, in float32): the trainer's unscale and overflow check in one pass.
  m.def("unscale_abs_range(Tensor(a!)[] tensors, float scale) -> (float, float)");
}

}  // namespace embcache
