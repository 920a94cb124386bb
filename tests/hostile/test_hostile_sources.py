"""A strange source tree or labels CSV: FIFOs, device links, huge files, non-UTF-8 names, directory
loops, DST inside SRC, CSV rows that leave SRC, huge or mixed labels, duplicates. Each is one clear line
naming the file or row (or, in skip mode, a listed skip), never a hang, a traceback or wrong labels.
Packs that could hang run as CLI subprocesses with a timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hostile_helpers import assert_one_line_error, run_cli, subprocess_env
from pack_helpers import read_packed_records
from PIL import Image

import packer
from packer.errors import PackError
from packer.source.scan import MAX_INDEX_CLASSES, scan_source

CAFE = b"caf\xe9".decode("utf-8", "surrogateescape")  # a Latin-1 name, not UTF-8


def image(path: Path, shade: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 6), (shade, 100, 200)).save(path, format="PNG")
    return path


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """Two classes of two 8x6 PNGs each."""
    for k, name in enumerate(["a/0.png", "a/1.png", "b/0.png", "b/1.png"]):
        image(tmp_path / "src" / name, shade=40 * k)
    return tmp_path / "src"


def pack_cli(src: Path, dst: Path, *options: str) -> subprocess.CompletedProcess:
    return run_cli("pack", src, dst, "--workers", "0", "--quiet", *options, timeout=60)


def skipped_of(dst: Path) -> dict[str, str]:
    manifest = json.loads((dst / "manifest.json").read_text())
    return {entry["path"]: entry["reason"] for entry in manifest["source"]["skipped"]}


@pytest.mark.parametrize("make, kind", [
    (lambda p: os.mkfifo(p), "a FIFO"),
    (lambda p: p.symlink_to("/dev/zero"), "a character device"),
])
def test_non_regular_source_files_fail_or_are_skipped(src: Path, tmp_path: Path, make, kind: str) -> None:
    make(src / "b" / "x.jpg")
    assert_one_line_error(pack_cli(src, tmp_path / "fail"), str(src / "b" / "x.jpg"), kind)
    done = pack_cli(src, tmp_path / "skip", "--on-error", "skip")
    assert done.returncode == 0, done.stderr
    assert skipped_of(tmp_path / "skip") == {"b/x.jpg": f"not a regular file ({kind})"}
    assert len(read_packed_records(tmp_path / "skip")) == 4


def test_a_fifo_swapped_in_after_the_scan_is_refused_when_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "late.png")
    code = ("import sys; from packer.run.worker_pool import encode_image; "
            "from packer.image.transforms import TransformSpec;"
            "print(encode_image(sys.argv[1], TransformSpec()))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "late.png")], capture_output=True,
                          text=True, timeout=60, env=subprocess_env())
    assert done.stdout.strip() == "Failure(reason='not a regular file')", done.stderr


def test_source_file_over_the_size_limit_is_refused(src: Path, tmp_path: Path) -> None:
    big = image(src / "a" / "big.png")
    with open(big, "ab") as f:
        f.write(b"\0" * 5000)
    line = assert_one_line_error(pack_cli(src, tmp_path / "out", "--max-file-size", "4000"), str(big))
    assert f"file is {big.stat().st_size} bytes, over the limit of 4000" in line
    with pytest.raises(PackError, match="a/big.png: file is .* over the limit of 4000 \\(--max-file-size\\)"):
        packer.pack(src, tmp_path / "api", on_error="fail", workers=0, progress=False, max_file_bytes=4000)


@pytest.mark.parametrize("limit", [1000, 100])
def test_a_file_growing_while_it_is_read_is_read_whole_or_refused(tmp_path: Path, monkeypatch, limit: int) -> None:
    """fstat saw 40 bytes; the file has 500 by the time it is read (the race, staged by a smaller
    fstat): within the limit it is read whole, past it the file is refused."""
    import packer.image.transforms as transforms

    path = tmp_path / "growing.bin"
    path.write_bytes(bytes(range(250)) * 2)
    real_fstat = os.fstat

    def stale_fstat(fd: int) -> os.stat_result:
        fields = real_fstat(fd)
        return os.stat_result((*fields[:6], 40, *fields[7:]))  # st_size is field 6

    monkeypatch.setattr(transforms.os, "fstat", stale_fstat)
    if limit > 500:
        assert transforms.read_source_file(path, limit) == path.read_bytes()
    else:
        with pytest.raises(transforms.SourceFileError, match="file grew past the limit of 100 bytes while it was read"):
            transforms.read_source_file(path, limit)


def test_non_utf8_names_are_packed_and_shown_escaped(src: Path, tmp_path: Path) -> None:
    image(src / "a" / f"{CAFE}.png", shade=7)
    image(src / CAFE / "0.png", shade=9)
    (src / "b" / f"{CAFE}-broken.png").write_bytes(b"not a png")
    for mode in ("fail", "skip"):
        done = pack_cli(src, tmp_path / mode, "--on-error", mode)
        assert "Traceback" not in done.stderr and "UnicodeEncodeError" not in done.stderr, done.stderr
    assert_one_line_error(pack_cli(src, tmp_path / "fail2"), "caf\\xe9-broken.png", "not an image")
    manifest = json.loads((tmp_path / "skip" / "manifest.json").read_bytes().decode("utf-8"))
    assert manifest["classes"] == ["a", "b", "caf\\xe9"]
    assert list(skipped_of(tmp_path / "skip")) == ["b/caf\\xe9-broken.png"]
    labels = [label for _, label, _, _ in read_packed_records(tmp_path / "skip")]
    assert labels == [0, 0, 0, 1, 1, 2]
    info = run_cli("info", tmp_path / "skip")
    assert info.returncode == 0 and "skipped b/caf\\xe9-broken.png" in info.stdout


def test_directory_symlink_loop_is_reported_not_packed_again(src: Path, tmp_path: Path) -> None:
    (src / "a" / "loop").symlink_to("..")
    (src / "b" / "again").symlink_to(src / "a")
    assert_one_line_error(pack_cli(src, tmp_path / "fail"), str(src / "a" / "loop"), "already scanned")
    done = pack_cli(src, tmp_path / "skip", "--on-error", "skip")
    assert done.returncode == 0, done.stderr
    assert skipped_of(tmp_path / "skip") == {
        "a/loop": "folder already scanned as 'SRC itself' (a symlink loop or a second link to it); not scanned again",
        "b/again": "folder already scanned as 'a' (a symlink loop or a second link to it); not scanned again",
    }
    assert [label for _, label, _, _ in read_packed_records(tmp_path / "skip")] == [0, 0, 1, 1]


def test_dst_inside_src_is_not_a_class_on_a_rerun(src: Path) -> None:
    for _ in range(2):
        manifest = packer.pack(src, src / "packed", workers=0, progress=False, force=True)
        assert manifest.classes == ["a", "b"] and manifest.num_records == 4
    plan = scan_source(src, None, "fail", exclude=src / "packed")
    assert plan.classes == ["a", "b"]


def write_csv(src: Path, text: str) -> Path:
    path = src / "labels.csv"
    path.write_text(text)
    return path


@pytest.mark.parametrize("rows, message", [
    ("a/0.png,0\n../outside.png,1\n", r"line 2: path '../outside.png' leaves SRC"),
    ("a/0.png,0\na/../../outside.png,1\n", r"line 2: path 'a/../../outside.png' leaves SRC"),
    ("a/0.png,0\na/1.png,99999999999999999999\n",
     r"line 2: label '99999999999999999999' for 'a/1.png' is not an integer from 0 to 999999"),
    (f"a/0.png,0\na/1.png,{MAX_INDEX_CLASSES}\n", r"line 2: label '1000000' .* is not an integer from 0 to 999999"),
    ("a/0.png,0\na/1.png,-1\n", r"line 2: label '-1' for 'a/1.png' is not an integer from 0 to 999999"),
    ("a/0.png,0\na/1.png,1\nb/0.png,cat\n",
     r"line 3: label 'cat' for 'b/0.png' mixes class names with integer labels; pass --label-kind"),
    ("a/0.png,cat\na/1.png,dog\nb/0.png,7\n", r"line 3: label '7' for 'b/0.png' mixes class names"),
    ("a/0.png,0\na/1.png,1\na/./0.png,1\n", r"line 3: 'a/./0.png' is listed again \(first on line 1\)"),
])
def test_bad_csv_rows_are_refused_naming_the_row(src: Path, tmp_path: Path, rows: str, message: str) -> None:
    image(tmp_path / "outside.png")
    labels = write_csv(src, rows)
    with pytest.raises(PackError, match=message) as error:
        scan_source(src, labels, "fail")
    assert str(labels) in str(error.value)
    assert_one_line_error(pack_cli(src, tmp_path / "out", "--labels", labels), str(labels), "line")


def test_duplicate_csv_rows_are_listed_in_skip_mode(src: Path) -> None:
    labels = write_csv(src, "a/0.png,0\na/1.png,1\na/0.png,1\n")
    plan = scan_source(src, labels, "skip")
    assert plan.paths == ["a/0.png", "a/1.png"] and plan.labels.tolist() == [0, 1]
    assert [(s.path, s.reason) for s in plan.skipped] == [
        ("a/0.png", f"{labels}, line 3: 'a/0.png' is listed again (first on line 1)")]


def test_label_kind_is_explicit(src: Path) -> None:
    labels = write_csv(src, "a/0.png,10\na/1.png,2\nb/0.png,cat\n")
    plan = scan_source(src, labels, "fail", label_kind="name")
    assert plan.classes == ["10", "2", "cat"] and plan.labels.tolist() == [0, 1, 2]
    with pytest.raises(PackError, match=r"line 3: label 'cat' for 'b/0.png' is not an integer"):
        scan_source(src, labels, "fail", label_kind="index")
    write_csv(src, "a/0.png,3\na/1.png,1\n")
    plan = scan_source(src, labels, "fail", label_kind="index")
    assert plan.classes == ["0", "1", "2", "3"] and plan.labels.tolist() == [3, 1]
    assert np.array_equal(scan_source(src, labels, "fail").labels, plan.labels)


def test_labels_csv_that_is_a_fifo_is_refused(src: Path, tmp_path: Path) -> None:
    os.mkfifo(src / "labels.csv")
    assert_one_line_error(pack_cli(src, tmp_path / "out", "--labels", src / "labels.csv"),
                          "labels.csv: the labels file is not a regular file")
