"""Format version 4 on: the manifest says where each shard's record table lies (``table_offset``, and
from version 5 its compressed length, ``table_bytes``), so a reader reads a table in one ``pread``;
version-3 datasets still look it up in the container, and ``packer verify`` checks that both places
hold the same table."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hostile_helpers import edit_manifest
from reader_helpers import make_images, pack_images

import packer
import reader.shard_io
from reader import PackedDataset
from reader.format import FormatError, container
from reader.format.compressed_arrays import compress_table, decompress_table
from reader.format.manifest import manifest_checksum

COUNT = 37
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module", params=["lmdb", "hdf5"])
def packed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp(request.param) / "packed"
    return pack_images(dst, make_images(COUNT, [(16, 24)]), [i % 3 for i in range(COUNT)],
                       storage=request.param, encoding="jpeg", records_per_shard=15).path


def copy_with_manifest(src: Path, dst: Path, edit) -> Path:
    """A copy of the dataset ``src`` (shards hard-linked) whose manifest ``edit`` changed, checksum redone."""
    dst.mkdir()
    for shard in src.iterdir():
        if shard.name != "manifest.json":
            os.link(shard, dst / shard.name)
    data = json.loads((src / "manifest.json").read_text())
    data.pop("checksum")
    edit(data)
    data["checksum"] = manifest_checksum(data)
    (dst / "manifest.json").write_text(json.dumps(data))
    return dst


def test_each_shard_records_where_its_table_lies(packed: Path) -> None:
    ds = PackedDataset(packed)
    assert ds.manifest.format_version == 5 and len(ds.manifest.shards) == 3
    for shard in ds.manifest.shards:
        table = container(ds.manifest.storage).read_table(packed / shard.file, packed / shard.file, shard.records,
                                                          compressed=True)
        with open(packed / shard.file, "rb") as f:
            f.seek(shard.table_offset)
            stored = f.read(shard.table_bytes)
        assert stored == compress_table(table) and decompress_table(stored, "", shard.records, shard.bytes).tobytes() \
            == table.tobytes()


def test_a_table_is_one_read(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: (reads.append((n, offset)), real_pread(fd, n, offset))[1])
    ds = PackedDataset(packed)
    ds._load_table(1)
    shard = ds.manifest.shards[1]
    assert reads == [(shard.table_bytes, shard.table_offset)]


def as_version_3(data: dict) -> None:
    data["format_version"] = 3
    for shard in data["shards"]:
        del shard["table_offset"]


def version_3_copy(packed: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The version-4 fixture of ``packed``'s storage, and a copy of it made a version-3 dataset (tables
    only in the containers): the same shard files, which a version-3 packer wrote the same way."""
    fixture = FIXTURES / f"v4-{PackedDataset(packed).manifest.storage}"
    return fixture, copy_with_manifest(fixture, tmp_path / "v3", as_version_3)


def test_version_3_datasets_look_their_tables_up_in_the_container(packed: Path, tmp_path: Path) -> None:
    fixture, old = version_3_copy(packed, tmp_path)
    ds, new = PackedDataset(old), PackedDataset(fixture)
    assert ds.manifest.format_version == 3 and {s.table_offset for s in ds.manifest.shards} == {None}
    assert ds.targets.tolist() == new.targets.tolist() and ds._offsets.tolist() == new._offsets.tolist()
    for i in range(len(ds)):
        assert torch.equal(ds[i][0], new[i][0]) and ds.source(i) == new.source(i)
    assert packer.verify(old, deep=True, progress=False).ok


def test_a_table_past_the_end_is_refused_naming_the_shard_entry(packed: Path, tmp_path: Path) -> None:
    """Checked with the manifest, before any shard is opened: a table past the shard's recorded size
    (whose file has exactly that size, or is refused) is a damaged or edited manifest."""
    shards = json.loads((packed / "manifest.json").read_text())["shards"]
    size, stored = shards[1]["bytes"], shards[1]["table_bytes"]
    bad = copy_with_manifest(packed, tmp_path / "bad", lambda data: data["shards"][1].update(table_offset=size - 100))
    message = (rf"^{bad / 'manifest.json'}: shards\[1\] puts its record table's {stored} bytes at offset "
               rf"{size - 100}, past the end of its {size} bytes$")
    with pytest.raises(FormatError, match=message):
        PackedDataset(bad)
    with pytest.raises(FormatError, match=message):
        packer.verify(bad, progress=False)
    huge = copy_with_manifest(packed, tmp_path / "huge", lambda data: data["shards"][1].update(table_bytes=2**70))
    with pytest.raises(FormatError, match=rf"puts its record table's {2**70} bytes at offset"):
        PackedDataset(huge)


