"""Mini-batches from a preprocessed directory (the layout of ``dlrm.data.criteo``, also written
by ``dlrm.data.synthetic``): ``dense.npy``, ``sparse.npy``, ``labels.npy`` (memory-mapped,
read-only) and ``meta.json`` (cardinalities, split row ranges, the dataset's ``fingerprint``:
``criteo.dataset_fingerprint``).

A directory written before meta.json had a fingerprint gets it on ``load``, computed from its
files, which are read once for that (the same value a fresh preprocessing of the same data
would store; it is not written back, so a read-only directory works). Re-running the
preprocessing (or the generator) stores it and makes later loads instant.

A batch is ``Batch(dense, ids, labels)`` of plain tensors: dense float32 [B, 13], ids int32
[B, 26] (one id of each categorical feature ``cat_0`` .. ``cat_25`` per sample, as the data
store them: half the bytes of int64 to copy to a device, which widens them there), labels
float32 [B]. Batch b of an epoch holds the rows
``order[b * B:(b + 1) * B]`` of the split, where ``order`` is the split's rows in file order,
or, with ``shuffle``, a permutation drawn from ``numpy.random.default_rng([seed, epoch])``
(the rows inside a shuffled batch are then sorted, for locality in the memory map).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from dlrm.data.criteo import (
    FILES,
    NUM_DENSE,
    NUM_SPARSE,
    DataError,
    dataset_fingerprint,
    file_digests,
)

T = TypeVar("T")

SPLITS = ("train", "val", "test")
log = logging.getLogger(__name__)


class Batch(NamedTuple):
    dense: torch.Tensor  # float32 [B, 13]
    ids: torch.Tensor  # int32 [B, 26]: sample b's id of feature cat_k is ids[b, k]
    labels: torch.Tensor  # float32 [B]

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory, which a copy to a GPU can overlap."""
        return Batch(*(t.pin_memory() for t in self))

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device``; from pinned memory to a GPU without waiting (the copies
        are ordered on the current stream before the work that reads them)."""
        return Batch(*(t.to(device, non_blocking=True) for t in self))


@dataclass(frozen=True)
class Dataset:
    """A preprocessed directory: read-only memory maps and its metadata."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    meta: dict

    def split(self, name: str) -> tuple[int, int]:
        """The half-open row range of split ``name`` (one of SPLITS)."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}, expected one of {SPLITS}")
        start, stop = self.meta["splits"][name]
        return start, stop


def read_meta(path: str | os.PathLike) -> dict:
    """``meta.json`` of the preprocessed directory ``path``; ``DataError`` if there is none."""
    meta_file = Path(path) / "meta.json"
    try:
        return json.loads(meta_file.read_text())
    except FileNotFoundError as e:
        raise DataError(
            f"{meta_file}: no such file: {path} is not a complete preprocessed "
            "directory (run the preprocessing or the synthetic generator)"
        ) from e
    except (OSError, ValueError) as e:
        raise DataError(f"{meta_file}: cannot read: {e}") from e


def cardinalities(path: str | os.PathLike) -> list[int]:
    """The number of ids of each of the 26 categorical features, from ``meta.json``."""
    return list(read_meta(path)["cardinalities"])


def load(path: str | os.PathLike) -> Dataset:
    """Memory-map the preprocessed directory ``path`` (checked against its ``meta.json``);
    ``meta["fingerprint"]`` is always there (computed for an old directory: module docstring)."""
    meta = read_meta(path)
    rows = meta["rows"]
    arrays = []
    for name, shape in zip(FILES, [(rows, NUM_DENSE), (rows, NUM_SPARSE), (rows,)]):
        try:
            a = np.load(Path(path) / name, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DataError(f"{Path(path) / name}: cannot read: {e}") from e
        if a.shape != shape:
            raise DataError(f"{Path(path) / name}: shape {a.shape}, meta.json says {shape}")
        arrays.append(a)
    if "fingerprint" not in meta:
        start = time.perf_counter()
        meta["data_files"] = file_digests(path)
        meta["fingerprint"] = dataset_fingerprint(meta)
        log.warning(
            "%s: meta.json has no fingerprint (written by an older version): computed from "
            "the files in %.1f s; re-run the preprocessing to store it",
            path,
            time.perf_counter() - start,
        )
    return Dataset(*arrays, meta)


def make_batch(dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> Batch:
    """A ``Batch`` (copies) from numpy rows: dense [B, 13], sparse ids [B, 26], labels [B]."""
    return Batch(
        torch.from_numpy(np.array(dense, dtype=np.float32)),
        torch.from_numpy(np.array(sparse, dtype=np.int32)),
        torch.from_numpy(np.array(labels, dtype=np.float32)),
    )


def num_batches(num_rows: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches per epoch of a split of ``num_rows`` rows."""
    return num_rows // batch_size if drop_last else -(-num_rows // batch_size)


def iterate_batches(
    data: str | os.PathLike | Dataset,
    split: str,
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    start_batch: int = 0,
    part: tuple[int, int] = (0, 1),
) -> Iterator[Batch]:
    """The batches ``start_batch, start_batch + 1, ...`` of one epoch over ``split``.

    ``data``: a directory or a ``load``-ed ``Dataset``. ``drop_last`` drops a last batch of
    fewer than ``batch_size`` rows. The order is a function of (``seed``, ``epoch``) only, so
    a resumed run that passes the same values and ``start_batch`` continues exactly.
    ``part=(i, n)``: only part ``i`` of ``n`` of every batch, its rows split in order into
    ``n`` parts whose sizes differ by at most one (``numpy.array_split``), as ``n``
    processes that share each batch read it.
    """
    ds = data if isinstance(data, Dataset) else load(data)
    start, stop = ds.split(split)
    order = (
        start + np.random.default_rng([seed, epoch]).permutation(stop - start) if shuffle else None
    )
    for b in range(start_batch, num_batches(stop - start, batch_size, drop_last)):
        lo, hi = b * batch_size, min((b + 1) * batch_size, stop - start)
        rows = np.arange(start + lo, start + hi) if order is None else np.sort(order[lo:hi])
        if part != (0, 1):
            rows = np.array_split(rows, part[1])[part[0]]
        rows = slice(rows[0], rows[-1] + 1) if order is None and len(rows) else rows
        yield make_batch(ds.dense[rows], ds.sparse[rows], ds.labels[rows])


def with_next(items: Iterable[T]) -> Iterator[tuple[T, T | None]]:
    """Each item with the one after it (None after the last): one item read ahead, so that a
    step can start preparing the next (the trainer's prefetch)."""
    source = iter(items)
    current = next(source, None)
    while current is not None:
        following = next(source, None)
        yield current, following
        current = following


def on_device(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    """``batches`` on ``device``. To a GPU, a thread reads and pins batch ``i + 1`` while
    batch ``i`` trains, and each is copied from pinned memory without waiting (ordered on the
    current stream before the step that reads it); on the CPU they are passed on as they are."""
    if device.type == "cpu":
        yield from batches
        return
    source = iter(batches)

    def next_pinned() -> Batch | None:
        batch = next(source, None)
        return None if batch is None else batch.pin_memory()

    with ThreadPoolExecutor(1, thread_name_prefix="batches") as reader:
        ahead = reader.submit(next_pinned)
        while (pinned := ahead.result()) is not None:
            ahead = reader.submit(next_pinned)
            yield pinned.to(device)
