"""Kill ``packer pack --append`` at every file-system event it makes in the dataset, rerun it, and check
that the dataset holds the old records plus the new ones exactly once.

    python scripts/append_kills.py                    # every single kill point, then seeded double kills
    python scripts/append_kills.py --doubles 40 --out out/append_kills

For each case: a fresh copy of a packed dataset (6 records), the append of 6 images SIGKILLed just
before its N-th event in the dataset (``tests/append_kills.py``: the manifest swap, each shard moved in,
the staging directory removed, every temporary...), optionally killed again at another point while
rerunning, then rerun to the end. The case passes when the records (source path and class name, in
order) equal an uninterrupted append's, ``packer verify --deep`` says ok, and nothing else is left in
the directory (no staging folder, no unlisted shard, no lock file). N past the last event means the
append finished before the kill: its rerun must add nothing. Prints one line per failure and the totals.
"""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from append_kills import (  # noqa: E402
    dataset_records,
    folder,
    fresh_copy,
    killed_append,
    leftovers,
    rerun,
)

import packer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doubles", type=int, default=20, help="seeded cases killed twice before the rerun")
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--out", type=Path, help="working folder (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        run(root, args.doubles, random.Random(args.seed))


def run(root: Path, doubles: int, rng: random.Random) -> None:
    old = folder(root / "a", {"cat": 3, "dog": 3}, seed=1)
    new = folder(root / "b", {"dog": 3, "fox": 3}, seed=2)
    pristine = root / "pristine"
    if not pristine.exists():
        packer.pack(old, pristine, workers=0, progress=False, shard_size=1000)
    reference = fresh_copy(pristine, root / "reference")
    returncode, events = killed_append(new, reference, 0)
    assert returncode == 0, returncode
    expected = dataset_records(reference)
    cases = [[n] for n in range(1, events + 2)]  # events + 1: killed after it finished
    cases += [[rng.randrange(1, events + 2), rng.randrange(1, events + 2)] for _ in range(doubles)]
    failures = 0
    killed = 0
    for points in cases:
        dst = fresh_copy(pristine, root / "ds")
        for point in points:
            returncode, _ = killed_append(new, dst, point)
            killed += returncode == -9
        done = rerun(new, dst)
        problem = None
        if done.returncode != 0:
            problem = f"rerun failed: {done.stderr.strip()[-300:]}"
        elif dataset_records(dst) != expected:
            problem = f"{len(dataset_records(dst))} records, expected {len(expected)} as an uninterrupted append"
        elif leftovers(dst):
            problem = f"left behind: {leftovers(dst)}"
        else:
            check = subprocess.run([sys.executable, "-m", "packer", "verify", "--deep", "--quiet", str(dst)],
                                   capture_output=True, text=True, timeout=120)
            if check.returncode != 0:
                problem = f"verify: {check.stderr.strip()}"
        if problem:
            failures += 1
            print(f"FAIL kill before event(s) {points}: {problem}")
    print(f"{len(cases)} cases ({events} events in an append; {events + 1} single kill points, {doubles} "
          f"double), {killed} SIGKILLs landed, {failures} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
