"""Criteo TSV (or TorchRec's npy files) -> preprocessed memory-mapped arrays (docs/contract.md §7).

Public: ``preprocess_criteo`` (TSV), ``convert_torchrec_npys`` (TorchRec's npy files),
``split_ranges``, ``DatasetWriter`` (also used by ``dlrm.data.synthetic``), ``DataError``.

Input line (ASCII, tab-separated, newline-terminated; the last newline may be missing):
label, 13 integer features (may be empty or negative), 26 categorical features as hex strings
of 1 to 8 digits (may be empty). Ragged lines (trailing empty fields left out) are padded.

Output directory (what ``dlrm.data.batches`` reads):

* ``dense.npy``  float32 [N, 13]: ``log(max(x, 0) + 1)``, missing -> 0.
* ``sparse.npy`` int32 [N, 26]: per column ids in ``[0, cardinality)``:

  - contiguous (default): the distinct values of the column get ids 0, 1, 2, ... in the
    order of their integer (hex) value (sorted, not order of first appearance); missing is a
    value of its own that sorts before every hex value, so it has id 0 wherever it occurs in
    the column. With ``min_count > 1`` the values seen fewer than ``min_count`` times
    (missing excepted) share one id, the last one.
  - hashing (``max_ind_range = m >= 2``, instead of ``min_count``): a column with more than m
    distinct values (missing included) gets id 0 for missing and ``1 + value % (m - 1)``
    otherwise, cardinality m; a column with at most m distinct values stays contiguous.

* ``labels.npy`` float32 [N]: 0.0 or 1.0.
* ``meta.json``: rows, cardinalities, missing and rare ids per column, hashed columns, split
  row ranges, options, the malformed-line report, the source, the size and SHA-256 of each
  data file (``data_files``) and the dataset's ``fingerprint`` (``dataset_fingerprint``).

Rows keep the file order. Split: 7 equal consecutive "days" (the first ``N % 7`` days get one
row more); days 0-5 are ``train``, day 6 is halved: first half (the larger one when odd)
``test``, second half ``val``; half-open ``[start, stop)`` row ranges.

Malformed-line policy: skip and report. A line with a label other than 0/1, a dense value
that is not an integer of at most 15 characters, a categorical value that is not 1-8 hex
digits, more than 40 fields, a NUL byte anywhere (it is not cut there: the whole line is
malformed), or more than ``MAX_LINE_BYTES`` (64 KiB; a Criteo line has at most about 450)
is left out (of the outputs and of N); the count per reason and the first ``MAX_REPORTED``
line numbers (1-based), with the field (1-based: 1 the label, 2-14 I1-I13, 15-40 C1-C26)
where one is at fault, go to ``meta.json`` and to the log, in one line. An over-long line is
skipped without being held in memory: it is read through ``chunk_bytes`` at a time. If more
than half of the lines up to the end of the first block are malformed, the file is not taken
for Criteo at all: ``DataError``.

Atomic outputs: everything is written under temporary names ``.<file>.<pid>.tmp`` in the
output directory and moved in place with ``os.replace``; an old ``meta.json`` is removed
before the arrays are replaced and the new one moved in last, so a directory with
``meta.json`` is complete and consistent, and a failed run leaves no partial file behind. A
writer holds an exclusive ``flock`` on the output directory while it writes (a second writer
into the same directory waits), so the temporaries found by a writer that has the lock were
left by a killed run: they are removed before anything is written (``DatasetWriter``).

Speed and memory: the file is read in blocks of whole lines (``chunk_bytes``), split into
fields and parsed with numpy operations on the raw bytes (no Python object per line or
field). Two passes: count the categorical values, then map them and write the ``.npy`` files
sequentially. Peak memory: a few times a block plus the per-column dictionaries of distinct
values (16 bytes per distinct value), whatever the file length.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
NUM_DAYS = 7
MAX_REPORTED = 10
# Criteo-Kaggle train.txt, no threshold (docs/contract.md §7).
# fmt: off
KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
# fmt: on
FILES = ("dense.npy", "sparse.npy", "labels.npy", "meta.json")
FORMAT = "dlrm-criteo-npy/1"
LAYOUT = {  # in every meta.json
    "format": FORMAT,
    "num_dense": NUM_DENSE,
    "num_sparse": NUM_SPARSE,
    "dense": "float32 [N, 13] log(max(x, 0) + 1), missing -> 0",
    "sparse": "int32 [N, 26] ids in [0, cardinality) per column",
    "labels": "float32 [N] 0/1",
}
REASONS = (
    "too many fields",
    "bad label",
    "bad dense value",
    "bad categorical value",
    "NUL byte",
    "line too long",
)
_NUL, _LONG = REASONS.index("NUL byte") + 1, REASONS.index("line too long") + 1
MAX_LINE_BYTES = 64 << 10  # a longer line is malformed (skipped unread)

log = logging.getLogger(__name__)

# Digit value of a byte (base 10, base 16 in either case), or _BAD.
_BAD = 255
_DEC = np.full(256, _BAD, np.uint8)
_DEC[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX = _DEC.copy()
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


class DataError(Exception):
    """A user error about the data: missing or unreadable input, unwritable output, not Criteo."""


def split_ranges(num_rows: int) -> dict[str, list[int]]:
    """The ``train``/``test``/``val`` half-open row ranges of ``num_rows`` rows (see above)."""
    day = [num_rows // NUM_DAYS + (d < num_rows % NUM_DAYS) for d in range(NUM_DAYS)]
    train_end = sum(day[:-1])
    test_end = train_end + (day[-1] + 1) // 2
    return {"train": [0, train_end], "test": [train_end, test_end], "val": [test_end, num_rows]}


def preprocess_criteo(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    min_count: int = 1,
    max_ind_range: int = 0,
    chunk_bytes: int = 4 << 20,
    progress: bool = True,
) -> dict:
    """Preprocess the Criteo TSV file ``src`` into ``out_dir``; returns the metadata written.

    ``min_count``: values seen fewer times share one id; ``max_ind_range``: hash the columns
    with more distinct values (see the module docstring); the file is read ``chunk_bytes`` at
    a time. Raises ``DataError`` for user errors.
    """
    return _build(
        _TsvSource(Path(src), chunk_bytes, progress), Path(out_dir), min_count, max_ind_range
    )


def convert_torchrec_npys(
    src_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    min_count: int = 1,
    max_ind_range: int = 0,
    dense_min: int | None = None,
    chunk_rows: int = 1_000_000,
    progress: bool = True,
) -> dict:
    """Convert the output of TorchRec's ``BinaryCriteoUtils.tsv_to_npys`` into our layout.

    Reads ``day_{i}_{dense,sparse,labels}.npy`` for i = 0, 1, ... (concatenated in that order),
    or else ``train_{dense,sparse,labels}.npy`` (TorchRec's Kaggle script) from ``src_dir``.
    TorchRec stores dense as ``log(x - min + 2)`` (float32, ``min`` = the smallest raw integer
    of that whole file, missing read as 0), sparse as the raw hex values (int64, missing read
    as 0) and labels as int32 [N, 1]. We recover ``x = round(exp(dense)) - 2 + min`` (exact up
    to about ``x = 1e5``; above, TorchRec's float32 log is off by a relative 1e-6 and so is
    ``x``) and apply our transform. ``dense_min`` is that ``min``: TorchRec does not store it,
    so by default it is inferred per file, assuming that raw 0 is the most frequent integer
    (true for Criteo, where missing reads as 0). Sparse value 0 is taken as missing. Options
    and outputs as ``preprocess_criteo``; rows in the order of the files.
    """
    source = _TorchrecSource(Path(src_dir), dense_min, chunk_rows, progress)
    return _build(source, Path(out_dir), min_count, max_ind_range)


def _field_name(field: int) -> str:
    """``field`` (1-based) as Criteo names it: label, I1-I13, C1-C26."""
    if field == 1:
        return "label"
    return f"I{field - 1}" if field <= 1 + NUM_DENSE else f"C{field - 1 - NUM_DENSE}"


def _fields(block: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``block`` (whole lines, each ending with a newline) into tab-separated fields.

    Returns the bytes (uint8) with every separator replaced by 0 and 16 zero bytes appended,
    the start offset [n, 40] of each line's fields (a field that a ragged line lacks
    starts at the appended zeros) and the number of fields per line.
    """
    buf = np.zeros(len(block) + 16, np.uint8)
    buf[: len(block)] = np.frombuffer(block, np.uint8)
    sep = np.flatnonzero((buf == ord("\t")) | (buf == ord("\n"))).astype(np.int32)
    newline = buf[sep] == ord("\n")
    buf[sep] = 0
    line = np.cumsum(newline) - newline  # line of each separator (a newline ends its own line)
    first_sep = np.concatenate([[0], np.flatnonzero(newline)[:-1] + 1])
    rank = np.arange(len(sep)) - first_sep[line]  # 0-based field that the separator ends
    start = np.full((len(first_sep), NUM_FIELDS), len(block), np.intp)
    start[:, 0] = np.concatenate([[0], sep[newline][:-1] + 1])
    inner = (rank < NUM_FIELDS - 1) & ~newline
    start.ravel()[(line * NUM_FIELDS + rank + 1)[inner]] = sep[inner] + 1
    return buf, start, np.bincount(line, minlength=len(first_sep))


def _parse(buf: np.ndarray, start: np.ndarray, num_fields: np.ndarray) -> tuple[np.ndarray, ...]:
    """Parse the lines split by ``_fields`` (NUL bytes are not seen here: see ``_mark_nul``).

    Returns labels float32 [n], dense float32 [n, 13] (transformed), raw categorical values
    int64 [n, 26] (-1 = missing), the reason per line (0 = valid, else 1 + index in REASONS)
    and the field at fault per line (1-based, 0 = none or valid).
    """
    label, empty, ok = _number(*_chars(buf, start[:, 0], 2), _DEC, 10)
    bad_label = ~(ok & ~empty & (label <= 1))

    # Dense: an optional "-" then decimal digits, 15 characters at most; negatives become 0.
    dense_start = start[:, 1 : 1 + NUM_DENSE]
    chars, ended = _chars(buf, dense_start, 16)
    negative = chars[0] == ord("-")
    bare_sign = negative & (buf[dense_start + 1] == 0)
    chars[0][negative] = ord("0")
    x, _, ok = _number(chars, ended, _DEC, 10)
    dense_ok = ok & ~bare_sign
    bad_dense = ~dense_ok.all(axis=1)
    dense = np.log1p(np.where(negative, 0, x)).astype(np.float32)

    # Categorical: up to 8 hex digits.
    raw, missing, cat_ok = _number(*_chars(buf, start[:, 1 + NUM_DENSE :], 9), _HEX, 16)
    raw[missing] = -1
    bad_cat = ~cat_ok.all(axis=1)

    # Line length with its newline; the start of the padding ends the last line.
    too_long = np.diff(start[:, 0], append=len(buf) - 16) > MAX_LINE_BYTES + 1
    reason = np.select(
        [too_long, num_fields > NUM_FIELDS, bad_label, bad_dense, bad_cat], [_LONG, 1, 2, 3, 4], 0
    )
    field = np.zeros(len(reason), np.int64)
    bad = np.flatnonzero(reason)
    if len(bad):
        r = reason[bad]
        field[bad] = np.select(
            [r == _LONG, r == 1, r == 2, r == 3],
            [0, NUM_FIELDS + 1, 1, 2 + np.argmin(dense_ok[bad], axis=1)],
            2 + NUM_DENSE + np.argmin(cat_ok[bad], axis=1),
        )
    return label.astype(np.float32), dense, raw, reason, field


def _mark_nul(block: bytes, reason: np.ndarray, field: np.ndarray) -> None:
    """Mark the lines of ``block`` that hold a NUL byte malformed (reason and field of the
    first NUL), unless too long. ``_fields`` ends a field at a NUL, so such a line would
    otherwise be read cut short; called only when the block has one (a rare case)."""
    arr = np.frombuffer(block, np.uint8)
    nul = np.flatnonzero(arr == 0)
    line_start = np.concatenate([[0], np.flatnonzero(arr == ord("\n"))[:-1] + 1])
    lines, first = np.unique(np.searchsorted(line_start, nul, side="right") - 1, return_index=True)
    tabs = np.flatnonzero(arr == ord("\t"))
    fields = 1 + np.searchsorted(tabs, nul[first]) - np.searchsorted(tabs, line_start[lines])
    keep = reason[lines] != _LONG
    reason[lines[keep]] = _NUL
    field[lines[keep]] = fields[keep]


def _chars(buf: np.ndarray, start: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes k = 0, 1, ... of each field, as rows k of uint8 [k_max, *start.shape], and
    ``ended`` (bool, same shape): the field ended at or before byte k (bytes past the end
    are garbage). Stops at the first row where every field has ended, after ``width`` rows
    at most; a field longer than ``width - 1`` bytes is then one that never ended."""
    chars, ended = [buf[start]], [buf[start] == 0]
    while len(chars) < width and not ended[-1].all():
        chars.append(buf[start + len(chars)])
        ended.append(ended[-1] | (chars[-1] == 0))
    return np.stack(chars), np.stack(ended)


def _number(
    chars: np.ndarray, ended: np.ndarray, lut: np.ndarray, base: int
) -> tuple[np.ndarray, ...]:
    """Value (int64), emptiness and validity of the numbers written as ``chars, ended``.

    Valid: digits of ``base`` (``lut`` gives their values) that end in time (see ``_chars``);
    the empty string is valid (value 0).
    """
    digit = lut[chars]
    ok = ~((digit == _BAD) & ~ended).any(axis=0) & ended[-1]
    value = np.zeros(chars.shape[1:], np.int64)
    for d, e in zip(digit, ended):
        value = np.where(e, value, value * base + d)
    return value, ended[0], ok


class _Report:
    """Malformed lines: count per reason and the first MAX_REPORTED (line, reason, field) in
    line order (field 1-based, 0 = none)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(REASONS, 0)
        self.first: list[tuple[int, str, int]] = []

    def add(self, lines: np.ndarray, reasons: np.ndarray, fields: np.ndarray) -> None:
        """Malformed ``lines`` (ascending), their reasons (1 + index in REASONS), fields."""
        for r, n in zip(REASONS, np.bincount(reasons - 1, minlength=len(REASONS))):
            self.counts[r] += int(n)
        new = [
            (int(line), REASONS[r - 1], int(f))
            for line, r, f in zip(lines[:MAX_REPORTED], reasons, fields)
        ]
        self.first = sorted(self.first + new)[:MAX_REPORTED]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @staticmethod
    def describe(line: int, reason: str, field: int) -> str:
        """``line 7, field 16 (C2): NUL byte``."""
        where = f", field {field} ({_field_name(field)})" if 1 <= field <= NUM_FIELDS else ""
        if reason == "line too long":
            reason += f" (over {MAX_LINE_BYTES} bytes)"
        return f"line {line}{where}: {reason}"

    def summary(self, source: str) -> str:
        """One line: the file, the counts per reason and the first lines reported."""
        counts = ", ".join(f"{r}: {n}" for r, n in self.counts.items() if n)
        first = "; ".join(self.describe(*entry) for entry in self.first)
        more = "; ..." if self.total > len(self.first) else ""
        return f"{source}: skipped {self.total} malformed lines ({counts}): {first}{more}"

    def as_dict(self) -> dict:
        return {
            "policy": "skip the line and report it",
            "count": self.total,
            "by_reason": self.counts,
            "first": [
                {"line": line, "reason": r, **({"field": f} if f else {})}
                for line, r, f in self.first
            ],
        }


class _TsvSource:
    """A Criteo TSV file read in chunks; ``chunks()`` yields the valid rows and fills ``report``."""

    def __init__(self, path: Path, chunk_bytes: int, progress: bool) -> None:
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        self.path, self.chunk_bytes, self.progress = path, chunk_bytes, progress
        self.report = _Report()
        self.description = {"source": str(path.resolve()), "source_format": "criteo_tsv"}

    def chunks(self, desc: str) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        self.report = _Report()
        lines_before, checked = 0, False
        with tqdm(
            total=self.path.stat().st_size,
            desc=desc,
            unit="B",
            unit_scale=True,
            disable=not self.progress,
        ) as bar:
            for block in self._blocks():
                if isinstance(block, int):  # an over-long line of that many bytes, skipped
                    lines_before += 1
                    self.report.add(np.array([lines_before]), np.array([_LONG]), np.array([0]))
                    bar.update(block)
                    continue
                labels, dense, raw, reason, field = _parse(*_fields(block))
                if b"\0" in block:
                    _mark_nul(block, reason, field)
                bad = np.flatnonzero(reason)
                self.report.add(lines_before + 1 + bad, reason[bad], field[bad])
                lines_before += len(reason)
                if not checked and 2 * self.report.total > lines_before:
                    raise DataError(
                        f"{self.path}: {self.report.describe(*self.report.first[0])}; "
                        f"{self.report.total} of the first {lines_before} lines are "
                        "malformed: not a Criteo TSV file"
                    )
                checked = True
                bar.update(len(block))
                ok = reason == 0
                yield labels[ok], dense[ok], raw[ok]
        if lines_before == 0:
            raise DataError(f"{self.path}: empty file")

    def _blocks(self) -> Iterator[bytes | int]:
        """The file in blocks of whole lines, each ending with a newline, and in their place
        the length (int) of each line longer than ``MAX_LINE_BYTES``: such a line is read
        through and dropped a chunk at a time, so memory stays within a few chunks."""
        tail, skipped = b"", -1  # skipped: bytes of the over-long line being read through
        with open(self.path, "rb") as f:
            while chunk := f.read(self.chunk_bytes):
                if skipped >= 0:
                    end = chunk.find(b"\n")
                    if end < 0:
                        skipped += len(chunk)
                        continue
                    yield skipped + end + 1
                    chunk, skipped = chunk[end + 1 :], -1
                block = tail + chunk
                cut = block.rfind(b"\n") + 1
                block, tail = block[:cut], block[cut:]
                if block:
                    yield block
                if len(tail) > MAX_LINE_BYTES:
                    tail, skipped = b"", len(tail)
        if skipped >= 0:
            yield skipped
        elif tail:
            yield tail + b"\n"


class _TorchrecSource:
    """TorchRec npy files (see ``convert_torchrec_npys``), read in chunks through memory maps."""

    def __init__(self, src_dir: Path, dense_min: int | None, chunk_rows: int, progress: bool):
        if not src_dir.is_dir():
            raise DataError(f"{src_dir}: no such directory")
        prefixes = []
        while (src_dir / f"day_{len(prefixes)}_dense.npy").exists():
            prefixes.append(f"day_{len(prefixes)}")
        prefixes = prefixes or ["train"]
        self.files = [self._load(src_dir, p) for p in prefixes]
        self.chunk_rows, self.progress = chunk_rows, progress
        self.dense_min = [
            dense_min if dense_min is not None else self._infer_min(d) for d, _, _ in self.files
        ]
        self.report = _Report()
        self.description = {
            "source": str(src_dir.resolve()),
            "source_format": "torchrec_npy",
            "source_files": prefixes,
            "torchrec_dense_min": self.dense_min,
        }

    @staticmethod
    def _load(src_dir: Path, prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        arrays = []
        for part, width in (("dense", NUM_DENSE), ("sparse", NUM_SPARSE), ("labels", 1)):
            path = src_dir / f"{prefix}_{part}.npy"
            try:
                a = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise DataError(f"{path}: cannot read as a TorchRec Criteo npy file: {e}") from e
            rows = len(arrays[0]) if arrays else len(a)
            if a.shape != (rows, width):
                raise DataError(f"{path}: shape {a.shape}, expected ({rows}, {width})")
            arrays.append(a)
        return tuple(arrays)

    def _infer_min(self, dense: np.ndarray) -> int:
        """TorchRec's ``min`` of a file such that its most frequent raw integer is 0."""
        counts = np.zeros(1024, np.int64)
        for start in range(0, len(dense), self.chunk_rows):
            v = np.rint(np.exp(dense[start : start + self.chunk_rows].astype(np.float64)))
            counts += np.bincount(np.minimum(v, 1023).astype(np.int64).ravel(), minlength=1024)
        return 2 - int(np.argmax(counts))

    def chunks(self, desc: str) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        total = sum(len(labels) for _, _, labels in self.files)
        with tqdm(total=total, desc=desc, unit="rows", disable=not self.progress) as bar:
            for (dense, sparse, labels), m in zip(self.files, self.dense_min):
                for start in range(0, len(labels), self.chunk_rows):
                    stop = min(start + self.chunk_rows, len(labels))
                    x = np.rint(np.exp(dense[start:stop].astype(np.float64))) - 2 + m
                    raw = sparse[start:stop].astype(np.int64)
                    y = labels[start:stop, 0]
                    bad = np.flatnonzero((y != 0) & (y != 1))
                    if len(bad):
                        raise DataError(
                            f"{labels.filename}: row {start + bad[0]}: label {y[bad[0]]}, expected "
                            "0 or 1 (TorchRec writes -1 for the unlabeled Kaggle test set)"
                        )
                    raw[raw == 0] = -1
                    bar.update(stop - start)
                    yield y.astype(np.float32), np.log1p(np.maximum(x, 0)).astype(np.float32), raw


class _ValueCounter:
    """Distinct values and their counts over chunks: sorted runs merged like a binary counter."""

    def __init__(self) -> None:
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, values: np.ndarray) -> None:
        self.runs.append(np.unique(values, return_counts=True))
        while len(self.runs) > 1 and len(self.runs[-2][0]) <= 2 * len(self.runs[-1][0]):
            self.runs.append(self._merge(self.runs.pop(), self.runs.pop()))

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        while len(self.runs) > 1:
            self.runs.append(self._merge(self.runs.pop(), self.runs.pop()))
        return self.runs[0] if self.runs else (np.zeros(0, np.int64), np.zeros(0, np.int64))

    @staticmethod
    def _merge(a: tuple, b: tuple) -> tuple[np.ndarray, np.ndarray]:
        values, inverse = np.unique(np.concatenate([a[0], b[0]]), return_inverse=True)
        counts = np.bincount(inverse, weights=np.concatenate([a[1], b[1]]), minlength=len(values))
        return values, counts.astype(np.int64)


class _Column:
    """The id assignment of one categorical column (see the module docstring)."""

    def __init__(self, values: np.ndarray, counts: np.ndarray, min_count: int, max_ind_range: int):
        self.hashed = 0 < max_ind_range < len(values)
        if self.hashed:
            self.cardinality, self.missing_id, self.rare_id = max_ind_range, 0, None
            return
        keep = (counts >= min_count) | (values == -1)
        # The sentinel (above every hex value) makes every searchsorted position a valid index.
        self.keep = np.append(values[keep], np.iinfo(np.int64).max)
        self.missing_id = 0 if len(values) and values[0] == -1 else None
        self.rare_id = None if keep.all() else int(keep.sum())
        self.cardinality = int(keep.sum()) + (self.rare_id is not None)

    def ids(self, raw: np.ndarray) -> np.ndarray:
        if self.hashed:
            return np.where(raw < 0, 0, 1 + raw % (self.cardinality - 1))
        pos = np.searchsorted(self.keep, raw)
        return pos if self.rare_id is None else np.where(self.keep[pos] == raw, pos, self.rare_id)


def _build(source, out_dir: Path, min_count: int, max_ind_range: int) -> dict:
    """Two passes over ``source``: count the categorical values, then map and write (atomically)."""
    if min_count < 1 or max_ind_range < 0 or max_ind_range == 1:
        raise ValueError("need min_count >= 1 and max_ind_range = 0 or >= 2")
    if min_count > 1 and max_ind_range:
        raise ValueError("min_count and max_ind_range are alternatives: give one of them")
    counters = [_ValueCounter() for _ in range(NUM_SPARSE)]
    num_rows = 0
    for labels, _, raw in source.chunks("pass 1/2: counting"):
        num_rows += len(labels)
        for c, counter in enumerate(counters):
            counter.add(raw[:, c])
    report = source.report.as_dict()
    if report["count"]:
        log.warning("%s", source.report.summary(source.description["source"]))
    if num_rows == 0:
        raise DataError(f"{source.description['source']}: no valid Criteo rows")
    columns = [_Column(*counter.result(), min_count, max_ind_range) for counter in counters]
    del counters

    with DatasetWriter(out_dir, num_rows) as out:
        for labels, dense, raw in source.chunks("pass 2/2: writing"):
            out.append(
                dense, np.stack([col.ids(raw[:, c]) for c, col in enumerate(columns)], 1), labels
            )
        meta = {
            **source.description,
            "rows": num_rows,
            "cardinalities": [col.cardinality for col in columns],
            "missing_ids": [col.missing_id for col in columns],
            "rare_ids": [col.rare_id for col in columns],
            "hashed_columns": [c for c, col in enumerate(columns) if col.hashed],
            "splits": split_ranges(num_rows),
            "options": {"min_count": min_count, "max_ind_range": max_ind_range},
            "sparse_ids": "sorted by hex value, missing -> 0 (if it occurs), rare -> last id; "
            "hashed columns: missing -> 0, else 1 + value % (max_ind_range - 1)",
            "malformed": report,
        }
        out.commit(meta)
    return meta


DATA_FILES = FILES[:3]  # the arrays; meta.json describes them
_TEMPORARY = re.compile(r"\.(" + "|".join(map(re.escape, FILES)) + r")\.(\d+)\.tmp")


def dataset_fingerprint(meta: dict) -> str:
    """The identity of a preprocessed directory: ``sha256:`` + SHA-256 of the canonical JSON
    of its format, rows, cardinalities and ``data_files`` (each array file's size and the
    SHA-256 of its whole content, ``.npy`` header included).

    So it covers every byte a run reads (the arrays) and what shapes the model (cardinalities),
    and two directories have the same fingerprint exactly when they hold the same data,
    whatever their path, source path or other meta fields (the report, timing-free anyway).
    It costs nothing extra to read: ``DatasetWriter`` hashes the bytes as it writes them
    (SHA-256 runs at about 1.7 GB/s, a few seconds for Criteo Kaggle's 7 GB). It is not
    checked against the files on load (that would read them all): it names the data, it
    does not guard them against corruption (``data_files`` lets one check that by hand).
    """
    content = {
        "format": meta.get("format", FORMAT),
        "rows": meta["rows"],
        "cardinalities": list(meta["cardinalities"]),
        "data_files": meta["data_files"],
    }
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def file_digests(directory: str | os.PathLike) -> dict:
    """``data_files`` of a written directory, computed by reading its arrays (for directories
    written before meta.json had it); the same values ``DatasetWriter`` records."""
    digests = {}
    for name in DATA_FILES:
        path = Path(directory) / name
        try:
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            digests[name] = {"bytes": path.stat().st_size, "sha256": digest}
        except OSError as e:
            raise DataError(f"{path}: cannot read: {e}") from e
    return digests


class DatasetWriter:
    """Writes a preprocessed directory of ``num_rows`` rows atomically and sequentially.

    ``append`` writes the next rows to ``.npy`` files under temporary names in ``out_dir``
    (plain sequential writes, so memory stays bounded, mapped pages included) and hashes
    them on the way; ``commit(meta)`` checks that all rows came, adds the common layout
    fields, ``data_files`` and ``fingerprint`` to ``meta`` and moves everything in place (old
    ``meta.json`` removed first, new one moved last); leaving the ``with`` block without a
    commit (an exception) removes the temporary files.

    Killed runs: from creation to exit the writer holds an exclusive ``flock`` on
    ``out_dir`` (waiting for another writer of the same directory, if any), so the
    temporaries it then finds there (``.<file>.<pid>.tmp``) are those of a killed run and
    are removed first. Where ``flock`` is not supported (some network file systems), only
    those of processes no longer running on this machine are removed.
    """

    SHAPES = {
        "dense.npy": (np.float32, (NUM_DENSE,)),
        "sparse.npy": (np.int32, (NUM_SPARSE,)),
        "labels.npy": (np.float32, ()),
    }

    def __init__(self, out_dir: str | os.PathLike, num_rows: int) -> None:
        self.out_dir, self.num_rows, self.rows = Path(out_dir), num_rows, 0
        self.tmp = {name: self.out_dir / f".{name}.{os.getpid()}.tmp" for name in FILES}
        self.files, self.hashes, self.lock_fd = {}, {}, None
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(f"{self.out_dir}: cannot create the output directory: {e}") from e
        try:
            self._remove_stale(locked=self._lock())
            for name, (dtype, row_shape) in self.SHAPES.items():
                header = io.BytesIO()
                np.lib.format.write_array_header_1_0(
                    header,
                    {
                        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                        "fortran_order": False,
                        "shape": (num_rows, *row_shape),
                    },
                )
                self.hashes[name] = hashlib.sha256(header.getvalue())
                self.files[name] = open(self.tmp[name], "wb")
                self.files[name].write(header.getvalue())
        except OSError as e:
            self.__exit__()
            raise DataError(f"{self.out_dir}: cannot write the output: {e}") from e

    def _lock(self) -> bool:
        """Take the exclusive lock on ``out_dir`` (waiting for it); False where unsupported."""
        try:
            import fcntl
        except ImportError:
            return False
        try:
            self.lock_fd = os.open(self.out_dir, os.O_RDONLY)
        except OSError:  # a directory we may write but not read
            return False
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("%s: another process is writing here; waiting for it", self.out_dir)
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        except OSError:
            return False
        return True

    def _remove_stale(self, locked: bool) -> None:
        """Remove the temporaries of killed runs (see the class docstring)."""
        stale = []
        for path in sorted(self.out_dir.iterdir()):
            match = _TEMPORARY.fullmatch(path.name)
            if match and (locked or not _running(int(match[2]))):
                path.unlink(missing_ok=True)
                stale.append(path.name)
        if stale:
            log.warning("%s: removed %s, left by a killed run", self.out_dir, ", ".join(stale))

    def append(self, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> None:
        """Write the next rows: dense [n, 13], sparse ids [n, 26], labels [n]."""
        self.rows += len(labels)
        if self.rows > self.num_rows:
            raise DataError(
                f"{self.out_dir}: more rows than the {self.num_rows} counted "
                "(did the input change while being read?)"
            )
        try:
            for (name, (dtype, _)), rows in zip(self.SHAPES.items(), (dense, sparse, labels)):
                rows = np.ascontiguousarray(rows, dtype)
                self.hashes[name].update(rows)
                rows.tofile(self.files[name])
        except OSError as e:
            raise DataError(f"{self.out_dir}: cannot write the output: {e}") from e

    def commit(self, meta: dict) -> None:
        if self.rows != self.num_rows:
            raise DataError(
                f"{self.out_dir}: {self.rows} rows, {self.num_rows} counted "
                "(did the input change while being read?)"
            )
        meta.update(LAYOUT)
        try:
            self._close()
            meta["data_files"] = {
                name: {"bytes": self.tmp[name].stat().st_size, "sha256": h.hexdigest()}
                for name, h in self.hashes.items()
            }
            meta["fingerprint"] = dataset_fingerprint(meta)
            self.tmp["meta.json"].write_text(json.dumps(meta, indent=1))
            (self.out_dir / "meta.json").unlink(missing_ok=True)
            for name in FILES:
                os.replace(self.tmp[name], self.out_dir / name)
        except OSError as e:
            raise DataError(f"{self.out_dir}: cannot write the output: {e}") from e

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._close()
        for path in self.tmp.values():
            path.unlink(missing_ok=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the lock
            self.lock_fd = None

    def _close(self) -> None:
        for f in self.files.values():
            f.close()


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True
