"""The output directory: which files in it are the packer's, and when it may be written to.

A finished dataset (``manifest.json`` present) is never overwritten without ``force``, and neither is
a directory holding files the packer did not write. Leftovers of an interrupted pack (shard files,
their temporaries, the journal) are the packer's own and may be removed.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from packer.errors import PackError
from reader.format import MANIFEST_NAME

JOURNAL_NAME = ".pack-journal.json"
_OWN_FILE = re.compile(
    rf"(shard-\d{{5}}\.(lmdb|h5)(\.tmp|\.spool)?|{re.escape(MANIFEST_NAME)}|{re.escape(JOURNAL_NAME)})(\.tmp)?"
)


def is_own_file(name: str) -> bool:
    """Whether a file name in DST is one the packer writes (a shard, a temporary, the manifest, ...)."""
    return _OWN_FILE.fullmatch(name) is not None


def check_destination(dst: Path, force: bool) -> None:
    """Refuse a DST that holds a finished dataset or someone else's files, unless ``force``."""
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


def remove_own_files(dst: Path, keep: Iterable[str] = ()) -> None:
    """Delete the packer's files in ``dst`` except those named in ``keep``; the manifest goes first."""
    kept = set(keep)
    manifest = dst / MANIFEST_NAME
    if MANIFEST_NAME not in kept:
        manifest.unlink(missing_ok=True)
    for entry in sorted(dst.iterdir()):
        if is_own_file(entry.name) and entry.name not in kept and entry.is_file():
            entry.unlink()
