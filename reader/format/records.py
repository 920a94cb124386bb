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


def table_problems(
    table: np.ndarray,
    num_classes: int,
    encoding: str,
    shape: list[int] | None,
    file_size: int | None = None,
) -> list[tuple[str, np.ndarray]]:
    """What is wrong with a shard's record table, as ``(what, indices of the bad rows)`` pairs.

    Labels must index a class, raw payloads be ``3*H*W`` bytes, every record have the manifest's fixed
    ``shape`` when it has one, and (given ``file_size``) every payload lie inside the file.
    """
    checks = [("label is not a class index", (table["label"] < 0) | (table["label"] >= num_classes))]
    if file_size is not None:
        checks.append(("payload lies outside the file", table["offset"] + table["nbytes"] > file_size))
    if encoding == "raw":
        expected = raw_payload_nbytes(table["height"].astype(np.uint64), table["width"].astype(np.uint64))
        checks.append(("raw payload is not 3*H*W bytes", table["nbytes"] != expected))
    if shape is not None:
        _, height, width = shape
        wrong_size = (table["height"] != height) | (table["width"] != width)
        checks.append((f"size is not the manifest's {height}x{width}", wrong_size))
    return [(what, np.flatnonzero(bad)) for what, bad in checks if bad.any()]
