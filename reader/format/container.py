"""What a shard container is: the base classes every container (LMDB, HDF5, ...) implements.

A ``Container`` owns everything about one kind of shard file: its file suffix, the names of its
temporary files, its ``ShardWriter``, its record-table reader, its reader of the named arrays stored
beside the table (the record columns of ``reader.format.fields``) and its own per-record read (used by
``packer verify --deep`` to check the record table's offsets against the container's API). The
containers are registered in ``reader.format.registry``; nothing else knows their details.

A writer takes records in order and produces a complete shard only in ``finish()``: until then the
data lives under a temporary name, so a crash never leaves a file that looks like a finished shard.
"""
from __future__ import annotations

import abc
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from reader.format.compressed_arrays import MAX_INFLATED_PER_FILE_BYTE, compress_array, compress_table
from reader.format.durable import fsync_directory
from reader.format.errors import FormatError
from reader.format.records import ARRAY_DTYPES, RECORD_TABLE_DTYPE, is_plain_column


class ShardWriter(abc.ABC):
    """Appends records to one shard; ``finish()`` writes the record table and publishes the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        self._rows: list[tuple[int, int, int, int]] = []  # (nbytes, label, height, width)
        self.payload_bytes = 0
        self.table_offset: int | None = None  # where the finished file holds the stored table (``finish``)
        self.table_bytes: int | None = None  # the stored table's length (``finish``)

    @property
    def num_records(self) -> int:
        return len(self._rows)

    def append(self, payload: bytes | memoryview, label: int, height: int, width: int) -> None:
        """Add one record's payload; records keep the order in which they are appended."""
        with self._errors_name_the_file():
            self._write_payload(len(self._rows), payload)
        self._rows.append((len(payload), label, height, width))
        self.payload_bytes += len(payload)

    def finish(self, arrays: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Write the record table (and the named ``arrays``: per-record columns, see
        ``reader.format.fields``), each compressed (``reader.format.compressed_arrays``), fsync, and
        rename the shard to its final name. Returns the table. An array no reader would accept is a
        ``ValueError`` naming the shard (a ``FormatError`` for one larger than readers inflate from
        this shard), before the shard is published (call ``abort()``): a finished shard is always
        readable.

        ``table_offset`` is then where the file holds the stored table, its ``table_bytes`` bytes (the
        manifest's ``table_offset`` and ``table_bytes``, which readers read in one ``pread``), or None
        when the container cannot say; it is checked against the file before the shard is published."""
        for name, array in (arrays or {}).items():
            if not is_plain_column(array.dtype, array.shape):
                raise ValueError(f"{self.path}: array {name} has dtype {array.dtype} and shape {array.shape}; "
                                 f"a shard stores {', '.join(map(str, ARRAY_DTYPES))} arrays of one or two "
                                 "dimensions")
        table = np.zeros(len(self._rows), dtype=RECORD_TABLE_DTYPE)
        rows = np.array(self._rows, dtype=np.int64).reshape(-1, 4)
        table["nbytes"], table["label"], table["height"], table["width"] = rows.T
        with self._errors_name_the_file():
            table["offset"] = self._finish_payloads(table)
            stored = compress_table(table)
            self.table_bytes = len(stored)
            self._write_table(stored, {name: compress_array(array) for name, array in (arrays or {}).items()})
            with open(self.tmp_path, "rb+") as f:
                os.fsync(f.fileno())
                if self.table_offset is not None and os.pread(f.fileno(), len(stored), self.table_offset) != stored:
                    raise RuntimeError(f"{self.tmp_path}: the record table is not at offset {self.table_offset}, "
                                       "where the container put it")
                _check_inflated_sizes({"record table": table, **(arrays or {})}, os.fstat(f.fileno()).st_size,
                                      self.path)
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
    def _write_table(self, table: bytes, arrays: dict[str, bytes]) -> None:
        """Store the table and the named arrays (their bytes, already compressed) inside the shard and
        close the container; set ``table_offset`` where the container can tell where the table's bytes
        lie in the file."""

    @abc.abstractmethod
    def _close(self) -> None: ...


def _check_inflated_sizes(arrays: dict[str, np.ndarray], file_size: int, shown: Path) -> None:
    """``FormatError`` for an array larger than readers inflate from a shard of ``file_size`` bytes
    (``MAX_INFLATED_PER_FILE_BYTE`` times it: a highly compressible column that dwarfs the payloads,
    such as a long vector of zeros per tiny image), so that a finished shard is always readable."""
    for name, array in arrays.items():
        if array.nbytes > MAX_INFLATED_PER_FILE_BYTE * file_size:
            raise FormatError(f"{shown}: {name} takes {array.nbytes} bytes, more than {MAX_INFLATED_PER_FILE_BYTE} "
                             f"times the shard's {file_size}, which readers refuse to inflate; keep such a "
                             "field outside the dataset")


class Container(abc.ABC):
    """One kind of shard file. Subclasses set ``storage`` (the manifest's name for it), ``suffix`` and
    ``temporary_suffixes`` (what the writer appends to a shard's name for its files in progress)."""

    storage: str
    suffix: str
    temporary_suffixes: tuple[str, ...] = (".tmp",)

    @abc.abstractmethod
    def writer(self, path: Path) -> ShardWriter:
        """A writer for a new shard at ``path``."""

    @abc.abstractmethod
    def read_table(
        self, path: str | os.PathLike, shown: Path, records: int | None = None, *, compressed: bool
    ) -> np.ndarray:
        """The record table inside the shard at ``path`` (opened read-only, no lock files), checked for
        the record-table dtype and ``records`` rows; errors are ``FormatError`` naming ``shown``.
        ``compressed``: stored by ``compressed_arrays`` (format version 5 on; ``ShardInfo.compressed``),
        else as plain rows."""

    @abc.abstractmethod
    def read_arrays(
        self, path: str | os.PathLike, file_size: int, shown: Path, rows: Mapping[str, int | None], *,
        compressed: bool,
    ) -> dict[str, np.ndarray]:
        """The named arrays stored beside the record table, named by ``rows`` with the rows each must
        have (None: any; ``fields.column_rows``), ``compressed`` as for ``read_table``. Each is checked
        (a plain dtype from ``records.ARRAY_DTYPES``, inside the file; compressed, its rows too) before
        it is read; a missing one is a ``FormatError``."""

    @abc.abstractmethod
    def read_records(
        self, path: str | os.PathLike, file_size: int, shown: Path, table: np.ndarray
    ) -> Iterator[bytes | None]:
        """Each record's payload as the container's own API returns it (None where it is absent),
        never reading past the file's end nor from other files; ``FormatError`` for a damaged shard."""
