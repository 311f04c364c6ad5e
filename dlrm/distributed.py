"""``dlrm train`` over several processes (docs/design.md, "Scale-out").

The tables are sharded by TorchRec's ``DistributedModelParallel`` with our sharder and a plan
from TorchRec's planner that knows our bytes (:mod:`embcache.sharding`); the dense part is
data-parallel (DDP, as DMP wraps it); :class:`dlrm.mixed_precision.MixedPrecisionTrainer`
makes one decision per step for all ranks. Every rank reads its part of each global batch
from the memory-mapped dataset. Checkpoints are written with ``torch.distributed.checkpoint``:
each rank writes its own shards, once, into one directory.

:func:`launch` starts the processes with torch's elastic launcher; a rank that fails or dies
makes the launcher end the others, and the launch raises one error naming the rank.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import io
import logging
import os
import signal
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dlrm.errors import RunError, Stopped
from dlrm.torchrec_adapter import is_sharded, unwrap
from embcache.serialization import load, load_dcp, read_metadata

CPU = torch.device("cpu")
# a collective that waits this long for a rank has lost it: it raises instead of hanging
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """The processes of a run: this one's ``rank`` of ``world_size``, and their group (None
    for a run of one process)."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    @classmethod
    def current(cls) -> Ranks:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls()
        return cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def part(self) -> tuple[int, int]:
        """This rank's part of every batch (``dlrm.data.batches.iterate_batches``)."""
        return self.rank, self.world_size

    def gather(self, obj) -> list:
        """``obj`` of every rank, in rank order (every rank gets the list)."""
        if self.group is None:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on some rank (every rank gets the answer)."""
        if self.group is None:
            return flag
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


ONE_PROCESS = Ranks()


def shard(
    model: torch.nn.Module,
    ranks: Ranks,
    batch_size: int,
    memory_budget: int | None = None,
    device: torch.device = CPU,
) -> torch.nn.Module:
    """``model`` with its embedding collection sharded over ``ranks`` as TorchRec's planner
    places it (by our tables' real bytes; table-wise but for a table larger than a rank's
    share, ``embcache.sharding.default_constraints``), each rank's shards on its ``device``
    (a CPU, or its GPU), the dense part left for the trainer to make data-parallel
    (``init_data_parallel=False``). With ``memory_budget``, the planner keeps each rank's
    shards within that many bytes, counted as ``memory_bytes()`` counts them (the capacity of
    the memory they live in, none of it reserved for other modules); ``RunError`` if it finds
    no such placement. Returns TorchRec's ``DistributedModelParallel``: this is where a run of
    several processes imports TorchRec."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.storage_reservations import (
        FixedPercentageStorageReservation,
    )
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.distributed.types import ShardingEnv

    from embcache.sharding import CachedEmbeddingBagCollectionSharder, default_constraints, planner

    sharder = CachedEmbeddingBagCollectionSharder()
    capacity = "hbm_cap" if device.type == "cuda" else "ddr_cap"
    topology = Topology(
        world_size=ranks.world_size,
        compute_device=device.type,
        **({} if memory_budget is None else {capacity: memory_budget}),
    )
    constraints = default_constraints(model.embedding_collection, ranks.world_size)
    reserve = None if memory_budget is None else FixedPercentageStorageReservation(0.0)
    try:
        plan = planner(topology, batch_size, constraints, reserve).collective_plan(
            model, [sharder], ranks.group
        )
    except PlannerError as e:
        if memory_budget is None:
            raise
        raise RunError(
            f"--memory-budget: TorchRec's planner cannot place the planned tables in "
            f"{memory_budget:,} bytes a process: {_last_line(str(e))}"
        ) from None
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(ranks.group),
        device=device,
        plan=plan,
        sharders=[sharder],
        init_data_parallel=False,
    )


def process_tables(model: torch.nn.Module) -> dict:
    """This process's tables by name: over several ranks its shards (``t``, or ``t@r`` for
    a row-wise shard from row ``r``), in one process the collection's tables."""
    if is_sharded(model):
        return unwrap(model).embedding_collection.local_tables()
    return dict(model.embedding_collection.embedding_bags.items())


def sharding_report(model: torch.nn.Module) -> dict:
    """Each table's sharding type and ranks, from the plan of a ``DistributedModelParallel``."""
    out = {}
    for module_plan in model.plan.plan.values():
        for table, ps in module_plan.items():
            out[table] = {"sharding": ps.sharding_type, "ranks": list(ps.ranks or [])}
    return out


# --------------------------------------------------------------------------- checkpoints

_REST = "rest"  # the entry that holds everything but the model's tensors


