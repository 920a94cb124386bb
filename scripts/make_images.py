"""Make image folders to pack: an ImageNet-like set for benchmarks, or a small mixed sample for the demo.

    python scripts/make_images.py imagenet DST --count 5000   # JPEG q90, sides 250-800 px, 10 classes
    python scripts/make_images.py sample DST                  # ~60 files: JPEG/PNG, several modes
    python scripts/make_images.py copies DST --of SRC --count 3  # SRC's images 3 times, and their labels

``copies`` makes a larger set of the same photos for the cold benchmarks: hard links of SRC's
``CLASS/FILE`` images under ``DST/1``, ``DST/2``, ... and ``DST/labels.csv`` (``N/CLASS/FILE,CLASS``
rows, written last), since a labels file may list a path once and each copy is then packed as a
record of its own. Links already there are kept, so an interrupted run is finished by running again.

The content is synthetic but photo-like, not noise: a sky-to-ground gradient, 1/f ("pink") texture,
a few soft-edged blobs and shapes, and a slight blur, so JPEG sizes and decode costs resemble real
photos (about 17 KB at q90 once resized and cropped to 224). Sizes are those of photos: the longer
side uniform in 250-800 px, a common aspect ratio (1:1, 4:3, 3:2, 16:9; landscape three times in four),
the shorter side at least 250 px: 0.23 megapixels on average (ImageNet's average is about 0.11-0.18).
Deterministic from --seed.
"""
from __future__ import annotations

import argparse
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

CLASSES = [f"class_{i:02d}" for i in range(10)]
ASPECT_RATIOS = (1.0, 4 / 3, 3 / 2, 16 / 9)


def photo_size(rng: np.random.Generator, shortest: int = 250, longest: int = 800) -> tuple[int, int]:
    """``(width, height)`` of a photo: a common aspect ratio, the longer side in [shortest, longest]."""
    long_side = int(rng.integers(shortest, longest + 1))
    short_side = max(shortest, round(long_side / float(rng.choice(ASPECT_RATIOS))))
    return (long_side, short_side) if rng.random() < 0.75 else (short_side, long_side)


def photo_like(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """An RGB image with the broad statistics of a photo: smooth regions, edges and texture."""
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    top, bottom = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    base = (top * (1 - y) + bottom * y + np.zeros((1, width, 1), np.float32)).astype(np.uint8)
    img = Image.fromarray(base, "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = rng.uniform(-0.2, 1.0) * width, rng.uniform(-0.2, 1.0) * height
        w, h = rng.uniform(0.1, 0.6) * width, rng.uniform(0.1, 0.6) * height
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        shape = [x0, y0, x0 + w, y0 + h]
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(shape, fill=color)
    texture = np.zeros((height, width), np.float32)
    for octave in range(1, 10):
        cells = min(2**octave, width, height)
        grid = rng.standard_normal((cells, cells)).astype(np.float32)
        layer = Image.fromarray(grid, mode="F").resize((width, height), Image.BICUBIC)
        texture += np.asarray(layer) * (40.0 / 1.2**octave)
    tint = rng.uniform(0.5, 1.0, 3).astype(np.float32)
    grain = rng.normal(0.0, 3.0, (height, width, 1)).astype(np.float32)
    pixels = np.asarray(img, np.float32) + texture[..., None] * tint + grain
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    return img.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.3, 0.7))))


def _imagenet_one(args: tuple[Path, int, int]) -> None:
    dst, index, seed = args
    rng = np.random.default_rng([seed, index])
    width, height = photo_size(rng)
    path = dst / CLASSES[index % len(CLASSES)] / f"img_{index:06d}.jpg"
    photo_like(rng, width, height).save(path, quality=90)


def make_imagenet_like(dst: Path, count: int, seed: int = 0, workers: int | None = None) -> None:
    """``count`` JPEGs (q90, sides 250-800 px) spread over 10 class folders."""
    for name in CLASSES:
        (dst / name).mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers or os.cpu_count()) as pool:
        list(pool.map(_imagenet_one, [(dst, i, seed) for i in range(count)], chunksize=64))


def make_sample(dst: Path, seed: int = 0) -> None:
    """A small folder exercising the pre-transforms: JPEG with EXIF rotation, PNG in modes RGB, RGBA,
    L, P and 16-bit grey, CMYK JPEG, sizes from 40 to 500 px, three classes of 20 files each."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(["cat", "dog", "fish"]):
        folder = dst / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(20):
            width, height = (int(v) for v in rng.integers(40, 501, 2))
            img = photo_like(rng, width, height)
            kind = (c * 20 + i) % 7
            if kind == 0:
                exif = Image.Exif()
                exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
                img.save(folder / f"{i:03d}.jpg", quality=92, exif=exif)
            elif kind == 1:
                img.save(folder / f"{i:03d}.jpg", quality=85)
            elif kind == 2:
                rgba = img.convert("RGBA")
                rgba.putalpha(Image.linear_gradient("L").resize(img.size))
                rgba.save(folder / f"{i:03d}.png")
            elif kind == 3:
                img.convert("L").save(folder / f"{i:03d}.png")
            elif kind == 4:
                img.convert("P", palette=Image.ADAPTIVE).save(folder / f"{i:03d}.png")
            elif kind == 5:
                grey16 = (np.asarray(img.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
                Image.fromarray(grey16).save(folder / f"{i:03d}.png")
            else:
                img.convert("CMYK").save(folder / f"{i:03d}.jpg", quality=90)


def make_copies(dst: Path, src: Path, count: int) -> None:
    """``count`` hard-linked copies of ``src``'s ``CLASS/FILE`` images and their labels (module docstring)."""
    images = sorted(path.relative_to(src) for path in src.glob("*/*") if path.is_file())
    rows = []
    for copy in range(1, count + 1):
        for image in images:
            link = dst / str(copy) / image
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                os.link(src / image, link)
            rows.append(f"{copy}/{image.as_posix()},{image.parent.name}\n")
    (dst / "labels.csv").write_text("".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("kind", choices=["imagenet", "sample", "copies"])
    parser.add_argument("dst", type=Path)
    parser.add_argument("--count", type=int, default=5000, help="images (imagenet), copies (copies)")
    parser.add_argument("--of", type=Path, help="the folder to copy (copies only)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.kind == "imagenet":
        make_imagenet_like(args.dst, args.count, args.seed)
    elif args.kind == "copies":
        if args.of is None:
            parser.error("copies needs --of SRC")
        make_copies(args.dst, args.of, args.count)
    else:
        make_sample(args.dst, args.seed)
    print(f"made {sum(1 for p in args.dst.rglob('*') if p.is_file() and p.suffix != '.csv')} images under {args.dst}")


if __name__ == "__main__":
    main()
