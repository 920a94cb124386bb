"""The epoch orders built piece by piece (``reader.epoch_order``) are the orders the sampler always gave.

``reference_*`` below is the sampler's former whole-array algorithm (one ``np.lexsort`` over every
record, every rank building the whole epoch), kept here verbatim as the definition of the orders: same
seed, same epoch orders, same DDP shares, same resume after a world-size change, same batches.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_sampler import ManifestOnly
from torch.utils.data import ConcatDataset, Subset

from reader import ShardSampler
from reader.batch_stream import BatchStream
from reader.epoch_order import BlockGroups
from reader.packed_view import as_view


def reference_quasi_random(block_ids: np.ndarray, buffer_blocks: int, rng: np.random.Generator) -> np.ndarray:
    if len(block_ids) == 0:
        return np.zeros(0, np.int64)
    perm = rng.permutation(int(block_ids.max()) + 1)
    block_rank = np.empty_like(perm)
    block_rank[perm] = np.arange(len(perm))
    key = block_rank[block_ids]
    records = np.argsort(key, kind="stable")
    window = key[records] // buffer_blocks
    within = rng.random(len(records))
    return records[np.lexsort((within, window))].astype(np.int64)


def reference_epoch_order(sampler: ShardSampler, dataset, epoch: int) -> np.ndarray:
    if sampler.order == "sequential":
        return np.arange(sampler.num_records, dtype=np.int64)
    rng = np.random.default_rng((sampler.seed, epoch))
    if sampler.order == "random":
        return rng.permutation(sampler.num_records).astype(np.int64)
    _, block_ids = np.unique(as_view(dataset).block_ids(), return_inverse=True)
    return reference_quasi_random(block_ids, sampler.buffer_blocks, rng)


def reference_rank_share(sampler: ShardSampler, dataset, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    order = reference_epoch_order(sampler, dataset, epoch)
    if epoch == sampler.epoch and sampler.history:  # the world-size changes' rule, moved unchanged
        return sampler._continued_share(order)
    valid = np.ones(len(order), dtype=bool)
    order, valid = sampler._fit(order, valid, sampler.world_size)
    per = len(order) // sampler.world_size
    first = sampler.rank * per
    return order[first:first + per], valid[first:first + per]


WHOLE = ManifestOnly([250, 400, 7, 310, 1, 93], block_bytes=9_000)  # 9 records a block: 130 blocks
DATASETS = {
    "whole": WHOLE,
    "subset": Subset(WHOLE, np.random.default_rng(1).permutation(len(WHOLE))[:700].tolist()),
    "concat": ConcatDataset([WHOLE, Subset(WHOLE, list(range(600, 30, -3))), ManifestOnly([40, 3])]),
    "tiny": ManifestOnly([3]),
}


@pytest.mark.parametrize("name", list(DATASETS))
@pytest.mark.parametrize("order", ["sequential", "random", "quasi_random"])
def test_orders_and_shares_are_the_reference_ones(name: str, order: str) -> None:
    dataset = DATASETS[name]
    for seed, buffer_blocks in [(0, 16), (7, 1), (123456789, 5)]:
        for world, pad in [(1, True), (3, True), (4, False), (7, True), (64, True)]:
            for rank in sorted({0, 1 % world, world - 1}):
                sampler = ShardSampler(dataset, order=order, seed=seed, rank=rank, world_size=world, pad=pad,
                                       buffer_blocks=buffer_blocks)
                for epoch in (0, 5):
                    expected = reference_rank_share(sampler, dataset, epoch)
                    got = sampler.rank_share(epoch)
                    assert got[0].dtype == np.int64 and got[1].dtype == bool
                    assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
                assert np.array_equal(sampler.epoch_order(5), reference_epoch_order(sampler, dataset, 5))


@pytest.mark.parametrize("drop_last", [False, True])
def test_resumed_on_another_world_size_and_batches_match_the_reference(drop_last: bool) -> None:
    dataset = DATASETS["subset"]
    for saved_world, saved_start, world in [(4, 30, 3), (2, 0, 5), (3, 233, 2)]:
        state = {"epoch": 2, "seed": 11, "order": "quasi_random", "start": saved_start,
                 "world_size": saved_world, "history": [], "records": len(dataset)}
        for rank in range(world):
            sampler = ShardSampler(dataset, seed=11, rank=rank, world_size=world, buffer_blocks=3)
            sampler.load_state_dict(state)
            expected = reference_rank_share(sampler, dataset, 2)
            assert all(np.array_equal(a, b) for a, b in zip(sampler.rank_share(), expected))
            sampler.start = min(17, len(expected[0]))
            stream = BatchStream(sampler, 10, drop_last)
            order = expected[0][sampler.start:]
            assert list(sampler) == order.tolist()
            cut = [order[i:i + 10].tolist() for i in range(0, len(order), 10)]
            assert list(stream) == [b for b in cut if len(b) == 10 or not drop_last]


def test_block_groups_group_positions_by_block_in_ascending_order() -> None:
    ids = np.array([5, 2, 5, 9, 2, 2, 9])
    groups = BlockGroups.of(ids)
    assert groups.block_count == 3 and groups.bounds.tolist() == [0, 3, 5, 7]
    assert groups.positions is not None and groups.positions.tolist() == [1, 4, 5, 0, 2, 3, 6]
    assert BlockGroups.of(np.array([0, 0, 1, 4])).positions is None
    whole = as_view(WHOLE).block_groups()
    assert whole.positions is None
    assert np.array_equal(whole.bounds, BlockGroups.of(as_view(WHOLE).block_ids()).bounds)
