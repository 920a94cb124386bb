"""``packer join OUT A B ...``: joining finished datasets, hard links where possible, clear refusals."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner
from pack_helpers import read_packed_records

import packer
from packer.cli import main
from reader import PackedDataset
from reader.format import DatasetWriter, load_manifest

OPTIONS = {"resize": 16, "crop": 16, "workers": 0, "progress": False, "resampler": "pil"}


def run(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture
def two_datasets(tmp_path: Path, make_image_folder: Callable[..., Path]) -> tuple[Path, Path]:
    a = make_image_folder(tmp_path / "src-a", per_class=2)
    b = make_image_folder(tmp_path / "src-b", per_class=3, size=(50, 40))
    packer.pack(a, tmp_path / "a", **OPTIONS)
    packer.pack(b, tmp_path / "b", partitions=2, **OPTIONS)
    return tmp_path / "a", tmp_path / "b"


def test_join_hard_links_the_shards_and_keeps_every_record(tmp_path: Path, two_datasets: tuple[Path, Path]) -> None:
    a, b = two_datasets
    out = tmp_path / "joined"
    code, output = run("join", out, a, b)
    assert code == 0, output
    assert output == (f"joined 2 datasets into {out}: 10 images in 2 classes, "
                      "3 shards (3 hard-linked (no bytes copied), 0 copied)\n")
    assert read_packed_records(out) == read_packed_records(a) + read_packed_records(b)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["manifest.json", "shard-00000.lmdb", "shard-00001.lmdb", "shard-00002.lmdb"]
    assert (out / "shard-00001.lmdb").stat().st_ino == (b / "part-00000-shard-00000.lmdb").stat().st_ino
    assert packer.verify(out, deep=True, progress=False).ok
    ds = PackedDataset(out)
    assert len(ds) == 10 and ds.classes == ["cat", "dog"]
    assert [int(ds[i][1]) for i in range(10)] == [0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    manifest = packer.info(out)
    assert manifest.source["kind"] == "merge" and manifest.source["packed"] == 10


def test_join_copies_across_file_systems(tmp_path: Path, two_datasets: tuple[Path, Path]) -> None:
    a, b = two_datasets
    if not Path("/dev/shm").is_dir() or Path("/dev/shm").stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a file system other than the test's temporary directory")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        out = Path(other) / "joined"
        report = packer.join_datasets(out, [a, b])
        assert (report.linked, report.copied) == (0, 3)
        assert read_packed_records(out) == read_packed_records(a) + read_packed_records(b)
        assert packer.verify(out, progress=False).ok


def test_integer_label_classes_that_extend_each_other_join(
    tmp_path: Path, make_image_folder: Callable[..., Path]
) -> None:
    src = make_image_folder(tmp_path / "src", per_class=2)
    (tmp_path / "few.csv").write_text("cat/000.png,0\ncat/001.png,1\n")
    (tmp_path / "more.csv").write_text("dog/000.png,2\ndog/001.png,0\n")
    packer.pack(src, tmp_path / "few", labels=tmp_path / "few.csv", **OPTIONS)
    packer.pack(src, tmp_path / "more", labels=tmp_path / "more.csv", **OPTIONS)
    report = packer.join_datasets(tmp_path / "out", [tmp_path / "few", tmp_path / "more"])
    assert report.manifest.classes == ["0", "1", "2"]
    assert [r[1] for r in read_packed_records(tmp_path / "out")] == [0, 1, 2, 0]


def test_join_refuses_other_classes_naming_the_input(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    packer.pack(make_image_folder(tmp_path / "s1", classes=("cat", "dog")), tmp_path / "one", **OPTIONS)
    packer.pack(make_image_folder(tmp_path / "s2", classes=("cat", "fox")), tmp_path / "two", **OPTIONS)
    code, output = run("join", tmp_path / "out", tmp_path / "one", tmp_path / "two")
    assert code == 1
    assert output == (
        f"Error: {tmp_path / 'two'}: label 1 is class 'fox' there but 'dog' in {tmp_path / 'one'}; labels are class "
        "positions, so the class lists must agree by name (one may only extend another)\n"
    )
    assert not (tmp_path / "out").exists()


def test_join_refuses_another_pre_transform(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src")
    packer.pack(src, tmp_path / "one", **OPTIONS)
    packer.pack(src, tmp_path / "two", **{**OPTIONS, "resize": 20})
    code, output = run("join", tmp_path / "out", tmp_path / "one", tmp_path / "two")
    assert code == 1
    assert output == (
        f"Error: {tmp_path / 'two'}: its pre-transform differs from {tmp_path / 'one'}'s in resize; "
        "only datasets packed with the same pre-transform can be joined\n"
    )
    packer.pack(src, tmp_path / "jpeg", **{**OPTIONS, "encoding": "jpeg"})
    code, output = run("join", tmp_path / "out", tmp_path / "one", tmp_path / "jpeg")
    assert output == (
        f"Error: {tmp_path / 'jpeg'}: encoding is 'jpeg' but {tmp_path / 'one'}'s is 'raw'; "
        "only datasets packed the same way can be joined\n"
    )


def test_join_refuses_an_unfinished_input_and_an_existing_output(
    tmp_path: Path, two_datasets: tuple[Path, Path]
) -> None:
    a, b = two_datasets
    (tmp_path / "empty").mkdir()
    code, output = run("join", tmp_path / "out", a, tmp_path / "empty")
    assert code == 1 and "empty: no manifest.json, so this is not a finished packed dataset" in output
    assert run("join", tmp_path / "out", a, b)[0] == 0
    code, output = run("join", tmp_path / "out", a, b)
    assert code == 1 and "already holds a finished packed dataset; pass --force" in output
    assert run("join", tmp_path / "out", a, b, "--force")[0] == 0
    code, output = run("join", a, a, b)
    assert code == 1 and output == f"Error: {a}: the output cannot be one of the datasets being joined\n"
    code, output = run("join", a / "sub", a, b)
    assert code == 1 and output == (f"Error: {a / 'sub'}: the output cannot be inside {a}, one of the datasets "
                                    "being joined\n")
    assert not (a / "sub").exists()


def test_the_old_merge_spelling_still_joins_with_a_note(tmp_path: Path, two_datasets: tuple[Path, Path]) -> None:
    a, b = two_datasets
    result = CliRunner().invoke(main, ["merge", str(tmp_path / "old"), str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert result.stderr == "note: `packer merge OUT A B ...` is now `packer join OUT A B ...`; this form will go\n"
    assert read_packed_records(tmp_path / "old") == read_packed_records(a) + read_packed_records(b)


def test_datasets_of_format_versions_4_and_5_join_into_version_5(tmp_path: Path) -> None:
    """Each shard keeps the layout it was written in; the joined manifest says how to read each."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "v4-lmdb"
    old = load_manifest(fixture)
    writer = DatasetWriter(tmp_path / "new", "lmdb", 1 << 20, fields=old.fields)
    writer.add(bytes(3 * 8 * 6), 1, 8, 6, source="new/img.png", fields={"id": 7, "caption": "new", "box": []})
    writer.finish(encoding="raw", classes=old.classes, shape=old.shape, transform=old.transform,
                  source={"kind": "imagefolder", "root": "new", "files": 1, "packed": 1, "skipped": []},
                  tool_version="test")
    code, output = run("join", tmp_path / "out", fixture, tmp_path / "new")
    assert code == 0, output
    joined = PackedDataset(tmp_path / "out")
    assert joined.manifest.format_version == 5
    assert [s.compressed for s in joined.manifest.shards] == [False, False, True]
    assert read_packed_records(tmp_path / "out") == read_packed_records(fixture) + read_packed_records(tmp_path / "new")
    assert [joined.source(k) for k in (0, 5)] == [PackedDataset(fixture).source(0), "new/img.png"]
    assert joined.fields(5) == {"id": 7, "caption": "new", "box": []}
    assert packer.verify(tmp_path / "out", deep=True, progress=False).ok
    version_1 = Path(__file__).resolve().parents[1] / "fixtures" / "v1-lmdb"
    code, output = run("join", tmp_path / "out1", fixture, version_1)
    message = (f"Error: {version_1}: format version 1 stores no source paths, so it joins only version-1 "
               f"datasets ({fixture} is a later version); pack it again to join them\n")
    assert code == 1 and output == message
    assert run("join", tmp_path / "out1", version_1, fixture) == (1, message)
