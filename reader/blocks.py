"""Blocks: runs of contiguous records, the unit of locality shared by the sampler and the reader.

``ShardSampler``'s quasi-random order shuffles blocks and mixes records within windows of blocks;
``PackedDataset`` reads a whole block ahead when a batch misses the page cache. Both must cut the files
the same way, so the rule lives here: each shard is cut into blocks of the same number of consecutive
records, about ``block_size`` bytes of shard file each (a block never crosses a shard).

``block_size`` is the asked-for size (8 MiB by default: long enough for a disk to stream) except for
datasets under 2 GiB, which get smaller blocks so that they still have ``MIN_BLOCKS`` of them (sixteen
windows of 16). Why: on a cold cache the first batch of an epoch draws from every block of the first
window, so it waits until the disk has read that whole window, and the last window's records are all
decoded after the disk has finished; with a window at most a sixteenth of the dataset, neither end
costs more than a sixteenth of the epoch's disk time (BENCHMARKS.md, "Cold reads from a slow disk").
Blocks never shrink below 1 MiB, where a slow disk starts to lose bandwidth to seeks.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from reader.format import ShardInfo

DEFAULT_BLOCK_BYTES = 8 << 20
MIN_BLOCKS = 256
MIN_BLOCK_BYTES = 1 << 20


def block_size(shards: Sequence[ShardInfo], block_bytes: int) -> int:
    """The block size in bytes for a dataset of ``shards`` when ``block_bytes`` is asked for."""
    total = sum(shard.bytes for shard in shards)
    return min(block_bytes, max(MIN_BLOCK_BYTES, total // MIN_BLOCKS))


def records_per_block(records: int, shard_bytes: int, size: int) -> int:
    """How many consecutive records of a shard make one block of about ``size`` bytes."""
    return max(1, size * records // max(shard_bytes, 1))


def block_count(records: int, shard_bytes: int, size: int) -> int:
    """How many blocks a shard of ``records`` records in ``shard_bytes`` bytes has (at least one); its
    ``block_bounds`` never cut more (records sharing a page may merge two)."""
    return max(1, -(-records // records_per_block(records, shard_bytes, size)))


def block_starts(shards: Sequence[ShardInfo], size: int) -> np.ndarray:
    """The dataset index of every block's first record, over all shards in order."""
    starts = []
    first = 0
    for shard in shards:
        if shard.records:
            per_block = records_per_block(shard.records, shard.bytes, size)
            starts.append(np.arange(first, first + shard.records, per_block, dtype=np.int64))
        first += shard.records
    return np.concatenate(starts) if starts else np.zeros(0, np.int64)


def dataset_block_starts(shards: Sequence[ShardInfo], block_bytes: int) -> np.ndarray:
    """The first record of every block of a dataset of ``shards`` cut for ``block_bytes``: its layout."""
    return block_starts(shards, block_size(shards, block_bytes))


def block_bounds(offsets: np.ndarray, nbytes: np.ndarray, shard: ShardInfo, size: int) -> np.ndarray:
    """Where one shard file's blocks start (bytes), then where its last block ends: the end of the
    record that ends last.

    Each block starts at its lowest record offset (the first at the file's start). Records small enough
    to share LMDB leaf pages are not in file order, so there blocks only roughly follow the records;
    payloads of a page or more are exact.

    Why the last block stops at the records and not at the file's end: what follows them is the
    container's own pages and the record table (both LMDB and HDF5 writers put it last). Read ahead,
    those bytes are read for nothing every epoch; and a streamed pass clears each block from the cache
    before advising it (``reader.shard_io``), which would drop the table's pages just after the main
    process read them, so that every worker then read the table again, from the back of the disk's
    queue (measured: 0.4-1.6 s per table in a worker, on a 1.2 GB raw set under a 1000 MB cap).
    """
    offsets = offsets.astype(np.int64)
    per_block = records_per_block(shard.records, shard.bytes, size)
    starts = np.minimum.reduceat(offsets, np.arange(0, shard.records, per_block))[1:] if len(offsets) else offsets
    end = int((offsets + nbytes.astype(np.int64)).max()) if len(offsets) else 0
    return np.unique(np.concatenate([[0], starts, [max(end, 1)]]))
