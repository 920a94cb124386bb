"""A third container, written only to show that adding one is this module plus one registry line.

``test_new_container.py`` copies it into a copy of ``reader/format`` and adds it to ``registry.py``.
Layout of a ``.flat`` shard: every payload back to back from byte 0, then an ``.npz`` archive holding
the stored bytes (``reader.format.compressed_arrays``) of ``table`` and of the named arrays
(``array.NAME``), then the archive's length as 8 little-endian bytes. A new container has no shards from
before format version 5, so it reads compressed tables and arrays only.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from reader.format.compressed_arrays import decompress_column, decompress_table
from reader.format.container import Container, ShardWriter
from reader.format.errors import FormatError


class FlatShardWriter(ShardWriter):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._file = open(self.tmp_path, "wb")

    def _write_payload(self, index: int, payload: bytes | memoryview) -> None:
        self._file.write(payload)

    def _finish_payloads(self, table: np.ndarray) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(table["nbytes"][:-1])]).astype(np.uint64)

    def _write_table(self, table: bytes, arrays: dict[str, bytes]) -> None:
        buf = io.BytesIO()
        stored = {f"array.{name}": _byte_array(array) for name, array in arrays.items()}
        np.savez(buf, table=_byte_array(table), **stored)
        self._file.write(buf.getvalue() + len(buf.getvalue()).to_bytes(8, "little"))
        self._close()

    def _close(self) -> None:
        self._file.close()


def _byte_array(stored: bytes) -> np.ndarray:
    return np.frombuffer(stored, dtype=np.uint8)


def _archive(path: str | os.PathLike, shown: Path, compressed: bool) -> np.lib.npyio.NpzFile:
    if not compressed:
        raise FormatError(f"{shown}: flat shards store their tables compressed (format version 5 on)")
    with open(path, "rb") as f:
        f.seek(-8, os.SEEK_END)
        length = int.from_bytes(f.read(8), "little")
        f.seek(-8 - length, os.SEEK_END)
        try:
            return np.load(io.BytesIO(f.read(length)), allow_pickle=False)
        except ValueError as e:
            raise FormatError(f"{shown}: damaged flat shard ({e})") from None


class FlatContainer(Container):
    storage = "flat"
    suffix = ".flat"

    def writer(self, path: Path) -> ShardWriter:
        return FlatShardWriter(path)

    def read_table(
        self, path: str | os.PathLike, shown: Path, records: int | None = None, *, compressed: bool
    ) -> np.ndarray:
        stored = _archive(path, shown, compressed)["table"].tobytes()
        return decompress_table(stored, shown, records, os.stat(path).st_size)

    def read_arrays(
        self, path: str | os.PathLike, file_size: int, shown: Path, rows: Mapping[str, int | None], *,
        compressed: bool,
    ) -> dict[str, np.ndarray]:
        archive = _archive(path, shown, compressed)
        arrays = {}
        for name, count in rows.items():
            if f"array.{name}" not in archive.files:
                raise FormatError(f"{shown}: flat shard has no array {name!r}")
            stored = archive[f"array.{name}"].tobytes()
            arrays[name] = decompress_column(stored, shown, f"array {name}", file_size, count)
        return arrays

    def read_records(
        self, path: str | os.PathLike, file_size: int, shown: Path, table: np.ndarray
    ) -> Iterator[bytes | None]:
        with open(path, "rb") as f:
            for offset, nbytes in zip(table["offset"].tolist(), table["nbytes"].tolist()):
                yield os.pread(f.fileno(), nbytes, offset)
