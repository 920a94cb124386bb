"""The format's one registry of containers and encodings, and ``DatasetWriter``, the one way to write."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from reader import PackedDataset
from reader.format import (
    ENCODINGS,
    STORAGES,
    DatasetWriter,
    FormatError,
    container,
    encoding,
    load_manifest,
)


def test_the_registry_names_every_container_and_encoding() -> None:
    assert STORAGES == ("lmdb", "hdf5") and ENCODINGS == ("raw", "jpeg")
    assert [container(s).suffix for s in STORAGES] == [".lmdb", ".h5"]
    assert container("hdf5").temporary_suffixes == (".tmp", ".spool")
    assert encoding("raw").stores_pixels and not encoding("jpeg").stores_pixels


def test_unknown_names_are_format_errors_naming_them() -> None:
    with pytest.raises(FormatError, match=r"^unknown storage 'zip' \(expected one of lmdb, hdf5\)$"):
        container("zip")
    with pytest.raises(FormatError, match=r"^unknown encoding 'png' \(expected one of raw, jpeg\)$"):
        encoding("png")


@pytest.mark.parametrize("storage", STORAGES)
def test_dataset_writer_rolls_over_by_payload_bytes_and_writes_the_manifest_last(
    tmp_path: Path, storage: str
) -> None:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (3, 4, 5), dtype=np.uint8) for _ in range(7)]
    writer = DatasetWriter(tmp_path / "ds", storage, shard_size=3 * images[0].nbytes)
    for k, image in enumerate(images):
        writer.add(image.tobytes(), k % 2, 4, 5, source=f"img/{k}.png")
    assert not (tmp_path / "ds" / "manifest.json").exists()
    manifest = writer.finish(encoding="raw", classes=["a", "b"], shape=[3, 4, 5], transform={},
                             source={"kind": "test"}, tool_version="test")
    suffix = container(storage).suffix
    assert [(s.file, s.records) for s in manifest.shards] == [
        (f"shard-00000{suffix}", 3), (f"shard-00001{suffix}", 3), (f"shard-00002{suffix}", 1)]
    assert load_manifest(tmp_path / "ds") == manifest
    ds = PackedDataset(tmp_path / "ds")
    for k, image in enumerate(images):
        pixels, label = ds[k]
        assert label == k % 2 and torch.equal(pixels, torch.from_numpy(image))


def test_dataset_writer_refuses_a_shard_size_below_one_byte(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shard_size must be positive, got 0"):
        DatasetWriter(tmp_path, "lmdb", shard_size=0)
