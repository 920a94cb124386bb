#!/usr/bin/env python
"""torchvision's ``references/classification/train.py``, ported to packed datasets: the essentials.

    torchrun --nproc_per_node N scripts/train_classification.py --train TRAIN --val VAL --output-dir OUT
    (or plain ``python scripts/train_classification.py ...`` for one process)

What changes from the reference, and why:

- data: ``make_loader`` splits every epoch between the ranks itself (no ``DistributedSampler``, no
  ``sampler.set_epoch``: ``prefetcher.set_epoch`` does it), and ``CUDAPrefetcher`` copies each batch to
  the device and normalizes (and flips) it there, so the loader ships uint8 and the workers only read;
- evaluation: ``make_loader(evaluation=True)`` pads the ranks' shares to the same length and marks the
  padding ``valid=False``; sums of ``metric * valid`` over the ranks count each sample exactly once,
  and the script checks that the count is the validation set's size (the reference only warns);
- checkpoints: besides model, optimizer, scheduler and epoch, they hold ``prefetcher.state_dict()``,
  and ``--checkpoint-every`` saves one mid-epoch; ``--resume`` continues after the last batch the saved
  run trained, with the same batches and augmentation draws as an uninterrupted run. ``len(prefetcher)``
  is the whole epoch's batch count, also when resumed mid-epoch; the loop counts from the saved batch;
- steady batches: ``gc.freeze()`` once everything is built, so that the training process's garbage
  collections skip torch's objects (docs/reading.md, "Steady batches");
- the model: a small CNN written here (``--width``), so that the recipe runs without torchvision; put
  ``torchvision.models.get_model(args.model, num_classes=...)`` in ``make_model`` for the real thing.

``--max-steps`` stops after that many training steps in all (saving a checkpoint first), like a job
that runs out of time; ``--resume OUT/checkpoint.pth`` then carries on.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path
from typing import Callable, cast

import torch
import torch.distributed as dist

from reader import CUDAPrefetcher, PackedDataset, make_loader

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", required=True, help="packed training dataset (packer pack output)")
    parser.add_argument("--val", required=True, help="packed validation dataset")
    parser.add_argument("--output-dir", required=True, help="where checkpoint.pth (and model_E.pth) go")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("-b", "--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("-j", "--workers", type=int, default=None, help="loader workers per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay")
    parser.add_argument("--lr-step-size", type=int, default=30)
    parser.add_argument("--lr-gamma", type=float, default=0.1)
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--width", type=int, default=64, help="channels of the small CNN")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda where torch sees a GPU (one for each process of the node), else cpu")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed, the same on every rank")
    parser.add_argument("--print-freq", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="also save every N steps, mid-epoch")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after N training steps in all")
    parser.add_argument("--resume", default="", help="a checkpoint.pth to continue from")
    parser.add_argument("--test-only", action="store_true")
    return parser.parse_args(argv)


def init_distributed(choice: str) -> tuple[int, int, torch.device]:
    """torchrun's environment -> ``(rank, world_size, device)``; one process without it. ``choice``:
    ``cuda`` (one GPU per process of the node), ``cpu``, or ``auto`` (cuda where torch sees a GPU, else
    cpu). Cuda with fewer GPUs than processes is one line saying so, not torch's "invalid device
    ordinal" from the rank without a GPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = choice == "cuda" or (choice == "auto" and gpus > 0)
    if cuda and gpus < processes:
        advice = (f"run one process per GPU (torchrun --nproc_per_node={gpus}) or pass --device cpu" if gpus
                  else "pass --device cpu, or install a CUDA build of torch")
        raise SystemExit(f"--device {choice}: {processes} process(es) on this node but torch sees {gpus} GPU(s); "
                         + advice)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        return 0, 1, device
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def make_model(num_classes: int, width: int) -> torch.nn.Module:
    """A small CNN (the recipe's ``torchvision.models.get_model`` goes here)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.BatchNorm2d(width), torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), torch.nn.BatchNorm2d(2 * width),
        torch.nn.ReLU(inplace=True), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(2 * width, num_classes))


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """``values`` summed over the ranks (as they are without torch.distributed)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()


def save(path: Path, state: dict, rank: int) -> None:
    """Rank 0 writes ``state`` (a temporary file renamed over ``path``: a crash never leaves half a file)."""
    if rank == 0:
        partial = path.with_suffix(".tmp")
        torch.save(state, partial)
        partial.replace(path)


