"""Lightning (the optional ``lightning`` extra): ``Trainer.fit`` on the CPU from ``make_loader`` with the
default settings, and a clear refusal when Lightning re-creates the loader around its own sampler."""
from __future__ import annotations

import logging

import pytest
import torch
from reader_helpers import make_images, pack_images
from torch.utils.data.distributed import DistributedSampler

from reader import PackedDataset, make_loader

lightning = pytest.importorskip("lightning")
from lightning.pytorch.utilities.data import _update_dataloader  # noqa: E402  (after the import check)

COUNT = 14
BATCH = 4


class TinyClassifier(lightning.LightningModule):
    """A linear layer over 4x4 images; remembers the labels of every training batch, per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3 * 4 * 4, 3)
        self.seen: dict[int, list[list[int]]] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        self.seen.setdefault(self.current_epoch, []).append(labels.tolist())
        logits = self.layer(images.flatten(1).float() / 255)
        return torch.nn.functional.cross_entropy(logits, labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> PackedDataset:
    path = pack_images(tmp_path_factory.mktemp("lightning") / "packed", make_images(COUNT, [(4, 4)]),
                       [i % 3 for i in range(COUNT)], storage="lmdb", encoding="raw", records_per_shard=5).path
    return PackedDataset(path)


def test_trainer_fit_on_cpu_with_default_settings(ds):
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    loader = make_loader(ds, BATCH, num_workers=0, seed=2)
    model = TinyClassifier()
    before = model.layer.weight.detach().clone()
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train_dataloaders=loader)
    assert trainer.global_step == 2 * len(loader) == 8
    assert not torch.equal(model.layer.weight.detach(), before), "the model trained"
    for epoch in (0, 1):  # Lightning calls the sampler's set_epoch: each epoch is that epoch's order
        order = loader.shard_sampler.rank_order(epoch)
        expected = ds.targets[order].tolist()
        assert model.seen[epoch] == [expected[i:i + BATCH] for i in range(0, COUNT, BATCH)]
    assert model.seen[0] != model.seen[1]


def test_lightning_reinstantiation_names_the_setting(ds):
    """What Lightning's Trainer does with use_distributed_sampler=True under DDP: re-create the loader
    around a DistributedSampler."""
    loader = make_loader(ds, BATCH, num_workers=0)
    with pytest.raises(TypeError, match=r"got DistributedSampler: .* Trainer\(use_distributed_sampler=False\)"):
        _update_dataloader(loader, DistributedSampler(loader.dataset, num_replicas=2, rank=0))
