"""The ``dlrm`` command: ``train``, ``evaluate``, ``plan``, ``report``, ``preprocess``,
``generate``.

User errors (missing or corrupt data, a damaged checkpoint or one from another
configuration, an unwritable output or one in use by another run, an invalid option) print
one line on stderr and exit with status 2, before any work. A training run that diverges
prints one line naming the step and its last checkpoint and exits with status 1 (its report
is written). SIGINT or SIGTERM stops any command with one line; a training run stops after
the step in progress, keeps a checkpoint there and exits with status 128 + the signal's
number (130, 143).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import signal
import sys
import time
from fractions import Fraction
from pathlib import Path

# torch.fx warns at import time about an API change that concerns neither us nor the user.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

from dlrm.config import EMBEDDINGS, RunConfig  # noqa: E402
from dlrm.errors import RunError, Stopped  # noqa: E402
from dlrm.mixed_precision import DENSE_PRECISIONS, OPTIMIZERS, SCALERS  # noqa: E402
from dlrm.model import PRESETS, TABLE_NAMES  # noqa: E402
from embcache.config import (  # noqa: E402
    LFU_COUNT_BITS,
    PLACEMENTS,
    POLICIES,
    PRECISION_BITS,
    QPARAMS,
    ROUNDINGS,
)
from embcache.config import OPTIMIZERS as TABLE_OPTIMIZERS  # noqa: E402

_DEFAULTS = RunConfig()
_DEFAULT_OUT = Path("runs/train")  # dlrm train's run directory; synthetic data go beside it
# what a size's unit multiplies (--memory-budget): none or B, decimal and binary prefixes
_SIZE_UNITS = {"": 1, "b": 1} | {
    f"{p}{i}b": (1024 if i else 1000) ** (k + 1) for k, p in enumerate("kmgt") for i in ("", "i")
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


def _size(text: str) -> int:
    """A number of bytes: ``700MiB``, ``1.5GiB``, ``800MB``, ``4096`` (rounded down)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = _SIZE_UNITS.get(m[2].lower()) if m else None
    value = int(Fraction(m[1]) * unit) if unit else 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a size of at least 1 byte such as 700MiB, 1.5GiB, 800MB or 4096, "
            f"got {text!r}"
        )
    return value


def _table_override(text: str) -> tuple[str, dict]:
    """``NAME:key=value,key=value`` -> (NAME, {key: value}) with numbers parsed."""
    try:
        name, rest = text.split(":", 1)
        options = {}
        for item in rest.split(","):
            key, value = item.split("=", 1)
            for cast in (int, float):
                try:
                    value = cast(value)
                    break
                except ValueError:
                    pass
            options[key.strip().replace("-", "_")] = value
        return name, options
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--table expects NAME:key=value[,key=value], got {text!r}"
        ) from None


def add_lfu_count_bits_option(g) -> None:
    """``--lfu-count-bits`` (TableConfig.lfu_count_bits, RunConfig's field of that name), for
    ``g`` a parser or an argument group: the command line and bench/hit_rate.py share it."""
    g.add_argument(
        "--lfu-count-bits",
        type=int,
        choices=LFU_COUNT_BITS,
        default=_DEFAULTS.lfu_count_bits,
        help="bits of an LFU table's per-row counts, which saturate (default: %(default)s)",
    )


def add_data_options(g, *, old_names: bool = False) -> None:
    """The options that choose a run's data (``--data``, ``--synthetic-rows``,
    ``--synthetic-scale``, RunConfig's fields of those names), for ``g`` a parser or an
    argument group: the command line and the benchmark scripts share them. ``old_names``:
    as in :func:`add_synthetic_options`."""
    g.add_argument(
        "--data",
        default=_DEFAULTS.data,
        help="a preprocessed directory, or synthetic: generated once, deterministically, into "
        "data/ beside the run directory (default: %(default)s)",
    )
    add_synthetic_options(g, old_names=old_names)


