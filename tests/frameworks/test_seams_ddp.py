"""make_loader over real DDP: 2 processes over gloo, spawned once for the module (a few seconds).

Every sample is identified by its pixels (each record of the dataset is a different image), so what
is checked is what the ranks really read: the training shares (disjoint, complete, equal counts, for a
size that does not divide by world_size x batch), evaluation coverage (exactly once, by the validity
mask and the sample indices), the seed check, and resume across a world-size change (2 -> 1, 1 -> 2).
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ddp_helpers import free_port, run_ranks
from reader_helpers import make_images, pack_images
from torch.utils.data import Subset

import reader.loader
import reader.ranks
from reader import PackedDataset, ShardSampler, make_loader
from reader.ranks import ranks_on_this_node

COUNT = 37  # not a multiple of WORLD * BATCH
WORLD = 2
BATCH = 4
RESUMED = 36  # the resume tests read a Subset of 36 records: no padding, so "exactly once" is exact


def record_ids(ds: PackedDataset) -> dict[bytes, int]:
    """Each record's pixels -> its index (the images are all different)."""
    ids = {ds[i][0].numpy().tobytes(): i for i in range(len(ds))}
    assert len(ids) == len(ds)
    return ids


def identify(ids: dict[bytes, int], images: torch.Tensor) -> list[int]:
    return [ids[image.contiguous().numpy().tobytes()] for image in images]


def resume_subset(path: Path) -> Subset:
    return Subset(PackedDataset(path), list(range(RESUMED)))


def ddp_session(rank: int, path: str, port: int, out: str, one_rank_state: dict) -> None:
    """One rank of the spawned job: runs every scenario and writes what it saw to ``out/rank{r}.json``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("LOCAL_WORLD_SIZE", None)  # as Lightning's own launcher leaves it
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        ds = PackedDataset(path)
        ids = record_ids(ds)
        seen: dict = {"node_ranks": [ranks_on_this_node()]}
        train = make_loader(ds, BATCH, num_workers=0, seed=5)  # rank and world size from torch.distributed
        seen["node_ranks"].append(ranks_on_this_node())
        train.set_epoch(1)
        seen["train"] = [identify(ids, images) for images, _ in train]

        evaluation = make_loader(ds, BATCH, num_workers=0, evaluation=True)
        seen["eval"] = [{"pixels": identify(ids, images), "labels": labels.tolist(), "indices": indices.tolist(),
                         "valid": valid.tolist(), "dtypes": [str(indices.dtype), str(valid.dtype)]}
                        for images, labels, indices, valid in evaluation]
        correct = torch.zeros((), dtype=torch.int64)  # docs/reading.md's metric: "label is even"
        count = torch.zeros((), dtype=torch.int64)
        for _, labels, _, valid in evaluation:
            correct += ((labels % 2 == 0) & valid).sum()
            count += valid.sum()
        dist.all_reduce(correct)
        dist.all_reduce(count)
        seen["metric"] = [int(correct), int(count)]

        measured, reader.loader.cache_room = reader.loader.cache_room, lambda to_come: 0 if rank == 1 else 1 << 50
        seen["streaming"] = [make_loader(ds, BATCH, num_workers=workers).view.streaming for workers in (1, 0)]
        if rank == 0:  # a loader of its own (world_size=1): no collective, so rank 1 is not waited for
            seen["alone"] = make_loader(ds, BATCH, num_workers=1, rank=0, world_size=1).view.streaming
        hostname, reader.ranks.socket.gethostname = reader.ranks.socket.gethostname, lambda: f"host{rank}"
        seen["two_hosts"] = [make_loader(ds, BATCH, num_workers=1).view.streaming, ranks_on_this_node()]
        reader.ranks.socket.gethostname = hostname
        reader.loader.cache_room = measured  # rank 1 found no room for the dataset, rank 0 plenty

        try:
            make_loader(ds, BATCH, num_workers=0, seed=rank)
            seen["seed_error"] = None
        except ValueError as e:
            seen["seed_error"] = str(e)
        try:
            make_loader(ds, BATCH, num_workers=0, buffer_blocks=2 + rank)
            seen["layout_error"] = None
        except ValueError as e:
            seen["layout_error"] = str(e)

        uninterrupted = make_loader(resume_subset(path), BATCH, num_workers=0, seed=8)
        seen["uninterrupted"] = [identify(ids, images) for images, _ in uninterrupted]
        first = make_loader(resume_subset(path), BATCH, num_workers=0, seed=8)
        batches = iter(first)
        seen["before_save"] = [identify(ids, next(batches)[0]) for _ in range(2)]
        seen["state"] = first.state_dict()
        del batches

        resumed = make_loader(resume_subset(path), BATCH, num_workers=0, seed=8)
        resumed.load_state_dict(one_rank_state)
        seen["after_one_rank_state"] = [identify(ids, images) for images, _ in resumed]
        seen["node_ranks"].append(ranks_on_this_node())  # the sampler just above counted both again
        dist.barrier()
    finally:
        dist.destroy_process_group()
    seen["node_ranks"].append(ranks_on_this_node())  # that process group is gone
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The dataset, what one rank read of the resume subset before saving (1 -> 2), and each rank's
    record of the spawned job."""
    root = tmp_path_factory.mktemp("ddp")
    path = pack_images(root / "packed", make_images(COUNT, [(8, 8)]), [i % 3 for i in range(COUNT)],
                       storage="lmdb", encoding="raw", records_per_shard=10).path
    ds = PackedDataset(path)
    ids = record_ids(ds)
    one_rank = make_loader(resume_subset(path), BATCH, num_workers=0, seed=8)
    one_rank_full = [identify(ids, images) for images, _ in one_rank]
    batches = iter(one_rank)
    one_rank_before = [identify(ids, next(batches)[0])]
    one_rank_state = one_rank.state_dict()
    del batches
    run_ranks(ddp_session, (str(path), free_port(), str(root), one_rank_state), WORLD, "spawn")
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {"path": path, "ds": ds, "ids": ids, "ranks": ranks, "one_rank_full": one_rank_full,
            "one_rank_before": one_rank_before}


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def test_training_shares_are_disjoint_complete_and_equal(job):
    shares = [flat(rank["train"]) for rank in job["ranks"]]
    assert [len(rank["train"]) for rank in job["ranks"]] == [5, 5], "ceil(19 / 4) batches on each rank"
    assert [len(share) for share in shares] == [19, 19]
    counts = Counter(shares[0] + shares[1])
    assert set(counts) == set(range(COUNT))
    assert sorted(counts.values()) == [1] * (COUNT - 1) + [2], "one wrapped sample pads 37 to 38"
    assert len(set(shares[0]) & set(shares[1])) <= 1
    sampler = ShardSampler(job["ds"], seed=5, rank=0, world_size=WORLD)
    sampler.set_epoch(1)
    assert shares[0] == sampler.rank_order().tolist(), "the rank's share is the sampler's, from torch.distributed"


