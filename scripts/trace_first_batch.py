"""Where a cold epoch's first batch waits: a timeline of the loader's steps in its main process and workers.

    scripts/slowdisk run python scripts/trace_first_batch.py SET [--workers 2] [--batch 256] [--disk] [--idle S]

Run under ``scripts/slowdisk run`` (the page cache dropped, reads throttled), it makes
``make_loader(SET, batch, num_workers=workers, multiprocessing_context="fork")`` and takes its first
batch, noting when each step starts and ends, in milliseconds from ``iter()``. In the main process: the
DataLoader's iterator made (its workers forked, then its first batches drawn from the stream), the
record tables asked for and the blocks advised (first and last call before the first batch, and how
many), each batch received from a worker until the first is yielded (in order: one worker's may come
before the first) and the first's pinned copy (where CUDA is there it is started first, as
``bench_cold.py`` starts it, and batches are pinned). In each worker: its start (``worker_init_fn``,
right after the fork) and its first batch (the read and decode, then the handoff to the collate
function; the pickling and the queue that carry the batch to the main process come between that and its
receipt, untimed). Then the same with the cache warm (a second loader over the same set, whose first
batch is now cached), so that what the disk costs shows against what the processes cost. With
``--disk``, also what the disk holding SET had served by each moment of the cold first batch: its
``/sys/dev/block/MAJ:MIN/stat`` read every millisecond, a line each time the count moves (a throttled
disk serves in steps about 100 ms apart, so a step's IOs come as one line).

``--idle S`` waits S seconds between making the loader and ``iter()``, as a training script that builds
its model in between does. On the throttled disk that changes the cold first batch: the kernel's block
throttle meters reads in periods of about 100 ms, the first starting with the first read after an idle
spell. Without ``--idle`` that read is the dataset's open a few milliseconds before ``iter()`` (its
manifest and the shard files' inodes), so the first window is read in periods that began before
``iter()``; with it, the period begins with the loader's first read, the record tables.

Why: BENCHMARKS.md's first batches are one figure, the wait; on one lent 16-core machine (lending C
there) they came at 0.39-0.46 s, about 0.2 s more than the disk's first window explains, and one
number cannot say which step took it. The steps are timed by wrapping the loader's own functions in
this process before the loader is made, so the reader runs unchanged; its workers are forked, so that
they inherit the wrappers (spawned ones would import the modules unwrapped). Each process appends its
lines to one file, tagged with the loader they belong to, ``time.time()`` being one clock for all of
them on one machine.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from reader import PackedDataset  # noqa: E402
from reader import loader as loader_module  # noqa: E402
from reader.packed_view import PackedView  # noqa: E402
from reader.torch_hooks import HookedDataLoader  # noqa: E402

TRACE = Path()  # the file every process appends its lines to: set by main(), inherited by the workers
loader_number = 0  # which loader of this run is being traced (its workers inherit the number)
# steps called many times before the first batch: the timeline gives their count, first and last call
TABLES, ADVICE = "main asks for tables", "main advises blocks"


def note(event: str) -> None:
    """One line ``time pid loader event``, appended with one write (whole lines from concurrent processes)."""
    line = f"{time.time():.6f} {os.getpid()} {loader_number} {event}\n".encode()
    fd = os.open(TRACE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def timed(name: str, function: Callable[..., Any], first_only: bool = True) -> Callable[..., Any]:
    """``function`` noting its start and end as ``name``: its first call for each loader in each process
    only, or all."""
    calls: dict[tuple[int, int], int] = {}

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = (os.getpid(), loader_number)
        count = calls[key] = calls.get(key, 0) + 1
        if first_only and count > 1:
            return function(*args, **kwargs)
        note(f"{name} #{count} start")
        try:
            return function(*args, **kwargs)
        finally:
            note(f"{name} #{count} end")
    return wrapper


def instrument() -> None:
    """Wrap the loader's steps (module docstring); before ``make_loader``, which takes some of them."""
    HookedDataLoader._get_iterator = timed("main makes the iterator", HookedDataLoader._get_iterator)  # type: ignore[method-assign]
    loader_module.start_worker = timed("worker start", loader_module.start_worker)
    loader_module.hand_over = timed("worker handoff", loader_module.hand_over)
    loader_module._received = timed("main receives a batch", loader_module._received, first_only=False)
    loader_module._pinned = timed("main pinned copy", loader_module._pinned)
    PackedView.__getitems__ = timed("worker reads and decodes", PackedView.__getitems__)  # type: ignore[method-assign]
    PackedView.read_tables_ahead = timed(TABLES, PackedView.read_tables_ahead, first_only=False)  # type: ignore[method-assign]
    PackedView.advise = timed(ADVICE, PackedView.advise, first_only=False)  # type: ignore[method-assign]


