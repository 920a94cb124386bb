"""Opening a dataset whose shards this process already maps (issue 21 item 3).

A reader keeps its own mapping of the shards it read, and a merged dataset's shards are hard links
of its inputs', so ``/proc/self/maps`` can list the same inode several times. Opening checks every
LMDB value against the mapping that holds it; the check once took the file's first mapping, which
depends on where the kernel put each map, and reported a valid shard as damaged. Each loop below
changes the memory layout (anonymous maps of 1-256 MiB held and dropped at random) between opens.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
from reader_helpers import make_images, pack_images

import packer
from reader import GPUDataset, PackedDataset

COUNT = 40
ROUNDS = 15


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("reopen")
    images = make_images(2 * COUNT, [(64, 64)])
    labels = [i % 3 for i in range(2 * COUNT)]
    a = pack_images(root / "a", images[:COUNT], labels[:COUNT], storage="lmdb", encoding="raw", records_per_shard=10)
    b = pack_images(root / "b", images[COUNT:], labels[COUNT:], storage="lmdb", encoding="raw", records_per_shard=10)
    return a.path, b.path


class Layouts:
    """Anonymous maps held and dropped at random: each ``shuffle()`` leaves other holes."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.held: list[mmap.mmap] = []

    def shuffle(self) -> None:
        for _ in range(3):
            if self.held and self.rng.random() < 0.5:
                self.held.pop(int(self.rng.integers(len(self.held)))).close()
            else:
                self.held.append(mmap.mmap(-1, int(self.rng.integers(1, 257)) << 20))

    def close(self) -> None:
        for held in self.held:
            held.close()


def _read_all(ds: PackedDataset) -> np.ndarray:
    batch, _ = ds.read_batch(list(range(len(ds))))
    return batch.numpy().copy()


def test_the_same_dataset_opens_again_after_reads_in_any_layout(two_datasets: tuple[Path, Path]) -> None:
    a, _ = two_datasets
    layouts, readers = Layouts(), []
    expected = _read_all(PackedDataset(a))
    try:
        for _ in range(ROUNDS):
            layouts.shuffle()
            ds = PackedDataset(a)
            np.testing.assert_array_equal(_read_all(ds), expected)
            readers = [*readers[-2:], ds]  # earlier readers keep their mappings
            layouts.shuffle()
            np.testing.assert_array_equal(_read_all(PackedDataset(a)), expected)
    finally:
        layouts.close()


def test_a_merged_dataset_of_hard_links_opens_beside_its_inputs(
    tmp_path: Path, two_datasets: tuple[Path, Path]
) -> None:
    a, b = two_datasets
    out = tmp_path / "merged"
    report = packer.join_datasets(out, [a, b])
    assert report.linked == len(list(out.glob("*.lmdb"))) and report.copied == 0
    expected = np.concatenate([_read_all(PackedDataset(a)), _read_all(PackedDataset(b))])
    layouts, readers = Layouts(), []
    try:
        for _ in range(ROUNDS):
            layouts.shuffle()
            readers = [*readers[-2:], PackedDataset(a), PackedDataset(b)]
            for ds in readers[-2:]:
                _read_all(ds)
            layouts.shuffle()
            merged = PackedDataset(out)
            np.testing.assert_array_equal(_read_all(merged), expected)
            readers.append(merged)
    finally:
        layouts.close()


def test_a_gpu_dataset_then_a_reopen(two_datasets: tuple[Path, Path]) -> None:
    a, _ = two_datasets
    expected = _read_all(PackedDataset(a))
    layouts = Layouts()
    try:
        for _ in range(ROUNDS):
            layouts.shuffle()
            resident = GPUDataset(PackedDataset(a), "cpu", batch_size=8, mean=(0.5,) * 3, std=(0.25,) * 3)
            assert resident.labels.tolist() == PackedDataset(a).targets.tolist()
            layouts.shuffle()
            np.testing.assert_array_equal(_read_all(PackedDataset(a)), expected)
    finally:
        layouts.close()
