"""The on-disk format of a packed dataset, owned here and imported by both the packer and the reader.

A dataset is a directory: shard files (LMDB or HDF5) holding the record bytes and, inside each shard,
its record table; and ``manifest.json``, written last, whose presence means the dataset is complete.
FORMAT.md beside this file is the specification; this package is its only implementation.
"""
from reader.format.errors import FormatError
from reader.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    file_checksum,
    load_manifest,
)
from reader.format.records import (
    ENCODINGS,
    RECORD_TABLE_DTYPE,
    STORAGES,
    shard_file_name,
    table_problems,
)
from reader.format.shard_files import FileIdentity
from reader.format.shards import ShardWriter, load_shard_table, open_shard_writer, read_record_table

__all__ = [
    "ENCODINGS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "RECORD_TABLE_DTYPE",
    "STORAGES",
    "FileIdentity",
    "FormatError",
    "Manifest",
    "ShardInfo",
    "ShardWriter",
    "file_checksum",
    "load_manifest",
    "load_shard_table",
    "open_shard_writer",
    "read_record_table",
    "shard_file_name",
    "table_problems",
]
