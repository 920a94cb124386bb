"""``GPUDataset``: a whole fixed-shape packed dataset held on the device, served as augmented batches.

Every record is read once, in large batches through ``read_batch``, into one uint8 tensor
``[N, 3, H, W]`` on the device plus an int64 label tensor. An epoch is then a device-side permutation
and one gather per batch: no host IO, no host-to-device copies, no workers. Worth it when the
dataset fits in device memory with room to spare for the model (e.g. CIFAR, or ImageNet at 64 px).

With DDP every rank holds the whole dataset and draws the same epoch permutation (seeded by
``(seed, epoch)``), then takes its own contiguous slice of it, by ``reader.ShardSampler``'s rule: the
permutation is padded by wrapping to a multiple of the world size (or its tail dropped with
``pad=False``), so the ranks' slices are disjoint apart from the wrapped samples and every rank yields
the same number of batches.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Protocol, Sequence

import torch

from reader.arguments import saved_position, true_or_false, whole_number
from reader.epoch_cursor import EpochCursor
from reader.gpu.augment import BatchAugment, augment_from, seeded_generator
from reader.gpu.prefetcher import default_device
from reader.ranks import rank_and_world_size, share_per_rank

# Fraction of the free memory the resident dataset may take; the rest is left to the model.
MEMORY_FRACTION = 0.8
_GIB = float(1 << 30)


class FixedShapeDataset(Protocol):
    """What GPUDataset needs from a dataset: ``len`` and ``dataset[i] -> (uint8 [3, H, W], label)``.
    Whole batches are read at once where the dataset can: ``read_batch(indices) -> (images, labels)``
    (``reader.PackedDataset``), else ``__getitems__(indices)`` (torch's ``Subset`` of one forwards
    it); a ``manifest`` gives the shape up front, else the first record does."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]: ...


