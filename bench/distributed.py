"""DLRM training over 1 and 2 processes (gloo, CPU): samples/s and what each rank sends per
step, ours against TorchRec's own sharded FP32 EmbeddingBagCollection, in one run.

Both engines train the same DLRM (preset kaggle, FP32 dense: TorchRec has no FP16
master-weight path; dense AdaGrad) on the same global batches, each rank reading its part of
every batch from the same memory-mapped dataset, chosen by dlrm train's data options
(--data, --synthetic-rows, --synthetic-scale, also taken as --rows, --scale; here 2M
synthetic rows by default, generated once under --data-root):

* ours: INT8 tables behind a 5% 32-way LFU cache, row-wise AdaGrad, sharded by our sharder
  with the plan of TorchRec's planner fed our bytes (``dlrm.distributed.shard``), trained by
  ``MixedPrecisionTrainer`` (one decision all-reduce per step);
* TorchRec: FP32 tables, FBGEMM's fused row-wise AdaGrad (``EXACT_ROWWISE_ADAGRAD``),
  sharded by TorchRec's ``EmbeddingBagCollectionSharder`` with its default planner.

Per (engine, processes): --warmup untimed steps, then --steps timed steps; samples/s is the
global batch times steps over the wall time of rank 0. Each is run --repeats times, the
engines interleaved; the table gives the median and range, and of ours against TorchRec
the median and range of the per-round ratios. Bytes sent per rank per step: the
payload each rank hands to the Python collectives (KJT and pooled all-to-alls,
reduce-scatter, all-gather, all-reduce; counted by wrapping ``torch.distributed``'s
functions, so TorchRec's and ours alike) plus DDP's all-reduce of the dense gradients
(computed: its bytes are the dense gradients'). Embedding memory per rank: ours measured
(``memory_bytes`` of the rank's shards); TorchRec's from its shard sizes (FP32 rows plus one
FP32 AdaGrad accumulator per row). On a 2-core machine two processes share the cores, so
the 2-process figure measures the overheads of sharding, not a speed-up. Every process of
either engine is on the same memory footing as in bench/embedding_step.py (huge pages, freed
memory kept: bench/_common.same_memory_footing).

    python bench/distributed.py --out bench/results/distributed
"""

from __future__ import annotations

import inspect
import json
import logging
import socket
import statistics
import time
import warnings
from pathlib import Path

from _common import (
    environment,
    environment_markdown,
    memory_footing_words,
    parser,
    same_memory_footing,
    write_text,
)

FOOTING = same_memory_footing()  # before torch is imported; again in each worker

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

ENGINES = ("ours", "torchrec")


