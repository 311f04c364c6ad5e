"""What a run's checkpoint holds, and loading it at any number of processes (docs/design.md,
"Runs and checkpoints"). Where and how its files are written is :mod:`dlrm.run_dir`.

A checkpoint holds the run's configuration (its identity), the trainer's state, the
progress and the dataset's fingerprint. One process writes them into ``state.pt``; several
write a ``torch.distributed.checkpoint`` of their shards, the rest as one item
(:func:`dlrm.distributed.write_checkpoint_files`). Reading never unpickles anything but
plain data and tensors (:mod:`embcache.serialization`), and only after every byte was
checked against the manifest (:func:`dlrm.run_dir.verify`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dlrm import distributed, run_dir
from dlrm.errors import RunError
from embcache.resharding import SavedTables, load_tables
from embcache.serialization import UnsafeFileError, load

STATE = "state.pt"  # the one file of a one-process checkpoint
_TABLES = "embedding_collection."  # the model's state entries of its tables start so


def save(out_dir: Path, cfg, trainer, progress: dict, data: dict, ranks) -> Path:
    """Write the checkpoint of ``trainer`` at ``progress["step"]`` into ``out_dir`` (made the
    latest, the one before kept: :func:`dlrm.run_dir.write_checkpoint`); its path. ``cfg``:
    the run's ``RunConfig``; ``data``: its dataset, ``{"dir", "fingerprint"}``;
    ``progress["run"]`` names the run."""
    state = trainer.state_dict()
    rest = {
        "config": cfg.identity(),
        "trainer": state,
        "progress": progress,
        "data": data,
        "world_size": ranks.world_size,
    }
    if ranks.world_size == 1:

        def write(directory: Path) -> None:
            torch.save(rest, directory / STATE)

    else:
        model_state = state.pop("model")  # each rank's tensors; the rest is equal everywhere

        def write(directory: Path) -> None:
            distributed.write_checkpoint_files(directory, model_state, rest, ranks)

    info = {"step": progress["step"], "run": progress["run"], "world_size": ranks.world_size}
    return run_dir.write_checkpoint(out_dir, write, info, ranks)


def open_checkpoint(path: Path, ranks) -> dict:
    """The checkpoint at ``path``, once every file has been checked against its manifest:
    a one-process checkpoint whole (its tensors memory-mapped), a sharded one without the
    model's tensors (:func:`load_into` reads them). RunError naming the file if it is
    damaged, would run code, or is not a dlrm checkpoint."""
    manifest = run_dir.verify(path, ranks)
    try:
        if STATE in manifest["files"]:
            state = load(path / STATE, mmap=True)
        else:
            state = distributed.load_rest(path, ranks)
    except UnsafeFileError as e:
        raise RunError(str(e)) from None
    except Exception as e:  # a file that its manifest vouches for, yet not a checkpoint's
        raise RunError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not {"config", "trainer", "progress"} <= set(state):
        raise RunError(f"{path}: not a dlrm checkpoint")
    return state


def check(state: dict, path: Path, cfg, data: dict | None) -> None:
    """Raise RunError unless the opened checkpoint ``state`` was written by the configuration
    ``cfg`` (a ``RunConfig``: every field of its identity equal) and, given ``data``, on a
    dataset of the same fingerprint (the configuration names the data by path only, and the
    same path may hold another dataset by now: regenerated with another seed or rows). The
    data are checked first, so a run pointed at another directory is told both
    fingerprints; without ``data``, neither they nor their path are checked (the check before
    the data are made ready)."""
    was = state.get("data") or {}
    if data and was.get("fingerprint") and was["fingerprint"] != data["fingerprint"]:
        raise RunError(
            f"{path}: the run started on the dataset {was.get('dir')} (fingerprint "
            f"{was['fingerprint'][:23]}), now {data['dir']} (fingerprint "
            f"{data['fingerprint'][:23]}) holds other data: resume on the run's own dataset"
        )
    saved, mine = state["config"], cfg.identity()
    if data is None:  # the data's path is checked with their fingerprint, once they are read
        del mine["data"]
    saved = {**cfg.ADDED_FIELDS, **saved}
    diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
    if diff:
        fields = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise RunError(f"{path} was written by another configuration ({fields})")


def load_into(trainer, path: Path, state: dict, ranks, device: torch.device) -> None:
    """Load the opened checkpoint ``state`` (:func:`open_checkpoint` of ``path``) into
    ``trainer``, whatever number of processes and whichever device wrote it. At the world size
    that wrote it the state is the saved one exactly; at another the tables are cut anew
    (``embcache.resharding.load_tables``: rows re-cut, caches written back). In one process
    the model is on ``device`` afterwards (tables built without memory are filled in host
    memory, then moved)."""
    if state["world_size"] == 1:  # everything is in ``state``
        if ranks.world_size == 1:
            trainer.load_state_dict(state["trainer"])
            trainer.model.to(device)
            return
        saved = state["trainer"]["model"]
        tables = SavedTables.from_state_dict(saved, _TABLES + "embedding_bags.")
        dense = {k: v for k, v in saved.items() if not k.startswith(_TABLES)}
        _load_resharded(trainer, state["trainer"], dense, tables)
        return
    model_state = trainer.model.state_dict()
    if state["world_size"] == ranks.world_size:  # the same shards: exactly as saved
        distributed.load_model_state(path, model_state, ranks)
        trainer.load_state_dict({**state["trainer"], "model": model_state})
        return
    dense = {k: v for k, v in model_state.items() if not k.startswith(_TABLES)}
    distributed.load_model_state(path, dense, ranks)
    tables = SavedTables.from_dcp(path, "model." + _TABLES + "_local.embedding_bags.")
    _load_resharded(trainer, state["trainer"], dense, tables)
    if ranks.world_size == 1:
        trainer.model.to(device)


def _load_resharded(trainer, trainer_state: dict, dense: dict, tables: SavedTables) -> None:
    """This process's tables (or shards) from ``tables``, the dense entries from ``dense``,
    the rest of the trainer from ``trainer_state``."""
    try:
        load_tables(tables, distributed.process_tables(trainer.model))
    except ValueError as e:
        raise RunError(str(e)) from None
    model_state = {**trainer.model.state_dict(), **dense}
    trainer.load_state_dict({**trainer_state, "model": model_state})
