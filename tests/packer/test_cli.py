"""The ``packer`` command line through click's CliRunner: pack, info --json, verify, and its errors."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import click
import pytest
from click.testing import CliRunner

from packer.cli import ByteSize, CommaSeparated, ImageSize, main
from reader.format import load_manifest


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_pack_info_verify(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=3)
    dst = tmp_path / "out"
    code, out, _ = run("pack", src, dst, "--resize", "24", "--crop", "20x16", "--format", "hdf5",
                       "--encoding", "jpeg", "--quality", "85", "--shard-size", "2KB", "--workers", "0", "--quiet")
    assert code == 0, out
    manifest = load_manifest(dst)
    assert out.startswith(f"packed 6 images into {len(manifest.shards)} hdf5 shards")
    assert manifest.shape == [3, 16, 20] and manifest.jpeg_quality == 85 and len(manifest.shards) > 1

    code, out, _ = run("info", dst, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["records"] == 6 and data["classes"] == ["cat", "dog"] and data["storage"] == "hdf5"

    code, out, _ = run("info", dst)
    assert code == 0 and "6 in 2 classes (cat, dog)" in out and "center crop 20x16" in out

    code, out, _ = run("verify", dst, "--deep", "--quiet")
    assert code == 0 and out.startswith(f"ok: {dst}: {len(manifest.shards)} shards, 6 records")

    (dst / manifest.shards[1].file).unlink()  # info still describes the dataset, and says what is missing
    code, out, _ = run("info", dst)
    assert code == 0 and f"; 1 MISSING ({manifest.shards[1].file}); run packer verify" in out
    assert json.loads(run("info", dst, "--json")[1])["missing_shards"] == [manifest.shards[1].file]

    # a shard replaced by a symlink (to a file of the right size) and one truncated: info opens neither,
    # counts neither's target, and says why the reader would refuse each
    first, last = dst / manifest.shards[0].file, dst / manifest.shards[-1].file
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(first.read_bytes())
    first.unlink()
    first.symlink_to(outside)
    with open(last, "r+b") as f:
        f.truncate(manifest.shards[-1].bytes - 1)
    code, out, _ = run("info", dst)
    assert code == 0 and f"; 1 MISSING ({manifest.shards[1].file}); 2 DAMAGED (below); run packer verify" in out
    assert f"  damaged {first}: shard is a symlink, not a regular file" in out
    assert (f"  damaged {last}: shard file is {manifest.shards[-1].bytes - 1} bytes, the manifest says "
            f"{manifest.shards[-1].bytes} (truncated") in out
    data = json.loads(run("info", dst, "--json")[1])
    assert [problem.split(": ")[0] for problem in data["damaged_shards"]] == [str(first), str(last)]
    assert data["bytes_on_disk"] == (dst / "manifest.json").stat().st_size + last.stat().st_size + sum(
        (dst / s.file).stat().st_size for s in manifest.shards[2:-1])


def test_errors_are_one_line_without_traceback(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=1)
    (src / "cat" / "broken.png").write_text("not a png")
    code, _, err = run("pack", src, tmp_path / "out", "--workers", "0", "--quiet")
    assert code == 1
    assert err == f"Error: {src / 'cat' / 'broken.png'}: not an image, or an unsupported image format\n"


def test_a_destination_that_cannot_be_created_is_one_line(
    tmp_path: Path, make_image_folder: Callable[..., Path]
) -> None:
    src = make_image_folder(tmp_path / "src", per_class=1)
    code, _, err = run("pack", src, "/proc/x", "--workers", "0", "--quiet")
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("Error: /proc/x: cannot ")  # create (as root) or write (as a user) the dataset


def test_skip_prints_a_summary(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=1)
    (src / "cat" / "broken.png").write_text("not a png")
    code, out, _ = run("pack", src, tmp_path / "out", "--on-error", "skip", "--workers", "0", "--quiet")
    assert code == 0
    assert "packed 2 images" in out
    assert "skipped 1 files:\n  cat/broken.png: not an image" in out
    code, out, _ = run("info", tmp_path / "out")
    assert "1 skipped" in out and "skipped cat/broken.png" in out


def test_existing_dataset_needs_force(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=1)
    dst = tmp_path / "out"
    assert run("pack", src, dst, "--workers", "0", "--quiet")[0] == 0
    code, _, err = run("pack", src, dst, "--workers", "0", "--quiet")
    assert code == 1 and "already holds a finished packed dataset" in err and "--force" in err
    assert run("pack", src, dst, "--workers", "0", "--quiet", "--force")[0] == 0


def test_verify_fails_naming_the_shard(tmp_path: Path, make_packed_dataset: Callable[..., Path]) -> None:
    dst = make_packed_dataset(tmp_path)
    shard = dst / load_manifest(dst).shards[0].file
    data = bytearray(shard.read_bytes())
    data[-100] ^= 1
    shard.write_bytes(bytes(data))
    code, _, err = run("verify", dst, "--quiet")
    assert code == 1
    assert f"error: {shard.name}: checksum mismatch" in err and "1 problems" in err


def test_info_on_a_non_dataset_is_an_error(tmp_path: Path) -> None:
    code, _, err = run("info", tmp_path)
    assert code == 1 and "no manifest.json" in err


@pytest.mark.parametrize(
    ("text", "size"),
    [("1000", 1000), ("512MB", 512 * 10**6), ("1GiB", 2**30), ("1.5kib", 1536), ("64 KB", 64000)],
)
def test_byte_sizes(text: str, size: int) -> None:
    assert ByteSize().convert(text, None, None) == size


def test_image_sizes_and_bad_values() -> None:
    assert ImageSize().convert("256", None, None) == 256
    assert ImageSize().convert("320x240", None, None) == (240, 320)  # WxH -> (height, width)
    code, _, err = run("pack", ".", "out", "--resize", "0")
    assert code == 2 and "is not a size" in err
    code, _, err = run("pack", ".", "out", "--shard-size", "12 parsecs")
    assert code == 2 and "is not a size" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", ".", "--workers", "two"], "Invalid value for '--workers': 'two' is not a valid integer"),
        (["bench", ".", "--workers", "1,-1"], "Invalid value for '--workers': -1 is not in the range x>=0"),
        (["bench", ".", "--workers", ","], "Invalid value for '--workers': ',' names no integer"),
        (["bench", ".", "--batch-size", "0"], "Invalid value for '--batch-size': 0 is not in the range x>=1"),
        (["bench", ".", "--model-ms", "inf"], "Invalid value for '--model-ms': inf is not a finite number of ms"),
        (["bench", ".", "--model-ms", "nan"], "Invalid value for '--model-ms': nan is not a finite number of ms"),
        (["bench", ".", "--plot", "no-such-dir/x.png"],
         "Invalid value for '--plot': no-such-dir is not a directory, so no-such-dir/x.png cannot be written"),
        (["pack", ".", "out", "--part", "3/2"], "Invalid value for '--part': --part 3/2: need 0 <= I < N"),
        (["pack", ".", "out", "--part", "half"], "Invalid value for '--part': --part 'half': expected I/N"),
        (["pack", ".", "out", "--workers", "many"], "Invalid value for '--workers': 'many' is not a valid integer"),
        (["pack", ".", "out", "--quality", "101"], "Invalid value for '--quality': 101 is not in the range 1<=x<=100"),
        (["pack", ".", "out", "--quality", "50"], "Error: --quality sets the JPEG quality: it needs --encoding jpeg"),
    ],
)
def test_bad_option_values_are_usage_errors(args: list[str], message: str) -> None:
    code, out, err = run(*args)
    assert code == 2 and out == "" and message in err and "Traceback" not in err


def test_bench_takes_comma_separated_orders_and_workers() -> None:
    assert CommaSeparated(click.IntRange(min=0)).convert("1, 2,4", None, None) == [1, 2, 4]
    assert CommaSeparated(click.STRING).convert("sequential,quasi_random", None, None) == ["sequential", "quasi_random"]


def test_show_takes_negative_indices_and_names_one_out_of_range(tmp_path: Path) -> None:
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "v1-lmdb"  # 5 records, format 1: no sources
    code, out, err = run("show", fixture, "-1", "0", "--out", tmp_path / "shown")
    assert code == 0, err
    assert out.splitlines() == [f"4: cat (source not stored) -> {tmp_path / 'shown' / 'record-00000004.png'}",
                                f"0: cat (source not stored) -> {tmp_path / 'shown' / 'record-00000000.png'}"]
    code, out, err = run("show", fixture, "-6", "--out", tmp_path / "none")
    assert code == 1 and err == f"Error: {fixture}: index -6 is out of range for 5 records\n"
    assert not (tmp_path / "none").exists()


def test_an_old_pack_inside_src_is_left_out_with_a_note(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=2)
    assert run("pack", src, tmp_path / "old", "--workers", "0", "--quiet")[0] == 0
    (tmp_path / "old").rename(src / "packed")  # e.g. packed into SRC/packed on an earlier day
    code, out, _ = run("pack", src, tmp_path / "out", "--workers", "0", "--quiet")
    assert code == 0
    assert out.splitlines()[1:] == [
        "skipped 1 files:", "  packed: a packed dataset (it holds manifest.json), not a class folder: left out"]
    manifest = load_manifest(tmp_path / "out")
    assert manifest.classes == ["cat", "dog"] and manifest.num_records == 4
