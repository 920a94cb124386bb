"""LMDB shards: one single-file environment, one key per record, the record table under its own key.

Keys are 8-byte big-endian record numbers, so they sort in record order and are written with
``append=True``. Values are the record payloads. The table is stored as ``.npy`` bytes under
``TABLE_KEY``, which sorts after every record key, and records each payload's byte offset in the file
as LMDB's map held it after the last record commit. Why those offsets stay true although the table's
own commit follows (large payloads never move; a copied leaf page is never overwritten): FORMAT.md.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import lmdb
import numpy as np

from reader.format.manifest import FormatError
from reader.format.records import RECORD_TABLE_DTYPE
from reader.format.shards import ShardWriter

TABLE_KEY = b"~table"
_COMMIT_BYTES = 64 << 20
_INITIAL_MAP_SIZE = 1 << 30


def record_key(index: int) -> bytes:
    return index.to_bytes(8, "big")


def open_readonly(path: Path) -> lmdb.Environment:
    """Open a shard for reading: no lock file, works on read-only directories and network shares."""
    return lmdb.open(
        str(path), subdir=False, readonly=True, lock=False, readahead=False, max_readers=1, max_dbs=0
    )


class LmdbShardWriter(ShardWriter):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.tmp_path.unlink(missing_ok=True)
        self._env = lmdb.open(
            str(self.tmp_path), subdir=False, lock=False, sync=False, metasync=False,
            map_size=_INITIAL_MAP_SIZE, max_dbs=0,
        )
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
        map_addr = _mapping_address(self.tmp_path)
        with self._env.begin(buffers=True) as txn:
            for i in range(len(table)):
                view = txn.get(record_key(i))
                offsets[i] = np.frombuffer(view, dtype=np.uint8).ctypes.data - map_addr
            first = bytes(txn.get(record_key(0)))
        with open(self.tmp_path, "rb") as f:
            f.seek(int(offsets[0]))
            if f.read(len(first)) != first:
                raise RuntimeError(f"{self.tmp_path}: could not locate LMDB payloads in the file")
        return offsets

    def _write_table(self, table: np.ndarray) -> None:
        buf = io.BytesIO()
        np.save(buf, table, allow_pickle=False)
        self._pending.append((TABLE_KEY, buf.getvalue()))
        self._commit()
        self._env.sync(True)
        self._close()

    def _close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


def _mapping_address(path: Path) -> int:
    """Where LMDB mapped ``path`` in this process (py-lmdb does not report it; Linux tells)."""
    inode = os.stat(path).st_ino
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and int(fields[4]) == inode and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    raise RuntimeError(f"{path}: LMDB mapping not found in /proc/self/maps")


def read_lmdb_table(path: Path) -> np.ndarray:
    try:
        env = open_readonly(path)
    except lmdb.Error as e:
        raise FormatError(f"{path}: cannot be opened as an LMDB shard ({e})") from None
    try:
        with env.begin() as txn:
            blob = txn.get(TABLE_KEY)
    finally:
        env.close()
    if blob is None:
        raise FormatError(f"{path}: LMDB shard has no record table (key {TABLE_KEY!r})")
    table = np.load(io.BytesIO(blob), allow_pickle=False)
    if table.dtype != RECORD_TABLE_DTYPE:
        raise FormatError(f"{path}: record table has dtype {table.dtype}, expected {RECORD_TABLE_DTYPE}")
    return table