def add_synthetic_options(g, *, old_names: bool = False) -> None:
    """``--synthetic-rows`` and ``--synthetic-scale``, the synthetic data's size (RunConfig's
    fields of those names, which ``RunConfig.validate`` checks), for ``g`` a parser or an
    argument group; with ``old_names`` also taken as ``--rows`` and ``--scale``, the names
    ``dlrm generate`` and ``bench/distributed.py`` had first (and documented commands use)."""
    d = _DEFAULTS
    g.add_argument(
        "--synthetic-rows",
        *(["--rows"] if old_names else []),
        type=int,
        default=d.synthetic_rows,
        help="rows of the synthetic data (default: %(default)s)",
    )
    g.add_argument(
        "--synthetic-scale",
        *(["--scale"] if old_names else []),
        type=float,
        default=d.synthetic_scale,
        help="Kaggle cardinalities times this (default: %(default)s)",
    )


def _data_options(p: argparse.ArgumentParser) -> None:
    add_data_options(p.add_argument_group("data"))


def _format_options(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("table formats and caches (--memory-budget chooses them per table)")
    g.add_argument(
        "--embeddings",
        choices=EMBEDDINGS,
        default=d.embeddings,
        help="our tables, or TorchRec's FP32 EmbeddingBagCollection as a baseline "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--precision",
        choices=list(PRECISION_BITS),
        default=d.precision,
        help="how each table stores its rows (default: %(default)s)",
    )
    g.add_argument(
        "--cache-ratio",
        type=float,
        default=d.cache_ratio,
        help="fraction of a table's rows its FP32 cache holds, 0 for none (default: %(default)s)",
    )
    g.add_argument(
        "--associativity",
        type=int,
        default=d.associativity,
        help="cache slots per set, 1 (direct-mapped) to 32 (default: %(default)s)",
    )
    g.add_argument(
        "--policy",
        choices=POLICIES,
        default=d.policy,
        help="which cached row a new one evicts: least recently or least frequently used "
        "(default: %(default)s)",
    )


def _table_options(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("embedding tables")
    g.add_argument(
        "--rounding",
        choices=ROUNDINGS,
        default=d.rounding,
        help="how an updated row is rounded back to its precision (default: %(default)s)",
    )
    add_lfu_count_bits_option(g)
    g.add_argument(
        "--emb-optimizer",
        choices=TABLE_OPTIMIZERS,
        default=d.emb_optimizer,
        help="the tables' optimizer (default: %(default)s)",
    )
    g.add_argument(
        "--emb-lr",
        type=float,
        default=d.emb_lr,
        help="the tables' learning rate (default: %(default)s)",
    )
    g.add_argument(
        "--qparams",
        choices=QPARAMS,
        default=d.qparams,
        help="precision of each low-precision row's scale and bias (default: %(default)s)",
    )
    g.add_argument(
        "--min-rows-for-low-precision",
        type=int,
        default=d.min_rows_for_low_precision,
        help="tables with fewer rows stay FP32 without a cache (default: %(default)s)",
    )
    g.add_argument(
        "--table",
        type=_table_override,
        action="append",
        metavar="NAME:key=value,...",
        help="per-table override, e.g. t_2:precision=int4,cache_ratio=0.1 "
        f"(tables are {TABLE_NAMES[0]}..{TABLE_NAMES[-1]}; repeatable; default: none)",
    )


def _budget_options(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("memory budget")
    g.add_argument(
        "--memory-budget",
        type=_size,
        default=d.memory_budget,
        metavar="SIZE",
        help="bytes the tables may take in each process (700MiB, 1.5GiB, 800MB, bytes), on its "
        "device: each table's precision, cache, associativity and policy are planned to fit "
        "it, times --nproc-per-node, whose processes TorchRec's planner then gives at most "
        "this each ('dlrm plan' shows the plan; default: none, no planning)",
    )
    g.add_argument(
        "--host-memory-budget",
        type=_size,
        default=d.host_memory_budget,
        metavar="SIZE",
        help="with --memory-budget, one process on a GPU: bytes the tables may take in pinned "
        "host memory besides; each table's placement is planned too, on the GPU or (when that "
        "is better than fitting it there) its rows in host memory and its cache on the GPU "
        "(default: none, every table on the device)",
    )
    g.add_argument(
        "--plan-rows",
        type=int,
        default=d.plan_rows,
        help="plan from this many training rows, the first the run reads (default: %(default)s)",
    )


def _model_options(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("model and batches")
    g.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=d.preset,
        help="the model's sizes: kaggle (embedding dim 16) or paper (dim 128) "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help="samples a step, and a batch of evaluation and planning (default: %(default)s)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seeds the synthetic data, the shuffling, the initial weights and the stochastic "
        "rounding (default: %(default)s)",
    )


def _training_options(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("training")
    g.add_argument(
        "--dense-precision",
        choices=DENSE_PRECISIONS,
        default=d.dense_precision,
        help="precision of the MLPs' forward and backward, over FP32 master weights "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--loss-scaler",
        choices=SCALERS,
        default=d.loss_scaler,
        help="static (fixed: --static-scale), backoff (halved on overflow, doubled after "
        "2000 clean steps) or logmax (aimed from the gradients' largest values) "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--static-scale",
        type=float,
        default=d.static_scale,
        help="the loss scale of --loss-scaler static (default: %(default)s)",
    )
    g.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=d.optimizer,
        help="the dense optimizer (default: %(default)s)",
    )
    g.add_argument(
        "--lr", type=float, default=d.lr, help="the dense learning rate (default: %(default)s)"
    )
    g.add_argument(
        "--epochs",
        type=int,
        default=d.epochs,
        help="passes over the train split (default: %(default)s)",
    )
    g.add_argument(
        "--steps", type=int, default=d.steps, help="total steps (default: whole --epochs)"
    )
    g.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="steps between validations, 0 for none (default: %(default)s)",
    )
    g.add_argument(
        "--eval-batches",
        type=int,
        default=d.eval_batches,
        help="batches each validation scores (default: %(default)s)",
    )
    g.add_argument(
        "--max-skipped-in-a-row",
        type=int,
        default=d.max_skipped_in_a_row,
        help="stop the run as diverged after this many skipped steps in a row "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--compare-fp32",
        action="store_true",
        help="also train the same run with FP32 tables (no cache) in OUT/fp32 and compare",
    )


def _output_options(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("checkpoints, logs and threads")
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="steps between checkpoints; one is also kept at the end (default: %(default)s)",
    )
    g.add_argument(
        "--stop-after",
        type=int,
        default=d.stop_after,
        help="stop after this many steps of this invocation, as if interrupted (resume with "
        "--resume; default: none)",
    )
    g.add_argument(
        "--log-every",
        type=int,
        default=d.log_every,
        help="steps between the figures written to OUT/history.jsonl, TensorBoard and the "
        "progress lines; the run's last steps are written at its end (default: %(default)s)",
    )
    g.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write TensorBoard event files here (default: none)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="torch's threads in each process (default: torch's own choice)",
    )


def _process_options(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("processes and progress")
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=d.nproc_per_node,
        help="run in this many processes (gloo; on GPUs NCCL, one GPU each): each takes an "
        "equal part of every batch, the tables are sharded over them by TorchRec's planner "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (on a terminal) or progress lines (otherwise)",
    )


def _device_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("device")
    g.add_argument(
        "--device",
        default=_DEFAULTS.device,
        help="where to run: auto (a CUDA GPU if torch sees one, else the CPU), cpu, cuda or "
        "cuda:N; a run may resume on another device (default: %(default)s)",
    )
    g.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=_DEFAULTS.placement,
        help="on a GPU, where each table's rows, counts and optimizer state live: in GPU "
        "memory with its cache, or in pinned host memory that the GPU reads in place, the "
        "cache in GPU memory (tables larger than the GPU); a table override "
        "NAME:placement=... places one table; a run may resume, and be evaluated, in another "
        "placement (default: %(default)s)",
    )


