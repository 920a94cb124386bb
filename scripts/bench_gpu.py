"""How much of a training step waits for data, with three ways of feeding the GPU.

A training step is fed from a packed dataset by:

  plain        make_loader + ``.to(device)`` + the same augmentation in the loop, on the consumer stream
               (the copy and the augmentation are on the critical path)
  prefetcher   make_loader + reader.CUDAPrefetcher (copy and augmentation overlap the previous step)
  gpu_dataset  reader.GPUDataset (the whole dataset resident on the device; fixed-shape sets only)
  gpu_decode   JPEG sets: make_loader over PackedDataset(decode=False) (the workers only read) +
               CUDAPrefetcher, which decodes each batch with nvJPEG on the GPU, then augments it

The step (``--model``) is torchvision's ResNet-50 in bf16 autocast and channels_last where torchvision
imports (``auto``), else a conv stack whose depth is calibrated to take about ``--step-ms`` per batch;
``none`` runs no model, so that the figures are the rate at which each feed can hand over batches.
A dataset packed without a crop is read with ``--random-resized-crop SIZE`` (GPU random resized
crops, as in training). For each feed, StepTimer gives the data wait as a share of the step and
images/s. Before the feeds, the augmentation's own GPU time per batch is measured on a resident batch
(normalize, flip, crops), so that users see what it costs. The figures go to a JSON file. The target
on a GPU is a data wait under 5% of the step for prefetcher and gpu_dataset.

    .venv/bin/python scripts/bench_gpu.py /data/imagenet-224-raw --out bench_gpu.json
    .venv/bin/python scripts/bench_gpu.py /data/imagenet-256-jpeg --random-resized-crop 224
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
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reader import BatchAugment, CUDAPrefetcher, GPUDataset, PackedDataset, StepTimer  # noqa: E402
from reader.format import DatasetWriter  # noqa: E402
from reader.gpu.jpeg_batches import decode_jpegs  # noqa: E402
from reader.loader import PackedLoader, make_loader  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MODES = ("plain", "prefetcher", "gpu_dataset", "gpu_decode")
MODELS = ("auto", "resnet50", "conv", "none")
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


def resnet50(classes: int) -> nn.Module | None:
    """torchvision's ResNet-50 (random weights), or None where torchvision does not import."""
    try:
        from torchvision.models import resnet50 as make
    except Exception:  # not installed, or a build that does not match this torch
        return None
    return make(num_classes=classes)


class TrainStep:
    """Forward, cross-entropy, backward and SGD: a step of fixed device cost. ``bf16`` runs the
    forward pass under bf16 autocast (the model is channels_last on CUDA, as for mixed precision);
    no model (``model=None``) is an empty step, which measures the feed alone."""

    def __init__(self, model: nn.Module | None, device: torch.device, bf16: bool) -> None:
        self.model = model
        self.bf16 = bf16 and device.type == "cuda"
        if model is not None:
            model.to(device)
            if self.bf16:
                model.to(memory_format=torch.channels_last)
            self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        self.loss = nn.CrossEntropyLoss()

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if self.model is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss(self.model(images), labels)
        loss.backward()
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
        return seconds_per_step(TrainStep(conv_stack(depth, width, classes), device, False), images, labels)

    base = measure(1)
    depth, measured = 5, measure(5)
    for _ in range(2):
        per_block = max((measured - base) / (depth - 1), 1e-6)
        depth = int(min(400, max(2, round(1 + (target_s - base) / per_block))))
        measured = measure(depth)
    return depth, measured


class StepModel:
    """Makes the benchmark's model afresh for each feed (so each starts from the same state) and says
    what it is."""

    def __init__(self, args: argparse.Namespace, sample: Batch, classes: int, device: torch.device) -> None:
        self.classes, self.device, self.width = classes, device, args.width
        kind = args.model
        if kind == "auto":
            kind = "resnet50" if device.type == "cuda" and resnet50(classes) is not None else "conv"
        if kind == "resnet50" and resnet50(classes) is None:
            raise SystemExit("--model resnet50 needs torchvision (a build matching this torch)")
        self.kind, self.depth = kind, 0
        if kind == "conv":
            self.depth, _ = calibrate(args.step_ms / 1000, args.width, sample, classes, device)
        self.step_s = seconds_per_step(self.new(), *sample) if kind != "none" else 0.0

    def new(self) -> TrainStep:
        if self.kind == "resnet50":
            return TrainStep(resnet50(self.classes), self.device, bf16=True)
        if self.kind == "conv":
            return TrainStep(conv_stack(self.depth, self.width, self.classes), self.device, bf16=False)
        return TrainStep(None, self.device, bf16=False)

    def describe(self) -> str:
        if self.kind == "resnet50":
            return "ResNet-50, bf16 autocast, channels_last"
        if self.kind == "conv":
            return f"conv stack depth {self.depth}, width {self.width}"
        return "no model (the feed alone)"


