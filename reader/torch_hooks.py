"""Every private torch API this project uses, detected once at import, each with a public fallback.

torch does not promise these names; they buy speed, never correctness. Should a torch release rename
or remove one, ``detect()`` finds it missing and the code that uses it takes its fallback: the same
batches, slower. Nothing else in the project touches a private torch name: ``reader.batch_memory``
calls ``storage_references`` and ``shared_uint8``, and ``reader.loader`` subclasses ``HookedDataLoader``
(tests/reader/test_torch_hooks.py hides each hook in turn and reads the same batches).

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

import contextlib
import functools
import gc
import multiprocessing
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, cast

import torch
from torch.utils.data import DataLoader, Dataset
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
                   and "_iterator" in vars(DataLoader(cast(Dataset, [])))
                   and iterator is not None and callable(getattr(iterator, "_reset", None)))
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    storage_use_count: Callable[[torch.UntypedStorage], int] | None = None
    if use_count is not None and hasattr(torch.UntypedStorage(0), "_cdata"):
        def storage_use_count(storage: torch.UntypedStorage) -> int:
            return use_count(storage._cdata)
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


class HookedDataLoader(DataLoader):
    """A ``DataLoader`` that reaches torch's private iterator hooks through public-named methods, each
    with its fallback; ``reader.loader.PackedLoader`` subclasses it and names nothing private.

    - ``index_batches()``: what the loader's iterators draw index batches from (the ``_index_sampler``
      hook; without it, the batch sampler as DataLoader has it);
    - ``batch_receiver()``: a function applied to every batch received from a worker, also to those
      the DataLoader drops when an epoch is cut short (an override of ``_try_get_data``; without it,
      never called);
    - ``live_iterator()``: the persistent worker iterator of the last loop, to be continued (the
      ``_iterator`` attribute; None without the hooks that make continuing it safe).
    """

    @property
    def _index_sampler(self) -> Any:
        return self.index_batches() if hooks.cross_epoch_iterator else super()._index_sampler

    def index_batches(self) -> Any:
        return super()._index_sampler

    def batch_receiver(self) -> Callable[[Any], Any] | None:
        return None

    def live_iterator(self) -> Any:
        return self._iterator if hooks.cross_epoch_iterator else None

    def _get_iterator(self) -> Any:
        """The DataLoader's iterator, which starts the workers: the receiving one where torch has it.

        Workers forked with the collector on, by a process that has started CUDA, must not collect the
        garbage they inherit (``garbage_kept_from_forked_workers``)."""
        forking = (self.num_workers > 0 and gc.isenabled() and torch.cuda.is_initialized()
                   and worker_start_method(self.multiprocessing_context) == "fork")
        with garbage_kept_from_forked_workers(forking):
            receiver, receiving = self.batch_receiver(), receiving_iterator_class()
            if self.num_workers == 0 or receiver is None or receiving is None:
                return super()._get_iterator()
            self.check_worker_number_rationality()
            return receiving(self, receiver)


# One freeze at a time in this process: a loader forking its workers in another thread while one is
# frozen would take that freeze for the process's own and fork with its garbage unfrozen.
_FORKING_WORKERS = threading.RLock()


@contextlib.contextmanager
def garbage_kept_from_forked_workers(forking: bool) -> Iterator[None]:
    """While workers are forked (``forking``): the parent's objects in the collector's permanent
    generation, released again after.

    Why: a forked worker inherits the parent's heap, garbage cycles included, and a worker's collector
    that frees a CUDA tensor of such a cycle calls into CUDA in the child, which aborts the worker
    ("CUDA error: initialization error" from the caching allocator's ``insert_events``: seen on an H200
    with ``CUDAPrefetcher``'s ``record_stream``-ed batches). Frozen at the fork, that garbage is never
    collected in the worker (which freezes what it starts with: ``reader.loader.start_worker``).
    Freezing is a splice of the collector's lists, where a full collection before the fork walked the
    whole heap in the training process, its first batch waiting: 63-77 ms with torch and the reader
    imported (a slow core), more with a model and a framework. Released, the frozen objects all join the
    oldest generation, where only a full collection looks, so the young ones are collected first (a
    young collection, well under a millisecond): garbage that was young, such as the last loop's CUDA
    batches, is freed now, not only at the next full collection; the old garbage stays where it was.
    Where the process had frozen objects of its own (``gc.freeze``), which releasing would release too,
    a full collection clears the garbage instead. Spawned and forkserver workers inherit nothing, with
    the collector off (``gc.disable()``) a worker collects nothing, and a process without CUDA has no
    CUDA tensor to free: those pass ``forking=False`` and nothing is done."""
    if not forking:
        yield
        return
    with _FORKING_WORKERS:
        if gc.get_freeze_count() > 0:
            gc.collect()
            yield
            return
        gc.collect(1)
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()


def worker_start_method(context: Any) -> str:
    """How a DataLoader with this ``multiprocessing_context`` (None, a name or a context) starts workers:
    "fork", "spawn" or "forkserver". Asking does not fix the default context (``set_start_method`` may
    still be called)."""
    if context is None:
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return context if isinstance(context, str) else context.get_start_method()


def receiving_iterator_class() -> type | None:
    """torch's multi-process iterator with every received batch passed through a receiver function,
    or None where this torch lacks the hook."""
    base = hooks.multiprocessing_iterator
    return None if base is None else _receiving_subclass(base)


@functools.cache
def _receiving_subclass(base: type) -> type:
    class ReceivingIterator(base):
        def __init__(self, loader: DataLoader, receiver: Callable[[Any], Any]) -> None:
            self._receiver = receiver  # not the loader: the loader holds this iterator, no cycle
            super().__init__(loader)

        def _try_get_data(self, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
            success, data = super()._try_get_data(*args, **kwargs)
            return success, self._receiver(data) if success else data

    return ReceivingIterator
