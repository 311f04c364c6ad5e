"""A run directory on disk (docs/design.md, "Runs and checkpoints"): one writer at a time,
files written under unique temporary names, checkpoints that carry their own checksums.

Layout of ``OUT``::

    .lock              held by the one run writing OUT (its PID inside)
    checkpoint/        the latest checkpoint: its files, then MANIFEST.json, written last
    checkpoint.prev/   the one before, of the same run (a fallback if the latest is damaged)
    report.json

A checkpoint directory holds ``state.pt`` (one process) or a ``torch.distributed.checkpoint``
(several), and ``MANIFEST.json``: its step, the run it belongs to and every file's size and
SHA-256. It is written under a temporary name and renamed into place, so ``checkpoint`` is
always complete; :func:`verify` checks every byte against the manifest before anything is
loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dlrm.errors import RunError

CHECKPOINT = "checkpoint"
PREVIOUS = "checkpoint.prev"
MANIFEST = "MANIFEST.json"
FORMAT = 1  # of a checkpoint directory; a manifest names it
_FORMAT_0 = "checkpoint.pt"  # the one file that earlier versions wrote, without checksums
LOCK = ".lock"
_TMP_SUFFIX = ".tmp"


@contextlib.contextmanager
def lock(out_dir: Path) -> Iterator[None]:
    """Hold ``out_dir`` for this process alone while the block runs; refuse at once
    (:class:`RunError` naming the holder's PID) if another process holds it. The lock is an
    ``flock`` on ``out_dir/.lock``, released by the operating system when its holder ends,
    however it ends: a killed run does not block the next one. Temporaries left in
    ``out_dir`` by a killed writer are removed once the lock is held."""
    fd = os.open(out_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunError(
            f"{out_dir} is in use by another run (PID {holder}); one run writes a directory "
            "at a time"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        for stale in out_dir.glob(f".*{_TMP_SUFFIX}"):
            _remove(stale)
        yield
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """A name beside ``path`` that no other process uses (``.NAME.PID-RANDOM.tmp``)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{_TMP_SUFFIX}")


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` to a temporary name, then rename it to ``path``: ``path`` is the old
    file or the whole new one, never a part. On any failure or interruption the temporary
    is removed (:class:`RunError` for an ``OSError``)."""
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, OSError):
            raise RunError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def write_checkpoint(out_dir: Path, write: Callable[[Path], None], info: dict, ranks) -> Path:
    """Write a checkpoint of ``out_dir``'s run and make it the latest; its path.

    ``write(directory)`` runs on every rank of ``ranks`` (``dlrm.distributed.Ranks``) and
    puts the checkpoint's files into a new directory; each rank then hashes its share of
    them, and rank 0 writes the manifest (``info``, which names the ``step`` and the
    ``run``, and every file's size and SHA-256) and renames the directory into place. The
    latest checkpoint becomes ``checkpoint.prev`` if it is of the same run; any other is
    removed. Until the rename, the checkpoints are as they were; an interrupted write leaves
    no temporary behind (one left by a killed process goes when the next run locks
    ``out_dir``)."""
    tmp = Path(ranks.gather(str(temporary_name(out_dir / CHECKPOINT)))[0])
    try:
        if ranks.main:
            tmp.mkdir()
        ranks.barrier()
        write(tmp)
        ranks.barrier()
        names = sorted(p.name for p in tmp.iterdir())
        mine = _hash_files(tmp, names[ranks.rank :: ranks.world_size], sync=True)
        files = {name: entry for part in ranks.gather(mine) for name, entry in part.items()}
        if ranks.main:
            manifest = {**info, "format": FORMAT, "files": files}
            manifest = json.dumps(manifest, indent=1, sort_keys=True)
            (tmp / MANIFEST).write_text(manifest)
            _make_latest(out_dir, tmp, info["run"])
        ranks.barrier()
    except BaseException as e:
        if ranks.main:
            _remove(tmp)
        if isinstance(e, OSError):
            raise RunError(f"cannot write a checkpoint in {out_dir}: {e.strerror or e}") from None
        raise
    return out_dir / CHECKPOINT


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The run's latest checkpoint: ``checkpoint``, or ``checkpoint.prev`` if a write was
    interrupted between its two renames; None if there is none."""
    for name in (CHECKPOINT, PREVIOUS):
        if (out_dir / name).is_dir():
            return out_dir / name
    return None


def require_checkpoint(out_dir: Path) -> Path:
    """:func:`latest_checkpoint`, or RunError saying there is none (and naming a checkpoint
    of the format before checksums, which is not loaded)."""
    path = latest_checkpoint(out_dir)
    if path is None:
        old = out_dir / _FORMAT_0
        raise RunError(
            f"{out_dir}: no checkpoint"
            + (f" ({old} is of format 0, without checksums: not loaded)" if old.exists() else "")
        )
    return path


def remove_checkpoints(out_dir: Path) -> None:
    """Remove every checkpoint of ``out_dir`` (a finished run that keeps only its report)."""
    for name in (CHECKPOINT, PREVIOUS):
        _remove(out_dir / name)


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint ``path`` (JSON: never executes anything); RunError
    naming the file if it is missing or malformed."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
        files = manifest["files"]
        ok = isinstance(manifest["step"], int) and all(
            isinstance(e["bytes"], int) and isinstance(e["sha256"], str) and _plain(n)
            for n, e in files.items()
        )
    except FileNotFoundError:
        raise RunError(f"{file}: missing, so {path} is not a complete checkpoint") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise RunError(f"{file}: not a checkpoint manifest ({type(e).__name__})") from None
    if not ok:
        raise RunError(f"{file}: not a checkpoint manifest (malformed entries)")
    if manifest.get("format") != FORMAT:
        raise RunError(
            f"{file}: checkpoint format {manifest.get('format')!r}; this version reads {FORMAT}"
        )
    return manifest


def verify(path: Path, ranks) -> dict:
    """The manifest of the checkpoint ``path`` once every file it lists has its size and
    SHA-256 (each rank checks a share; all agree). Otherwise RunError, on every rank,
    before anything is loaded: naming the manifest if it is missing or malformed, else the
    first missing, truncated or damaged file; and naming ``checkpoint.prev`` as the way back
    if ``path`` is the latest checkpoint and that one is intact."""
    try:
        manifest = read_manifest(path)
    except RunError as e:
        raise RunError(f"{e}{_way_back(path)}") from None
    names = sorted(manifest["files"])
    found = _hash_files(path, names[ranks.rank :: ranks.world_size], sync=False)
    problems = []
    for name in names[ranks.rank :: ranks.world_size]:
        want, got = manifest["files"][name], found.get(name)
        if got is None:
            problems.append(f"{path / name}: missing from the checkpoint")
        elif got["bytes"] != want["bytes"]:
            problems.append(
                f"{path / name}: {got['bytes']} bytes where the checkpoint wrote "
                f"{want['bytes']} (truncated or changed)"
            )
        elif got["sha256"] != want["sha256"]:
            problems.append(f"{path / name}: damaged (its SHA-256 differs from {MANIFEST}'s)")
    problems = [p for part in ranks.gather(problems) for p in part]
    if problems:
        raise RunError(problems[0] + _way_back(path))
    return manifest


def _way_back(path: Path) -> str:
    """What a refusal of the checkpoint ``path`` adds: ``checkpoint.prev`` as the way back
    if ``path`` is the latest checkpoint and ``checkpoint.prev`` is intact (its manifest
    read and every file it lists checked, by this process alone); else nothing."""
    previous = path.with_name(PREVIOUS)
    if path.name != CHECKPOINT or not previous.is_dir():
        return ""
    try:
        files = read_manifest(previous)["files"]
    except RunError:
        return ""
    if _hash_files(previous, sorted(files), sync=False) != files:
        return ""
    return f"; the checkpoint before it is {previous}: remove {path} to use that one"


def _hash_files(directory: Path, names: list[str], sync: bool) -> dict:
    """{name: {"bytes", "sha256"}} of the files ``names`` in ``directory`` that exist, read
    in parallel (hashlib releases the GIL); ``sync``: also flush each to the disk, so that a
    checkpoint renamed into place is on the disk, not only in the page cache."""

    def one(name: str):
        digest, size = hashlib.sha256(), 0
        try:
            with open(directory / name, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    size += len(chunk)
                if sync:
                    os.fsync(f.fileno())
        except FileNotFoundError:
            return name, None
        return name, {"bytes": size, "sha256": digest.hexdigest()}

    with ThreadPoolExecutor(max_workers=min(4, len(names) or 1)) as pool:
        return {name: entry for name, entry in pool.map(one, names) if entry is not None}


def _make_latest(out_dir: Path, new: Path, run: str) -> None:
    """Rename the complete checkpoint ``new`` to ``out_dir/checkpoint``; the one it replaces
    becomes ``checkpoint.prev`` if it belongs to ``run``. Every step leaves a complete
    checkpoint for :func:`latest_checkpoint` to find."""
    latest, previous = out_dir / CHECKPOINT, out_dir / PREVIOUS
    for old in (latest, previous):
        if old.exists() and _run_of(old) != run:  # another run's, from before this one began
            _remove(old)
    if latest.exists():
        _remove(previous)
        os.replace(latest, previous)
    os.replace(new, latest)
    with contextlib.suppress(OSError):  # make the renames durable (not on every filesystem)
        fd = os.open(out_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _run_of(path: Path) -> str | None:
    try:
        return json.loads((path / MANIFEST).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None


def _plain(name: str) -> bool:
    """A file name inside the checkpoint directory (a manifest may not point outside it)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
