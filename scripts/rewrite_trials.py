"""A shard rewritten in place under a reading loop, many times: how each run ended (issue 23 item 5).

    python scripts/rewrite_trials.py [--trials 20] [--workers 0] [--rounds 12] [--loop read|open]
        [--storage lmdb|hdf5] [--reader DIR]

Each trial is one subprocess running one of the suite's loops (``tests/reader/test_mapped_copy.py``).
``--loop read`` (``REWRITTEN``): ``--rounds`` times, open a 160-record raw dataset (``--storage``, LMDB
by default), read it in batches with ``--workers`` loader workers while a thread runs ``cp PRISTINE
SHARD`` over one shard again and again. ``--loop open`` (``REOPENED``): the copies run all the time, and
each round opens the dataset afresh and reads its first batches, so the shard's record table is read
while it may be truncated. Prints how the runs ended: ``ok`` followed by the kinds of ``FormatError``
met, or ``rc -7`` for a process killed by SIGBUS (``rc 1``: a worker killed by it, which the loader
reports as a ``RuntimeError``). ``--reader`` runs another checkout's ``reader`` package (a directory
holding ``reader/``), for before/after figures.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "reader")]

from reader_helpers import make_images, pack_images  # noqa: E402
from test_mapped_copy import REOPENED, REWRITTEN  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--loop", choices=("read", "open"), default="read")
    parser.add_argument("--storage", choices=("lmdb", "hdf5"), default="lmdb")
    parser.add_argument("--reader", type=Path, default=ROOT, help="directory holding the reader package to run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        packed = pack_images(Path(tmp) / "packed", make_images(160, [(64, 64)]), [i % 3 for i in range(160)],
                             storage=args.storage, encoding="raw", records_per_shard=80)
        shard = sorted(packed.path.glob("*-shard-*"))[0]
        pristine = Path(tmp) / "pristine"
        pristine.write_bytes(shard.read_bytes())
        env = dict(os.environ, PYTHONPATH=str(args.reader.resolve()))
        outcomes: Counter[str] = Counter()
        loop = REWRITTEN if args.loop == "read" else REOPENED
        for _ in range(args.trials):
            returncode, stdout, left_behind = run_trial([sys.executable, "-c", loop, str(packed.path), str(shard),
                                                         str(pristine), str(args.workers), str(args.rounds)], env, tmp)
            if returncode:
                outcomes[f"rc {returncode}{left_behind}"] += 1
                continue
            seen = json.loads(stdout.splitlines()[-1])
            kinds = sorted({re.sub(r"\d+", "N", message.split(": ", 1)[1].split(" (")[0])[:40]
                            for message in seen["messages"]})
            outcomes["ok: " + "; ".join(kinds) + left_behind] += 1
    print(f"reader {args.reader}, {args.storage}, loop {args.loop}, {args.workers} workers, "
          f"{args.trials} trials of {args.rounds} rounds:")
    for outcome, count in outcomes.most_common():
        print(f"  {count:4d}  {outcome}")


def run_trial(command: list[str], env: dict[str, str], cwd: str) -> tuple[int | str, str, str]:
    """Run one trial in a session of its own; its return code (``"hang"`` after 10 minutes), stdout, and
    ``", processes left behind"`` when processes of its session outlived it (then killed). Output goes to
    a file, not a pipe: a loader worker orphaned by a main process killed by SIGBUS holds a pipe open
    forever (torch's watchdog takes init for the parent when the parent died before the worker started
    watching), so waiting for a pipe's end would hang."""
    with tempfile.TemporaryFile("w+") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.DEVNULL, text=True, env=env, cwd=cwd,
                                   start_new_session=True)
        try:
            returncode: int | str = process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            returncode = "hang"
        try:
            os.killpg(process.pid, signal.SIGKILL)
            left_behind = ", processes left behind"
        except ProcessLookupError:
            left_behind = ""
        process.wait()
        out.seek(0)
        return returncode, out.read(), left_behind


if __name__ == "__main__":
    main()
