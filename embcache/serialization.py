"""Loading saved state without running code.

``torch.load`` and ``torch.distributed.checkpoint`` (DCP) unpickle what they read, and an
unpickler calls whatever function the file names. Here every read is restricted to data:

* :func:`load` reads a ``torch.save`` file with torch's weights-only unpickler (tensors and
  plain data: dicts, lists, tuples, strings, numbers...). Our own saved states (a table's or
  a collection's ``state_dict()``, the trainer's) are only that, so nothing is allow-listed.
* :func:`load_dcp` reads a DCP directory: its ``.metadata`` with an unpickler that builds
  only the classes DCP's metadata holds, each tensor item as DCP does (weights-only), a
  refusal naming its data file (:class:`SafeFileSystemReader`), and each non-tensor item
  with :func:`load` (:class:`SafeLoadPlanner`).

A file that refers to anything else is refused with :class:`UnsafeFileError` before the
thing is called.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future


class UnsafeFileError(ValueError):
    """A file refused because loading it would call something beyond building plain data.
    Its message is one line naming the file and what it refers to."""


def load(f: str | os.PathLike | IO[bytes], *, mmap: bool = False, what: str | None = None):
    """What ``torch.save`` wrote to ``f`` (a path or a binary buffer), tensors on the CPU,
    if it is tensors and plain data only. ``mmap``: map the file's tensors rather than read
    them (``f`` a path). ``what`` names ``f`` in messages (default: the path, or "a buffer").

    Raises :class:`UnsafeFileError` naming ``what`` and the globals the file refers to
    (those torch's weights-only unpickler refuses) if it refers to any. Any other failure
    propagates as torch raises it (a truncated, empty or foreign file: ``RuntimeError``,
    ``EOFError``, ``KeyError``...), its message possibly several lines long."""
    is_path = isinstance(f, (str, os.PathLike))
    where = what or (os.fspath(f) if is_path else "a buffer")
    start = None if is_path else f.tell()
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:  # torch raises it for what the unpickler refuses
        if start is not None:
            f.seek(start)
        refusal = _refusal(where, _refused_globals(f), "tensors and plain data")
        raise UnsafeFileError(refusal) from None


def _refused_globals(f: str | os.PathLike | IO[bytes]) -> list[str]:
    """The globals of the ``torch.save`` file ``f`` that the weights-only unpickler refuses,
    found by reading its pickle without running it; none if it names none (it builds a
    refused object another way) or cannot be read so (a file in torch's legacy format)."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    except ValueError:  # not in torch's zip format
        return []


def _refusal(where: str, refused: list[str], allowed: str) -> str:
    """The message refusing ``where``, which may hold only ``allowed`` and refers to the
    globals ``refused`` (none if unknown)."""
    if not refused:
        return f"{where}: refused: it holds more than {allowed}"
    calls = ", ".join(refused)
    return f"{where}: refused: loading it would call {calls} (it may hold only {allowed})"


# What DCP's ``.metadata`` pickle refers to, as seen by logging the unpickler's find_class
# while reading checkpoints written by dcp.save of a table (one process) and by a two-process
# `dlrm train` (torch 2.13): DCP's metadata dataclasses, the layout and memory-format
# encodings of TensorProperties, and the path StorageMeta records; besides, the tensors'
# dtypes, any of torch's (_DTYPES).
_METADATA_GLOBALS = frozenset(
    [
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
    ]
)
_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` at ``where``, refusing every global but its own."""

    def __init__(self, file: IO[bytes], where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        refusal = _refusal(self.where, [f"{module}.{name}"], "DCP's metadata")
        raise UnsafeFileError(refusal)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``read_metadata`` builds nothing but the metadata:
    it raises :class:`UnsafeFileError` naming the ``.metadata`` file and the global if the
    file refers to anything else. Its tensors are read as DCP reads them (weights-only), an
    item at a time: a tensor item whose stored bytes are not a tensor's (a pickle of
    anything else, or of something that would run code) raises :class:`UnsafeFileError`
    naming the data file and the item's key, not DCP's error."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file, str(path)).load()
        # as the parent's: a checkpoint written without storage_meta gets one for load_id
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            try:
                super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
            except Exception:
                refusal = self._refusal_of(item) if item.type == LoadItemType.TENSOR else None
                if refusal is None:
                    raise
                raise UnsafeFileError(refusal) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _refusal_of(self, item: ReadItem) -> str | None:
        """The message refusing the tensor ``item`` whose read failed, naming its file and
        the globals its stored bytes refer to, if those bytes are not a tensor's (loaded
        weights-only); None if they are (or are stored transformed: not told apart)."""
        stored = self.storage_data[item.storage_index]
        if stored.transform_descriptors:
            return None
        file = self.fs.concat_path(self.path, stored.relative_path)
        with self.fs.create_stream(file, "rb") as f:
            f.seek(stored.offset)
            data = io.BytesIO(f.read(stored.length))
        refused = []
        try:
            if isinstance(torch.load(data, map_location="cpu", weights_only=True), torch.Tensor):
                return None
        except pickle.UnpicklingError:
            data.seek(0)
            refused = _refused_globals(data)
        except Exception:  # not torch.save's bytes at all
            pass
        return _refusal(f"{file} ({item.dest_index.fqn})", refused, "a tensor")


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` (``options`` are its own) that reads each non-tensor
    item with :func:`load`: plain data only, else :class:`UnsafeFileError` naming the
    ``checkpoint`` and the item's key."""

    def __init__(self, checkpoint: str | os.PathLike, **options: Any):
        super().__init__(**options)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load(value, what=f"{self.checkpoint} ({fqn})")
        if self.flatten_state_dict:  # as DefaultLoadPlanner: into the nested dicts given
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The metadata of the DCP checkpoint directory ``path`` (see
    :class:`SafeFileSystemReader`)."""
    return SafeFileSystemReader(path).read_metadata()


def load_dcp(
    state: dict,
    path: str | os.PathLike,
    *,
    process_group: torch.distributed.ProcessGroup | None = None,
    no_dist: bool = False,
) -> None:
    """``torch.distributed.checkpoint.load(state, checkpoint_id=path, ...)`` reading data
    only (:class:`SafeFileSystemReader`, :class:`SafeLoadPlanner`): tensors in ``state`` are
    filled in place; every non-tensor entry (at any depth of its nested dicts) is replaced by
    the object saved there, as :func:`load` returns it. Whatever the entry held before is not
    read: an ``io.BytesIO`` passed in is replaced, not filled, and an ``io.BytesIO`` saved is
    refused (an ``io.BytesIO`` is not plain data; save bytes as a uint8 tensor instead).

    Raises :class:`UnsafeFileError` (itself, on every process of the group) if the metadata
    or an item refers to anything but data; other failures raise as DCP raises them."""
    # read first so that a refusal raises as itself: inside dcp.load a failure to read the
    # metadata is logged with its traceback and raised as an AssertionError
    read_metadata(path)
    with warnings.catch_warnings():
        if no_dist:  # DCP warns of every read without a process group, even one asked for
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(path),
                planner=SafeLoadPlanner(path),
                process_group=process_group,
                no_dist=no_dist,
            )
        except dcp.CheckpointException as e:  # each process's failures, gathered
            refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeFileError)]
            if refused:
                raise refused[0] from None
            raise