def free_memory_bytes(device: torch.device) -> int:
    """Bytes free on ``device``: the CUDA driver's figure, or for the CPU the RAM the kernel reports
    as available (``MemAvailable``: free pages plus reclaimable page cache)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _variable_sizes(name: str) -> ValueError:
    return ValueError(
        f"{name}: records have different sizes, but GPUDataset stacks them in one tensor; read them with "
        "make_loader and CUDAPrefetcher(..., random_resized_crop=SIZE) for training or center_crop=SIZE, "
        "resize=SHORTER_SIDE for evaluation, which bring each batch to one size, or pack with --crop for a "
        "fixed size"
    )


def _read(dataset: FixedShapeDataset, indices: list[int]) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
    """Records ``indices`` as ``(images, int64 labels)``: one ``read_batch`` or ``__getitems__`` call
    where the dataset has one, else one ``dataset[i]`` per record. A batch of samples (torch's
    ``__getitems__`` convention) comes back with its images as a list."""
    if hasattr(dataset, "read_batch"):
        images, labels = dataset.read_batch(indices)[:2]
        return images, labels
    batch = dataset.__getitems__(indices) if hasattr(dataset, "__getitems__") else None
    if isinstance(batch, tuple) and len(batch) >= 2 and isinstance(batch[1], torch.Tensor):
        return batch[0], batch[1]
    samples = batch if batch is not None else [dataset[i] for i in indices]
    return [image for image, *_ in samples], torch.tensor([int(label) for _, label, *_ in samples])


def _describe(dataset: object) -> str:
    """A name for ``dataset`` in error messages: its path when it has one."""
    path = getattr(dataset, "path", None) or getattr(dataset, "root", None)
    return str(path) if path is not None else type(dataset).__name__


class GPUDataset(EpochCursor):
    """Iterate over a resident copy of ``dataset`` in shuffled, normalized, augmented batches.

    Yields ``(dtype images [B, 3, H', W'], int64 labels [B])`` on ``device`` (None: CUDA when present,
    else CPU, where it works the same). The augmentation is ``augment=BatchAugment(...)``, or built
    from ``mean``, ``std`` and ``BatchAugment``'s keyword options given here. The order is
    ``torch.randperm`` on the device from a generator seeded by ``(seed, epoch)``, the same on every
    rank; this rank's share of it is ``epoch_indices(epoch)`` (see the module docstring: ``rank`` and
    ``world_size`` default to torch.distributed's when it is initialised). Augmentation draws are
    seeded by ``(seed, epoch, rank, batch)``, so ranks draw differently. Each iteration uses the epoch
    given to ``set_epoch``, or else the one after the previous iteration. ``state_dict()`` /
    ``load_state_dict()`` resume after the batches yielded so far, as ``CUDAPrefetcher``'s do.

    Refuses datasets whose records vary in size (use ``make_loader`` with ``CUDAPrefetcher``, which
    crops each batch to one size), and datasets that would take more than ``MEMORY_FRACTION`` of the
    device's free memory.
    """

    def __init__(
        self,
        dataset: FixedShapeDataset,
        device: torch.device | str | None,
        *,
        batch_size: int,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        augment: BatchAugment | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        pad: bool = True,
        load_batch_size: int = 1024,
        **augment_options: Any,
    ) -> None:
        self.device = default_device(device)
        self.batch_size = whole_number("batch_size", batch_size, 1)
        load_batch_size = whole_number("load_batch_size", load_batch_size, 1)
        self.shuffle = true_or_false("shuffle", shuffle)
        self.drop_last = true_or_false("drop_last", drop_last)
        self.seed = whole_number("seed", seed)
        self.rank, self.world_size = rank_and_world_size(rank, world_size)
        self.pad = true_or_false("pad", pad)
        self._position = (0, 0)
        self.augment = augment_from(mean, std, augment, augment_options)
        shape = self._fixed_shape(dataset)
        self._check_fits(dataset, shape)
        self.images, self.labels = self._load(dataset, shape, load_batch_size)
        count = len(self.labels)
        self.samples_per_rank = share_per_rank(count, self.world_size, pad)

    @staticmethod
    def _fixed_shape(dataset: FixedShapeDataset) -> tuple[int, int, int]:
        manifest = getattr(dataset, "manifest", None)
        shape = manifest.shape if manifest is not None else tuple(dataset[0][0].shape)
        if shape is None:
            raise _variable_sizes(_describe(dataset))
        channels, height, width = shape
        return int(channels), int(height), int(width)

    def _check_fits(self, dataset: FixedShapeDataset, shape: tuple[int, int, int]) -> None:
        channels, height, width = shape
        needed = len(dataset) * (channels * height * width + 8)
        free = free_memory_bytes(self.device)
        if needed > free * MEMORY_FRACTION:
            raise MemoryError(
                f"{_describe(dataset)}: dataset needs {needed / _GIB:.2f} GiB, {self.device} has "
                f"{free / _GIB:.2f} GiB free (GPUDataset uses at most {MEMORY_FRACTION:.0%} of it, leaving "
                "the rest to the model); use CUDAPrefetcher, or pack at a smaller size"
            )

    def _load(
        self, dataset: FixedShapeDataset, shape: tuple[int, int, int], load_batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        count = len(dataset)
        images = torch.empty((count, *shape), dtype=torch.uint8, device=self.device)
        labels = torch.empty(count, dtype=torch.int64, device=self.device)
        for start in range(0, count, load_batch_size):
            stop = min(start + load_batch_size, count)
            batch_images, batch_labels = _read(dataset, list(range(start, stop)))
            if isinstance(batch_images, list):
                if len({tuple(image.shape) for image in batch_images}) > 1:
                    raise _variable_sizes(f"{_describe(dataset)} (records {start}..{stop - 1})")
                batch_images = torch.stack(batch_images)
            if tuple(batch_images.shape[1:]) != shape:
                raise ValueError(
                    f"{_describe(dataset)}: records {start}..{stop - 1} have shape "
                    f"{tuple(batch_images.shape[1:])}, but the manifest (or record 0) says {shape}"
                )
            images[start:stop].copy_(batch_images)
            labels[start:stop].copy_(batch_labels)
        return images, labels

    def __len__(self) -> int:
        """Batches in a whole epoch, also after ``load_state_dict`` (an iteration then yields those left)."""
        count = self.samples_per_rank
        return count // self.batch_size if self.drop_last else -(-count // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration's order and augmentation draws (moving to another epoch
        than a loaded state's drops that state's position)."""
        if self._move_to_epoch(epoch):
            self._position = (self.epoch, 0)

    def state_dict(self) -> dict:
        """Where the consumer is: ``{"epoch", "batches" (yielded this epoch), "seed"}``; between
        iterations, the position after the last batch yielded. The same on every rank."""
        epoch, batches = self._position
        return {"epoch": epoch, "batches": batches, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``: the next iteration yields the batch after the saved ones, with the
        same order and augmentation draws as the saved run. A state that is not such a dict, or has an
        entry missing or mistyped, raises ``TypeError``/``ValueError`` naming it."""
        _, epoch, batches, self.seed = saved_position(state)
        self._restore_position(epoch, batches)
        self._position = (epoch, batches)

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for ``epoch``, in order (before batching and ``drop_last``)."""
        count = len(self.labels)
        if self.shuffle:
            order = torch.randperm(count, generator=seeded_generator(self.device, self.seed, epoch), device=self.device)
        else:
            order = torch.arange(count, device=self.device)
        total = self.samples_per_rank * self.world_size
        if total > count:
            order = order.repeat(-(-total // count))
        first = self.rank * self.samples_per_rank
        return order[first : first + self.samples_per_rank]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._batches(*self._take_pass())

    def _batches(self, epoch: int, first: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.epoch_indices(epoch)
        for number in range(first, len(self)):
            indices = order[number * self.batch_size : (number + 1) * self.batch_size]
            generator = seeded_generator(self.device, self.seed, epoch, self.rank, number)
            batch = self.augment(self.images.index_select(0, indices), generator), self.labels.index_select(0, indices)
            self._position = (epoch, number + 1)
            yield batch
        self._position = (epoch + 1, 0)
