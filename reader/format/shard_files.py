"""Finding and opening a dataset's shard files as untrusted input: plain names, regular files, right sizes.

A manifest can name any path, and a shared dataset directory can hold anything: a shard ``file`` of
``../other/shard-00001.lmdb``, ``/etc/passwd`` or a symlink to ``/dev/zero``, a FIFO (an ``open`` that
blocks forever), a truncated copy (LMDB maps the file, and touching a page past its end kills the
process with ``SIGBUS``). So before any container library sees a shard:

- its name must be a plain file name inside the dataset directory (no ``/``, no ``..``, not absolute);
- ``lstat`` must show a regular file (not a symlink, FIFO, device or directory);
- its size must be the manifest's ``bytes``.

Shards are then opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked again with ``fstat`` (the name could
have been swapped in between), and the container libraries open ``/proc/self/fd/N``, the very file
checked. ``FileIdentity`` (device, inode, size, mtime) recorded at open lets a reader notice that a
shard was replaced or rewritten under it (a ``pack --force`` into the same directory) instead of
reading new files against old record tables.
"""
from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from reader.format.errors import FormatError
from reader.format.manifest import ShardInfo
from reader.format.manifest_schema import check_plain_name


@dataclass(frozen=True)
class FileIdentity:
    """What identifies one version of a file: a replaced file has another inode, a rewritten one
    (almost always) another size or modification time."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def describe_file_type(mode: int) -> str:
    """``'a symlink'``, ``'a FIFO'``, ... for the type bits of ``mode``."""
    kinds = [(stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket")]
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def check_shard_file(root: Path, shard: ShardInfo) -> FileIdentity:
    """The identity of shard ``shard`` of the dataset at ``root`` once its name, type and size pass.

    Raises ``FormatError`` naming the file: a name that leaves the directory, a missing file, a
    symlink/FIFO/device/directory, or a size other than the manifest's (a truncated or partial copy).
    """
    check_plain_name(shard.file, str(root / "manifest.json"))
    path = root / shard.file
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FormatError(f"{path}: shard file is missing (the manifest lists it)") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot stat the shard file ({e.strerror})") from None
    return check_stat(path, st, shard.bytes)


def check_stat(path: Path, st: os.stat_result, expected_bytes: int) -> FileIdentity:
    """Refuse anything but a regular file of ``expected_bytes`` bytes."""
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{path}: shard is {describe_file_type(st.st_mode)}, not a regular file")
    if st.st_size != expected_bytes:
        how = "truncated" if st.st_size < expected_bytes else "longer than recorded"
        raise FormatError(f"{path}: shard file is {st.st_size} bytes, the manifest says {expected_bytes} "
                          f"({how}: a partial copy, or the file changed)")
    return FileIdentity.of(st)


def open_checked(path: Path, identity: FileIdentity) -> int:
    """A read-only descriptor on ``path``, which must still be the file ``identity`` describes.

    ``O_NOFOLLOW | O_NONBLOCK``: a symlink put in its place fails, a FIFO never blocks the open.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FormatError(f"{path}: shard file is missing (it was there when the dataset was opened)") \
            from None
    except OSError as e:
        raise FormatError(f"{path}: cannot open the shard file ({e.strerror})") from None
    try:
        check_identity(path, fd, identity)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_identity(path: Path, fd: int, identity: FileIdentity) -> None:
    """Raise ``FormatError`` if the open file ``fd`` is not (or no longer) the version ``identity``."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{path}: shard is {describe_file_type(st.st_mode)}, not a regular file")
    if FileIdentity.of(st) != identity:
        raise FormatError(f"{path}: shard file was replaced or changed since the dataset was opened "
                          "(repacked or copied over?); open the dataset again")


def fd_path(fd: int) -> str:
    """A path that opens exactly the file behind ``fd`` (for libraries that take a path)."""
    return f"/proc/self/fd/{fd}"


@contextmanager
def checked_shard(root: Path, shard: ShardInfo) -> Iterator[tuple[int, FileIdentity]]:
    """``(descriptor, identity)`` of a checked shard, open for the duration of the block.

    Container libraries are given ``fd_path(descriptor)``, so LMDB or HDF5 open exactly the regular
    file of the right size that was checked, whatever happens to the name meanwhile.
    """
    identity = check_shard_file(root, shard)
    fd = open_checked(root / shard.file, identity)
    try:
        yield fd, identity
    finally:
        os.close(fd)
