"""StepTimer attributes time to data wait or compute correctly (generous share bounds, no tight timing)."""
from __future__ import annotations

import time
from typing import Iterator

import pytest
import torch

from reader.gpu.augment import BatchAugment
from reader.gpu.prefetcher import CUDAPrefetcher
from reader.step_timer import StepTimer, StepTimerSummary

SLEEP_S = 0.02


def batches(count: int, batch_size: int = 4, sleep_s: float = 0.0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` uint8 batches, sleeping ``sleep_s`` before each (a slow loader)."""
    for _ in range(count):
        time.sleep(sleep_s)
        yield torch.zeros(batch_size, 3, 8, 8, dtype=torch.uint8), torch.zeros(batch_size, dtype=torch.int64)


def test_sleep_in_loop_body_is_compute() -> None:
    timer = StepTimer()
    for _ in timer.wrap(batches(6)):
        time.sleep(SLEEP_S)
    summary = timer.summary()
    assert isinstance(summary, StepTimerSummary)
    assert summary.steps == 5 and summary.warmup_steps == 1 and summary.images == 20
    assert summary.wait_share < 0.3
    assert summary.compute_s >= 5 * SLEEP_S * 0.9
    assert summary.images_per_s > 0
    assert not summary.loader_bound
    assert "not the bottleneck" in summary.report()


def test_sleep_in_iterable_is_data_wait() -> None:
    timer = StepTimer(warmup_steps=2)
    for _ in timer.wrap(batches(6, sleep_s=SLEEP_S)):
        pass
    summary = timer.summary()
    assert summary.steps == 4 and summary.images == 16
    assert summary.wait_share > 0.7
    assert summary.data_wait_s >= 4 * SLEEP_S * 0.9
    assert summary.loader_bound
    report = str(summary)
    assert "hint: the loader is the bottleneck" in report and "GPUDataset" in report


def test_steps_accumulate_over_epochs_and_slowest_are_listed() -> None:
    timer = StepTimer(slowest=2)
    for epoch in range(2):
        for step, _ in enumerate(timer.wrap(batches(3))):
            time.sleep(0.1 if (epoch, step) == (1, 1) else 0.0)
    summary = timer.summary()
    assert summary.steps == 5
    assert len(summary.slowest_steps) == 2
    assert summary.slowest_steps[0].step == 4, "step 1 of epoch 1 is step 4 overall, and the slowest"


def test_early_break_records_the_last_step() -> None:
    timer = StepTimer(warmup_steps=0)
    for step, _ in enumerate(timer.wrap(batches(10))):
        if step == 2:
            break
    assert timer.summary().steps == 3
    timer.reset()
    assert timer.summary().steps == 0
    assert "no steps measured" in timer.report()


def test_wraps_a_prefetcher_and_any_iterable() -> None:
    prefetcher = CUDAPrefetcher(list(batches(3)), (0.5,) * 3, (0.5,) * 3, device="cpu")
    timer = StepTimer(warmup_steps=0)
    for images, _ in timer.wrap(prefetcher):
        assert images.dtype == torch.float32
    timer_on_lists = StepTimer(warmup_steps=0)
    for _ in timer_on_lists.wrap([([1, 2], [0, 0]), ([3], [1])]):
        pass
    assert timer.summary().images == 12 and timer_on_lists.summary().images == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_time_counts_as_compute() -> None:
    timer = StepTimer()
    weight = torch.randn(2048, 2048, device="cuda")
    for _ in timer.wrap(batches(4)):
        for _ in range(50):
            weight = torch.tanh(weight @ weight)
    summary = timer.summary()
    assert summary.wait_share < 0.3, "asynchronous GPU work is attributed to the step that queued it"


AUGMENT_SLEEP_S = 0.1  # long beside a loaded machine's thread hand-over (a few ms a batch under 16 xdist workers)


class SlowAugment(BatchAugment):
    """A CPU augmentation that takes ``AUGMENT_SLEEP_S`` a batch (heavy crops on big images, say)."""

    def __call__(self, images, generator=None):  # type: ignore[no-untyped-def]
        time.sleep(AUGMENT_SLEEP_S)
        return super().__call__(images, generator)


def test_a_prefetchers_cpu_augmentation_is_preparation_not_loader_wait() -> None:
    """Without CUDA the prefetcher augments on the CPU, which the loop waits for: a fast loader must not be
    blamed."""
    prefetcher = CUDAPrefetcher(list(batches(6)), augment=SlowAugment((0.5,) * 3, (0.5,) * 3), device="cpu")
    timer = StepTimer()
    for _ in timer.wrap(prefetcher):
        pass
    summary = timer.summary()
    assert summary.steps == 5 and summary.preparing_s >= 4 * AUGMENT_SLEEP_S * 0.9
    assert summary.preparing_share > 0.7 and summary.wait_share < 0.3 and not summary.loader_bound
    report = summary.report()
    assert "hint: the loader is the bottleneck" not in report
    assert "hint: the loop waits for the prefetcher's own preparation of batches" in report and "CPU" in report
