"""The GPU side under real DDP: two processes over gloo, spawned by the test, with the rank taken from
torch.distributed. Resume through CUDAPrefetcher over make_loader, each rank's own augmentation draws,
and GPUDataset's sharding (disjoint, complete, equal batch counts for 37 samples, which 2 ranks x
batches of 4 do not divide)."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ddp_helpers import free_port, run_ranks
from gpu_helpers import MEAN, STD, batch_of
from reader_helpers import SMALL_RAW_COUNT

from reader import CUDAPrefetcher, GPUDataset, PackedDataset, make_loader

WORLD = 2
SEED = 11
SAVE_AFTER = 2


def prefetcher_over_loader(dataset: PackedDataset) -> CUDAPrefetcher:
    loader = make_loader(dataset, batch_size=4, num_workers=0, seed=SEED, pin_memory=False)
    return CUDAPrefetcher(loader, MEAN, STD, device="cpu", random_resized_crop=8, flip=True, seed=SEED)


def rank_main(rank: int, port: int, data: Path, out: Path) -> None:
    """One rank: runs every scenario and saves what it saw for the parent to compare."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        dataset = PackedDataset(data)
        run = prefetcher_over_loader(dataset)
        run.set_epoch(1)
        uninterrupted, saved = [], None
        for batch in run:
            uninterrupted.append(batch)
            if len(uninterrupted) == SAVE_AFTER:
                saved = copy.deepcopy(run.state_dict())
        resumed = prefetcher_over_loader(dataset)
        resumed.load_state_dict(saved)
        resumed.set_epoch(1)
        same_input = [batch_of(dataset, range(8))]
        resident = GPUDataset(dataset, "cpu", batch_size=4, mean=MEAN, std=STD, seed=SEED)
        unpadded = GPUDataset(dataset, "cpu", batch_size=4, mean=MEAN, std=STD, seed=SEED, pad=False)
        torch.save({
            "uninterrupted": uninterrupted,
            "resumed": list(resumed),
            "draws_on_same_input": next(iter(CUDAPrefetcher(same_input, MEAN, STD, device="cpu",
                                                            random_resized_crop=8, flip=True, seed=SEED)))[0],
            "gpu_indices": resident.epoch_indices(0),
            "gpu_batches": list(resident),
            "unpadded_indices": unpadded.epoch_indices(0),
            "unpadded_batches": len(list(unpadded)),
            "labels": torch.from_numpy(dataset.targets),
        }, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(raw_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    # The ranks run on the CPU: fork starts them in a fraction of a second, unless this process has
    # initialised CUDA, which a forked child cannot use (then spawn, a few seconds).
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    run_ranks(rank_main, (free_port(), raw_path, out), WORLD, method)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


def test_resume_through_the_prefetcher_on_each_rank(ranks: list[dict]) -> None:
    for seen in ranks:
        expected, got = seen["uninterrupted"][SAVE_AFTER:], seen["resumed"]
        assert len(got) == len(expected) > 0
        for (images, labels), (want_images, want_labels) in zip(got, expected):
            assert torch.equal(labels, want_labels) and torch.equal(images, want_images)
    assert not torch.equal(ranks[0]["draws_on_same_input"], ranks[1]["draws_on_same_input"]), \
        "the same batch on two ranks gets each rank's own draws"


def test_gpu_dataset_shards_across_ranks(ranks: list[dict]) -> None:
    padded = [seen["gpu_indices"].tolist() for seen in ranks]
    assert [len(share) for share in padded] == [19, 19]
    assert set(padded[0]) | set(padded[1]) == set(range(SMALL_RAW_COUNT))
    assert len(set(padded[0]) & set(padded[1])) == 1, "only the one sample wrapped to fill the last rank"
    assert [len(seen["gpu_batches"]) for seen in ranks] == [5, 5], "equal batch counts: no hang at epoch end"
    for seen in ranks:
        labels = torch.cat([labels for _, labels in seen["gpu_batches"]])
        assert torch.equal(labels, seen["labels"][seen["gpu_indices"]])
    unpadded = [set(seen["unpadded_indices"].tolist()) for seen in ranks]
    assert [len(share) for share in unpadded] == [18, 18] and not unpadded[0] & unpadded[1]
    assert [seen["unpadded_batches"] for seen in ranks] == [5, 5]
