"""A dataset shard's record table, read after the file itself is checked: at the manifest's
``table_offset`` in one ``pread`` (format version 4 on), else through its container; and its columns."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from reader.format import registry
from reader.format.compressed_arrays import decompress_table
from reader.format.errors import FormatError
from reader.format.fields import SOURCE, Column, FieldSpec, column_rows, printable, read_record_columns
from reader.format.manifest import ShardInfo, file_checksum
from reader.format.records import RECORD_TABLE_DTYPE, table_problems
from reader.format.shard_files import FileIdentity, checked_shard, fd_path


def load_shard_table(
    root: Path, storage: str, shard: ShardInfo, num_classes: int | None, encoding: str, shape: list[int] | None,
    checksum: bool = False, opened: FileIdentity | None = None,
) -> np.ndarray:
    """A dataset shard's record table, after every check that is cheap at open time.

    The file is checked before any container library sees it (``check_shard_file``: plain name,
    regular file, manifest size), its table is read through the checked descriptor, and its rows must
    pass ``table_problems`` (labels index a class, payloads inside the file, sizes consistent with the
    encoding and shape). With ``checksum``, the whole file must also have the manifest's checksum
    (this reads the whole shard once). With ``opened`` (the file's identity when the dataset was
    opened), a shard replaced since is refused before its table is read: read at the old manifest's
    ``table_offset``, the new file's bytes would only show as bad rows. Raises ``FormatError`` naming
    the shard and, for a bad row, the record (and its source path, where the shard stores one:
    ``record_source``).

    Why ``table_offset``: looking a table up in its container takes dependent reads (LMDB: the meta
    pages, the B-tree's root, the value; HDF5 likewise), three per shard. On a disk that serves 200
    reads a second that was 0.1 s for 7 shards before a cold epoch's first batch; the rows at a known
    offset are one read.
    """
    path = root / shard.file
    with checked_shard(root, shard) as (fd, identity):
        if opened is not None and identity != opened:
            raise FormatError(f"{path}: shard file was replaced or changed since the dataset was opened "
                              "(repacked or copied over?); open the dataset again")
        if checksum and file_checksum(fd_path(fd)) != shard.checksum:
            raise FormatError(f"{path}: checksum mismatch (the file is corrupt or changed)")
        if shard.table_offset is None:
            table = registry.container(storage).read_table(fd_path(fd), path, shard.records,
                                                           compressed=shard.compressed)
        else:
            table = table_at_offset(fd, shard, identity.size, path)
    problems = table_problems(table, num_classes, registry.encoding(encoding), shape, identity.size)
    if problems:
        what, rows = min(problems, key=lambda problem: problem[1][0])
        source = record_source(root, storage, shard, int(rows[0]))
        raise FormatError(f"{path}: record {rows[0]}{f' ({source})' if source is not None else ''}: {what}")
    return table


def table_at_offset(fd: int, shard: ShardInfo, file_size: int, shown: Path) -> np.ndarray:
    """The record table stored at ``shard.table_offset`` of the open shard file ``fd`` of ``file_size``
    bytes (compressed, or plain rows before format version 5); ``FormatError`` naming ``shown``. The
    manifest's checks put it inside the file (``manifest_schema``), which has the manifest's size."""
    offset, nbytes = shard.table_offset, shard.stored_table_nbytes
    assert offset is not None
    stored = os.pread(fd, nbytes, offset)
    if len(stored) != nbytes:
        raise FormatError(f"{shown}: the file ends inside its record table (it shrank after it was checked: "
                          "rewritten in place while it was read?)")
    if shard.compressed:
        return decompress_table(stored, shown, shard.records, file_size)
    return np.frombuffer(stored, dtype=RECORD_TABLE_DTYPE)


def record_source(root: Path, storage: str, shard: ShardInfo, record: int) -> str | None:
    """The source path of record ``record`` of a shard, for an error message about it: None when the
    shard stores none (format version 1) or its source column cannot be read."""
    try:
        return printable(load_shard_columns(root, storage, shard, [])[SOURCE].value(record))
    except FormatError:
        return None


def load_shard_columns(
    root: Path, storage: str, shard: ShardInfo, fields: Sequence[FieldSpec]
) -> dict[str, Column]:
    """A version-2 shard's source column (``fields.SOURCE``) and field columns, read through the
    checked file like its table, each checked against the shard's record count."""
    path = root / shard.file
    with checked_shard(root, shard) as (fd, identity):
        rows = column_rows(fields, shard.records)
        arrays = registry.container(storage).read_arrays(fd_path(fd), identity.size, path, rows,
                                                         compressed=shard.compressed)
    return read_record_columns(fields, arrays, shard.records, path)
