"""``GPUDataset``: a whole fixed-shape packed dataset held on the device, served as augmented batches.

Every record is read once, in large batches through ``read_batch``, into one uint8 tensor
``[N, 3, H, W]`` on the device plus an int64 label tensor. An epoch is then a device-side permutation
and one gather per batch: no host IO, no host-to-device copies, no workers. Worth it when the
dataset fits in device memory with room to spare for the model (e.g. CIFAR, or ImageNet at 64 px).
"""
from __future__ import annotations

import os
from typing import Iterator, Protocol, Sequence

import torch

from reader.augment import BatchAugment, epoch_generator
from reader.prefetcher import default_device

# Fraction of the free memory the resident dataset may take; the rest is left to the model.
MEMORY_FRACTION = 0.8
_GIB = float(1 << 30)


class FixedShapeDataset(Protocol):
    """What GPUDataset needs from a dataset (``reader.PackedDataset`` provides it)."""

    manifest: object

    def __len__(self) -> int: ...

    def read_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]: ...


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


def _describe(dataset: object) -> str:
    """A name for ``dataset`` in error messages: its path when it has one."""
    path = getattr(dataset, "path", None) or getattr(dataset, "root", None)
    return str(path) if path is not None else type(dataset).__name__


class GPUDataset:
    """Iterate over a resident copy of ``dataset`` in shuffled, normalized, augmented batches.

    Yields ``(dtype images [B, 3, H', W'], int64 labels [B])`` on ``device`` (None: CUDA when present,
    else CPU, where it works the same). Options as in ``CUDAPrefetcher`` / ``BatchAugment``. The
    order is ``torch.randperm`` on the device from a generator seeded by ``(seed, epoch)``; each
    iteration uses the epoch given to ``set_epoch``, or else the one after the previous iteration.
    Refuses datasets whose records vary in size, and datasets that would take more than
    ``MEMORY_FRACTION`` of the device's free memory.
    """

    def __init__(
        self,
        dataset: FixedShapeDataset,
        device: torch.device | str | None,
        *,
        batch_size: int,
        mean: Sequence[float],
        std: Sequence[float],
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        flip: bool = False,
        crop: int | Sequence[int] | None = None,
        random_resized_crop: int | Sequence[int] | None = None,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
        load_batch_size: int = 1024,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.device = default_device(device)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self.augment = BatchAugment(
            mean,
            std,
            dtype=dtype,
            channels_last=channels_last,
            flip=flip,
            crop=crop,
            random_resized_crop=random_resized_crop,
            scale=scale,
            ratio=ratio,
        )
        shape = self._fixed_shape(dataset)
        self._check_fits(dataset, shape)
        self.images, self.labels = self._load(dataset, shape, load_batch_size)

    @staticmethod
    def _fixed_shape(dataset: FixedShapeDataset) -> tuple[int, int, int]:
        shape = dataset.manifest.shape
        if shape is None:
            raise ValueError(
                f"{_describe(dataset)}: records have different sizes, but GPUDataset stacks them in one "
                "tensor; pack with a crop (fixed output size) to use it, or read with CUDAPrefetcher"
            )
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
            batch_images, batch_labels = dataset.read_batch(list(range(start, stop)))
            if tuple(batch_images.shape[1:]) != shape:
                raise ValueError(
                    f"{_describe(dataset)}: records {start}..{stop - 1} have shape "
                    f"{tuple(batch_images.shape[1:])}, but the manifest says {shape}"
                )
            images[start:stop].copy_(batch_images)
            labels[start:stop].copy_(batch_labels)
        return images, labels

    def __len__(self) -> int:
        count = len(self.labels)
        return count // self.batch_size if self.drop_last else -(-count // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration's order and augmentation draws."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        return self._batches(epoch_generator(self.seed, epoch, self.device))

    def _batches(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        count = len(self.labels)
        if self.shuffle:
            order = torch.randperm(count, generator=generator, device=self.device)
        else:
            order = torch.arange(count, device=self.device)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            indices = order[start : start + self.batch_size]
            yield self.augment(self.images.index_select(0, indices), generator), self.labels.index_select(0, indices)
