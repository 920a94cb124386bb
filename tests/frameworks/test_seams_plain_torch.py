"""PackedDataset at torch's seams: a plain DataLoader (default collate, workers, fork and spawn), Subset,
ConcatDataset and a user's wrapper; make_loader over Subset and ConcatDataset, keeping the block order;
reader.split; the loader's batch_sampler walked directly."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from reader_helpers import Packed, chw, make_images, pack_images
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

import reader
from reader import PackedDataset, make_loader
from reader.packed_view import PackedView

COUNT = 23


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Packed:
    """23 raw 12x16 records in LMDB shards of 5, labels ``i % 3`` (stored class by class)."""
    return pack_images(tmp_path_factory.mktemp("raw") / "packed", make_images(COUNT, [(12, 16)]),
                       [i % 3 for i in range(COUNT)], storage="lmdb", encoding="raw", records_per_shard=5)


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Packed:
    """A second raw dataset of the same image size (other pixels), in HDF5: 9 records."""
    return pack_images(tmp_path_factory.mktemp("other") / "packed", make_images(9, [(12, 16)], seed=7),
                       [i % 2 for i in range(9)], storage="hdf5", encoding="raw", records_per_shard=4)


@pytest.fixture(scope="module")
def jpeg(tmp_path_factory: pytest.TempPathFactory) -> Packed:
    return pack_images(tmp_path_factory.mktemp("jpeg") / "packed", make_images(11, [(12, 16)], seed=3),
                       [i % 2 for i in range(11)], storage="hdf5", encoding="jpeg", records_per_shard=4)


class Wrapped(Dataset):
    """A user's own wrapper: flips every image left-right and adds 10 to the label."""

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.inner[index]
        return image.flip(-1), label + 10


