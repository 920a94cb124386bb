"""Lightning's own DDP launcher, not torchrun, for tests/frameworks/test_lightning_ranks.py.

    python lightning_ranks_job.py DATASET OUT

``Trainer(devices=2, strategy="ddp")`` on the CPU starts the second rank itself, running this script
again with an environment that holds no ``LOCAL_WORLD_SIZE``. Each rank builds its loader where
Lightning's docs say (``train_dataloader()``), trains one step, and writes ``OUT/rank{R}.json``:
``LOCAL_WORLD_SIZE`` as it found it and ``ranks_on_this_node()`` once its loader was made.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path

import lightning
import torch
from job_exit import end_process_group

from reader import PackedDataset, make_loader
from reader.ranks import ranks_on_this_node


class OneStep(lightning.LightningModule):
    """A linear layer over 4x4 images; notes what its rank knew of the node when its loader was made."""

    def __init__(self, dataset: str, out: Path) -> None:
        super().__init__()
        self.dataset, self.out = dataset, out
        self.layer = torch.nn.Linear(3 * 4 * 4, 2)

    def train_dataloader(self) -> object:
        loader = make_loader(PackedDataset(self.dataset), 2, num_workers=0)
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(
            {"LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE"), "ranks_on_this_node": ranks_on_this_node()}))
        return loader

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.layer(images.flatten(1).float() / 255), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(dataset: str, out: Path) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp", use_distributed_sampler=False,
                                max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False)
    trainer.fit(OneStep(dataset, out))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    end_process_group()
