"""One writer at a time on a dataset directory: ``writer_lock(dst)``.

Every command that changes a dataset (``pack`` into DST, ``pack --append``, ``merge DST``, ``join OUT A
B``) holds an exclusive lock on ``DST/.packer-lock`` while it works. A second writer does not wait: it is
refused at once with one line naming the holder (pid, host, command), which the holder writes into the
lock file. Readers never take the lock: they see the old manifest or the new one, never a mix.

The lock is ``flock`` on the lock file, released by the kernel when its holder exits however it dies,
so it is never stale. Where the file system does not support ``flock`` (some NFS mounts answer
``ENOLCK``), the lock is instead the lock file's existence, created with ``O_EXCL`` and removed when the
writer finishes; a writer killed with SIGKILL leaves it behind, and the refusal then says how to tell
(the holder's pid and host) and what to remove. The tasks of one ``pack --part`` job share DST by design
and take no lock; ``merge DST`` does.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from packer.errors import PackError
from packer.run.destination import check_destination, create_destination
from reader.format.fields import printable

LOCK_NAME = ".packer-lock"
EXCLUSIVE_NAME = ".packer-lock.excl"  # the fallback's lock where flock is not supported
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_HOLDER_BYTES = 4096


@contextmanager
def writer_lock(dst: Path) -> Iterator[None]:
    """Hold ``dst``'s writer lock while the block runs (``dst`` must exist); raise ``PackError`` naming
    the holder when another writer has it. The lock file is removed on release, so a dataset holds none
    while nobody writes it."""
    fd = _locked_file(dst / LOCK_NAME)
    if fd is None:
        with exclusive_file_lock(dst):
            yield
        return
    try:
        os.pwrite(fd, _holder().encode("utf-8", "backslashreplace"), 0)
        yield
    finally:
        (dst / LOCK_NAME).unlink(missing_ok=True)  # still holding the lock: nobody can take it meanwhile
        os.close(fd)


def _locked_file(path: Path) -> int | None:
    """An open descriptor of ``path`` holding its ``flock``, or None where the file system has no
    ``flock``. The file locked must still be the one at ``path``: a holder removes it on release, and a
    lock taken on the removed file would lock nothing."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise PackError(_refusal(path.parent, holder)) from None
        except OSError as e:
            os.close(fd)
            if e.errno in _NO_FLOCK:
                path.unlink(missing_ok=True)
                return None
            raise
        opened = os.fstat(fd)
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
            return fd
        os.close(fd)  # locked a file its holder removed on release: take the new one


@contextmanager
def exclusive_file_lock(dst: Path) -> Iterator[None]:
    """The lock as a file created with ``O_EXCL`` (for file systems without ``flock``), removed when the
    block ends; an existing one refuses, naming its holder."""
    path = dst / EXCLUSIVE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        try:
            with open(path, "rb") as f:
                holder = f.read(_HOLDER_BYTES).decode("utf-8", "replace")
        except OSError:
            holder = ""
        raise PackError(_refusal(dst, holder) + f"; if that process is gone (killed), remove {path}") from None
    try:
        os.write(fd, _holder().encode("utf-8", "backslashreplace"))
        os.close(fd)
        yield
    finally:
        path.unlink(missing_ok=True)


def _holder() -> str:
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    command = " ".join(["packer" if program == "__main__.py" else program, *sys.argv[1:]])
    return f"pid {os.getpid()} on {socket.gethostname()}, command: {command}"


def _read_holder(fd: int) -> str:
    return os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8", "replace")


def _refusal(dst: Path, holder: str) -> str:
    who = printable(holder.strip()) or "a process that has not yet written its name"
    return f"{dst}: another packer is writing this dataset ({who}); wait for it to finish, then rerun"


@contextmanager
def claimed_destination(dst: Path, force: bool) -> Iterator[None]:
    """Create ``dst``, hold its writer lock while the block runs, and check it again under the lock: a
    writer that finished a dataset there between the caller's first check and the lock is not undone."""
    create_destination(dst)
    with writer_lock(dst):
        check_destination(dst, force)
        yield