def _count_collectives(counter: dict) -> None:
    """Wrap torch.distributed's collectives to add each call's input bytes to ``counter``."""
    for name, arg in (
        ("all_to_all_single", "input"),
        ("all_reduce", "tensor"),
        ("reduce_scatter_tensor", "input"),
        ("all_gather_into_tensor", "input_tensor"),
    ):
        original = getattr(dist, name)
        signature = inspect.signature(original)

        def counted(*args, _original=original, _sig=signature, _name=name, _arg=arg, **kwargs):
            t = _sig.bind(*args, **kwargs).arguments[_arg]
            counter[_name] = counter.get(_name, 0) + t.numel() * t.element_size()
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def _worker(rank: int, world: int, port: int, engine: str, args: dict, data: str, queue) -> None:
    same_memory_footing()  # glibc's settings are the process's own
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    torch.set_num_threads(max(1, args["threads"] // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        queue.put((rank, _measure(rank, world, engine, args, data)))
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, engine: str, args: dict, data: str) -> dict:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from dlrm import distributed
    from dlrm.build import build_model
    from dlrm.config import RunConfig
    from dlrm.data import batches as data_batches
    from dlrm.mixed_precision import MixedPrecisionTrainer
    from dlrm.model import DLRM, SPARSE_KEYS
    from dlrm.torchrec_adapter import make_torchrec_ebc

    dataset = data_batches.load(data)
    cards = list(dataset.meta["cardinalities"])
    ranks = distributed.Ranks(rank, world, dist.group.WORLD)
    cfg = RunConfig(
        batch_size=args["batch_size"], dense_precision="fp32", optimizer="adagrad", lr=0.01
    )
    if engine == "ours":
        model = build_model(cfg, cards, tables_on_meta=True, keyed=True)
        model = distributed.shard(model, ranks, cfg.batch_size)
        trainer = MixedPrecisionTrainer(
            model, dense_precision="fp32", optimizer="adagrad", lr=cfg.lr
        )
        step = trainer.train_step
        sharded = model.module.embedding_collection
        memory = sum(t.memory_bytes()["total"] for t in sharded.local_tables().values())
    else:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        torch.manual_seed(cfg.seed)
        model = DLRM.from_preset(cfg.preset, make_torchrec_ebc(cards, 16, SPARSE_KEYS))
        sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
        )
        # as ours: table-wise or row-wise, the fused kernel (not data-parallel tables)
        constraints = {
            f"t_{k}": ParameterConstraints(
                sharding_types=["table_wise", "row_wise"], compute_kernels=["fused"]
            )
            for k in range(len(cards))
        }
        plan = EmbeddingShardingPlanner(
            Topology(world_size=world, compute_device="cpu"), constraints=constraints
        ).collective_plan(model, [sharder], dist.group.WORLD)
        model = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=torch.device("cpu"),
            plan=plan,
            sharders=[sharder],
        )
        dense = dict(in_backward_optimizer_filter(model.named_parameters()))
        optimizer = torch.optim.Adagrad(dense.values(), lr=cfg.lr)

        def step(x, sparse, labels):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x, sparse), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        memory = 0
        for shards in model.plan.plan["embedding_collection"].values():
            for shard in shards.sharding_spec.shards:
                if f"rank:{rank}/" in str(shard.placement):
                    rows, dim = shard.shard_sizes
                    memory += rows * dim * 4 + rows * 4
    dense_bytes = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if "embedding_collection" not in n
    )
    batches = data_batches.iterate_batches(
        dataset, "train", cfg.batch_size, shuffle=True, drop_last=True, part=ranks.part
    )
    for _ in range(args["warmup"]):
        b = next(batches)
        step(b.dense, b.ids, b.labels)
    counter: dict = {}
    _count_collectives(counter)
    phases_before = trainer.phase_seconds if engine == "ours" else {}
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args["steps"]):
        b = next(batches)
        step(b.dense, b.ids, b.labels)
    dist.barrier()
    seconds = time.perf_counter() - start
    # ours: the trainer's own timer, ms per step by phase (docs/design.md, trainer costs)
    phase_ms = {
        k: (v - phases_before[k]) * 1e3 / args["steps"]
        for k, v in (trainer.phase_seconds.items() if engine == "ours" else [])
    }
    sent = {k: v / args["steps"] for k, v in counter.items()}
    if world > 1:
        sent["ddp_all_reduce (dense gradients)"] = dense_bytes
    return {
        "samples_per_second": args["steps"] * cfg.batch_size / seconds,
        "bytes_sent_per_step": sent,
        "bytes_sent_per_step_total": sum(sent.values()),
        "embedding_memory_bytes": memory,
        "phase_ms_per_step": phase_ms,
    }


# the phases of our trainer's step that check it (dlrm.mixed_precision.trainer.PHASES)
CHECK_PHASES = ("unscale_check", "dry_run", "decision", "backup", "dense_check")


