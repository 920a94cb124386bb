"""Records that carry more than a class: source paths, extra fields of every type, labels files (CSV with
more columns, JSON Lines), fields in batches, unlabelled datasets, format versions."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import packer
from packer.errors import PackError
from reader import CUDAPrefetcher, PackedDataset, make_loader
from reader.format import DatasetWriter, FormatError, container, load_manifest
from reader.format.fields import FieldSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
COUNT = 7


def image(k: int) -> np.ndarray:
    """Record ``k``'s source pixels (HWC): a gradient unique to ``k``, 10x12 (sizes kept: no resize)."""
    return ((np.arange(10 * 12 * 3).reshape(10, 12, 3) * (k + 3)) % 256).astype(np.uint8)


def rows() -> list[dict]:
    """One JSON Lines object per image: every field type, varying lengths, empty lists included."""
    return [{
        "path": f"img/{k:02d}.png", "label": ["cat", "dog", "fish"][k % 3], "id": 1000 + k, "score": k / 4,
        "caption": f"photo {k} é", "tags": [["indoor", "night"], [], ["outdoor"]][k % 3],
        "codes": [k, k + 1][: k % 3], "emb": [k, 0.5, -1.25, 2.0],
        "boxes": [[0.0, 1.0, 2.5, 3.0]] * (k % 3),
    } for k in range(COUNT)]


def make_source(tmp_path: Path, labels: list[dict] | None = None, name: str = "labels.jsonl") -> Path:
    src = tmp_path / "src"
    (src / "img").mkdir(parents=True, exist_ok=True)
    for k in range(COUNT):
        Image.fromarray(image(k)).save(src / "img" / f"{k:02d}.png")
    (src / name).write_text("\n".join(json.dumps(row) for row in (labels or rows())) + "\n")
    return src


def expected_value(row: dict, name: str) -> object:
    return [float(v) for v in row[name]] if name == "emb" else row[name]


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_every_field_type_round_trips(tmp_path: Path, storage: str, encoding: str) -> None:
    src = make_source(tmp_path)
    manifest = packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", storage=storage, encoding=encoding,
                           shard_size=3 * 360, workers=2, progress=False)
    assert [(f.name, f.type) for f in manifest.fields] == [
        ("id", "int"), ("score", "float"), ("caption", "str"), ("tags", "labels"), ("codes", "labels"),
        ("emb", "vector"), ("boxes", "boxes")]
    assert manifest.fields[3].classes == ("indoor", "night", "outdoor") and manifest.fields[5].length == 4
    assert len(manifest.shards) > 1 and manifest.format_version == 5
    ds = PackedDataset(tmp_path / "out")
    for k, row in enumerate(rows()):
        pixels, label = ds[k]
        assert ds.source(k) == row["path"] and ds.classes[label] == row["label"]
        assert ds.fields(k) == {name: expected_value(row, name) for name in
                                ("id", "score", "caption", "tags", "codes", "emb", "boxes")}
        if encoding == "raw":
            assert torch.equal(pixels, torch.from_numpy(image(k)).permute(2, 0, 1))
    assert packer.verify(tmp_path / "out", deep=True, progress=False).ok


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_fields_in_batches_under_workers(tmp_path: Path, context: str) -> None:
    src = make_source(tmp_path)
    packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", crop=(10, 12), shard_size=3 * 360, workers=0,
                progress=False)
    ds = PackedDataset(tmp_path / "out")
    names = ["source", "id", "score", "caption", "tags", "emb", "boxes"]
    loader = make_loader(ds, 3, num_workers=2, order="random", seed=4, fields=names,
                         multiprocessing_context=context)
    loader.set_epoch(1)
    order = loader.shard_sampler.rank_order().tolist()
    seen = []
    for batch in loader:
        assert list(batch) == ["image", "label", *names]
        taken = order[len(seen):len(seen) + len(batch["label"])]
        seen += taken
        assert batch["image"].shape == (len(taken), 3, 10, 12)
        assert batch["id"].dtype == torch.int64 and batch["id"].tolist() == [1000 + k for k in taken]
        assert batch["score"].dtype == torch.float64 and batch["score"].tolist() == [k / 4 for k in taken]
        assert batch["emb"].dtype == torch.float32 and batch["emb"].shape == (len(taken), 4)
        assert batch["source"] == [f"img/{k:02d}.png" for k in taken]
        assert batch["caption"] == [f"photo {k} é" for k in taken]
        tag_ids = {"indoor": 0, "night": 1, "outdoor": 2}
        assert [t.tolist() for t in batch["tags"]] == [[tag_ids[n] for n in rows()[k]["tags"]] for k in taken]
        assert [tuple(b.shape) for b in batch["boxes"]] == [(k % 3, 4) for k in taken]
        for k, pixels in zip(taken, batch["image"]):
            assert torch.equal(pixels, torch.from_numpy(image(k)).permute(2, 0, 1))
    assert sorted(seen) == list(range(COUNT))


