"""What a spawned worker receives is O(1) in records and shards, and a received dataset reads the same."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import ConcatDataset, Subset

import packer
from reader import PackedDataset, make_loader, split
from reader.format import FormatError

REPO = Path(__file__).resolve().parents[2]


def tiny_dataset(path: Path, count: int, partition: int | None = None) -> Path:
    """``count`` 4x4 records (one shard, or ``partition`` records a shard), record ``k`` filled with
    ``k % 256``, label ``k % 3``."""
    items = ({"image": np.full((4, 4, 3), k % 256, np.uint8), "label": k % 3} for k in range(count))
    packer.pack_items(items, path, classes=["a", "b", "c"], workers=1, progress=False,
                      partition_size=partition or count)
    return path


def worker_payload(dataset: object) -> int:
    """Bytes of ``dataset`` as a spawned DataLoader worker receives it (multiprocessing's pickler, with
    torch's reductions: a shared-memory tensor goes as a handle)."""
    return len(ForkingPickler.dumps(dataset))


def test_the_pickled_dataset_does_not_grow_with_its_records_or_shards(tmp_path: Path) -> None:
    small, large = tiny_dataset(tmp_path / "small", 10), tiny_dataset(tmp_path / "large", 3000, 75)
    sizes = {}
    for path in (small, large):
        dataset = PackedDataset(path)
        dataset[len(dataset) - 1]  # its table read and its columns filled in this process
        sizes[path] = [worker_payload(make_loader(source, 4, num_workers=0).dataset)
                       for source in (dataset, split(dataset, 0.5, seed=1)[0], ConcatDataset([dataset, dataset]))]
        sizes[path].append(len(pickle.dumps(dataset)))
    assert len(PackedDataset(large).manifest.shards) == 40
    assert all(abs(a - b) < 64 for a, b in zip(sizes[large], sizes[small])), sizes


def test_a_dataset_changed_before_the_worker_started_is_refused(tmp_path: Path) -> None:
    path = tiny_dataset(tmp_path / "d", 50)
    payload = pickle.dumps(PackedDataset(path))
    shard = next(path.glob("*.lmdb"))
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a rewrite in place keeps the inode
    received = pickle.loads(payload)  # a worker's copy: refuses its first read, which the loader reports
    with pytest.raises(FormatError, match=f"^{path}: a shard file was replaced or changed after the loader's process"):
        received.read_batch([0])


def test_a_dataset_whose_shard_went_away_is_refused_at_the_first_read(tmp_path: Path) -> None:
    path = tiny_dataset(tmp_path / "d", 50, 10)
    payload = pickle.dumps(PackedDataset(path))
    shard = sorted(path.glob("*.lmdb"))[2]
    shard.unlink()
    received = pickle.loads(payload)
    with pytest.raises(FormatError, match=f"^{shard}: "):
        received.read_batch([0])


class Tagged(PackedDataset):
    """A subclass with an attribute of its own, which a worker's copy must keep."""

    def __init__(self, path: Path, tag: str) -> None:
        super().__init__(path)
        self.tag = tag


def test_a_subclass_keeps_its_own_attributes(tmp_path: Path) -> None:
    received = pickle.loads(pickle.dumps(Tagged(tiny_dataset(tmp_path / "d", 5), "mine")))
    assert received.tag == "mine" and received.read_batch([4])[1].tolist() == [1]


def test_a_received_dataset_reads_its_tables_again(tmp_path: Path) -> None:
    dataset = PackedDataset(tiny_dataset(tmp_path / "d", 50))
    assert dataset.targets.tolist() == [k % 3 for k in range(50)]
    received = pickle.loads(pickle.dumps(dataset))
    images, labels = received.read_batch([49, 3, 17])
    assert labels.tolist() == [1, 0, 2]
    assert [int(image[0, 0, 0]) for image in images] == [49, 3, 17]


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@pytest.mark.parametrize("shape", ["whole", "subset", "concat"])
def test_spawned_workers_read_every_record(tmp_path: Path, context: str, shape: str) -> None:
    """Workers that receive the dataset by pickle read their shards' tables themselves, and a view's
    positions through the shared position table."""
    dataset = PackedDataset(tiny_dataset(tmp_path / "d", 40, 7))
    source, expected = {
        "whole": (dataset, list(range(40))),
        "subset": (Subset(dataset, [39, 0, 5, 17, 17, 8]), [39, 0, 5, 17, 17, 8]),
        "concat": (ConcatDataset([Subset(dataset, [3, 2]), dataset]), [3, 2, *range(40)]),
    }[shape]
    loader = make_loader(source, 4, num_workers=2, order="sequential", multiprocessing_context=context,
                         pin_memory=False)
    loader.timeout = 120  # a worker that never answers fails the test
    seen = [(int(image[0, 0, 0]), int(label)) for images, labels in loader for image, label in zip(images, labels)]
    assert seen == [(k, k % 3) for k in expected]


def test_a_script_without_the_main_guard_gets_pythons_message_not_a_hang(tmp_path: Path) -> None:
    """Under spawn, a script that makes a loader at module level makes each worker run it again, which
    Python refuses with its bootstrapping message. 400 shards: the dataset's payload used to be about
    76 KB, over the 64 KiB pipe that CPython's spawn writes it to, so the parent hung forever."""
    path = tiny_dataset(tmp_path / "d", 400, 1)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        from reader import PackedDataset, make_loader
        loader = make_loader(PackedDataset({str(path)!r}), 8, num_workers=2, multiprocessing_context="spawn",
                             pin_memory=False)
        for batch in loader:
            pass
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 1, run.stderr[-2000:]
    assert "finished its bootstrapping phase" in run.stderr and "if __name__ == '__main__':" in run.stderr
    # The parent's own last word; the resource tracker may warn about the failed workers' semaphores
    # after it (its own process, writing to the same stderr at the parent's exit).
    parents = [line for line in run.stderr.splitlines() if "resource_tracker" not in line]
    assert "DataLoader worker" in parents[-1], run.stderr[-2000:]
