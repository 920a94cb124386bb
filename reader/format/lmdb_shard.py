"""LMDB shards: one single-file environment, records in chunks, the record table under its own key.

Keys are 8-byte big-endian record numbers, so they sort in record order and are written with
``append=True``. Each value is a *chunk*: the payloads of the records from its key's number up to the
next key's, back to back (format version 3 writes chunks of about ``_COMMIT_BYTES``; versions 1 and 2
wrote one record per value, the same rule with chunks of one record). A chunk is one run of LMDB
overflow pages, so the page rounding LMDB does to every value over ~2 KB is paid once per MiB instead
of once per record. The table is stored under ``TABLE_KEY``, which sorts after every record key
(compressed, ``reader.format.compressed_arrays``; ``.npy`` bytes before format version 5), and records
each payload's byte offset in the file as LMDB's map held it after the last record commit. Why those
offsets stay true although the table's own commit follows (large values never move; a copied leaf page
is never overwritten): FORMAT.md.
"""
from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

import lmdb
import numpy as np

from reader.format.compressed_arrays import decompress_column, decompress_table
from reader.format.container import Container, ShardWriter
from reader.format.errors import FormatError
from reader.format.lmdb_pages import check_lmdb_meta, paged_values
from reader.format.records import parse_npy_array, parse_npy_table

TABLE_KEY = b"~table"
ARRAY_KEY_PREFIX = b"~array/"
# Records are committed in transactions of about this many payload bytes, each transaction one chunk
# value (so a chunk wastes at most one page to LMDB's rounding: 0.2-0.4%). Small enough that LMDB's dirty
# pages stay in the CPU cache between the copy in and the write out (and are reused, warm, by the next
# transaction): measured packing 150 KB raw records, 64 MiB transactions cost 0.19-0.29 ms of CPU a
# record, 1 MiB ones 0.06 (the whole pack 1.60 -> 1.45 ms an image); 256 KiB was no better.
_COMMIT_BYTES = 1 << 20
_INITIAL_MAP_SIZE = 1 << 30


def record_key(index: int) -> bytes:
    return index.to_bytes(8, "big")


def array_key(name: str) -> bytes:
    """The key of a named array: after every record key, before ``TABLE_KEY``."""
    return ARRAY_KEY_PREFIX + name.encode()


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
        self._chunk: list[bytes] = []  # payloads of the chunk being filled, records _chunk_first...
        self._chunk_first = 0
        self._chunk_bytes = 0
        self._chunk_starts: list[int] = []  # the first record of every committed chunk

    def _write_payload(self, index: int, payload: bytes | memoryview) -> None:
        if not self._chunk:
            self._chunk_first = index
        self._chunk.append(bytes(payload))
        self._chunk_bytes += len(payload)
        if self._chunk_bytes >= _COMMIT_BYTES:
            self._commit_chunk()

    def _commit_chunk(self) -> None:
        """Write the records filled so far as one chunk value, in one transaction."""
        if self._chunk:
            self._put([(record_key(self._chunk_first), b"".join(self._chunk))])
            self._chunk_starts.append(self._chunk_first)
        self._chunk.clear()
        self._chunk_bytes = 0

    def _put(self, items: list[tuple[bytes, bytes]]) -> None:
        """Write ``items`` (keys in order, after every key written) in one transaction, growing the map
        when it is full."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    cursor = txn.cursor()
                    for key, value in items:
                        cursor.put(key, value, append=True)
                return
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)

    def _finish_payloads(self, table: np.ndarray) -> np.ndarray:
        """Each record's file offset: its chunk's place in LMDB's map plus the payloads before it."""
        self._commit_chunk()
        nbytes = table["nbytes"].astype(np.int64)
        within = np.cumsum(nbytes) - nbytes  # offset inside the chunk, once each chunk's start is taken off
        starts = np.array(self._chunk_starts, dtype=np.int64)
        chunk_of = np.searchsorted(starts, np.arange(len(table)), "right") - 1
        chunk_offset = np.empty(len(starts), dtype=np.int64)
        mappings = FileMappings(self.tmp_path)
        with self._env.begin(buffers=True) as txn:
            for k, first in enumerate(starts.tolist()):
                view = txn.get(record_key(first))
                if view is None:
                    raise RuntimeError(f"{self.tmp_path}: chunk {first} was committed but LMDB does not find it")
                offset = mappings.file_offset(view)
                if offset is None:
                    raise RuntimeError(f"{self.tmp_path}: LMDB's map of chunk {first} not found in /proc/self/maps")
                chunk_offset[k] = offset - within[first]
            first_chunk = txn.get(record_key(0)) if len(table) else None
            first_bytes = bytes(first_chunk[: int(nbytes[0])]) if first_chunk is not None else b""
        offsets = (chunk_offset[chunk_of] + within).astype(np.uint64) if len(table) else np.zeros(0, np.uint64)
        with open(self.tmp_path, "rb") as f:
            f.seek(int(offsets[0]) if len(table) else 0)
            if f.read(len(first_bytes)) != first_bytes:
                raise RuntimeError(f"{self.tmp_path}: could not locate LMDB payloads in the file")
        return offsets

    def _write_table(self, table: bytes, arrays: dict[str, bytes]) -> None:
        self._put(sorted((array_key(name), array) for name, array in arrays.items()) + [(TABLE_KEY, table)])
        self._env.sync(True)
        with self._env.begin(buffers=True) as txn:
            view = txn.get(TABLE_KEY)
            self.table_offset = None if view is None else FileMappings(self.tmp_path).file_offset(view)
        self._close()

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

    def file_offset(self, view: memoryview) -> int | None:
        """The file offset of the bytes ``view`` shows (a zero-copy LMDB value), or None if no single
        mapping of the file holds them all."""
        address, length = np.frombuffer(view, dtype=np.uint8).ctypes.data, len(view)
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


