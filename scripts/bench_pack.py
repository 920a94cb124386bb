"""Time ``packer.pack --resize 256 --crop 224`` (raw and JPEG, LMDB and HDF5) on an ImageNet-like folder,
with 1 and 2 worker processes, and report the scaling.

    python scripts/bench_pack.py                      # makes out/bench_pack/images (5000 JPEGs) once
    python scripts/bench_pack.py --images DIR --workers 1 2 --variants raw-lmdb jpeg-lmdb --rounds 3
    PYTHONPATH=/path/to/plain-pillow python scripts/bench_pack.py ...   # as a plain pip install packs

Prints one row per variant and worker count: images/s (median of the rounds, and the range), MB
written, wall seconds, and the CPU seconds spent in the main process and in the worker processes;
then, per variant, the speed-up of the most workers over the fewest. CPU ms/img (all processes'
CPU time over the images) bounds what an otherwise idle machine reaches: cores / (CPU ms/img). Every
worker decodes, encodes and writes whole partitions, so the main process only waits. Rounds alternate between worker
counts, so that a change in the machine's load touches them alike. The source files are read once
before timing, so every run starts from a warm page cache; with the torch resampler, torch is
imported before timing (a one-off 1.7 s a pack here, which would dwarf a 2,000-image run). Run it under
``flock /tmp/bench.lock`` on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import PIL

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import packer  # noqa: E402
from packer.image.resampling import RESAMPLERS, default_resampler  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {
    "raw-lmdb": ("raw", "lmdb"),
    "raw-hdf5": ("raw", "hdf5"),
    "jpeg-lmdb": ("jpeg", "lmdb"),
    "jpeg-hdf5": ("jpeg", "hdf5"),
}


def ensure_images(images: Path, count: int) -> None:
    """Make the ImageNet-like folder with scripts/make_images.py unless it is already there."""
    if images.is_dir() and any(images.iterdir()):
        return
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_images.py"), "imagenet", str(images), "--count", str(count)],
        check=True,
    )


def warm_page_cache(images: Path) -> int:
    """Read every source file once; returns how many there are."""
    files = [p for p in images.rglob("*") if p.is_file()]
    for path in files:
        path.read_bytes()
    return len(files)


def cpu_seconds() -> tuple[float, float]:
    """(this process, its finished children) user + system CPU seconds so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def bench_variant(
    images: Path, out: Path, encoding: str, storage: str, workers: int, resampler: str | None,
    partitions: int | None = None,
) -> dict[str, float]:
    """Pack once with the variant's options; wall time, output size and CPU split."""
    shutil.rmtree(out, ignore_errors=True)
    own0, children0 = cpu_seconds()
    start = time.perf_counter()
    manifest = packer.pack(
        images, out, resize=256, crop=224, encoding=encoding, storage=storage, workers=workers,
        resampler=resampler, partitions=partitions, progress=False,
    )
    seconds = time.perf_counter() - start
    own1, children1 = cpu_seconds()
    shutil.rmtree(out, ignore_errors=True)
    return {
        "images": manifest.num_records,
        "images_per_s": manifest.num_records / seconds,
        "mb": manifest.total_bytes / 1e6,
        "seconds": seconds,
        "main_cpu": own1 - own0,
        "worker_cpu": children1 - children0,
        "shards": len(manifest.shards),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, default=ROOT / "out" / "bench_pack" / "images")
    parser.add_argument("--count", type=int, default=5000, help="images to make when --images is missing")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench_pack" / "packed")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to time")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--resampler", choices=RESAMPLERS, help="default: packer's choice for this install")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--partitions", type=int, help="override the default partition count (a small JPEG set "
                        "has few partitions, so few processes pack it at once: packer.run.partitions)")
    args = parser.parse_args()

    ensure_images(args.images, args.count)
    files = warm_page_cache(args.images)
    resampler = args.resampler or default_resampler()
    if resampler == "torch":
        import torch  # noqa: F401  (a one-off 1.7 s a pack; imported before timing, to time the packing)
    print(f"source: {args.images} ({files} files), pack --resize 256 --crop 224, PIL {PIL.__version__}, "
          f"resampler {resampler}, {len(os.sched_getaffinity(0))} cores, load average "
          f"{os.getloadavg()[0]:.1f}, {args.rounds} rounds")
    print(f"{'variant':<10} {'workers':>7} {'images/s':>9} {'range':>11} {'MB':>7} {'shards':>6} "
          f"{'seconds':>8} {'main CPU s':>10} {'worker CPU s':>12} {'CPU ms/img':>10}")
    for name in args.variants:
        encoding, storage = VARIANTS[name]
        rows: dict[int, list[dict[str, float]]] = {w: [] for w in args.workers}
        for _ in range(args.rounds):
            for workers in args.workers:
                rows[workers].append(bench_variant(args.images, args.out / name, encoding, storage, workers, resampler,
                                                          args.partitions))
        for workers, runs in rows.items():
            rates = sorted(r["images_per_s"] for r in runs)
            row = runs[0]
            print(
                f"{name:<10} {workers:>7} {statistics.median(rates):>9.0f} {f'{rates[0]:.0f}-{rates[-1]:.0f}':>11} "
                f"{row['mb']:>7.1f} {row['shards']:>6.0f} {statistics.median(r['seconds'] for r in runs):>8.2f} "
                f"{statistics.median(r['main_cpu'] for r in runs):>10.2f} "
                f"{statistics.median(r['worker_cpu'] for r in runs):>12.2f} "
                f"{statistics.median(1e3 * (r['main_cpu'] + r['worker_cpu']) / r['images'] for r in runs):>10.2f}",
                flush=True,
            )
        fewest, most = min(args.workers), max(args.workers)
        if fewest != most:
            speedup = statistics.median(r["images_per_s"] for r in rows[most]) / statistics.median(
                r["images_per_s"] for r in rows[fewest])
            print(f"{name:<10} scaling {fewest} -> {most} workers: {speedup:.2f}x", flush=True)


if __name__ == "__main__":
    main()
