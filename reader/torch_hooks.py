"""Every private torch API this project uses, detected once at import, each with a public fallback.

torch does not promise these names; they buy speed, never correctness. Should a torch release rename
or remove one, ``detect()`` finds it missing and the code that uses it takes its fallback: the same
batches, slower. Nothing else in the project touches a private torch name (tests/test_torch_hooks.py
hides each hook in turn and reads the same batches).

- ``torch._C._storage_Use_Count`` (of a storage's ``_cdata``): knowing when no tensor uses a batch buffer
  any more, so that it is reused (``reader.batch_memory``). Fallback: buffers count as always in use,
  so batches get fresh memory.
- ``torch.UntypedStorage._new_shared``: an uninitialised shared-memory buffer. Fallback:
  ``torch.empty(n).share_memory_()`` (the same memory, written once more).
- ``_MultiProcessingDataLoaderIter._try_get_data`` and ``DataLoader._get_iterator``: seeing every batch a
  worker sends, also those dropped when an epoch is cut short (``reader.loader``). Fallback: batch slots
  are never handed back, so workers use fresh memory per batch.
- ``DataLoader._index_sampler``, ``DataLoader._iterator`` and persistent workers' ``_reset``: workers that
  prefetch across epoch boundaries (``reader.batch_stream``). Fallback: each epoch starts a new pass of
  the batch sampler, as a plain DataLoader does.

Tested with torch 2.13 (``setup.cfg`` pins that range).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as dataloader_module


@dataclass(frozen=True)
class TorchHooks:
    """Which private hooks this torch has (None or False: missing, the fallback is used)."""

    storage_use_count: Callable[[torch.UntypedStorage], int] | None  # counting the storage object asked with
    new_shared_storage: Callable[[int], torch.UntypedStorage] | None
    multiprocessing_iterator: type | None  # with ``_try_get_data``, and DataLoader has ``_get_iterator``
    cross_epoch_iterator: bool  # DataLoader's ``_index_sampler``, ``_iterator`` and the iterator's ``_reset``


def detect() -> TorchHooks:
    """Look up every hook in the torch that is imported now."""
    iterator = getattr(dataloader_module, "_MultiProcessingDataLoaderIter", None)
    watchable = (iterator is not None and callable(getattr(iterator, "_try_get_data", None))
                 and callable(getattr(DataLoader, "_get_iterator", None)))
    cross_epoch = (isinstance(getattr(DataLoader, "_index_sampler", None), property)
                   and "_iterator" in vars(DataLoader([]))
                   and iterator is not None and callable(getattr(iterator, "_reset", None)))
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is not None and hasattr(torch.UntypedStorage(0), "_cdata"):
        def storage_use_count(storage: torch.UntypedStorage) -> int:
            return use_count(storage._cdata)
    else:
        storage_use_count = None
    return TorchHooks(
        storage_use_count=storage_use_count,
        new_shared_storage=getattr(torch.UntypedStorage, "_new_shared", None),
        multiprocessing_iterator=iterator if watchable else None,
        cross_epoch_iterator=cross_epoch,
    )


hooks = detect()


def storage_references(tensor: torch.Tensor) -> int | None:
    """How many tensors share ``tensor``'s storage, or None when this torch cannot tell."""
    if hooks.storage_use_count is None:
        return None
    return hooks.storage_use_count(tensor.untyped_storage()) - 1  # less the temporary storage object


def shared_uint8(nbytes: int) -> torch.Tensor:
    """An uninitialised ``uint8 [nbytes]`` tensor in shared memory (what a worker can send without a copy)."""
    if hooks.new_shared_storage is None:
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    return torch.empty(0, dtype=torch.uint8).set_(hooks.new_shared_storage(nbytes))
