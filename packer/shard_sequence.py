"""Writing records into consecutive, size-bounded shards.

A shard closes when the next record would take its payload bytes past ``shard_size``; a record is never
split, so a shard always holds at least one record (a record larger than ``shard_size`` gets a shard of
its own). Container overhead (LMDB page rounding, the record table) comes on top of the payload bytes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from packer.pipeline import Encoded
from reader.format import ShardInfo, ShardWriter, file_checksum, open_shard_writer, shard_file_name

ShardDone = Callable[[ShardInfo, int], None]


class ShardSequence:
    """Appends records to shard ``first_index``, then the next ones; reports each finished shard.

    ``on_shard_done(info, end)`` is called after a shard is published, with ``end`` the plan position
    of the first record that is not in it.
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

    def add(self, record: Encoded, label: int, position: int) -> None:
        """Append the record at plan ``position``, first closing the shard if it would overflow."""
        writer = self._writer
        if writer is not None and writer.payload_bytes + len(record.payload) > self._shard_size:
            self.close_shard(position)
            writer = None
        if writer is None:
            self._name = shard_file_name(self._next_index, self._storage)
            self._next_index += 1
            writer = self._writer = open_shard_writer(self._storage, self._dst / self._name)
        writer.append(record.payload, label, record.height, record.width)

    def close_shard(self, end: int) -> None:
        """Publish the open shard (if any) and report it; ``end`` is the plan position after it."""
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        writer.finish()
        path = self._dst / self._name
        info = ShardInfo(self._name, writer.num_records, os.path.getsize(path), file_checksum(path))
        self._on_shard_done(info, end)

    def abort(self) -> None:
        """Drop the shard being written (finished shards stay, for a resume)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
