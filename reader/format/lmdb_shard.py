"""LMDB shards: one single-file environment, one key per record, the record table under its own key.

Keys are 8-byte big-endian record numbers, so they sort in record order and are written with
``append=True``. Values are the record payloads. The table is stored as ``.npy`` bytes under
``TABLE_KEY``, which sorts after every record key, and records each payload's byte offset in the file
as LMDB's map held it after the last record commit. Why those offsets stay true although the table's
own commit follows (large payloads never move; a copied leaf page is never overwritten): FORMAT.md.
"""
from __future__ import annotations

import errno
import io
import os
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import lmdb
import numpy as np

from reader.format.container import Container, ShardWriter
from reader.format.errors import FormatError
from reader.format.records import parse_npy_array, parse_npy_table

TABLE_KEY = b"~table"
ARRAY_KEY_PREFIX = b"~array/"
# Records are committed in transactions of about this many payload bytes. Small enough that LMDB's dirty
# pages stay in the CPU cache between the copy in and the write out (and are reused, warm, by the next
# transaction): measured packing 150 KB raw records, 64 MiB transactions cost 0.19-0.29 ms of CPU a
# record, 1 MiB ones 0.06 (the whole pack 1.60 -> 1.45 ms an image); 256 KiB was no better.
_COMMIT_BYTES = 1 << 20
_INITIAL_MAP_SIZE = 1 << 30
# Where LMDB's two meta pages keep what ``check_lmdb_meta`` reads (liblmdb 0.9, 64-bit): each page is a
# 16-byte page header, then MDB_meta: magic, version, address, map size, two 48-byte MDB_db records
# (the first one's md_pad is the page size), the last page number and the transaction id.
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_DATA_VERSION = 1
_MAGIC_AT = 16
_PAGE_SIZE_AT = 40
_LAST_PAGE_AT = 136
_META_END = 152


def record_key(index: int) -> bytes:
    return index.to_bytes(8, "big")


def array_key(name: str) -> bytes:
    """The key of a named array: after every record key, before ``TABLE_KEY``."""
    return ARRAY_KEY_PREFIX + name.encode()


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def open_readonly(path: Path) -> lmdb.Environment:
    """Open a shard for reading: no lock file, works on read-only directories and network shares."""
    return lmdb.open(
        str(path), subdir=False, readonly=True, lock=False, readahead=False, max_readers=1, max_dbs=0
    )


class LmdbShardWriter(ShardWriter):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.tmp_path.unlink(missing_ok=True)
        try:
            self._env = lmdb.open(
                str(self.tmp_path), subdir=False, lock=False, sync=False, metasync=False,
                map_size=_INITIAL_MAP_SIZE, max_dbs=0,
            )
        except lmdb.Error as e:  # a full disk can already fail the open
            raise self._write_error(e) from None
        self._closed = False
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0

    def _write_payload(self, index: int, payload: bytes | memoryview) -> None:
        self._pending.append((record_key(index), bytes(payload)))
        self._pending_bytes += len(payload)
        if self._pending_bytes >= _COMMIT_BYTES:
            self._commit()

    def _commit(self) -> None:
        """Write the pending records in one transaction, growing the map when it is full."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    cursor = txn.cursor()
                    for key, value in self._pending:
                        cursor.put(key, value, append=True)
                break
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
        self._pending.clear()
        self._pending_bytes = 0

    def _finish_payloads(self, table: np.ndarray) -> np.ndarray:
        self._commit()
        offsets = np.empty(len(table), dtype=np.uint64)
        mappings = FileMappings(self.tmp_path)
        with self._env.begin(buffers=True) as txn:
            for i in range(len(table)):
                view = self._written(txn, i)
                offset = mappings.file_offset(np.frombuffer(view, dtype=np.uint8).ctypes.data, len(view))
                if offset is None:
                    raise RuntimeError(f"{self.tmp_path}: LMDB's map of record {i} not found in /proc/self/maps")
                offsets[i] = offset
            first = bytes(self._written(txn, 0))
        with open(self.tmp_path, "rb") as f:
            f.seek(int(offsets[0]))
            if f.read(len(first)) != first:
                raise RuntimeError(f"{self.tmp_path}: could not locate LMDB payloads in the file")
        return offsets

    def _write_table(self, table: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        for name, array in sorted(arrays.items()):
            self._pending.append((array_key(name), _npy_bytes(array)))
        self._pending.append((TABLE_KEY, _npy_bytes(table)))
        self._commit()
        self._env.sync(True)
        self._close()

    def _written(self, txn: lmdb.Transaction, index: int) -> bytes | memoryview:
        """Record ``index`` as LMDB's map holds it, just after it was committed."""
        view = txn.get(record_key(index))
        if view is None:
            raise RuntimeError(f"{self.tmp_path}: record {index} was committed but LMDB does not find it")
        return view

    def _as_os_error(self, error: Exception) -> OSError | None:
        return self._write_error(error) if isinstance(error, lmdb.Error) else None

    def _write_error(self, error: lmdb.Error) -> OSError:
        return OSError(errno.EIO, f"LMDB write failed ({error})", str(self.tmp_path))

    def _close(self) -> None:
        if not self._closed:
            self._env.close()
            self._closed = True


