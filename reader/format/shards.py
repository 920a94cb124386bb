"""Shard files: one writer class per storage behind a small base class, and the record-table reader.

A writer takes records in order and produces a complete shard only in ``finish()``: until then the
data lives under a temporary name, so a crash never leaves a file that looks like a finished shard.
"""
from __future__ import annotations

import abc
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from reader.format.manifest import FormatError, ShardInfo, file_checksum, fsync_directory
from reader.format.records import RECORD_TABLE_DTYPE, STORAGES, table_problems
from reader.format.shard_files import FileIdentity, checked_shard, fd_path


class ShardWriter(abc.ABC):
    """Appends records to one shard; ``finish()`` writes the record table and publishes the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        self._rows: list[tuple[int, int, int, int]] = []  # (nbytes, label, height, width)
        self.payload_bytes = 0

    @property
    def num_records(self) -> int:
        return len(self._rows)

    def append(self, payload: bytes | memoryview, label: int, height: int, width: int) -> None:
        """Add one record's payload; records keep the order in which they are appended."""
        with self._errors_name_the_file():
            self._write_payload(len(self._rows), payload)
        self._rows.append((len(payload), label, height, width))
        self.payload_bytes += len(payload)

    def finish(self) -> np.ndarray:
        """Write the record table, fsync, and rename the shard to its final name. Returns the table."""
        table = np.zeros(len(self._rows), dtype=RECORD_TABLE_DTYPE)
        rows = np.array(self._rows, dtype=np.int64).reshape(-1, 4)
        table["nbytes"], table["label"], table["height"], table["width"] = rows.T
        with self._errors_name_the_file():
            table["offset"] = self._finish_payloads(table)
            self._write_table(table)
            with open(self.tmp_path, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(self.tmp_path, self.path)
        fsync_directory(self.path.parent)
        return table

    @contextmanager
    def _errors_name_the_file(self) -> Iterator[None]:
        """Write errors as ``OSError`` naming the shard's temporary file (a container library's own
        error, such as LMDB's ``EIO`` on a full disk, converted by ``_as_os_error``)."""
        try:
            yield
        except OSError as e:
            if e.filename is not None:
                raise
            raise OSError(e.errno, e.strerror or str(e), str(self.tmp_path)) from e
        except Exception as e:
            converted = self._as_os_error(e)
            if converted is None:
                raise
            raise converted from e

    def _as_os_error(self, error: Exception) -> OSError | None:
        """The container library's write error as an ``OSError`` naming the file, or None."""
        return None

    def abort(self) -> None:
        """Drop everything written so far."""
        self._close()
        self.tmp_path.unlink(missing_ok=True)

    @abc.abstractmethod
    def _write_payload(self, index: int, payload: bytes | memoryview) -> None: ...

    @abc.abstractmethod
    def _finish_payloads(self, table: np.ndarray) -> np.ndarray:
        """Flush all payloads; return each record's byte offset in the shard file."""

    @abc.abstractmethod
    def _write_table(self, table: np.ndarray) -> None:
        """Store the table inside the shard and close the container."""

    @abc.abstractmethod
    def _close(self) -> None: ...


def open_shard_writer(storage: str, path: Path) -> ShardWriter:
    """A writer for a new shard at ``path`` in the given storage (``"lmdb"`` or ``"hdf5"``)."""
    from reader.format.hdf5_shard import Hdf5ShardWriter
    from reader.format.lmdb_shard import LmdbShardWriter

    writers = {"lmdb": LmdbShardWriter, "hdf5": Hdf5ShardWriter}
    if storage not in writers:
        raise ValueError(f"unknown storage {storage!r}: expected one of {', '.join(STORAGES)}")
    return writers[storage](path)


def read_record_table(
    storage: str, path: str | os.PathLike, records: int | None = None, shown: os.PathLike | None = None
) -> np.ndarray:
    """The record table stored inside the shard at ``path`` (opened read-only, no lock files).

    ``records`` (the manifest's count) is checked before the table is read; errors name ``shown``
    (default ``path``). For a shard of a dataset, ``load_shard_table`` first checks the file itself.
    """
    from reader.format.hdf5_shard import read_hdf5_table
    from reader.format.lmdb_shard import read_lmdb_table

    readers = {"lmdb": read_lmdb_table, "hdf5": read_hdf5_table}
    return readers[storage](path, Path(shown or path), records)


def load_shard_table(
    root: Path, storage: str, shard: ShardInfo, num_classes: int, encoding: str, shape: list[int] | None,
    checksum: bool = False,
) -> tuple[FileIdentity, np.ndarray]:
    """A dataset shard's identity and record table, after every check that is cheap at open time.

    The file is checked before any container library sees it (``check_shard_file``: plain name,
    regular file, manifest size), its table is read through the checked descriptor, and its rows must
    pass ``table_problems`` (labels index a class, payloads inside the file, sizes consistent with the
    encoding and shape). With ``checksum``, the whole file must also have the manifest's checksum
    (this reads the whole shard once). Raises ``FormatError`` naming the shard and, for a bad row, the
    record.
    """
    path = root / shard.file
    with checked_shard(root, shard) as (fd, identity):
        if checksum and file_checksum(fd_path(fd)) != shard.checksum:
            raise FormatError(f"{path}: checksum mismatch (the file is corrupt or changed)")
        table = read_record_table(storage, fd_path(fd), shard.records, shown=path)
    problems = table_problems(table, num_classes, encoding, shape, identity.size)
    if problems:
        what, rows = min(problems, key=lambda problem: problem[1][0])
        raise FormatError(f"{path}: record {rows[0]}: {what}")
    return identity, table
