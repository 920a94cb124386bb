"""A dataset shared by a lab (issue 23): symlink loops, NUL and lone surrogates in labels files, a
manifest that is a directory or a device, names that differ only by Unicode normalisation, digits that
are not ASCII, escape sequences in names, signals during append and join. Each is one line from the CLI
(in a subprocess with a timeout), the promised exit code, and no temporary left."""
from __future__ import annotations

import os
import shutil
import subprocess
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from append_kills import TIMEOUT_S, folder, signalled
from hostile_helpers import REPO, assert_one_line_error, edit_manifest, run_cli, subprocess_env
from PIL import Image

import packer
from reader.format import FormatError
from reader.format.records import parse_npy_table

NFC, NFD = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
RAW = ("\x1b", "\u202e", "\x07")  # an escape sequence, a right-to-left override, a bell


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shared")
    dst = root / "ds"
    packer.pack(folder(root / "src", {"cat": 2, "dog": 2}, seed=1), dst, workers=0, progress=False)
    return dst


def copy(packed: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(packed, tmp_path / name))


def test_a_symlink_loop_in_an_image_folder_is_one_line_or_skipped(tmp_path: Path) -> None:
    src = folder(tmp_path / "src", {"cat": 2}, seed=1)
    os.symlink("self", src / "cat" / "self")
    line = assert_one_line_error(run_cli("pack", src, tmp_path / "a", "--workers", "0", "--quiet"), "cat/self")
    assert "Too many levels of symbolic links" in line
    done = run_cli("pack", src, tmp_path / "b", "--workers", "0", "--quiet", "--on-error", "skip")
    assert done.returncode == 0, done.stderr
    assert "skipped 1 files:\n  cat/self: cannot tell what it is (Too many levels of symbolic links" in done.stdout
    assert packer.info(tmp_path / "b").records == 2


def test_labels_files_with_a_nul_or_a_lone_surrogate_are_one_line(tmp_path: Path) -> None:
    src = folder(tmp_path / "src", {"cat": 1}, seed=1)
    nul = tmp_path / "nul.csv"
    nul.write_text('path,label\n"cat/1-0\0.png",cat\n')
    line = assert_one_line_error(run_cli("pack", src, tmp_path / "a", "--labels", nul, "--quiet"), "nul.csv, line 2")
    assert "holds a NUL character" in line
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"path": "cat/1-0.png", "label": "x\\udc80"}\n')
    line = assert_one_line_error(run_cli("pack", src, tmp_path / "b", "--labels", surrogate, "--quiet"),
                                 "surrogate.jsonl, line 1")
    assert "not valid Unicode text (a lone surrogate)" in line and not (tmp_path / "b" / "manifest.json").exists()


@pytest.mark.parametrize("kind", ["directory", "link to /dev/zero"])
def test_a_manifest_that_is_not_a_file_is_one_line_for_every_command(packed: Path, tmp_path: Path, kind: str) -> None:
    dst = copy(packed, tmp_path)
    (dst / "manifest.json").unlink()
    if kind == "directory":
        (dst / "manifest.json").mkdir()
    else:
        os.symlink("/dev/zero", dst / "manifest.json")
    for command in (["info", dst], ["verify", dst, "--quiet"], ["show", dst, "0", "--out", tmp_path / "png"],
                    ["pack", packed.parent / "src", dst, "--append", "--quiet"],
                    ["join", tmp_path / "joined", dst, packed]):
        line = assert_one_line_error(run_cli(*command), "manifest.json")
        assert "not a regular file" in line, command


def test_show_into_a_dangling_symlink_and_merge_of_a_dataset_with_itself_are_refused(
    packed: Path, tmp_path: Path
) -> None:
    os.symlink("nowhere", tmp_path / "dangling")
    line = assert_one_line_error(run_cli("show", packed, "0", "--out", tmp_path / "dangling"), "dangling")
    assert "a symlink to 'nowhere', which does not exist" in line
    line = assert_one_line_error(run_cli("join", tmp_path / "out", packed, packed), str(packed))
    assert "named twice among the datasets to join" in line and not (tmp_path / "out").exists()


def test_an_npy_header_too_long_is_refused_without_advising_allow_pickle() -> None:
    header = b"{'descr': '<i8', 'fortran_order': False, 'shape': (1,), " + b" " * 20_000 + b"}\n"
    blob = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header
    with pytest.raises(FormatError, match=r"t: record table is not valid \.npy data \(its header is longer") as e:
        parse_npy_table(blob, "t", 1)
    assert "allow_pickle" not in str(e.value)