class DiskServed:
    """What the block device holding a path has served (reads completed, bytes), read every millisecond
    on a thread while in a ``with`` block: ``steps()`` gives ``(ms from start, reads, MB)`` each time it
    moved, reads within ``STEP_MS`` of each other folded into one step."""

    STEP_MS = 5

    def __init__(self, path: str) -> None:
        device = os.stat(path).st_dev
        self.stat = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat")
        if not self.stat.is_file():
            raise SystemExit(f"--disk: {path} is not on a block device ({self.stat} does not exist: "
                             "a network or memory file system?)")
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _read(self) -> tuple[int, int]:
        fields = self.stat.read_text().split()
        return int(fields[0]), int(fields[2]) * 512  # reads completed, sectors read

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), *self._read()))
            time.sleep(0.001)

    def __enter__(self) -> "DiskServed":
        self.start = time.time()
        self.base = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def steps(self) -> list[tuple[float, int, float]]:
        out: list[tuple[float, int, float]] = []
        last = self.base
        for t, reads, nbytes in self.samples:
            if (reads, nbytes) == last:
                continue
            last = (reads, nbytes)
            row = (1000 * (t - self.start), reads - self.base[0], (nbytes - self.base[1]) / 1e6)
            if out and row[0] - out[-1][0] < self.STEP_MS:
                out[-1] = (out[-1][0], row[1], row[2])
            else:
                out.append(row)
        return out


def first_batch(path: str, workers: int, batch: int, disk: bool = False, idle: float = 0) -> DiskServed | None:
    """Make the run's next loader over ``path``, wait ``idle`` seconds, and take its first batch, noting
    ``iter()`` and the batch's arrival; with ``disk``, what the disk served from ``iter()`` to the first
    batch."""
    global loader_number
    loader_number += 1
    served = DiskServed(path) if disk else None
    loader = loader_module.make_loader(PackedDataset(path), batch, num_workers=workers,
                                       multiprocessing_context="fork")
    time.sleep(idle)
    note("iter")
    with served or contextlib.nullcontext():
        iterator = iter(loader)
        next(iterator)
        note("first batch")
    del iterator, loader
    return served


def timeline(lines: list[str], number: int) -> str:
    """The lines of loader ``number`` from its ``iter()`` to its first batch, in ms from ``iter()``, by
    process; the calls of ``TABLES`` and ``ADVICE`` folded into their count, first and last."""
    rows = sorted((float(t), int(pid), event) for t, pid, loader, event in (line.split(" ", 3) for line in lines)
                  if int(loader) == number)
    begin = next(i for i, row in enumerate(rows) if row[2] == "iter")
    end = next(i for i, row in enumerate(rows) if row[2] == "first batch")
    t0, main = rows[begin][0], rows[begin][1]
    workers: dict[int, str] = {}
    repeated: dict[str, list[float]] = {}
    out = []
    for t, pid, event in rows[begin:end + 1]:
        who = "main" if pid == main else workers.setdefault(pid, f"worker {len(workers)}")
        name, _, rest = event.partition(" #")
        if name in (TABLES, ADVICE):
            if rest.endswith("start"):
                repeated.setdefault(name, []).append(1000 * (t - t0))
            continue
        out.append(f"  {1000 * (t - t0):8.1f} ms  {who:9}  {name}{' ' + rest.split()[-1] if rest else ''}")
    for name, times in repeated.items():
        out.append(f"  {name}: {len(times)} calls, first at {times[0]:.1f} ms, last at {times[-1]:.1f} ms")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("set", help="a packed dataset, read cold (run under scripts/slowdisk run)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--disk", action="store_true",
                        help="also what the disk served during the cold first batch (module docstring)")
    parser.add_argument("--idle", type=float, default=0.0, metavar="S",
                        help="seconds between making the loader and iter(), as a training script builds its "
                             "model in between (module docstring)")
    args = parser.parse_args()
    if args.idle < 0:
        parser.error(f"--idle must be 0 or more seconds, got {args.idle}")
    if torch.cuda.is_available():
        torch.empty(1).pin_memory()
    print(f"{args.set}: batch {args.batch}, {args.workers} workers, "
          f"{'CUDA started first' if torch.cuda.is_available() else 'no CUDA'}")
    global TRACE
    TRACE = Path(tempfile.mkdtemp(prefix="first-batch-")) / "trace.txt"
    instrument()
    labels = ("cold", "warm")
    try:
        served = first_batch(args.set, args.workers, args.batch, disk=args.disk, idle=args.idle)
        first_batch(args.set, args.workers, args.batch)
        lines = TRACE.read_text().splitlines()
    finally:
        shutil.rmtree(TRACE.parent)
    for number, label in enumerate(labels, 1):
        print(f"{label} (page cache {'dropped' if label == 'cold' else 'holding the first batch'}):")
        print(timeline(lines, number), flush=True)
    if served is not None:
        print(f"the disk ({served.stat.parent.name}) from iter() to the cold first batch, by step:")
        for ms, reads, mb in served.steps():
            print(f"  {ms:8.1f} ms  {reads:4} reads done, {mb:6.1f} MB")


if __name__ == "__main__":
    main()
