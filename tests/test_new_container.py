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

REPO = Path(__file__).resolve().parent.parent

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


def test_a_new_container_is_one_module_and_its_registry_line(
    tmp_path: Path, make_image_folder: Callable[..., Path]
) -> None:
    tree = tmp_path / "tree"
    for package in ("reader", "packer"):
        shutil.copytree(REPO / package, tree / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "tests" / "flat_shard.py", tree / "reader" / "format" / "flat_shard.py")
    registry = tree / "reader" / "format" / "registry.py"
    old_line = "_CONTAINERS: dict[str, Container] = {c.storage: c for c in (LmdbContainer(), Hdf5Container())}"
    assert old_line in registry.read_text()
    new_lines = ("from reader.format.flat_shard import FlatContainer\n"
                 + old_line.replace("Hdf5Container())", "Hdf5Container(), FlatContainer())"))
    registry.write_text(registry.read_text().replace(old_line, new_lines))
    src = make_image_folder(tmp_path / "images")
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "part-00000-shard-00009.flat.tmp").write_bytes(b"left by a killed pack")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run([sys.executable, "-c", CHECK, str(tree), str(src), str(flat), str(tmp_path / "lmdb")],
                         env=env, cwd=tree, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["manifest.json", "part-00000-shard-00000.flat", "part-00000-shard-00001.flat"]
    cli = subprocess.run([sys.executable, "-m", "packer", "pack", str(src), str(tmp_path / "cli"), "--format", "flat",
                          "--resize", "16x16", "--workers", "0"], env=env, cwd=tree, capture_output=True, text=True,
                         timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert sorted(p.suffix for p in (tmp_path / "cli").iterdir()) == [".flat", ".json"]
