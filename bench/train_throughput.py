"""Training throughput of DLRM: our INT8 + 5% LFU-cached tables versus TorchRec's FP32
EmbeddingBagCollection, on the same synthetic batches, in one run.

Each engine trains the same model (same preset, dense precision, optimizer) on the same
batches: --warmup untimed steps, then --rounds rounds in which every engine in turn trains
--steps fresh steps, so that a slow spell of a shared machine falls on both engines (as in
bench/embedding_step.py); an engine's figure is the median of its per-round samples/s. The
table prints samples/s and the ratio (target >= 1.0), under
the command, commit, machine and library versions (bench/_common.environment); --out DIR also
writes them to DIR/train_throughput.md and DIR/train_throughput.json.

The batches are drawn in memory from the synthetic generator, as many as the steps take, not
read from a data directory: so the script has --scale (Kaggle cardinalities times this,
default 0.01, tables small enough for a quick CPU comparison) rather than dlrm train's data
options, whose --data and --synthetic-rows would mean nothing here.

    python bench/train_throughput.py                       # scale 0.01: tables up to ~100k rows
    python bench/train_throughput.py --dense-precision fp32 --scale 0.05
    python bench/train_throughput.py --out bench/results/train_throughput
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path

from _common import (
    environment,
    environment_markdown,
    memory_footing_words,
    same_memory_footing,
    write_text,
)

FOOTING = same_memory_footing()  # before torch is imported

import torch  # noqa: E402

logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

from dlrm.build import build_model, build_trainer  # noqa: E402
from dlrm.config import RunConfig  # noqa: E402
from dlrm.data.synthetic import SyntheticCriteo  # noqa: E402
from dlrm.mixed_precision import DENSE_PRECISIONS  # noqa: E402
from dlrm.model import PRESETS  # noqa: E402


def train_steps(trainer, batches) -> float:
    """Samples/s of ``trainer`` over ``batches``."""
    start = time.perf_counter()
    for b in batches:
        trainer.train_step(b.dense, b.ids, b.labels)
    return sum(len(b.labels) for b in batches) / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=0.01, help="Kaggle cardinalities times this")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps per engine per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--dense-precision", choices=DENSE_PRECISIONS, default="fp16")
    p.add_argument("--preset", choices=list(PRESETS), default="kaggle")
    p.add_argument("--json", help="also write the results here")
    p.add_argument(
        "--out",
        type=Path,
        help="write train_throughput.md and train_throughput.json in this directory",
    )
    args = p.parse_args()
    env = environment(__file__, threads=torch.get_num_threads())
    gen = SyntheticCriteo(scale=args.scale, seed=0)
    total = args.warmup + args.rounds * args.steps
    n = args.batch_size * total
    batches = list(
        gen.batches(n * 14 // 12 + 14 * args.batch_size, "train", args.batch_size, drop_last=True)
    )
    batches = batches[:total]
    base = RunConfig(preset=args.preset, dense_precision=args.dense_precision, progress=False)
    engines = {
        "embcache int8 + 5% 32-way LFU": dataclasses.replace(
            base,
            embeddings="embcache",
            precision="int8",
            cache_ratio=0.05,
            associativity=32,
            policy="lfu",
        ),
        "TorchRec EBC fp32": dataclasses.replace(base, embeddings="torchrec"),
    }
    trainers = {
        name: build_trainer(cfg, build_model(cfg, gen.cardinalities))
        for name, cfg in engines.items()
    }
    for trainer in trainers.values():
        train_steps(trainer, batches[: args.warmup])
    per_round = {name: [] for name in trainers}
    for r in range(args.rounds):
        timed = batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]
        for name, trainer in trainers.items():
            per_round[name].append(train_steps(trainer, timed))
    results = {name: statistics.median(x) for name, x in per_round.items()}
    ratio = results["embcache int8 + 5% 32-way LFU"] / results["TorchRec EBC fp32"]
    md = "\n".join(
        [
            "# DLRM training throughput",
            "",
            environment_markdown(env),
            "",
            f"Synthetic data, scale {args.scale}: {sum(gen.cardinalities):,} rows; batch "
            f"{args.batch_size}, preset {args.preset}, dense {args.dense_precision}, "
            f"{torch.get_num_threads()} threads, {args.warmup} warm-up steps, median of "
            f"{args.rounds} rounds of {args.steps} steps (engines in turn); "
            f"{memory_footing_words(FOOTING)}.",
            "",
            "| engine | samples/s |",
            "|---|---:|",
            *(f"| {name} | {sps:,.0f} |" for name, sps in results.items()),
            "",
            f"ratio (ours / TorchRec): {ratio:.2f}x",
            "",
        ]
    )
    print("\n" + md)
    result = {
        "environment": env,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": sum(gen.cardinalities),
        **FOOTING,
        "samples_per_second": results,
        "samples_per_second_rounds": per_round,
        "ratio": ratio,
    }
    if args.json:
        write_text(args.json, json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_text(args.out / "train_throughput.md", md)
        write_text(args.out / "train_throughput.json", json.dumps(result, indent=2))
        print(f"wrote {args.out}/train_throughput.md, train_throughput.json")


if __name__ == "__main__":
    main()