def run(engine: str, world: int, args: dict, data: str) -> list[dict]:
    """Every rank's figures of ``engine`` trained by ``world`` processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(
        _worker,
        args=(world, port, engine, args, data, queue),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    out = dict(queue.get() for _ in range(world))
    return [out[r] for r in range(world)]


def main() -> None:
    from dlrm.build import resolve_data
    from dlrm.cli import add_data_options
    from dlrm.config import RunConfig

    p = parser(__doc__)
    add_data_options(p, old_names=True)  # docs/scaling.md's command says --scale, --rows
    p.set_defaults(synthetic_rows=2_000_000)
    p.add_argument("--batch-size", type=int, default=2048, help="global batch")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="runs of each; the median is shown")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument(
        "--data-root",
        type=Path,
        default=Path("runs/bench-distributed"),
        help="the synthetic data goes to DATA_ROOT/data/ (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, help="write distributed.md and distributed.json here")
    args = p.parse_args()
    cfg = RunConfig(
        data=args.data, synthetic_rows=args.synthetic_rows, synthetic_scale=args.synthetic_scale
    )
    data = resolve_data(cfg, args.data_root)
    env = environment(__file__, threads=args.threads)
    shared = {k: getattr(args, k) for k in ("batch_size", "steps", "warmup", "threads")}
    results: dict[str, list] = {}  # name -> one list of every rank's figures per repeat
    for repeat in range(args.repeats):  # interleaved, so drift hits every engine alike
        for world in (1, 2):
            for engine in ENGINES:
                ranks = run(engine, world, shared, str(data))
                name = f"{engine}, {world} process{'es' if world > 1 else ''}"
                results.setdefault(name, []).append(ranks)
                r0 = ranks[0]
                print(
                    f"[{repeat + 1}/{args.repeats}] {engine} x{world}: "
                    f"{r0['samples_per_second']:,.0f} samples/s, sent per rank per step "
                    f"{[round(r['bytes_sent_per_step_total'] / 2**20, 2) for r in ranks]} MiB, "
                    f"embeddings per rank "
                    f"{[round(r['embedding_memory_bytes'] / 2**20, 1) for r in ranks]} MiB"
                )
    md = _markdown(env, args, data, results)
    print("\n" + md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_text(args.out / "distributed.md", md)
        payload = {
            "environment": env,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            **FOOTING,
            "results": results,
        }
        write_text(args.out / "distributed.json", json.dumps(payload, indent=2))
        print(f"wrote {args.out}/distributed.md, distributed.json")


def _markdown(env: dict, args, data: Path, results: dict) -> str:
    meta = json.loads((data / "meta.json").read_text())
    what = (
        f"Synthetic data at scale {args.synthetic_scale}"
        if args.data == "synthetic"
        else f"Data {args.data}"
    )
    lines = [
        "# Distributed DLRM training (gloo, CPU)",
        "",
        environment_markdown(env),
        "",
        f"{what} ({sum(meta['cardinalities']):,} rows in 26 "
        f"tables, dim 16), global batch {args.batch_size}, {args.warmup} warm-up and "
        f"{args.steps} timed steps, {args.threads} threads shared by the processes; "
        f"{args.repeats} runs of each, interleaved; {memory_footing_words(FOOTING)}.",
        "",
        "| engine, processes | samples/s, median (range) | ours / TorchRec, median (range) | "
        "sent per rank per step (MiB) | embeddings per rank (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        speeds = [ranks[0]["samples_per_second"] for ranks in runs]
        ratio = "–"
        if name.startswith("ours"):
            peer = results[name.replace("ours", "torchrec")]
            ratios = [a / b[0]["samples_per_second"] for a, b in zip(speeds, peer)]
            ratio = _median_range(ratios, "{:.2f}x")
        ranks = runs[0]  # bytes and memory are the same in every run
        sent = " / ".join(f"{r['bytes_sent_per_step_total'] / 2**20:.2f}" for r in ranks)
        mem = " / ".join(f"{r['embedding_memory_bytes'] / 2**20:.1f}" for r in ranks)
        lines.append(f"| {name} | {_median_range(speeds, '{:,.0f}')} | {ratio} | {sent} | {mem} |")
    lines += ["", "Bytes sent per step by collective, rank 0:", ""]
    for name, runs in results.items():
        parts = ", ".join(
            f"{k} {v / 2**20:.3f} MiB" for k, v in runs[0][0]["bytes_sent_per_step"].items()
        )
        lines.append(f"* {name}: {parts or 'none'}")
    lines += [
        "",
        "Our trainer's step by phase, ms per step, each rank (rank 0 / rank 1; median run), and "
        "the checks' share of the step (unscale_check, dry_run, decision, backup, dense_check; "
        "the decision includes the wait for the other rank's figures):",
        "",
    ]
    for name, runs in results.items():
        if name.startswith("ours"):
            by_speed = sorted(runs, key=lambda ranks: ranks[0]["samples_per_second"])
            phases = [r["phase_ms_per_step"] for r in by_speed[len(by_speed) // 2]]
            parts = ", ".join(f"{k} {' / '.join(f'{p[k]:.2f}' for p in phases)}" for k in phases[0])
            share = " / ".join(
                f"{sum(p[k] for k in CHECK_PHASES) / sum(p.values()):.1%}" for p in phases
            )
            lines.append(f"* {name}: {parts}; checks {share} of the step")
    return "\n".join(lines) + "\n"


def _median_range(values: list[float], fmt: str) -> str:
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} ({fmt.format(lo)}–{fmt.format(hi)})"


if __name__ == "__main__":
    main()