def test_default_batches_stay_tuples_and_unknown_fields_are_named(tmp_path: Path) -> None:
    src = make_source(tmp_path)
    packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", crop=(10, 12), workers=0, progress=False)
    ds = PackedDataset(tmp_path / "out")
    images, labels = next(iter(make_loader(ds, 4, num_workers=0)))
    assert images.shape == (4, 3, 10, 12) and labels.dtype == torch.int64
    with pytest.raises(KeyError, match="no field 'colour' .*has: source, id, score, caption, tags, codes, emb, boxes"):
        make_loader(ds, 4, fields=["colour"])


def test_csv_with_more_columns_declared_and_inferred(tmp_path: Path) -> None:
    src = make_source(tmp_path)
    lines = ["path,label,id,score,emb,tags"] + [
        f'img/{k:02d}.png,{["cat", "dog"][k % 2]},{k},{k / 2},"[{k}, 1, 2]","[""a""]"' for k in range(COUNT)]
    (src / "labels.csv").write_text("\n".join(lines) + "\n")
    manifest = packer.pack(src, tmp_path / "out", labels=src / "labels.csv", workers=0, progress=False,
                           fields={"emb": "vector:3", "tags": "labels:a,b"})
    assert [(f.name, f.type) for f in manifest.fields] == [
        ("id", "int"), ("score", "float"), ("emb", "vector"), ("tags", "labels")]
    ds = PackedDataset(tmp_path / "out")
    assert ds.fields(3) == {"id": 3, "score": 1.5, "emb": [3.0, 1.0, 2.0], "tags": ["a"]}
    assert ds.source(3) == "img/03.png"


