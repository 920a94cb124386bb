"""Small packed datasets for the reader's tests, with the source pixels to compare against."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from reader.format import Manifest, ShardInfo, file_checksum, open_shard_writer, shard_file_name

CLASSES = ["cat", "dog", "eel"]


def make_images(count: int, sizes: list[tuple[int, int]], seed: int = 0) -> list[np.ndarray]:
    """Smooth colour gradients with mild noise (``uint8 (H, W, 3)``), cycling through ``sizes``."""
    rng = np.random.default_rng(seed)
    images = []
    for i in range(count):
        h, w = sizes[i % len(sizes)]
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        phase = rng.uniform(0, 6.3, 3)
        channels = [128 + 80 * np.sin(x / (9 + 4 * c) + y / 13 + phase[c]) for c in range(3)]
        pixels = np.stack(channels, axis=-1) + rng.normal(0, 2, (h, w, 3))
        images.append(np.clip(pixels, 0, 255).astype(np.uint8))
    return images


def jpeg_bytes(image: np.ndarray, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def write_dataset(
    dst: Path,
    images: list[np.ndarray],
    labels: list[int],
    *,
    storage: str,
    encoding: str,
    records_per_shard: int,
) -> Path:
    """Write ``images`` (HWC) as a packed dataset through the format's writers; return ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    shards = []
    for first in range(0, len(images), records_per_shard):
        path = dst / shard_file_name(len(shards), storage)
        writer = open_shard_writer(storage, path)
        for image, label in zip(images[first:first + records_per_shard],
                                labels[first:first + records_per_shard]):
            payload = jpeg_bytes(image) if encoding == "jpeg" else image.transpose(2, 0, 1).tobytes()
            writer.append(payload, label, image.shape[0], image.shape[1])
        writer.finish()
        shards.append(ShardInfo(file=path.name, records=writer.num_records, bytes=path.stat().st_size,
                                checksum=file_checksum(path)))
    sizes = {image.shape for image in images}
    shape = [3, *images[0].shape[:2]] if len(sizes) == 1 else None
    Manifest(
        storage=storage, encoding=encoding, shape=shape, classes=CLASSES, shards=shards,
        transform={}, source={"kind": "test"}, tool_version="test",
        jpeg_quality=95 if encoding == "jpeg" else None,
    ).write(dst)
    return dst


def chw(image: np.ndarray) -> np.ndarray:
    """A source image (HWC) in the reader's layout (CHW)."""
    return np.ascontiguousarray(image.transpose(2, 0, 1))
