"""``StepTimer``: how much of each training step waits for data, measured inside any training loop.

    timer = StepTimer()
    for images, labels in timer.wrap(loader):   # any iterable of (images, labels)
        ...                                      # the training step
    print(timer.summary())

Data wait is the time spent inside the iterator's ``next()``; compute is the time from a batch being
handed over to the next ``next()``. With ``sync=True`` and CUDA in use, the consumer's current stream
is synchronized at both boundaries, so GPU work queued by the step counts as compute and a batch still
being copied when handed over counts as data wait. Only the current stream is synchronized, never the
whole device: a prefetcher's side stream copying the *next* batch keeps overlapping. Time the loop
waits for an iterable's own preparation of a batch rather than for its loader (its ``preparing_s``
counter: ``CUDAPrefetcher``'s copy, normalization, augmentation and GPU JPEG decode, on the CPU
without CUDA) is kept apart as preparation, not charged to the loader: more loader workers would not
shorten it. The first
``warmup_steps`` steps of the timer's life (worker start-up, CUDA and cuDNN initialisation) are
recorded but left out of the figures.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class StepTime:
    """One step: its number (0-based, counting warm-up steps), data wait, compute and the wrapped
    iterable's own preparation of the batch (``preparing_s``) in seconds."""

    step: int
    data_wait_s: float
    compute_s: float
    preparing_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.data_wait_s + self.compute_s + self.preparing_s


@dataclass(frozen=True)
class StepTimerSummary:
    """Figures over the measured (post warm-up) steps; ``wait_share`` is data wait / total time,
    ``preparing_share`` the time waited for the iterable's own preparation / total time."""

    steps: int
    warmup_steps: int
    images: int
    data_wait_s: float
    compute_s: float
    wait_share: float
    images_per_s: float
    slowest_steps: tuple[StepTime, ...]
    hint_threshold: float
    preparing_s: float = 0.0
    preparing_share: float = 0.0

    @property
    def loader_bound(self) -> bool:
        """True when the loader, not the step, limits throughput."""
        return self.steps > 0 and self.wait_share > self.hint_threshold

    def report(self) -> str:
        """A few lines for a human: the split, the throughput, the slowest steps and what to try."""
        if self.steps == 0:
            return f"StepTimer: no steps measured yet ({self.warmup_steps} warm-up step(s) are skipped)"
        total = self.data_wait_s + self.compute_s + self.preparing_s
        lines = [
            f"{self.steps} steps, {self.images} images in {total:.2f} s "
            f"(after {self.warmup_steps} warm-up step(s)): {self.images_per_s:,.0f} images/s",
            f"data wait {self.data_wait_s:.2f} s ({self.wait_share:.1%}), compute {self.compute_s:.2f} s "
            f"({self.compute_s / total:.1%}); per step {1000 * self.data_wait_s / self.steps:.1f} ms wait, "
            f"{1000 * self.compute_s / self.steps:.1f} ms compute",
            "slowest steps: "
            + ", ".join(
                f"#{s.step} {1000 * s.total_s:.1f} ms ({1000 * s.data_wait_s:.1f} ms wait)" for s in self.slowest_steps
            ),
        ]
        if self.preparing_s > 0:
            lines.insert(2, f"waiting for batch preparation (the prefetcher's copy, normalization, augmentation "
                            f"and decoding) {self.preparing_s:.2f} s ({self.preparing_share:.1%})")
        if self.preparing_share > self.hint_threshold:
            lines.append(
                f"hint: the loop waits for the prefetcher's own preparation of batches {self.preparing_share:.0%} "
                "of the time, which loader workers cannot speed up: without CUDA it normalizes and augments on "
                "the CPU (train on a GPU, or augment less); with decode=False it decodes JPEG itself (decode in "
                "the workers instead, the default)."
            )
        if self.loader_bound:
            lines.append(
                f"hint: the loader is the bottleneck ({self.wait_share:.0%} of the time waits for data). Try more "
                "loader workers; for a slow disk (HDD, NFS) pack with JPEG encoding (fewer bytes to read), for a "
                "fast disk with busy CPUs pack raw (no decoding); use reader.CUDAPrefetcher to overlap the copy "
                "to the GPU; if the dataset fits in GPU memory, reader.GPUDataset removes loading altogether."
            )
        else:
            lines.append(f"data loading is not the bottleneck ({self.wait_share:.0%} of the time waits for data)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


class StepTimer:
    """Splits each step of a loop over ``wrap(iterable)`` into data wait and compute (module docstring).

    Steps accumulate over every ``wrap`` (e.g. one per epoch) until ``reset()``. A step whose loop
    is left by ``break`` counts its compute up to the moment the iteration is closed.
    """

    def __init__(
        self, sync: bool = True, warmup_steps: int = 1, slowest: int = 5, hint_threshold: float = 0.10
    ) -> None:
        self.sync = sync
        self.warmup_steps = warmup_steps
        self.slowest = slowest
        self.hint_threshold = hint_threshold
        self.reset()

    def reset(self) -> None:
        """Forget every step recorded so far (the warm-up applies again)."""
        self._steps: list[StepTime] = []
        self._images: list[int] = []

    def wrap(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the items of ``iterable`` unchanged, timing the wait for each and the work between them."""
        iterator = iter(iterable)
        pending: tuple[float, int, float] | None = None  # (data wait, images, preparing) of the step computing
        handed_over = 0.0
        try:
            while True:
                asked = self._now()
                if pending is not None:
                    self._record(*pending, asked - handed_over)
                    pending = None
                prepared = _preparing_s(iterable)
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                handed_over = self._now()
                preparing = _preparing_s(iterable) - prepared
                pending = (handed_over - asked - preparing, len(batch[0]), preparing)  # type: ignore[index]
                yield batch
        finally:
            if pending is not None:
                self._record(*pending, self._now() - handed_over)

    def summary(self) -> StepTimerSummary:
        """The figures so far, warm-up steps excluded."""
        steps = self._steps[self.warmup_steps :]
        images = sum(self._images[self.warmup_steps :])
        wait = sum(s.data_wait_s for s in steps)
        compute = sum(s.compute_s for s in steps)
        preparing = sum(s.preparing_s for s in steps)
        total = wait + compute + preparing
        return StepTimerSummary(
            steps=len(steps),
            warmup_steps=min(self.warmup_steps, len(self._steps)),
            images=images,
            data_wait_s=wait,
            compute_s=compute,
            wait_share=wait / total if total > 0 else 0.0,
            images_per_s=images / total if total > 0 else 0.0,
            slowest_steps=tuple(sorted(steps, key=lambda s: s.total_s, reverse=True)[: self.slowest]),
            hint_threshold=self.hint_threshold,
            preparing_s=preparing,
            preparing_share=preparing / total if total > 0 else 0.0,
        )

    def report(self) -> str:
        """``summary().report()``."""
        return self.summary().report()

    def _record(self, data_wait_s: float, images: int, preparing_s: float, compute_s: float) -> None:
        self._steps.append(StepTime(len(self._steps), data_wait_s, compute_s, preparing_s))
        self._images.append(images)

    def _now(self) -> float:
        """The time, after the work queued on the current CUDA stream is done when syncing."""
        if self.sync and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        return time.perf_counter()


def _preparing_s(iterable: object) -> float:
    """The iterable's own preparation time so far (``CUDAPrefetcher.preparing_s``), else 0."""
    value = getattr(iterable, "preparing_s", 0.0)
    return value if isinstance(value, float) else 0.0
