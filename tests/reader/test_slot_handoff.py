"""After its first batch, a worker's slot crosses to the main process by name, not by descriptor,
and batches stay exact, including those the DataLoader holds back until their turn, JPEG batches placed
16 bytes into their slot (``reader.format.jpeg_decode``) as raw ones at its start."""
from __future__ import annotations

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
