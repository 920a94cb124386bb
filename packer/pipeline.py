"""Packing partitions on every core: each process decodes, encodes AND writes whole partitions.

A partition (``packer.partitions``) is packed start to finish by one process into its own shards
(``part-PPPPP-shard-SSSSS``), then marked done by its part record (``packer.journal``). Nothing per
record travels between processes except a shared progress count, so adding cores adds writers too.
The result of a partition depends only on its records, so any number of processes, in any order,
give the same bytes. With ``workers <= 1`` the partitions are packed one after the other in this
process; otherwise a pool of forked processes takes them one at a time.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from packer.destination import partition_shard_name
from packer.encoding import Failure, encode_file
from packer.errors import PackError
from packer.journal import PartRecord
from packer.malloc_tuning import reuse_large_allocations
from packer.partitions import Partition
from packer.shard_sequence import ShardSequence
from packer.sources import Skipped
from packer.transforms import TransformSpec

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


@dataclass(frozen=True)
class PartitionTask:
    """One partition to pack: its range, and its images' paths (relative to the root) and labels."""

    settings: PackSettings
    partition: Partition
    paths: list[str]
    labels: np.ndarray


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
    settings, partition = task.settings, task.partition
    shards = ShardSequence(
        settings.dst, settings.storage, settings.shard_size,
        lambda number: partition_shard_name(partition.index, number, settings.storage),
    )
    skipped: list[tuple[int, Skipped]] = []
    try:
        for position, path, label in zip(range(partition.start, partition.end), task.paths, task.labels):
            if should_stop is not None and should_stop():
                raise Stopped
            result = encode_file(str(settings.root / path), settings.spec)
            if isinstance(result, Failure):
                if settings.on_error == "fail":
                    raise PackError(f"{settings.root / path}: {result.reason}")
                skipped.append((position, Skipped(path, result.reason)))
            else:
                shards.add(result, int(label))
            if on_record is not None:
                on_record(1)
        record = PartRecord(settings.fingerprint, partition, shards.finish(), skipped)
    except BaseException:
        shards.abort()
        raise
    record.save(settings.dst)
    return record


def pack_partitions(
    tasks: list[PartitionTask], workers: int, on_records: Callable[[int], Any]
) -> list[PartRecord]:
    """Pack every task's partition with ``workers`` processes; their part records, in task order.

    ``on_records(n)`` is called in this process as images are done. The first failure stops the other
    partitions (their finished shards stay for a rerun to overwrite) and is raised here.
    """
    if workers <= 1 or len(tasks) <= 1:
        reuse_large_allocations()
        return [pack_partition(task, on_records) for task in tasks]
    context = multiprocessing.get_context("fork")
    done_count = context.Value("q", 0)
    stop = context.Event()
    executor = ProcessPoolExecutor(
        min(workers, len(tasks)), mp_context=context, initializer=_start_worker, initargs=(done_count, stop)
    )
    records: dict[Future[PartRecord], PartRecord] = {}
    reported = 0
    try:
        futures = [executor.submit(_pack_in_worker, task) for task in tasks]
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=_PROGRESS_SECONDS, return_when=FIRST_COMPLETED)
            now = done_count.value
            on_records(now - reported)
            reported = now
            for future in finished:
                records[future] = future.result()
    except BrokenProcessPool as e:
        raise PackError(
            f"a packing worker process died ({e}); if it ran out of memory, use fewer workers"
        ) from None
    finally:
        if len(records) < len(tasks):
            stop.set()
        executor.shutdown(wait=True, cancel_futures=True)
    return [records[future] for future in futures]


_worker_done_count: Any = None
_worker_stop: Any = None


def _start_worker(done_count: Any, stop: Any) -> None:
    global _worker_done_count, _worker_stop
    _worker_done_count, _worker_stop = done_count, stop
    reuse_large_allocations()


def _pack_in_worker(task: PartitionTask) -> PartRecord:
    return pack_partition(task, _count_done, _worker_stop.is_set)


def _count_done(n: int) -> None:
    with _worker_done_count.get_lock():
        _worker_done_count.value += n
