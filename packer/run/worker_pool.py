"""Packing partitions on every core: each process decodes, encodes AND writes whole partitions.

A partition (``packer.run.partitions``) is packed start to finish by one process into its own shards
(``part-PPPPP-shard-SSSSS``), then marked done by its part record (``packer.run.journal``). Nothing per
record travels between processes except a progress count, so adding cores adds writers too.
The result of a partition depends only on its records, so any number of processes, in any order,
give the same bytes. With ``workers <= 1`` the partitions are packed one after the other in this
process; otherwise forked worker processes are sent them one at a time, each down its own pipe
(``_Pool``: no lock is shared, so a worker killed at any moment fails the pack instead of hanging it).

Finishing a partition (its last shard's LMDB commit or HDF5 copy, fsync, rename and checksum, then
the part record) takes 15-20 ms for a 10 MB shard here, most of it waiting for the disk. A process
does it on a background thread while it encodes its next partition (``pack_in_turn``), so the core
is not left idle; at most one partition per process is being finished at a time.
"""
from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from packer.errors import PackError
from packer.image.record import Failure, encode_image
from packer.image.transforms import TransformSpec
from packer.run.cleanup import leave_interrupts_to_the_parent
from packer.run.destination import partition_shard_name
from packer.run.journal import PartRecord
from packer.run.malloc_tuning import reuse_large_allocations
from packer.run.partitions import Partition
from packer.source.scan import Skipped, display_name
from reader.format import DatasetWriter, FormatError
from reader.format.fields import FieldSpec

_PROGRESS_SECONDS = 0.2
_DEATH_SECONDS = 10  # between a worker's pipe closing and its exit code being there: milliseconds
_SHUTDOWN_SECONDS = 60  # for the workers to finish saving the partitions they are on, after a failure


@dataclass(frozen=True)
class PackSettings:
    """What every partition of one pack shares: where, how, and the plan's fingerprint."""

    dst: Path
    root: Path
    storage: str
    shard_size: int
    spec: TransformSpec
    on_error: str
    fingerprint: str
    fields: tuple[FieldSpec, ...] = ()


@dataclass(frozen=True)
class PartitionTask:
    """One partition to pack: its range, and its images' paths (relative to the root), labels, source
    names (what each record's source path is recorded as) and field values (one list per field).
    ``images``: the images themselves (``packer.items``: paths, bytes or PIL images) instead of files
    under the root; ``paths`` then only repeat the source names."""

    settings: PackSettings
    partition: Partition
    paths: list[str]
    labels: np.ndarray
    sources: list[str]
    values: dict[str, list[Any]] = field(default_factory=dict)
    images: list[Any] | None = None

    def image(self, k: int) -> Any:
        """The ``k``-th image of the partition, as ``encode_image`` takes it."""
        return str(self.settings.root / self.paths[k]) if self.images is None else self.images[k]

    def shown(self, k: int) -> str:
        """The ``k``-th image as an error names it."""
        if self.images is None:
            return str(self.settings.root / display_name(self.paths[k]))
        return f"item {self.partition.start + k} ({self.sources[k]})"


class Stopped(Exception):
    """Another partition failed, so this one was given up."""


