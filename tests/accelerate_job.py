"""Hugging Face accelerate with ``make_loader``, for tests/frameworks/test_accelerate.py:

    torchrun --nproc_per_node 2 accelerate_job.py DATASET OUT

Each rank: ``accelerator.prepare(model, optimizer, make_loader(...))`` (the loader registered for
checkpointing), two training steps, ``accelerator.save_state``; then a second accelerator resumes
from that state with a new loader and trains the rest of the epoch. Also a loader rebuilt around
make_loader's pieces by accelerate's ``prepare_data_loader`` function (what ``prepare`` did before
make_loader's loaders were passed through). Rank 0 writes what every rank saw to ``OUT/seen.json``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from job_exit import end_process_group

from reader import PackedDataset, make_loader

BATCH = 3
STEPS_BEFORE_SAVE = 2


def train(accelerator: Accelerator, classes: int, dataset: PackedDataset) -> tuple:
    model = torch.nn.Linear(3 * 4 * 4, classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader(dataset, BATCH, num_workers=1, seed=3)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    accelerator.register_for_checkpointing(prepared)
    return model, optimizer, prepared, prepared is loader


def steps(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: object,
          limit: int | None = None) -> tuple[list[int], set[str]]:
    """Train on ``loader`` (at most ``limit`` steps): the record ids (labels) seen, the labels' types."""
    ids: list[int] = []
    types: set[str] = set()
    for step, (images, labels) in enumerate(loader):
        types.add(type(labels).__name__)
        loss = torch.nn.functional.cross_entropy(model(images.flatten(1).float() / 255), labels)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ids += labels.tolist()
        if limit is not None and step + 1 == limit:
            break
    return ids, types


def main(path: str, out: Path) -> None:
    dataset = PackedDataset(path)
    first = Accelerator(cpu=True)
    model, optimizer, loader, passed_through = train(first, len(dataset), dataset)
    length = len(loader)
    before, types = steps(first, model, optimizer, loader, STEPS_BEFORE_SAVE)
    first.save_state(str(out / "state"))

    second = Accelerator(cpu=True)
    model, optimizer, resumed, _ = train(second, len(dataset), dataset)
    second.load_state(str(out / "state"))
    after, more_types = steps(second, model, optimizer, resumed)

    rebuilt = prepare_data_loader(make_loader(dataset, BATCH, num_workers=1, seed=3), num_processes=1,
                                  process_index=0)
    rebuilt_types = {type(labels).__name__ for _, labels in rebuilt}
    mine = {"passed_through": passed_through, "len": length, "before": before, "after": after,
            "types": sorted(types | more_types), "rebuilt_types": sorted(rebuilt_types)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        (out / "seen.json").write_text(json.dumps(everyone))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    end_process_group()
