"""Bad input files: each fails the pack naming the file and the reason, or is skipped and listed."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from pack_helpers import read_packed_records

import packer
from packer.errors import PackError
from reader.format import MANIFEST_NAME


def truncated_jpeg(path: Path, source: Path) -> None:
    data = source.read_bytes()
    path.write_bytes(data[: len(data) // 2])


BAD_FILES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "truncated.jpg": (truncated_jpeg, "truncated"),
    "text.jpg": (lambda path, _: path.write_text("just some text, not a JPEG"), "not an image"),
    "empty.png": (lambda path, _: path.write_bytes(b""), "not an image"),
    "dangling.png": (lambda path, _: path.symlink_to(path.parent / "nowhere.png"), "unreadable file"),
}


@pytest.fixture
def jpeg_folder(tmp_path: Path, make_image_folder: Callable[..., Path]) -> Path:
    return make_image_folder(tmp_path / "src", classes=("a", "b"), per_class=2, size=(64, 48), ext="jpg")


@pytest.mark.parametrize("name", sorted(BAD_FILES))
@pytest.mark.parametrize(("workers", "resize"), [(0, None), (2, 16)])
def test_bad_file_fails_naming_file_and_reason(
    tmp_path: Path, jpeg_folder: Path, name: str, workers: int, resize: int | None
) -> None:
    make, reason = BAD_FILES[name]
    bad = jpeg_folder / "b" / name
    make(bad, jpeg_folder / "a" / "000.jpg")
    with pytest.raises(PackError) as error:
        packer.pack(jpeg_folder, tmp_path / "out", resize=resize, workers=workers, progress=False)
    message = str(error.value)
    assert message.startswith(f"{bad}: ") and reason in message.removeprefix(f"{bad}: ")
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_decompression_bomb_fails_with_small_max_pixels(tmp_path: Path, jpeg_folder: Path) -> None:
    with pytest.raises(PackError, match="decompression bomb"):
        packer.pack(jpeg_folder, tmp_path / "out", max_pixels=64 * 48 - 1, workers=0, progress=False)
    manifest = packer.pack(jpeg_folder, tmp_path / "out", max_pixels=64 * 48 + 1000, workers=0, progress=False)
    assert manifest.num_records == 4


def test_skip_mode_lists_every_skipped_file_with_its_reason(tmp_path: Path, jpeg_folder: Path) -> None:
    for name, (make, _) in BAD_FILES.items():
        make(jpeg_folder / "b" / name, jpeg_folder / "a" / "000.jpg")
    manifest = packer.pack(jpeg_folder, tmp_path / "out", on_error="skip", resize=16, workers=2, progress=False)
    assert manifest.num_records == 4
    assert manifest.source["files"] == 8 and manifest.source["packed"] == 4
    skipped = {entry["path"]: entry["reason"] for entry in manifest.source["skipped"]}
    assert list(skipped) == ["b/dangling.png", "b/empty.png", "b/text.jpg", "b/truncated.jpg"]  # plan order
    for name, (_, reason) in BAD_FILES.items():
        assert reason in skipped[f"b/{name}"]
    assert [r[1] for r in read_packed_records(tmp_path / "out")] == [0, 0, 1, 1]


def test_all_files_skipped_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.png").write_text("not a png")
    with pytest.raises(PackError, match="every one of the 1 images was skipped"):
        packer.pack(tmp_path / "src", tmp_path / "out", on_error="skip", workers=0, progress=False)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_a_destination_that_is_a_file_is_refused_as_one(tmp_path: Path, jpeg_folder: Path) -> None:
    """A DST that is a file (or lies under one) was refused with "no permission to write in FILE", which
    sent the user after permissions; it is named as what it is, by pack and by join."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for dst in (a_file, a_file / "dst"):
        with pytest.raises(PackError, match=f"^{dst}: cannot write the dataset here: {a_file} is not a directory$"):
            packer.pack(jpeg_folder, dst, workers=0, progress=False)
    done = packer.pack(jpeg_folder, tmp_path / "done", workers=0, progress=False)
    assert done.num_records == 4
    with pytest.raises(PackError, match=f"^{a_file}: cannot write the dataset here: {a_file} is not a directory$"):
        packer.join_datasets(a_file, [tmp_path / "done"] * 2)
    assert a_file.read_text() == "not a folder"
