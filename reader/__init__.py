"""Fast torch reader for packed image datasets (see ``reader/format/FORMAT.md``)."""
from reader.dataset import PackedDataset
from reader.gpu_dataset import GPUDataset
from reader.prefetcher import CUDAPrefetcher
from reader.step_timer import StepTimer

__all__ = ["CUDAPrefetcher", "GPUDataset", "PackedDataset", "StepTimer"]
