"""The output directory: which files in it are the packer's, and when it may be written to.

A finished dataset (``manifest.json`` present) is never overwritten without ``force``, and neither is
a directory holding files the packer did not write. A destination that cannot be written (a read-only
file system, no permission) is refused before any work, not found out by the first shard. Leftovers
of an interrupted pack (shard files, their temporaries, the plan and partition records) are the
packer's own and may be removed.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable

from packer.errors import PackError
from reader.format import MANIFEST_NAME, containers, shard_file_name

PLAN_NAME = ".pack-plan.json"
# A shard file or one of its container's temporaries, by the suffixes the registered containers declare.
_SHARD_FILE = "|".join(
    rf"{re.escape(c.suffix)}(?:{'|'.join(re.escape(t) for t in c.temporary_suffixes)})?" for c in containers()
)
_SHARD = rf"(part-\d{{5,}}-)?shard-\d{{5,}}(?:{_SHARD_FILE})"  # shard-00000: datasets before partitions
_OWN_FILE = re.compile(
    rf"({_SHARD}|\.part-\d{{5,}}\.json|{re.escape(MANIFEST_NAME)}|{re.escape(PLAN_NAME)}(\.[\w.-]+-\d+)?"
    r"|\.pack-journal\.json)(\.tmp)?"  # the journal: before partitions
    r"|\.packer-lock(\.excl)?"  # the writer lock (packer.run.locking), never removed while a writer holds it
)
_LOCK_FILE = re.compile(r"\.packer-lock(\.excl)?")
# What a pack has in progress: a shard's temporaries (by its container's declared suffixes), a manifest,
# part record, plan or journal being written. ``partition``/``record`` name the partition it belongs to.
_SHARD_TEMPORARY = "|".join(
    rf"{re.escape(c.suffix)}(?:{'|'.join(re.escape(t) for t in c.temporary_suffixes)})" for c in containers()
)
TEMPORARY_FILE = re.compile(
    rf"(part-(?P<partition>\d{{5,}})-)?shard-\d{{5,}}(?:{_SHARD_TEMPORARY})|{re.escape(MANIFEST_NAME)}\.tmp"
    r"|\.part-(?P<record>\d{5,})\.json\.tmp|\.pack-(journal|plan)\.json\.tmp"
)

_PARTITION_FILE = re.compile(rf"part-(\d{{5,}})-shard-\d{{5,}}(?:{_SHARD_FILE})|\.part-(\d{{5,}})\.json(?:\.tmp)?")


def partition_shard_name(partition: int, shard: int, storage: str) -> str:
    """The file name of shard ``shard`` of partition ``partition``: names sort in dataset order."""
    return f"part-{partition:05d}-{shard_file_name(shard, storage)}"


def part_record_name(partition: int) -> str:
    """The file that marks partition ``partition`` as finished (see ``packer.run.journal``)."""
    return f".part-{partition:05d}.json"


def is_own_file(name: str) -> bool:
    """Whether a file name in DST is one the packer writes (a shard, a temporary, the manifest, ...)."""
    return _OWN_FILE.fullmatch(name) is not None


def check_destination(dst: Path, force: bool) -> None:
    """Refuse a DST that cannot be written, or that holds a finished dataset or someone else's files
    (unless ``force``)."""
    problem = unwritable(dst)
    if problem:
        raise PackError(f"{dst}: cannot write the dataset here: {problem}")
    if not dst.exists():
        return
    if not dst.is_dir():
        raise PackError(f"{dst}: destination exists and is not a directory")
    if force:
        return
    if (dst / MANIFEST_NAME).exists():
        raise PackError(f"{dst}: already holds a finished packed dataset; pass --force to overwrite it")
    foreign = sorted(entry.name for entry in dst.iterdir() if not is_own_file(entry.name))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise PackError(
            f"{dst}: destination holds files the packer did not write ({shown}); "
            "choose an empty or new directory, or pass --force to pack into it anyway"
        )


def create_destination(dst: Path) -> None:
    """Make the ``dst`` directory (and its parents) if it is not there; one ``PackError`` line if that
    fails, e.g. under ``/proc``, which ``access`` calls writable for root."""
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PackError(f"{dst}: cannot create the dataset directory: {e.strerror or e}") from None


def unwritable(dst: Path) -> str | None:
    """Why ``dst`` (or, when it does not exist yet, the nearest existing path it would be made in) cannot
    be written (a file where a folder is needed, no permission, a read-only file system), or None.
    ``access`` answers as the kernel would for this user: root may write into a read-only folder, nobody
    into a read-only file system."""
    where = dst
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        return f"{where} is not a directory"
    if os.access(where, os.W_OK | os.X_OK):
        return None
    if os.statvfs(where).f_flag & os.ST_RDONLY:
        return f"{where} is on a read-only file system"
    return f"no permission to write in {where}"


def partition_files(dst: Path, partitions: Iterable[int]) -> set[str]:
    """The names of the files in ``dst`` that belong to ``partitions``: shards, temporaries, part records."""
    wanted = set(partitions)
    names = set()
    for entry in dst.iterdir():
        match = _PARTITION_FILE.fullmatch(entry.name)
        if match and int(match.group(1) or match.group(2)) in wanted:
            names.add(entry.name)
    return names


def remove_files(dst: Path, names: Iterable[str]) -> None:
    """Delete the named files from ``dst`` where they exist."""
    for name in names:
        (dst / name).unlink(missing_ok=True)


def remove_own_files(dst: Path, keep: Iterable[str] = ()) -> None:
    """Delete the packer's files in ``dst`` except those named in ``keep``; the manifest goes first."""
    kept = set(keep)
    manifest = dst / MANIFEST_NAME
    if MANIFEST_NAME not in kept:
        manifest.unlink(missing_ok=True)
    for entry in os.scandir(dst):  # the directory's own entry types: no stat per file
        if is_own_file(entry.name) and entry.name not in kept and entry.is_file() \
                and not _LOCK_FILE.fullmatch(entry.name):
            os.unlink(entry.path)
