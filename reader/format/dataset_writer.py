"""``DatasetWriter``: records into consecutive, size-bounded shards of a dataset directory, then its manifest.

The one way a dataset is written: the packer (one writer per partition), the tests and the benchmark
scripts all use it. A shard closes when the next record would take its payload bytes past
``shard_size``; a record is never split, so a shard always holds at least one record (a record larger
than ``shard_size`` gets a shard of its own). Container overhead (LMDB page rounding, the record table)
comes on top of the payload bytes. The manifest is written last (``finish``), so a crash never leaves
a directory that looks like a finished dataset.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from reader.format.container import Container, ShardWriter
from reader.format.fields import FieldSpec, record_columns
from reader.format.manifest import Manifest, ShardInfo, file_checksum
from reader.format.registry import container, shard_file_name

ShardName = Callable[[int], str]


class DatasetWriter:
    """Appends records to shard 0, 1, ... of ``root`` and lists the finished ones.

    Shards are named ``shard_name(number)`` (default ``shard-NNNNN`` with the container's suffix; the
    packer names each partition's own). Publishing a full shard (record table, fsync, rename,
    checksum) runs on a background thread while the next shard fills, so encoding is not left idle
    during the disk flush; at most one shard is being published at a time. ``shards`` lists the
    published shards, in order. ``finish_shards()`` publishes the last shard (a part of a dataset,
    whose manifest is written by whoever joins the parts); ``finish(...)`` also writes the manifest.
    """

    def __init__(
        self, root: str | os.PathLike, storage: str, shard_size: int, shard_name: ShardName | None = None,
        fields: Sequence[FieldSpec] = (),
    ) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be positive, got {shard_size}")
        self._dst = Path(root)
        self._dst.mkdir(parents=True, exist_ok=True)
        self._storage = storage
        self._container: Container = container(storage)
        self._shard_size = shard_size
        self._shard_name = shard_name or (lambda number: shard_file_name(number, storage))
        self.fields = list(fields)
        self._sources: list[str] = []
        self._values: dict[str, list[Any]] = {field.name: [] for field in self.fields}
        self.shards: list[ShardInfo] = []
        self._writer: ShardWriter | None = None
        self._name = ""
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="shard-publisher")
        self._publishing: Future[ShardInfo] | None = None

    def add(
        self, payload: bytes | memoryview, label: int, height: int, width: int, *, source: str,
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        """Append one record, first closing the shard if the record would overflow it. ``source`` is
        where the record came from (a path relative to the source root, or a name the caller gives);
        ``fields`` holds a value for every field of the schema, already ``FieldSpec.parse``d."""
        values = fields or {}
        if set(values) != set(self._values):
            missing = sorted(set(self._values) - set(values)) or sorted(set(values) - set(self._values))
            raise ValueError(f"record {source!r}: fields {', '.join(missing)} do not match the schema "
                             f"({', '.join(self._values) or 'no fields'})")
        writer = self._writer
        if writer is not None and writer.payload_bytes + len(payload) > self._shard_size:
            self._close_shard()
            writer = None
        if writer is None:
            self._name = self._shard_name(len(self.shards) + (self._publishing is not None))
            writer = self._writer = self._container.writer(self._dst / self._name)
        writer.append(payload, label, height, width)
        self._sources.append(source)
        for name, value in values.items():
            self._values[name].append(value)

    def finish_shards(self) -> list[ShardInfo]:
        """Publish the last shard (if any), wait until every shard is published, and list them."""
        self._close_shard()
        self._collect_published()
        self._publisher.shutdown()
        return self.shards

    def finish(
        self, *, encoding: str, classes: list[str], shape: list[int] | None, transform: dict[str, Any],
        source: dict[str, Any], tool_version: str, jpeg_quality: int | None = None, labelled: bool = True,
    ) -> Manifest:
        """Publish every shard, then write the manifest that makes the directory a finished dataset."""
        manifest = Manifest(storage=self._storage, encoding=encoding, shape=shape, classes=classes,
                            shards=self.finish_shards(), transform=transform, source=source,
                            tool_version=tool_version, jpeg_quality=jpeg_quality, fields=self.fields,
                            labelled=labelled)
        manifest.write(self._dst)
        return manifest

    def abort(self) -> None:
        """Drop the shard being written; let one being published finish (its partition is redone)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        if self._publishing is not None:
            self._publishing.exception()
            self._publishing = None
        self._publisher.shutdown()

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        self._collect_published()  # may raise: the writer stays ours, for abort() to drop
        writer, self._writer = self._writer, None
        arrays = record_columns(self.fields, self._sources, self._values)
        self._sources = []
        self._values = {name: [] for name in self._values}
        self._publishing = self._publisher.submit(_publish, writer, self._dst / self._name, arrays)

    def _collect_published(self) -> None:
        """Wait for the shard being published (re-raising its error) and add it to ``shards``."""
        if self._publishing is None:
            return
        future, self._publishing = self._publishing, None
        self.shards.append(future.result())


def _publish(writer: ShardWriter, path: Path, arrays: dict[str, np.ndarray]) -> ShardInfo:
    """Finish a shard (table, fsync, rename) and describe it for the manifest; a shard that cannot be
    finished (a full disk) is dropped, leaving no temporary file behind."""
    try:
        writer.finish(arrays)
    except BaseException:
        writer.abort()
        raise
    return ShardInfo(path.name, writer.num_records, os.path.getsize(path), file_checksum(path), writer.table_offset,
                     writer.table_bytes)
