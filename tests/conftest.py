"""Shared fixtures: small real image folders written with PIL, and packed datasets made from them."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest
from pack_helpers import smooth_rgb
from PIL import Image
from reader_helpers import SMALL_RAW_COUNT, make_images, pack_images

import packer


@pytest.fixture
def make_image_folder() -> Callable[..., Path]:
    """Factory: ``make_image_folder(root, classes=("cat", "dog"), per_class=3, size=(40, 30), ext="png")``
    writes an ImageFolder tree of smooth RGB images (each a few pixels larger than the one before) and
    returns ``root``."""

    def make(
        root: Path,
        classes: tuple[str, ...] = ("cat", "dog"),
        per_class: int = 3,
        size: tuple[int, int] = (40, 30),
        ext: str = "png",
    ) -> Path:
        seed = 0
        for name in classes:
            (root / name).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                img = Image.fromarray(smooth_rgb(size[0] + 3 * i, size[1] + 2 * i, seed), "RGB")
                img.save(root / name / f"{i:03d}.{ext}", **({"quality": 95} if ext in ("jpg", "jpeg") else {}))
                seed += 1
        return root

    return make


@pytest.fixture
def make_packed_dataset(make_image_folder: Callable[..., Path]) -> Callable[..., Path]:
    """Factory: ``make_packed_dataset(tmp_path, per_class=3, size=(40, 30), **pack_options)`` packs a
    two-class folder (in-process, no progress bar) into ``tmp_path / "packed"`` and returns it."""

    def make(tmp_path: Path, per_class: int = 3, size: tuple[int, int] = (40, 30), **options: object) -> Path:
        src = make_image_folder(tmp_path / "images", per_class=per_class, size=size)
        dst = tmp_path / "packed"
        options.setdefault("workers", 0)
        options.setdefault("progress", False)
        packer.pack(src, dst, **options)
        return dst

    return make


@pytest.fixture(scope="module")
def raw_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``SMALL_RAW_COUNT`` raw 16x16 records (labels ``i % 3``) in LMDB shards of 10, packed once per
    test module."""
    dst = tmp_path_factory.mktemp("raw") / "packed"
    labels = [i % 3 for i in range(SMALL_RAW_COUNT)]
    return pack_images(dst, make_images(SMALL_RAW_COUNT, [(16, 16)]), labels,
                       storage="lmdb", encoding="raw", records_per_shard=10).path


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Callable[[bool], None]]:
    """``read_only(True)`` makes the folder ``tmp_path / "ro"`` and everything in it read-only,
    ``read_only(False)`` writable again: a tmpfs remounted read-only as root (who may write into a
    chmod -w folder), every folder chmod 555 otherwise."""
    where = tmp_path / "ro"
    where.mkdir()
    as_root = os.geteuid() == 0
    if as_root:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs ({done.stderr.decode().strip()})")

    def switch(on: bool) -> None:
        if as_root:
            subprocess.run(["mount", "-o", f"remount,{'ro' if on else 'rw'}", str(where)], check=True)
        else:
            for folder in [where, *(p for p in where.rglob("*") if p.is_dir())]:
                folder.chmod(0o555 if on else 0o755)

    try:
        yield switch
    finally:
        if as_root:
            subprocess.run(["umount", "-l", str(where)], check=False)
        else:
            switch(False)
