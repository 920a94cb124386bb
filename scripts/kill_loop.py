"""SIGKILL one worker of a real ``packer pack --workers 2`` again and again, under load, and count
what happened: the clear error (good), a hang, another failure, or a pack that finished first.

    PYTHONPATH=$PWD python scripts/kill_loop.py              # 200 runs, 2 busy-loop processes of load
    PYTHONPATH=$PWD python scripts/kill_loop.py --runs 20 --load 0

Each run kills at a seeded random one of ``tests/pack_helpers.KILL_EVENTS`` (a shard being written, a
part record just saved, any moment once the workers exist) plus 0-20 ms. A pack that still succeeds
("killed after its work": the worker had sent its last part record) or ended before the kill
("finished first") is fine too. A pack that has not ended
``--hang-seconds`` after the kill counts as a hang (and is killed). After a good failure the same
command is rerun, and must finish with the same files as a clean pack (else it counts as "bad
resume"). Prints one line per problem and the totals; exits 1 if any run hung or failed otherwise.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from pack_helpers import KILL_EVENTS, children_of, kill_a_worker, smooth_rgb  # noqa: E402

CLEAR_ERROR = "a packing worker process died (exit code -9)"
GOOD = ("clear error", "finished first", "killed after its work")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--load", type=int, default=2, help="busy-loop processes running meanwhile")
    parser.add_argument("--hang-seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.load)]
    for burner in burners:
        burner.start()
    outcomes: Counter[str] = Counter()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kill-loop-") as work:
        root = Path(work)
        src = _images(root / "src")
        clean = root / "clean"
        subprocess.run(_command(src, clean, workers=0), check=True, capture_output=True)
        for run in range(args.runs):
            dst = root / "out"
            event, delay = rng.choice(KILL_EVENTS), rng.uniform(0, 0.02)
            outcome = _one_run(src, dst, clean, event, delay, args.hang_seconds)
            outcomes[outcome] += 1
            if outcome not in GOOD:
                print(f"run {run}: {outcome} (kill at {event} + {delay * 1000:.0f} ms)", flush=True)
            shutil.rmtree(dst, ignore_errors=True)
    for burner in burners:
        burner.kill()
    print(f"{args.runs} runs in {time.monotonic() - started:.0f} s, load {args.load}: "
          + ", ".join(f"{name} {count}" for name, count in sorted(outcomes.items())))
    return 0 if set(outcomes) <= set(GOOD) else 1


def _one_run(src: Path, dst: Path, clean: Path, event: str, delay: float, hang_seconds: float) -> str:
    pack = subprocess.Popen(_command(src, dst), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        victim = kill_a_worker(pack, dst, event, delay, time.monotonic() + hang_seconds)
        try:
            _, stderr = pack.communicate(timeout=hang_seconds)
        except subprocess.TimeoutExpired:
            for worker in children_of(pack.pid):  # else they would outlive the pack, hung
                os.kill(worker, signal.SIGKILL)
            return "hang"
    finally:
        pack.kill()
        pack.wait()
    if victim is None:
        return "finished first"
    if pack.returncode == 0:  # the killed worker had sent its last part record already
        return "killed after its work"
    if CLEAR_ERROR not in stderr or "Traceback" in stderr:
        return f"unclear failure (exit {pack.returncode}): {stderr.strip()[-300:]!r}"
    try:
        rerun = subprocess.run(_command(src, dst), capture_output=True, text=True, timeout=hang_seconds)
    except subprocess.TimeoutExpired:
        return "rerun hang"
    if rerun.returncode != 0 or _tree(dst) != _tree(clean):
        return f"bad resume (exit {rerun.returncode}): {rerun.stderr.strip()[-300:]!r}"
    return "clear error"


def _command(src: Path, dst: Path, workers: int = 2) -> list[str]:
    return [sys.executable, "-m", "packer", "pack", str(src), str(dst), "--resize", "96", "--crop", "96",
            "--partitions", "6", "--shard-size", "200KB", "--workers", str(workers), "--quiet"]


def _images(root: Path) -> Path:
    """48 JPEGs of 480 x 360 in 3 classes: a pack of about a second on two workers."""
    for number in range(48):
        folder = root / "abc"[number % 3]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(smooth_rgb(480, 360, number)).save(folder / f"{number:03d}.jpg", quality=95)
    return root


def _tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _burn() -> None:
    value = np.float64(1.0)
    while True:
        value = value * 1.0000001 % 7.0


if __name__ == "__main__":
    sys.exit(main())