def test_evaluation_covers_every_sample_exactly_once(job):
    ranks = job["ranks"]
    assert [len(rank["eval"]) for rank in ranks] == [5, 5], "equal batch counts: no hang at the end"
    valid_indices = []
    for rank in ranks:
        for batch in rank["eval"]:
            assert batch["pixels"] == batch["indices"], "indices name the samples the batch holds"
            assert batch["labels"] == job["ds"].targets[batch["indices"]].tolist()
            assert batch["dtypes"] == ["torch.int64", "torch.bool"]
            valid_indices += [i for i, ok in zip(batch["indices"], batch["valid"]) if ok]
    assert sorted(valid_indices) == list(range(COUNT))
    assert sum(not ok for rank in ranks for batch in rank["eval"] for ok in batch["valid"]) == 1
    expected = int((job["ds"].targets % 2 == 0).sum())
    assert ranks[0]["metric"] == ranks[1]["metric"] == [expected, COUNT]


def test_the_ranks_learn_how_many_share_their_node(job):
    """Without ``LOCAL_WORLD_SIZE`` (Lightning's own launcher, srun, mpirun set none) a rank counts the
    ranks on its host from the sampler's collective: before it, 1; after it, both ranks of this machine;
    ranks given host names of their own count themselves alone; once the process group is destroyed, 1."""
    assert [rank["node_ranks"] for rank in job["ranks"]] == [[1, 2, 2, 1], [1, 2, 2, 1]]
    assert [rank["two_hosts"][1] for rank in job["ranks"]] == [1, 1]


def test_where_one_rank_of_a_node_streams_all_do(job):
    """Each rank measures the node's memory at its own moment; where one finds no room for the dataset,
    every rank on the node streams it (a loader without workers never does, and still takes part);
    not a loader of one rank's own (``world_size=1``, no collective), nor ranks on other hosts."""
    assert [rank["streaming"] for rank in job["ranks"]] == [[True, False], [True, False]]
    assert job["ranks"][0]["alone"] is False  # its own loader: rank 1's finding is not asked for
    assert [rank["two_hosts"][0] for rank in job["ranks"]] == [False, True]  # one host's finding, not the other's


def test_ranks_with_different_seeds_fail_clearly(job):
    for rank in job["ranks"]:
        assert rank["seed_error"] == (
            "ShardSampler: the ranks disagree on the seed (rank 0: 0, rank 1: 1); it must be the same on "
            "every rank: the sampler splits one order between the ranks itself, so pass the run's seed "
            "(e.g. make_loader(seed=args.seed)), not a per-rank one")