def train_one_epoch(model: torch.nn.Module, criterion: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    prefetcher: CUDAPrefetcher, epoch: int, args: argparse.Namespace,
                    checkpoint: Callable[[dict, int], dict], rank: int, steps_done: int) -> int:
    """One epoch (or its rest, when resumed mid-epoch); returns the training steps done in all."""
    model.train()
    first = prefetcher.state_dict()["batches"]  # 0, or the batches the resumed run had trained
    samples = correct = loss_sum = 0.0
    start = time.time()
    for step, (images, labels) in enumerate(prefetcher, start=first):
        output = model(images)
        loss = criterion(output, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps_done += 1
        samples += len(labels)
        correct += (output.argmax(1) == labels).sum().item()
        loss_sum += loss.item() * len(labels)
        if step % args.print_freq == 0 and rank == 0:
            print(f"Epoch: [{epoch}] [{step}/{len(prefetcher)}] loss {loss.item():.4f}", flush=True)
        stop = args.max_steps and steps_done >= args.max_steps
        if stop or (args.checkpoint_every and steps_done % args.checkpoint_every == 0):
            save(Path(args.output_dir) / "checkpoint.pth", checkpoint(prefetcher.state_dict(), steps_done), rank)
        if stop:
            break
    samples, correct, loss_sum = all_sum([samples, correct, loss_sum], prefetcher.device)
    if rank == 0:
        print(f"Epoch: [{epoch}] trained {int(samples)} samples in this run, batches {first}.., "
              f"loss {loss_sum / max(samples, 1):.4f} acc {100 * correct / max(samples, 1):.2f} "
              f"({time.time() - start:.1f} s)", flush=True)
    return steps_done


def evaluate(model: torch.nn.Module, prefetcher: CUDAPrefetcher, dataset_size: int, rank: int) -> float:
    """Top-1 accuracy over the validation set, each sample counted exactly once across the ranks."""
    model.eval()
    counted = correct = loss_sum = 0.0
    with torch.inference_mode():
        for batch in prefetcher:
            images, labels, _, valid = cast(tuple[torch.Tensor, ...], batch)
            output = model(images)
            losses = torch.nn.functional.cross_entropy(output, labels, reduction="none")
            counted += valid.sum().item()
            correct += ((output.argmax(1) == labels) & valid).sum().item()
            loss_sum += (losses * valid).sum().item()
    counted, correct, loss_sum = all_sum([counted, correct, loss_sum], prefetcher.device)
    if counted != dataset_size:
        raise RuntimeError(f"the validation counted {counted:.0f} samples, the dataset has {dataset_size}")
    if rank == 0:
        print(f"Test: evaluated {int(counted)} samples, loss {loss_sum / counted:.4f} "
              f"Acc@1 {100 * correct / counted:.3f}", flush=True)
    return correct / counted


def main(args: argparse.Namespace) -> None:
    rank, world_size, device = init_distributed(args.device)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    train_set, val_set = PackedDataset(args.train), PackedDataset(args.val)
    train = CUDAPrefetcher(make_loader(train_set, args.batch_size, num_workers=args.workers, seed=args.seed),
                           MEAN, STD, device=device, seed=args.seed, flip=True)
    val = CUDAPrefetcher(make_loader(val_set, args.batch_size, num_workers=args.workers, evaluation=True),
                         MEAN, STD, device=device)

    model = make_model(len(train_set.classes), args.width).to(device)
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_step_size, gamma=args.lr_gamma)
    bare = cast(torch.nn.Module, model.module if world_size > 1 else model)

    start_epoch, steps_done = 0, 0
    if args.resume:
        saved = torch.load(args.resume, map_location="cpu", weights_only=True)
        bare.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["lr_scheduler"])
        train.load_state_dict(saved["prefetcher"])
        start_epoch, steps_done = saved["epoch"], saved["steps"]
    gc.freeze()  # full collections skip everything built so far (docs/reading.md, "Steady batches")
    if args.test_only:
        evaluate(model, val, len(val_set), rank)
        return

    def checkpoint(position: dict, steps: int) -> dict:
        return {"model": bare.state_dict(), "optimizer": optimizer.state_dict(), "lr_scheduler": scheduler.state_dict(),
                "prefetcher": position, "epoch": position["epoch"], "steps": steps, "args": vars(args)}

    for epoch in range(start_epoch, args.epochs):
        train.set_epoch(epoch)  # keeps a resumed position in this epoch
        steps_done = train_one_epoch(model, criterion, optimizer, train, epoch, args, checkpoint, rank, steps_done)
        if args.max_steps and steps_done >= args.max_steps:
            if rank == 0:
                print(f"stopped after {steps_done} steps (--max-steps)", flush=True)
            break
        scheduler.step()
        evaluate(model, val, len(val_set), rank)
        save(Path(args.output_dir) / "checkpoint.pth", checkpoint(train.state_dict(), steps_done), rank)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