class NaiveDeviceFeed:
    """What a plain loop does: copy each batch and augment it on the consumer stream, so the copy and
    the augmentation sit on the critical path (inside ``next()``, hence counted as data wait)."""

    def __init__(self, loader: PackedLoader, augment: BatchAugment, device: torch.device) -> None:
        self.loader = loader
        self.augment = augment
        self.device = device
        self.generator = torch.Generator(device=device)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Batch]:
        for images, labels in self.loader:
            if isinstance(images, list):
                images = [image.to(self.device, non_blocking=True) for image in images]
            else:
                images = images.to(self.device, non_blocking=True)
            yield self.augment(images, self.generator), labels.to(self.device, non_blocking=True)


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


def batch_augment(args: argparse.Namespace, bf16: bool, **options: object) -> BatchAugment:
    """The augmentation every feed applies: normalize to the model's dtype, channels_last, flip, and a
    random resized crop for a dataset packed without a crop."""
    defaults: dict = {"dtype": torch.bfloat16 if bf16 else torch.float32, "channels_last": True, "flip": True,
                      "random_resized_crop": args.random_resized_crop}
    return BatchAugment(MEAN, STD, **{**defaults, **options})


def feeds(
    dataset: PackedDataset, args: argparse.Namespace, augment: BatchAugment, device: torch.device
) -> dict[str, Callable[[], NaiveDeviceFeed | CUDAPrefetcher | GPUDataset]]:
    """A factory per mode, so each mode starts from fresh loader workers (``setup_s`` in the figures
    is the factory's time: GPUDataset's load; the loaders start their workers lazily, in warm-up)."""

    def loader(source: PackedDataset = dataset) -> PackedLoader:
        return make_loader(source, args.batch_size, num_workers=args.workers, drop_last=True)

    return {
        "plain": lambda: NaiveDeviceFeed(loader(), augment, device),
        "prefetcher": lambda: CUDAPrefetcher(loader(), augment=augment, device=device),
        "gpu_dataset": lambda: GPUDataset(dataset, device, batch_size=args.batch_size, augment=augment,
                                          drop_last=True),
        "gpu_decode": lambda: CUDAPrefetcher(loader(PackedDataset(dataset.path, decode=False)), augment=augment,
                                             device=device),
    }


def augment_costs(dataset: PackedDataset, args: argparse.Namespace, bf16: bool, device: torch.device,
                  repeats: int = 20) -> dict[str, float]:
    """The augmentation's own time per batch, in ms, on one resident batch of the dataset (``ms_per_call``):
    normalize alone, with flip, and with the crop the feeds use, so users see what each op costs."""
    images, _ = dataset.read_batch(list(range(min(args.batch_size, len(dataset)))))
    if isinstance(images, list):
        images = [image.to(device) for image in images]
    else:
        images = images.to(device)
    rrc = args.random_resized_crop or 224
    variants = {"normalize": {}, "normalize+flip": {"flip": True},
                f"normalize+flip+random_resized_crop {rrc}": {"flip": True, "random_resized_crop": rrc}}
    if args.random_resized_crop:  # the images vary in size: every variant needs the crop
        variants = {f"normalize+random_resized_crop {rrc}": {"flip": False, "random_resized_crop": rrc},
                    **{name: options for name, options in variants.items() if "random_resized_crop" in options}}
    costs = {}
    for name, options in variants.items():
        augment = batch_augment(args, bf16, **{"flip": False, "random_resized_crop": None, **options})
        generator = torch.Generator(device=device)
        costs[name] = ms_per_call(lambda: augment(images, generator), device, repeats, warmup=3)
    return costs


def decode_costs(dataset: PackedDataset, args: argparse.Namespace, device: torch.device,
                 repeats: int = 10) -> dict[str, float]:
    """A JPEG dataset's decode time per batch, in ms: ``reader.gpu.jpeg_batches.decode_jpegs`` on the
    device (its calling thread's wall time: torchvision's GPU decode returns once the batch is
    decoded), and libjpeg-turbo on one core of the host, as the loader's workers decode."""
    indices = list(range(min(args.batch_size, len(dataset))))
    payloads, _ = PackedDataset(dataset.path, decode=False).read_batch(indices)
    on_device = ms_per_call(lambda: decode_jpegs(payloads, device), device, repeats, warmup=2)
    on_host = ms_per_call(lambda: dataset.read_batch(indices), device, repeats)
    return {f"decode_jpegs on {device.type}": on_device, "read_batch, decoded on one host core": on_host}


