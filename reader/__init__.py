"""Fast torch reader for packed image datasets (see ``reader/format/FORMAT.md``).

The names below import on first use, so that ``reader.format`` (all the packer needs) loads without
torch: ``packer info`` answers in a fraction of a second. Importing ``reader`` guards this process's
later forks against a CPython bug that can hang a forked worker at its start (``reader.fork_guard``).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from reader.fork_guard import install as _guard_forks

if TYPE_CHECKING:
    from reader.dataset import PackedDataset
    from reader.gpu.augment import BatchAugment
    from reader.gpu.gpu_dataset import GPUDataset
    from reader.gpu.prefetcher import CUDAPrefetcher
    from reader.loader import make_loader
    from reader.sampler import ShardSampler
    from reader.splits import split
    from reader.step_timer import StepTimer

    __all__ = ["BatchAugment", "CUDAPrefetcher", "GPUDataset", "PackedDataset", "ShardSampler", "StepTimer",
               "make_loader", "split"]

_HOMES = {
    "BatchAugment": "reader.gpu.augment",
    "CUDAPrefetcher": "reader.gpu.prefetcher",
    "GPUDataset": "reader.gpu.gpu_dataset",
    "PackedDataset": "reader.dataset",
    "ShardSampler": "reader.sampler",
    "StepTimer": "reader.step_timer",
    "make_loader": "reader.loader",
    "split": "reader.splits",
}
__all__ = sorted(_HOMES)
_guard_forks()


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'reader' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
