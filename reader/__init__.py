"""Fast torch reader for packed image datasets (see ``reader/format/FORMAT.md``)."""
from reader.dataset import PackedDataset
from reader.gpu_dataset import GPUDataset
from reader.loader import make_loader
from reader.prefetcher import CUDAPrefetcher
from reader.sampler import ShardSampler
from reader.step_timer import StepTimer

__all__ = ["CUDAPrefetcher", "GPUDataset", "PackedDataset", "ShardSampler", "StepTimer", "make_loader"]
