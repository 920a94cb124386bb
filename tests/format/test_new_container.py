"""FORMAT.md's promise, tested: a new container is one module plus its line in ``registry.py``. A copy of
the packer and reader gets ``tests/flat_shard.py`` and nothing else; the packer (Python API and CLI),
its clean-up of leftovers, the reader and ``verify --deep`` then work on ``.flat`` shards."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import sys
from pathlib import Path

import torch

import packer
import reader
from reader import PackedDataset

tree, src, flat, lmdb = map(Path, sys.argv[1:])
assert Path(reader.__file__).is_relative_to(tree), reader.__file__
packer.pack(src, lmdb, storage="lmdb", resize=16, crop=16, shard_size=3 * 768, workers=0, progress=False)
packer.pack(src, flat, storage="flat", resize=16, crop=16, shard_size=3 * 768, workers=0, progress=False)
a, b = PackedDataset(flat), PackedDataset(lmdb)
assert len(a) == len(b) == 6
for i in range(6):
    assert torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1] and a.source(i) == b.source(i)
report = packer.verify(flat, deep=True, progress=False)
assert report.ok and report.records == 6, report
print(" ".join(sorted(p.name for p in flat.iterdir())))
"""


def code_with(tmp_path: Path, module: str, old_line: str, new_line: str) -> dict[str, str]:
    """A copy of ``reader`` and ``packer`` given ``tests/MODULE.py`` in ``reader/format`` and, in
    ``registry.py``, its import and ``new_line`` in place of ``old_line``; the environment that runs it."""
    tree = tmp_path / "tree"
    for package in ("reader", "packer"):
        shutil.copytree(REPO / package, tree / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "tests" / f"{module}.py", tree / "reader" / "format" / f"{module}.py")
    registry = tree / "reader" / "format" / "registry.py"
    assert old_line in registry.read_text()
    class_name = new_line.split(", ")[-1].split("(")[0]
    registry.write_text(registry.read_text().replace(
        old_line, f"from reader.format.{module} import {class_name}\n{new_line}"))
    return {**os.environ, "PYTHONPATH": str(tree)}


def test_a_new_container_is_one_module_and_its_registry_line(
    tmp_path: Path, make_image_folder: Callable[..., Path]
) -> None:
    old_line = "_CONTAINERS: dict[str, Container] = {c.storage: c for c in (LmdbContainer(), Hdf5Container())}"
    env = code_with(tmp_path, "flat_shard", old_line,
                    old_line.replace("Hdf5Container())", "Hdf5Container(), FlatContainer())"))
    tree = tmp_path / "tree"
    src = make_image_folder(tmp_path / "images")
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "part-00000-shard-00009.flat.tmp").write_bytes(b"left by a killed pack")
    run = subprocess.run([sys.executable, "-c", CHECK, str(tree), str(src), str(flat), str(tmp_path / "lmdb")],
                         env=env, cwd=tree, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["manifest.json", "part-00000-shard-00000.flat", "part-00000-shard-00001.flat"]
    cli = subprocess.run([sys.executable, "-m", "packer", "pack", str(src), str(tmp_path / "cli"), "--format", "flat",
                          "--resize", "16x16", "--workers", "0"], env=env, cwd=tree, capture_output=True, text=True,
                         timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert sorted(p.suffix for p in (tmp_path / "cli").iterdir()) == [".flat", ".json"]


CHECK_ENCODING = """
import sys
from pathlib import Path

import torch

import packer
from reader import PackedDataset, make_loader
from reader.format import load_manifest

src, png, raw = map(Path, sys.argv[1:])
packer.pack(src, raw, encoding="raw", resize=16, crop=16, workers=0, progress=False)
packer.pack(src, png, encoding="png", resize=16, crop=16, workers=2, progress=False)
assert load_manifest(png).encoding == "png"
shard = png / load_manifest(png).shards[0].file
assert b"IHDR" in shard.read_bytes() and b"IHDR" not in (raw / load_manifest(raw).shards[0].file).read_bytes()
a, b = PackedDataset(png), PackedDataset(raw)
assert [a[i][1] for i in range(6)] == [b[i][1] for i in range(6)] == [0, 0, 0, 1, 1, 1]
assert all(torch.equal(a[i][0], b[i][0]) for i in range(6))
seen = {}
for x, y, indices, valid in make_loader(a, batch_size=4, num_workers=2, evaluation=True):
    seen.update((i, image.clone()) for i, image, ok in zip(indices.tolist(), x, valid.tolist()) if ok)
assert sorted(seen) == list(range(6)) and all(torch.equal(seen[i], b[i][0]) for i in range(6))
report = packer.verify(png, deep=True, progress=False)
assert report.ok and report.records == 6, report
"""


def test_a_new_encoding_is_one_module_and_its_registry_line(
    tmp_path: Path, make_image_folder: Callable[..., Path]
) -> None:
    """A lossless ``png`` encoding gives the raw pixels, through the dataset, a loader with workers and
    a pack with workers."""
    old_line = "_ENCODINGS: dict[str, Encoding] = {e.name: e for e in (RawEncoding(), JpegEncoding())}"
    env = code_with(tmp_path, "png_encoding", old_line,
                    old_line.replace("JpegEncoding())", "JpegEncoding(), PngEncoding())"))
    src = make_image_folder(tmp_path / "images")
    run = subprocess.run([sys.executable, "-c", CHECK_ENCODING, str(src), str(tmp_path / "png"), str(tmp_path / "raw")],
                         env=env, cwd=tmp_path / "tree", capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
