// The schemas of the table ops, written once: the CPU library (torch.ops.embcache, whose CUDA
// implementations register under the same names) and the emulated CUDA kernels
// (torch.ops.embcache_emu) define the same ops (define_cache_ops); the CPU library alone
// defines define_cpu_only_ops.
//
// Table-batched ops take their tables as `state` (kNumStateTensors tensors per table, in the
// order of EMBCACHE_STATE_TENSORS, table after table), `specs` (one spec row per table,
// csrc/include/embcache/table_spec.h) and `counters` (one int64 CPU tensor per table, which
// the op adds to). Feature f of a KeyedJaggedTensor is bags [f * batch, (f + 1) * batch) of the
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
  // lookup's slot, each feature's value bound, argmax) and adds each feature's lookups and
  // hits to its table's counters (none if the list is empty). argmax: int32 [batch, sum of
  // the max-pooled features' dims] (csrc/tables.h, argmax_columns), the position in indices
  // of the lookup each max-pooled element came from, -1 for an empty bag (no columns, no
  // memory, without such features).
  m.def("multi_lookup_forward(Tensor[] state, Tensor specs, Tensor indices, Tensor lengths, "
        "Tensor? per_sample_weights, int[] feature_table, int batch, Tensor(a!)[] counters) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Every feature's deduplicated gradient, features in the role of multi_update's tables:
  // (unique_rows, grads, occurrences, slots (empty without lookup_slots), row_starts). A
  // max-pooled feature's element goes to the lookup the forward's argmax names (required
  // with such features).
  m.def("multi_dedup_backward(Tensor indices, Tensor offsets, Tensor? per_sample_weights, "
        "Tensor grad_output, Tensor specs, int[] feature_table, Tensor? lookup_slots=None, "
        "Tensor? argmax=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Checks every table's update, then commits all of them only if every table can take its
  // update: returns per table the smallest row it cannot store or -1; if any table has such a
  // row, no state is changed. Table t's update is step counters[t][kSteps] + 1; a commit adds
  // its steps and unique rows to its counters, and its unique hits, insertions and evictions
  // to commit_counts[t] (int64 [3] on the table's device), which fold_commit_counts moves
  // into the counters (csrc/tables.h, classify_rows). With commit=false it only checks (a dry
  // run: nothing is changed either way).
  m.def("multi_update(Tensor(a!)[] state, Tensor specs, Tensor unique_rows, Tensor grads, "
        "Tensor occurrences, Tensor slot_hints, int[] row_starts, float[] value_bounds, "
        "Tensor(b!)[] counters, Tensor(c!)[] commit_counts, bool commit=True) -> int[]");
  // Writes every cached row back into its table (rounded with the stream of step
  // counters[t][kSteps]) and empties the caches; returns the rows written per table, which
  // it adds to their counters.
  m.def("cache_flush(Tensor(a!)[] state, Tensor specs, Tensor(b!)[] counters) -> int[]");
}

/// The ops of the CPU library only (torch.ops.embcache): no CUDA kernel, or (fold_commit_counts)
/// one implementation for every device.
inline void define_cpu_only_ops(torch::Library& m) {
  // Moves each table's commit counts (multi_update) into its counters: reads them back from
  // their device, adds them (csrc/tables.h, classify_rows) and zeroes them.
  m.def("fold_commit_counts(Tensor(a!)[] counters, Tensor(b!)[] commit_counts) -> ()");
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