# the option groups each command of a run takes: train all; plan what planning reads;
# evaluate none of a run's configuration, which it reads from the checkpoint
_TRAIN_OPTIONS = (
    _data_options,
    _format_options,
    _table_options,
    _budget_options,
    _model_options,
    _training_options,
    _output_options,
    _device_options,
    _process_options,
)
_PLAN_OPTIONS = (_data_options, _table_options, _budget_options, _model_options, _process_options)
_EVALUATE_OPTIONS = (_device_options, _process_options)


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of a command's options; the fields it has no option for keep their
    defaults."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["tables"] = dict(getattr(args, "table", None) or ())
    values["progress"] = not args.no_progress
    return RunConfig(**values)


def _summary(report: dict) -> str:
    t = report["test"]
    shown = [
        f"{label} " + ("n/a" if t[key] is None else f"{t[key]:.4f}")
        for label, key in (
            ("auc", "auc"),
            ("accuracy", "accuracy"),
            ("log loss", "log_loss"),
            ("normalized entropy", "normalized_entropy"),
        )
    ]
    why = "; ".join(f"{k}: {v}" for k, v in t["undefined"].items())
    lines = [
        "test: " + "  ".join(shown) + (f"  (undefined: {why})" if why else ""),
        f"steps {report['steps']}  samples/s {report['samples_per_second']:.0f}  "
        f"skipped {report['skipped_steps']}  final loss scale {report['loss_scale']['final']:g}",
    ]
    emb = report["embeddings"]
    line = f"embeddings: {emb['memory_bytes'] / 2**20:.1f} MiB"
    if emb.get("host_memory_bytes"):
        line += f" ({emb['host_memory_bytes'] / 2**20:.1f} MiB of it in host memory)"
    line += (
        f", FP32 tables {emb['fp32_bytes'] / 2**20:.1f} MiB "
        f"(factor {emb['compression_factor']:.3f})"
    )
    if "hit_rate" in emb:
        line += f", cache hit rate {emb['hit_rate']:.3f} (tables with a cache)"
    lines.append(line + f"; peak RSS {report['peak_rss_bytes'] / 2**20:.0f} MiB")
    if report.get("world_size", 1) > 1:
        per_rank = ", ".join(f"{b / 2**20:.1f}" for b in emb["memory_bytes_per_rank"])
        lines.append(f"{report['world_size']} processes; embeddings per rank (MiB): {per_rank}")
    fp32 = report.get("compare_fp32")
    if fp32 and fp32["status"] == "completed":
        auc = fp32["test"]["auc"]
        lines.append(
            "FP32 tables, same run: test auc "
            + ("n/a" if auc is None else f"{auc:.4f}")
            + ("" if fp32["auc_difference"] is None else f" (ours {fp32['auc_difference']:+.4f})")
            + f", embeddings {fp32['embedding_memory_bytes'] / 2**20:.1f} MiB, "
            f"samples/s {fp32['samples_per_second']:.0f}"
        )
    if report["data"].get("bayes_auc"):
        lines.append(f"data: Bayes-optimal AUC {json.dumps(report['data']['bayes_auc'])}")
    return "\n".join(lines)


