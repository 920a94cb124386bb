"""An interrupted pack leaves no manifest, and a rerun redoes only the partitions that did not finish."""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from pack_helpers import kill_a_worker

import packer
import packer.run.worker_pool
from packer.run.destination import PLAN_NAME
from reader.format import MANIFEST_NAME

# 12 images (6 per class), 4 partitions of 3 records, each partition two shards (2 + 1 records)
OPTIONS = {"resize": 16, "crop": 16, "shard_size": 2 * 3 * 16 * 16, "partitions": 4, "workers": 0,
           "progress": False}


@pytest.fixture
def src(tmp_path: Path, make_image_folder: Callable[..., Path]) -> Path:
    return make_image_folder(tmp_path / "src", per_class=6)


def count_encoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record which images the (in-process) pack encodes."""
    encoded: list[str] = []
    original = packer.run.worker_pool.encode_image

    def encode_image(path, spec):  # type: ignore[no-untyped-def]
        encoded.append(Path(path).name)
        return original(path, spec)

    monkeypatch.setattr(packer.run.worker_pool, "encode_image", encode_image)
    return encoded


def tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def fail_in_partition_2(src: Path, dst: Path) -> bytes:
    """Pack with the first image of partition 2 (dog/000.png) broken: partitions 0 and 1 finish, the
    pack stops there. Returns the image's good bytes."""
    bad = src / "dog" / "000.png"
    good = bad.read_bytes()
    bad.write_text("not a png")
    with pytest.raises(packer.PackError, match=r"dog/000\.png: not an image"):
        packer.pack(src, dst, **OPTIONS)
    bad.write_bytes(good)
    return good