def ms_per_call(call: Callable[[], object], device: torch.device, repeats: int, warmup: int = 0) -> float:
    """The mean wall time of ``repeats`` calls of ``call``, in ms, after ``warmup`` untimed ones, the
    device synchronized before and after (so that the work the calls queue there counts)."""
    for _ in range(warmup):
        call()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    synchronize(device)
    return 1000 * (time.perf_counter() - start) / repeats


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="packed dataset directory")
    parser.add_argument("--smoke", action="store_true", help="tiny model and sizes; makes a tiny dataset if no path")
    parser.add_argument("--batch-size", type=int, default=None, help="default 256 (smoke: 16)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per mode, default 100 (smoke: 6)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured first steps, default 10 (smoke: 2)")
    parser.add_argument("--workers", type=int, default=None, help="loader workers (default: make_loader's)")
    parser.add_argument("--model", choices=MODELS, default="auto",
                        help="the training step: auto (resnet50 on CUDA where torchvision imports, else conv)")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="conv model's target step time, default 30 (smoke: 20)")
    parser.add_argument("--width", type=int, default=None, help="conv model's channels, default 128 (smoke: 8)")
    parser.add_argument("--random-resized-crop", type=int, default=None, metavar="SIZE",
                        help="GPU random resized crops to SIZE (needed for a dataset packed without a crop)")
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
    shape = dataset.manifest.shape
    if shape is None and args.random_resized_crop is None:
        raise SystemExit(f"{path}: records vary in size; give --random-resized-crop SIZE (or pack with a crop)")
    out_shape = (3, args.random_resized_crop, args.random_resized_crop) if args.random_resized_crop else tuple(shape)
    classes = len(dataset.manifest.classes)
    sample = (torch.randn(args.batch_size, *out_shape, device=device),
              torch.randint(0, classes, (args.batch_size,), device=device))
    model = StepModel(args, sample, classes, device)
    bf16 = model.kind == "resnet50"
    sample = (sample[0].to(torch.bfloat16 if bf16 else torch.float32).contiguous(memory_format=torch.channels_last),
              sample[1])
    print(f"device {device}: {model.describe()}: {1000 * model.step_s:.1f} ms per step at batch {args.batch_size}, "
          f"{out_shape[1]}x{out_shape[2]}")
    costs = augment_costs(dataset, args, bf16, device)
    for name, ms in costs.items():
        print(f"augmentation {name}: {ms:.2f} ms per batch of {args.batch_size}")
    decoding = {}
    if dataset.manifest.encoding == "jpeg":
        decoding = decode_costs(dataset, args, device)
        for name, ms in decoding.items():
            print(f"{name}: {ms:.2f} ms per batch of {args.batch_size}")
    results: dict = {
        "dataset": str(path), "decode_ms_per_batch": decoding, "records": len(dataset), "shape": shape,
        "batch_size": args.batch_size,
        "encoding": dataset.manifest.encoding, "random_resized_crop": args.random_resized_crop,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cuda": device.type == "cuda", "torch": torch.__version__, "model": model.describe(),
        "calibrated_step_ms": 1000 * model.step_s, "augment_ms_per_batch": costs,
        "workers": args.workers, "modes": {},
    }
    augment = batch_augment(args, bf16)
    factories = feeds(dataset, args, augment, device)
    for mode in args.modes.split(","):
        if mode == "gpu_dataset" and shape is None:
            print("\n== gpu_dataset: skipped (GPUDataset holds fixed-shape datasets only)")
            continue
        if mode == "gpu_decode" and dataset.manifest.encoding != "jpeg":
            print(f"\n== gpu_decode: skipped (a {dataset.manifest.encoding} dataset has nothing to decode)")
            continue
        step = model.new()
        start = time.perf_counter()
        feed = factories[mode]()
        setup_s = time.perf_counter() - start
        timer = run_mode(feed, step, args.steps, args.warmup)
        summary = timer.summary()
        results["modes"][mode] = {
            "steps": summary.steps, "images_per_s": summary.images_per_s, "wait_share": summary.wait_share,
            "data_wait_ms_per_step": 1000 * summary.data_wait_s / max(summary.steps, 1),
            "compute_ms_per_step": 1000 * summary.compute_s / max(summary.steps, 1),
            "preparing_ms_per_step": 1000 * summary.preparing_s / max(summary.steps, 1), "setup_s": setup_s,
        }
        print(f"\n== {mode} (setup {setup_s:.2f} s)\n{summary.report()}")
        del feed
    return results


def print_table(results: dict) -> None:
    print(f"\n{'mode':<12} {'images/s':>10} {'wait ms/step':>13} {'prep ms/step':>13} {'step ms':>8} "
          f"{'wait share':>11}")
    for mode, r in results["modes"].items():
        flag = ""
        if results["cuda"] and mode != "plain" and results["calibrated_step_ms"] > 0:
            flag = "  ok (< 5%)" if r["wait_share"] < TARGET_WAIT_SHARE else "  ABOVE the 5% target"
        step_ms = r["data_wait_ms_per_step"] + r["compute_ms_per_step"] + r["preparing_ms_per_step"]
        print(f"{mode:<12} {r['images_per_s']:>10,.0f} {r['data_wait_ms_per_step']:>13.2f} "
              f"{r['preparing_ms_per_step']:>13.2f} {step_ms:>8.1f} {r['wait_share']:>10.1%}{flag}")
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
