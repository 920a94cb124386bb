"""Exact resume through CUDAPrefetcher over a real make_loader (workers 0 and 2, fixed and variable
sizes): a state saved after k consumed batches (or between epochs) resumes with batch k+1, pixels,
labels and augmentation draws identical to an uninterrupted run; draws differ across ranks."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from gpu_helpers import MEAN, STD, batch_of
from reader_helpers import make_images, pack_images

from reader import CUDAPrefetcher, PackedDataset, make_loader

SAVE_AFTER = 3  # batches of epoch 1 consumed before the checkpoint


@pytest.fixture(scope="module")
def variable_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """23 raw records of four different sizes (no crop), labels i % 3."""
    images = make_images(23, [(16, 20), (12, 18), (20, 14), (15, 15)])
    return pack_images(tmp_path_factory.mktemp("variable") / "packed", images, [i % 3 for i in range(23)],
                       storage="lmdb", encoding="raw", records_per_shard=8).path


def training_prefetcher(path: Path, workers: int) -> CUDAPrefetcher:
    loader = make_loader(PackedDataset(path), batch_size=5, num_workers=workers, seed=3)
    return CUDAPrefetcher(loader, MEAN, STD, random_resized_crop=(8, 6), flip=True, seed=3)


def assert_same_batches(got: list[tuple], expected: list[tuple]) -> None:
    assert len(got) == len(expected)
    for (images, labels), (want_images, want_labels) in zip(got, expected):
        assert torch.equal(labels, want_labels)
        assert torch.equal(images, want_images), "pixels and augmentation draws repeat exactly"


@pytest.mark.parametrize("data, workers", [("fixed", 0), ("fixed", 2), ("variable", 0)])
def test_resume_after_k_batches_equals_the_uninterrupted_run(
    raw_path: Path, variable_path: Path, data: str, workers: int
) -> None:
    path = raw_path if data == "fixed" else variable_path
    run = training_prefetcher(path, workers)
    epochs, saved = [], None
    for epoch in range(3):
        run.set_epoch(epoch)
        batches = []
        for batch in run:
            batches.append(batch)
            if epoch == 1 and len(batches) == SAVE_AFTER:
                saved = copy.deepcopy(run.state_dict())
        epochs.append(batches)
        if epoch == 0:
            between_epochs = copy.deepcopy(run.state_dict())
    assert saved["epoch"] == 1 and saved["batches"] == SAVE_AFTER
    assert between_epochs["epoch"] == 1 and between_epochs["batches"] == 0

    from_epoch_end = training_prefetcher(path, workers)
    from_epoch_end.load_state_dict(between_epochs)
    from_epoch_end.set_epoch(1)
    assert_same_batches(list(from_epoch_end), epochs[1])

    resumed = training_prefetcher(path, workers)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved
    assert len(resumed) == len(epochs[1]), "len() stays the whole epoch's; the loop counts from saved['batches']"
    for epoch in (1, 2):
        resumed.set_epoch(epoch)
        got = list(resumed)
        assert_same_batches(got, epochs[epoch][SAVE_AFTER:] if epoch == 1 else epochs[epoch])


def test_state_after_a_break_is_the_position_of_the_consumer(raw_path: Path) -> None:
    run = training_prefetcher(raw_path, 0)
    for count, _ in enumerate(run, 1):
        if count == SAVE_AFTER:
            during = copy.deepcopy(run.state_dict())
            break
    assert run.state_dict() == during, "closing the iteration drops the batch in flight, not the position"
    resumed = training_prefetcher(raw_path, 0)
    resumed.load_state_dict(during)
    resumed.set_epoch(0)
    first_after = next(iter(resumed))
    uninterrupted = list(training_prefetcher(raw_path, 0))
    assert_same_batches([first_after], [uninterrupted[SAVE_AFTER]])


def test_ranks_draw_differently_and_each_repeats(raw_path: Path) -> None:
    batch = batch_of(PackedDataset(raw_path), range(8))

    def first_batch(rank: int) -> torch.Tensor:
        return next(iter(CUDAPrefetcher([batch], MEAN, STD, random_resized_crop=8, flip=True, rank=rank)))[0]

    assert torch.equal(first_batch(0), first_batch(0)) and torch.equal(first_batch(1), first_batch(1))
    assert not torch.equal(first_batch(0), first_batch(1)), "the default seed gives each rank its own draws"


def test_state_needs_a_loader_that_has_one(raw_path: Path) -> None:
    prefetcher = CUDAPrefetcher([batch_of(PackedDataset(raw_path), [0, 1])], MEAN, STD)
    list(prefetcher)
    with pytest.raises(TypeError, match=r"list has no state_dict\(\): CUDAPrefetcher saves its position only"):
        prefetcher.state_dict()
    with pytest.raises(TypeError, match=r"list has no load_state_dict\(\)"):
        prefetcher.load_state_dict({})