def test_a_table_offset_that_points_elsewhere_is_caught(packed: Path, tmp_path: Path) -> None:
    """Bytes read from the wrong place are not a stored table; ``verify`` names the disagreement and
    goes on with the container's table (its records still read back)."""
    name = json.loads((packed / "manifest.json").read_text())["shards"][0]["file"]
    bad = copy_with_manifest(packed, tmp_path / "bad", lambda data: data["shards"][0].update(table_offset=0))
    with pytest.raises(FormatError, match=rf"^{bad / name}: record table is not valid \.npy data"):
        PackedDataset(bad).targets
    report = packer.verify(bad, deep=True, progress=False)
    assert report.problems == [f"{name}: the record table at the manifest's table_offset (0) is not the one the "
                               "container holds (the shard or the manifest was damaged or edited)"]
    assert report.records == COUNT


def test_a_version_4_table_offset_that_points_elsewhere_is_caught(packed: Path, tmp_path: Path) -> None:
    """Plain rows (version 4) read from the wrong place fail the table's checks when read; ``verify``
    names the disagreement with the container's table."""
    fixture = FIXTURES / f"v4-{PackedDataset(packed).manifest.storage}"
    name = json.loads((fixture / "manifest.json").read_text())["shards"][0]["file"]
    bad = copy_with_manifest(fixture, tmp_path / "bad", lambda data: data["shards"][0].update(table_offset=0))
    with pytest.raises(FormatError, match=rf"^{bad / name}: record \d+"):
        PackedDataset(bad).targets
    report = packer.verify(bad, progress=False)
    assert any(problem == f"{name}: the record table at the manifest's table_offset (0) is not the one the "
               "container holds (the shard or the manifest was damaged or edited)" for problem in report.problems)


@pytest.mark.parametrize("offset, message", [
    (-1, "has a negative record count, size, table offset or table length"),
    ("12", "table_offset is a str ('12'), expected int or null"),
])
def test_a_bad_table_offset_value_is_named(packed: Path, tmp_path: Path, offset: object, message: str) -> None:
    bad = copy_with_manifest(packed, tmp_path / "bad", lambda data: data["shards"][2].update(table_offset=offset))
    with pytest.raises(FormatError, match=r"shards\[2\]"):
        PackedDataset(bad)
    with pytest.raises(FormatError) as caught:
        PackedDataset(bad)
    assert message in str(caught.value)


def test_join_keeps_each_shard_s_table_offset(packed: Path, tmp_path: Path) -> None:
    again = copy_with_manifest(packed, tmp_path / "again", lambda data: None)
    joined = packer.join_datasets(tmp_path / "joined", [packed, again])
    offsets = [s.table_offset for s in PackedDataset(packed).manifest.shards]
    assert [s.table_offset for s in joined.manifest.shards] == offsets * 2
    assert packer.verify(tmp_path / "joined", deep=True, progress=False).ok
    first = PackedDataset(tmp_path / "joined")
    assert np.array_equal(first.targets, np.concatenate([PackedDataset(packed).targets] * 2))


def test_lying_rows_at_the_table_offset_are_refused_naming_the_record(packed: Path, tmp_path: Path) -> None:
    """The table read at ``table_offset`` passes the same checks as a table read from the container."""
    shard = PackedDataset(packed).manifest.shards[0]
    table = container(PackedDataset(packed).manifest.storage).read_table(packed / shard.file, packed / shard.file,
                                                                       compressed=True)
    table[1]["label"] = 99
    lying = compress_table(table)
    bad = Path(shutil.copytree(packed, tmp_path / "bad"))
    with open(bad / shard.file, "r+b") as f:
        f.seek(shard.table_offset)
        f.write(lying)
    size = (bad / shard.file).stat().st_size
    edit_manifest(bad, lambda data: data["shards"][0].update(table_bytes=len(lying), bytes=size))
    with pytest.raises(FormatError, match=rf"^{bad / shard.file}: record 1\b.*label is not a class index"):
        PackedDataset(bad).targets


def test_tables_are_read_ahead_at_their_offsets_once(packed: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_tables_ahead`` asks the kernel for each unread table's rows (where the manifest says), once,
    and never for a table already read; datasets of format 3 and datasets without read-ahead ask for
    nothing. The tables are then read as ever."""
    advice: list[tuple[int, int, int, int]] = []
    monkeypatch.setattr(reader.shard_io.os, "posix_fadvise",
                        lambda fd, offset, length, kind: advice.append((fd, offset, length, kind)))
    ds = PackedDataset(packed)
    ds._load_table(0)
    ds.read_tables_ahead([0, 1, 16, 17, 36])  # shards 0 (read), 1 and 2
    ds.read_tables_ahead(np.array([20, 30]))  # asked for already
    shard_of_fd = {entry.fd: shard for shard, entry in ds._files._open.items()}
    shards = ds.manifest.shards
    assert [(shard_of_fd[fd], offset, length, kind) for fd, offset, length, kind in advice] == \
        [(s, shards[s].table_offset, shards[s].table_bytes, os.POSIX_FADV_WILLNEED) for s in (1, 2)]
    assert ds.targets.tolist() == PackedDataset(packed, readahead=False).targets.tolist()
    _, old = version_3_copy(packed, tmp_path)
    PackedDataset(old).read_tables_ahead(np.arange(5))
    PackedDataset(packed, readahead=False).read_tables_ahead(np.arange(COUNT))
    assert len(advice) == 2
