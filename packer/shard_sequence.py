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

from packer.pipeline import Encoded
from reader.format import ShardInfo, ShardWriter, file_checksum, open_shard_writer, shard_file_name

ShardDone = Callable[[ShardInfo, int], None]


class ShardSequence:
    """Appends records to shard ``first_index``, then the next ones; reports each finished shard.

    Publishing a full shard (record table, fsync, rename, checksum) runs on a background thread while
    the next shard fills, so the encoding processes are not left idle during the disk flush; at most
    one shard is being published at a time. ``on_shard_done(info, end)`` is called on the caller's
    thread, in shard order, once a shard is published; ``end`` is the plan position of the first
    record that is not in it.
    """

    def __init__(
        self, dst: Path, storage: str, shard_size: int, first_index: int, on_shard_done: ShardDone
    ) -> None:
        self._dst = dst
        self._storage = storage
        self._shard_size = shard_size
        self._next_index = first_index
        self._on_shard_done = on_shard_done
        self._writer: ShardWriter | None = None
        self._name = ""
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="shard-publisher")
        self._publishing: tuple[Future[ShardInfo], int] | None = None

    def add(self, record: Encoded, label: int, position: int) -> None:
        """Append the record at plan ``position``, first closing the shard if it would overflow."""
        writer = self._writer
        if writer is not None and writer.payload_bytes + len(record.payload) > self._shard_size:
            self._close_shard(position)
            writer = None
        if writer is None:
            self._name = shard_file_name(self._next_index, self._storage)
            self._next_index += 1
            writer = self._writer = open_shard_writer(self._storage, self._dst / self._name)
        writer.append(record.payload, label, record.height, record.width)

    def finish(self, end: int) -> None:
        """Publish the last shard (if any) and wait until every shard is published and reported."""
        self._close_shard(end)
        self._report_published()
        self._publisher.shutdown()

    def abort(self) -> None:
        """Drop the shard being written. A shard already being published is let finish and, when it
        succeeds, reported like any other, so that a resume keeps it."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        if self._publishing is not None:
            future, end = self._publishing
            self._publishing = None
            if future.exception() is None:
                self._on_shard_done(future.result(), end)
        self._publisher.shutdown()

    def _close_shard(self, end: int) -> None:
        if self._writer is None:
            return
        self._report_published()  # may raise: the writer stays ours, for abort() to drop
        writer, self._writer = self._writer, None
        self._publishing = (self._publisher.submit(_publish, writer, self._dst / self._name), end)

    def _report_published(self) -> None:
        """Wait for the shard being published (re-raising its error) and report it."""
        if self._publishing is None:
            return
        future, end = self._publishing
        self._publishing = None
        self._on_shard_done(future.result(), end)


def _publish(writer: ShardWriter, path: Path) -> ShardInfo:
    """Finish a shard (table, fsync, rename) and describe it for the manifest; a shard that cannot be
    finished (a full disk) is dropped, leaving no temporary file behind."""
    try:
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return ShardInfo(path.name, writer.num_records, os.path.getsize(path), file_checksum(path))
