"""Small packed datasets for the reader's tests, with the source pixels to compare against."""
from __future__ import annotations

import io
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import packer
from reader.format import DatasetWriter
from reader.memory_budget import CGROUP_ROOT

CLASSES = ["cat", "dog", "eel"]
JPEG_QUALITY = 95
# Records in the ``raw_path`` fixture (conftest.py): 16x16 raw, labels i % 3, LMDB shards of 10.
SMALL_RAW_COUNT = 37


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


@dataclass
class Packed:
    """A dataset packed by ``packer.pack``, with each record's source pixels (HWC) and label."""

    path: Path
    encoding: str
    images: list[np.ndarray]
    labels: list[int]


def pack_images(
    dst: Path,
    images: list[np.ndarray],
    labels: list[int],
    *,
    storage: str,
    encoding: str,
    records_per_shard: int,
) -> Packed:
    """Save ``images`` as PNG files in an ImageFolder tree (class ``CLASSES[label]``) and pack them.

    Same-size images are packed with a crop to their size, so the manifest has a fixed shape; mixed
    sizes give a variable-size dataset. Shards hold about ``records_per_shard`` records (exactly that
    many for raw records). ImageFolder order is class, then file name, so record order is returned.
    """
    src = dst.with_name(dst.name + "-src")
    for k, (image, label) in enumerate(zip(images, labels)):
        path = src / CLASSES[label] / f"{k:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path)
    sizes = {image.shape for image in images}
    h, w, _ = images[0].shape
    record_bytes = 3 * h * w if encoding == "raw" else len(jpeg_bytes(images[0]))
    packer.pack(src, dst, storage=storage, encoding=encoding, quality=JPEG_QUALITY,
                crop=(h, w) if len(sizes) == 1 else None, shard_size=records_per_shard * record_bytes,
                workers=1, progress=False)
    order = sorted(range(len(images)), key=lambda k: (labels[k], k))
    return Packed(dst, encoding, [images[k] for k in order], [labels[k] for k in order])


def jpeg_bytes(image: np.ndarray) -> bytes:
    """``image`` (HWC) as the JPEG bytes ``write_dataset`` stores for it."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, "JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


def write_dataset(
    dst: Path,
    images: list[np.ndarray],
    labels: list[int],
    *,
    storage: str,
    encoding: str,
    records_per_shard: int,
    classes: list[str] = CLASSES,
) -> Path:
    """Write ``images`` (HWC) as records in exactly this order, through ``reader.format``'s
    ``DatasetWriter`` rather than the packer (for tests that need that order); return ``dst``."""
    payloads = [jpeg_bytes(image) if encoding == "jpeg" else image.transpose(2, 0, 1).tobytes() for image in images]
    writer = DatasetWriter(dst, storage, shard_size=records_per_shard * max(map(len, payloads)))
    for k, (image, payload, label) in enumerate(zip(images, payloads, labels)):
        writer.add(payload, label, image.shape[0], image.shape[1], source=f"written/{k:04d}.png")
    sizes = {image.shape for image in images}
    writer.finish(encoding=encoding, classes=classes, shape=[3, *images[0].shape[:2]] if len(sizes) == 1 else None,
                  transform={}, source={"kind": "test"}, tool_version="test",
                  jpeg_quality=JPEG_QUALITY if encoding == "jpeg" else None)
    return dst


def chw(image: np.ndarray) -> np.ndarray:
    """A source image (HWC) in the reader's layout (CHW)."""
    return np.ascontiguousarray(image.transpose(2, 0, 1))


def memory_cgroup(limit: int) -> Path:
    """A new memory cgroup capped at ``limit`` bytes (v1 or v2); skips where none can be made."""
    name = f"packed-images-test-{uuid.uuid4().hex[:8]}"
    candidates = ((CGROUP_ROOT / "memory" / name, "memory.limit_in_bytes"), (CGROUP_ROOT / name, "memory.max"))
    for group, limit_file in candidates:
        if not group.parent.is_dir() or not os.access(group.parent, os.W_OK):
            continue
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            (group / limit_file).write_text(str(limit))
            return group
        except OSError:
            group.rmdir()
    pytest.skip("no memory cgroup can be created here (not root, or cgroups mounted read-only)")
