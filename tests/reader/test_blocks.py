"""The block rule shared by the sampler and the read-ahead: sizes, small datasets, shard boundaries."""
from __future__ import annotations

import numpy as np

from reader.blocks import MIN_BLOCK_BYTES, MIN_BLOCKS, block_bounds, block_size, block_starts
from reader.format import ShardInfo

MIB = 1 << 20


def shard(records: int, nbytes: int) -> ShardInfo:
    return ShardInfo(file="s", records=records, bytes=nbytes, checksum="")


def test_large_datasets_get_the_asked_size() -> None:
    assert block_size([shard(50000, 4000 * MIB)], 8 * MIB) == 8 * MIB


def test_small_datasets_get_at_least_min_blocks_but_never_under_one_mib() -> None:
    size = block_size([shard(50000, 830 * MIB)], 8 * MIB)
    assert size == 830 * MIB // MIN_BLOCKS
    assert len(block_starts([shard(50000, 830 * MIB)], size)) >= MIN_BLOCKS
    assert block_size([shard(5000, 83 * MIB)], 8 * MIB) == MIN_BLOCK_BYTES
    assert block_size([shard(100, 3 * MIB)], 8 * MIB) == MIN_BLOCK_BYTES
    assert block_size([shard(100, 3 * MIB)], 4096) == 4096  # an explicit small size is kept


def test_blocks_never_cross_shards_and_bounds_follow_offsets() -> None:
    shards = [shard(10, 10 * MIB), shard(5, 5 * MIB)]
    assert block_starts(shards, 4 * MIB).tolist() == [0, 4, 8, 10, 14]
    offsets = np.arange(10, dtype=np.int64) * MIB + 100
    nbytes = np.full(10, MIB - 4096, np.int64)  # the last record ends 4096 - 100 bytes before the file
    assert block_bounds(offsets, nbytes, shards[0], 4 * MIB).tolist() == \
        [0, 4 * MIB + 100, 8 * MIB + 100, 10 * MIB + 100 - 4096]
