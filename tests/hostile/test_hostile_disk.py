"""A full disk and interrupted packs: one line saying the disk is full and which file, no temporary file
left in DST, and a rerun that resumes to the same bytes as an uninterrupted pack. The full disk is a
small tmpfs (needs root and mount rights; skipped with the reason otherwise)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from hostile_helpers import assert_one_line_error, run_cli, subprocess_env
from PIL import Image

import packer

TEMPORARY_SUFFIXES = (".tmp", ".spool")


@pytest.fixture(scope="module")
def noisy_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 incompressible 64x64 PNGs in two classes (12 KB of raw pixels each)."""
    src = tmp_path_factory.mktemp("noisy") / "src"
    rng = np.random.default_rng(0)
    for k in range(40):
        path = src / "ab"[k % 2] / f"{k:02d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    return src


def mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({done.stderr.strip() or 'mount failed'})")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 300 KB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("filling a small tmpfs needs root (mount)")
    where = tmp_path / "small-disk"
    mount_tmpfs(where, "300k")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def temporaries(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.iterdir() if p.name.endswith(TEMPORARY_SUFFIXES))


def shard_bytes(dst: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dst.glob("*shard-*"))}


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
def test_full_disk_says_so_cleans_up_and_resumes(
    noisy_src: Path, small_disk: Path, tmp_path: Path, storage: str
) -> None:
    options = ["--format", storage, "--shard-size", "100kB", "--workers", "2", "--quiet"]
    dst = small_disk / "packed"
    line = assert_one_line_error(run_cli("pack", noisy_src, dst, *options), str(dst))
    assert "the disk is full" in line and "rerun the same command to resume" in line
    assert temporaries(dst) == [] and (dst / ".pack-plan.json").exists()
    kept = shard_bytes(dst)
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    done = run_cli("pack", noisy_src, dst, *options)
    assert done.returncode == 0, done.stderr
    reference = tmp_path / "reference"
    assert run_cli("pack", noisy_src, reference, *options).returncode == 0
    assert shard_bytes(dst) == shard_bytes(reference)
    assert all(shard_bytes(reference)[name] == data for name, data in kept.items())
    assert packer.verify(dst, deep=True, progress=False).ok


