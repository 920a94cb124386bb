"""``packer bench`` on a tiny dataset: every setting and epoch reported, the baseline read the same
images, the chart written, and the API's figures consistent with what was read."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from click.testing import CliRunner

from packer.cli import main
from packer.image.transforms import TransformSpec
from packer.tools import bench
from reader import PackedDataset


def test_bench_json_baseline_and_plot(tmp_path: Path, make_packed_dataset: Callable[..., Path]) -> None:
    dst = make_packed_dataset(tmp_path, per_class=4, resize=24, crop=20)
    chart = tmp_path / "bench.png"
    result = CliRunner().invoke(main, [
        "bench", str(dst), "--baseline", str(tmp_path / "images"), "--orders", "sequential,quasi_random",
        "--workers", "0", "--epochs", "2", "--batch-size", "3", "--plot", str(chart), "--json",
    ])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    settings = [(r["reader"], r["order"], r["epoch"]) for r in rows]
    assert settings == [
        ("packed: lmdb raw", "sequential", 1), ("packed: lmdb raw", "sequential", 2),
        ("packed: lmdb raw", "quasi_random", 1), ("packed: lmdb raw", "quasi_random", 2),
        ("folder (PIL per item)", "random", 1), ("folder (PIL per item)", "random", 2),
    ]
    assert all(r["images"] == 8 and r["images_per_s"] > 0 for r in rows)
    assert chart.read_bytes().startswith(b"\x89PNG")


def test_baseline_applies_the_packed_transform(tmp_path: Path, make_packed_dataset: Callable[..., Path]) -> None:
    dst = make_packed_dataset(tmp_path, per_class=2, resize=24, crop=(16, 20))
    packed = PackedDataset(dst)
    folder = bench.FolderDataset(tmp_path / "images", TransformSpec.from_description(packed.manifest.transform))
    assert len(folder) == len(packed)
    for i in range(len(packed)):
        image, label = folder[i]
        expected, expected_label = packed[i]
        assert label == expected_label and image.equal(expected)


def test_model_ms_reports_data_wait(tmp_path: Path, make_packed_dataset: Callable[..., Path]) -> None:
    dst = make_packed_dataset(tmp_path, per_class=4, resize=24, crop=20)
    settings = bench.Settings(batch_size=2, epochs=1, model_ms=1.0)
    rows = bench.bench_packed(dst, settings, orders=["random"], workers=[0])
    assert len(rows) == 1 and rows[0].wait_share is not None and 0.0 <= rows[0].wait_share <= 1.0
    assert "data wait" in bench.format_table(rows)
