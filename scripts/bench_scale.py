"""Scale benchmark: what per-record metadata costs at 10^4..10^6+ records (issue 22).

Packs N tiny records (8x8 raw RGB by default, 1,000 classes, with ``pack_items``, partitions of
``--partition`` records: 1,131 gives ImageNet's 1,132 shards at 1.28M) and reports, per N:

- pack: seconds per record of ``pack_items``;
- open: ``PackedDataset(path)`` (median of 3, in this process);
- payload: bytes a spawned/forkserver worker receives (the pickled dataset ``make_loader`` hands to it);
- first batch: ``make_loader`` + ``iter`` + the first batch, 2 spawn workers, batch 256;
- gap: the largest wait between two batches of epoch 2 (fork workers) over the median wait, the wait for
  epoch 2's first batch (the epoch boundary) over the median, and how many waits exceed 3x the median
  (on a loaded machine, other processes' bursts show up here too), with ``gc.freeze()`` called once the
  loader is built, as docs/reading.md advises; "unfrozen" is the largest gap without that call (the
  main process's full garbage collections, about 0.1 s each with torch loaded);
- rank 0/64: a ``ShardSampler`` of rank 0 of 64 built and its first batch of indices cut;
- fds / RSS: descriptors and resident MiB of the main process and each worker after epoch 2;
- split: ``reader.split(dataset, 0.1)``.

Usage: ``python scripts/bench_scale.py [--sizes 10000 100000 1281000] [--dir /tmp/bench_scale]``.
Figures vary with the machine's load: compare only figures from one run.
"""
from __future__ import annotations

import argparse
import gc
import os
import pickle
import shutil
import statistics
import time
from pathlib import Path
from typing import Iterator

import numpy as np

import packer
from reader import PackedDataset, ShardSampler, make_loader, split
from reader.batch_stream import BatchStream

CLASSES = 1000


def items(count: int, side: int) -> Iterator[dict]:
    """``count`` tiny images, each a different flat colour, labels cycling over the classes."""
    for k in range(count):
        yield {"image": np.full((side, side, 3), k % 251, np.uint8), "label": k % CLASSES}


def pack(path: Path, count: int, side: int, partition: int) -> float:
    if not (path / "manifest.json").exists():
        shutil.rmtree(path, ignore_errors=True)
        start = time.perf_counter()
        packer.pack_items(items(count, side), path, classes=[str(c) for c in range(CLASSES)],
                          partition_size=partition, progress=False)
        return (time.perf_counter() - start) / count
    return float("nan")


def process_figures(pid: int) -> tuple[int, float]:
    """(open descriptors, resident MiB) of process ``pid``."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return fds, rss / 1024


def epoch_gaps(path: Path, batch: int, freeze: bool) -> tuple[list[float], list[tuple[int, float]]]:
    """The waits for each batch of epoch 2 with 2 fork workers, and (fds, MiB) of each process."""
    loader = make_loader(PackedDataset(path), batch, num_workers=2, multiprocessing_context="fork",
                         pin_memory=False)
    if freeze:
        gc.freeze()
    gaps: list[float] = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        last = time.perf_counter()
        for _ in loader:
            now = time.perf_counter()
            if epoch == 1:
                gaps.append(now - last)
            last = now
    workers = loader.live_iterator()._workers  # type: ignore[union-attr]
    figures = [process_figures(os.getpid())] + [process_figures(w.pid) for w in workers]
    del loader
    gc.unfreeze()
    return gaps, figures


def first_batch(path: Path, batch: int) -> float:
    start = time.perf_counter()
    loader = make_loader(PackedDataset(path), batch, num_workers=2, multiprocessing_context="spawn",
                         pin_memory=False)
    next(iter(loader))
    elapsed = time.perf_counter() - start
    del loader
    return elapsed


def rank0_of_64(dataset: PackedDataset, batch: int) -> float:
    start = time.perf_counter()
    sampler = ShardSampler(dataset, seed=0, rank=0, world_size=64)
    sampler.set_epoch(1)
    next(iter(BatchStream(sampler, batch, False)))
    return time.perf_counter() - start


def measure(path: Path, count: int, side: int, partition: int, batch: int) -> dict:
    row: dict = {"N": count, "pack us/rec": pack(path, count, side, partition) * 1e6}
    opens = []
    for _ in range(3):
        start = time.perf_counter()
        dataset = PackedDataset(path)
        opens.append(time.perf_counter() - start)
    row["shards"] = len(dataset.manifest.shards)
    row["open s"] = statistics.median(opens)
    loader = make_loader(dataset, batch, num_workers=2, multiprocessing_context="spawn")
    row["payload B"] = len(pickle.dumps(loader.dataset, protocol=pickle.HIGHEST_PROTOCOL))
    del loader
    row["1st batch s"] = first_batch(path, batch)
    row["rank0/64 s"] = rank0_of_64(dataset, batch)
    gaps, figures = epoch_gaps(path, batch, freeze=True)
    median = statistics.median(gaps)
    row["gap med ms"], row["gap max/med"] = median * 1e3, max(gaps) / median
    row["boundary/med"], row["gaps>3x"] = gaps[0] / median, sum(gap > 3 * median for gap in gaps)
    unfrozen, _ = epoch_gaps(path, batch, freeze=False)
    row["unfrozen max/med"] = max(unfrozen) / statistics.median(unfrozen)
    row["fds main/workers"] = "/".join(str(fds) for fds, _ in figures)
    row["RSS MiB main/workers"] = "/".join(f"{rss:.0f}" for _, rss in figures)
    start = time.perf_counter()
    split(dataset, 0.1)
    row["split s"] = time.perf_counter() - start
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_281_000])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_scale"))
    parser.add_argument("--side", type=int, default=8, help="image side in pixels (default 8)")
    parser.add_argument("--partition", type=int, default=1131, help="records per shard (default 1131)")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    rows = []
    for count in args.sizes:
        rows.append(measure(args.dir / f"n{count}-s{args.side}-p{args.partition}", count, args.side,
                            args.partition, args.batch))
        print(rows[-1], flush=True)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