def bounded_value(view: memoryview, mappings: FileMappings, file_size: int, shown: Path, what: str) -> bytes:
    """Copy an LMDB value (a zero-copy view into the map) only when it lies inside the file.

    A damaged node can claim a value longer than the file, or on pages past its end: copying it would
    touch pages past the end (``SIGBUS``). ``mappings`` says where the file is mapped.
    """
    start = mappings.file_offset(view) if len(view) else 0
    if start is None or start + len(view) > file_size:
        where = "outside LMDB's map" if start is None else f"at offset {start}"
        raise FormatError(f"{shown}: {what} lies outside the file ({len(view)} bytes {where}); "
                          "the LMDB shard is damaged")
    return bytes(view)


class _CheckedValues:
    """Reads from one read transaction of a checked shard: values copied only from inside the file
    (``bounded_value``), LMDB errors as ``FormatError`` naming the shard (``_checked_values``)."""

    def __init__(self, txn: lmdb.Transaction, mappings: FileMappings, file_size: int, shown: Path) -> None:
        self._txn = txn
        self._cursor = txn.cursor()
        self._mappings = mappings
        self._file_size = file_size
        self._shown = shown

    def get(self, key: bytes, what: str) -> bytes | None:
        """The value under ``key``, or None when it is absent."""
        view = self._txn.get(key)
        if view is None:
            return None
        return bounded_value(memoryview(view), self._mappings, self._file_size, self._shown, what)

    def record_key_from(self, index: int) -> int | None:
        """The first record key at or after record ``index`` (as a number), or None."""
        if not self._cursor.set_range(record_key(index)):
            return None
        key = bytes(self._cursor.key())
        return int.from_bytes(key, "big") if len(key) == 8 and key < ARRAY_KEY_PREFIX else None

    def keys_from(self, first: bytes) -> list[bytes]:
        """Every key at or after ``first``, in order."""
        return [bytes(key) for key in self._cursor.iternext(values=False)] if self._cursor.set_range(first) else []


@contextmanager
def _checked_values(path: str | os.PathLike, file_size: int, shown: Path) -> Iterator[_CheckedValues]:
    """A read transaction on the shard at ``path``, after its meta pages are checked against the file.
    LMDB errors become ``FormatError`` naming ``shown``."""
    check_lmdb_meta(path, file_size, shown)
    try:
        env = open_readonly(Path(path))
    except lmdb.Error as e:
        raise FormatError(f"{shown}: cannot be opened as an LMDB shard ({e})") from None
    try:
        with env.begin(buffers=True) as txn:
            yield _CheckedValues(txn, FileMappings(path), file_size, shown)
    except lmdb.Error as e:
        raise FormatError(f"{shown}: the LMDB shard is damaged ({e})") from None
    finally:
        env.close()


