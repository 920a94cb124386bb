"""Fast torch reader for packed image datasets (see ``reader/format/FORMAT.md``)."""
from reader.dataset import PackedDataset

__all__ = ["PackedDataset"]
