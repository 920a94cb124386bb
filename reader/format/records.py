"""What one record is: its payload encodings, the per-shard record table, and shard file names."""
from __future__ import annotations

import numpy as np

STORAGES = ("lmdb", "hdf5")
ENCODINGS = ("raw", "jpeg")

# One row per record of a shard, in record order. ``offset`` is the byte offset of the record's payload
# in the shard *file*, so that a reader can fetch a run of records with one positional read whatever
# the container; ``nbytes`` its length. Little-endian, no padding: 32 bytes a record.
RECORD_TABLE_DTYPE = np.dtype(
    [("offset", "<u8"), ("nbytes", "<u8"), ("label", "<i8"), ("height", "<u4"), ("width", "<u4")]
)

_SHARD_SUFFIX = {"lmdb": ".lmdb", "hdf5": ".h5"}


def shard_file_name(index: int, storage: str) -> str:
    """The file name of shard number ``index``: fixed-width, so names sort in shard order."""
    return f"shard-{index:05d}{_SHARD_SUFFIX[storage]}"


def raw_payload_nbytes(height: int, width: int, channels: int = 3) -> int:
    """Size of a raw record: uint8 pixels laid out channel-major (C, H, W)."""
    return channels * height * width
