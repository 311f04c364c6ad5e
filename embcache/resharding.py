"""Load our tables from a ``torch.distributed.checkpoint`` written under another sharding.

A sharded checkpoint holds each rank's shards as whole tables (``ShardedCachedEmbedding
BagCollection.local_tables``): table ``t`` whole, or a row-wise shard ``t@r`` holding rows
``[r, r + rows)``. :func:`load_tables` fills the tables of any other sharding of the same
collection (another world size, another plan, or one process) from them:

* a table whose name and rows a saved shard has is loaded from it exactly, its cache, LFU
  counts, optimizer state and statistics included;
* any other table gets its rows from every saved shard they overlap: each is read alone,
  its cache written back (``flush``: a cached row is rounded into its stored format, as at
  eviction), and the rows copied with their optimizer state and counts
  (``CachedLowPrecisionEmbedding.copy_rows_from``). Its cache starts empty.

Every process reads only the saved shards its own tables need, one at a time, without a
collective (``no_dist``): a process's peak is its tables plus one saved shard.

Example (two ranks saved, one process loads)::

    saved = SavedTables.from_dcp(path, "model.embedding_collection._local.embedding_bags.")
    load_tables(saved, dict(collection.embedding_bags.items()))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from embcache.embedding import CachedLowPrecisionEmbedding
from embcache.serialization import load_dcp, read_metadata


@dataclasses.dataclass(frozen=True)
class SavedShard:
    """A table or row-wise shard in a checkpoint: its name, table and rows."""

    name: str
    table: str
    start: int
    rows: int

    @property
    def stop(self) -> int:
        return self.start + self.rows


def split_name(name: str) -> tuple[str, int]:
    """(table, first row) of a shard named ``t`` (a whole table) or ``t@r``."""
    table, at, start = name.rpartition("@")
    if at and start.isdigit():
        return table, int(start)
    return name, 0


class SavedTables:
    """The tables and row-wise shards a checkpoint holds under a key prefix, read one at a
    time: from a ``torch.distributed.checkpoint`` directory (:meth:`from_dcp`) or from a
    ``state_dict()`` in memory, e.g. a ``torch.load``-ed file (:meth:`from_state_dict`)."""

    def __init__(self, shards: list[SavedShard], read: Callable[[str], dict], where: str):
        self.shards: dict[str, list[SavedShard]] = {}
        for shard in sorted(shards, key=lambda s: s.start):
            self.shards.setdefault(shard.table, []).append(shard)
        self.read = read  # shard name -> its saved state_dict()
        self.where = where

    @classmethod
    def from_dcp(cls, path: str | Path, prefix: str) -> SavedTables:
        metadata = read_metadata(path).state_dict_metadata
        sizes = {k: m.size for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}
        return cls(
            _shards(sizes, prefix),
            lambda name: _read_dcp(path, metadata, prefix + name),
            f"the checkpoint {path}",
        )

    @classmethod
    def from_state_dict(cls, state: Mapping[str, object], prefix: str) -> SavedTables:
        sizes = {k: v.shape for k, v in state.items() if isinstance(v, torch.Tensor)}

        def read(name: str) -> dict:
            key = prefix + name + "."
            return {k[len(key) :]: v for k, v in state.items() if k.startswith(key)}

        return cls(_shards(sizes, prefix), read, "the saved state")


def load_tables(saved: SavedTables, tables: Mapping[str, CachedLowPrecisionEmbedding]) -> None:
    """Fill ``tables`` (name -> table, named as :func:`split_name` reads) from ``saved``,
    whatever sharding saved them (see the module's docstring). Tables may be on the meta
    device: they are given memory here; tables in memory must have empty caches.

    Raises ``ValueError`` naming the table, before any table is written, if ``saved`` lacks
    a table or some of its rows; a failure while reading (a damaged file) may leave the
    tables part loaded."""
    plans = []
    for name, table in tables.items():
        base, start = split_name(name)
        stop = start + table.config.num_embeddings
        shards = saved.shards.get(base, [])
        exact = [s for s in shards if s.name == name and s.rows == table.config.num_embeddings]
        overlapping = exact or [s for s in shards if s.start < stop and start < s.stop]
        covered = start
        for s in overlapping:  # in row order
            if s.start <= covered:
                covered = max(covered, s.stop)
        if covered < stop:
            raise ValueError(
                f"table '{name}': {saved.where} does not hold its rows [{covered}, {stop})"
                + ("" if shards else f" (it has no table '{base}')")
            )
        plans.append((table, start, stop, bool(exact), overlapping))
    for table, start, stop, exact, overlapping in plans:
        if exact:
            table.load_state_dict(saved.read(overlapping[0].name))
            continue
        for s in overlapping:
            source = CachedLowPrecisionEmbedding.from_state(saved.read(s.name))
            source.flush()
            first, last = max(start, s.start), min(stop, s.stop)
            table.copy_rows_from(source, first - s.start, into=first - start, rows=last - first)


def _shards(sizes: Mapping[str, Sequence[int]], prefix: str) -> list[SavedShard]:
    """The shards among tensors ``sizes`` (key -> shape): one per ``<prefix><name>.weights``."""
    out = []
    for key, size in sizes.items():
        if key.startswith(prefix) and key.endswith(".weights"):
            name = key[len(prefix) : -len(".weights")]
            if "." not in name:  # a table of this module, not of a module inside it
                table, start = split_name(name)
                out.append(SavedShard(name, table, start, int(size[0])))
    return out


def load_alone(state: dict, path: str | Path) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` by this process alone (no
    collective, whatever process group exists), reading data only
    (``embcache.serialization.load_dcp``)."""
    load_dcp(state, path, no_dist=True)


def _read_dcp(path: str | Path, metadata: dict, key: str) -> dict:
    """The saved ``state_dict()`` of the module at ``key``, read by this process alone."""
    state: dict = {}
    for full, meta in metadata.items():
        if full.startswith(key + "."):
            tensor = isinstance(meta, TensorStorageMetadata)
            empty = torch.empty(meta.size, dtype=meta.properties.dtype) if tensor else None
            _nest(state, full[len(key) + 1 :], empty)
    root: dict = {}
    _nest(root, key, state)
    load_alone(root, path)  # fills ``state`` in place
    return state


def _nest(root: dict, dotted: str, value) -> None:
    """Put ``value`` at the dotted path ``dotted`` of nested dicts under ``root`` (as DCP
    addresses a state_dict's entries)."""
    *parents, last = dotted.split(".")
    for part in parents:
        root = root.setdefault(part, {})
    root[last] = value