@pytest.mark.parametrize(("edit", "declared", "message"), [
    (lambda r: r[2].update(id="three"), {}, r"line 3: field 'id': expected an integer, got 'three'"),
    (lambda r: r[4].update(emb=[1.0, 2.0]), {}, r"line 5: field 'emb': expected a list of 4 numbers, got 2"),
    (lambda r: r[1].update(tags=["indoor", "garden"]), {"tags": "labels:indoor,night,outdoor"},
     r"line 2: field 'tags': unknown class 'garden' \(the field's classes: indoor, night, outdoor\)"),
    (lambda r: r[5].pop("caption"), {}, r"line 6: field 'caption' is missing for 'img/05.png'"),
    (lambda r: r[0].update(boxes=[[1, 2, 3]]), {}, r"line 1: field 'boxes': expected boxes of 4 numbers each"),
    (lambda r: r[3].pop("label"), {}, r"line 4: no label for 'img/03.png', while other lines have one"),
    (lambda r: r[0].update(score="high"), {}, r"line 1: field 'score': expected a finite number, got 'high'"),
    (lambda r: r[0].update(score={"a": 1}), {}, r"line 1: field 'score': expected a finite number, got {'a': 1}"),
    (lambda r: r[2].update(score=10 ** 400), {},
     r"line 3: field 'score': expected a finite number, got 1000000000000000000000000000000000000\.\.\.$"),
    (lambda r: r[1].update(emb=[1e39, 0.5, -1.25, 2.0]), {},
     r"line 2: field 'emb': 1e\+39 is beyond the float32 range \(\+-3.4e38\) these values are stored in$"),
    (lambda r: r[1].update(boxes=[[0, 0, -1e39, 1]]), {},
     r"line 2: field 'boxes': -1e\+39 is beyond the float32 range"),
    (lambda r: r[2].update(codes=[1 << 63]), {},
     r"line 3: field 'codes': label 9223372036854775808 does not fit in 64 bits$"),
    (lambda r: r[0].update(id="1000"), {"id": "int"}, r"line 1: field 'id': expected an integer, got '1000'$"),
    (lambda r: r[0].update(emb="[1, 2, 3, 4]"), {"emb": "vector:4"},
     r"line 1: field 'emb': expected a list of numbers, got '\[1, 2, 3, 4\]'$"),
])
def test_bad_rows_are_named_by_line(tmp_path: Path, edit, declared, message) -> None:
    labels = rows()
    edit(labels)
    src = make_source(tmp_path, labels)
    with pytest.raises(PackError, match=message):
        packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", workers=0, progress=False, fields=declared)
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize(("values", "message"), [
    ([{"a": 1}, 2.5], r"line 1: field 'x': expected a finite number, got \{'a': 1\}$"),
    ([[1, 2], 7], r"line 2: field 'x': expected a list of labels, got 7$"),  # a tie: the first kind seen
])
def test_a_bad_value_as_common_as_good_ones_is_named_by_line(tmp_path: Path, values, message) -> None:
    """Two rows, one bad: the type comes from the kind of value that fits one, so the bad row is named."""
    labels = [{"path": f"img/{k:02d}.png", "label": "cat", "x": value} for k, value in enumerate(values)]
    src = make_source(tmp_path, labels)
    with pytest.raises(PackError, match=message):
        packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", workers=0, progress=False)


def test_a_declared_field_spec_must_be_named_by_its_key(tmp_path: Path) -> None:
    """Else the manifest would name one field twice and the finished dataset would not open."""
    src = make_source(tmp_path)
    message = r"^fields: the key 'id' holds a FieldSpec named 'score' \(a field's key is its name\)$"
    with pytest.raises(PackError, match=message):
        packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", workers=0, progress=False,
                    fields={"id": FieldSpec("score", "float")})
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_json_lines_text_stays_text(tmp_path: Path) -> None:
    """A JSON string is text even when it reads as a number or a list (only a CSV's cells, which are all
    text, are read as numbers or JSON lists)."""
    labels = [{"path": f"img/{k:02d}.png", "code": f"{k:03d}", "note": "[1, 2]"} for k in range(COUNT)]
    src = make_source(tmp_path, labels)
    manifest = packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", workers=0, progress=False)
    assert [(f.name, f.type) for f in manifest.fields] == [("code", "str"), ("note", "str")]
    ds = PackedDataset(tmp_path / "out")
    assert [ds.fields(k) for k in range(COUNT)] == [{"code": f"{k:03d}", "note": "[1, 2]"} for k in range(COUNT)]


def test_a_dataset_without_labels(tmp_path: Path) -> None:
    labels = [{k: v for k, v in row.items() if k != "label"} for row in rows()]
    src = make_source(tmp_path, labels)
    manifest = packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", workers=0, progress=False)
    assert manifest.labelled is False and manifest.classes == []
    ds = PackedDataset(tmp_path / "out")
    assert [ds[k][1] for k in range(COUNT)] == [-1] * COUNT  # unlabelled: every label is -1
    batch = next(iter(make_loader(ds, COUNT, num_workers=0, order="sequential", fields=["id"])))
    assert batch["label"].tolist() == [-1] * COUNT and batch["id"].tolist() == list(range(1000, 1000 + COUNT))
    assert packer.verify(tmp_path / "out", progress=False).ok


def fixture_pixels(k: int) -> np.ndarray:
    """Record ``k``'s pixels in the format-version fixtures (``tests/fixtures/v1-*``, ``v4-*``)."""
    return (np.arange(3 * 8 * 6).reshape(3, 8, 6) * (k + 1) % 256).astype(np.uint8)


