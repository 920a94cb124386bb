"""Shard files hold little besides their payloads (format version 3: LMDB chunks; version 5: compressed
record tables and source paths), and still read back and ``verify --deep`` record by record."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import packer
from reader import PackedDataset
from reader.format import DatasetWriter


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
@pytest.mark.parametrize("sides", [(20, 26), (32, 32), (45, 68)])
def test_shard_files_are_at_most_3_percent_over_their_payloads(
    tmp_path: Path, storage: str, sides: tuple[int, int]
) -> None:
    # 1.2-2.0 KB records (the size of 48-64 px JPEGs, where a plain table row and source path were 3-5%),
    # 32x32 raw records (3,072 B: LMDB's worst case with a value per record) or 6-14 KB ones, the size
    # of 224 px JPEGs; several 1 MiB chunks per shard, and a source path per record
    rng = np.random.default_rng(0)
    count = 800 if sides == (45, 68) else 3000
    heights = rng.integers(sides[0], sides[1] + 1, count)
    payloads = [rng.integers(0, 256, 3 * h * h, dtype=np.uint8).tobytes() for h in heights.tolist()]
    writer = DatasetWriter(tmp_path / "out", storage, 512 << 20)
    for i, (payload, h) in enumerate(zip(payloads, heights.tolist())):
        writer.add(payload, i % 2, h, h, source=f"class_{i % 10:02d}/img_{i:06d}.jpg")
    manifest = writer.finish(encoding="raw", classes=["a", "b"], shape=None, transform={}, tool_version="t",
                             source={"kind": "imagefolder", "root": "x", "files": count, "packed": count,
                                     "skipped": []})
    assert manifest.total_bytes <= 1.03 * sum(map(len, payloads))
    ds = PackedDataset(tmp_path / "out")
    for i in (0, 1, 340, 341, count // 2, count - 1):  # records inside chunks, at their edges, the last
        assert ds[i][0].numpy().tobytes() == payloads[i]
    report = packer.verify(tmp_path / "out", deep=True, progress=False)
    assert report.ok, report.problems
