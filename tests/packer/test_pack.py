"""``packer.pack`` end to end on real image files: pixels, labels, shards, determinism, manifest, DST rules."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from pack_helpers import raw_pixels, read_packed_records, reference_pixels
from PIL import Image

import packer
from packer.errors import PackError
from packer.image.transforms import TransformSpec
from packer.run.partitions import default_partition_count, expected_record_bytes
from reader.format import MANIFEST_NAME, load_manifest


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
def test_raw_pixels_and_labels_equal_plain_pil(
    tmp_path: Path, make_image_folder: Callable[..., Path], storage: str
) -> None:
    src = make_image_folder(tmp_path / "src", classes=("b_class", "a_class"), per_class=3)
    manifest = packer.pack(src, tmp_path / "out", storage=storage, resize=24, crop=20, workers=0, progress=False,
                           resampler="pil")
    records = read_packed_records(tmp_path / "out")
    files = sorted(src.glob("*/*.png"))  # a_class first: classes are sorted
    assert [r[1] for r in records] == [0, 0, 0, 1, 1, 1]
    for record, path in zip(records, files, strict=True):
        np.testing.assert_array_equal(raw_pixels(record), reference_pixels(path, 24, 20))
    assert manifest.classes == ["a_class", "b_class"]
    assert manifest.storage == storage and manifest.encoding == "raw" and manifest.shape == [3, 20, 20]
    assert manifest.num_records == 6
    assert load_manifest(tmp_path / "out") == manifest


def test_without_crop_records_keep_their_own_sizes(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", classes=("x",), per_class=3, size=(30, 20))
    manifest = packer.pack(src, tmp_path / "out", workers=0, progress=False)
    assert manifest.shape is None
    records = read_packed_records(tmp_path / "out")
    assert [(r[2], r[3]) for r in records] == [(20, 30), (22, 33), (24, 36)]
    for record, path in zip(records, sorted(src.glob("x/*.png"))):
        np.testing.assert_array_equal(raw_pixels(record), np.asarray(Image.open(path).convert("RGB")))


def test_exact_resize_fixes_the_shape(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=2)
    manifest = packer.pack(src, tmp_path / "out", resize=(12, 16), workers=0, progress=False)  # (H, W)
    assert manifest.shape == [3, 12, 16]
    assert manifest.transform["resize"] == {"size": [16, 12]}  # the manifest writes sizes width first


def test_jpeg_encoding(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=2)
    manifest = packer.pack(
        src, tmp_path / "out", resize=24, crop=20, encoding="jpeg", quality=95, workers=0, progress=False
    )
    assert manifest.encoding == "jpeg" and manifest.jpeg_quality == 95
    for record, path in zip(read_packed_records(tmp_path / "out"), sorted(src.glob("*/*.png"))):
        decoded = Image.open(io.BytesIO(record[0]))
        assert decoded.format == "JPEG" and decoded.size == (20, 20)
        diff = np.asarray(decoded).astype(int) - reference_pixels(path, 24, 20).astype(int)
        assert np.abs(diff).mean() < 3


def test_small_shard_size_splits_records_in_order(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=5)
    record_bytes = 3 * 16 * 16
    manifest = packer.pack(
        src, tmp_path / "out", resize=16, crop=16, shard_size=3 * record_bytes + 10, workers=0, progress=False,
        resampler="pil",
    )
    assert [s.records for s in manifest.shards] == [3, 3, 3, 1]
    assert [s.file for s in manifest.shards] == [f"part-00000-shard-{i:05d}.lmdb" for i in range(4)]
    records = read_packed_records(tmp_path / "out")
    assert [r[1] for r in records] == [0] * 5 + [1] * 5
    for record, path in zip(records, sorted(src.glob("*/*.png"))):
        np.testing.assert_array_equal(raw_pixels(record), reference_pixels(path, 16, 16))


def test_a_record_larger_than_the_shard_size_gets_a_shard_of_its_own(
    tmp_path: Path, make_image_folder: Callable[..., Path]
) -> None:
    src = make_image_folder(tmp_path / "src", per_class=2)
    manifest = packer.pack(src, tmp_path / "out", shard_size=1, storage="hdf5", workers=0, progress=False)
    assert [s.records for s in manifest.shards] == [1, 1, 1, 1]


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
def test_output_is_byte_identical_for_any_worker_count(
    tmp_path: Path, make_image_folder: Callable[..., Path], storage: str
) -> None:
    """Five partitions of 7-8 records, two shards each (5,000 payload bytes hold 4 records of 1,200),
    packed in this process, by one worker process and by two."""
    src = make_image_folder(tmp_path / "src", classes=("a", "b", "c"), per_class=12, ext="jpg", size=(60, 44))
    outputs = []
    for workers in (0, 1, 2):
        dst = tmp_path / f"out{workers}"
        packer.pack(src, dst, storage=storage, resize=24, crop=20, shard_size=5_000, workers=workers,
                    partitions=5, resampler="pil", progress=False)
        outputs.append({p.name: p.read_bytes() for p in sorted(dst.iterdir())})
    suffix = ".lmdb" if storage == "lmdb" else ".h5"
    shards = [f"part-{p:05d}-shard-{s:05d}{suffix}" for p in range(5) for s in range(2)]
    assert sorted(outputs[0]) == [MANIFEST_NAME] + shards
    assert outputs[0] == outputs[1] == outputs[2]
    records = read_packed_records(tmp_path / "out2")
    files = sorted(src.glob("*/*.jpg"))
    assert [r[1] for r in records] == [0] * 12 + [1] * 12 + [2] * 12
    for record, path in zip(records, files, strict=True):
        np.testing.assert_array_equal(raw_pixels(record), reference_pixels(path, 24, 20, draft=True))


def test_default_partition_count_comes_from_the_source_alone(
    tmp_path: Path, make_image_folder: Callable[..., Path]
) -> None:
    src = make_image_folder(tmp_path / "src", classes=("a", "b"), per_class=40, size=(8, 8))  # 80 images
    one = packer.pack(src, tmp_path / "one", resize=8, workers=0, progress=False)
    packer.pack(src, tmp_path / "two", resize=8, workers=2, progress=False)
    assert [s.file for s in one.shards] == ["part-00000-shard-00000.lmdb"]
    assert [s.records for s in one.shards] == [80]  # 80 records of 192 B: far below one partition's 32 MiB
    assert (tmp_path / "one" / MANIFEST_NAME).read_bytes() == (tmp_path / "two" / MANIFEST_NAME).read_bytes()


def test_default_partitions_are_long_enough_for_disk_reads() -> None:
    jpeg, raw = TransformSpec(resize=256, crop=224, encoding="jpeg"), TransformSpec(resize=256, crop=224)
    assert (expected_record_bytes(jpeg), expected_record_bytes(raw)) == (3 * 224 * 224 // 16, 3 * 224 * 224)
    assert expected_record_bytes(TransformSpec(resize=8)) == 3 * 8 * 8
    assert expected_record_bytes(TransformSpec()) == 3 * 256 * 256
    # 24,000 JPEGs: 7 partitions (the square-root rule alone made 155); raw: 108 of ~33 MB; then the
    # square root takes over for large datasets
    assert default_partition_count(24_000, expected_record_bytes(jpeg)) == 7
    assert default_partition_count(24_000, expected_record_bytes(raw)) == 108
    assert default_partition_count(1_281_000, expected_record_bytes(jpeg)) == 360
    assert default_partition_count(1_281_000, expected_record_bytes(raw)) == 1132
    assert default_partition_count(12, 1) == 1


def test_manifest_records_transform_and_source(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=2)
    manifest = packer.pack(src, tmp_path / "out", resize=24, crop=(16, 20), workers=0, progress=False)
    assert manifest.shape == [3, 16, 20]
    assert manifest.transform["resize"] == {"shorter_side": 24}
    assert manifest.transform["filter"] == "bilinear" and manifest.transform["antialias"] is True
    assert manifest.transform["crop"]["size"] == [20, 16]
    assert manifest.transform["steps"][0] == "open" and manifest.transform["steps"][-1] == "encode"
    assert "white" in manifest.transform["colour"]["alpha"]
    assert manifest.source == {"kind": "imagefolder", "root": str(src.resolve()), "files": 4, "packed": 4,
                               "skipped": []}
    assert manifest.tool_version == packer.__version__
    assert manifest.jpeg_quality is None


def test_csv_source(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=2)
    labels = tmp_path / "labels.csv"
    labels.write_text("path,label\ndog/001.png,7\ncat/000.png,3\n")
    manifest = packer.pack(src, tmp_path / "out", labels=labels, workers=0, progress=False)
    records = read_packed_records(tmp_path / "out")
    assert [r[1] for r in records] == [7, 3]
    assert manifest.classes == [str(i) for i in range(8)]
    assert manifest.source["kind"] == "csv" and manifest.source["files"] == 2
    np.testing.assert_array_equal(raw_pixels(records[0]), np.asarray(Image.open(src / "dog/001.png")))


def test_empty_source_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "readme.txt").write_text("no images here")
    with pytest.raises(PackError, match="no images to pack"):
        packer.pack(tmp_path / "src", tmp_path / "out", workers=0, progress=False)
    assert not (tmp_path / "out").exists()


def test_finished_dataset_is_not_overwritten_without_force(
    tmp_path: Path, make_image_folder: Callable[..., Path]
) -> None:
    src = make_image_folder(tmp_path / "src", per_class=2)
    dst = tmp_path / "out"
    packer.pack(src, dst, storage="hdf5", workers=0, progress=False)
    before = (dst / MANIFEST_NAME).read_bytes()
    with pytest.raises(PackError, match=rf"{dst}: already holds a finished packed dataset.*--force"):
        packer.pack(src, dst, workers=0, progress=False)
    assert (dst / MANIFEST_NAME).read_bytes() == before
    manifest = packer.pack(src, dst, storage="lmdb", force=True, workers=0, progress=False)
    assert manifest.storage == "lmdb"
    assert sorted(p.name for p in dst.iterdir()) == [MANIFEST_NAME, "part-00000-shard-00000.lmdb"]


def test_destination_with_foreign_files_needs_force(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=1)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "thesis.tex").write_text("precious")
    with pytest.raises(PackError, match="files the packer did not write \\(thesis.tex\\)"):
        packer.pack(src, dst, workers=0, progress=False)
    packer.pack(src, dst, force=True, workers=0, progress=False)
    assert (dst / "thesis.tex").read_text() == "precious"
    assert (dst / MANIFEST_NAME).is_file()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"storage": "zip"}, "storage 'zip'"),
        ({"encoding": "png"}, "encoding 'png'"),
        ({"quality": 0}, "quality 0"),
        ({"shard_size": 0}, "shard_size 0"),
        ({"on_error": "ignore"}, "on_error 'ignore'"),
        ({"resize": 0}, "resize 0"),
        ({"crop": (3, -1)}, "crop"),
        ({"workers": -1}, "workers -1"),
    ],
)
def test_bad_options_are_pack_errors(tmp_path: Path, option: dict, message: str) -> None:
    (tmp_path / "src" / "a").mkdir(parents=True)
    with pytest.raises(PackError, match=message):
        packer.pack(tmp_path / "src", tmp_path / "out", progress=False, **option)