def wait_for_first_shard(dst: Path, process: subprocess.Popen, timeout: float = 60) -> None:
    """Wait until the pack has published its first shard (so the signal comes in mid-pack)."""
    deadline = time.monotonic() + timeout
    while not any(dst.glob("*shard-*.lmdb")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no shard was finished in time"
        time.sleep(0.01)


@pytest.mark.parametrize("signum, status, whole_group", [
    (signal.SIGTERM, 143, False),  # kill PID
    (signal.SIGINT, 130, True),  # Ctrl-C: the pack and its worker processes
])
def test_interrupted_pack_cleans_up_and_resumes(
    noisy_src: Path, tmp_path: Path, signum: int, status: int, whole_group: bool
) -> None:
    dst = tmp_path / "packed"
    command = [sys.executable, "-m", "packer", "pack", str(noisy_src), str(dst), "--shard-size", "13kB",
               "--workers", "2", "--quiet"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env(), start_new_session=True)
    wait_for_first_shard(dst, process)
    if whole_group:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    if process.returncode == 0:
        pytest.skip("the pack finished before the signal arrived")
    assert process.returncode == status, stderr
    assert "Traceback" not in stderr and stderr.count("Error:") == 1, stderr
    assert f"interrupted ({signal.Signals(signum).name if signum == signal.SIGTERM else 'SIGINT'}" in stderr
    assert temporaries(dst) == []
    assert subprocess.run(command, capture_output=True, env=subprocess_env(), timeout=120).returncode == 0
    reference = tmp_path / "reference"
    assert subprocess.run([*command[:5], str(reference), *command[6:]], env=subprocess_env(),
                          capture_output=True, timeout=120).returncode == 0
    assert shard_bytes(dst) == shard_bytes(reference)


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
def test_failed_background_publish_leaves_no_temporary(tmp_path: Path, storage: str, monkeypatch) -> None:
    """The shard being published on the background thread fails (as on a full disk): its temporary
    (and HDF5 spool) are removed and the error reaches the caller."""
    from reader.format import DatasetWriter, container

    def fail(self, table, arrays):
        raise OSError(28, "No space left on device")

    writer_class = type(container(storage).writer(tmp_path / "probe"))
    (tmp_path / "probe.tmp").unlink(missing_ok=True)
    (tmp_path / "probe.spool").unlink(missing_ok=True)
    monkeypatch.setattr(writer_class, "_write_table", fail)
    shards = DatasetWriter(tmp_path, storage, 10)
    shards.add(b"x" * 8, 0, 1, 1, source="x")
    shards.add(b"y" * 8, 0, 1, 1, source="y")  # closes shard 0: published in the background
    with pytest.raises(OSError, match="No space left on device") as error:
        try:
            shards.finish_shards()
        except BaseException:
            shards.abort()  # as packing does
            raise
    assert error.value.filename.endswith(".tmp")
    assert temporaries(tmp_path) == [] and shards.shards == []


def test_a_destination_that_cannot_be_written_is_refused_before_packing(
    noisy_src: Path, tmp_path: Path, read_only
) -> None:
    """A read-only file system (or, not as root, a read-only folder): one line from the CLI, a PackError
    from pack, pack_items and join, and nothing made there; once writable, the same pack works."""
    packer.pack(noisy_src, tmp_path / "ro" / "done", workers=0, progress=False)
    read_only(True)
    dst = tmp_path / "ro" / "new"
    reason = r"(.*ro is on a read-only file system|no permission to write in .*ro)"
    line = assert_one_line_error(run_cli("pack", noisy_src, dst, "--quiet"), str(dst))
    assert "cannot write the dataset here" in line
    with pytest.raises(packer.PackError, match=rf"ro/new: cannot write the dataset here: {reason}$"):
        packer.pack(noisy_src, dst, workers=0, progress=False)
    with pytest.raises(packer.PackError, match=rf"ro/new: cannot write the dataset here: {reason}$"):
        packer.pack_items([{"image": Image.new("RGB", (8, 8)), "label": 0}], dst, progress=False)
    with pytest.raises(packer.PackError, match=rf"ro/new: cannot write the dataset here: {reason}$"):
        packer.join_datasets(dst, [tmp_path / "ro" / "done"] * 2)
    assert not dst.exists()
    read_only(False)
    assert packer.pack(noisy_src, dst, workers=0, progress=False).num_records == 40


def all_temporaries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith(TEMPORARY_SUFFIXES))


def test_a_full_disk_during_append_is_one_line_and_the_dataset_stays_as_it_was(
    noisy_src: Path, small_disk: Path, tmp_path: Path
) -> None:
    dst = small_disk / "packed"
    subprocess.run(["mount", "-o", "remount,size=1m", str(small_disk)], check=True)
    assert run_cli("pack", noisy_src, dst, "--shard-size", "100kB", "--workers", "0", "--quiet").returncode == 0
    before = packer.verify(dst, deep=True, progress=False)
    more = tmp_path / "more"  # 2 x 40 more incompressible images than the disk has room for
    for copy in range(2):
        for path in noisy_src.rglob("*.png"):
            target = more / path.parent.name / f"{copy}-{path.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    line = assert_one_line_error(run_cli("pack", more, dst, "--append", "--workers", "0", "--quiet"), str(dst))
    assert "the disk is full" in line
    assert all_temporaries(dst) == []
    after = packer.verify(dst, deep=True, progress=False)
    assert after.ok and after.records == before.records


def test_a_full_disk_during_a_join_that_copies_is_one_line_and_leaves_nothing(
    noisy_src: Path, small_disk: Path, tmp_path: Path
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"  # on another file system than the join's output: copied
    for dataset in (a, b):
        assert run_cli("pack", noisy_src, dataset, "--workers", "0", "--quiet").returncode == 0
    out = small_disk / "joined"
    line = assert_one_line_error(run_cli("join", out, a, b), str(out))
    assert "the disk is full" in line
    assert all_temporaries(small_disk) == [] and not (out / "manifest.json").exists()
