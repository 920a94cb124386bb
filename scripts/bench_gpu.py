"""How much of a training step waits for data, with three ways of feeding the GPU.

A synthetic training step of known cost (a conv stack, depth calibrated at start to take about
``--step-ms`` per batch) is fed from a packed dataset by:

  plain        make_loader + ``.to(device)`` + normalize in the loop (the copy is on the critical path)
  prefetcher   make_loader + reader.CUDAPrefetcher (copy and normalize overlap the previous step)
  gpu_dataset  reader.GPUDataset (the whole dataset resident on the device)

For each, StepTimer gives the data wait as a share of the step and images/s; the figures go to a JSON
file. The target on a GPU is a data wait under 5% of the step for prefetcher and gpu_dataset.

    .venv/bin/python scripts/bench_gpu.py /data/imagenet-224-raw --out bench_gpu.json
    .venv/bin/python scripts/bench_gpu.py --smoke        # CPU-sized check on a tiny generated dataset

Without CUDA everything runs on the CPU with a tiny model: a smoke check, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reader import CUDAPrefetcher, GPUDataset, PackedDataset, StepTimer  # noqa: E402
from reader.format import DatasetWriter  # noqa: E402
from reader.loader import PackedLoader, make_loader  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MODES = ("plain", "prefetcher", "gpu_dataset")
TARGET_WAIT_SHARE = 0.05
Batch = tuple[torch.Tensor, torch.Tensor]


def make_tiny_dataset(dst: Path, count: int, size: int, classes: int = 10) -> Path:
    """A raw LMDB dataset of ``count`` random ``size``x``size`` images, written through reader.format."""
    rng = np.random.default_rng(0)
    writer = DatasetWriter(dst, "lmdb", shard_size=1 << 40)  # one shard
    for i in range(count):
        writer.add(rng.integers(0, 256, (3, size, size), dtype=np.uint8).tobytes(), i % classes, size, size,
                   source=f"synthetic/{i}")
    writer.finish(encoding="raw", shape=[3, size, size], classes=[f"class{c}" for c in range(classes)],
                  transform={}, source={"kind": "synthetic"}, tool_version="bench_gpu")
    return dst


def conv_stack(depth: int, width: int, classes: int) -> nn.Module:
    """A stride-4 stem, ``depth`` 3x3 conv+ReLU blocks at ``width`` channels, pooled linear head."""
    blocks: list[nn.Module] = [nn.Conv2d(3, width, 4, stride=4), nn.ReLU(inplace=True)]
    for _ in range(depth):
        blocks += [nn.Conv2d(width, width, 3, padding=1), nn.ReLU(inplace=True)]
    blocks += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)]
    return nn.Sequential(*blocks)


class TrainStep:
    """Forward, cross-entropy, backward and SGD on a conv stack: a step of fixed device cost."""

    def __init__(self, depth: int, width: int, classes: int, device: torch.device) -> None:
        self.model = conv_stack(depth, width, classes).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.loss = nn.CrossEntropyLoss()

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(self.model(images), labels).backward()
        self.optimizer.step()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_step(step: TrainStep, images: torch.Tensor, labels: torch.Tensor, repeats: int = 7) -> float:
    """The fastest of ``repeats`` timed calls of ``step`` on a resident batch (after two warm-up
    calls): the minimum is robust to other processes sharing the machine."""
    for _ in range(2):
        step(images, labels)
    times = []
    for _ in range(repeats):
        synchronize(images.device)
        start = time.perf_counter()
        step(images, labels)
        synchronize(images.device)
        times.append(time.perf_counter() - start)
    return min(times)


def calibrate(target_s: float, width: int, batch: Batch, classes: int, device: torch.device) -> tuple[int, float]:
    """The conv-stack depth whose step takes about ``target_s``, and the time measured at that depth.

    Step time is close to linear in depth: fit it on depths 1 and 5, then refit once on the chosen
    depth to correct the extrapolation.
    """
    images, labels = batch

    def measure(depth: int) -> float:
        return seconds_per_step(TrainStep(depth, width, classes, device), images, labels)

    base = measure(1)
    depth, measured = 5, measure(5)
    for _ in range(2):
        per_block = max((measured - base) / (depth - 1), 1e-6)
        depth = int(min(400, max(2, round(1 + (target_s - base) / per_block))))
        measured = measure(depth)
    return depth, measured


class NaiveDeviceFeed:
    """What a plain loop does: copy each batch and normalize it on the consumer stream, so the copy
    and the conversion sit on the critical path (inside ``next()``, hence counted as data wait)."""

    def __init__(self, loader: Iterable[Batch], device: torch.device) -> None:
        self.loader = loader
        self.device = device
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Batch]:
        for images, labels in self.loader:
            images = images.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
            yield images, labels.to(self.device, non_blocking=True)


def run_mode(
    feed: NaiveDeviceFeed | CUDAPrefetcher | GPUDataset, step: TrainStep, steps: int, warmup: int
) -> StepTimer:
    """Run ``warmup + steps`` training steps fed by ``feed`` (re-iterated as epochs as needed)."""
    timer = StepTimer(warmup_steps=warmup)
    done = 0
    epoch = 0
    while done < steps + warmup:
        feed.set_epoch(epoch)
        for images, labels in timer.wrap(feed):
            step(images, labels)
            done += 1
            if done == steps + warmup:
                break
        epoch += 1
    return timer


def feeds(
    dataset: PackedDataset, args: argparse.Namespace, device: torch.device
) -> dict[str, Callable[[], NaiveDeviceFeed | CUDAPrefetcher | GPUDataset]]:
    """A factory per mode, so each mode starts from fresh loader workers (``setup_s`` in the figures
    is the factory's time: GPUDataset's load; the loaders start their workers lazily, in warm-up)."""

    def loader() -> PackedLoader:
        return make_loader(dataset, args.batch_size, num_workers=args.workers, drop_last=True)

    return {
        "plain": lambda: NaiveDeviceFeed(loader(), device),
        "prefetcher": lambda: CUDAPrefetcher(loader(), MEAN, STD, device=device),
        "gpu_dataset": lambda: GPUDataset(dataset, device, batch_size=args.batch_size, mean=MEAN, std=STD,
                                          drop_last=True),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="packed dataset directory (fixed-shape records)")
    parser.add_argument("--smoke", action="store_true", help="tiny model and sizes; makes a tiny dataset if no path")
    parser.add_argument("--batch-size", type=int, default=None, help="default 256 (smoke: 16)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per mode, default 100 (smoke: 6)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured first steps, default 10 (smoke: 2)")
    parser.add_argument("--workers", type=int, default=None, help="loader workers (default: make_loader's)")
    parser.add_argument("--step-ms", type=float, default=None, help="target step time, default 30 (smoke: 20)")
    parser.add_argument("--width", type=int, default=None, help="conv channels, default 128 (smoke: 8)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--out", default="bench_gpu.json", help="JSON file for the figures")
    args = parser.parse_args()
    smoke = args.smoke
    defaults = {"batch_size": 16 if smoke else 256, "steps": 6 if smoke else 100, "warmup": 2 if smoke else 10,
                "step_ms": 20.0 if smoke else 30.0, "width": 8 if smoke else 128}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    if args.path is None and not smoke:
        parser.error("give a packed dataset path (or --smoke to generate a tiny one)")
    return args


def bench(args: argparse.Namespace, path: Path) -> dict:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        print("No CUDA device: running on the CPU. These figures are a smoke check, not GPU results.")
        torch.set_num_threads(1)  # leave the other cores to the loader workers; steadier step times
    torch.backends.cudnn.benchmark = True
    dataset = PackedDataset(path)
    if dataset.manifest.shape is None:
        raise SystemExit(f"{path}: records vary in size; the benchmark needs a dataset packed with a crop")
    classes = len(dataset.manifest.classes)
    shape = tuple(dataset.manifest.shape)
    sample = (torch.randn(args.batch_size, *shape, device=device),
              torch.randint(0, classes, (args.batch_size,), device=device))
    depth, step_s = calibrate(args.step_ms / 1000, args.width, sample, classes, device)
    print(f"device {device}: conv stack depth {depth}, width {args.width}: {1000 * step_s:.1f} ms per step "
          f"at batch {args.batch_size}, {shape[1]}x{shape[2]} (target {args.step_ms:.0f} ms)")
    results: dict = {
        "dataset": str(path), "records": len(dataset), "shape": list(shape), "batch_size": args.batch_size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cuda": device.type == "cuda", "torch": torch.__version__, "depth": depth, "width": args.width,
        "calibrated_step_ms": 1000 * step_s, "modes": {},
    }
    factories = feeds(dataset, args, device)
    for mode in args.modes.split(","):
        step = TrainStep(depth, args.width, classes, device)
        start = time.perf_counter()
        feed = factories[mode]()
        setup_s = time.perf_counter() - start
        timer = run_mode(feed, step, args.steps, args.warmup)
        summary = timer.summary()
        results["modes"][mode] = {
            "steps": summary.steps, "images_per_s": summary.images_per_s, "wait_share": summary.wait_share,
            "data_wait_ms_per_step": 1000 * summary.data_wait_s / max(summary.steps, 1),
            "compute_ms_per_step": 1000 * summary.compute_s / max(summary.steps, 1), "setup_s": setup_s,
        }
        print(f"\n== {mode} (setup {setup_s:.2f} s)\n{summary.report()}")
        del feed
    return results


def print_table(results: dict) -> None:
    print(f"\n{'mode':<12} {'images/s':>10} {'wait ms/step':>13} {'step ms':>8} {'wait share':>11}")
    for mode, r in results["modes"].items():
        flag = ""
        if results["cuda"] and mode != "plain":
            flag = "  ok (< 5%)" if r["wait_share"] < TARGET_WAIT_SHARE else "  ABOVE the 5% target"
        step_ms = r["data_wait_ms_per_step"] + r["compute_ms_per_step"]
        print(f"{mode:<12} {r['images_per_s']:>10,.0f} {r['data_wait_ms_per_step']:>13.2f} {step_ms:>8.1f} "
              f"{r['wait_share']:>10.1%}{flag}")
    if not results["cuda"]:
        print("(no CUDA: CPU smoke check only)")


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.path) if args.path else make_tiny_dataset(Path(tmp), 128, 32)
        results = bench(args, path)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"figures written to {args.out}")


if __name__ == "__main__":
    main()
