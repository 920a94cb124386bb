"""``packer bench``: is loading my bottleneck, and what would packing buy me?

Reads a packed dataset through ``reader.make_loader`` for a few epochs per (order, workers) setting and
measures, per epoch: images/s, MB/s of shard bytes, the first batch's latency (worker start-up in
epoch 1, the stall at each later epoch's start) and the RSS of every loader worker. With a baseline
folder it runs an ImageFolder-style reader on the original images in the same run: one PIL open plus
the same pre-transform per item, the same batch size and workers, the default collate.
With ``model_ms`` each step also sleeps that long, standing in for a training step on the GPU, and
``reader.StepTimer`` reports the share of the step spent waiting for data.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from packer.image.transforms import TransformSpec, load_image
from packer.source.scan import scan_source
from reader import PackedDataset, StepTimer, make_loader


@dataclass(frozen=True)
class Settings:
    """How every setting is timed: batch size, epochs, an optional simulated step, cold epochs."""

    batch_size: int
    epochs: int
    model_ms: float | None = None
    cold: bool = False


@dataclass(frozen=True)
class EpochFigures:
    """One epoch of one reader setting."""

    reader: str
    order: str
    workers: int
    epoch: int
    images: int
    seconds: float
    images_per_s: float
    mb_per_s: float
    first_batch_ms: float
    worker_private_mb: tuple[float, ...]
    worker_shared_mb: tuple[float, ...]
    wait_share: float | None


class FolderDataset(Dataset):
    """The baseline: an image folder read the usual way, one PIL open and pre-transform per item."""

    def __init__(self, src: str | os.PathLike, spec: TransformSpec) -> None:
        plan = scan_source(src, labels=None, on_error="fail")
        self.root = plan.root
        self.paths = np.array(plan.paths)
        self.labels = plan.labels
        self.spec = spec

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        img = load_image(self.root / str(self.paths[index]), self.spec)
        return torch.from_numpy(np.asarray(img).transpose(2, 0, 1).copy()), int(self.labels[index])


def bench_packed(
    path: str | os.PathLike, settings: Settings, *, orders: Sequence[str], workers: Sequence[int]
) -> list[EpochFigures]:
    """Figures for every epoch of every (order, workers) setting on the packed dataset at ``path``."""
    dataset = PackedDataset(path)
    bytes_per_record = dataset.manifest.total_bytes / max(1, len(dataset))
    label = f"{Path(path).name}: {dataset.manifest.storage} {dataset.manifest.encoding}"
    results = []
    for order in orders:
        for n in workers:
            loader = make_loader(dataset, settings.batch_size, num_workers=n, order=order, seed=0)
            results += _run_epochs(loader, settings, label, order, n, bytes_per_record)
            del loader
    return results


def bench_folder(
    src: str | os.PathLike, spec: TransformSpec, settings: Settings, *, workers: Sequence[int]
) -> list[EpochFigures]:
    """The same figures for the ImageFolder-style baseline, shuffled, on the source folder."""
    dataset = FolderDataset(src, spec)
    sizes = [os.path.getsize(dataset.root / str(p)) for p in dataset.paths]
    bytes_per_record = sum(sizes) / max(1, len(sizes))
    results = []
    for n in workers:
        loader = DataLoader(
            dataset, settings.batch_size, shuffle=True, num_workers=n, persistent_workers=n > 0,
            generator=torch.Generator().manual_seed(0),
        )
        results += _run_epochs(loader, settings, "folder (PIL per item)", "random", n, bytes_per_record)
        del loader
    return results


def _run_epochs(
    loader: Iterable, settings: Settings, reader: str, order: str, workers: int, bytes_per_record: float
) -> list[EpochFigures]:
    figures = []
    for epoch in range(settings.epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        if settings.cold:
            drop_page_cache()
        timer = StepTimer(sync=False, warmup_steps=1)
        images, first_batch = 0, None
        start = time.perf_counter()
        for _, labels in timer.wrap(loader):
            if first_batch is None:
                first_batch = time.perf_counter() - start
            images += len(labels)
            if settings.model_ms:
                time.sleep(settings.model_ms / 1000)
        seconds = time.perf_counter() - start
        figures.append(EpochFigures(
            reader=reader, order=order, workers=workers, epoch=epoch + 1, images=images,
            seconds=seconds, images_per_s=images / seconds,
            mb_per_s=images * bytes_per_record / seconds / 1e6,
            first_batch_ms=1000 * (first_batch or 0.0), **worker_memory_mb(),
            wait_share=timer.summary().wait_share if settings.model_ms else None,
        ))
    return figures


def drop_page_cache() -> None:
    """Empty the page cache so the next epoch reads from the disk (root only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        raise PermissionError(f"--cold needs root to drop the page cache ({e})") from None


def worker_memory_mb() -> dict[str, tuple[float, ...]]:
    """Resident memory of this process's children (the loader's workers), in MB, split in two:
    private (``RssAnon``: what would grow if workers copied the dataset's objects) and shared
    (``RssShmem``: mostly the batch slots handed to the main process, a bounded pool)."""
    me = os.getpid()
    private, shared = [], []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != me:
                    continue
            with open(f"/proc/{entry.name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssShmem")))
        except (OSError, IndexError, ValueError):
            continue
        private.append(int(fields["RssAnon"].split()[0]) / 1e3)
        shared.append(int(fields["RssShmem"].split()[0]) / 1e3)
    return {"worker_private_mb": tuple(private), "worker_shared_mb": tuple(shared)}


