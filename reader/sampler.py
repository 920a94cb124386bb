"""``ShardSampler``: record orders that keep reads long and sequential yet batches well mixed, for DDP.

Orders:

- ``"sequential"``: records in dataset order.
- ``"random"``: a uniform random permutation.
- ``"quasi_random"`` (default): the dataset is cut into blocks of contiguous records (about
  ``block_bytes`` of shard file each, less for small datasets: ``reader.blocks``), the blocks are shuffled,
  then records are shuffled within each window of ``buffer_blocks`` consecutive shuffled blocks. A
  batch draws from ~``buffer_blocks`` places in the files, so a slow disk sees long sequential reads,
  while a record can still land anywhere in the epoch.

Every order is a function of ``(seed, epoch)`` only: the same seed repeats, each epoch differs.

Distributed rule: the epoch order is made a multiple of ``world_size`` long, by wrapping around to its
beginning (``pad=True``, the default: the first few records of the order are seen twice) or by
dropping its tail (``pad=False``: a few records are skipped this epoch). Rank ``r`` then takes the
``r``-th contiguous slice of it, so every rank yields the same number of samples (no DDP hang at epoch
end), the ranks' slices are disjoint apart from the wrapped duplicates, and their union is the whole
dataset when padding. Contiguous slices (not strides) keep each rank's reads sequential.

Resume: ``start`` skips the first ``start`` samples of this rank's epoch order. It is part of
``state_dict()`` and stays in force until ``set_epoch`` moves to another epoch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from reader.blocks import DEFAULT_BLOCK_BYTES, block_size, block_starts

if TYPE_CHECKING:
    from reader.dataset import PackedDataset

ORDERS = ("sequential", "random", "quasi_random")
DEFAULT_BUFFER_BLOCKS = 16


class ShardSampler(Sampler[int]):
    """Record indices of one rank's share of a packed dataset's epoch (see the module docstring).

    ``dataset`` needs ``len()`` and a ``manifest`` (a ``PackedDataset``): shard sizes in records and
    bytes set the quasi-random blocks. ``rank`` and ``world_size`` default to torch.distributed's
    when it is initialised, else to 0 and 1.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        order: str = "quasi_random",
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        pad: bool = True,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        buffer_blocks: int = DEFAULT_BUFFER_BLOCKS,
    ) -> None:
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}: expected one of {', '.join(ORDERS)}")
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in range for world_size {world_size}")
        if block_bytes < 1 or buffer_blocks < 1:
            raise ValueError("block_bytes and buffer_blocks must be positive")
        self.num_records = len(dataset)
        self.order = order
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.pad = pad
        self.buffer_blocks = buffer_blocks
        self.epoch = 0
        self.start = 0
        shards = dataset.manifest.shards
        self._block_starts = block_starts(shards, block_size(shards, block_bytes))
        if pad:
            self.samples_per_rank = -(-self.num_records // world_size)
        else:
            self.samples_per_rank = self.num_records // world_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order to yield; moving to another epoch clears ``start``."""
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "seed": self.seed, "order": self.order, "start": self.start}

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``: the next iteration yields what the saved run would have next."""
        if state["order"] != self.order:
            raise ValueError(f"saved state is for order {state['order']!r}, this sampler uses "
                             f"{self.order!r}")
        if not 0 <= state["start"] <= self.samples_per_rank:
            raise ValueError(f"saved start {state['start']} is outside this rank's "
                             f"{self.samples_per_rank} samples")
        self.epoch = state["epoch"]
        self.seed = state["seed"]
        self.start = state["start"]

    def __len__(self) -> int:
        return self.samples_per_rank - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(self.rank_order()[self.start:].tolist())

    def rank_order(self, epoch: int | None = None) -> np.ndarray:
        """This rank's whole share of ``epoch`` (default: the current one), ``start`` not applied."""
        order = self.epoch_order(epoch)
        total = self.samples_per_rank * self.world_size
        if total > len(order):
            order = np.resize(order, total)
        first = self.rank * self.samples_per_rank
        return order[first:first + self.samples_per_rank]

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """Every record once, in ``epoch``'s order (default: the current epoch), before the split
        between ranks. Taking the epoch as an argument lets a loader prepare the next epoch's batches
        while this one is still being read, without touching the sampler's state."""
        if self.order == "sequential":
            return np.arange(self.num_records, dtype=np.int64)
        rng = np.random.default_rng((self.seed, self.epoch if epoch is None else epoch))
        if self.order == "random":
            return rng.permutation(self.num_records).astype(np.int64)
        return _quasi_random(self._block_starts, self.num_records, self.buffer_blocks, rng)


def _quasi_random(block_starts: np.ndarray, num_records: int, buffer_blocks: int,
                  rng: np.random.Generator) -> np.ndarray:
    """Shuffle the blocks, then shuffle records within windows of ``buffer_blocks`` blocks."""
    if num_records == 0:
        return np.zeros(0, np.int64)
    lengths = np.diff(np.append(block_starts, num_records))
    perm = rng.permutation(len(block_starts))
    starts, lengths = block_starts[perm], lengths[perm]
    first_position = np.cumsum(lengths) - lengths
    records = np.repeat(starts - first_position, lengths) + np.arange(num_records)
    window = np.repeat(np.arange(len(perm)) // buffer_blocks, lengths)
    within = rng.random(num_records)
    return records[np.lexsort((within, window))]
