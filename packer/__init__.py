"""Pack an image folder once into LMDB or HDF5 shards of pre-transformed images (``pack``, whole or one
task's share of the partitions, then ``merge_parts``), or any iterable of images (``pack_items``), as
``PackOptions`` say; add images to a dataset (``append``); join finished datasets (``join_datasets``);
inspect (``info``, ``class_counts``), look at (``show``) or check (``verify``) a packed dataset. ``packer``
on the command line."""
from packer.appending import append
from packer.errors import PackError
from packer.items import pack_items
from packer.joining import join_datasets
from packer.merging import merge_parts
from packer.options import PackOptions
from packer.packing import pack
from packer.tools.inspection import DatasetInfo, class_counts, info
from packer.tools.showing import show
from packer.tools.verification import VerifyReport, verify
from packer.version import __version__

__all__ = [
    "DatasetInfo", "PackError", "PackOptions", "VerifyReport", "__version__", "append", "class_counts", "info",
    "join_datasets", "merge_parts", "pack", "pack_items", "show", "verify",
]