def write_checkpoint_files(directory: Path, model_state: dict, rest: dict, ranks: Ranks) -> None:
    """Write ``model_state`` (each rank its own tensors) and ``rest`` (the same on every rank,
    written once) into ``directory`` as a ``torch.distributed.checkpoint``. ``rest`` is stored
    as the bytes of ``torch.save`` in a uint8 tensor: one opaque item (DCP would otherwise
    split it into its leaves) that loads without unpickling anything but plain data."""
    blob = io.BytesIO()
    torch.save(rest, blob)
    rest_bytes = torch.frombuffer(bytearray(blob.getbuffer()), dtype=torch.uint8)
    state = {"model": model_state, _REST: rest_bytes}
    dcp.save(state, checkpoint_id=directory, process_group=ranks.group)


def load_rest(path: Path, ranks: Ranks) -> dict:
    """The ``rest`` of the checkpoint at ``path`` (nothing else is read), loaded as plain
    data only (``embcache.serialization``)."""
    size = read_metadata(path).state_dict_metadata[_REST].size
    state = {_REST: torch.empty(size, dtype=torch.uint8)}
    _load(state, path, ranks)
    return load(io.BytesIO(state[_REST].numpy().tobytes()), what=f"{path} ({_REST})")


def load_model_state(path: Path, model_state: dict, ranks: Ranks) -> None:
    """Read each rank's tensors of the checkpoint at ``path`` into ``model_state`` (in place:
    pass the model's own ``state_dict()``) and its other entries into the dict."""
    _load({"model": model_state}, path, ranks)


def _load(state: dict, path: Path, ranks: Ranks) -> None:
    load_dcp(state, path, process_group=ranks.group, no_dist=ranks.group is None)


# --------------------------------------------------------------------------- processes


def launch(entry: Callable, nproc: int, *args, device_type: str = "cpu"):
    """``entry(*args)`` in ``nproc`` processes on this machine (torch's elastic launcher), each
    with a process group initialized and an equal share of the CPU's threads; rank 0's
    result. The group runs collectives of CPU tensors with gloo; for ``device_type="cuda"``
    each rank takes GPU ``LOCAL_RANK`` and the group runs those of CUDA tensors with NCCL. ``entry`` must be a module-level function (the processes are spawned, and import
    it by name). A failed rank ends the others; the error names it. A SIGINT or SIGTERM to
    this process reaches the ranks too (from the terminal, or forwarded by the launcher, which
    waits 30 s for them to end): once they have, it raises :class:`dlrm.errors.Stopped`. If
    this process dies (SIGKILL), the kernel kills the ranks (Linux's parent-death signal)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The launcher's own log repeats a failed rank's traceback or a signal it got: the line
    # this raises says it once. Its modules' loggers each set their own level (WARNING).
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing.spawn")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"dlrm-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
    )
    # A killed rank cannot unregister its semaphores; multiprocessing's resource tracker
    # (started by the launcher, reading this environment) frees them and would warn about
    # it on stderr, after the one line below that already says the rank died.
    warning_options = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(
        filter(None, [warning_options, "ignore:resource_tracker:UserWarning"])
    )
    try:
        results = elastic_launch(config, _worker)(os.getpid(), device_type, entry, *args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", message)
        raise RunError(f"rank {rank} failed: {_last_line(str(message))}") from None
    except SignalException as e:
        raise Stopped(signal.Signals(e.sigval).name) from None
    finally:
        if warning_options is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = warning_options
    return results[0]


def _last_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "exited without a message"


def _worker(launcher: int, device_type: str, entry: Callable, *args):
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_run)(launcher, device_type, entry, *args)


_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent ends


def _end_with(launcher: int) -> None:
    """Have the kernel kill this process (SIGKILL) when its parent, the process ``launcher``,
    ends however it ends (``prctl(PR_SET_PDEATHSIG)``); end it now if it has already. A
    rank must not outlive its launcher: it would hold its memory (a GPU) for nobody. The
    signal torch's spawn sets, SIGINT, asks the loop to stop at a step and write a
    checkpoint (without the launcher's lock on the run directory), after which the rank
    waits forever for the dead launcher to read its result. SIGKILL ends every rank at
    once, so none is left waiting in a collective."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != launcher:  # it ended before the signal was set
        os.kill(os.getpid(), signal.SIGKILL)


def _run(launcher: int, device_type: str, entry: Callable, *args):
    _end_with(launcher)
    # torch and torchrec deprecation notices, once per rank, say nothing to a user of dlrm
    warnings.filterwarnings("ignore", category=FutureWarning)
    # the planner warns about how it was built and about sizes it guesses for dense tensors
    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
    backend = "gloo"
    if device_type == "cuda":  # this rank's GPU, before NCCL makes its context there
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    # the ranks share the machine's cores (a run's --threads, if given, overrides this)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    try:
        return entry(*args)
    finally:
        dist.destroy_process_group()
