"""The on-disk format of a packed dataset, owned here and imported by both the packer and the reader.

A dataset is a directory: shard files (LMDB or HDF5) holding the record bytes and, inside each shard,
its record table; and ``manifest.json``, written last, whose presence means the dataset is complete.
FORMAT.md beside this file is the specification; this package is its only implementation.

Where things are: ``manifest`` (the manifest, checked by ``manifest_schema``), ``records`` (the record
table), ``container`` and ``encoding`` (the base classes of a shard container and of a payload
encoding), ``lmdb_shard``/``hdf5_shard`` and ``raw_encoding``/``jpeg_encoding`` (the implementations),
``registry`` (where they are registered), ``dataset_writer`` (writing a dataset), ``shard_files`` and
``shard_tables`` (opening a dataset's shards safely).
"""
from reader.format.container import Container, ShardWriter
from reader.format.dataset_writer import DatasetWriter
from reader.format.encoding import Encoding
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
from reader.format.records import RECORD_TABLE_DTYPE, table_problems
from reader.format.registry import ENCODINGS, STORAGES, container, containers, encoding, shard_file_name
from reader.format.shard_files import FileIdentity
from reader.format.shard_tables import load_shard_table

__all__ = [
    "ENCODINGS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "RECORD_TABLE_DTYPE",
    "STORAGES",
    "Container",
    "DatasetWriter",
    "Encoding",
    "FileIdentity",
    "FormatError",
    "Manifest",
    "ShardInfo",
    "ShardWriter",
    "container",
    "containers",
    "encoding",
    "file_checksum",
    "load_manifest",
    "load_shard_table",
    "shard_file_name",
    "table_problems",
]
