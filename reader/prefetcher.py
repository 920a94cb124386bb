"""``CUDAPrefetcher``: overlap the host-to-device copy and normalization of batch k+1 with the step on k.

The copy runs on one side stream per prefetcher, created once. Before a batch is handed over, the
consumer's current stream waits on the side stream (a GPU-side wait: the host does not block), and
every tensor made on the side stream is ``record_stream``-ed on the consumer stream so the caching
allocator never hands its memory back to the side stream while the consumer still reads it (the race
in apex's prefetcher). Without CUDA the same code runs synchronously on the CPU, so training loops do
not branch.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Sequence

import torch

from reader.augment import BatchAugment, epoch_generator

Batch = tuple[torch.Tensor, torch.Tensor]


def default_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device``; None means the current CUDA device when there is one, else CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def forward_set_epoch(loader: object, epoch: int) -> None:
    """Tell the loader (or its batch sampler or sampler, for a plain DataLoader) which epoch starts."""
    for target in (loader, getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if hasattr(target, "set_epoch"):
            target.set_epoch(epoch)
            return


class CUDAPrefetcher:
    """Wraps a loader of ``(uint8 images [B,3,H,W], int64 labels [B])`` and yields device batches
    ``(dtype images [B,3,H',W'], int64 labels [B])``, normalized and augmented (see ``BatchAugment``
    for ``mean``/``std`` units and the options).

    At most two batches live on the device: the one being consumed and the next one in flight. The
    loader should pin its memory (``DataLoader(pin_memory=True)``); unpinned batches are pinned here,
    on the host, before their asynchronous copy. Augmentation draws are seeded by ``(seed, epoch)``:
    each iteration uses the epoch given to ``set_epoch``, or else the one after the previous iteration.
    """

    def __init__(
        self,
        loader: Iterable[Batch],
        mean: Sequence[float],
        std: Sequence[float],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        flip: bool = False,
        crop: int | Sequence[int] | None = None,
        random_resized_crop: int | Sequence[int] | None = None,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
        seed: int = 0,
    ) -> None:
        self.loader = loader
        self.device = default_device(device)
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
        self.seed = seed
        self.epoch = 0
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration's draws, and forward it to the loader."""
        self.epoch = epoch
        forward_set_epoch(self.loader, epoch)

    def __iter__(self) -> Iterator[Batch]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        return self._batches(epoch_generator(self.seed, epoch, self.device))

    def _batches(self, generator: torch.Generator) -> Iterator[Batch]:
        """Hand over batch k, then start k+1 before the consumer resumes. Closing this generator (an
        early ``break`` does) drops the batch in flight and the loader's iterator."""
        source = iter(self.loader)
        try:
            pending = self._start(next(source, None), generator)
            while pending is not None:
                ready = self._hand_over(pending)
                pending = self._start(next(source, None), generator)
                yield ready
        finally:
            pending = ready = source = None

    def _start(self, batch: Batch | None, generator: torch.Generator) -> Batch | None:
        """Enqueue the copy and conversion of ``batch`` on the side stream (CPU: compute it now)."""
        if batch is None:
            return None
        images, labels = batch
        if self.stream is not None:
            images, labels = (t if t.is_pinned() else t.pin_memory() for t in (images, labels))
        context = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with context:
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, dtype=torch.int64, non_blocking=True)
            return self.augment(images, generator), labels

    def _hand_over(self, batch: Batch) -> Batch:
        """Make the consumer's stream wait for ``batch`` and protect its memory from reuse meanwhile."""
        if self.stream is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_stream(self.stream)
            for tensor in batch:
                tensor.record_stream(consumer)
        return batch