def pack_partition(
    task: PartitionTask,
    on_record: Callable[[int], Any] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> PartRecord:
    """Encode and write one partition's records into its own shards, then save its part record.

    ``on_record(1)`` is called after each image; ``should_stop()`` is asked before each image, and a
    true answer gives the partition up (``Stopped``). With ``on_error="fail"`` a bad image raises
    ``PackError`` naming it. The shard being written is dropped on any exception.
    """
    shards, skipped = _encode_partition(task, on_record, should_stop)
    return _finish_partition(task, shards, skipped)


def pack_in_turn(
    tasks: Iterable[PartitionTask],
    on_record: Callable[[int], Any] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[PartRecord]:
    """``pack_partition`` over ``tasks`` one after the other, each partition finished on a background
    thread while the next one is encoded; yields the part records in task order as they are saved."""
    with ThreadPoolExecutor(1, thread_name_prefix="partition-finisher") as finisher:
        finishing: Future[PartRecord] | None = None
        try:
            for task in tasks:
                shards, skipped = _encode_partition(task, on_record, should_stop)
                if finishing is not None:
                    yield finishing.result()
                finishing = finisher.submit(_finish_partition, task, shards, skipped)
            if finishing is not None:
                yield finishing.result()
        finally:
            if finishing is not None and not finishing.done():
                finishing.exception()  # a complete partition: let it be saved for a rerun to keep


def _encode_partition(
    task: PartitionTask, on_record: Callable[[int], Any] | None, should_stop: Callable[[], bool] | None
) -> tuple[DatasetWriter, list[tuple[int, Skipped]]]:
    """Every record of the partition appended to its shards; the last shard is left open."""
    settings, partition = task.settings, task.partition
    shards = DatasetWriter(
        settings.dst, settings.storage, settings.shard_size,
        lambda number: partition_shard_name(partition.index, number, settings.storage),
        fields=settings.fields,
    )
    skipped: list[tuple[int, Skipped]] = []
    try:
        for k, (position, label) in enumerate(zip(range(partition.start, partition.end), task.labels)):
            if should_stop is not None and should_stop():
                raise Stopped
            result = encode_image(task.image(k), settings.spec)
            if isinstance(result, Failure):
                if settings.on_error == "fail":
                    raise PackError(f"{task.shown(k)}: {result.reason}")
                skipped.append((position, Skipped(task.sources[k], result.reason)))
            else:
                shards.add(result.payload, int(label), result.height, result.width, source=task.sources[k],
                           fields={name: values[k] for name, values in task.values.items()})
            if on_record is not None:
                on_record(1)
    except BaseException:
        shards.abort()
        raise
    return shards, skipped


def _finish_partition(
    task: PartitionTask, shards: DatasetWriter, skipped: list[tuple[int, Skipped]]
) -> PartRecord:
    """Publish the partition's last shard, then save the part record that marks it done."""
    try:
        record = PartRecord(task.settings.fingerprint, task.partition, shards.finish_shards(), skipped)
    except BaseException:
        shards.abort()
        raise
    record.save(task.settings.dst)
    return record


def pack_partitions(
    tasks: Iterable[PartitionTask], workers: int, on_records: Callable[[int], Any]
) -> list[PartRecord]:
    """Pack every task's partition with ``workers`` processes; their part records, in task order.

    ``tasks`` may be a list or a stream (``packer.items`` makes them as it reads its items): at most
    two of them per worker are taken ahead of the workers, so a stream of in-memory images is never
    held whole. ``on_records(n)`` is called in this process as images are done. The first failure
    stops the other partitions (their finished shards stay for a rerun to keep) and is raised here;
    so is the death of a worker process, killed at any moment, and an error raised by ``tasks``.
    """
    if isinstance(tasks, list) and len(tasks) <= 1 or workers <= 1:
        reuse_large_allocations()
        return list(pack_in_turn(tasks, on_records))
    count = min(workers, len(tasks)) if isinstance(tasks, list) else workers
    pool = _Pool(count)
    try:
        return pool.run(iter(tasks), on_records)
    finally:
        pool.shut_down()


@dataclass
class _Worker:
    """One worker process and the parent's ends of its two pipes: tasks go down ``tasks``, part
    records (or the error that stopped it) come back up ``results``. ``outstanding``: the partitions
    sent to it whose record has not come back yet."""

    process: Any
    tasks: Connection
    results: Connection
    outstanding: list[int] = field(default_factory=list)


class _Pool:
    """Forked worker processes that share no lock with each other or with this process.

    A process killed at any moment (the OOM killer's SIGKILL) can hold a lock forever, and whoever
    waits on it next hangs: a shared queue's reader or writer lock, an ``Event``'s condition, a counted
    ``Value``. So each worker has its own pipes (one reader, one writer each), reports its progress in
    its own slot of a lock-free shared array, and reads a lock-free stop flag; this process waits on
    the pipes and on the processes' sentinels at once, so a death is seen within a progress tick.
    """

    def __init__(self, count: int) -> None:
        context = multiprocessing.get_context("fork")
        self.done = context.RawArray("q", count)  # images done, one slot per worker: a single writer each
        self.stop = context.RawValue("b", 0)
        pipes = [(context.Pipe(duplex=False), context.Pipe(duplex=False)) for _ in range(count)]
        everything = [end for pair in pipes for pipe in pair for end in pipe]
        self.workers: list[_Worker] = []
        for number, ((task_out, task_in), (result_out, result_in)) in enumerate(pipes):
            others = [end for end in everything if end is not task_out and end is not result_in]
            process = context.Process(target=_worker, daemon=True,
                                      args=(number, task_out, result_in, others, self.done, self.stop))
            self.workers.append(_Worker(process, task_in, result_out))
        for worker in self.workers:
            worker.process.start()
        for (task_out, _), (_, result_in) in pipes:
            task_out.close()
            result_in.close()

    def run(self, tasks: Iterator[PartitionTask], on_records: Callable[[int], Any]) -> list[PartRecord]:
        records: dict[int, PartRecord] = {}
        fed: list[int] = []
        reported = 0
        more = True
        while True:
            for worker in self.workers:
                while more and len(worker.outstanding) < 2:
                    task = next(tasks, None)
                    if task is None:
                        more = False
                        for each in self.workers:
                            each.tasks.close()  # the end of the tasks, which the worker sees as EOF
                        break
                    self._send(worker, task)
                    fed.append(task.partition.index)
            if not more and len(records) == len(fed):
                return [records[index] for index in fed]
            running = [w for w in self.workers if not w.results.closed]
            ready = wait([w.results for w in running] + [w.process.sentinel for w in running], _PROGRESS_SECONDS)
            for worker in running:
                if worker.results in ready or worker.process.sentinel in ready:
                    for kind, payload in self._receive(worker):
                        if kind == "error":
                            raise payload.rebuilt()
                        records[payload.partition.index] = payload
                        worker.outstanding.remove(payload.partition.index)
            now = sum(self.done)
            on_records(now - reported)
            reported = now

    def _send(self, worker: _Worker, task: PartitionTask) -> None:
        try:
            worker.tasks.send(task)
        except OSError:  # the worker is gone: its end of the pipe was closed with it
            worker.process.join(_DEATH_SECONDS)
            raise _death(worker.process.exitcode) from None
        worker.outstanding.append(task.partition.index)

    def _receive(self, worker: _Worker) -> list[tuple[str, Any]]:
        """What ``worker`` has sent so far. Once it has ended, its pipe is closed, and an error raised
        if partitions sent to it are still outstanding."""
        messages = []
        ended = worker.process.exitcode is not None  # then everything it sent is in the pipe already
        while worker.results.poll():
            try:
                messages.append(worker.results.recv())
            except (EOFError, OSError):  # it exited, or died while sending
                ended = True
                break
        if ended:
            worker.results.close()
            worker.process.join(_DEATH_SECONDS)
            left = set(worker.outstanding) - {m[1].partition.index for m in messages if m[0] == "record"}
            if left and not any(kind == "error" for kind, _ in messages):
                raise _death(worker.process.exitcode)
        return messages

    def shut_down(self) -> None:
        """Stop the workers: each finishes the partition it is saving (kept for a rerun) and gives up
        the others; any still running after ``_SHUTDOWN_SECONDS`` is killed."""
        self.stop.value = 1
        for worker in self.workers:
            worker.tasks.close()
        deadline = time.monotonic() + _SHUTDOWN_SECONDS
        running = [w for w in self.workers if w.process.exitcode is None]
        while running and time.monotonic() < deadline:
            ready = wait([w.results for w in running if not w.results.closed]
                         + [w.process.sentinel for w in running], deadline - time.monotonic())
            for worker in running:
                if worker.results in ready:  # drained, so that a worker never blocks sending to us
                    try:
                        worker.results.recv()
                    except (EOFError, OSError):
                        worker.results.close()
            running = [w for w in running if w.process.exitcode is None]
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join()
            worker.results.close()


def _worker(number: int, tasks: Connection, results: Connection, others: list[Connection], done: Any,
            stop: Any) -> None:
    """A worker process: packs the partitions sent down ``tasks`` until its end, sends each part
    record (or the error that stopped it) up ``results``; counts its images in ``done[number]``."""
    for end in others:  # the other workers' pipes and this process's copies of the parent's ends
        end.close()
    leave_interrupts_to_the_parent()
    reuse_large_allocations()
    received: queue.SimpleQueue[PartitionTask | None] = queue.SimpleQueue()
    threading.Thread(target=_read_tasks, args=(tasks, received), daemon=True).start()

    def count_done(n: int) -> None:
        done[number] += n

    try:
        for record in pack_in_turn(iter(received.get, None), count_done, lambda: bool(stop.value)):
            results.send(("record", record))
    except Stopped:
        pass
    except BaseException as e:
        results.send(("error", WorkerError.of(e)))


def _read_tasks(tasks: Connection, received: "queue.SimpleQueue[PartitionTask | None]") -> None:
    """Take each task off the pipe as soon as it is sent (so the parent never waits on a busy worker),
    then None at the end of the tasks."""
    while True:
        try:
            received.put(tasks.recv())
        except (EOFError, OSError):
            received.put(None)
            return


@dataclass(frozen=True)
class WorkerError:
    """An exception raised in a worker process, as plain fields the parent rebuilds it from.

    The exception object itself is not sent: one whose constructor takes other arguments than it
    stores would fail to cross the queue in the queue's own feeder thread, silently, and the parent
    would wait forever. A user-fixable ``PackError`` or ``FormatError`` (a record the format cannot
    hold) and an ``OSError`` (a full disk, a shard that cannot be written) come back as themselves
    (the first two as ``PackError``); anything else as a ``PackError`` naming its type.
    """

    type_name: str
    message: str
    errno: int | None = None
    strerror: str | None = None
    filename: str | None = None

    @classmethod
    def of(cls, error: BaseException) -> "WorkerError":
        if isinstance(error, OSError):
            filename = None if error.filename is None else str(error.filename)
            return cls("OSError", str(error), error.errno, error.strerror, filename)
        return cls(type(error).__name__, str(error))

    def rebuilt(self) -> Exception:
        if self.type_name == "OSError":
            if self.errno is None:
                return OSError(self.message)
            return OSError(self.errno, self.strerror or self.message, self.filename)
        if self.type_name in (PackError.__name__, FormatError.__name__):
            return PackError(self.message)
        return PackError(f"{self.type_name}: {self.message}")


def _death(exitcode: int | None) -> PackError:
    """The error for a worker process that ended (killed, out of memory) before its work was done."""
    if exitcode == 0:
        return PackError("a packing worker process ended before every partition was packed")
    return PackError(f"a packing worker process died (exit code {exitcode}); "
                     "if it ran out of memory, use fewer workers")
