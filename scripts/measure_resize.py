"""Time the two resamplers on photos, one thread, and compare their pixels with PIL's.

    python scripts/measure_resize.py --images DIR            # the first 300 JPEGs under DIR
    PYTHONPATH=/path/to/plain-pillow python scripts/measure_resize.py --images DIR

Each photo is decoded once (at the draft scale the packer uses), then resized to shorter side 256 and
center-cropped to 224 by PIL (the fused resize+crop) and by torch (resize, then crop), conversions to
and from a tensor included. Prints images/s for each (two rounds: the first warms up) and how far
torch's pixels are from PIL's resize-then-crop and from PIL's fused resize+crop. Which PIL is measured
is whichever is first on the path (pillow-simd or plain Pillow).
"""
from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np
import PIL
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from packer.image.transforms import _decode, center_crop_box, resize_and_crop, resize_target, to_rgb  # noqa: E402

RESIZE, CROP = 256, 224


def decoded_photos(images: Path, count: int) -> list[tuple[Image.Image, tuple[int, int]]]:
    """The photos decoded as the packer decodes them, each with its resize target."""
    photos = []
    for path in sorted(images.rglob("*.jpg"))[:count]:
        data = path.read_bytes()
        img = Image.open(io.BytesIO(data))
        target = resize_target(*img.size, RESIZE)
        photos.append((to_rgb(_decode(img, data, target)), target))
    return photos


def pil_fused(img: Image.Image, target: tuple[int, int]) -> np.ndarray:
    return np.asarray(resize_and_crop(img, target, (CROP, CROP), "pil").convert("RGB"))


def pil_then_crop(img: Image.Image, target: tuple[int, int]) -> np.ndarray:
    return np.asarray(img.resize(target, Image.BILINEAR).crop(center_crop_box(*target, (CROP, CROP))).convert("RGB"))


def torch_then_crop(img: Image.Image, target: tuple[int, int]) -> np.ndarray:
    return np.asarray(resize_and_crop(img, target, (CROP, CROP), "torch").convert("RGB"))


def max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> str:
    diffs = np.concatenate([np.abs(x.astype(int) - y.astype(int)).ravel() for x, y in zip(a, b)])
    return f"max {diffs.max()}, off by 1: {(diffs == 1).mean():.4%}, by 2 or more: {(diffs >= 2).sum()} of {diffs.size}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, required=True)
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    photos = decoded_photos(args.images, args.count)
    print(f"{len(photos)} photos, shorter side {RESIZE}, crop {CROP}, one thread; PIL {PIL.__version__}, "
          f"torch {torch.__version__}")
    outputs = {}
    for name, resize in [("PIL fused", pil_fused), ("torch", torch_then_crop)] * 2:
        start = time.perf_counter()
        outputs[name] = [resize(img, target) for img, target in photos]
        print(f"{name:<10} {len(photos) / (time.perf_counter() - start):7.0f} img/s")
    textbook = [pil_then_crop(img, target) for img, target in photos]
    print(f"torch vs PIL resize-then-crop: {max_difference(outputs['torch'], textbook)}")
    print(f"torch vs PIL fused:            {max_difference(outputs['torch'], outputs['PIL fused'])}")


if __name__ == "__main__":
    main()
