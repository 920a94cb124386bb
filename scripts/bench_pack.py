"""Time ``packer.pack --resize 256 --crop 224`` (raw and JPEG, LMDB and HDF5) on an ImageNet-like folder.

    python scripts/bench_pack.py                      # makes out/bench_pack/images (5000 JPEGs) once
    python scripts/bench_pack.py --images DIR --workers 2 --variants raw-lmdb jpeg-lmdb

Prints one row per variant: images/s, MB written, wall seconds, and the CPU seconds spent in the main
(writer) process and in the worker processes, which tell whether decoding or writing bounds the rate.
The source files are read once before timing, so every variant starts from a warm page cache.
"""
from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import packer

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


def bench_variant(images: Path, out: Path, encoding: str, storage: str, workers: int | None) -> dict[str, float]:
    """Pack once with the variant's options; wall time, output size and CPU split."""
    shutil.rmtree(out, ignore_errors=True)
    own0, children0 = cpu_seconds()
    start = time.perf_counter()
    manifest = packer.pack(
        images, out, resize=256, crop=224, encoding=encoding, storage=storage, workers=workers, progress=False
    )
    seconds = time.perf_counter() - start
    own1, children1 = cpu_seconds()
    return {
        "images": manifest.num_records,
        "images_per_s": manifest.num_records / seconds,
        "mb": manifest.total_bytes / 1e6,
        "seconds": seconds,
        "main_cpu": own1 - own0,
        "worker_cpu": children1 - children0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, default=ROOT / "out" / "bench_pack" / "images")
    parser.add_argument("--count", type=int, default=5000, help="images to make when --images is missing")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench_pack" / "packed")
    parser.add_argument("--workers", type=int, default=None, help="default: every core")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()

    ensure_images(args.images, args.count)
    files = warm_page_cache(args.images)
    print(f"source: {args.images} ({files} files), pack --resize 256 --crop 224, workers={args.workers or 'all'}")
    print(f"{'variant':<10} {'images/s':>9} {'MB written':>11} {'seconds':>8} {'main CPU s':>11} {'worker CPU s':>13}")
    for name in args.variants:
        encoding, storage = VARIANTS[name]
        row = bench_variant(args.images, args.out / name, encoding, storage, args.workers)
        print(
            f"{name:<10} {row['images_per_s']:>9.0f} {row['mb']:>11.1f} {row['seconds']:>8.2f} "
            f"{row['main_cpu']:>11.2f} {row['worker_cpu']:>13.2f}",
            flush=True,
        )
        shutil.rmtree(args.out / name, ignore_errors=True)


if __name__ == "__main__":
    main()
