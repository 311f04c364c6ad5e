"""A run's configuration: :class:`RunConfig`, everything that defines a ``dlrm train`` run,
and its validation (one line naming the command-line option) before any work."""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from dlrm.data.synthetic import scaled_cardinalities
from dlrm.errors import RunError
from dlrm.mixed_precision import DENSE_PRECISIONS, OPTIMIZERS, SCALERS
from dlrm.model import PRESETS, TABLE_NAMES
from embcache.config import ADDED_FIELDS as _TABLE_ADDED_FIELDS
from embcache.config import WHERE_FIELDS, TableConfig

EMBEDDINGS = ("embcache", "torchrec")  # ours, or TorchRec's FP32 collection (the baseline)
# TableConfig's defaults, stated there once: a run's table options take them, all but the
# embedding optimizer and its learning rate (emb_optimizer, emb_lr), which are a run's own
_TABLECONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TableConfig)}


@dataclasses.dataclass
class RunConfig:
    """Everything that defines a run. Table options apply to every table unless ``tables``
    overrides them per table (``{"t_2": {"precision": "int4"}}``)."""

    data: str = "synthetic"  # a preprocessed directory, or "synthetic"
    # full Kaggle cardinalities, and rows enough for a 5% LFU cache to warm
    synthetic_rows: int = 12_000_000
    synthetic_scale: float = 1.0
    preset: str = "kaggle"
    embeddings: str = "embcache"  # or "torchrec" (FP32 baseline)
    precision: str = _TABLECONFIG_DEFAULTS["precision"]
    rounding: str = _TABLECONFIG_DEFAULTS["rounding"]
    cache_ratio: float = _TABLECONFIG_DEFAULTS["cache_ratio"]
    associativity: int = _TABLECONFIG_DEFAULTS["associativity"]
    policy: str = _TABLECONFIG_DEFAULTS["policy"]
    lfu_count_bits: int = _TABLECONFIG_DEFAULTS["lfu_count_bits"]
    emb_optimizer: str = "rowwise_adagrad"
    emb_lr: float = 0.05
    qparams: str = _TABLECONFIG_DEFAULTS["qparams"]
    min_rows_for_low_precision: int = _TABLECONFIG_DEFAULTS["min_rows_for_low_precision"]
    tables: dict = dataclasses.field(default_factory=dict)
    # bytes of all the tables on the device: each table's precision and cache are then
    # planned to fit it (dlrm.plan) from the first plan_rows rows training reads; --table may
    # not set those
    memory_budget: int | None = None
    # bytes the tables may take in pinned host memory beside the GPU: with memory_budget, each
    # table's placement is planned too (a host-placed table's storage counts here, its cache
    # on the device)
    host_memory_budget: int | None = None
    plan_rows: int = 1_000_000
    dense_precision: str = "fp16"
    loss_scaler: str = "backoff"
    static_scale: float = 1024.0
    optimizer: str = "adagrad"  # AdaGrad learns far faster than SGD in a few hundred steps
    lr: float = 0.01
    batch_size: int = 1024
    epochs: int = 1
    steps: int | None = None  # None: whole epochs
    eval_every: int = 100
    eval_batches: int = 20
    seed: int = 0
    # processes on this machine, each with a part of every batch and a shard of the tables
    nproc_per_node: int = 1
    # bookkeeping: may differ between a run and its resumption
    # "auto" (CUDA if present), "cpu", "cuda" or "cuda:N"; a run resumes on any device
    device: str = "auto"
    # where every table's storage lies on a GPU (TableConfig.placement; "tables" may say
    # otherwise per table): "device", or "host", in pinned host memory the GPU reads in place
    placement: str = _TABLECONFIG_DEFAULTS["placement"]
    threads: int | None = None
    checkpoint_every: int = 500
    # stop (as if interrupted) after this many steps of this invocation
    stop_after: int | None = None
    # a run that skips this many steps in a row has diverged (more than the backoff scaler
    # needs to fall from its largest scale, 2^24, to 1)
    max_skipped_in_a_row: int = 25
    # also train the same run with FP32 tables (no cache) in out_dir/fp32, and compare
    compare_fp32: bool = False
    progress: bool = True
    # every this many steps the interval's figures go to history.jsonl (dlrm.monitor)
    log_every: int = 100
    tensorboard: str | None = None  # a directory for TensorBoard's event files

    BOOKKEEPING = (
        "steps",
        "threads",
        "checkpoint_every",
        "stop_after",
        "max_skipped_in_a_row",
        "compare_fp32",
        "progress",
        "eval_every",
        "nproc_per_node",  # a checkpoint resumes at any world size (embcache.resharding)
        "log_every",
        "tensorboard",
        "plan_rows",  # the plan it led to is in ``tables``
        "device",  # the tables' bytes are the same on every device (docs/design.md)
        "placement",  # ... and in either placement (so too a table's, in ``tables``)
    )
    # fields newer than some checkpoints, with the value those checkpoints' runs had: the
    # table options among them (RunConfig names them as TableConfig does)
    ADDED_FIELDS = {
        **{k: v for k, v in _TABLE_ADDED_FIELDS.items() if k not in WHERE_FIELDS},
        "host_memory_budget": None,
    }

    def identity(self) -> dict:
        """The fields a resumed run must share with the checkpoint: all but the bookkeeping,
        and in ``tables`` all but where a table lives (its placement)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in self.BOOKKEEPING}
        tables = {
            name: {k: v for k, v in options.items() if k not in WHERE_FIELDS}
            for name, options in self.tables.items()
        }
        out["tables"] = {name: options for name, options in tables.items() if options}
        return out

    def validate(self) -> None:
        """Raise :class:`RunError` naming the first invalid field (as its command-line option)
        and its value. Reads nothing from disk: a run checks this before any work."""
        for name, (low, optional) in _INT_FIELDS.items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RunError(f"{_option(name)} must be an integer >= {low}, got {value!r}")
        for name, positive in _FLOAT_FIELDS.items():
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and math.isfinite(value)
            if not ok or value < 0 or (positive and value == 0):
                want = "positive" if positive else "non-negative"
                raise RunError(f"{_option(name)} must be a finite {want} number, got {value!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise RunError(f"{_option(name)} must be one of {', '.join(choices)}")
        self._check_device_option()
        if self.nproc_per_node > 1:
            if self.batch_size % self.nproc_per_node:
                raise RunError(
                    f"--batch-size ({self.batch_size}) must be a multiple of --nproc-per-node "
                    f"({self.nproc_per_node}): every process takes an equal part of a batch"
                )
            if self.embeddings != "embcache":
                raise RunError("--nproc-per-node > 1 shards our tables: use --embeddings embcache")
        if self.memory_budget is not None and self.embeddings != "embcache":
            raise RunError("--memory-budget plans our tables: use --embeddings embcache")
        if self.host_memory_budget is not None and self.memory_budget is None:
            raise RunError(
                "--host-memory-budget plans the tables with --memory-budget (the device's "
                "bytes): give both"
            )
        placed = self._host_placement_option()
        if placed and self.embeddings != "embcache":
            raise RunError(f"{placed[0]} places our tables: use --embeddings embcache")
        if placed and self.nproc_per_node > 1:
            raise RunError(
                f"{placed[0]}: host placement runs in one process for now (--nproc-per-node 1)"
            )
        for option, (field, value) in _TABLE_DEFAULT_OPTIONS.items():
            try:
                TableConfig(1, 1, **{field: getattr(self, value)})
            except (TypeError, ValueError) as e:
                raise RunError(f"{option}: {str(e).split(': ', 1)[-1]}") from None
        if self.data == "synthetic":  # refused here, not after the data are generated
            rows = max(scaled_cardinalities(self.synthetic_scale))
            try:
                TableConfig(rows, 1)
            except ValueError as e:
                rule = str(e).split(" must ", 1)[-1]
                raise RunError(
                    f"--synthetic-scale {self.synthetic_scale:g}: the largest table would have "
                    f"{rows:,} rows, and a table's rows must be {rule}"
                ) from None
        for table, options in self.tables.items():
            if table not in TABLE_NAMES:
                raise RunError(
                    f"--table {table}: no such table "
                    f"(tables are {TABLE_NAMES[0]} ... {TABLE_NAMES[-1]})"
                )
            unknown = set(options) - _TABLE_OPTIONS
            if unknown:
                raise RunError(
                    f"--table {table}: unknown option {sorted(unknown)[0]!r} "
                    f"(options: {', '.join(sorted(_TABLE_OPTIONS))})"
                )
            try:
                TableConfig(1, 1, **{**self.table_defaults(), **options, "name": table})
            except (TypeError, ValueError) as e:
                raise RunError(f"--table {table}: {str(e).split(': ', 1)[-1]}") from None

    def table_configs(self, cardinalities: list[int]) -> list[TableConfig]:
        """Each table's configuration in an embcache run, as the collection builds it."""
        dim = PRESETS[self.preset].embedding_dim
        return [
            TableConfig.of(
                n,
                dim,
                table_id=i,
                name=name,
                **{**self.table_defaults(), **self.tables.get(name, {})},
            )
            for i, (name, n) in enumerate(zip(TABLE_NAMES, cardinalities))
        ]

    def _resolved_device(self, local_rank: int) -> torch.device:
        """:meth:`torch_device` before the placement's check."""
        self._check_device_option()
        name = self.device
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if name == "auto":
            name = "cuda" if gpus else "cpu"
        if name == "cpu":
            return torch.device("cpu")
        if not gpus:
            raise RunError(
                f"--device {self.device}: torch {torch.__version__} sees no CUDA GPU here "
                "(use --device cpu)"
            )
        if self.nproc_per_node > gpus:
            raise RunError(
                f"--nproc-per-node {self.nproc_per_node} on --device {self.device} needs a GPU "
                f"a process; this machine has {gpus}"
            )
        index = int(name.split(":")[1]) if ":" in name else local_rank
        if index >= gpus:
            raise RunError(
                f"--device {self.device}: this machine has {gpus} GPU(s), cuda:0 to cuda:{gpus - 1}"
            )
        return torch.device("cuda", index)

    def torch_device(self, local_rank: int = 0) -> torch.device:
        """The device this process trains on: ``device``, with "auto" CUDA where torch sees a
        GPU, and with several processes on CUDA GPU ``local_rank``. A RunError naming
        ``--device`` (or ``--nproc-per-node``) if the machine has no such device, or naming
        the option (and table) that asks for host placement on the CPU, where it means
        nothing: a host-placed table's rows are in host memory for a GPU to read."""
        device = self._resolved_device(local_rank)
        placed = self._host_placement_option()
        if placed and device.type != "cuda":
            why = (
                f"torch {torch.__version__} sees no CUDA GPU here"
                if self.device == "auto"
                else f"this run is on the CPU (--device {self.device})"
            )
            raise RunError(
                f"{placed[1]} in pinned host memory for a CUDA GPU to read in place, but "
                f"{why}; on the CPU every table is in host memory anyway: leave it out"
            )
        return device

    def _host_placement_option(self) -> tuple[str, str] | None:
        """The option that puts a table in host memory (one table's ``--table``,
        ``--placement host`` or ``--host-memory-budget``) and what it does, for a message;
        None if no option does."""
        for name, options in self.tables.items():
            if options.get("placement") == "host" and self.placement != "host":
                option = f"--table {name}: placement=host"
                return option, f"{option} puts the table's rows"
        if self.placement == "host":
            return "--placement host", "--placement host puts every table's rows"
        if self.host_memory_budget is not None:
            return "--host-memory-budget", "--host-memory-budget lets the plan put tables' rows"
        return None

    def _check_device_option(self) -> None:
        """``device`` is a device's name, and one that several processes can share."""
        if not _DEVICE.fullmatch(self.device):
            raise RunError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.nproc_per_node > 1 and self.device.startswith("cuda:"):
            raise RunError(
                f"--device {self.device} names one GPU: with --nproc-per-node use --device "
                "cuda (rank r uses GPU r)"
            )

    def table_defaults(self) -> dict:
        """The options every table of an embcache run gets unless ``tables`` overrides them."""
        options = {field: getattr(self, own) for field, own in _TABLE_DEFAULT_OPTIONS.values()}
        options["seed"] = self.seed
        options["min_rows_for_low_precision"] = self.min_rows_for_low_precision
        return options


