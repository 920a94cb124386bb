"""Scanning sources: ImageFolder order and labels as torchvision, CSV labels and CSV errors."""
from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from packer.errors import PackError
from packer.source.scan import scan_source


def touch_image(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4)).save(path, format="PNG")


def test_image_folder_matches_torchvision_order_and_labels(tmp_path: Path) -> None:
    for rel in ["b/2.png", "b/10.JPG", "a/z.webp", "a/sub/x.jpeg", "a/sub/deeper/y.tif", "c/q.bmp"]:
        touch_image(tmp_path / rel)
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    (tmp_path / "empty").mkdir()
    touch_image(tmp_path / "top-level.png")  # outside any class folder: ignored, like torchvision
    plan = scan_source(tmp_path, None, "fail")
    assert plan.kind == "imagefolder"
    assert plan.classes == ["a", "b", "c", "empty"]
    # torchvision: sorted(os.walk(class_dir)) then sorted file names in each folder
    assert plan.paths == ["a/z.webp", "a/sub/x.jpeg", "a/sub/deeper/y.tif", "b/10.JPG", "b/2.png", "c/q.bmp"]
    assert plan.labels.tolist() == [0, 0, 0, 1, 1, 2]
    assert plan.files == 6


def test_image_folder_without_class_folders_is_an_error(tmp_path: Path) -> None:
    touch_image(tmp_path / "x.png")
    with pytest.raises(PackError, match="no class sub-folders"):
        scan_source(tmp_path, None, "fail")


def test_missing_source_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PackError, match="not a directory"):
        scan_source(tmp_path / "nope", None, "fail")


def test_csv_with_header_and_class_names(tmp_path: Path) -> None:
    for rel in ["x/1.png", "2.png", "3.png"]:
        touch_image(tmp_path / rel)
    labels = tmp_path / "labels.csv"
    labels.write_text("path,label\nx/1.png,zebra\n2.png,ant\n\n3.png,zebra\n")
    plan = scan_source(tmp_path, labels, "fail")
    assert plan.kind == "csv"
    assert plan.classes == ["ant", "zebra"]
    assert plan.paths == ["x/1.png", "2.png", "3.png"]
    assert plan.labels.tolist() == [1, 0, 1]


def test_csv_integer_labels_keep_their_values(tmp_path: Path) -> None:
    for name in ["a.png", "b.png", "c.png"]:
        touch_image(tmp_path / name)
    labels = tmp_path / "labels.csv"
    labels.write_text("a.png,2\nb.png,0\nc.png,10\n")
    plan = scan_source(tmp_path, labels, "fail")
    assert plan.labels.tolist() == [2, 0, 10]
    assert plan.classes == [str(i) for i in range(11)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("a.png\n", r"line 1: expected 2 columns"),
        ("a.png,cat\nb.png,dog,extra\n", r"line 2: expected 2 columns"),
        ("a.png,cat\na.png,\n", r"line 2: empty label"),
        ("path,label\na.png,cat\nmissing.png,dog\n", r"line 3: no such file 'missing.png'"),
        ("/etc/passwd,cat\n", r"line 1: path '/etc/passwd' is absolute"),
    ],
)
def test_csv_errors_name_the_line(tmp_path: Path, content: str, message: str) -> None:
    touch_image(tmp_path / "a.png")
    labels = tmp_path / "labels.csv"
    labels.write_text(content)
    with pytest.raises(PackError, match=message) as error:
        scan_source(tmp_path, labels, "fail")
    assert str(labels) in str(error.value)


def test_csv_missing_files_are_skipped_in_skip_mode(tmp_path: Path) -> None:
    touch_image(tmp_path / "a.png")
    labels = tmp_path / "labels.csv"
    labels.write_text("a.png,cat\ngone.png,dog\n")
    plan = scan_source(tmp_path, labels, "skip")
    assert plan.paths == ["a.png"]
    assert plan.files == 2
    assert [s.path for s in plan.skipped] == ["gone.png"]
    assert "line 2" in plan.skipped[0].reason
    assert plan.classes == ["cat", "dog"]
