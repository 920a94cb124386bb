"""``pack_items``: any iterable of images (paths, file bytes, PIL images, arrays) packs to the same
records as the same files packed from a folder, deterministically, with fields; bad items are named."""
from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from PIL import Image

import packer
from packer.errors import PackError
from reader import PackedDataset


def folder_items(src: Path, kind: str) -> list[dict]:
    """The files of an ImageFolder tree in torchvision's order, each image given as ``kind``."""
    classes = sorted(p.name for p in src.iterdir())
    files = [(path, c) for c, name in enumerate(classes) for path in sorted((src / name).iterdir())]
    convert: dict[str, Callable[[Path], object]] = {
        "path": lambda p: p, "bytes": lambda p: p.read_bytes(), "pil": lambda p: Image.open(p),
        "array": lambda p: np.asarray(Image.open(p).convert("RGB")),
    }
    return [{"image": convert[kind](path), "label": label, "source": str(path.relative_to(src))}
            for path, label in files]


def records(path: Path) -> list[tuple[torch.Tensor, int, str | None]]:
    ds = PackedDataset(path)
    return [(*ds[i], ds.source(i)) for i in range(len(ds))]


@pytest.mark.parametrize("kind", ["path", "bytes", "pil", "array"])
def test_items_pack_like_the_same_files_from_a_folder(
    tmp_path: Path, make_image_folder: Callable[..., Path], kind: str
) -> None:
    src = make_image_folder(tmp_path / "src", classes=("cat", "dog"), per_class=5, size=(20, 14))
    packer.pack(src, tmp_path / "folder", resize=12, crop=10, workers=0, progress=False)
    manifest = packer.pack_items(folder_items(src, kind), tmp_path / kind, classes=["cat", "dog"], resize=12,
                                 crop=10, workers=2, partition_size=3, progress=False)
    assert manifest.classes == ["cat", "dog"] and manifest.num_records == 10 and len(manifest.shards) == 4
    expected, got = records(tmp_path / "folder"), records(tmp_path / kind)
    assert [(label, source) for _, label, source in got] == [(label, source) for _, label, source in expected]
    for (pixels, _, source), (want, _, _) in zip(got, expected):
        assert torch.equal(pixels, want), source
    assert packer.verify(tmp_path / kind, deep=True, progress=False).ok


def test_the_bytes_do_not_depend_on_the_worker_count(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=4)
    for workers in (0, 2):
        items = [{**item, "weight": float(k)} for k, item in enumerate(folder_items(src, "bytes"))]
        packer.pack_items(items, tmp_path / f"w{workers}", workers=workers, partition_size=3, progress=False)
    one, two = sorted((tmp_path / "w0").iterdir()), sorted((tmp_path / "w2").iterdir())
    assert [p.name for p in one] == [p.name for p in two]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two))
    assert PackedDataset(tmp_path / "w2").fields(5) == {"weight": 5.0}


def samples(tar_file):  # type: ignore[no-untyped-def]
    """docs/packing.md's tar example as it should read: a path, or a pipe such as ``sys.stdin.buffer``."""
    opened = {"fileobj": tar_file} if hasattr(tar_file, "read") else {"name": tar_file}
    with tarfile.open(mode="r|*", **opened) as tar:     # one pass: works on a stream
        for member in tar:                              # NAME.jpg, then NAME.cls (sorted by name)
            data = tar.extractfile(member).read()
            if member.name.endswith(".jpg"):
                image, source = data, member.name
            elif member.name.endswith(".cls"):
                yield {"image": image, "label": int(data), "source": source}


