"""Packing partitions on every core: each process decodes, encodes AND writes whole partitions.

A partition (``packer.partitions``) is packed start to finish by one process into its own shards
(``part-PPPPP-shard-SSSSS``), then marked done by its part record (``packer.journal``). Nothing per
record travels between processes except a shared progress count, so adding cores adds writers too.
The result of a partition depends only on its records, so any number of processes, in any order,
give the same bytes. With ``workers <= 1`` the partitions are packed one after the other in this
process; otherwise forked worker processes take them one at a time from a queue.

Finishing a partition (its last shard's LMDB commit or HDF5 copy, fsync, rename and checksum, then
the part record) takes 15-20 ms for a 10 MB shard here, most of it waiting for the disk. A process
does it on a background thread while it encodes its next partition (``pack_in_turn``), so the core
is not left idle; at most one partition per process is being finished at a time.
"""
from __future__ import annotations

import multiprocessing
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from packer.cleanup import leave_interrupts_to_the_parent
from packer.destination import partition_shard_name
from packer.encoding import Failure, encode_image
from packer.errors import PackError
from packer.journal import PartRecord
from packer.malloc_tuning import reuse_large_allocations
from packer.partitions import Partition
from packer.sources import Skipped, display_name
from packer.transforms import TransformSpec
from reader.format import DatasetWriter
from reader.format.fields import FieldSpec

_PROGRESS_SECONDS = 0.2


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
    ``2 * workers`` of them are taken ahead of the workers, so a stream of in-memory images is never
    held whole. ``on_records(n)`` is called in this process as images are done. The first failure
    stops the other partitions (their finished shards stay for a rerun to overwrite) and is raised
    here; so is the death of a worker process.
    """
    if isinstance(tasks, list) and len(tasks) <= 1 or workers <= 1:
        reuse_large_allocations()
        return list(pack_in_turn(tasks, on_records))
    context = multiprocessing.get_context("fork")
    todo, results = context.Queue(), context.Queue()
    done_count, stop = context.Value("q", 0), context.Event()
    processes = [
        context.Process(target=_worker, args=(todo, results, done_count, stop), daemon=True)
        for _ in range(min(workers, len(tasks)) if isinstance(tasks, list) else workers)
    ]
    for process in processes:  # forked before this process starts the queue's feeder thread
        process.start()
    feeder = _Feeder(iter(tasks), todo, len(processes))
    records: dict[int, PartRecord] = {}
    reported = 0
    try:
        feeder.feed(outstanding=0)
        while not feeder.finished or len(records) < len(feeder.fed):
            try:
                kind, payload = results.get(timeout=_PROGRESS_SECONDS)
            except queue.Empty:
                _check_alive(processes)
                continue
            finally:
                now = done_count.value
                on_records(now - reported)
                reported = now
            if kind == "error":
                raise payload.rebuilt()
            records[payload.partition.index] = payload
            feeder.feed(outstanding=len(feeder.fed) - len(records))
    finally:
        stop.set()
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
                process.join()
    return [records[index] for index in feeder.fed]


class _Feeder:
    """Puts tasks on the workers' queue as they free up, then one end marker per worker."""

    def __init__(self, tasks: Iterator[PartitionTask], todo: Any, workers: int) -> None:
        self.tasks, self.todo, self.workers = tasks, todo, workers
        self.fed: list[int] = []
        self.finished = False

    def feed(self, outstanding: int) -> None:
        while not self.finished and outstanding < 2 * self.workers:
            task = next(self.tasks, None)
            if task is None:
                self.finished = True
                for _ in range(self.workers):
                    self.todo.put(None)
                return
            self.todo.put(task)
            self.fed.append(task.partition.index)
            outstanding += 1


def _worker(todo: Any, results: Any, done_count: Any, stop: Any) -> None:
    """A worker process: packs partitions from ``todo`` until its end marker, sends each part record
    (or the error that stopped it) to ``results``."""
    leave_interrupts_to_the_parent()
    reuse_large_allocations()

    def count_done(n: int) -> None:
        with done_count.get_lock():
            done_count.value += n

    try:
        for record in pack_in_turn(iter(todo.get, None), count_done, stop.is_set):
            results.put(("record", record))
    except Stopped:
        pass
    except BaseException as e:
        results.put(("error", WorkerError.of(e)))


@dataclass(frozen=True)
class WorkerError:
    """An exception raised in a worker process, as plain fields the parent rebuilds it from.

    The exception object itself is not sent: one whose constructor takes other arguments than it
    stores would fail to cross the queue in the queue's own feeder thread, silently, and the parent
    would wait forever. A user-fixable ``PackError`` and an ``OSError`` (a full disk, a shard that
    cannot be written) come back as themselves; anything else as a ``PackError`` naming its type.
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
        if self.type_name == PackError.__name__:
            return PackError(self.message)
        return PackError(f"{self.type_name}: {self.message}")


def _check_alive(processes: list[Any]) -> None:
    """Raise when a worker process died (killed, out of memory) instead of finishing its work."""
    if all(process.exitcode == 0 for process in processes):
        raise PackError("the packing worker processes ended before every partition was packed")
    for process in processes:
        if process.exitcode not in (None, 0):
            raise PackError(
                f"a packing worker process died (exit code {process.exitcode}); "
                "if it ran out of memory, use fewer workers"
            )