def fixture_fields(k: int) -> dict:
    """Record ``k``'s fields in the version-4 fixtures."""
    return {"id": 100 + k, "caption": f"picture {k}", "box": [[float(k)] * 4] * (k % 3)}


@pytest.mark.parametrize("version", [1, 4])
def test_format_version_1_and_4_datasets_still_open(version: int) -> None:
    """Written by the packers of those versions: version 1 without source paths or fields, version 4
    with both, its record tables as plain rows at ``table_offset`` and its columns as ``.npy`` arrays."""
    for storage in ("lmdb", "hdf5"):
        ds = PackedDataset(FIXTURES / f"v{version}-{storage}")
        assert ds.manifest.format_version == version and len(ds) == 5 and ds.classes == ["cat", "dog"]
        for k in range(5):
            pixels, label = ds[k]
            assert label == k % 2 and torch.equal(pixels, torch.from_numpy(fixture_pixels(k)))
            if version == 1:
                assert ds.source(k) is None and ds.fields(k) == {}
            else:
                assert ds.source(k) == f"{['cat', 'dog'][k % 2]}/img_{k}.png"
                assert ds.fields(k) == fixture_fields(k)
        assert packer.verify(FIXTURES / f"v{version}-{storage}", deep=True, progress=False).ok


def test_version_4_and_5_shards_in_one_dataset(tmp_path: Path) -> None:
    """What an append to a version-4 dataset makes: its shards keep their plain tables and columns
    (``table_bytes`` null) beside compressed version-5 shards, each read its own way."""
    for storage in ("lmdb", "hdf5"):
        old = load_manifest(FIXTURES / f"v4-{storage}")
        writer = DatasetWriter(tmp_path / storage, storage, 1 << 20, fields=old.fields,
                               shard_name=lambda number: f"new-{number}{container(storage).suffix}")
        for k in range(5, 8):
            writer.add(fixture_pixels(k).tobytes(), k % 2, 8, 6, source=f"new/img_{k}.png", fields=fixture_fields(k))
        new_shards = writer.finish_shards()
        for shard in old.shards:
            shutil.copy(FIXTURES / f"v4-{storage}" / shard.file, tmp_path / storage / shard.file)
        dataclasses.replace(old, shards=old.shards + new_shards, format_version=5,
                            source={**old.source, "files": 8, "packed": 8}).write(tmp_path / storage)
        ds = PackedDataset(tmp_path / storage)
        assert ds.manifest.format_version == 5 and [s.compressed for s in ds.manifest.shards] == [False] * 2 + [True]
        for k in range(8):
            pixels, label = ds[k]
            assert label == k % 2 and torch.equal(pixels, torch.from_numpy(fixture_pixels(k)))
            assert ds.source(k) == (f"{['cat', 'dog'][k % 2]}/img_{k}.png" if k < 5 else f"new/img_{k}.png")
            assert ds.fields(k) == fixture_fields(k)
        assert packer.verify(tmp_path / storage, deep=True, progress=False).ok


@pytest.mark.parametrize("workers", [0, 2])
def test_a_column_readers_would_not_inflate_is_refused_when_packing(tmp_path: Path, workers: int) -> None:
    """A vector of 2,048 equal numbers per 4x4 image deflates to almost nothing, but would inflate to
    over 32 bytes per byte of its shard, past what readers inflate (a decompression bomb to them): the
    pack fails with one line naming the shard and the field (from a worker process too), and no shard is
    left as finished."""
    partitions = max(workers, 1)
    src = tmp_path / "src"
    (src / "img").mkdir(parents=True)
    for k in range(300 * partitions):
        Image.fromarray(np.full((4, 4, 3), k % 256, np.uint8)).save(src / "img" / f"{k}.png")
    lines = [json.dumps({"path": f"img/{k}.png", "label": "a", "emb": [0.5] * 2048}) for k in range(300 * partitions)]
    (src / "labels.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises((PackError, FormatError), match=r"^\S+part-0000\d-shard-00000\.lmdb: field\.emb takes "
                                                      r"2457600 bytes, more than 32 times the shard's \d+, which "
                                                      r"readers refuse to inflate; keep such a field outside the "
                                                      r"dataset$"):
        packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", workers=workers, partitions=partitions,
                    progress=False)
    assert not list((tmp_path / "out").glob("*.lmdb")) and not (tmp_path / "out" / "manifest.json").exists()


