"""``pack --append`` exactly once and one writer at a time, with real SIGKILL/SIGSTOP at the manifest swap
(``tests/append_kills.py``; ``scripts/append_kills.py`` runs every kill point)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from append_kills import (
    TIMEOUT_S,
    dataset_records,
    folder,
    fresh_copy,
    killed_append,
    killer,
    leftovers,
    rerun,
)
from hostile_helpers import REPO, assert_one_line_error, run_cli, subprocess_env

import packer


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, list[tuple[str, str]]]:
    """The packed dataset to append to, the folder appended, and the records an uninterrupted append gives."""
    root = tmp_path_factory.mktemp("append-kills")
    pristine = root / "pristine"
    packer.pack(folder(root / "a", {"cat": 3, "dog": 3}, seed=1), pristine, workers=0, progress=False,
                shard_size=1000)
    new = folder(root / "b", {"dog": 3, "fox": 3}, seed=2)
    reference = fresh_copy(pristine, root / "reference")
    assert killed_append(new, reference, 0)[0] == 0
    return root, pristine, new, dataset_records(reference)


@pytest.mark.parametrize("points", [["swap+0"], ["swap+1"], [5, "swap+1"], ["swap+99"]],
                         ids=["before-the-swap", "after-the-swap", "staging-then-after-the-swap", "finished"])
def test_an_append_killed_anywhere_and_rerun_adds_its_records_exactly_once(
    sources: tuple[Path, Path, Path, list[tuple[str, str]]], points: list[int | str]
) -> None:
    root, pristine, new, expected = sources
    dst = fresh_copy(pristine, root / f"ds-{'-'.join(map(str, points))}")
    for point in points:
        returncode, _ = killed_append(new, dst, point)
        assert returncode == (0 if point == "swap+99" else -signal.SIGKILL)
    done = rerun(new, dst)
    assert done.returncode == 0, done.stderr
    assert dataset_records(dst) == expected and len(expected) == 12
    assert leftovers(dst) == []
    if points != ["swap+0"]:  # the swap had happened: the rerun only cleaned up
        assert f"nothing added: {new} was appended to {dst} already" in done.stdout
    assert run_cli("verify", "--deep", "--quiet", dst).returncode == 0


def test_a_second_writer_is_refused_naming_the_holder_and_readers_need_no_lock(
    sources: tuple[Path, Path, Path, list[tuple[str, str]]]
) -> None:
    root, pristine, new, expected = sources
    dst = fresh_copy(pristine, root / "ds-locked")
    stalled = subprocess.Popen(killer(new, dst, "swap+0", "STOP"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=subprocess_env(), cwd=REPO)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while _state(stalled.pid) != "T":  # stopped just before swapping the manifest, holding the lock
            assert time.monotonic() < deadline and stalled.poll() is None, "the first append never stalled"
            time.sleep(0.05)
        holder = f"pid {stalled.pid} on {socket.gethostname()}, command: packer pack {new} {dst} --append"
        for second in (["pack", new, dst, "--append", "--workers", "0", "--quiet"],
                       ["pack", new, dst, "--force", "--workers", "0", "--quiet"],
                       ["join", dst, pristine, root / "reference", "--force"]):
            line = assert_one_line_error(run_cli(*second), f"{dst}: another packer is writing this dataset")
            assert holder in line and "wait for it to finish, then rerun" in line
        assert len(dataset_records(dst)) == 6  # a reader opens the old dataset meanwhile, without the lock
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
        stalled.communicate(timeout=TIMEOUT_S)
    assert stalled.returncode == 0
    assert dataset_records(dst) == expected and leftovers(dst) == []


def _state(pid: int) -> str:
    """The process state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


HOLD_EXCLUSIVE = """
import sys, time
from pathlib import Path
from packer.run.locking import exclusive_file_lock
with exclusive_file_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""
TRY_EXCLUSIVE = """
import sys
from pathlib import Path
from packer.errors import PackError
from packer.run.locking import exclusive_file_lock
try:
    with exclusive_file_lock(Path(sys.argv[1])):
        print("taken")
except PackError as e:
    print(e)
"""


def test_without_flock_the_exclusive_lock_file_refuses_a_second_writer_and_names_a_stale_one(tmp_path: Path) -> None:
    """The fallback for file systems without flock, in two real processes: the second is refused naming
    the first; killed, the first leaves the lock file, and the refusal says what to remove."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_EXCLUSIVE, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, env=subprocess_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        second = subprocess.run([sys.executable, "-c", TRY_EXCLUSIVE, str(tmp_path)], capture_output=True,
                                text=True, timeout=TIMEOUT_S, env=subprocess_env())
        assert f"another packer is writing this dataset (pid {holder.pid} on {socket.gethostname()}" in second.stdout
    finally:
        holder.kill()
        holder.wait(timeout=TIMEOUT_S)
    stale = subprocess.run([sys.executable, "-c", TRY_EXCLUSIVE, str(tmp_path)], capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=subprocess_env())
    assert f"if that process is gone (killed), remove {tmp_path / '.packer-lock.excl'}" in stale.stdout
    (tmp_path / ".packer-lock.excl").unlink()
    taken = subprocess.run([sys.executable, "-c", TRY_EXCLUSIVE, str(tmp_path)], capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=subprocess_env())
    assert taken.stdout == "taken\n" and not (tmp_path / ".packer-lock.excl").exists()
