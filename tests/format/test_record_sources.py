"""Source paths and fields beyond the JSON Lines round trip: an ImageFolder's source paths, a CSV's bad rows
named by line, a record named by its source in errors, fields through Subset / ConcatDataset loaders."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from reader_helpers import chw, make_images
from torch.utils.data import ConcatDataset, Subset

import packer
from packer.cli import main
from packer.errors import PackError
from packer.source.labels_file import declare_field
from reader import PackedDataset, make_loader
from reader.format import DatasetWriter, FormatError, load_manifest
from reader.format.compressed_arrays import compress_array, decompress_column
from reader.format.fields import FieldSpec


@pytest.mark.parametrize(("storage", "encoding"), [("lmdb", "raw"), ("hdf5", "jpeg")])
def test_an_image_folder_records_each_source_path(make_packed_dataset, tmp_path: Path, storage: str,
                                                  encoding: str) -> None:
    dst = make_packed_dataset(tmp_path, per_class=3, storage=storage, encoding=encoding, crop=24,
                              shard_size=1, partitions=2, workers=2)  # a shard per record
    ds = PackedDataset(dst)
    assert ds.manifest.format_version == 5 and len(ds.manifest.shards) == 6
    expected = [f"{name}/{i:03d}.png" for name in ("cat", "dog") for i in range(3)]
    assert [ds.source(k) for k in range(len(ds))] == expected
    assert ds.source(-1) == expected[-1] and ds.fields(0) == {}
    with pytest.raises(IndexError):
        ds.source(len(ds))


def _csv_source(tmp_path: Path, lines: list[str]) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for k, image in enumerate(make_images(4, [(6, 5)])):
        Image.fromarray(image).save(src / f"{k}.png")
    (src / "labels.csv").write_text("\n".join(lines) + "\n")
    return src


@pytest.mark.parametrize(("lines", "declared", "message"), [
    (["path,label,id", "0.png,a,1", "1.png,b,x2", "2.png,a,3"], {"id": "int"},
     r"labels.csv, line 3: field 'id': expected an integer, got 'x2'"),
    (["path,label,emb", "0.png,a,\"[1, 2]\"", "1.png,b,\"[1, 2, 3]\""], {"emb": "vector:2"},
     r"labels.csv, line 3: field 'emb': expected a list of 2 numbers, got 3"),
    (["path,label,tags", "0.png,a,\"[\"\"x\"\"]\"", "1.png,b,\"[\"\"y\"\", \"\"z\"\"]\""], {"tags": "labels:x,y"},
     r"labels.csv, line 3: field 'tags': unknown class 'z' \(the field's classes: x, y\)"),
    (["path,label,box", "0.png,a,\"[[1, 2, 3, 4]]\"", "", "1.png,b,[1"], {"box": "boxes"},
     r"labels.csv, line 4: field 'box': '\[1' is not a JSON list"),
    (["0.png,a,1", "1.png,b,2"], {},
     r"labels.csv, line 1: expected 2 columns \(path,label\), found 3; a CSV with more columns needs a header"),
    (["path,label,source", "0.png,a,x", "1.png,b,y"], {},
     r"labels.csv: column or key 'source' cannot be a field: field name 'source' is not allowed"),
    (["path,label,id", "0.png,a,1", "1.png,b"], {},
     r"labels.csv, line 3: expected 3 columns \(path,label,id\), found 2"),
    (["path,label,tags", "0.png,a,\"[\"\"x\"\"]\""], {"tags": "labels:x,y,x"},
     r"^field declaration 'tags:labels:x,y,x': class 'x' is listed twice$"),
    (["path,label,tags", "0.png,a,\"[\"\"x\"\"]\""], {"tags": "labels:, ,"},
     r"^field declaration 'tags:labels:, ,': it names no class$"),
])
def test_bad_csv_rows_are_named_by_line(tmp_path: Path, lines: list[str], declared: dict, message: str) -> None:
    src = _csv_source(tmp_path, lines)
    with pytest.raises(PackError, match=message):
        packer.pack(src, tmp_path / "out", labels=src / "labels.csv", fields=declared, workers=0, progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_csv_without_labels_but_with_fields(tmp_path: Path) -> None:
    src = _csv_source(tmp_path, ["path,caption,score"] + [f"{k}.png,image {k},{k}.5" for k in range(4)])
    manifest = packer.pack(src, tmp_path / "out", labels=src / "labels.csv", workers=0, progress=False)
    assert manifest.labelled is False and [(f.name, f.type) for f in manifest.fields] == [
        ("caption", "str"), ("score", "float")]
    ds = PackedDataset(tmp_path / "out")
    assert [ds[k][1] for k in range(4)] == [-1] * 4
    assert [ds.fields(k) for k in range(4)] == [{"caption": f"image {k}", "score": k + 0.5} for k in range(4)]
    assert packer.class_counts(tmp_path / "out") == {}


def test_a_bad_record_is_named_by_its_source_path(tmp_path: Path) -> None:
    """A record whose label indexes no class: the reader's open, ``info --classes`` and ``verify`` all
    name it by shard, record and source path."""
    dst = tmp_path / "bad"
    writer = DatasetWriter(dst, "lmdb", shard_size=1 << 20)
    for k, image in enumerate(make_images(3, [(4, 4)])):
        writer.add(chw(image).tobytes(), [0, 1, 2][k], 4, 4, source=f"photos/{k}.png")
    writer.finish(encoding="raw", classes=["a", "b"], shape=[3, 4, 4], transform={}, source={"kind": "test"},
                  tool_version="test")
    shard = dst / "shard-00000.lmdb"
    expected = rf"{shard}: record 2 \(photos/2.png\): label is not a class index"
    dataset = PackedDataset(dst)  # the open reads no table: a shard's is checked before any of its records
    for action in (lambda: dataset[0], lambda: dataset.targets, lambda: packer.class_counts(dst)):
        with pytest.raises(FormatError, match=expected):
            action()
    report = packer.verify(dst, progress=False)
    assert not report.ok and "shard-00000.lmdb: record 2 (photos/2.png): label is not a class index" in report.problems


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two raw 6x5 datasets of 4 records (labels file with an int id and a boxes field), 2 records a shard."""
    made = []
    for part in range(2):
        root = tmp_path_factory.mktemp(f"part{part}")
        src = root / "src"
        src.mkdir()
        rows = []
        for k, image in enumerate(make_images(4, [(6, 5)], seed=part)):
            Image.fromarray(image).save(src / f"{k}.png")
            rows.append({"path": f"{k}.png", "label": "ab"[k % 2], "id": 10 * part + k, "box": [[k, 0, 1, 1]] * k})
        (src / "labels.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        packer.pack(src, root / "out", labels=src / "labels.jsonl", crop=(6, 5), shard_size=2 * 90, workers=0,
                    progress=False)
        made.append(root / "out")
    return made


