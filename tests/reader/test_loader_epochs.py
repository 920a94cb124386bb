"""make_loader across epochs: the per-epoch orders, break, set_epoch jumps, resume, and the workers'
prefetch running into the next epoch before the current one ends."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import pytest
import torch
from reader_helpers import SMALL_RAW_COUNT as COUNT

from reader import PackedDataset, batch_memory, make_loader
from reader.loader import PackedLoader
from reader.torch_hooks import receiving_iterator_class

BATCH = 4


class IndexLabelled(PackedDataset):
    """A ``PackedDataset`` whose batches are labelled with their record indices, so a batch says which
    records it holds; with ``log``, every batch read appends its indices as one line to that file (the
    workers' reads become visible to the test process)."""

    def __init__(self, path: Path, log: Path | None = None) -> None:
        super().__init__(path)
        self.log = log

    def read_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(",".join(map(str, indices)) + "\n")
        images, _ = super().read_batch(indices)
        return images, torch.tensor(indices, dtype=torch.int64)


def requested(log: Path) -> list[list[int]]:
    """Every batch the dataset was asked for so far, in the order of the requests."""
    if not log.exists():
        return []
    return [[int(i) for i in line.split(",")] for line in log.read_text().splitlines()]


def epoch_batches(loader: PackedLoader, epoch: int, start: int = 0) -> list[list[int]]:
    """The batches ``loader`` must yield for ``epoch`` from ``start``: the sampler's order, cut."""
    order = loader.shard_sampler.rank_order(epoch)[start:].tolist()
    stream = loader.batch_sampler
    return [order[i:i + BATCH] for i in range(0, stream.batches_in(len(order)) * BATCH, BATCH)]


def pass_indices(loader: PackedLoader, stop_after: int | None = None) -> list[list[int]]:
    """The record indices of each batch of one ``for`` loop, optionally cut short by a ``break``."""
    batches = []
    for _, labels in loader:
        batches.append(labels.tolist())
        if len(batches) == stop_after:
            break
    return batches


def loader_for(ds: IndexLabelled, num_workers: int, **options: object) -> PackedLoader:
    if num_workers:
        options["multiprocessing_context"] = "fork"
    return make_loader(ds, BATCH, num_workers=num_workers, order="random", seed=5, **options)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("options", [{}, {"drop_last": True, "rank": 1, "world_size": 2}])
def test_set_epoch_idiom_yields_each_epochs_order(raw_path, num_workers, options):
    ds = IndexLabelled(raw_path)
    loader = loader_for(ds, num_workers, **options)
    for epoch in range(4):
        loader.set_epoch(epoch)
        assert pass_indices(loader) == epoch_batches(loader, epoch)
        assert len(loader) == len(epoch_batches(loader, epoch))
    assert epoch_batches(loader, 0) != epoch_batches(loader, 1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_without_set_epoch_every_loop_repeats_the_epoch(raw_path, num_workers):
    ds = IndexLabelled(raw_path)
    loader = loader_for(ds, num_workers)
    for _ in range(3):
        assert pass_indices(loader) == epoch_batches(loader, 0)
    loader.set_epoch(1)
    assert pass_indices(loader) == epoch_batches(loader, 1)


def test_images_match_records_across_epochs(raw_path):
    ds = PackedDataset(raw_path)
    loader = make_loader(ds, BATCH, num_workers=2, order="random", seed=1,
                         multiprocessing_context="fork")
    for epoch in range(2):
        loader.set_epoch(epoch)
        rows = torch.cat([images for images, _ in loader])
        order = loader.shard_sampler.rank_order().tolist()
        assert len(rows) == len(order) == COUNT
        for row, i in zip(rows, order):
            assert torch.equal(row, ds[i][0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_break_then_new_loop_starts_the_epoch_over(raw_path, num_workers):
    ds = IndexLabelled(raw_path)
    loader = loader_for(ds, num_workers)
    for epoch in range(3):
        loader.set_epoch(epoch)
        assert pass_indices(loader, stop_after=len(loader) - 1) == epoch_batches(loader, epoch)[:-1]
        assert pass_indices(loader, stop_after=2) == epoch_batches(loader, epoch)[:2]
        assert pass_indices(loader) == epoch_batches(loader, epoch)
    if num_workers:
        assert len(loader._releaser._trailers) <= num_workers * batch_memory.MAX_SLOTS


@pytest.mark.parametrize("num_workers", [0, 2])
def test_unexpected_epoch_or_state_restarts_the_stream(raw_path, num_workers):
    ds = IndexLabelled(raw_path)
    loader = loader_for(ds, num_workers)
    assert pass_indices(loader) == epoch_batches(loader, 0)
    loader.set_epoch(5)
    assert pass_indices(loader) == epoch_batches(loader, 5)
    loader.set_epoch(2)
    assert pass_indices(loader) == epoch_batches(loader, 2)

    loader.load_state_dict({"epoch": 3, "seed": 11, "order": "random", "start": 0})
    assert loader.shard_sampler.seed == 11
    assert pass_indices(loader) == epoch_batches(loader, 3)
    loader.load_state_dict({"epoch": 4, "seed": 11, "order": "random", "start": 2 * BATCH})
    assert pass_indices(loader) == epoch_batches(loader, 4, start=2 * BATCH)
    loader.set_epoch(5)
    assert pass_indices(loader) == epoch_batches(loader, 5)


def test_resume_then_following_epochs_with_workers(raw_path):
    ds = IndexLabelled(raw_path)
    first = loader_for(ds, 2)
    first.set_epoch(1)
    batches = iter(first)
    seen = [next(batches)[1].tolist() for _ in range(3)]
    state = first.state_dict()
    del batches

    resumed = loader_for(ds, 2)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert seen + pass_indices(resumed) == epoch_batches(resumed, 1)
    for epoch in (2, 3):
        resumed.set_epoch(epoch)
        assert pass_indices(resumed) == epoch_batches(resumed, epoch)


def wait_for(log: Path, batch: list[int], timeout_s: float = 60.0) -> bool:
    """Whether ``batch`` shows up among the dataset's requests before ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if batch in requested(log):
            return True
        time.sleep(0.01)
    return False


def test_workers_read_the_next_epoch_before_this_one_ends(raw_path, tmp_path):
    log = tmp_path / "requests.txt"
    loader = loader_for(IndexLabelled(raw_path, log), 1)
    next_first = epoch_batches(loader, 1)[0]
    loader.set_epoch(0)
    for k, (_, labels) in enumerate(loader):
        if k == len(loader) - 1:
            assert wait_for(log, next_first), "the next epoch's first batch was never requested"
    loader.set_epoch(1)
    assert pass_indices(loader) == epoch_batches(loader, 1)
    assert requested(log).count(next_first) == 1


def test_loops_without_set_epoch_reuse_the_stream(raw_path, monkeypatch):
    """After one loop shows that the epoch repeats, later loops continue the workers' stream."""
    resets = []
    iterator_class = receiving_iterator_class()
    original = iterator_class._reset

    def counting_reset(self, loader, first_iter=False):
        resets.append(first_iter)
        original(self, loader, first_iter)

    monkeypatch.setattr(iterator_class, "_reset", counting_reset)
    loader = loader_for(IndexLabelled(raw_path), 2)
    for _ in range(4):
        assert pass_indices(loader) == epoch_batches(loader, 0)
    assert resets == [True, False]
    for epoch in range(1, 4):
        loader.set_epoch(epoch)
        assert pass_indices(loader) == epoch_batches(loader, epoch)
    assert resets == [True, False, False]


def test_empty_epochs_yield_nothing(raw_path):
    ds = IndexLabelled(raw_path)
    loader = make_loader(ds, COUNT + 1, num_workers=2, drop_last=True, multiprocessing_context="fork")
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert len(loader) == 0 and pass_indices(loader) == []
