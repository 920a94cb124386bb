"""ShardSampler: complete epochs in every order, shard-local blocks, DDP slices, seeds, resume."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from reader_helpers import make_images, pack_images

from reader import PackedDataset, ShardSampler
from reader.blocks import DEFAULT_BLOCK_BYTES, dataset_block_starts
from reader.format import Manifest, ShardInfo

RECORD_BYTES = 1000
SHARD_RECORDS = [25, 40, 7, 31]


class ManifestOnly:
    """What the sampler reads of a dataset: its length, its manifest's shard sizes and its block layout
    (``PackedDataset.block_starts``, cut by the same rule)."""

    def __init__(self, shard_records: list[int], block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        shards = [ShardInfo(f"shard-{i:05d}.lmdb", n, n * RECORD_BYTES, "") for i, n in
                  enumerate(shard_records)]
        self.manifest = Manifest(storage="lmdb", encoding="raw", shape=[3, 8, 8], classes=["a"],
                                 shards=shards, transform={}, source={}, tool_version="test")

    def __len__(self) -> int:
        return self.manifest.num_records

    def block_starts(self) -> np.ndarray:
        return dataset_block_starts(self.manifest.shards, self.block_bytes)


DATASET = ManifestOnly(SHARD_RECORDS)
N = sum(SHARD_RECORDS)


@pytest.mark.parametrize("order", ["sequential", "random", "quasi_random"])
def test_every_record_once_per_epoch(order):
    sampler = ShardSampler(DATASET, order=order, seed=3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert len(sampler) == N
        assert sorted(sampler) == list(range(N))


def test_sequential_is_dataset_order():
    assert list(ShardSampler(DATASET, order="sequential")) == list(range(N))


def block_starts_of(block_records: int) -> np.ndarray:
    """First record of every block when each shard is cut into blocks of ``block_records``."""
    shard_starts = np.cumsum([0, *SHARD_RECORDS])
    return np.concatenate([np.arange(a, b, block_records)
                           for a, b in zip(shard_starts[:-1], shard_starts[1:])])


def windows_of(order: list[int], block_records: int, buffer_blocks: int) -> list[list[int]]:
    """Cut an epoch order into its windows: runs made of ``buffer_blocks`` whole blocks."""
    starts = block_starts_of(block_records)
    sizes = np.diff(np.append(starts, N))
    block_of = np.searchsorted(starts, order, side="right") - 1
    windows, position = [], 0
    while position < N:
        members = list(dict.fromkeys(block_of[position:].tolist()))[:buffer_blocks]
        length = int(sizes[members].sum())
        assert set(block_of[position:position + length].tolist()) == set(members)
        windows.append(order[position:position + length])
        position += length
    return windows


def test_quasi_random_blocks_stay_in_one_shard():
    """With a one-block buffer, the order is whole blocks of ~block_bytes, each inside one shard."""
    sampler = ShardSampler(ManifestOnly(SHARD_RECORDS, 10 * RECORD_BYTES), seed=1, buffer_blocks=1)
    windows = windows_of(list(sampler), block_records=10, buffer_blocks=1)
    assert len(windows) == len(block_starts_of(10))
    first_records = [min(w) for w in windows]
    assert first_records != sorted(first_records)
    for window in windows:
        assert sorted(window) == list(range(min(window), min(window) + len(window)))


def test_quasi_random_shuffles_within_buffer():
    sampler = ShardSampler(ManifestOnly(SHARD_RECORDS, 10 * RECORD_BYTES), seed=2, buffer_blocks=4)
    windows = windows_of(list(sampler), block_records=10, buffer_blocks=4)
    assert len(windows) == -(-len(block_starts_of(10)) // 4)
    assert all(window != sorted(window) for window in windows)


@pytest.mark.parametrize("order", ["random", "quasi_random"])
def test_seed_and_epoch_determine_the_order(order):
    def epoch_order(seed: int, epoch: int) -> list[int]:
        sampler = ShardSampler(DATASET, order=order, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert epoch_order(0, 0) == epoch_order(0, 0)
    assert epoch_order(0, 0) != epoch_order(0, 1)
    assert epoch_order(0, 1) != epoch_order(1, 1)


@pytest.mark.parametrize("order", ["sequential", "quasi_random"])
def test_ranks_pad_to_equal_contiguous_slices(order):
    world = 3
    samplers = [ShardSampler(DATASET, order=order, seed=5, rank=r, world_size=world)
                for r in range(world)]
    per_rank = -(-N // world)
    slices = [list(s) for s in samplers]
    assert all(len(s) == per_rank == len(sampler) for s, sampler in zip(slices, samplers))
    epoch_order = samplers[0].epoch_order()
    assert sum(slices, []) == np.resize(epoch_order, per_rank * world).tolist()
    assert set(sum(slices, [])) == set(range(N))
    assert len(sum(slices, [])) - N == per_rank * world - N


def test_ranks_without_padding_drop_the_tail():
    world = 4
    slices = [list(ShardSampler(DATASET, seed=5, rank=r, world_size=world, pad=False))
              for r in range(world)]
    assert all(len(s) == N // world for s in slices)
    flat = sum(slices, [])
    assert len(set(flat)) == len(flat) == N // world * world


def test_tiny_dataset_pads_every_rank():
    dataset = ManifestOnly([2])
    slices = [list(ShardSampler(dataset, rank=r, world_size=5)) for r in range(5)]
    assert [len(s) for s in slices] == [1] * 5
    assert set(sum(slices, [])) == {0, 1}


def test_rank_defaults_follow_torch_distributed(tmp_path):
    assert (ShardSampler(DATASET).rank, ShardSampler(DATASET).world_size) == (0, 1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    try:
        sampler = ShardSampler(DATASET)
        assert (sampler.rank, sampler.world_size) == (0, 1)
    finally:
        dist.destroy_process_group()


def test_resume_skips_what_was_consumed():
    uninterrupted = ShardSampler(DATASET, seed=9, rank=1, world_size=2)
    uninterrupted.set_epoch(4)
    full = list(uninterrupted)
    state = uninterrupted.state_dict()
    state["start"] = 20
    resumed = ShardSampler(DATASET, seed=0, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert state == {"epoch": 4, "seed": 9, "order": "quasi_random", "start": 20, "world_size": 2, "history": [],
                     "records": N, "layout": uninterrupted.layout()}
    assert len(resumed) == len(full), "len() is the whole epoch's"
    assert (resumed.samples_done, resumed.samples_left) == (20, len(full) - 20)
    resumed.set_epoch(4)
    assert list(resumed) == full[20:]
    resumed.set_epoch(5)
    assert resumed.start == 0 and len(list(resumed)) == len(full)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="order"):
        ShardSampler(DATASET, order="shuffled")
    with pytest.raises(ValueError, match="rank"):
        ShardSampler(DATASET, rank=2, world_size=2)
    with pytest.raises(ValueError, match="order"):
        ShardSampler(DATASET).load_state_dict({"epoch": 0, "seed": 0, "order": "random", "start": 0})


@pytest.mark.parametrize("options, error, message", [
    ({"seed": "a"}, TypeError, "seed must be an int, got 'a'"),
    ({"seed": None}, TypeError, "seed must be an int, got None"),
    ({"seed": 1.5}, TypeError, "seed must be an int, got 1.5"),
    ({"seed": -1}, ValueError, "seed must be 0 or more, got -1"),
    ({"rank": 1.0, "world_size": 2}, TypeError, "rank must be an int, got 1.0"),
    ({"rank": 0, "world_size": "2"}, TypeError, "world_size must be an int, got '2'"),
    ({"rank": -1, "world_size": 2}, ValueError, "rank -1 is not in range for world_size 2"),
    ({"rank": 0, "world_size": 0}, ValueError, "rank 0 is not in range for world_size 0"),
])
def test_bad_seed_rank_and_world_size_are_named(options, error, message):
    with pytest.raises(error, match=f"^{message}$"):
        ShardSampler(DATASET, **options)
    assert len(ShardSampler(DATASET, seed=np.int64(3), rank=np.int32(1), world_size=2)) == -(-N // 2)


def test_set_epoch_takes_an_epoch_numpy_can_seed():
    sampler = ShardSampler(DATASET)
    with pytest.raises(ValueError, match="^epoch must be 0 or more, got -1$"):
        sampler.set_epoch(-1)
    with pytest.raises(TypeError, match="^epoch must be an int, got 1.5$"):
        sampler.set_epoch(1.5)


GOOD_STATE = {"epoch": 2, "seed": 5, "order": "quasi_random", "start": 10, "world_size": 1, "history": [],
              "records": N, "layout": ShardSampler(DATASET).layout()}


@pytest.mark.parametrize("change, error, message", [
    ({"records": N - 1}, ValueError, f"saved state is for a dataset of {N - 1} records, this sampler's has {N}"),
    ({"epoch": None}, TypeError, "saved epoch must be an int, got None"),
    ({"epoch": -1}, ValueError, "saved epoch must be 0 or more, got -1"),
    ({"seed": "x"}, TypeError, "saved seed must be an int, got 'x'"),
    ({"start": 1.5}, TypeError, "saved start must be an int, got 1.5"),
    ({"start": -1}, ValueError, "saved start must be 0 or more, got -1"),
    ({"world_size": 0}, ValueError, "saved world_size must be positive, got 0"),
    ({"history": None}, ValueError, r"saved history must be a list of \[world_size, start\] pairs, got None"),
    ({"history": [[2]]}, ValueError, r"saved history must be a list of \[world_size, start\] pairs, got \[\[2\]\]"),
    ({"history": [[0, 0]]}, ValueError, "saved history world_size must be positive, got 0"),
    ({"layout": 7}, TypeError, "saved layout must be a string or None, got int"),
])
def test_corrupted_or_foreign_state_is_refused_naming_the_entry(change, error, message):
    sampler = ShardSampler(DATASET, seed=1)
    with pytest.raises(error, match=f"^{message}$"):
        sampler.load_state_dict({**GOOD_STATE, **change})
    assert sampler.state_dict() == {**GOOD_STATE, "epoch": 0, "seed": 1, "start": 0}, "left as it was"
    sampler.load_state_dict(GOOD_STATE)
    assert sampler.state_dict() == GOOD_STATE
    sampler.load_state_dict({key: GOOD_STATE[key] for key in ("epoch", "seed", "order", "start")})  # older states
    assert sampler.state_dict() == GOOD_STATE


def test_a_mid_epoch_resume_over_other_blocks_is_refused(tmp_path: Path):
    """The quasi-random order follows the blocks: resumed over blocks cut otherwise (another
    ``block_bytes=`` or ``buffer_blocks=``), the rest of the epoch would not be the rest of the saved
    order. Refused mid-epoch; at an epoch's start, or with the position cleared, a new order is fine."""
    packed = pack_images(tmp_path / "packed", make_images(40, [(16, 16)]), [0] * 40,
                         storage="lmdb", encoding="raw", records_per_shard=20)
    record = 3 * 16 * 16
    saved = ShardSampler(PackedDataset(packed.path, block_bytes=5 * record), seed=4, buffer_blocks=2)
    saved.set_epoch(1)
    order = list(saved)
    saved.start = 15
    state = saved.state_dict()
    assert state["layout"] == saved.layout()
    assert re.fullmatch(r"20 blocks in windows of 2, xxh3 [0-9a-f]{16}", saved.layout())

    same = ShardSampler(PackedDataset(packed.path, block_bytes=5 * record), buffer_blocks=2)
    same.load_state_dict(state)
    assert list(same) == order[15:]
    for block_bytes, buffer_blocks in [(10 * record, 2), (5 * record, 3)]:
        other = ShardSampler(PackedDataset(packed.path, block_bytes=block_bytes), buffer_blocks=buffer_blocks)
        with pytest.raises(ValueError) as refused:
            other.load_state_dict(state)
        assert str(refused.value) == (
            f"saved state is mid-epoch in a quasi-random order over other blocks (saved: {saved.layout()}; "
            f"this sampler's: {other.layout()}): the dataset was opened with another block_bytes= or "
            "buffer_blocks= than the saved run's, or by a reader release that cuts blocks otherwise, and "
            "resuming would repeat some records and skip others. Open it as the saved run did; or, to read "
            "this epoch again from its start, load the state with 'start' set to 0 and 'history' set to []")
        assert other.start == 0, "left as it was"
        other.load_state_dict({**state, "start": 0, "history": []})
        assert (other.epoch, sorted(other)) == (1, list(range(40))), "the epoch again, in its own order"
        assert other.state_dict()["layout"] == other.layout() != saved.layout()

    whole = ShardSampler(PackedDataset(packed.path, block_bytes=5 * record), seed=4, buffer_blocks=2)
    whole.set_epoch(1)
    whole.start = len(order)  # saved as the epoch ended: nothing of it is left to repeat or skip
    other = ShardSampler(PackedDataset(packed.path, block_bytes=10 * record), buffer_blocks=2)
    other.load_state_dict(whole.state_dict())
    assert (other.epoch, other.samples_left) == (1, 0)

    for order_name in ("random", "sequential"):  # orders that do not depend on blocks
        kept = ShardSampler(PackedDataset(packed.path, block_bytes=5 * record), order=order_name, seed=4)
        kept.set_epoch(1)
        kept.start = 15
        state = kept.state_dict()
        assert state["layout"] is None
        other = ShardSampler(PackedDataset(packed.path, block_bytes=10 * record), order=order_name)
        other.load_state_dict(state)
        assert list(other) == kept.rank_order()[15:].tolist()


def test_state_missing_an_entry_or_not_a_dict():
    sampler = ShardSampler(DATASET)
    with pytest.raises(ValueError, match=r"^saved state has no epoch, start \(loading it needs epoch, seed, order, "
                                         r"start\), got keys \['order', 'seed'\]$"):
        sampler.load_state_dict({"order": "quasi_random", "seed": 0})
    with pytest.raises(TypeError, match="^load_state_dict takes the dict state_dict\\(\\) returned, got NoneType$"):
        sampler.load_state_dict(None)  # type: ignore[arg-type]


def test_real_dataset_blocks_from_shard_bytes(tmp_path: Path):
    packed = pack_images(tmp_path / "packed", make_images(30, [(16, 16)]), [0] * 30,
                         storage="hdf5", encoding="raw", records_per_shard=12)
    ds = PackedDataset(packed.path, block_bytes=4 * 3 * 16 * 16)
    sampler = ShardSampler(ds, seed=1, buffer_blocks=2)
    assert sorted(sampler) == list(range(30))
