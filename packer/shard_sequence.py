"""Writing records into consecutive, size-bounded shards.

A shard closes when the next record would take its payload bytes past ``shard_size``; a record is never
split, so a shard always holds at least one record (a record larger than ``shard_size`` gets a shard of
its own). Container overhead (LMDB page rounding, the record table) comes on top of the payload bytes.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from packer.encoding import Encoded
from reader.format import ShardInfo, ShardWriter, file_checksum, open_shard_writer

ShardName = Callable[[int], str]


class ShardSequence:
    """Appends records to shard 0, 1, ... (named by ``shard_name(number)``) and lists the finished ones.

    Publishing a full shard (record table, fsync, rename, checksum) runs on a background thread while
    the next shard fills, so encoding is not left idle during the disk flush; at most one shard is
    being published at a time. ``shards`` lists the published shards, in order.
    """

    def __init__(self, dst: Path, storage: str, shard_size: int, shard_name: ShardName) -> None:
        self._dst = dst
        self._storage = storage
        self._shard_size = shard_size
        self._shard_name = shard_name
        self.shards: list[ShardInfo] = []
        self._writer: ShardWriter | None = None
        self._name = ""
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="shard-publisher")
        self._publishing: Future[ShardInfo] | None = None

    def add(self, record: Encoded, label: int) -> None:
        """Append one record, first closing the shard if the record would overflow it."""
        writer = self._writer
        if writer is not None and writer.payload_bytes + len(record.payload) > self._shard_size:
            self._close_shard()
            writer = None
        if writer is None:
            self._name = self._shard_name(len(self.shards) + (self._publishing is not None))
            writer = self._writer = open_shard_writer(self._storage, self._dst / self._name)
        writer.append(record.payload, label, record.height, record.width)

    def finish(self) -> list[ShardInfo]:
        """Publish the last shard (if any), wait until every shard is published, and list them."""
        self._close_shard()
        self._collect_published()
        self._publisher.shutdown()
        return self.shards

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
        self._publishing = self._publisher.submit(_publish, writer, self._dst / self._name)

    def _collect_published(self) -> None:
        """Wait for the shard being published (re-raising its error) and add it to ``shards``."""
        if self._publishing is None:
            return
        future, self._publishing = self._publishing, None
        self.shards.append(future.result())


def _publish(writer: ShardWriter, path: Path) -> ShardInfo:
    """Finish a shard (table, fsync, rename) and describe it for the manifest; a shard that cannot be
    finished (a full disk) is dropped, leaving no temporary file behind."""
    try:
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return ShardInfo(path.name, writer.num_records, os.path.getsize(path), file_checksum(path))
