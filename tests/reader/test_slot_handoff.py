"""After its first batch, a worker's slot crosses to the main process by name, not by descriptor,
and batches stay exact, including those the DataLoader holds back until their turn."""
from __future__ import annotations

import torch

from reader import PackedDataset, batch_memory, make_loader


def test_known_slots_cross_by_name_and_batches_stay_exact(raw_path, monkeypatch):
    kinds = []
    receive = batch_memory.SlotReleaser.receive

    def counting(self, batch):
        if isinstance(batch, tuple) and batch:
            kinds.append(type(batch[0]).__name__)
        return receive(self, batch)

    monkeypatch.setattr(batch_memory.SlotReleaser, "receive", counting)
    ds = PackedDataset(raw_path)
    loader = make_loader(ds, 3, num_workers=2, order="random", multiprocessing_context="fork")
    for epoch in range(4):
        loader.set_epoch(epoch)
        order = iter(loader.shard_sampler.rank_order().tolist())
        for images, labels in loader:  # each batch dropped before the next, so its slot is reused
            for image, label in zip(images, labels.tolist()):
                i = next(order)
                assert label == ds.targets[i] and torch.equal(image, ds[i][0])
    assert "_SlotView" in kinds
    assert kinds.count("_SlotView") > kinds.count("Tensor")
