"""Full embedding training step (forward, backward, update) on a skewed Criteo-like trace.

26 tables with the Criteo-Kaggle cardinalities (capped by --max-rows), batch 2048, one id per
table per sample, ids drawn from a per-table power law (--trace powerlaw) or from the
calibrated synthetic Kaggle generator (--trace kaggle: the hit rate training sees). In one run
it times:

* ours: INT8 + 5% 32-way LFU cache (stochastic rounding, SGD)
* ours: FP32, no cache (SGD)
* FBGEMM CPU TBE, FP32, EXACT_SGD (all tables in one fused op)
* nn.EmbeddingBag(sparse=True) + torch.optim.SGD

and prints ms/step, lookups/s, embedding memory and the ratios against FBGEMM, under the
command, commit, machine and library versions (bench/_common.environment); --out DIR also
writes them to DIR/embedding_step.md and DIR/embedding_step.json.

Every engine first trains --warmup steps, so that the cache is in its steady state (a 5% cache
of a 10M-row table takes a few hundred steps to fill). Then --rounds rounds each time every
engine over --steps fresh steps, the engines in turn, so that a slow spell of a shared machine
falls on all of them; an engine's figure is the median of its per-round means. Its speed vs
FBGEMM is given both as the ratio of those medians and as the median of the per-round ratios
(FBGEMM's round time over the engine's, the two timed within seconds of each other): when a
busy spell hits some rounds the two differ, and the per-round one is the fairer comparison.

Every engine is put on the same memory footing (bench/_common.same_memory_footing): huge
pages for all (EMBCACHE_HUGE_PAGES=0: for none), and glibc keeping freed memory
(EMBCACHE_KEEP_FREED_MEMORY=0: glibc's defaults; at --max-rows 20000 its adaptive trimming
once cost ours ~1600 page faults, ~1 ms, a step, and FBGEMM ~800). The script prints each
engine's page faults per timed step and the share of its rows on huge pages.
Example:

    python bench/embedding_step.py                      # dim 16, full Kaggle cardinalities
    python bench/embedding_step.py --dim 128 --max-rows 2000000
    python bench/embedding_step.py --rounds 7 --out bench/results/embedding_step
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

from _common import (
    environment,
    environment_markdown,
    huge_page_share,
    memory_footing_words,
    progress,
    same_memory_footing,
    write_text,
)

FOOTING = same_memory_footing()  # before torch is imported

import torch  # noqa: E402
from torch import nn  # noqa: E402

import embcache  # noqa: E402
from dlrm.data.criteo import KAGGLE_CARDINALITIES  # noqa: E402


def kaggle_trace(cards, batch, steps, seed):
    """Per step, per table: int64 ids of the calibrated synthetic Kaggle generator
    (dlrm.data.synthetic, fitted to the skew of real Criteo rows: the hit rate training
    sees), folded into ``cards`` rows where --max-rows caps a table."""
    from dlrm.data.synthetic import SyntheticCriteo

    sparse = torch.from_numpy(SyntheticCriteo(scale=1.0, seed=seed).rows(0, batch * steps)[1])
    sparse = sparse.long() % torch.tensor(cards)
    return [
        [sparse[k * batch : (k + 1) * batch, t].contiguous() for t in range(len(cards))]
        for k in range(steps)
    ]


def trace(cards, batch, steps, alpha, seed):
    """Per step, per table: int64 ids; rank r = floor(N * u^alpha) mapped through a fixed
    random permutation, so a few hot rows take most lookups (as in Criteo)."""
    gen = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(n, generator=gen) for n in cards]
    return [
        [
            perms[t][(torch.rand(batch, generator=gen) ** alpha * n).long()]
            for t, n in enumerate(cards)
        ]
        for _ in range(steps)
    ]


class Ours:
    """Our collection: all tables in one table-batched forward, backward and update."""

    def __init__(self, cards, dim, **options):
        from torchrec.modules.embedding_configs import EmbeddingBagConfig

        tables = [
            EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{i}"]
            )
            for i, n in enumerate(cards)
        ]
        self.ebc = embcache.CachedLowPrecisionEmbeddingBagCollection(tables, lr=0.01, **options)

    def prepare(self, ids):
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        values = torch.cat(ids)
        return KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(len(ids))],
            values=values,
            lengths=torch.ones(values.numel(), dtype=torch.int32),
        )

    def step(self, kjt, grad):
        self.ebc(kjt).values().backward(grad)
        self.ebc.step()

    def memory(self):
        return sum(m["total"] for m in self.ebc.memory_bytes().values())

    def weights(self):
        return [t.weights for t in self.ebc.embedding_bags.values()]

    def lookups_and_hits(self):
        """Lookups and hits of the tables that have a cache (tables under
        min_rows_for_low_precision rows stay FP32 without one), as `dlrm train` reports them."""
        s = [t.stats() for t in self.ebc.embedding_bags.values() if t.config.num_slots > 0]
        return sum(x["lookups"] for x in s), sum(x["hits"] for x in s)


class EmbeddingBagSGD:
    def __init__(self, cards, dim):
        self.tables = [nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in cards]
        self.opt = torch.optim.SGD([t.weight for t in self.tables], lr=0.01)

    def prepare(self, ids):
        return ids

    def step(self, ids, grad):
        self.opt.zero_grad()
        offsets = torch.arange(ids[0].numel())
        outs = [t(i, offsets) for t, i in zip(self.tables, ids)]
        torch.cat(outs, dim=1).backward(grad)
        self.opt.step()

    def memory(self):
        return sum(t.weight.nbytes for t in self.tables)

    def weights(self):
        return [t.weight for t in self.tables]


class FbgemmTBE:
    def __init__(self, cards, dim):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(n, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in cards],
            optimizer=EmbOptimType.EXACT_SGD,
            learning_rate=0.01,
            pooling_mode=PoolingMode.SUM,
        )

    def prepare(self, ids):
        indices = torch.cat(ids)
        return indices, torch.arange(indices.numel() + 1)  # one id per bag

    def step(self, batch, grad):
        self.tbe(*batch).backward(grad)  # the update is fused into backward

    def memory(self):
        return sum(w.nbytes for w in self.tbe.split_embedding_weights())

    def weights(self):
        return [self.tbe.weights_host]


def run_steps(engine, batches, grad):
    """Seconds and minor page faults per step over batches (inputs prepared beforehand,
    outside the clock)."""
    inputs = [engine.prepare(ids) for ids in batches]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for x in inputs:
        engine.step(x, grad)
    seconds = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return seconds / len(inputs), faults / len(inputs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--max-rows", type=int, default=None, help="cap each table's rows")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=300, help="untimed steps first (cache fill)")
    p.add_argument(
        "--trace",
        choices=["powerlaw", "kaggle"],
        default="powerlaw",
        help="ids from a power law (--alpha), or from the calibrated synthetic Kaggle generator",
    )
    p.add_argument("--alpha", type=float, default=4.0, help="power-law exponent of the trace")
    p.add_argument("--json", help="also write the results here")
    p.add_argument(
        "--out", type=Path, help="write embedding_step.md and embedding_step.json in this directory"
    )
    args = p.parse_args()
    env = environment(__file__, threads=torch.get_num_threads())
    cards = [min(n, args.max_rows) if args.max_rows else n for n in KAGGLE_CARDINALITIES]
    total_steps = args.warmup + args.rounds * args.steps
    if args.trace == "kaggle":
        batches = kaggle_trace(cards, args.batch, total_steps, seed=0)
    else:
        batches = trace(cards, args.batch, total_steps, args.alpha, seed=0)
    grad = torch.randn(args.batch, len(cards) * args.dim) * 1e-2
    engines = {
        "ours int8 + 5% 32-way LFU": Ours(
            cards, args.dim, precision="int8", cache_ratio=0.05, associativity=32, policy="lfu"
        ),
        "ours fp32, no cache": Ours(cards, args.dim, precision="fp32", cache_ratio=0),
        "FBGEMM TBE fp32 EXACT_SGD": FbgemmTBE(cards, args.dim),
        "nn.EmbeddingBag + SGD": EmbeddingBagSGD(cards, args.dim),
    }
    for engine in progress(engines.values(), desc="warm-up", unit="engine"):
        for k in range(0, args.warmup, args.steps):
            run_steps(engine, batches[k : min(k + args.steps, args.warmup)], grad)
    counted = {name: e.lookups_and_hits() for name, e in engines.items() if isinstance(e, Ours)}
    per_round = {name: [] for name in engines}
    faults = {name: [] for name in engines}
    for r in progress(range(args.rounds), desc="timed rounds"):
        timed = batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]
        for name, engine in engines.items():
            sec, fault = run_steps(engine, timed, grad)
            per_round[name].append(sec)
            faults[name].append(fault)
    rows = {}
    for name, engine in engines.items():
        sec = statistics.median(per_round[name])
        hit_rate = None
        if name in counted:
            lookups, hits = (a - b for a, b in zip(engine.lookups_and_hits(), counted[name]))
            hit_rate = hits / max(1, lookups)
        rows[name] = {
            "ms_per_step": sec * 1e3,
            "ms_per_step_rounds": [x * 1e3 for x in per_round[name]],
            "lookups_per_s": len(cards) * args.batch / sec,
            "memory_bytes": engine.memory(),
            "hit_rate": hit_rate,
            "page_faults_per_step": statistics.mean(faults[name]),
            "huge_pages": huge_page_share(engine.weights()),
        }
    ref = rows["FBGEMM TBE fp32 EXACT_SGD"]
    lines = [
        f"# Embedding training step, dim {args.dim}",
        "",
        environment_markdown(env),
        "",
        f"{len(cards)} tables, {sum(cards):,} rows, dim {args.dim}, batch {args.batch}, "
        + (
            "ids of the calibrated synthetic Kaggle generator, "
            if args.trace == "kaggle"
            else f"power-law ids (alpha {args.alpha}), "
        )
        + f"{torch.get_num_threads()} threads, {args.warmup} warm-up steps, "
        f"median of {args.rounds} rounds of {args.steps} steps, "
        f"{memory_footing_words(FOOTING)}.",
        "",
        "| engine | ms/step | Mlookups/s | memory MB | speed vs FBGEMM | speed vs FBGEMM, "
        "per-round median | memory vs FBGEMM | hit rate (cached tables) | page faults/step "
        "| rows on huge pages |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        r["speed_vs_fbgemm"] = ref["ms_per_step"] / r["ms_per_step"]
        r["speed_vs_fbgemm_rounds"] = [
            a / b for a, b in zip(ref["ms_per_step_rounds"], r["ms_per_step_rounds"])
        ]
        r["speed_vs_fbgemm_round_median"] = statistics.median(r["speed_vs_fbgemm_rounds"])
        r["memory_vs_fbgemm"] = r["memory_bytes"] / ref["memory_bytes"]
        hr = "" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        huge = "" if r["huge_pages"] is None else f"{r['huge_pages']:.0%}"
        lines.append(
            f"| {name} | {r['ms_per_step']:.1f} | {r['lookups_per_s'] / 1e6:.2f} | "
            f"{r['memory_bytes'] / 2**20:.0f} | {r['speed_vs_fbgemm']:.2f}x | "
            f"{r['speed_vs_fbgemm_round_median']:.2f}x | "
            f"{r['memory_vs_fbgemm']:.3f}x | {hr} | {r['page_faults_per_step']:.0f} | {huge} |"
        )
    ebag = rows["nn.EmbeddingBag + SGD"]["ms_per_step"]
    fp32_vs_ebag = ebag / rows["ours fp32, no cache"]["ms_per_step"]
    lines += ["", f"ours fp32 vs nn.EmbeddingBag: {fp32_vs_ebag:.2f}x", ""]
    md = "\n".join(lines)
    print("\n" + md)
    result = {
        "environment": env,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **FOOTING,
        "ours_fp32_vs_embedding_bag": fp32_vs_ebag,
        "results": rows,
    }
    if args.json:
        write_text(args.json, json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_text(args.out / "embedding_step.md", md)
        write_text(args.out / "embedding_step.json", json.dumps(result, indent=2))
        print(f"wrote {args.out}/embedding_step.md, embedding_step.json")


if __name__ == "__main__":
    main()
