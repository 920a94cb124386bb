"""GPUDataset over a small fake dataset of real PNG images (CPU always, CUDA when present)."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gpu_helpers import MEAN, STD, normalized, png_images

import reader.gpu.gpu_dataset as gpu_dataset
from reader.gpu.gpu_dataset import GPUDataset
from reader.gpu.prefetcher import CUDAPrefetcher

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class FakePackedDataset:
    """The interface GPUDataset uses: ``len``, ``manifest.shape``, ``read_batch``; counts the reads."""

    def __init__(self, images: torch.Tensor, shape: list[int] | None) -> None:
        self.images = images
        self.path = Path("/data/fake-packed")
        self.manifest = SimpleNamespace(shape=shape)
        self.reads: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.images)

    def read_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads.append(list(indices))
        batch = self.images[indices].contiguous(memory_format=torch.channels_last)
        return batch, torch.tensor(indices, dtype=torch.int64)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """Eleven 12x14 RGB PNGs read back as uint8 [11, 3, 12, 14]."""
    return torch.stack(png_images(tmp_path_factory.mktemp("png"), [(12, 14)] * 11, seed=1))


@pytest.mark.parametrize("device", DEVICES)
def test_loads_in_big_batches_and_matches_reference(images: torch.Tensor, device: str) -> None:
    dataset = FakePackedDataset(images, [3, 12, 14])
    resident = GPUDataset(dataset, device, batch_size=4, mean=MEAN, std=STD, shuffle=False, load_batch_size=5)
    assert dataset.reads == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10]]
    assert len(resident) == 3
    batches = list(resident)
    got = torch.cat([b for b, _ in batches]).cpu().double()
    labels = torch.cat([batch_labels for _, batch_labels in batches]).cpu()
    assert batches[0][0].device.type == device
    assert torch.equal(labels, torch.arange(11))
    torch.testing.assert_close(got, normalized(images), atol=1e-5, rtol=0)
    assert len(dataset.reads) == 3, "iterating reads nothing more from the dataset"


@pytest.mark.parametrize("device", DEVICES)
def test_every_sample_once_per_epoch_shuffled(images: torch.Tensor, device: str) -> None:
    resident = GPUDataset(FakePackedDataset(images, [3, 12, 14]), device, batch_size=3, mean=MEAN, std=STD)
    orders = []
    for _ in range(3):
        batches = list(resident)
        assert len(batches) == len(resident) == 4
        order = torch.cat([labels for _, labels in batches]).cpu()
        assert sorted(order.tolist()) == list(range(11))
        for batch, labels in batches:
            torch.testing.assert_close(batch.cpu().double(), normalized(images[labels.cpu()]), atol=1e-5, rtol=0)
        orders.append(order.tolist())
    assert orders[0] != orders[1] != orders[2], "a new permutation every epoch"


def test_drop_last(images: torch.Tensor) -> None:
    resident = GPUDataset(
        FakePackedDataset(images, [3, 12, 14]), "cpu", batch_size=3, mean=MEAN, std=STD, drop_last=True
    )
    batches = list(resident)
    assert len(resident) == len(batches) == 3
    assert all(len(labels) == 3 for _, labels in batches)


def test_seeded_reproducible_and_set_epoch(images: torch.Tensor) -> None:
    def epochs(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        resident = GPUDataset(
            FakePackedDataset(images, [3, 12, 14]), "cpu", batch_size=11, mean=MEAN, std=STD,
            seed=seed, random_resized_crop=8, flip=True, channels_last=True,
        )
        first = next(iter(resident))
        resident.set_epoch(0)
        replay = next(iter(resident))
        assert torch.equal(first[0], replay[0]) and torch.equal(first[1], replay[1])
        return [first, next(iter(resident))]

    run, again, other = epochs(0), epochs(0), epochs(1)
    assert run[0][0].shape == (11, 3, 8, 8) and run[0][0].is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(run, again))
    assert not torch.equal(run[0][0], run[1][0]), "epoch 1 draws anew"
    assert not torch.equal(run[0][1], other[0][1]), "the seed changes the order"


def test_refuses_variable_sizes(images: torch.Tensor) -> None:
    with pytest.raises(
        ValueError, match="fake-packed: records have different sizes, .* read them with make_loader and CUDAPrefetcher"
    ):
        GPUDataset(FakePackedDataset(images, None), "cpu", batch_size=4, mean=MEAN, std=STD)


def test_refuses_a_dataset_too_large_for_free_memory(images: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_dataset, "free_memory_bytes", lambda device: 1000)
    with pytest.raises(MemoryError, match=r"fake-packed: dataset needs 0\.00 GiB, cpu has 0\.00 GiB free"):
        GPUDataset(FakePackedDataset(images, [3, 12, 14]), "cpu", batch_size=4, mean=MEAN, std=STD)
    needed = 11 * (3 * 12 * 14 + 8)
    monkeypatch.setattr(gpu_dataset, "free_memory_bytes", lambda device: int(needed / gpu_dataset.MEMORY_FRACTION) + 1)
    assert len(GPUDataset(FakePackedDataset(images, [3, 12, 14]), "cpu", batch_size=4, mean=MEAN, std=STD)) == 3


def test_refuses_records_that_contradict_the_manifest(images: torch.Tensor) -> None:
    with pytest.raises(
        ValueError,
        match=r"records 0\.\.10 have shape \(3, 12, 14\), but the manifest \(or record 0\) says \(3, 16, 16\)",
    ):
        GPUDataset(FakePackedDataset(images, [3, 16, 16]), "cpu", batch_size=4, mean=MEAN, std=STD)


@pytest.mark.parametrize("device", DEVICES)
def test_end_to_end_on_a_packed_dataset(tmp_path: Path, device: str) -> None:
    from reader_helpers import chw, make_images, write_dataset

    from reader import PackedDataset

    sources = make_images(9, [(16, 20)])
    write_dataset(tmp_path, sources, [i % 3 for i in range(9)], storage="lmdb", encoding="raw", records_per_shard=4)
    resident = GPUDataset(PackedDataset(tmp_path), device, batch_size=4, mean=MEAN, std=STD, crop=(8, 8))
    seen = []
    for batch, labels in resident:
        assert batch.shape[1:] == (3, 8, 8) and batch.device.type == device
        seen += labels.tolist()
    assert sorted(seen) == sorted(i % 3 for i in range(9))
    unshuffled = GPUDataset(PackedDataset(tmp_path), device, batch_size=9, mean=MEAN, std=STD, shuffle=False)
    batch, labels = next(iter(unshuffled))
    expected = normalized(torch.from_numpy(np.stack([chw(image) for image in sources])))
    torch.testing.assert_close(batch.cpu().double(), expected, atol=1e-5, rtol=0)
    assert labels.tolist() == [i % 3 for i in range(9)]


def test_explicit_ranks_split_one_permutation(images: torch.Tensor) -> None:
    shares = [GPUDataset(FakePackedDataset(images, [3, 12, 14]), "cpu", batch_size=2, mean=MEAN, std=STD,
                         rank=rank, world_size=3, seed=4) for rank in range(3)]
    indices = [share.epoch_indices(2).tolist() for share in shares]
    assert [len(i) for i in indices] == [4, 4, 4] and [len(share) for share in shares] == [2, 2, 2]
    assert set(sum(indices, [])) == set(range(11)) and len(sum(indices, [])) == 12
    for share, expected in zip(shares, indices):
        share.set_epoch(2)
        assert torch.cat([labels for _, labels in share]).tolist() == expected
    with pytest.raises(ValueError, match="rank 3 is not in range for world_size 3"):
        GPUDataset(FakePackedDataset(images, [3, 12, 14]), "cpu", batch_size=2, mean=MEAN, std=STD,
                   rank=3, world_size=3)


def test_takes_one_augmentation_object(images: torch.Tensor) -> None:
    from reader.gpu.augment import BatchAugment

    augment = BatchAugment(MEAN, STD, crop=(6, 7))
    resident = GPUDataset(FakePackedDataset(images, [3, 12, 14]), "cpu", batch_size=4, augment=augment)
    assert resident.augment is augment and next(iter(resident))[0].shape == (4, 3, 6, 7)
    with pytest.raises(TypeError, match="either augment=BatchAugment"):
        GPUDataset(FakePackedDataset(images, [3, 12, 14]), "cpu", batch_size=4, mean=MEAN, std=STD, augment=augment)
    with pytest.raises(TypeError, match="give mean and std"):
        GPUDataset(FakePackedDataset(images, [3, 12, 14]), "cpu", batch_size=4, flip=True)


def test_torch_subset_and_concat_of_packed_datasets(tmp_path: Path) -> None:
    from reader_helpers import chw, make_images, write_dataset
    from torch.utils.data import ConcatDataset, Subset

    from reader import PackedDataset

    sources = make_images(9, [(16, 20)])
    write_dataset(tmp_path / "a", sources, [i % 3 for i in range(9)], storage="lmdb", encoding="raw",
                  records_per_shard=4)
    write_dataset(tmp_path / "b", sources[:4], [2, 1, 0, 2], storage="hdf5", encoding="raw", records_per_shard=4)
    first, second = PackedDataset(tmp_path / "a"), PackedDataset(tmp_path / "b")
    pixels = normalized(torch.from_numpy(np.stack([chw(image) for image in sources])))
    for dataset, rows, labels in [
        (Subset(first, [7, 2, 5]), [7, 2, 5], [1, 2, 2]),
        (ConcatDataset([first, second]), list(range(9)) + [0, 1, 2, 3], [i % 3 for i in range(9)] + [2, 1, 0, 2]),
    ]:
        resident = GPUDataset(dataset, "cpu", batch_size=len(rows), mean=MEAN, std=STD, shuffle=False,
                              load_batch_size=2)
        batch, got_labels = next(iter(resident))
        torch.testing.assert_close(batch.double(), pixels[rows], atol=1e-5, rtol=0)
        assert got_labels.tolist() == labels


def test_refuses_a_subset_of_variable_sizes(tmp_path: Path) -> None:
    from reader_helpers import make_images, write_dataset
    from torch.utils.data import Subset

    from reader import PackedDataset

    path = write_dataset(tmp_path, make_images(4, [(16, 20), (12, 12)]), [0, 1, 2, 0], storage="lmdb",
                         encoding="raw", records_per_shard=4)
    with pytest.raises(ValueError, match=r"Subset \(records 0\.\.2\): records have different sizes, .* CUDAPrefetcher"):
        GPUDataset(Subset(PackedDataset(path), [0, 1, 2]), "cpu", batch_size=2, mean=MEAN, std=STD)


def test_resume_after_k_batches_equals_the_uninterrupted_run(images: torch.Tensor) -> None:
    def resident() -> GPUDataset:
        return GPUDataset(FakePackedDataset(images, [3, 12, 14]), "cpu", batch_size=3, mean=MEAN, std=STD,
                          seed=6, random_resized_crop=8, flip=True)

    run = resident()
    epochs, saved = [], None
    for epoch in range(2):
        run.set_epoch(epoch)
        batches = []
        for batch in run:
            batches.append(batch)
            if epoch == 0 and len(batches) == 2:
                saved = run.state_dict()
        epochs.append(batches)
    assert saved == {"epoch": 0, "batches": 2, "seed": 6}
    assert run.state_dict() == {"epoch": 2, "batches": 0, "seed": 6}
    resumed = resident()
    resumed.load_state_dict(saved)
    for epoch, expected in ((0, epochs[0][2:]), (1, epochs[1])):
        resumed.set_epoch(epoch)
        got = list(resumed)
        assert len(got) == len(expected)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"batch_size": 2.5}, TypeError, "batch_size must be an int, got 2.5"),
        ({"batch_size": 0}, ValueError, "batch_size must be positive, got 0"),
        ({"load_batch_size": 0}, ValueError, "load_batch_size must be positive, got 0"),
        ({"seed": None}, TypeError, "seed must be an int, got None"),
        ({"seed": -1}, ValueError, "seed must be 0 or more, got -1"),
        ({"shuffle": "no"}, TypeError, "shuffle must be True or False, got 'no'"),
        ({"drop_last": "no"}, TypeError, "drop_last must be True or False, got 'no'"),
        ({"pad": "no"}, TypeError, "pad must be True or False, got 'no'"),
    ],
)
def test_bad_arguments_are_refused_naming_them(images: torch.Tensor, options: dict, error: type, message: str) -> None:
    """load_batch_size=0 failed in range(), a seed of None or -1 only at the first batch inside numpy, and
    batch_size=2.5 or shuffle="no" were taken: each is refused where it is given."""
    arguments = {"batch_size": 4, "mean": MEAN, "std": STD, **options}
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        GPUDataset(FakePackedDataset(images, [3, 12, 14]), "cpu", **arguments)


@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        (None, TypeError, "load_state_dict takes the dict state_dict() returned, got NoneType"),
        ({"epoch": 0}, ValueError, "saved state has no batches, seed (loading it needs epoch, batches, seed), "
         "got keys ['epoch']"),
        ({"epoch": "x", "batches": 0, "seed": 0}, TypeError, "saved epoch must be an int, got 'x'"),
        ({"epoch": 0, "batches": -3, "seed": 0}, ValueError, "saved batches must be 0 or more, got -3"),
        ({"epoch": 0, "batches": 1.5, "seed": 0}, TypeError, "saved batches must be an int, got 1.5"),
        ({"epoch": 0, "batches": 2, "seed": None}, TypeError, "saved seed must be an int, got None"),
    ],
)
def test_a_corrupted_state_is_refused_naming_the_entry(
    images: torch.Tensor, state: object, error: type, message: str
) -> None:
    resident = GPUDataset(FakePackedDataset(images, [3, 12, 14]), "cpu", batch_size=4, mean=MEAN, std=STD, seed=3)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        resident.load_state_dict(state)  # type: ignore[arg-type]
    assert resident.state_dict() == {"epoch": 0, "batches": 0, "seed": 3}
    with pytest.raises(TypeError, match=r"^epoch must be an int, got 'a'$"):
        resident.set_epoch("a")  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("make", ["prefetcher", "gpu_dataset"])
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_without_cuda_is_one_clear_line(images: torch.Tensor, make: str, device: object) -> None:
    message = (rf"^device '{device}': torch sees 0 CUDA devices \(torch .+\); pass device=None \(CUDA when "
               r"present, else CPU\) or 'cpu', or install a CUDA build of torch$")
    with pytest.raises(RuntimeError, match=message):
        if make == "prefetcher":
            CUDAPrefetcher([], device=device)
        else:
            GPUDataset(FakePackedDataset(images, [3, 12, 14]), device, batch_size=4)