def _plan_text(plan: dict, seconds: float, processes: int = 1) -> str:
    """A plan (``embcache.planner.plan``) as a table, a line per table, and its total (its
    budget that of ``processes`` processes)."""

    def size(n: int) -> str:
        k = max([0] + [k for k in range(1, 4) if n >= 1024**k])
        return f"{n:,} B" if k == 0 else f"{n / 1024**k:,.1f} {('KiB', 'MiB', 'GiB')[k - 1]}"

    def cache(t: dict) -> str:
        if not t["cache_slots"]:
            return "none"
        ways = "direct" if t["associativity"] == 1 else f"{t['associativity']}-way"
        return f"{t['cache_ratio'] * 100:g}% {t['policy'].upper()} {ways}"

    placed = plan.get("host_budget") is not None  # then each table's placement is planned
    head = ("table", "rows", "dim", "precision", "cache", "hit rate", "bytes")
    head += ("placement", "host bytes") if placed else ()
    rows = [
        (
            t["name"],
            f"{t['rows']:,}",
            str(t["dim"]),
            t["precision"],
            cache(t),
            f"{t['hit_rate']:.1%}" if t["cache_slots"] else "-",
            size(t["bytes"]),
        )
        + ((t["placement"], size(t["host_bytes"]) if t["host_bytes"] else "-") if placed else ())
        for t in plan["tables"]
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    right = (1, 2, 5, 6, 8)  # numbers
    lines = [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        )
        for r in [head, *rows]
    ]
    sample = max(t["lookups"] for t in plan["tables"])
    budget = f"a {size(plan['budget'])} budget"
    if processes > 1:
        budget += f", {size(plan['budget'] // processes)} for each of {processes} processes"
    used = f"{size(plan['total_bytes'])} of {budget}"
    if placed:
        used = (
            f"{size(plan['total_bytes'])}: {size(plan['device_bytes'])} of {budget} on the "
            f"device, {size(plan['host_bytes'])} of a {size(plan['host_budget'])} budget in "
            "host memory"
        )
    lines.append(
        f"total {used} "
        f"({plan['total_bytes'] / plan['fp32_bytes']:.3f} of FP32 tables, "
        f"{size(plan['fp32_bytes'])}); loss proxy {plan['proxy']:.3g}; planned from "
        f"{sample:,} training rows in {seconds:.1f} s"
    )
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    """The ``dlrm`` command's parser: a subparser per command, each option with its help
    and default."""
    parser = _Parser(
        prog="dlrm", description="DLRM on Criteo with low-precision cached embedding tables"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        help="train a model (default: INT8 tables + 5%% LFU cache, FP16 dense, synthetic data)",
    )
    for add in _TRAIN_OPTIONS:
        add(p)
    p.add_argument(
        "--out",
        type=Path,
        default=_DEFAULT_OUT,
        help="run directory: checkpoint/, history.jsonl, report.json; synthetic data go to "
        "data/ beside it (default: %(default)s)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its checkpoint"
    )

    p = sub.add_parser(
        "evaluate",
        help="evaluate a run's latest checkpoint with the configuration it was trained with",
        description="Score the latest checkpoint in --out on a split. The run's data, tables "
        "and model are those its checkpoint records.",
    )
    for add in _EVALUATE_OPTIONS:
        add(p)
    p.add_argument(
        "--out", type=Path, default=_DEFAULT_OUT, help="run directory (default: %(default)s)"
    )
    p.add_argument(
        "--split",
        choices=["val", "test"],
        default="test",
        help="the data split to score (default: %(default)s)",
    )

    p = sub.add_parser(
        "plan",
        help="print each table's precision and cache planned to fit --memory-budget, as "
        "dlrm train --memory-budget with the same options trains them",
    )
    for add in _PLAN_OPTIONS:
        add(p)

    p = sub.add_parser("report", help="draw a run (finished or running) into a PNG")
    p.add_argument("run", type=Path, help="the run directory (a dlrm train --out)")
    p.add_argument("--png", type=Path, help="where to write it (default: RUN/report.png)")

    p = sub.add_parser(
        "preprocess", help="raw Criteo TSV (or TorchRec npy directory) -> preprocessed directory"
    )
    p.add_argument(
        "src",
        type=Path,
        help="train.txt, or a directory of TorchRec day_*.npy files with --torchrec",
    )
    p.add_argument("out", type=Path, help="the preprocessed directory to write (--data)")
    p.add_argument(
        "--torchrec", action="store_true", help="src is TorchRec's preprocessed npy layout"
    )
    p.add_argument(
        "--min-count",
        type=_int_at_least(1),
        default=1,
        help="ids seen fewer times share one row per feature (default: %(default)s)",
    )
    p.add_argument(
        "--max-ind-range",
        type=_int_at_least(0),
        default=0,
        help="hash ids modulo this, 0 for no hashing (default: %(default)s)",
    )

    p = sub.add_parser(
        "generate",
        help="write the synthetic Criteo-like data set to a directory: the data dlrm train "
        "generates with the same options",
    )
    p.add_argument("out", type=Path, help="the directory to write (--data)")
    add_synthetic_options(p, old_names=True)
    p.add_argument(
        "--seed", type=int, default=_DEFAULTS.seed, help="the data's seed (default: %(default)s)"
    )
    return parser


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        return _dispatch(args)
    except (RunError, ValueError, OSError) as e:
        print(f"dlrm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"dlrm {args.command}: stopped by {e}", file=sys.stderr)
        return 128 + signal.Signals[str(e)]
    except KeyboardInterrupt:
        print(f"dlrm {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_stopped(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def _checkpoint_line(out: Path, step: int | None) -> str:
    return "last checkpoint: " + ("none" if step is None else f"step {step} ({out / 'checkpoint'})")


def _dispatch(args) -> int:
    from dlrm.data.criteo import DataError

    try:
        if args.command == "train":
            from dlrm.train import train

            report = train(_run_config(args), args.out, resume=args.resume)
            if "stopped_at_step" in report:
                step, by = report["stopped_at_step"], report["signal"]
                at = "" if step is None else f" at step {step}"
                line = f"{_checkpoint_line(args.out, report['checkpoint_step'])}; continue with --resume"
                if by is None:
                    print(f"stopped{at}; {line}")
                    return 0
                print(f"dlrm train: stopped by {by}{at}; {line}", file=sys.stderr)
                return 128 + signal.Signals[by]
            if report["status"] == "diverged":
                d = report["diverged"]
                print(
                    f"dlrm train: diverged at step {d['step']}: {d['reason']}; report: "
                    f"{args.out / 'report.json'}; "
                    + _checkpoint_line(args.out, d["last_checkpoint_step"]),
                    file=sys.stderr,
                )
                return 1
            print(_summary(report))
            print(f"report: {args.out / 'report.json'}")
        elif args.command == "evaluate":
            from dlrm.evaluate import evaluate_checkpoint

            m = evaluate_checkpoint(_run_config(args), args.out, args.split)
            print(json.dumps(m, indent=2))
        elif args.command == "plan":
            from dlrm.build import resolve_dataset
            from dlrm.plan import plan_run, refuse_unmeetable, run_cardinalities

            cfg = _run_config(args)
            if cfg.memory_budget is None:
                raise RunError("--memory-budget is required: the bytes the tables may take")
            cfg.validate()
            refuse_unmeetable(cfg, run_cardinalities(cfg))
            start = time.perf_counter()
            plan = plan_run(cfg, resolve_dataset(cfg, _DEFAULT_OUT)[1])
            print(_plan_text(plan, time.perf_counter() - start, cfg.nproc_per_node))
        elif args.command == "report":
            from dlrm.plots import render

            print(render(args.run, args.png))
        elif args.command == "preprocess":
            from dlrm.data.criteo import convert_torchrec_npys, preprocess_criteo

            if args.torchrec:
                meta = convert_torchrec_npys(args.src, args.out)
            else:
                meta = preprocess_criteo(
                    args.src, args.out, min_count=args.min_count, max_ind_range=args.max_ind_range
                )
            print(json.dumps({k: meta[k] for k in ("rows", "cardinalities") if k in meta}))
        elif args.command == "generate":
            from dlrm.data.synthetic import SyntheticCriteo

            cfg = RunConfig(
                synthetic_rows=args.synthetic_rows,
                synthetic_scale=args.synthetic_scale,
                seed=args.seed,
            )
            cfg.validate()
            meta = SyntheticCriteo(scale=cfg.synthetic_scale, seed=cfg.seed).write(
                args.out, cfg.synthetic_rows
            )
            print(
                json.dumps(
                    {k: meta[k] for k in ("rows", "cardinalities", "bayes_auc") if k in meta}
                )
            )
    except DataError as e:
        raise RunError(str(e)) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
