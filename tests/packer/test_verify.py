"""``packer.verify`` and ``packer.info`` on real packed datasets, intact and damaged."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

import packer
from reader.format import FormatError, container, load_manifest


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_intact_dataset_verifies_deep(
    tmp_path: Path, make_packed_dataset: Callable[..., Path], storage: str, encoding: str
) -> None:
    dst = make_packed_dataset(tmp_path, storage=storage, encoding=encoding, resize=20, shard_size=4000)
    report = packer.verify(dst, deep=True, progress=False)
    assert report.ok, report.problems
    assert report.records == 6 and report.shards == len(load_manifest(dst).shards) > 1


def flip_byte_in_record(dst: Path, shard: int, record: int, at: int) -> None:
    """Flip one payload byte of a record, found through the shard's record table."""
    manifest = load_manifest(dst)
    path = dst / manifest.shards[shard].file
    row = container(manifest.storage).read_table(path, path, compressed=manifest.shards[shard].compressed)[record]
    data = bytearray(path.read_bytes())
    data[int(row["offset"]) + at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
def test_flipped_byte_fails_the_checksum(
    tmp_path: Path, make_packed_dataset: Callable[..., Path], storage: str
) -> None:
    dst = make_packed_dataset(tmp_path, storage=storage, resize=16, crop=16, shard_size=3 * 768)
    flip_byte_in_record(dst, shard=1, record=2, at=100)
    report = packer.verify(dst, progress=False)
    name = load_manifest(dst).shards[1].file
    assert report.problems == [f"{name}: checksum mismatch (the file is corrupt or changed)"]


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
def test_deep_names_the_record_that_does_not_decode(
    tmp_path: Path, make_packed_dataset: Callable[..., Path], storage: str
) -> None:
    dst = make_packed_dataset(tmp_path, storage=storage, encoding="jpeg", resize=20, shard_size=10**6)
    flip_byte_in_record(dst, shard=0, record=4, at=0)  # the JPEG's SOI marker
    name = load_manifest(dst).shards[0].file
    assert not packer.verify(dst, progress=False).ok
    problems = packer.verify(dst, deep=True, progress=False).problems
    assert problems[0] == f"{name}: checksum mismatch (the file is corrupt or changed)"
    assert len(problems) == 2  # the bad record is named with its source path
    assert problems[1].startswith(f"{name}: record 4 (dog/001.png): JPEG does not decode")


def test_missing_shard_and_wrong_size_are_reported(tmp_path: Path, make_packed_dataset: Callable[..., Path]) -> None:
    dst = make_packed_dataset(tmp_path, resize=16, crop=16, shard_size=3 * 768)
    first, second = load_manifest(dst).shards
    (dst / second.file).unlink()
    with open(dst / first.file, "ab") as f:
        f.write(b"\0")
    problems = packer.verify(dst, deep=True, progress=False).problems
    assert f"{second.file}: missing (the manifest lists it)" in problems
    assert (f"{first.file}: {first.bytes + 1} bytes, the manifest says {first.bytes} "
            "(truncated or changed; not read further)") in problems


def test_verify_refuses_a_directory_without_manifest(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="no manifest.json"):
        packer.verify(tmp_path, progress=False)


def test_info_summarises_the_dataset(tmp_path: Path, make_packed_dataset: Callable[..., Path]) -> None:
    dst = make_packed_dataset(tmp_path, resize=16, crop=(12, 16), encoding="jpeg", quality=80, storage="hdf5")
    summary = packer.info(dst)
    assert summary.records == 6 and summary.classes == ["cat", "dog"] and summary.shards == 1
    assert summary.storage == "hdf5" and summary.encoding == "jpeg" and summary.jpeg_quality == 80
    assert summary.shape == [3, 12, 16]
    assert summary.bytes_on_disk == sum(p.stat().st_size for p in dst.iterdir())
    assert summary.skipped == []
    assert summary.to_dict()["transform"]["crop"]["size"] == [16, 12]
