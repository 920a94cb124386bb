"""A Lightning training run interrupted mid-epoch twice and resumed, for tests/frameworks/test_lightning_resume.py.

    python lightning_resume_job.py DATASET OUT WORLD              # WORLD 1
    torchrun --nproc_per_node 2 lightning_resume_job.py DATASET OUT 2

The dataset's label is each record's id. Every training step gathers the ids of all ranks' batches and
the module keeps them, per epoch, in its checkpoints, so the last run's list is exactly what the chain
of checkpoints trained. The loader is built where Lightning's docs say, in ``train_dataloader()``
(after the process group exists). One ``Trainer`` after another, in this process:

- ``early``: a loader built before ``fit`` (no process group yet) is refused at its first batch when
  there are several ranks (``RuntimeError``, written to ``OUT/early.txt``);
- ``stop``: ``fit`` with ``max_steps`` ending mid-epoch 0, ``ModelCheckpoint`` saving that last step to
  ``OUT/stopped.ckpt`` (as a time-limited job does). Not ``trainer.save_checkpoint`` after ``fit``
  returned: by then Lightning has counted the epoch as finished, and resumes with the next one;
- ``crash``: ``fit(ckpt_path=stopped.ckpt)``; ``ModelCheckpoint`` saves ``OUT/crashed.ckpt`` mid-epoch 1,
  then a callback raises ``RuntimeError("stopped on purpose")`` two steps later (those steps are lost);
- ``finish``: ``fit(ckpt_path=crashed.ckpt)`` to the end of ``EPOCHS`` epochs; rank 0 writes
  ``OUT/seen.json`` (``{"seen": [[epoch, ids], ...], "global_step", "steps_per_epoch", "crash"}``).
"""
from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import lightning
import torch
from job_exit import end_process_group
from lightning.pytorch.callbacks import ModelCheckpoint

from reader import PackedDataset, make_loader

BATCH = 3
EPOCHS = 3
STOP_STEP = 2  # mid-epoch 0 on one rank and on two
SEED = 4


class IdRecorder(lightning.LightningModule):
    """A linear layer over the images; remembers the record ids (labels) every step trained, all ranks'."""

    def __init__(self, dataset: PackedDataset) -> None:
        super().__init__()
        self.dataset = dataset
        self.layer = torch.nn.Linear(3 * 4 * 4, len(dataset))
        self.seen: list[list] = []

    def train_dataloader(self) -> object:
        return make_loader(self.dataset, BATCH, num_workers=1, seed=SEED)  # ranks from torch.distributed

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        everyone = self.all_gather(labels).reshape(-1)
        self.seen.append([self.current_epoch, everyone.tolist()])
        logits = self.layer(images.flatten(1).float() / 255)
        return torch.nn.functional.cross_entropy(logits, labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["seen"] = self.seen

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.seen = checkpoint["seen"]


class CrashAt(lightning.Callback):
    """Raises once ``global_step`` reaches ``step`` (after ModelCheckpoint saved an earlier step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: lightning.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("stopped on purpose")


def trainer(world: int, callbacks: list[lightning.Callback], max_steps: int = -1) -> lightning.Trainer:
    return lightning.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", use_distributed_sampler=False,
        max_epochs=EPOCHS, max_steps=max_steps, callbacks=callbacks, logger=False,
        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False)


def main(dataset: str, out: Path, world: int) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    ds = PackedDataset(dataset)
    steps_per_epoch = -(-(len(ds) // world) // BATCH)
    checkpoint_step = steps_per_epoch + 1  # mid-epoch 1
    if world > 1:
        early = make_loader(ds, BATCH, num_workers=0, seed=SEED)
        try:
            trainer(world, []).fit(IdRecorder(ds), train_dataloaders=early)
        except RuntimeError as error:
            (out / "early.txt").write_text(str(error))

    stopped = trainer(world, [ModelCheckpoint(dirpath=out, filename="stopped", every_n_train_steps=STOP_STEP)],
                      max_steps=STOP_STEP)
    stopped.fit(IdRecorder(ds))

    crashing = trainer(world, [ModelCheckpoint(dirpath=out, filename="crashed", every_n_train_steps=checkpoint_step),
                               CrashAt(checkpoint_step + 2)])
    crash = "no exception"
    try:
        crashing.fit(IdRecorder(ds), ckpt_path=out / "stopped.ckpt")
    except RuntimeError as error:
        crash = str(error)

    finishing = trainer(world, [])
    model = IdRecorder(ds)
    finishing.fit(model, ckpt_path=out / "crashed.ckpt")
    if finishing.is_global_zero:
        (out / "seen.json").write_text(json.dumps({"seen": model.seen, "global_step": finishing.global_step,
                                                   "steps_per_epoch": steps_per_epoch, "crash": crash}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
    end_process_group()
