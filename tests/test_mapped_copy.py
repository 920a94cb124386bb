"""Warm records copied from a mapping of the shard: same bytes as ``preadv``, no ``preadv`` at all,
and a shard that shrinks after it was mapped gets the changed-file error, not SIGBUS."""
from __future__ import annotations

import os

import numpy as np
import pytest
from reader_helpers import make_images, pack_images

import reader.shard_io
from reader import PackedDataset
from reader.format import FormatError
from reader.mapped_copy import PAGE, MappedFile


@pytest.fixture
def packed(tmp_path):
    images = make_images(12, [(40, 24)])
    return pack_images(tmp_path / "packed", images, [i % 3 for i in range(12)], storage="hdf5",
                       encoding="raw", records_per_shard=20)


def test_resident_pages_and_bounds(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(bytes(range(256)) * (3 * PAGE // 256))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, 3 * PAGE)
        mapped = MappedFile(fd)
        assert mapped.resident(10, 3 * PAGE)
        assert not mapped.resident(10, 3 * PAGE + 1)
        assert not mapped.resident(5, 5)
        out = bytearray(300)
        assert mapped.copy(PAGE - 100, [memoryview(out)[:100], memoryview(out)[100:]]) == 300
        assert bytes(out) == path.read_bytes()[PAGE - 100:PAGE + 200]
    finally:
        os.close(fd)


def test_warm_batch_is_copied_without_preadv(packed, monkeypatch):
    ds = PackedDataset(packed.path)
    (packed.path / "part-00000-shard-00000.h5").read_bytes()
    calls = []
    real_preadv = os.preadv
    monkeypatch.setattr(reader.shard_io.os, "preadv", lambda *a: calls.append(a) or real_preadv(*a))
    order = [11, 0, 5, 5, 3]
    batch, labels = ds.read_batch(order)
    assert calls == []
    assert labels.tolist() == [packed.labels[i] for i in order]
    for row, i in zip(batch, order):
        np.testing.assert_array_equal(row.numpy(), packed.images[i].transpose(2, 0, 1))


def test_shard_truncated_after_mapping_reports_the_record(packed):
    ds = PackedDataset(packed.path)
    ds.read_batch([0, 11])
    os.truncate(packed.path / "part-00000-shard-00000.h5", int(ds._offsets[9]) + 10)
    with pytest.raises(FormatError, match=r"part-00000-shard-00000\.h5: shard file was replaced or changed"):
        ds.read_batch([0, 9])
