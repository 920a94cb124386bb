"""``packer split`` / ``split_dataset``: a finished dataset written again as its training and validation
parts, with the records ``reader.split`` chooses, each copied whole (payload bytes, label, size, source
path, fields); damaged input and bad arguments are refused in one line naming the culprit."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

import packer
import reader
from packer.cli import main
from packer.errors import PackError
from reader import PackedDataset
from reader.format import MANIFEST_NAME, load_manifest

COUNT = 30
CLASSES = ["cat", "dog", "fish"]


def row(k: int) -> dict:
    """Record ``k``'s JSON Lines entry: a class, and one field of each kind, some lists empty."""
    return {"path": f"img/{k:02d}.png", "label": CLASSES[k % 3] if k < 27 else "cat", "id": 1000 + k,
            "score": k / 4, "caption": f"photo {k} é", "tags": [["indoor", "night"], [], ["outdoor"]][k % 3],
            "emb": [k, 0.5, -1.25, 2.0], "boxes": [[0.0, 1.0, 2.5, 3.0]] * (k % 3)}


@pytest.fixture(scope="module", params=[("lmdb", "jpeg"), ("hdf5", "raw")], ids=["lmdb-jpeg", "hdf5-raw"])
def dataset(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``COUNT`` gradient images of 10x12 (classes of 12, 9 and 9 records) with every kind of field,
    packed in shards of about 4 records."""
    storage, encoding = request.param
    root = tmp_path_factory.mktemp(f"split-{storage}-{encoding}")
    src = root / "src"
    (src / "img").mkdir(parents=True)
    for k in range(COUNT):
        pixels = ((np.arange(10 * 12 * 3).reshape(10, 12, 3) * (k + 3)) % 256).astype(np.uint8)
        Image.fromarray(pixels).save(src / "img" / f"{k:02d}.png")
    (src / "labels.jsonl").write_text("".join(json.dumps(row(k)) + "\n" for k in range(COUNT)))
    packer.pack(src, root / "packed", labels=src / "labels.jsonl", storage=storage, encoding=encoding,
                shard_size=4 * (360 if encoding == "raw" else 700), workers=1, progress=False)
    return root / "packed"


def records(path: Path, indices: list[int] | None = None) -> list[tuple]:
    """Each record of the dataset at ``path`` (those at ``indices``, in that order) as stored: payload
    bytes (JPEG bytes, or the raw pixels), label, source path and fields."""
    manifest = load_manifest(path)
    ds = PackedDataset(path, decode=manifest.encoding != "jpeg")
    chosen = range(len(ds)) if indices is None else indices
    return [(ds[i][0].numpy().tobytes(), ds[i][1], ds.source(i), ds.fields(i)) for i in chosen]


def test_the_parts_hold_reader_split_s_records_copied_whole(dataset: Path, tmp_path: Path) -> None:
    report = packer.split_dataset(dataset, tmp_path / "train", tmp_path / "val", 0.3, seed=5, shard_size=2000)
    train, val = reader.split(PackedDataset(dataset), 0.3, seed=5)
    assert len(val.indices) == 4 + 3 + 3  # 12, 9 and 9 records: 3.6, 2.7 and 2.7 rounded half up
    source = load_manifest(dataset)
    for part, subset, manifest in (("train", train, report.train), ("val", val, report.val)):
        assert records(tmp_path / part) == records(dataset, list(subset.indices)), part
        on_disk = load_manifest(tmp_path / part)
        assert on_disk == manifest
        for key in ("storage", "encoding", "shape", "classes", "transform", "jpeg_quality", "fields", "labelled"):
            assert getattr(manifest, key) == getattr(source, key), (part, key)
        assert manifest.source["split"] == {"part": part, "val_fraction": 0.3, "seed": 5, "of": COUNT,
                                            "source": {k: v for k, v in source.source.items() if k != "skipped"}}
        assert len(manifest.shards) > 1, "shard_size is honoured"
        report_ = packer.verify(tmp_path / part, deep=True, progress=False)
        assert report_.ok, report_.problems


def test_the_cli_splits_and_reports_each_part(dataset: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["split", str(dataset), str(tmp_path / "t"), str(tmp_path / "v"),
                                       "--val-fraction", "0.5", "--seed", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"{tmp_path / 't'}: 14 images in 3 classes, 1 shards, ")  # 6 + 4 + 4
    assert lines[1].startswith(f"{tmp_path / 'v'}: 16 images in 3 classes, 1 shards, ")  # 6 + 5 + 5
    _, val = reader.split(PackedDataset(dataset), 0.5, seed=2)
    assert records(tmp_path / "v") == records(dataset, list(val.indices))


@pytest.mark.parametrize("args, message", [
    (["--val-fraction", "1.5"], r"Error: split: val_fraction must be between 0 and 1 \(exclusive\), got 1.5"),
    (["--val-fraction", "0.01"], r"Error: .*packed: a val_fraction of 0.01 leaves the val part of its 30 records "
                                 r"empty; choose a fraction that gives both parts records"),
])
def test_a_fraction_that_cannot_split_is_one_line(dataset: Path, tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["split", str(dataset), str(tmp_path / "t"), str(tmp_path / "v"), *args])
    assert result.exit_code != 0
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert re.match(message, result.output.strip()), result.output
    assert not (tmp_path / "t" / MANIFEST_NAME).exists() and not (tmp_path / "v" / MANIFEST_NAME).exists()


def test_outputs_that_would_clash_are_refused(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(PackError, match="the training and validation parts need directories of their own"):
        packer.split_dataset(dataset, tmp_path / "same", tmp_path / "same", 0.3)
    with pytest.raises(PackError, match="a part cannot be written in .*packed, the dataset being split"):
        packer.split_dataset(dataset, dataset / "train", tmp_path / "v", 0.3)
    packer.split_dataset(dataset, tmp_path / "t", tmp_path / "v", 0.3)
    with pytest.raises(PackError, match=r"/t: already holds a finished packed dataset; pass --force to overwrite it"):
        packer.split_dataset(dataset, tmp_path / "t", tmp_path / "v2", 0.3)
    assert not (tmp_path / "v2" / MANIFEST_NAME).exists()
    packer.split_dataset(dataset, tmp_path / "t", tmp_path / "v", 0.5, force=True)
    assert len(PackedDataset(tmp_path / "v")) == 16


def test_a_damaged_shard_is_refused_not_copied(dataset: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in dataset.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    shard = load_manifest(copy).shards[1]
    data = bytearray((copy / shard.file).read_bytes())
    data[100] ^= 0xFF
    (copy / shard.file).write_bytes(bytes(data))
    with pytest.raises(reader.format.FormatError, match=f"{shard.file}: checksum mismatch"):
        packer.split_dataset(copy, tmp_path / "t", tmp_path / "v", 0.3)
    assert not (tmp_path / "t" / MANIFEST_NAME).exists() and not (tmp_path / "v" / MANIFEST_NAME).exists()


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
def test_a_version_1_dataset_splits_its_records_named_by_index(tmp_path: Path, storage: str) -> None:
    """Version-1 datasets store no source paths: the parts name each record by its index in the source."""
    old = Path(__file__).resolve().parents[1] / "fixtures" / f"v1-{storage}"
    packer.split_dataset(old, tmp_path / "t", tmp_path / "v", 0.4, seed=1)
    train, val = reader.split(PackedDataset(old), 0.4, seed=1)
    for part, subset in (("t", train), ("v", val)):
        copied = PackedDataset(tmp_path / part)
        assert [copied.source(j) for j in range(len(copied))] == [f"record {i}" for i in subset.indices]
        pixels_and_labels = [(r[0], r[1]) for r in records(old, list(subset.indices))]
        assert [(r[0], r[1]) for r in records(tmp_path / part)] == pixels_and_labels
        assert packer.verify(tmp_path / part, deep=True, progress=False).ok
