"""Training throughput of DLRM: our INT8 + 5% LFU-cached tables versus TorchRec's FP32
EmbeddingBagCollection, on the same synthetic batches, in one run.

Each engine trains the same model (same preset, dense precision, optimizer) for --steps
steps after --warmup steps; the table prints samples/s and the ratio (target >= 1.0).

    python bench/train_throughput.py                       # scale 0.01: tables up to ~100k rows
    python bench/train_throughput.py --dense-precision fp32 --scale 0.05
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time

import torch

logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

from _common import write_text  # noqa: E402

from dlrm.data.synthetic import SyntheticCriteo  # noqa: E402
from dlrm.train import RunConfig, build_model, build_trainer  # noqa: E402


def samples_per_second(cfg: RunConfig, cards, batches, warmup: int) -> float:
    trainer = build_trainer(cfg, build_model(cfg, cards))
    for b in batches[:warmup]:
        trainer.train_step(b.dense, b.sparse, b.labels)
    start = time.perf_counter()
    for b in batches[warmup:]:
        trainer.train_step(b.dense, b.sparse, b.labels)
    return sum(len(b.labels) for b in batches[warmup:]) / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=0.01, help="Kaggle cardinalities times this")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dense-precision", choices=["fp32", "fp16"], default="fp16")
    p.add_argument("--preset", choices=["kaggle", "paper"], default="kaggle")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    gen = SyntheticCriteo(scale=args.scale, seed=0)
    n = args.batch_size * (args.steps + args.warmup)
    batches = list(
        gen.batches(n * 14 // 12 + 14 * args.batch_size, "train", args.batch_size, drop_last=True)
    )
    batches = batches[: args.steps + args.warmup]
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
    results = {
        name: samples_per_second(cfg, gen.cardinalities, batches, args.warmup)
        for name, cfg in engines.items()
    }
    ratio = results["embcache int8 + 5% 32-way LFU"] / results["TorchRec EBC fp32"]
    print(
        f"\n{sum(gen.cardinalities):,} rows, batch {args.batch_size}, dense {args.dense_precision}, "
        f"{torch.get_num_threads()} threads, {args.steps} timed steps"
    )
    print("| engine | samples/s |\n|---|---:|")
    for name, sps in results.items():
        print(f"| {name} | {sps:,.0f} |")
    print(f"ratio (ours / TorchRec): {ratio:.2f}x")
    if args.json:
        write_text(
            args.json,
            json.dumps(
                {"args": vars(args), "samples_per_second": results, "ratio": ratio}, indent=2
            ),
        )


if __name__ == "__main__":
    main()