def test_one_class_per_name_in_unicode_nfc(tmp_path: Path) -> None:
    nfc = folder(tmp_path / "nfc", {NFC: 2}, seed=1)
    packer.pack(nfc, tmp_path / "ds", workers=0, progress=False)
    nfd = folder(tmp_path / "nfd", {NFD: 1}, seed=2)
    manifest = packer.append(nfd, tmp_path / "ds", workers=0, progress=False)
    assert manifest.classes == [NFC] and manifest.num_records == 3  # the same class, not one printing the same
    both = folder(tmp_path / "both", {NFC: 1, NFD: 1}, seed=3)
    line = assert_one_line_error(run_cli("pack", both, tmp_path / "x", "--quiet"), "differ only by Unicode")
    assert "rename one" in line
    # a dataset packed before normalisation holds the NFD spelling: an NFC class would be a second one
    legacy = copy(tmp_path / "ds", tmp_path, "legacy")
    edit_manifest(legacy, lambda d: d.update(classes=[NFD], class_to_idx={NFD: 0}))
    line = assert_one_line_error(run_cli("pack", folder(tmp_path / "more", {NFC: 1}, seed=4), legacy, "--append",
                                         "--quiet", "--workers", "0"), "only by Unicode normalisation")
    assert packer.info(legacy).records == 3
    edit_manifest(legacy, lambda d: d.update(classes=[NFD, NFC], class_to_idx={NFD: 0, NFC: 1}))
    with pytest.raises(FormatError, match=r"classes\[1\] 'café' differs from classes\[0\] only by Unicode"):
        packer.info(legacy)


def test_digits_other_than_ascii_are_not_class_indices(tmp_path: Path) -> None:
    src = folder(tmp_path / "src", {"x": 3}, seed=1)
    labels = tmp_path / "labels.csv"
    labels.write_text("path,label\nx/1-0.png,3\nx/1-1.png,\uff13\nx/1-2.png,\u0663\n")
    line = assert_one_line_error(run_cli("pack", src, tmp_path / "a", "--labels", labels, "--quiet"), "labels.csv")
    assert "mixes class names with integer labels" in line
    line = assert_one_line_error(run_cli("pack", src, tmp_path / "b", "--labels", labels, "--label-kind", "index",
                                         "--quiet"), "labels.csv, line 3")
    assert "in ASCII digits" in line
    manifest = packer.pack(src, tmp_path / "c", labels=labels, label_kind="name", workers=0, progress=False)
    assert manifest.classes == sorted(["3", "\uff13", "\u0663"]) and manifest.num_records == 3


def test_nothing_from_a_dataset_reaches_the_terminal_unescaped(tmp_path: Path) -> None:
    evil = "\x1b]0;pwned\x07\x1b[2J\u202egnp.exe\nfake: ok"
    src = tmp_path / "src"
    (src / evil).mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(src / evil / f"{evil}.png")
    (src / evil / f"bad{evil}.png").write_bytes(b"not a png")
    done = run_cli("pack", src, tmp_path / "ds", "--workers", "0", "--on-error", "skip")
    outputs = [done]
    dst = tmp_path / "ds"
    outputs += [run_cli("info", dst, "--classes"), run_cli("show", dst, "0", "--out", tmp_path / "png")]
    outputs.append(run_cli("pack", src, tmp_path / "ds2", "--quiet"))  # fails on the bad file, naming it
    for output in outputs:
        text = output.stdout + output.stderr
        assert not any(c in text for c in RAW), text
        assert "fake: ok" not in text.splitlines() and "\\x1b]0;pwned\\x07" in text, text


@pytest.mark.parametrize("signal_name, status", [("TERM", 143), ("INT", 130)])
def test_a_signal_during_append_or_join_is_one_line_its_exit_code_and_no_temporary(
    packed: Path, tmp_path: Path, signal_name: str, status: int
) -> None:
    dst = copy(packed, tmp_path)
    src = folder(tmp_path / "more", {"fox": 2}, seed=5)
    commands = {dst: ["pack", src, dst, "--append", "--workers", "0", "--quiet"],
                tmp_path / "joined": ["join", tmp_path / "joined", packed, dst]}
    for where, args in commands.items():  # the signal comes just before the manifest is swapped in
        done = subprocess.run(signalled("swap+0", signal_name, where, args), capture_output=True, text=True,
                              timeout=TIMEOUT_S, env=subprocess_env(), cwd=REPO)
        assert done.returncode == status, done.stderr
        lines = [line for line in done.stderr.splitlines() if not line.startswith("events ") and line]
        assert lines == [f"Error: interrupted (SIG{signal_name}); no temporary file was left: rerun the same "
                         "command to resume"], done.stderr
        assert not [p for p in where.rglob("*") if p.name.endswith((".tmp", ".spool", ".packer-lock"))]
        assert packer.info(dst).records == 4  # the append did not take effect
    assert run_cli(*commands[dst]).returncode == 0 and packer.info(dst).records == 6
