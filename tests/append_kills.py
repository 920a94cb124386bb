"""SIGKILL an in-process ``packer pack --append`` at its N-th file-system event in the dataset, then rerun.

No hook in the product: the killed run is the real CLI in a subprocess whose Python audit hook counts
the events that change the dataset directory (``os.rename``/``os.replace``, ``os.remove``, ``os.rmdir``,
``os.mkdir``, ``shutil.rmtree`` and every ``open`` for writing, of a path inside it) and sends the
process SIGKILL just before the N-th one happens: the manifest swap, a shard moved in, the staging
directory removed, a temporary written. ``--workers 0`` keeps every write in that one process. Used by
``tests/packer/test_append_kills.py`` (a few points) and ``scripts/append_kills`` (every point, with figures).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from hostile_helpers import REPO, subprocess_env
from PIL import Image

TIMEOUT_S = 120
# Run as `python -c KILLER POINT SIGNAL DST packer-args...`: send SIGNAL (KILL, or STOP to stall it holding
# what it holds) to itself just before the POINT-th event in DST; POINT is N (0: never) or swap+K (the K-th
# event after the rename that swaps DST's manifest; swap+0 is that rename). The last line of stderr is the
# count of events.
KILLER = r"""
import os, runpy, signal, sys
point, signum, dst = sys.argv[1], getattr(signal, "SIG" + sys.argv[2]), os.path.realpath(sys.argv[3])
count, swap = 0, None
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
def inside(path):
    try:
        return isinstance(path, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(path)).startswith(dst)
    except (TypeError, ValueError):
        return False
def hook(event, args):
    global count, swap
    if event in ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree"):
        changes = inside(args[0]) or (event == "os.rename" and inside(args[1]))
    elif event == "open":
        mode, flags = args[1], args[2]
        changes = inside(args[0]) and (flags & WRITES if mode is None else any(c in str(mode) for c in "wax+"))
    else:
        return
    if not changes:
        return
    count += 1
    if event == "os.rename" and os.path.realpath(os.fsdecode(args[1])) == os.path.join(dst, "manifest.json"):
        swap = count
    target = int(point) if point.isdigit() else None if swap is None else swap + int(point.split("+")[1])
    if count == target:
        os.kill(os.getpid(), signum)
sys.addaudithook(hook)
sys.argv = ["packer", *sys.argv[4:]]
try:
    runpy.run_module("packer", run_name="__main__")
finally:
    print(f"\nevents {count}", file=sys.stderr)
"""


def folder(root: Path, classes: dict[str, int], seed: int) -> Path:
    """An ImageFolder tree of small random PNGs."""
    rng = np.random.default_rng(seed)
    for name, count in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for k in range(count):
            Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(root / name / f"{seed}-{k}.png")
    return root


def append_args(src: Path, dst: Path) -> list[str]:
    # two partitions of several shards each: moves, part records and temporaries to be killed at
    return ["pack", str(src), str(dst), "--append", "--workers", "0", "--quiet", "--shard-size", "1KB"]


def killer(src: Path, dst: Path, point: int | str, signal: str = "KILL") -> list[str]:
    """The command line of an append that sends itself ``signal`` before event ``point`` (see KILLER)."""
    return signalled(point, signal, dst, append_args(src, dst))


def signalled(point: int | str, signal: str, dst: Path, args: list[str]) -> list[str]:
    """The command line of ``packer ARGS`` sending itself ``signal`` before event ``point`` in ``dst``."""
    return [sys.executable, "-c", KILLER, str(point), signal, str(dst), *map(str, args)]


def killed_append(src: Path, dst: Path, point: int | str) -> tuple[int, int]:
    """Run the append, killed before its event ``point`` (0: not killed); ``(returncode, events seen)``."""
    done = subprocess.run(killer(src, dst, point), capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=subprocess_env(), cwd=REPO)
    lines = done.stderr.strip().splitlines()
    seen = int(lines[-1].split()[1]) if lines and lines[-1].startswith("events ") else -1
    return done.returncode, seen


def rerun(src: Path, dst: Path) -> subprocess.CompletedProcess:
    """The same append, not killed."""
    return subprocess.run([sys.executable, "-m", "packer", *append_args(src, dst)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=subprocess_env(), cwd=REPO)


def dataset_records(dst: Path) -> list[tuple[str, str]]:
    """(source path, class name) of every record, read in a subprocess by the reader."""
    code = ("import json, sys\nfrom reader import PackedDataset\nds = PackedDataset(sys.argv[1])\n"
            "print(json.dumps([[ds.source(i), ds.classes[int(ds.targets[i])]] for i in range(len(ds))]))")
    done = subprocess.run([sys.executable, "-c", code, str(dst)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=subprocess_env(), check=True)
    return [tuple(pair) for pair in json.loads(done.stdout)]


def leftovers(dst: Path) -> list[str]:
    """Names in ``dst`` that a finished append must not leave: staging folders, unlisted shards, locks."""
    listed = {shard["file"] for shard in json.loads((dst / "manifest.json").read_text())["shards"]}
    return sorted(name for name in os.listdir(dst)
                  if name != "manifest.json" and name not in listed)


def fresh_copy(pristine: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(pristine, dst)
    return dst