@pytest.mark.parametrize("kind", ["subset", "concat"])
def test_fields_through_a_subset_or_a_concatenation(two_datasets: list[Path], kind: str) -> None:
    first, second = (PackedDataset(path) for path in two_datasets)
    if kind == "subset":
        dataset, ids = Subset(first, [3, 0, 2]), [3, 0, 2]
    else:
        dataset, ids = ConcatDataset([Subset(first, [1, 2]), second]), [1, 2, 10, 11, 12, 13]
    loader = make_loader(dataset, 2, num_workers=1, order="sequential", fields=["id", "source", "box"],
                         evaluation=True, multiprocessing_context="fork")
    batches = list(loader)
    assert all(list(b) == ["image", "label", "index", "valid", "id", "source", "box"] for b in batches)
    got_ids = torch.cat([b["id"] for b in batches]).tolist()
    assert got_ids == ids
    assert [s for b in batches for s in b["source"]] == [f"{i % 10}.png" for i in ids]
    assert [b.tolist() for batch in batches for b in batch["box"]] == [[[i % 10, 0, 1, 1]] * (i % 10) for i in ids]
    for batch in batches:
        for image, position in zip(batch["image"], batch["index"].tolist()):
            assert torch.equal(image, dataset[position][0])


def test_a_concatenation_refuses_a_field_whose_type_differs(two_datasets: list[Path], tmp_path: Path) -> None:
    """Batching an int column with a float one (or vectors of two lengths, labels of two class lists)
    would fail deep in torch, or silently mix ids of different classes."""
    src = _csv_source(tmp_path, ["path,label,id"] + [f"{k}.png,a,{k}.5" for k in range(4)])
    packer.pack(src, tmp_path / "out", labels=src / "labels.csv", crop=(6, 5), workers=0, progress=False)
    dataset = ConcatDataset([PackedDataset(two_datasets[0]), PackedDataset(tmp_path / "out")])
    with pytest.raises(ValueError, match=rf"^field 'id' is id:int in {two_datasets[0]} but id:float in "
                                         rf"{tmp_path / 'out'}: a field batched from several datasets needs the same "
                                         "type"):
        make_loader(dataset, 8, num_workers=0, fields=["source", "id"])
    batch = next(iter(make_loader(dataset, 8, num_workers=0, order="sequential", fields=["source"])))
    assert batch["source"] == [f"{k}.png" for k in range(4)] * 2


