"""After its first batch, a worker's slot crosses to the main process by name, not by descriptor,
and batches stay exact, including those the DataLoader holds back until their turn, JPEG batches placed
16 bytes into their slot (``reader.format.jpeg_decode``) as raw ones at its start."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from reader_helpers import make_images, pack_images

from reader import PackedDataset, batch_memory, make_loader


@pytest.fixture(scope="module")
def jpeg_path(tmp_path_factory: pytest.TempPathFactory):
    return pack_images(tmp_path_factory.mktemp("jpeg") / "packed", make_images(40, [(16, 16)]),
                       [i % 3 for i in range(40)], storage="lmdb", encoding="jpeg", records_per_shard=10).path


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_known_slots_cross_by_name_and_batches_stay_exact(encoding, raw_path, jpeg_path, monkeypatch):
    kinds = []
    receive = batch_memory.SlotReleaser.receive

    def counting(self, batch):
        if isinstance(batch, tuple) and batch:
            kinds.append(type(batch[0]).__name__)
        return receive(self, batch)

    monkeypatch.setattr(batch_memory.SlotReleaser, "receive", counting)
    ds = PackedDataset(raw_path if encoding == "raw" else jpeg_path)
    loader = make_loader(ds, 3, num_workers=2, order="random", multiprocessing_context="fork")
    for epoch in range(4):
        loader.set_epoch(epoch)
        order = iter(loader.shard_sampler.rank_order().tolist())
        for images, labels in loader:  # each batch dropped before the next, so its slot is reused
            if encoding == "jpeg":  # the decode placement survives the handoff
                assert images.data_ptr() % 32 == 16
            for image, label in zip(images, labels.tolist()):
                i = next(order)
                assert label == ds.targets[i] and torch.equal(image, ds[i][0])
    assert "_SlotView" in kinds
    assert kinds.count("_SlotView") > kinds.count("Tensor")


def test_past_its_batches_in_flight_a_pool_waits_for_a_slot_to_come_back(monkeypatch):
    """A pool told to make ``made_at_once`` slots takes one that comes back within ``SLOT_WAIT_S``
    instead of making another; where none comes back it makes one, and the next count waits again. A
    pool not told so never waits."""
    pool = batch_memory._Pool(shared=False)
    pool.made_at_once = 1
    held = [pool.take(1000)]
    first = held[0].data_ptr()
    threading.Timer(0.05, held.clear).start()  # the batch is dropped 50 ms later
    began = time.monotonic()
    again = pool.take(1000)
    assert 0.04 <= time.monotonic() - began < batch_memory.SLOT_WAIT_S
    assert again.data_ptr() == first and len(pool.slots) == 1  # the same slot, no new one
    monkeypatch.setattr(batch_memory, "SLOT_WAIT_S", 0.05)
    began = time.monotonic()
    other = pool.take(1000)  # ``again`` stays in use: after the wait, a second slot
    assert time.monotonic() - began >= 0.05
    assert other.data_ptr() != first and len(pool.slots) == 2 and pool.made_at_once == 2
    began = time.monotonic()
    third = pool.take(1000)  # both in use: the third count waits too
    assert time.monotonic() - began >= 0.05 and len(pool.slots) == 3 and pool.made_at_once == 3
    unbounded = batch_memory._Pool(shared=False)
    monkeypatch.setattr(batch_memory, "SLOT_WAIT_S", 10.0)
    kept = [unbounded.take(1000) for _ in range(3)]
    assert len(unbounded.slots) == 3 and len({t.data_ptr() for t in kept + [third]}) == 4  # at once


def test_workers_that_wait_for_slots_still_give_every_batch_exact(raw_path, monkeypatch):
    """make_loader's workers make a slot per batch in flight and one more at once; a consumer that keeps
    every batch makes them wait each time before they make another (up to ``MAX_SLOTS``, then fresh
    memory), and every batch stays exact."""
    monkeypatch.setattr(batch_memory, "SLOT_WAIT_S", 0.02)  # forked workers inherit it
    ds = PackedDataset(raw_path)
    loader = make_loader(ds, 1, num_workers=2, order="sequential", prefetch_factor=1, multiprocessing_context="fork",
                         pin_memory=False)
    assert loader.worker_init_fn.keywords["prefetch"] == 1
    kept = list(loader)
    assert len(kept) > 2 * batch_memory.MAX_SLOTS  # past every slot: fresh memory at the end
    assert torch.cat([labels for _, labels in kept]).tolist() == ds.targets.tolist()
    for i, image in enumerate(torch.cat([images for images, _ in kept])):
        assert torch.equal(image, ds[i][0])