def test_a_failed_pack_keeps_its_finished_partitions_and_the_rerun_redoes_only_the_others(
    tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "out"
    fail_in_partition_2(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == [".pack-plan.json", ".part-00000.json", ".part-00001.json"] + [
        f"part-0000{p}-shard-0000{s}.lmdb" for p in (0, 1) for s in (0, 1)
    ]
    with pytest.raises(Exception, match="no manifest.json"):
        packer.info(dst)

    encoded = count_encoded(monkeypatch)
    packer.pack(src, dst, **OPTIONS)
    assert encoded == [f"{i:03d}.png" for i in range(6)]  # the dog class: partitions 2 and 3
    clean = tmp_path / "clean"
    packer.pack(src, clean, **OPTIONS)
    assert tree(dst) == tree(clean)
    assert PLAN_NAME not in tree(dst)


def test_a_finished_partition_whose_shard_changed_is_redone(
    tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "out"
    fail_in_partition_2(src, dst)
    shard = dst / "part-00001-shard-00000.lmdb"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))

    encoded = count_encoded(monkeypatch)
    packer.pack(src, dst, **OPTIONS)
    assert len(encoded) == 9  # partition 0 kept; 1 failed its checksum and was redone with 2 and 3
    clean = tmp_path / "clean"
    packer.pack(src, clean, **OPTIONS)
    assert tree(dst) == tree(clean)


def test_changed_options_start_over(tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "out"
    fail_in_partition_2(src, dst)
    encoded = count_encoded(monkeypatch)
    changed = {**OPTIONS, "storage": "hdf5"}
    packer.pack(src, dst, **changed)
    assert len(encoded) == 12
    assert sorted(p.name for p in dst.iterdir()) == [MANIFEST_NAME] + [
        f"part-0000{p}-shard-0000{s}.h5" for p in range(4) for s in (0, 1)
    ]
    clean = tmp_path / "clean"
    packer.pack(src, clean, **changed)
    assert tree(dst) == tree(clean)


def test_kill_9_of_the_whole_process_group_at_random_points_then_a_rerun_gives_identical_output(
    tmp_path: Path, make_image_folder: Callable[..., Path]
) -> None:
    """The real CLI with two worker processes, killed (SIGKILL to its process group, workers included)
    at seeded random points of its run, again and again; the final rerun must equal a clean pack.

    A point is "once k more partitions are finished and a shard is being written, plus 0-30 ms", so
    the kills land inside the work however fast or loaded the machine is."""
    src = make_image_folder(tmp_path / "src", classes=("a", "b", "c"), per_class=16, size=(240, 180))

    def command(dst: Path) -> list[str]:
        return [sys.executable, "-m", "packer", "pack", str(src), str(dst), "--resize", "48", "--crop", "48",
                "--partitions", "8", "--shard-size", "15KB", "--workers", "2", "--quiet"]

    def finished_parts(names: list[str]) -> int:
        return sum(name.startswith(".part-") and name.endswith(".json") for name in names)

    clean = tmp_path / "clean"
    subprocess.run(command(clean), check=True, capture_output=True)
    dst = tmp_path / "out"
    rng = random.Random(10)
    interrupted = 0
    for _ in range(5):
        target = finished_parts(os.listdir(dst) if dst.is_dir() else []) + rng.randrange(3)
        process = subprocess.Popen(command(dst), start_new_session=True, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        while process.poll() is None:
            names = os.listdir(dst) if dst.is_dir() else []
            if finished_parts(names) >= target and any(name.endswith(".tmp") for name in names):
                time.sleep(rng.uniform(0, 0.03))
                break
            time.sleep(0.001)
        with contextlib.suppress(ProcessLookupError):  # unless it finished first
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if (dst / MANIFEST_NAME).exists():
            break
        interrupted += 1
    assert interrupted >= 1, "no kill landed before the pack finished"
    if not (dst / MANIFEST_NAME).exists():
        subprocess.run(command(dst), check=True, capture_output=True)
    # A kill in the few milliseconds between writing the manifest and removing the hidden plan and part
    # records and the writer lock's file leaves those behind: the dataset is complete and identical, the
    # records are unused, and the lock died with its holder (flock), so the next writer takes it.
    left_behind = (".pack-plan.json", ".part-", ".packer-lock")
    dataset = {name: data for name, data in tree(dst).items() if not name.startswith(left_behind)}
    assert dataset == tree(clean)


PACK_TIMEOUT_S = 120  # a pack here takes about a second; a hung one fails the test


@pytest.mark.parametrize("event", ["shard", "part"])
def test_a_worker_process_killed_mid_shard_fails_the_pack_clearly_and_a_rerun_finishes(
    tmp_path: Path, make_image_folder: Callable[..., Path], event: str
) -> None:
    """The real CLI with two workers; one is SIGKILLed while it writes a shard, or just after it saved a
    partition's part record (sending it back). The pack must fail with the clear error, never hang
    (a lock held by the dead worker once did), and the rerun must equal a clean pack."""
    src = make_image_folder(tmp_path / "src", classes=("a", "b", "c"), per_class=16, size=(480, 360), ext="jpg")

    def command(dst: Path, workers: int = 2) -> list[str]:
        return [sys.executable, "-m", "packer", "pack", str(src), str(dst), "--resize", "96", "--crop", "96",
                "--partitions", "6", "--shard-size", "1MB", "--workers", str(workers), "--quiet"]

    dst = tmp_path / "out"
    for _ in range(3):  # a kill lands unless the whole pack finished first
        pack = subprocess.Popen(command(dst), stderr=subprocess.PIPE, text=True)
        try:
            victim = kill_a_worker(pack, dst, event, 0.0, time.monotonic() + PACK_TIMEOUT_S)
            _, stderr = pack.communicate(timeout=PACK_TIMEOUT_S)
        finally:
            pack.kill()
        if victim is not None:
            break
        shutil.rmtree(dst)
    assert victim is not None, "the pack finished before a worker could be killed, three times"
    assert pack.returncode == 1
    assert "a packing worker process died (exit code -9)" in stderr and "Traceback" not in stderr
    assert not (dst / MANIFEST_NAME).exists()
    subprocess.run(command(dst), check=True, capture_output=True, timeout=PACK_TIMEOUT_S)
    clean = tmp_path / "clean"
    subprocess.run(command(clean, workers=0), check=True, capture_output=True, timeout=PACK_TIMEOUT_S)
    assert tree(dst) == tree(clean)