# (smallest value, None allowed) of each integer field, and whether each float must be > 0
_INT_FIELDS = {
    "synthetic_rows": (1, False),
    "memory_budget": (1, True),
    "host_memory_budget": (1, True),
    "plan_rows": (1, False),
    "min_rows_for_low_precision": (0, False),
    "batch_size": (1, False),
    "epochs": (1, False),
    "steps": (1, True),
    "eval_every": (0, False),  # 0: no validation during training
    "eval_batches": (1, False),
    "seed": (0, False),
    "threads": (1, True),
    "checkpoint_every": (1, False),
    "stop_after": (1, True),
    "max_skipped_in_a_row": (1, False),
    "nproc_per_node": (1, False),
    "log_every": (1, False),
}


_FLOAT_FIELDS = {"synthetic_scale": True, "static_scale": True, "lr": False}


_CHOICES = {
    "preset": tuple(PRESETS),
    "embeddings": EMBEDDINGS,
    "dense_precision": DENSE_PRECISIONS,
    "loss_scaler": SCALERS,
    "optimizer": OPTIMIZERS,
}


# what --table may set for one table (the rest is fixed by the run or the collection)
_TABLE_OPTIONS = {
    "precision",
    "rounding",
    "cache_ratio",
    "associativity",
    "policy",
    "lfu_count_bits",
    "optimizer",
    "lr",
    "eps",
    "qparams",
    "min_rows_for_low_precision",
    "placement",
}


# the command-line option of each table default: (TableConfig field, RunConfig field)
_TABLE_DEFAULT_OPTIONS = {
    "--precision": ("precision", "precision"),
    "--rounding": ("rounding", "rounding"),
    "--cache-ratio": ("cache_ratio", "cache_ratio"),
    "--associativity": ("associativity", "associativity"),
    "--policy": ("policy", "policy"),
    "--lfu-count-bits": ("lfu_count_bits", "lfu_count_bits"),
    "--emb-optimizer": ("optimizer", "emb_optimizer"),
    "--emb-lr": ("lr", "emb_lr"),
    "--qparams": ("qparams", "qparams"),
    "--placement": ("placement", "placement"),
}


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _option(field: str) -> str:
    return "--" + field.replace("_", "-")
