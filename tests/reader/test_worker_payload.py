"""What a spawned worker receives is O(shards), not O(records), and a received dataset reads the same."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import packer
from reader import PackedDataset, make_loader


def tiny_dataset(path: Path, count: int) -> Path:
    """``count`` 4x4 records in one shard, record ``k`` filled with ``k % 256``, label ``k % 3``."""
    items = ({"image": np.full((4, 4, 3), k % 256, np.uint8), "label": k % 3} for k in range(count))
    packer.pack_items(items, path, classes=["a", "b", "c"], workers=1, progress=False, partition_size=count)
    return path


def test_the_pickled_dataset_does_not_grow_with_its_records(tmp_path: Path) -> None:
    small, large = tiny_dataset(tmp_path / "small", 10), tiny_dataset(tmp_path / "large", 3000)
    sizes = {}
    for path in (small, large):
        dataset = PackedDataset(path)
        dataset[len(dataset) - 1]  # its table read and its columns filled in this process
        view = make_loader(dataset, 4, num_workers=0).dataset
        sizes[path] = (len(pickle.dumps(dataset)), len(pickle.dumps(view)))
    assert abs(sizes[large][0] - sizes[small][0]) < 64 and abs(sizes[large][1] - sizes[small][1]) < 64, sizes


def test_a_received_dataset_reads_its_tables_again(tmp_path: Path) -> None:
    dataset = PackedDataset(tiny_dataset(tmp_path / "d", 50))
    assert dataset.targets.tolist() == [k % 3 for k in range(50)]
    received = pickle.loads(pickle.dumps(dataset))
    images, labels = received.read_batch([49, 3, 17])
    assert labels.tolist() == [1, 0, 2]
    assert [int(image[0, 0, 0]) for image in images] == [49, 3, 17]


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_workers_read_every_record(tmp_path: Path, context: str) -> None:
    """Workers that receive the dataset by pickle read their shards' tables themselves."""
    dataset = PackedDataset(tiny_dataset(tmp_path / "d", 40))
    loader = make_loader(dataset, 8, num_workers=2, order="sequential", multiprocessing_context=context,
                         pin_memory=False)
    loader.timeout = 120  # a worker that never answers fails the test
    seen = [(int(image[0, 0, 0]), int(label)) for images, labels in loader for image, label in zip(images, labels)]
    assert seen == [(k, k % 3) for k in range(40)]