def test_a_field_declared_twice_is_a_usage_error(tmp_path: Path) -> None:
    src = _csv_source(tmp_path, ["path,label,n"] + [f"{k}.png,a,{k}" for k in range(4)])
    result = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "out"), "--labels", str(src / "labels.csv"),
                                       "--workers", "0", "--field", "n:int", "--field", "n:str"])
    assert result.exit_code == 2 and "Invalid value for '--field': field 'n' is declared twice" in result.output
    assert not (tmp_path / "out").exists()


def test_the_writer_refuses_a_record_whose_fields_do_not_match_the_schema(tmp_path: Path) -> None:
    writer = DatasetWriter(tmp_path / "out", "hdf5", 1 << 20, fields=[FieldSpec("id", "int")])
    with pytest.raises(ValueError, match=r"record 'x.png': fields id do not match the schema \(id\)"):
        writer.add(np.zeros(3, np.uint8).tobytes(), 0, 1, 1, source="x.png", fields={})
    writer.abort()


def test_info_shows_each_field_as_its_declaration(tmp_path: Path) -> None:
    """``packer info`` lists the schema in ``--field`` syntax, which declares the same fields again.
    A CSV column of JSON lists is inferred as a list type (here a vector: numbers, not all integers)."""
    src = _csv_source(tmp_path, ["path,label,emb,tags,n"] + [f'{k}.png,a,"[{k}.5, 1]","[""x""]",{k}' for k in range(4)])
    result = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "out"), "--labels", str(src / "labels.csv"),
                                       "--workers", "0", "--field", "tags:labels:x,y"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["info", str(tmp_path / "out")])
    line = next(line for line in result.output.splitlines() if line.startswith("fields"))
    assert line.split(None, 1)[1] == "emb:vector:2; tags:labels:x,y; n:int"
    declared = [declare_field(text) for text in line.split(None, 1)[1].split("; ")]
    assert declared == load_manifest(tmp_path / "out").fields


def test_a_source_path_is_read_without_the_fields_columns(tmp_path: Path) -> None:
    """Columns load one by one on first use: a damaged field column fails only what reads that field,
    with a ``FormatError`` naming the shard and the column."""
    writer = DatasetWriter(tmp_path / "out", "hdf5", 1 << 20, fields=[FieldSpec("emb", "vector", length=2)])
    for k, image in enumerate(make_images(2, [(3, 2)])):
        writer.add(chw(image).tobytes(), 0, 3, 2, source=f"s/{k}.png", fields={"emb": [k, 0.5]})
    writer.finish(encoding="raw", classes=["a"], shape=[3, 3, 2], transform={}, source={"kind": "test"},
                  tool_version="test")
    shard = tmp_path / "out" / "shard-00000.h5"
    with h5py.File(shard, "r+") as f:
        del f["arrays/field.emb"]
        f["arrays/field.emb"] = np.frombuffer(compress_array(np.zeros((2, 2), np.int64)), np.uint8)
    manifest = load_manifest(tmp_path / "out")  # the shard's new size, so that it opens
    manifest.shards = [dataclasses.replace(manifest.shards[0], bytes=shard.stat().st_size)]
    manifest.write(tmp_path / "out")
    ds = PackedDataset(tmp_path / "out")
    assert [ds.source(k) for k in range(2)] == ["s/0.png", "s/1.png"]
    with pytest.raises(FormatError, match=rf"{shard}: column field.emb has dtype int64"):
        ds.fields(0)


