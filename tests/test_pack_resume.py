"""An interrupted pack leaves no manifest, and a rerun resumes after the finished shards it can trust."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

import packer
import packer.packing
from packer.destination import JOURNAL_NAME
from packer.journal import Journal
from reader.format import MANIFEST_NAME

OPTIONS = {"resize": 16, "crop": 16, "shard_size": 3 * 3 * 16 * 16, "workers": 0, "progress": False}


class SimulatedCrash(Exception):
    pass


@pytest.fixture
def src(tmp_path: Path, make_image_folder: Callable[..., Path]) -> Path:
    return make_image_folder(tmp_path / "src", per_class=6)  # 12 images: shards of 3


def crash_after_shards(monkeypatch: pytest.MonkeyPatch, shards: int) -> None:
    """Make the pack die right after its ``shards``-th shard is journaled, leaving its leftovers behind
    as a killed process would (no clean-up of the shard being written)."""
    original = Journal.add_shard

    def add_shard(self: Journal, info: object, end: int, dst: Path) -> None:
        original(self, info, end, dst)
        if len(self.shards) == shards:
            (dst / "shard-00099.lmdb.tmp").write_bytes(b"half-written")
            raise SimulatedCrash

    monkeypatch.setattr(Journal, "add_shard", add_shard)
    monkeypatch.setattr(packer.packing.ShardSequence, "abort", lambda self: None)


def count_encoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record how many images each pack sends to be encoded."""
    counts: list[int] = []
    original = packer.packing.encode_in_order

    def encode_in_order(paths, spec, workers):  # type: ignore[no-untyped-def]
        counts.append(len(paths))
        return original(paths, spec, workers)

    monkeypatch.setattr(packer.packing, "encode_in_order", encode_in_order)
    return counts


def tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_rerun_after_a_crash_resumes_and_gives_identical_output(
    tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = tmp_path / "clean"
    packer.pack(src, clean, **OPTIONS)
    dst = tmp_path / "out"
    with monkeypatch.context() as patch:
        crash_after_shards(patch, 2)
        with pytest.raises(SimulatedCrash):
            packer.pack(src, dst, **OPTIONS)
    assert not (dst / MANIFEST_NAME).exists()
    assert (dst / JOURNAL_NAME).exists()
    with pytest.raises(Exception, match="no manifest.json"):
        packer.info(dst)

    encoded = count_encoded(monkeypatch)
    packer.pack(src, dst, **OPTIONS)
    assert encoded == [6]  # the two finished shards (6 images) were kept
    assert tree(dst) == tree(clean)


def test_a_corrupt_finished_shard_is_redone(tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "out"
    with monkeypatch.context() as patch:
        crash_after_shards(patch, 3)
        with pytest.raises(SimulatedCrash):
            packer.pack(src, dst, **OPTIONS)
    shard = dst / "shard-00001.lmdb"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))

    encoded = count_encoded(monkeypatch)
    packer.pack(src, dst, **OPTIONS)
    assert encoded == [9]  # shard 0 kept; shard 1 failed its checksum, so it and the rest were redone
    clean = tmp_path / "clean"
    packer.pack(src, clean, **OPTIONS)
    assert tree(dst) == tree(clean)


def test_changed_options_start_over(tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "out"
    with monkeypatch.context() as patch:
        crash_after_shards(patch, 2)
        with pytest.raises(SimulatedCrash):
            packer.pack(src, dst, **OPTIONS)
    encoded = count_encoded(monkeypatch)
    changed = {**OPTIONS, "storage": "hdf5"}
    packer.pack(src, dst, **changed)
    assert encoded == [12]
    assert sorted(p.name for p in dst.iterdir()) == [MANIFEST_NAME] + [f"shard-0000{i}.h5" for i in range(4)]
    clean = tmp_path / "clean"
    packer.pack(src, clean, **changed)
    assert tree(dst) == tree(clean)


def test_a_failed_pack_keeps_its_finished_shards_for_the_rerun(
    tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = src / "dog" / "005.png"
    good = bad.read_bytes()
    bad.write_text("not a png")  # the last image: fails after three shards are finished
    dst = tmp_path / "out"
    with pytest.raises(packer.PackError, match="not an image"):
        packer.pack(src, dst, **OPTIONS)
    assert sorted(p.name for p in dst.iterdir()) == [JOURNAL_NAME] + [f"shard-0000{i}.lmdb" for i in range(3)]
    bad.write_bytes(good)
    encoded = count_encoded(monkeypatch)
    packer.pack(src, dst, **OPTIONS)
    assert encoded == [3]
