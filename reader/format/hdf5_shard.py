"""HDF5 shards: every payload back to back in one contiguous uint8 dataset, plus the record table.

``/records`` is a flat, uncompressed, contiguous ``uint8`` dataset (a run of records is one byte range
of the file); ``/table`` and each ``/arrays/NAME`` a contiguous ``uint8`` dataset holding the stored
bytes of the record table and of the named array (``reader.format.compressed_arrays``; before format
version 5, ``/table`` was a compound dataset with ``RECORD_TABLE_DTYPE`` and each array a dataset of
its own dtype). No timestamps are stored, so the same records give the same bytes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Mapping

import h5py
import numpy as np

from reader.format.compressed_arrays import decompress_column, decompress_table
from reader.format.container import Container, ShardWriter
from reader.format.errors import FormatError
from reader.format.records import RECORD_TABLE_DTYPE, check_array_layout, check_table_layout

RECORDS_DATASET = "records"
TABLE_DATASET = "table"
ARRAYS_GROUP = "arrays"
_COPY_CHUNK = 64 << 20
# What h5py raises for a damaged file, depending on where HDF5 notices (an object header, a dataspace,
# a B-tree...): each becomes one FormatError naming the shard.
HDF5_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError)


def open_readonly(path: Path) -> h5py.File:
    """Open a shard for reading without HDF5 file locking (which fails on many network shares)."""
    return h5py.File(path, "r", locking=False)


class Hdf5ShardWriter(ShardWriter):
    """Payloads go to a plain spool file first: a contiguous HDF5 dataset needs its size up front."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._spool_path = self.path.with_name(self.path.name + ".spool")
        self._spool = open(self._spool_path, "wb")

    def _write_payload(self, index: int, payload: bytes | memoryview) -> None:
        self._spool.write(payload)

    def _finish_payloads(self, table: np.ndarray) -> np.ndarray:
        self._spool.close()
        total = int(table["nbytes"].sum())
        self.tmp_path.unlink(missing_ok=True)
        self._file = h5py.File(self.tmp_path, "w", libver="earliest", track_order=False, locking=False)
        records = self._file.create_dataset(
            RECORDS_DATASET, shape=(total,), dtype=np.uint8, track_times=False
        )
        with open(self._spool_path, "rb") as spool:
            start = 0
            while chunk := spool.read(_COPY_CHUNK):
                records[start : start + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
                start += len(chunk)
        self._spool_path.unlink()
        within = np.concatenate([[0], np.cumsum(table["nbytes"][:-1], dtype=np.uint64)])
        return records.id.get_offset() + within.astype(np.uint64)

    def _write_table(self, table: bytes, arrays: dict[str, bytes]) -> None:
        for name, array in sorted(arrays.items()):
            self._file.create_dataset(f"{ARRAYS_GROUP}/{name}", data=_byte_array(array), track_times=False)
        stored = self._file.create_dataset(TABLE_DATASET, data=_byte_array(table), track_times=False)
        self.table_offset = stored.id.get_offset()  # None unless stored contiguously (h5py's default)
        self._close()

    def _close(self) -> None:
        if not self._spool.closed:
            self._spool.close()
        self._spool_path.unlink(missing_ok=True)
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None


def internal_dataset(f: h5py.File, name: str, shown: object) -> h5py.Dataset:
    """The dataset ``/name`` of an open shard, refused unless it lives wholly inside this file.

    An HDF5 file can make ``/name`` an external or soft link, keep a dataset's bytes in other files
    (external raw storage) or assemble it from other files (a virtual dataset): a shared dataset
    would then read whatever files its author chose. Only a hard-linked dataset stored in the file
    itself is accepted, and only contiguous (as the writer stores every dataset): a chunked one may
    be compressed, and HDF5 inflates a whole chunk (up to 4 GiB) to read any byte of it.
    """
    link = f.get(name, getlink=True)
    if link is None:
        raise FormatError(f"{shown}: HDF5 shard has no /{name} dataset")
    if not isinstance(link, h5py.HardLink):
        raise FormatError(f"{shown}: /{name} is {type(link).__name__.lower()}, not a dataset stored in "
                          "this file; links to other files are refused")
    dataset = f[name]
    if not isinstance(dataset, h5py.Dataset):
        raise FormatError(f"{shown}: /{name} is not a dataset")
    if dataset.is_virtual:
        raise FormatError(f"{shown}: /{name} is a virtual dataset (built from other files); refused")
    if dataset.external:
        raise FormatError(f"{shown}: /{name} keeps its data in external files; refused")
    if dataset.chunks is not None:
        raise FormatError(f"{shown}: /{name} is stored in chunks, not contiguously as a shard's datasets are; "
                          "refused (a compressed chunk is inflated whole to read any byte of it)")
    return dataset


def _byte_array(stored: bytes) -> np.ndarray:
    return np.frombuffer(stored, dtype=np.uint8)


def _stored_bytes(dataset: h5py.Dataset, file_size: int, shown: object, what: str) -> bytes:
    """The bytes a version-5 ``uint8`` dataset stores, refused unless it is one dimension of
    ``uint8`` that the file can hold (a contiguous dataset whose storage was never written may claim
    any size, and reads as fill values)."""
    if dataset.dtype != np.uint8 or len(dataset.shape) != 1:
        raise FormatError(f"{shown}: {what} is a dataset of dtype {dataset.dtype} and shape {dataset.shape}, "
                          "not the stored bytes of a compressed array")
    if dataset.shape[0] > file_size:
        raise FormatError(f"{shown}: {what} claims {dataset.shape[0]} bytes, more than the file holds; refused")
    return dataset[()].tobytes()


def read_hdf5_table(path: str | os.PathLike, shown: Path, records: int | None, compressed: bool) -> np.ndarray:
    """The record table of the HDF5 shard at ``path`` (named ``shown`` in errors), checked for links
    and external storage, its dtype, ``records`` rows and a size the file can hold (an HDF5-compressed
    dataset claiming a billion rows would otherwise be inflated into memory) before it is read;
    ``compressed``: stored by ``compressed_arrays`` (a ``uint8`` dataset of its bytes), else rows."""
    try:
        with open_readonly(Path(path)) as f:
            table = internal_dataset(f, TABLE_DATASET, shown)
            file_size = os.stat(path).st_size
            if compressed:
                stored = _stored_bytes(table, file_size, shown, "record table")
                return decompress_table(stored, shown, records, file_size)
            check_table_layout(table.dtype, table.shape, shown, records)
            if table.shape[0] * RECORD_TABLE_DTYPE.itemsize > file_size:
                raise FormatError(f"{shown}: record table claims {table.shape[0]} rows, more than the file "
                                  "can hold uncompressed; refused")
            return table[()]
    except HDF5_ERRORS as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"{shown}: cannot be read as an HDF5 shard ({e})") from None