@pytest.mark.parametrize("via", ["path", "pipe"])
def test_a_webdataset_style_tar_stream_packs_with_its_fields(tmp_path: Path, via: str) -> None:
    """docs/packing.md's tar example: ``NAME.jpg`` + ``NAME.cls`` members read in one pass with ``tarfile``,
    from a file or from a pipe (which allows no seeking back)."""
    shard = tmp_path / "shard-000.tar"
    with tarfile.open(shard, "w") as tar:
        for k in range(4):
            jpeg = io.BytesIO()
            Image.fromarray(np.full((8, 8, 3), 40 * k, np.uint8)).save(jpeg, "JPEG", quality=95)
            for suffix, data in ((".jpg", jpeg.getvalue()), (".cls", str(k % 2).encode())):
                info = tarfile.TarInfo(f"sample{k:03d}{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    with subprocess.Popen(["cat", str(shard)], stdout=subprocess.PIPE) as cat:
        assert cat.stdout is not None
        source = shard if via == "path" else cat.stdout
        manifest = packer.pack_items(samples(source), tmp_path / "out", workers=0, progress=False)
        cat.stdout.read()
        cat.wait(timeout=30)
    ds = PackedDataset(tmp_path / "out")
    assert manifest.classes == ["0", "1"] and [ds[k][1] for k in range(4)] == [0, 1, 0, 1]
    assert ds.source(2) == "sample002.jpg" and abs(int(ds[2][0].float().mean()) - 80) <= 2


@pytest.mark.parametrize(("items", "message"), [
    ([{"image": "missing.png"}], r"item 0 \(missing.png\): unreadable file"),
    ([{"image": np.zeros((4, 4), np.float32)}], r"item 0: an array image must be uint8"),
    ([{"image": 3}], r"item 0: image is int; expected a path, bytes, a PIL image or a uint8 array"),
    ([{"image": np.zeros((4, 4), np.uint8), "label": "a"}, {"image": np.zeros((4, 4), np.uint8)}],
     r"item 1 \(item-1\): has no label, unlike the first item"),
    ([{"image": np.zeros((4, 4), np.uint8), "label": "a"}, {"image": np.zeros((4, 4), np.uint8), "label": 1}],
     r"item 1 \(item-1\): label 1 mixes class names and integer labels"),
    ([{"image": np.zeros((4, 4), np.uint8), "size": 3}, {"image": np.zeros((4, 4), np.uint8), "size": "big"}],
     r"item 1 \(item-1\): field 'size': expected an integer, got 'big'"),
    (["not a mapping"], r"item 0: expected a mapping with an 'image'"),
])
def test_bad_items_are_named(tmp_path: Path, items: list, message: str) -> None:
    with pytest.raises(PackError, match=message):
        packer.pack_items(items, tmp_path / "out", workers=0, progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_failed_forced_repack_does_not_leave_the_old_manifest_over_new_shards(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)

    def items(count: int, fail_at: int | None = None):
        for k in range(count):
            if k == fail_at:
                raise RuntimeError(f"the source broke at item {k}")
            yield {"image": rng.integers(0, 256, (8, 12, 3), dtype=np.uint8), "label": "ab"[k % 2]}

    dst = tmp_path / "out"
    packer.pack_items(items(6), dst, workers=0, progress=False, partition_size=2)
    with pytest.raises(RuntimeError, match="the source broke at item 5"):
        packer.pack_items(items(6, fail_at=5), dst, workers=0, progress=False, partition_size=2, force=True)
    assert not (dst / "manifest.json").exists()  # the old manifest would list shards overwritten since
    assert packer.pack_items(items(6), dst, workers=0, progress=False, partition_size=2).num_records == 6
    assert packer.verify(dst, deep=True, progress=False).ok


def test_every_item_skipped_is_one_line_naming_pack_items(tmp_path: Path) -> None:
    with pytest.raises(PackError, match=r"^pack_items: every one of the 2 images was skipped; nothing to pack$"):
        packer.pack_items([{"image": b"not an image"}, {"image": b"nor this"}], tmp_path / "out", workers=0,
                          progress=False, on_error="skip")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_an_error_raised_by_the_items_while_workers_wait_is_raised_at_once(tmp_path: Path) -> None:
    """The items fail after the first partition went to a worker: the error comes back as itself, and
    the two idle workers end at once (they once waited for their end marker, 60 s each)."""
    script = f"""
import numpy as np, packer
def items():
    yield {{"image": np.zeros((8, 8, 3), np.uint8), "label": 0}}
    raise ValueError("the stream broke")
packer.pack_items(items(), {str(tmp_path / "out")!r}, workers=2, partition_size=1, progress=False)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=40)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == "ValueError: the stream broke"
    # no temporary and no manifest; a partition a worker finished before it saw the stop may stay (the
    # module docstring: the next run removes it)
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert not [name for name in left if name.endswith((".tmp", ".spool")) or name == "manifest.json"], left
