"""Leaving DST clean when a pack stops early: after any error, a full disk, SIGINT or SIGTERM.

``cleaned_up_on_failure(dst)`` wraps a pack. Whatever ends it early, the temporaries in DST (shards
being written, HDF5 spools, half-written journal or manifest) are removed, while the finished shards and
the journal stay, so rerunning the same command resumes. SIGTERM is turned into a ``Terminated``
exception for the duration, so it unwinds (and cleans up) like Ctrl-C does. A full disk, which shows as
``ENOSPC``/``EDQUOT``, or as any write error (LMDB reports ``EIO``, HDF5 its own message) while the
file system has almost no space left, becomes one ``PackError`` saying so and naming the file.
"""
from __future__ import annotations

import errno
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from packer.errors import PackError
from packer.run.destination import TEMPORARY_FILE

# A write that fails while less than this is free counts as a full disk: a pack writes a record, an
# LMDB commit (about 1 MiB of records) or a shard's table at a time, far less than this unless one
# record is larger.
NEARLY_FULL_BYTES = 64 << 20


class Terminated(BaseException):
    """The pack received SIGTERM (a ``BaseException``, like ``KeyboardInterrupt``, so that nothing
    mistakes it for a per-file error)."""


@contextmanager
def cleaned_up_on_failure(dst: Path, partitions: Iterable[int] | None = None) -> Iterator[None]:
    """Run a pack into ``dst``; on any exception remove DST's temporaries, and report a full disk.

    ``partitions``: when only these partitions are packed (one task of ``--part``), only their own
    temporaries are removed, since other tasks may be writing theirs in ``dst`` at the same time."""
    with sigterm_raises():
        try:
            yield
        except BaseException as e:
            full = _disk_full(e, dst)
            remove_temporaries(dst, partitions)
            if full is not None:
                raise full from None
            raise


def remove_temporaries(dst: Path, partitions: Iterable[int] | None = None) -> None:
    """Delete the packer's temporary files in ``dst`` (never finished shards, part records or others);
    with ``partitions``, only the temporary shards and part records of those partitions."""
    if not dst.is_dir():
        return
    own = None if partitions is None else set(partitions)
    for entry in os.scandir(dst):
        match = TEMPORARY_FILE.fullmatch(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        partition = match.group("partition") or match.group("record")
        if own is None or (partition is not None and int(partition) in own):
            Path(entry.path).unlink(missing_ok=True)


def _disk_full(error: BaseException, dst: Path) -> PackError | None:
    """The ``PackError`` for a write that failed because the disk is full, else None."""
    if not isinstance(error, OSError):
        return None
    free = _free_bytes(dst)
    if error.errno not in (errno.ENOSPC, errno.EDQUOT) and (free is None or free >= NEARLY_FULL_BYTES):
        return None
    where = error.filename if _inside(error.filename, dst) else dst  # a copy's error names its source
    reason = os.strerror(error.errno) if error.errno in (errno.ENOSPC, errno.EDQUOT) else error.strerror or str(error)
    space = "" if free is None else f", {free} bytes free"
    return PackError(f"{where}: the disk is full ({reason}{space}); temporary files were removed, the finished "
                     "shards kept: free some space and rerun the same command to resume")


def _inside(filename: object, dst: Path) -> bool:
    """Whether an error's ``filename`` is in ``dst`` (the full disk is DST's, not an input's)."""
    if not isinstance(filename, (str, os.PathLike)):
        return False
    return Path(os.path.abspath(filename)).is_relative_to(os.path.abspath(dst))


def _free_bytes(dst: Path) -> int | None:
    try:
        fs = os.statvfs(dst if dst.exists() else dst.parent)
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize


def leave_interrupts_to_the_parent() -> None:
    """In an encoding worker process: ignore SIGINT. Ctrl-C reaches the whole process group; the
    parent unwinds, cleans up and shuts the pool down, so the workers need not print tracebacks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Make SIGTERM raise ``Terminated`` in the main thread while the block runs (elsewhere: no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