@pytest.mark.parametrize(("classes", "stored", "message"), [
    (("x", "y"), 2, "holds 2, not a class of the field's 2"),
    (("x", "y"), -1, "holds -1, not a class of the field's 2"),
    (None, -3, "holds -3, not a non-negative label"),
])
def test_a_label_field_holding_no_class_is_refused(tmp_path: Path, classes, stored: int, message: str) -> None:
    """A labels column is checked like the record table's labels: an id outside the field's classes
    would otherwise be an IndexError, or silently the last class for -1."""
    spec = FieldSpec("tags", "labels", classes=classes)
    writer = DatasetWriter(tmp_path / "out", "hdf5", 1 << 20, fields=[spec])
    image = make_images(1, [(3, 2)])[0]
    writer.add(chw(image).tobytes(), 0, 3, 2, source="s/0.png", fields={"tags": [0, 1] if classes else [5]})
    writer.finish(encoding="raw", classes=["a"], shape=[3, 3, 2], transform={}, source={"kind": "test"},
                  tool_version="test")
    shard = tmp_path / "out" / "shard-00000.h5"
    with h5py.File(shard, "r+") as f:
        values = decompress_column(f["arrays/field.tags.values"][()].tobytes(), shard, "values", 1 << 20, None)
        values[0] = stored
        del f["arrays/field.tags.values"]
        f["arrays/field.tags.values"] = np.frombuffer(compress_array(values), np.uint8)
    manifest = load_manifest(tmp_path / "out")  # the shard's new size, so that it opens
    manifest.shards = [dataclasses.replace(manifest.shards[0], bytes=shard.stat().st_size)]
    manifest.write(tmp_path / "out")
    with pytest.raises(FormatError, match=rf"{shard}: column field.tags {message}"):
        PackedDataset(tmp_path / "out").fields(0)


def test_fields_follow_a_resumed_loader(two_datasets: list[Path]) -> None:
    """After ``load_state_dict`` the fields still belong to the images they come with."""
    ds = PackedDataset(two_datasets[0])

    def loader():
        made = make_loader(ds, 1, num_workers=0, order="random", seed=3, fields=["id"])
        made.set_epoch(2)
        return made

    whole = [(b["image"][0].clone(), b["id"].item()) for b in loader()]
    first = loader()
    batches = iter(first)
    head = [next(batches)["id"].item() for _ in range(2)]
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    tail = [(b["image"][0].clone(), b["id"].item()) for b in resumed]
    assert head + [i for _, i in tail] == [i for _, i in whole]
    assert sorted(i for _, i in whole) == list(range(len(ds)))
    for image, i in whole + tail:
        assert torch.equal(image, ds[i][0])  # ids are the record numbers here


@pytest.mark.parametrize(("declared", "expected"), [({}, [7, 8, 9, 10]), ({"id": "str"}, ["007", "008", "009", "010"])])
def test_a_csv_column_of_integers_is_int_unless_declared_text(tmp_path: Path, declared: dict, expected: list) -> None:
    src = _csv_source(tmp_path, ["path,id"] + [f"{k}.png,{7 + k:03d}" for k in range(4)])
    packer.pack(src, tmp_path / "out", labels=src / "labels.csv", fields=declared, workers=0, progress=False)
    ds = PackedDataset(tmp_path / "out")
    assert [ds.fields(k)["id"] for k in range(4)] == expected


@pytest.mark.parametrize("name", ["labels.jsonl", "labels.csv"])
def test_a_labels_field_declared_without_classes_takes_the_names_in_the_file(tmp_path: Path, name: str) -> None:
    """The README's ``--field tags:labels``: class names get their classes from the file (sorted), as an
    inferred field's do; integers stay integer labels."""
    tags = [["outdoor", "cat"], ["cat"], []]
    if name.endswith(".jsonl"):
        lines = [json.dumps({"path": f"{k}.png", "label": "a", "tags": t}) for k, t in enumerate(tags)]
    else:
        lines = ["path,label,tags"] + [f'{k}.png,a,"{json.dumps(t).replace(chr(34), chr(34) * 2)}"'
                                       for k, t in enumerate(tags)]
    src = _csv_source(tmp_path, lines)
    (src / "labels.csv").rename(src / name)
    result = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "out"), "--labels", str(src / name),
                                       "--workers", "0", "--quiet", "--field", "tags:labels"])
    assert result.exit_code == 0, result.output
    ds = PackedDataset(tmp_path / "out")
    assert ds.manifest.fields == [FieldSpec("tags", "labels", classes=("cat", "outdoor"))]
    assert [ds.fields(k)["tags"] for k in range(3)] == tags


def test_class_names_for_a_labels_field_of_items_without_classes_say_what_to_declare(tmp_path: Path) -> None:
    items = [{"image": np.zeros((4, 4, 3), np.uint8), "tags": ["cat"]}]
    with pytest.raises(PackError, match=r"^item 0 \(item-0\): field 'tags': got the class name 'cat', but the field "
                                        r"has no class list: declare one \(tags:labels:A,B,\.\.\.\), or give integer "
                                        r"labels$"):
        packer.pack_items(items, tmp_path / "out", fields={"tags": "labels"}, workers=0, progress=False)
