"""LMDB values read with ``pread``, by walking the B-tree pages in the file: never through a memory map.

LMDB reads a file through its own map, and touching a page of a map past the file's end raises
``SIGBUS``, which kills the process: a shard truncated after its meta pages were checked (``cp`` or
``rsync --inplace`` over a dataset while it is read) does exactly that inside LMDB's page walk. A record
table (or record column) is read when a shard is first needed in a process, mid-epoch, so the reader
looks its few values up here instead: ``pread`` of a page past the end returns short, which is a
``FormatError`` naming the shard. Only what a shard needs is read (the main database of a plain,
single-database environment: no sub-databases, no duplicate keys, no 32-bit or big-endian layouts);
anything else is refused as damaged. Each page and value is checked to lie below the meta page's last
page (``check_lmdb_meta`` checked that against the file size) before it is read, and a walk takes at
most one page per level of the tree, so a hostile file can neither loop nor make it read past the file.
``packer verify --deep`` checks that these reads give exactly what LMDB's own API gives.

Layout (liblmdb 0.9, 64-bit little-endian): every page starts with a 16-byte header (page number,
padding, flags, then the lower and upper bounds of its free space, or an overflow run's page count); a
branch or leaf page's header is followed by an array of 16-bit node offsets, one per key, in key order.
A node is ``lo, hi, flags, key size`` (four uint16), then the key, then (leaf) the value or, for a value
on overflow pages (``flags & 1``), the first overflow page's number; a leaf value's size is
``lo | hi << 16``, a branch node's child page ``lo | hi << 16 | flags << 32``.
"""
from __future__ import annotations

import bisect
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from reader.format.errors import FormatError

# Where LMDB's two meta pages keep what ``check_lmdb_meta`` reads: after the page header, MDB_meta holds
# magic, version, address, map size, two 48-byte MDB_db records (free pages, then the main database:
# md_pad is the page size, md_depth the tree's levels, md_root its root page), the last page number and
# the transaction id.
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_DATA_VERSION = 1
_MAGIC_AT = 16
_PAGE_SIZE_AT = 40
_MAIN_DEPTH_AT = 94
_MAIN_ROOT_AT = 128
_LAST_PAGE_AT = 136
_TXNID_AT = 144
_META_END = 152
_NO_PAGE = (1 << 64) - 1  # md_root of an empty database
# LMDB's page size is the OS page size where it was written: 4 KiB on x86-64 and most ARM machines. The
# first read takes that much more than meta page 0, so that meta page 1 comes with it: on a disk that
# allows 200 reads a second, a read less per shard is 5 ms less before a cold epoch's first batch.
_USUAL_PAGE_SIZE = 4096
_PAGE_HEADER = 16
_NODE_HEADER = 8
_BRANCH, _LEAF, _OVERFLOW = 0x01, 0x02, 0x04
_LEAF_KINDS = 0x20 | 0x40  # page flags of leaves without nodes (fixed-size duplicates) or inside a node
_BIG_DATA = 0x01  # node flag: the value is on overflow pages
_PLAIN_NODE = 0x01  # the only node flag a plain database's leaf has (no sub-database, no duplicates)
# Levels a walk descends at most: a tree of 8-byte keys in 4 KiB pages is under 6 levels for any file.
_MAX_DEPTH = 32


@dataclass(frozen=True)
class LmdbMeta:
    """What LMDB's current meta page (the one with the higher transaction id) says of the main database."""

    page_size: int
    root: int
    depth: int
    last_page: int