class FileMappings:
    """Where this process maps one file, read from ``/proc/self/maps`` (py-lmdb does not report where
    LMDB mapped a file; Linux does).

    The same file can be mapped several times (LMDB's map, the reader's own mapping of a shard it
    read, a hard link of it in a merged dataset), so an address is resolved by the mapping that
    *contains* it, never by the first mapping of the file. The maps are read when an address is not in
    a mapping found before, and only up to the mapping that holds it (the kernel writes the file as it
    is read: each line costs). A read-only LMDB environment never moves its map.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        st = os.stat(path)
        self._key = f" {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino} "
        self._found: list[tuple[int, int, int]] = []  # (start, end, file offset of start)

    def file_offset(self, address: int, length: int) -> int | None:
        """The file offset of the ``length`` bytes at ``address``, or None if no single mapping of
        the file holds them all."""
        mapping = next((m for m in self._found if m[0] <= address < m[1]), None) or self._find(address)
        if mapping is None or address + length > mapping[1]:
            return None
        return address - mapping[0] + mapping[2]

    def _find(self, address: int) -> tuple[int, int, int] | None:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if self._key in line:
                    span, _, offset = line.split(maxsplit=3)[:3]
                    start, end = (int(a, 16) for a in span.split("-"))
                    if start <= address < end:
                        self._found.append((start, end, int(offset, 16)))
                        return self._found[-1]
        return None


def check_lmdb_meta(path: str | os.PathLike, file_size: int, shown: Path) -> None:
    """Refuse an LMDB file whose meta pages promise more pages than the file holds (or are not LMDB).

    LMDB maps the file and trusts its meta page: a truncated file, or one whose meta names a last
    page past the end, makes the first touch of a missing page a ``SIGBUS`` that kills the process.
    LMDB itself only looks pages up below the last page of the meta it picks (the one with the
    higher transaction id), so checking both metas against the file size keeps every page access
    inside the file. ``path`` is opened without following links or blocking (it may be
    ``/proc/self/fd/N`` of a checked file).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        first = os.pread(fd, _META_END, 0)
        page_size = struct.unpack_from("<I", first, _PAGE_SIZE_AT)[0] if len(first) == _META_END else 0
        second = os.pread(fd, _META_END, page_size) if page_size else b""
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


def bounded_value(view: memoryview, mappings: FileMappings, file_size: int, shown: Path, what: str) -> bytes:
    """Copy an LMDB value (a zero-copy view into the map) only when it lies inside the file.

    A damaged node can claim a value longer than the file, or on pages past its end: copying it would
    touch pages past the end (``SIGBUS``). ``mappings`` says where the file is mapped.
    """
    start = mappings.file_offset(np.frombuffer(view, dtype=np.uint8).ctypes.data, len(view)) if len(view) else 0
    if start is None or start + len(view) > file_size:
        where = "outside LMDB's map" if start is None else f"at offset {start}"
        raise FormatError(f"{shown}: {what} lies outside the file ({len(view)} bytes {where}); "
                          "the LMDB shard is damaged")
    return bytes(view)


@contextmanager
def _checked_values(
    path: str | os.PathLike, file_size: int, shown: Path
) -> Iterator[Callable[[bytes, str], bytes | None]]:
    """A read transaction on the shard at ``path``, after its meta pages are checked against the file,
    as a function from a key to its value (copied only from inside the file: ``bounded_value``; None
    when absent). LMDB errors become ``FormatError`` naming ``shown``."""
    check_lmdb_meta(path, file_size, shown)
    try:
        env = open_readonly(Path(path))
    except lmdb.Error as e:
        raise FormatError(f"{shown}: cannot be opened as an LMDB shard ({e})") from None
    try:
        mappings = FileMappings(path)
        with env.begin(buffers=True) as txn:
            def value(key: bytes, what: str) -> bytes | None:
                view = txn.get(key)
                return None if view is None else bounded_value(view, mappings, file_size, shown, what)

            yield value
    except lmdb.Error as e:
        raise FormatError(f"{shown}: the LMDB shard is damaged ({e})") from None
    finally:
        env.close()


def read_lmdb_table(path: str | os.PathLike, shown: Path, records: int | None = None) -> np.ndarray:
    """The record table of the LMDB shard at ``path`` (named ``shown`` in errors), checked before
    anything is mapped or allocated: meta pages inside the file, the value inside the file, an
    ``.npy`` header of the record-table dtype and ``records`` rows."""
    with _checked_values(path, os.stat(path).st_size, shown) as value:
        blob = value(TABLE_KEY, "record table")
    if blob is None:
        raise FormatError(f"{shown}: LMDB shard has no record table (key {TABLE_KEY!r})")
    return parse_npy_table(blob, shown, records)


class LmdbContainer(Container):
    storage = "lmdb"
    suffix = ".lmdb"

    def writer(self, path: Path) -> ShardWriter:
        return LmdbShardWriter(path)

    def read_table(self, path: str | os.PathLike, shown: Path, records: int | None = None) -> np.ndarray:
        return read_lmdb_table(path, shown, records)

    def read_arrays(
        self, path: str | os.PathLike, file_size: int, shown: Path, names: list[str]
    ) -> dict[str, np.ndarray]:
        arrays = {}
        with _checked_values(path, file_size, shown) as value:
            for name in names:
                blob = value(array_key(name), f"array {name}")
                if blob is None:
                    raise FormatError(f"{shown}: LMDB shard has no array {name!r}")
                arrays[name] = parse_npy_array(blob, shown, f"array {name}")
        return arrays

    def read_records(
        self, path: str | os.PathLike, file_size: int, shown: Path, table: np.ndarray
    ) -> Iterator[bytes | None]:
        """``txn.get`` of every record key, copied only from inside the file (``bounded_value``)."""
        with _checked_values(path, file_size, shown) as value:
            for index in range(len(table)):
                yield value(record_key(index), f"record {index}")
