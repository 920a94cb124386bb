"""A dataset shard's record table, read through its container after the file itself is checked."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from reader.format import registry
from reader.format.errors import FormatError
from reader.format.fields import SOURCE, Column, FieldSpec, column_names, printable, read_record_columns
from reader.format.manifest import ShardInfo, file_checksum
from reader.format.records import table_problems
from reader.format.shard_files import FileIdentity, checked_shard, fd_path


def load_shard_table(
    root: Path, storage: str, shard: ShardInfo, num_classes: int | None, encoding: str, shape: list[int] | None,
    checksum: bool = False,
) -> tuple[FileIdentity, np.ndarray]:
    """A dataset shard's identity and record table, after every check that is cheap at open time.

    The file is checked before any container library sees it (``check_shard_file``: plain name,
    regular file, manifest size), its table is read through the checked descriptor, and its rows must
    pass ``table_problems`` (labels index a class, payloads inside the file, sizes consistent with the
    encoding and shape). With ``checksum``, the whole file must also have the manifest's checksum
    (this reads the whole shard once). Raises ``FormatError`` naming the shard and, for a bad row, the
    record (and its source path, where the shard stores one: ``record_source``).
    """
    path = root / shard.file
    with checked_shard(root, shard) as (fd, identity):
        if checksum and file_checksum(fd_path(fd)) != shard.checksum:
            raise FormatError(f"{path}: checksum mismatch (the file is corrupt or changed)")
        table = registry.container(storage).read_table(fd_path(fd), path, shard.records)
    problems = table_problems(table, num_classes, registry.encoding(encoding), shape, identity.size)
    if problems:
        what, rows = min(problems, key=lambda problem: problem[1][0])
        source = record_source(root, storage, shard, int(rows[0]))
        raise FormatError(f"{path}: record {rows[0]}{f' ({source})' if source is not None else ''}: {what}")
    return identity, table


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
        arrays = registry.container(storage).read_arrays(fd_path(fd), identity.size, path, column_names(fields))
    return read_record_columns(fields, arrays, shard.records, path)
