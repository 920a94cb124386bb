"""Packing the partitions as Ray tasks, on an existing Ray cluster or a local one (``pack --ray``).

Each partition is one task running ``pipeline.pack_partition`` where Ray places it; the tasks write
straight into DST, which every node must see at the same path (a shared file system), and the driver
writes the manifest once all are done, as a local pack does. A task whose worker process or node dies
is retried by Ray (``max_retries``): the retry rewrites the partition from its start, and the
partition's part record is written only once its shards are complete, so a killed attempt leaves
nothing that counts. A bad image (``PackError``) is not retried: it fails the pack as it would
locally. The one progress bar advances as images are done, whichever node does them (a small actor
keeps each partition's count). Needs the ``ray`` extra
(``pip install packed-images[ray]``), and ``packer`` installed on every node.
"""
from __future__ import annotations

from typing import Any, Callable

from packer.errors import PackError
from packer.run.journal import PartRecord
from packer.run.malloc_tuning import reuse_large_allocations
from packer.run.worker_pool import PartitionTask, pack_partition

LOCAL = "local"
TASK_RETRIES = 3
REPORT_EVERY = 8
PROGRESS_SECONDS = 0.25


def ray_runner(address: str = LOCAL, num_cpus: int | None = None) -> Callable[..., list[PartRecord]]:
    """A ``pack(runner=...)`` that runs the partitions on Ray: ``address`` ``"local"`` starts a local
    Ray instance with ``num_cpus`` CPUs (default: all) for the pack; ``"auto"``, ``host:port`` or
    ``ray://host:port`` connect to a running cluster. An already initialised Ray is used as it is."""

    def run(tasks: list[PartitionTask], on_records: Callable[[int], Any]) -> list[PartRecord]:
        try:
            import ray
        except ImportError:
            raise PackError("--ray needs Ray: pip install 'packed-images[ray]' (or pip install ray)") from None
        started_here = not ray.is_initialized()
        if started_here:
            if address == LOCAL:
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        try:
            return _run_tasks(ray, tasks, on_records)
        finally:
            if started_here:
                ray.shutdown()

    return run


class ProgressBoard:
    """A Ray actor (created with ``ray.remote``): how many images of each partition are done. A retried
    task starts its partition's count again from zero, so the sum never counts an image twice."""

    def __init__(self) -> None:
        self._done: dict[int, int] = {}

    def report(self, partition: int, done: int) -> None:
        self._done[partition] = done

    def total(self) -> int:
        return sum(self._done.values())


def _pack_on_a_node(task: PartitionTask, board: Any) -> PartRecord:
    """The Ray task: one partition, packed by a Ray worker process with the packer's malloc settings,
    its progress posted to ``board`` every ``REPORT_EVERY`` images."""
    reuse_large_allocations()
    done = 0

    def on_record(n: int) -> None:
        nonlocal done
        done += n
        if done % REPORT_EVERY == 0:
            board.report.remote(task.partition.index, done)

    record = pack_partition(task, on_record)
    board.report.remote(task.partition.index, len(task.partition))
    return record


def _run_tasks(ray: Any, tasks: list[PartitionTask], on_records: Callable[[int], Any]) -> list[PartRecord]:
    board = ray.remote(num_cpus=0)(ProgressBoard).remote()
    remote = ray.remote(num_cpus=1, max_retries=TASK_RETRIES, retry_exceptions=False)(_pack_on_a_node)
    refs = [remote.remote(task, board) for task in tasks]
    pending, shown = list(refs), 0
    try:
        while pending:
            finished, pending = ray.wait(pending, num_returns=1, timeout=PROGRESS_SECONDS)
            for ref in finished:
                ray.get(ref)  # raises the task's error
            done = ray.get(board.total.remote())
            if done > shown:
                on_records(done - shown)
                shown = done
        on_records(sum(len(task.partition) for task in tasks) - shown)
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, PackError):
            raise PackError(str(e.cause)) from None
        raise
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        ray.kill(board)