def format_table(results: Sequence[EpochFigures]) -> str:
    """A fixed-width table, one row per epoch."""
    header = (f"{'reader':<28} {'order':<13} {'wk':>2} {'ep':>2} {'img/s':>9} {'MB/s':>7} "
              f"{'1st batch':>10} {'worker MB private':>17} {'+ slots':>9} {'data wait':>9}")
    rows = [header, "-" * len(header)]
    for r in results:
        private = "/".join(f"{v:.0f}" for v in r.worker_private_mb) or "-"
        shared = "/".join(f"{v:.0f}" for v in r.worker_shared_mb) or "-"
        wait = "-" if r.wait_share is None else f"{100 * r.wait_share:.1f}%"
        rows.append(f"{r.reader:<28} {r.order:<13} {r.workers:>2} {r.epoch:>2} {r.images_per_s:>9,.0f} "
                    f"{r.mb_per_s:>7.1f} {r.first_batch_ms:>8.1f}ms {private:>17} {shared:>9} {wait:>9}")
    return "\n".join(rows)


def as_json_rows(results: Sequence[EpochFigures]) -> list[dict]:
    return [asdict(r) for r in results]


def plot(results: Sequence[EpochFigures], path: str | os.PathLike, title: str = "") -> Path:
    """A bar chart of images/s per setting and epoch (needs the optional matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'packed-images[plot]'") from None
    settings = list(dict.fromkeys((r.reader, r.order, r.workers) for r in results))
    epochs = sorted({r.epoch for r in results})
    by_key = {(r.reader, r.order, r.workers, r.epoch): r.images_per_s for r in results}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(settings) + 2), 4.5))
    width = 0.8 / len(epochs)
    for j, epoch in enumerate(epochs):
        xs = [i + (j - (len(epochs) - 1) / 2) * width for i in range(len(settings))]
        ax.bar(xs, [by_key.get((*s, epoch), 0.0) for s in settings], width, label=f"epoch {epoch}")
    ax.set_xticks(range(len(settings)))
    ax.set_xticklabels([f"{r}\n{o}, {w} workers" for r, o, w in settings], fontsize=7)
    ax.set_ylabel("images / s")
    ax.set_yscale("log")
    ax.set_title(title or "packer bench")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
