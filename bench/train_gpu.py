"""DLRM training on a device: `dlrm train`'s model and step against a plain PyTorch loop (and
TorchRec's FP32 collection where TorchRec runs), on the same batches, in one process.

Engines (each the Kaggle preset's DLRM, 26 tables of Kaggle's cardinalities times --scale):

* ``ours``: what ``dlrm train`` builds -- one ``CachedLowPrecisionEmbeddingBags`` of INT8 rows
  behind a 5% 32-way LFU cache (row-wise AdaGrad), FP16 dense with FP32 masters and loss
  scaling (``MixedPrecisionTrainer``, dense AdaGrad);
* ``plain PyTorch``: 26 ``nn.EmbeddingBag(sparse=True)`` (FP32) updated by SGD, the same DLRM
  dense part in FP32 under ``torch.autocast`` (FP16 on CUDA) with ``GradScaler``, dense AdaGrad;
* ``TorchRec FP32``: TorchRec's ``EmbeddingBagCollection`` in the trainer above (FP32 rows,
  dense AdaGrad over them too); only where TorchRec imports and its ops run on the device
  (not on a GPU machine without FBGEMM's CUDA build), else reported as skipped with why.

Per batch size: --warmup untimed steps, then --rounds rounds in which every engine in turn
trains --steps steps on fresh batches (so that a slow spell falls on every engine); an
engine's samples/s is the median of its rounds. On CUDA each round is timed with CUDA events
(the batches are on the device before it starts), elsewhere with the wall clock. Also per
engine: peak device memory while it was built and warmed up (above what was allocated
before), its tables' bytes, and, under torch.profiler over --profile-steps steps, the host
syncs and kernel launches per step (``_common.runtime_calls``; its device ms in the JSON).

    python bench/train_gpu.py                          # CUDA, Kaggle size, batches 2048,16384
    python bench/train_gpu.py --device cpu --scale 0.001 --batch-sizes 256 --rounds 2
    python bench/train_gpu.py --out bench/results/train_gpu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from _common import environment, environment_markdown, runtime_calls, torch_device, write_text
from torch import nn

from dlrm.build import build_model, build_trainer
from dlrm.config import RunConfig
from dlrm.data.synthetic import SyntheticCriteo
from dlrm.model import DLRM


class PlainTables(nn.Module):
    """26 ``nn.EmbeddingBag(sparse=True)`` read by the ids ``[B, 26]`` (the interface DLRM
    takes without TorchRec: ``forward(ids) -> [B, 26 * dim]`` and ``feature_dims()``)."""

    def __init__(self, cardinalities: list[int], dim: int) -> None:
        super().__init__()
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in cardinalities
        )
        self.dim = dim

    def feature_dims(self) -> list[int]:
        return [self.dim] * len(self.bags)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([bag(ids[:, k : k + 1]) for k, bag in enumerate(self.bags)], 1)


class PlainLoop:
    """The plain PyTorch training step: autocast (FP16 on CUDA, BF16 on the CPU), GradScaler,
    sparse SGD for the tables, AdaGrad for the dense part."""

    def __init__(self, cfg: RunConfig, cardinalities: list[int], device: torch.device) -> None:
        torch.manual_seed(cfg.seed)
        dim = 16  # the Kaggle preset's
        self.model = DLRM.from_preset(cfg.preset, PlainTables(cardinalities, dim)).to(device)
        tables = list(self.model.embedding_collection.parameters())
        ids = {id(p) for p in tables}
        dense = [p for p in self.model.parameters() if id(p) not in ids]
        self.sparse_opt = torch.optim.SGD(tables, lr=cfg.emb_lr)
        self.dense_opt = torch.optim.Adagrad(dense, lr=cfg.lr)
        self.dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        self.scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")
        self.device = device

    def train_step(self, dense, ids, labels) -> None:
        with torch.autocast(self.device.type, dtype=self.dtype):
            logits = self.model(dense, ids)
        loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), labels)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.dense_opt)
        self.scaler.step(self.sparse_opt)
        self.scaler.update()
        self.dense_opt.zero_grad(set_to_none=True)
        self.sparse_opt.zero_grad(set_to_none=True)


def table_bytes(model: nn.Module) -> int:
    """The bytes of the model's tables (ours: ``memory_bytes()``, rows, cache and optimizer
    state; an FP32 collection: its parameters)."""
    tables = model.embedding_collection
    if hasattr(tables, "memory_bytes"):
        return sum(t["total"] for t in tables.memory_bytes().values())
    return sum(p.nbytes for p in tables.parameters())


def engines(cfg: RunConfig, cardinalities: list[int], device: torch.device) -> dict:
    """name -> a builder of (an object with ``train_step(dense, ids, labels)``, its model), or
    -> the reason the engine cannot run here."""

    def ours():
        trainer = build_trainer(cfg, build_model(cfg, cardinalities, device))
        return trainer, trainer.model

    def plain():
        loop = PlainLoop(cfg, cardinalities, device)
        return loop, loop.model

    def torchrec_fp32():
        fp32 = dataclasses.replace(cfg, embeddings="torchrec")
        trainer = build_trainer(fp32, build_model(fp32, cardinalities, device))
        return trainer, trainer.model

    out = {"ours": ours, "plain PyTorch": plain}
    try:
        import torchrec  # noqa: F401

        out["TorchRec FP32"] = torchrec_fp32
    except ImportError as e:
        out["TorchRec FP32"] = f"TorchRec does not import here ({e})"
    return out


def device_batches(gen: SyntheticCriteo, batch: int, count: int, device: torch.device) -> list:
    rows = batch * count * 14 // 12 + 14 * batch  # the train split is 12/14 of the rows
    return [b.to(device) for b in gen.batches(rows, "train", batch, drop_last=True)][:count]


def timed(step, batches, device: torch.device) -> float:
    """Samples/s of ``step`` over ``batches`` (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for b in batches:
            step(b.dense, b.ids, b.labels)
        stop.record()
        stop.synchronize()
        seconds = start.elapsed_time(stop) / 1e3
    else:
        begin = time.perf_counter()
        for b in batches:
            step(b.dense, b.ids, b.labels)
        seconds = time.perf_counter() - begin
    return sum(len(b.labels) for b in batches) / seconds


def measure(args, batch: int, device: torch.device) -> dict:
    """Every engine at batch size ``batch`` (module docstring)."""
    gen = SyntheticCriteo(scale=args.scale, seed=0)
    cfg = RunConfig(batch_size=batch, progress=False)
    count = args.warmup + args.profile_steps + args.rounds * args.steps
    batches = device_batches(gen, batch, count, device)
    built, out = {}, {}
    for name, build in engines(cfg, gen.cardinalities, device).items():
        if isinstance(build, str):
            out[name] = {"skipped": build}
            continue
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            engine, model = build()
            timed(engine.train_step, batches[: args.warmup], device)
        except (RuntimeError, NotImplementedError) as e:  # e.g. TorchRec's ops on this device
            out[name] = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            continue
        peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
        built[name] = engine
        profiled = batches[args.warmup : args.warmup + args.profile_steps]

        def run(engine=engine, profiled=profiled):
            for b in profiled:
                engine.train_step(b.dense, b.ids, b.labels)

        out[name] = {
            "table_bytes": table_bytes(model),
            "peak_device_memory_bytes": peak,
            **runtime_calls(run, len(profiled), device),
            "rounds": [],
        }
    first = args.warmup + args.profile_steps
    for r in range(args.rounds):
        timed_batches = batches[first + r * args.steps : first + (r + 1) * args.steps]
        for name, engine in built.items():
            out[name]["rounds"].append(timed(engine.train_step, timed_batches, device))
    for name in built:
        out[name]["samples_per_second"] = statistics.median(out[name]["rounds"])
    return out


def markdown(env: dict, args, results: dict) -> str:
    lines = ["# DLRM training on a device", "", environment_markdown(env), ""]
    lines += [
        f"Kaggle preset, 26 tables of Kaggle's cardinalities x {args.scale} on {args.device}; "
        f"{args.warmup} warm-up steps, median of {args.rounds} rounds of {args.steps} steps "
        "(engines in turn); syncs and launches per step under torch.profiler.",
        "",
        "| batch | engine | samples/s | vs plain | peak device memory | table bytes | "
        "vs plain | syncs | launches |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch, engines_ in results.items():
        plain = engines_.get("plain PyTorch", {})
        for name, r in engines_.items():
            if "skipped" in r:
                lines.append(f"| {batch} | {name} | skipped: {r['skipped']} | | | | | | |")
                continue
            speed = r["samples_per_second"] / plain["samples_per_second"]
            size = r["table_bytes"] / plain["table_bytes"]
            peak = r["peak_device_memory_bytes"]
            cells = [
                str(batch),
                name,
                f"{r['samples_per_second']:,.0f}",
                f"{speed:.2f}x",
                "-" if peak is None else f"{peak / 2**30:.2f} GiB",
                f"{r['table_bytes'] / 2**30:.3f} GiB",
                f"{size:.2f}x",
                "-" if r["syncs"] is None else f"{r['syncs']:g}",
                "-" if r["launches"] is None else f"{r['launches']:g}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    p.add_argument("--scale", type=float, default=1.0, help="Kaggle cardinalities times this")
    p.add_argument("--batch-sizes", default="2048,16384", help="comma-separated")
    p.add_argument("--steps", type=int, default=20, help="timed steps per engine per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--profile-steps", type=int, default=5, help="steps under torch.profiler")
    p.add_argument("--out", type=Path, help="write train_gpu.md and train_gpu.json here")
    args = p.parse_args()
    device = torch_device(args.device)
    env = environment(__file__, gpu=device.type == "cuda")
    results = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        results[batch] = measure(args, batch, device)
        print(json.dumps({batch: results[batch]}, indent=1))
    md = markdown(env, args, results)
    print("\n" + md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"environment": env, "args": vars(args) | {"out": str(args.out)}}
        write_text(args.out / "train_gpu.json", json.dumps(result | {"results": results}, indent=1))
        write_text(args.out / "train_gpu.md", md)
        print(f"wrote {args.out}/train_gpu.md, train_gpu.json")


if __name__ == "__main__":
    main()