def check_lmdb_meta(path: str | os.PathLike, file_size: int, shown: Path) -> LmdbMeta:
    """Refuse an LMDB file whose meta pages promise more pages than the file holds (or are not LMDB).

    LMDB maps the file and trusts its meta page: a truncated file, or one whose meta names a last
    page past the end, makes the first touch of a missing page a ``SIGBUS`` that kills the process.
    LMDB itself only looks pages up below the last page of the meta it picks (the one with the
    higher transaction id), so checking both metas against the file size keeps every page access
    inside the file (as long as the file does not shrink). ``path`` is opened without following links
    or blocking (it may be ``/proc/self/fd/N`` of a checked file). Returns the meta LMDB picks.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        head = os.pread(fd, _USUAL_PAGE_SIZE + _META_END, 0)  # both metas in one disk read, usually
        first = head[:_META_END]
        page_size = struct.unpack_from("<I", first, _PAGE_SIZE_AT)[0] if len(first) == _META_END else 0
        second = head[page_size:page_size + _META_END] if page_size else b""
        if page_size and len(second) < _META_END:
            second = os.pread(fd, _META_END, page_size)
    finally:
        os.close(fd)
    for number, page in enumerate((first, second)):
        if len(page) < _META_END:
            raise FormatError(f"{shown}: not an LMDB shard (too short for its meta pages)")
        magic, version = struct.unpack_from("<II", page, _MAGIC_AT)
        if magic != _LMDB_MAGIC or version != _LMDB_DATA_VERSION:
            raise FormatError(f"{shown}: not an LMDB shard (meta page {number} is damaged)")
        last_page = struct.unpack_from("<Q", page, _LAST_PAGE_AT)[0]
        if page_size < 512 or page_size & (page_size - 1) or (last_page + 1) * page_size > file_size:
            raise FormatError(
                f"{shown}: LMDB meta page {number} describes {last_page + 1} pages of {page_size} bytes "
                f"but the file has {file_size} bytes (truncated or damaged)"
            )
    txnids = [struct.unpack_from("<Q", page, _TXNID_AT)[0] for page in (first, second)]
    current = second if txnids[0] < txnids[1] else first  # LMDB's mdb_env_pick_meta
    return LmdbMeta(page_size, struct.unpack_from("<Q", current, _MAIN_ROOT_AT)[0],
                    struct.unpack_from("<H", current, _MAIN_DEPTH_AT)[0],
                    struct.unpack_from("<Q", current, _LAST_PAGE_AT)[0])


class PagedValues:
    """Values of one LMDB file looked up by key with ``pread`` (the module docstring)."""

    def __init__(self, fd: int, meta: LmdbMeta, shown: Path) -> None:
        self._fd = fd
        self._meta = meta
        self._shown = shown

    def get(self, key: bytes, what: str) -> bytes | None:
        """The value under ``key``, or None when it is absent; ``FormatError`` naming the shard and
        ``what`` for a damaged tree or a file that ends before a page or value it needs."""
        number = self._meta.root
        if number == _NO_PAGE:
            return None
        for _ in range(min(self._meta.depth, _MAX_DEPTH)):
            page = self._read(number, self._meta.page_size, what)
            flags = struct.unpack_from("<H", page, 10)[0]
            keys, nodes = self._nodes(page, number, what)
            if flags & _LEAF and not flags & _LEAF_KINDS:
                found = bisect.bisect_left(keys, key)
                if found == len(keys) or keys[found] != key:
                    return None
                return self._value(page, nodes[found], len(key), number, what)
            if not flags & _BRANCH:
                raise self._damaged(what, f"page {number} is neither a branch nor a leaf")
            lo, hi, high = struct.unpack_from("<HHH", page, nodes[max(bisect.bisect_right(keys, key, 1) - 1, 0)])
            number = lo | hi << 16 | high << 32
        raise self._damaged(what, f"no leaf within the tree's {self._meta.depth} levels")

    def _read(self, number: int, length: int, what: str) -> bytes:
        """``length`` bytes from the start of page ``number``, which must lie below the last page."""
        end = number * self._meta.page_size + length
        if number > self._meta.last_page or end > (self._meta.last_page + 1) * self._meta.page_size:
            raise self._damaged(what, f"{length} bytes at page {number} lie past the last page, "
                                      f"{self._meta.last_page}")
        data = os.pread(self._fd, length, number * self._meta.page_size)
        if len(data) != length:
            raise FormatError(f"{self._shown}: {what}: the file ends before byte {end} (it shrank after it "
                              "was checked: rewritten in place while it was read?)")
        if struct.unpack_from("<Q", data)[0] != number:
            raise self._damaged(what, f"page {number} is numbered {struct.unpack_from('<Q', data)[0]}")
        return data

    def _nodes(self, page: bytes, number: int, what: str) -> tuple[list[bytes], list[int]]:
        """A branch or leaf page's keys and node offsets, each node and key checked to lie in the page."""
        lower, upper = struct.unpack_from("<HH", page, 12)
        if not _PAGE_HEADER < lower <= upper <= len(page) or lower % 2:
            raise self._damaged(what, f"page {number} has free space {lower}-{upper}")
        nodes = list(struct.unpack_from(f"<{(lower - _PAGE_HEADER) // 2}H", page, _PAGE_HEADER))
        keys = []
        for at in nodes:
            size = struct.unpack_from("<H", page, at + 6)[0] if upper <= at <= len(page) - _NODE_HEADER else None
            if size is None or at + _NODE_HEADER + size > len(page):
                raise self._damaged(what, f"page {number} has a node outside it")
            keys.append(page[at + _NODE_HEADER:at + _NODE_HEADER + size])
        return keys, nodes

    def _value(self, page: bytes, at: int, key_size: int, number: int, what: str) -> bytes:
        """The value of the leaf node at ``at``: inside the leaf page, or on the overflow pages it names."""
        lo, hi, flags = struct.unpack_from("<HHH", page, at)
        size, start = lo | hi << 16, at + _NODE_HEADER + key_size
        if flags & ~_PLAIN_NODE:
            raise self._damaged(what, f"page {number} holds a sub-database or duplicate keys")
        if not flags & _BIG_DATA:
            if start + size > len(page):
                raise self._damaged(what, f"a {size}-byte value overruns page {number}")
            return page[start:start + size]
        if start + 8 > len(page):
            raise self._damaged(what, f"page {number} has a node outside it")
        first = struct.unpack_from("<Q", page, start)[0]
        run = self._read(first, _PAGE_HEADER + size, what)
        if not struct.unpack_from("<H", run, 10)[0] & _OVERFLOW:
            raise self._damaged(what, f"page {first} is not an overflow page")
        return run[_PAGE_HEADER:]

    def _damaged(self, what: str, why: str) -> FormatError:
        return FormatError(f"{self._shown}: {what}: {why} (the LMDB shard is damaged)")


@contextmanager
def paged_values(path: str | os.PathLike, file_size: int, shown: Path) -> Iterator[PagedValues]:
    """Values of the LMDB shard at ``path`` (named ``shown`` in errors) read with ``pread``, after its
    meta pages are checked against ``file_size``."""
    meta = check_lmdb_meta(path, file_size, shown)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        yield PagedValues(fd, meta, shown)
    finally:
        os.close(fd)