def test_ranks_with_different_block_layouts_fail_clearly(job):
    """Ranks whose quasi-random blocks differ (here ``buffer_blocks``) would split different orders."""
    for rank in job["ranks"]:
        error = rank["layout_error"]
        assert error.startswith("ShardSampler: the ranks disagree on the block layout (rank 0: '"), error
        assert "blocks in windows of 2, xxh3 " in error and "blocks in windows of 3, xxh3 " in error
        assert error.endswith("it must be the same on every rank: the sampler splits one order between the "
                              "ranks itself, so open the dataset with the same block_bytes= and buffer_blocks= "
                              "on every rank")


def test_resume_from_two_ranks_on_one(job):
    ranks = job["ranks"]
    state = ranks[0]["state"]
    assert state["world_size"] == 2 and state["start"] == 2 * BATCH
    assert ranks[1]["state"] == state, "ranks in lockstep save the same state"
    ids = job["ids"]
    resumed = make_loader(resume_subset(job["path"]), BATCH, num_workers=0, seed=0)
    resumed.load_state_dict(state)
    assert (resumed.batches_done(), len(resumed)) == (2, 2 + 5), \
        "the 2 batches each rank had read, then (36 - 2 x 8) / 4 batches left: a counter restored at 2 ends exactly"
    rest = flat([identify(ids, images) for images, _ in resumed])
    read = flat(ranks[0]["before_save"]) + flat(ranks[1]["before_save"]) + rest
    assert sorted(read) == list(range(RESUMED)), "nothing lost, nothing repeated"
    tails = flat(ranks[0]["uninterrupted"])[2 * BATCH:] + flat(ranks[1]["uninterrupted"])[2 * BATCH:]
    assert rest == tails, "the same global order goes on: what the two ranks had left, in order"
    after = resumed.state_dict()
    assert (after["world_size"], after["history"], after["start"]) == (1, [[2, 8]], 20)
    resumed.set_epoch(1)
    assert resumed.state_dict()["history"] == [] and len(resumed) == RESUMED // BATCH


def test_resume_from_one_rank_on_two(job):
    ranks = job["ranks"]
    after = [flat(rank["after_one_rank_state"]) for rank in ranks]
    assert [len(rank["after_one_rank_state"]) for rank in ranks] == [4, 4], "32 samples left, 16 a rank"
    assert sorted(flat(job["one_rank_before"]) + after[0] + after[1]) == list(range(RESUMED))
    assert after[0] + after[1] == flat(job["one_rank_full"])[BATCH:], "rank 0 the first half, rank 1 the rest"


@pytest.mark.parametrize("count, first_world, batches, second_world", [
    (37, 2, 2, 3), (37, 3, 1, 2), (20, 1, 3, 4), (9, 4, 1, 1), (37, 2, 0, 5)])
def test_world_size_changes_keep_the_epoch(tmp_path, count, first_world, batches, second_world):
    """In-process (explicit ranks): any change of world size, padding included, loses nothing, and
    evaluation's validity mask counts every sample exactly once."""
    path = pack_images(tmp_path / "packed", make_images(count, [(4, 4)]), [0] * count,
                       storage="hdf5", encoding="raw", records_per_shard=6).path
    ds = PackedDataset(path)

    def loaders(world: int) -> list:
        return [make_loader(ds, 2, num_workers=0, seed=3, rank=r, world_size=world, evaluation=True)
                for r in range(world)]

    seen = []
    first = loaders(first_world)
    for loader in first:
        stream = iter(loader)
        for _ in range(batches):
            _, _, indices, valid = next(stream)
            seen += indices[valid].tolist()
    state = first[0].state_dict()
    second = loaders(second_world)
    for loader in second:
        loader.load_state_dict(state)
    assert len({len(loader) for loader in second}) == 1, "equal batch counts after the change"
    for loader in second:
        for _, _, indices, valid in loader:
            seen += indices[valid].tolist()
    assert sorted(seen) == list(range(count))


def test_bad_saved_start_is_refused(tmp_path):
    path = pack_images(tmp_path / "packed", make_images(10, [(4, 4)]), [0] * 10,
                       storage="lmdb", encoding="raw", records_per_shard=5).path
    sampler = ShardSampler(PackedDataset(path), world_size=1, rank=0)
    state = {"epoch": 0, "seed": 0, "order": "quasi_random", "start": 6, "world_size": 2, "history": []}
    with pytest.raises(ValueError, match="saved start 6 is outside the 5 samples of each of the 2 saved ranks"):
        sampler.load_state_dict(state)
    assert np.array_equal(np.sort(sampler.rank_order()), np.arange(10)), "the sampler is unchanged"


def test_evaluation_refuses_options_that_would_drop_samples(tmp_path):
    path = pack_images(tmp_path / "packed", make_images(5, [(4, 4)]), [0] * 5,
                       storage="lmdb", encoding="raw", records_per_shard=5).path
    for options in ({"drop_last": True}, {"pad": False}):
        with pytest.raises(ValueError, match="evaluation=True.*needs drop_last=False and pad=True"):
            make_loader(PackedDataset(path), 2, num_workers=0, evaluation=True, **options)
