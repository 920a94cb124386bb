"""``make_loader``: a DataLoader over a ``PackedDataset`` that moves whole batches, and can resume.

The DataLoader hands each worker a list of indices; the worker calls ``PackedDataset.__getitems__``
(which reads the batch in a few coalesced reads) and the identity collate passes the batch through.
Workers are persistent, so shard descriptors and buffers stay warm from one epoch to the next.
"""
from __future__ import annotations

import os
from typing import Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader

from reader.dataset import PackedDataset
from reader.sampler import DEFAULT_BLOCK_BYTES, DEFAULT_BUFFER_BLOCKS, ShardSampler

MAX_DEFAULT_WORKERS = 8


def identity_collate(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset already returns a collated batch (module level, so it pickles under spawn)."""
    return batch


def default_num_workers() -> int:
    """The cores this process may use, shared among the ranks on this node, at most 8."""
    cores = len(os.sched_getaffinity(0))
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(MAX_DEFAULT_WORKERS, cores // max(ranks_here, 1)))


class PackedLoader(DataLoader):
    """A DataLoader that counts the batches it yields, so that ``state_dict()`` can resume mid-epoch.

    ``set_epoch(e)`` selects the epoch's order (call it before each epoch); ``state_dict()`` after
    any batch, then ``load_state_dict()`` on a new loader, yields exactly the batches the first
    loader would have yielded next.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0
        self._epoch_start = self.shard_sampler.start

    @property
    def shard_sampler(self) -> ShardSampler:
        return self.batch_sampler.sampler

    def set_epoch(self, epoch: int) -> None:
        self.shard_sampler.set_epoch(epoch)
        self._yielded = 0
        self._epoch_start = self.shard_sampler.start

    def state_dict(self) -> dict:
        """The sampler's state with ``start`` moved past every sample yielded so far this epoch."""
        state = self.shard_sampler.state_dict()
        state["start"] = self._epoch_start + self._yielded
        return state

    def load_state_dict(self, state: dict) -> None:
        self.shard_sampler.load_state_dict(state)
        self._yielded = 0
        self._epoch_start = self.shard_sampler.start

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._yielded = 0
        self._epoch_start = self.shard_sampler.start
        for images, labels in super().__iter__():
            self._yielded += len(labels)
            yield images, labels


def make_loader(
    dataset: PackedDataset,
    batch_size: int,
    *,
    num_workers: int | None = None,
    order: str = "quasi_random",
    seed: int = 0,
    drop_last: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    pad: bool = True,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    buffer_blocks: int = DEFAULT_BUFFER_BLOCKS,
    prefetch_factor: int | None = None,
    pin_memory: bool | None = None,
    multiprocessing_context: str | None = None,
) -> PackedLoader:
    """A loader yielding ``(uint8 [B, 3, H, W], int64 [B])`` batches of ``dataset``.

    Order, seed, rank, world_size, pad, block_bytes and buffer_blocks go to ``ShardSampler``.
    ``num_workers`` defaults to ``default_num_workers()`` (0 reads in the calling process);
    ``prefetch_factor`` (batches in flight per worker) to 2; ``pin_memory`` to whether CUDA is
    available. ``multiprocessing_context`` ("fork", "spawn", "forkserver") is passed to the DataLoader.
    """
    sampler = ShardSampler(dataset, order=order, seed=seed, rank=rank, world_size=world_size,
                           pad=pad, block_bytes=block_bytes, buffer_blocks=buffer_blocks)
    workers = default_num_workers() if num_workers is None else num_workers
    return PackedLoader(
        dataset,
        batch_sampler=BatchSampler(sampler, batch_size, drop_last),
        collate_fn=identity_collate,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=(2 if prefetch_factor is None else prefetch_factor) if workers > 0 else None,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        multiprocessing_context=multiprocessing_context,
    )