def plain_epoch(dataset: Dataset, **options: object) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One epoch of a plain DataLoader (default collate) in a shuffled order, and that order."""
    order = np.random.default_rng(len(dataset)).permutation(len(dataset)).tolist()
    images, labels = zip(*DataLoader(dataset, batch_size=4, sampler=order, **options))
    return torch.cat(images), torch.cat(labels), order


@pytest.mark.parametrize("options", [{"num_workers": 0},
                                     {"num_workers": 2, "multiprocessing_context": "fork"},
                                     {"num_workers": 2, "multiprocessing_context": "spawn"}],
                         ids=["in-process", "fork", "spawn"])
def test_plain_dataloader_default_collate(raw, options):
    images, labels, order = plain_epoch(PackedDataset(raw.path), **options)
    assert images.shape == (COUNT, 3, 12, 16) and images.dtype == torch.uint8
    expected = np.stack([chw(raw.images[i]) for i in order])
    assert np.array_equal(images.numpy(), expected)
    assert labels.tolist() == [raw.labels[i] for i in order]


def test_plain_dataloader_jpeg_matches_items(jpeg):
    ds = PackedDataset(jpeg.path)
    images, labels, order = plain_epoch(ds, num_workers=2, multiprocessing_context="fork")
    assert torch.equal(images, torch.stack([ds[i][0] for i in order]))
    assert labels.tolist() == [jpeg.labels[i] for i in order]
    decoded = images[order.index(0)].permute(1, 2, 0).numpy().astype(int)
    assert np.abs(decoded - jpeg.images[0]).mean() < 5, "the JPEG decodes close to its source (q95, 4:2:0)"


def test_getitems_gives_samples_in_private_memory(raw):
    samples = PackedDataset(raw.path).__getitems__([4, 0, 4])
    assert [label for _, label in samples] == [raw.labels[4], raw.labels[0], raw.labels[4]]
    for (image, _), i in zip(samples, [4, 0, 4]):
        assert image.is_contiguous() and np.array_equal(image.numpy(), chw(raw.images[i]))
        assert not image.untyped_storage().is_shared()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_plain_dataloader_over_subset_concat_and_wrapper(raw, other, num_workers):
    options = {"num_workers": num_workers, "multiprocessing_context": "fork" if num_workers else None}
    subset = Subset(PackedDataset(raw.path), [20, 3, 7, 0, 11, 12])
    images, labels, order = plain_epoch(subset, **options)
    records = [subset.indices[k] for k in order]
    assert np.array_equal(images.numpy(), np.stack([chw(raw.images[i]) for i in records]))
    assert labels.tolist() == [raw.labels[i] for i in records]

    concat = ConcatDataset([PackedDataset(raw.path), PackedDataset(other.path)])
    sources = [(raw, i) for i in range(COUNT)] + [(other, i) for i in range(9)]
    images, labels, order = plain_epoch(concat, **options)
    assert np.array_equal(images.numpy(), np.stack([chw(sources[k][0].images[sources[k][1]]) for k in order]))
    assert labels.tolist() == [sources[k][0].labels[sources[k][1]] for k in order]

    images, labels, order = plain_epoch(Wrapped(PackedDataset(raw.path)), **options)
    assert np.array_equal(images.numpy(), np.stack([chw(raw.images[i])[:, :, ::-1] for i in order]))
    assert labels.tolist() == [raw.labels[i] + 10 for i in order]


def loader_positions_and_images(loader) -> tuple[list[int], torch.Tensor, list[int]]:
    images, labels = zip(*loader)
    return loader.shard_sampler.rank_order().tolist(), torch.cat(images), torch.cat(labels).tolist()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_make_loader_over_a_subset(raw, num_workers):
    ds = PackedDataset(raw.path)
    subset = Subset(ds, [k for k in range(COUNT) if k % 4 != 1])
    loader = make_loader(subset, 4, num_workers=num_workers, seed=2,
                         multiprocessing_context="fork" if num_workers else None)
    positions, images, labels = loader_positions_and_images(loader)
    assert sorted(positions) == list(range(len(subset)))
    records = [subset.indices[p] for p in positions]
    assert np.array_equal(images.numpy(), np.stack([chw(raw.images[i]) for i in records]))
    assert labels == [raw.labels[i] for i in records]
    assert loader.source is subset


@pytest.mark.parametrize("num_workers", [0, 2])
def test_make_loader_over_a_concatenation(raw, other, jpeg, num_workers):
    parts = [PackedDataset(raw.path), PackedDataset(other.path)]
    concat = ConcatDataset([parts[0], Subset(parts[1], [8, 1, 5])])
    loader = make_loader(concat, 5, num_workers=num_workers, order="random", seed=1,
                         multiprocessing_context="fork" if num_workers else None)
    positions, images, labels = loader_positions_and_images(loader)
    assert sorted(positions) == list(range(COUNT + 3))
    assert torch.equal(images, torch.stack([concat[p][0] for p in positions]))
    assert labels == [concat[p][1] for p in positions]

    for mixed in (ConcatDataset([PackedDataset(jpeg.path), parts[1]]),  # channels-last JPEG + raw
                  ConcatDataset([PackedDataset(jpeg.path), PackedDataset(jpeg.path)])):
        loader = make_loader(mixed, 6, num_workers=0, order="random", seed=3)
        positions, images, labels = loader_positions_and_images(loader)
        assert torch.equal(images, torch.stack([mixed[p][0] for p in positions]))
        assert labels == [mixed[p][1] for p in positions]


def test_make_loader_over_a_concatenation_of_variable_size_datasets(tmp_path):
    """Mixed batches of variable-size records cross the worker boundary in one batch slot: the batches
    kept until the end of the epoch still hold their own pixels."""
    sizes = [(12, 16), (10, 14), (9, 9)]
    parts = [PackedDataset(pack_images(tmp_path / name, make_images(9, sizes, seed=seed), [0] * 9,
                                       storage="lmdb", encoding=encoding, records_per_shard=4).path)
             for name, seed, encoding in (("raw", 1, "raw"), ("jpeg", 2, "jpeg"))]
    concat = ConcatDataset(parts)
    loader = make_loader(concat, 4, num_workers=2, order="random", multiprocessing_context="fork")
    batches = [images for images, _ in loader]
    positions = loader.shard_sampler.rank_order().tolist()
    images = [image for batch in batches for image in batch]
    assert all(isinstance(batch, list) for batch in batches)
    assert [tuple(image.shape) for image in images] == [tuple(concat[p][0].shape) for p in positions]
    assert all(torch.equal(image, concat[p][0]) for image, p in zip(images, positions))


def test_subset_and_concatenation_keep_the_block_order(raw, other):
    """With one block per window, the quasi-random order reads each block of the files in one run."""
    ds = PackedDataset(raw.path, block_bytes=1 << 30)  # blocks of at least 1 MiB: here one per shard
    subset = Subset(ds, list(range(0, COUNT, 2)) + list(range(1, COUNT, 2)))
    concat = ConcatDataset([subset, PackedDataset(other.path, block_bytes=1 << 30)])
    view = PackedView(concat)
    blocks = view.block_ids()
    assert len(np.unique(blocks)) == 5 + 3  # shards of the two datasets
    loader = make_loader(concat, 4, num_workers=0, seed=6, buffer_blocks=1)
    for epoch in range(3):
        loader.set_epoch(epoch)
        runs = blocks[loader.shard_sampler.rank_order()]
        changes = np.flatnonzero(np.diff(runs)) + 1
        run_blocks = runs[np.concatenate([[0], changes])]
        assert len(run_blocks) == len(set(run_blocks.tolist())) == 8, "each block is read in one run"
        assert sorted(loader.shard_sampler.rank_order().tolist()) == list(range(len(concat)))


def test_make_loader_refuses_other_datasets(raw):
    with pytest.raises(TypeError, match="make_loader, ShardSampler and split take a PackedDataset, a Subset or a "
                                        "ConcatDataset of them, not Wrapped; give this dataset to a plain torch "
                                        "DataLoader"):
        make_loader(Wrapped(PackedDataset(raw.path)), 4)
    with pytest.raises(IndexError, match=f"Subset index 23 is out of range for 23 records of {raw.path}"):
        make_loader(Subset(PackedDataset(raw.path), [0, 23]), 4)


def test_split_is_stratified_deterministic_disjoint_and_complete(tmp_path):
    labels = [0] * 30 + [1] * 20 + [2] * 7
    packed = pack_images(tmp_path / "packed", make_images(len(labels), [(8, 8)]), labels,
                         storage="lmdb", encoding="raw", records_per_shard=10)
    ds = PackedDataset(packed.path)
    train, val = reader.split(ds, val_fraction=0.2, seed=0)
    assert sorted(np.concatenate([train.indices, val.indices]).tolist()) == list(range(len(ds)))
    assert not set(train.indices.tolist()) & set(val.indices.tolist())
    assert np.bincount(ds.targets[val.indices]).tolist() == [6, 4, 1]
    assert np.bincount(ds.targets[train.indices]).tolist() == [24, 16, 6]
    again_train, again_val = reader.split(PackedDataset(packed.path), val_fraction=0.2, seed=0)
    assert np.array_equal(again_val.indices, val.indices) and np.array_equal(again_train.indices, train.indices)
    assert not np.array_equal(reader.split(ds, val_fraction=0.2, seed=1)[1].indices, val.indices)
    assert list(val.indices) == sorted(val.indices), "file order"
    batches = [batch[1] for batch in make_loader(val, 4, num_workers=0, evaluation=True)]
    assert torch.cat(batches).tolist() == ds.targets[val.indices].tolist()
    with pytest.raises(ValueError, match="val_fraction must be between 0 and 1"):
        reader.split(ds, val_fraction=1.0)


@pytest.mark.parametrize("arguments, error, message", [
    ({"val_fraction": 0.2, "seed": None}, TypeError, "seed must be an int, got None"),
    ({"val_fraction": 0.2, "seed": 1.5}, TypeError, "seed must be an int, got 1.5"),
    ({"val_fraction": 0.2, "seed": -1}, ValueError, "seed must be 0 or more, got -1"),
    ({"val_fraction": "0.2"}, TypeError, r"val_fraction must be a number between 0 and 1 \(exclusive\), got '0.2'"),
    ({"val_fraction": 0}, ValueError, r"val_fraction must be between 0 and 1 \(exclusive\), got 0"),
    ({"val_fraction": -0.5}, ValueError, r"val_fraction must be between 0 and 1 \(exclusive\), got -0.5"),
    ({"val_fraction": 1.5}, ValueError, r"val_fraction must be between 0 and 1 \(exclusive\), got 1.5"),
])
def test_split_names_a_bad_seed_or_fraction(raw, arguments, error, message):
    with pytest.raises(error, match=f"^{message}$"):
        reader.split(PackedDataset(raw.path), **arguments)


def test_subset_with_float_indices_is_refused_not_truncated(raw):
    ds = PackedDataset(raw.path)
    with pytest.raises(TypeError, match=rf"^Subset indices must be ints, got np.float64\(0.5\) \(dtype float64\) in "
                                        rf"the Subset of {raw.path}$"):
        make_loader(Subset(ds, [0.5, 1.0]), 4, num_workers=0)
    assert [len(b[1]) for b in make_loader(Subset(ds, []), 4, num_workers=0)] == []


def test_batch_sampler_walked_directly_ends_after_one_epoch(raw):
    loader = make_loader(PackedDataset(raw.path), 4, num_workers=2, multiprocessing_context="fork")
    loader.set_epoch(3)
    walked = list(loader.batch_sampler)
    assert len(walked) == len(loader) == len(loader.batch_sampler) == 6
    order = loader.shard_sampler.rank_order().tolist()
    assert walked == [order[i:i + 4] for i in range(0, COUNT, 4)]
    labels = [batch[1].tolist() for batch in loader]
    assert labels == [[raw.labels[i] for i in batch] for batch in walked]