def read_lmdb_table(path: str | os.PathLike, shown: Path, records: int | None, compressed: bool) -> np.ndarray:
    """The record table of the LMDB shard at ``path`` (named ``shown`` in errors), checked before
    anything is allocated: meta pages inside the file, the value inside the file, a header of the
    record-table dtype and ``records`` rows. Read with ``pread`` (``reader.format.lmdb_pages``), never
    through a map, so a shard truncated under the reader is a ``FormatError``, not ``SIGBUS``."""
    file_size = os.stat(path).st_size
    with paged_values(path, file_size, shown) as values:
        blob = values.get(TABLE_KEY, "record table")
    if blob is None:
        raise FormatError(f"{shown}: LMDB shard has no record table (key {TABLE_KEY!r})")
    if compressed:
        return decompress_table(blob, shown, records, file_size)
    return parse_npy_table(blob, shown, records)


class LmdbContainer(Container):
    storage = "lmdb"
    suffix = ".lmdb"

    def writer(self, path: Path) -> ShardWriter:
        return LmdbShardWriter(path)

    def read_table(
        self, path: str | os.PathLike, shown: Path, records: int | None = None, *, compressed: bool
    ) -> np.ndarray:
        return read_lmdb_table(path, shown, records, compressed)

    def read_arrays(
        self, path: str | os.PathLike, file_size: int, shown: Path, rows: Mapping[str, int | None], *,
        compressed: bool,
    ) -> dict[str, np.ndarray]:
        arrays = {}
        with paged_values(path, file_size, shown) as values:
            for name, count in rows.items():
                blob = values.get(array_key(name), f"array {name}")
                if blob is None:
                    raise FormatError(f"{shown}: LMDB shard has no array {name!r}")
                arrays[name] = (decompress_column(blob, shown, f"array {name}", file_size, count) if compressed
                                else parse_npy_array(blob, shown, f"array {name}"))
        return arrays

    def read_records(
        self, path: str | os.PathLike, file_size: int, shown: Path, table: np.ndarray
    ) -> Iterator[bytes | None]:
        """Every record as LMDB's API gives it: the chunk under each record key (a cursor walk, values
        copied only from inside the file), cut in the table's ``nbytes``. Chunk ``k`` holds records
        ``k`` up to the next record key, so a one-record-per-value shard (format versions 1-2) reads
        the same way; a record no key covers is None, and a chunk whose length is not its records'
        sum gives pieces that differ from the bytes at the table's offsets.

        First, the table and every array (each key from ``ARRAY_KEY_PREFIX`` on) as LMDB's API gives
        them must be the bytes the readers' page walk (``reader.format.lmdb_pages``) finds under the
        same key: a ``FormatError`` naming the value where they differ."""
        nbytes = table["nbytes"].tolist()
        with _checked_values(path, file_size, shown) as values, paged_values(path, file_size, shown) as paged:
            for key in values.keys_from(ARRAY_KEY_PREFIX):
                what = "record table" if key == TABLE_KEY else f"value {key!r}"
                if values.get(key, what) != paged.get(key, what):
                    raise FormatError(f"{shown}: {what}: LMDB's lookup and the readers' page walk (pread) give "
                                      "different bytes (the LMDB shard is damaged)")
            index = 0
            while index < len(nbytes):
                first = values.record_key_from(index)
                first = len(nbytes) if first is None else min(first, len(nbytes))
                yield from [None] * (first - index)
                if first == len(nbytes):
                    return
                end = values.record_key_from(first + 1)
                end = len(nbytes) if end is None else min(end, len(nbytes))
                chunk = values.get(record_key(first), f"records {first}-{end - 1}") or b""
                position = 0
                for size in nbytes[first:end]:
                    yield chunk[position:position + size]
                    position += size
                index = end