def test_a_reader_refuses_a_format_version_it_does_not_know(tmp_path: Path) -> None:
    dst = tmp_path / "v6"
    shutil.copytree(FIXTURES / "v1-lmdb", dst)
    manifest = dst / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"format_version": 1', '"format_version": 6'))
    supported = r"format version 6 is not supported \(this reader reads versions 1, 2, 3, 4, 5\b"
    with pytest.raises(FormatError, match=supported):
        load_manifest(dst)


def test_show_writes_the_records_pixels_and_metadata(tmp_path: Path) -> None:
    src = make_source(tmp_path)
    packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", workers=0, progress=False)
    ds = PackedDataset(tmp_path / "out")
    shown = packer.show(tmp_path / "out", [2, 5], tmp_path / "shown")
    for record in shown:
        with Image.open(record.file) as png:
            assert torch.equal(torch.from_numpy(np.array(png.convert("RGB"))).permute(2, 0, 1), ds[record.index][0])
            assert json.loads(png.text["fields"]) == ds.fields(record.index)
            assert png.text["source"] == f"img/{record.index:02d}.png"
            assert png.text["label"] == rows()[record.index]["label"]
    sheet = packer.show(tmp_path / "out", [0, 1, 2], tmp_path / "sheet", sheet=True)
    with Image.open(sheet[0].file) as png:
        assert [r["index"] for r in json.loads(png.text["records"])] == [0, 1, 2]


def test_info_lists_classes_with_counts(tmp_path: Path) -> None:
    src = make_source(tmp_path)
    packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", workers=0, progress=False)
    assert packer.class_counts(tmp_path / "out") == {"cat": 3, "dog": 2, "fish": 2}


def test_the_prefetcher_moves_mapping_batches_with_their_fields(tmp_path: Path) -> None:
    src = make_source(tmp_path)
    packer.pack(src, tmp_path / "out", labels=src / "labels.jsonl", crop=(10, 12), workers=0, progress=False)
    ds = PackedDataset(tmp_path / "out")
    loader = make_loader(ds, 4, num_workers=0, order="sequential", fields=["source", "emb", "tags"])
    batches = list(CUDAPrefetcher(loader, (0.0,) * 3, (255.0,) * 3, device="cpu"))
    first = batches[0]
    assert list(first) == ["image", "label", "source", "emb", "tags"]
    assert first["image"].dtype == torch.float32 and first["image"].shape == (4, 3, 10, 12)
    assert torch.allclose(first["image"][1], torch.from_numpy(image(1)).permute(2, 0, 1).float() / 255)
    assert first["source"] == [f"img/{k:02d}.png" for k in range(4)] and first["emb"].shape == (4, 4)
    assert [t.tolist() for t in first["tags"]] == [[0, 1], [], [2], [0, 1]]


def test_a_source_path_with_control_characters_stays_on_one_line(tmp_path: Path) -> None:
    items = [{"image": image(k), "label": 0, "source": f"evil\n{k}\x1b[31m.png"} for k in range(3)]
    packer.pack_items(items, tmp_path / "out", storage="hdf5", encoding="jpeg", workers=0, progress=False)
    manifest = load_manifest(tmp_path / "out")
    shard = tmp_path / "out" / manifest.shards[0].file
    offset = int(container(manifest.storage).read_table(shard, shard, compressed=True)[1]["offset"])
    with open(shard, "r+b") as f:  # record 1's JPEG no longer decodes
        f.seek(offset)
        f.write(b"\0" * 64)
    problems = packer.verify(tmp_path / "out", deep=True, progress=False).problems
    assert any(p.startswith(f"{shard.name}: record 1 (evil\\n1\\x1b[31m.png): JPEG does not decode") for p in problems)
    assert all("\n" not in p and "\x1b" not in p for p in problems)
    assert PackedDataset(tmp_path / "out").source(1) == "evil\n1\x1b[31m.png"  # stored as given