class Hdf5Container(Container):
    storage = "hdf5"
    suffix = ".h5"
    temporary_suffixes = (".tmp", ".spool")

    def writer(self, path: Path) -> ShardWriter:
        return Hdf5ShardWriter(path)

    def read_table(
        self, path: str | os.PathLike, shown: Path, records: int | None = None, *, compressed: bool
    ) -> np.ndarray:
        return read_hdf5_table(path, shown, records, compressed)

    def read_arrays(
        self, path: str | os.PathLike, file_size: int, shown: Path, rows: Mapping[str, int | None], *,
        compressed: bool,
    ) -> dict[str, np.ndarray]:
        arrays = {}
        try:
            with open_readonly(Path(path)) as f:
                if rows and not isinstance(f.get(ARRAYS_GROUP, getlink=True), h5py.HardLink):
                    raise FormatError(f"{shown}: HDF5 shard has no /{ARRAYS_GROUP} group stored in this file")
                for name, count in rows.items():
                    dataset = internal_dataset(f, f"{ARRAYS_GROUP}/{name}", shown)
                    if compressed:
                        stored = _stored_bytes(dataset, file_size, shown, f"array {name}")
                        arrays[name] = decompress_column(stored, shown, f"array {name}", file_size, count)
                    else:
                        check_array_layout(dataset.dtype, dataset.shape, shown, f"array {name}")
                        if dataset.size * dataset.dtype.itemsize > file_size:
                            raise FormatError(f"{shown}: array {name} claims more bytes than the file holds; "
                                              "refused")
                        arrays[name] = dataset[()]
        except HDF5_ERRORS as e:
            if isinstance(e, FormatError):
                raise
            raise FormatError(f"{shown}: cannot be read as an HDF5 shard ({e})") from None
        return arrays

    def read_records(
        self, path: str | os.PathLike, file_size: int, shown: Path, table: np.ndarray
    ) -> Iterator[bytes | None]:
        """Slices of ``/records`` (refused unless stored in this file: ``internal_dataset``)."""
        try:
            with open_readonly(Path(path)) as f:
                records = internal_dataset(f, RECORDS_DATASET, shown)
                if records.ndim != 1:
                    raise FormatError(f"{shown}: /{RECORDS_DATASET} has shape {records.shape}, not one dimension")
                start = 0
                for nbytes in table["nbytes"].tolist():
                    yield records[start : start + nbytes].tobytes() if start + nbytes <= records.shape[0] else None
                    start += nbytes
        except HDF5_ERRORS as e:
            if isinstance(e, FormatError):
                raise
            raise FormatError(f"{shown}: the HDF5 shard is damaged ({e})") from None
