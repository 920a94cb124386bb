"""Pack an image folder once into LMDB or HDF5 shards of pre-transformed images (``pack``, whole or
one task's share of the partitions, then ``merge_parts``), join finished datasets (``join_datasets``),
and inspect (``info``) or check (``verify``) a packed dataset. ``packer`` on the command line."""
from packer.errors import PackError
from packer.inspection import DatasetInfo, info
from packer.joining import join_datasets
from packer.merging import merge_parts
from packer.packing import pack
from packer.verification import VerifyReport, verify
from packer.version import __version__

__all__ = [
    "DatasetInfo", "PackError", "VerifyReport", "__version__", "info", "join_datasets", "merge_parts", "pack",
    "verify",
]
