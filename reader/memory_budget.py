"""How much of a dataset the page cache can be expected to keep (``cache_room``): half the memory this
process may use, and less where the processes and the loaders about to start on this node (one a rank)
take more than a third of it.

The memory is the machine's RAM, or less where a control group caps it: a Slurm job, a container, a
Kubernetes pod, or ``scripts/slowdisk``'s ``SLOW_MEM``. Under such a cap the page cache of
the group is charged to it, so a dataset larger than what is left is read from the disk again every
epoch, whatever the machine's RAM.

Half, because the rest belongs to the processes themselves (torch, the model, batches in flight in
shared memory) and to other jobs; less where three quarters of what is free now, less the batch slots
and workers of the loaders about to start on this node, is less than that. A loader over a dataset
larger than this streams it (``reader.loader``): each block's pages are dropped once read, so that the
cache holds the blocks read ahead, not the ones already consumed.

How far ahead a streamed loader may read is measured rather than assumed (``measure_free_memory``):
what the group can still give the page cache now, its limit less the memory that reclaim cannot take
back (the processes' own memory, shared-memory batches, pinned buffers, a CUDA context), and what is
left of that beyond the files the processes map, whose pages reclaim keeps while it takes blocks read
ahead (``reader.lookahead`` uses both). A fixed share of the limit overshoots where those take most of
it: the blocks read ahead are then evicted before they are read, and every record is read again on
its own at the disk's IOPS.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Iterator, NamedTuple

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
# What a DataLoader worker takes of its own, beyond the memory it shares with its loader's main process
# (the anonymous part of its proportional set size, two workers after 100 batches of 256 records, JPEG
# or raw): 23-29 MB forked (the parent's pages it writes to), about 155 MB spawned or started by a
# forkserver (it imports torch itself).
FORKED_WORKER_BYTES = 32 << 20
STARTED_WORKER_BYTES = 160 << 20
# The share of what the page cache can still take (``cache_room``) that a dataset kept from one epoch to
# the next may fill: the rest is slack for what the reckoning misses (file pages the processes map, the
# kernel's reclaim margins), since a dataset a little larger than the cache is evicted as it is read.
KEEP_SHARE = 0.75


@functools.cache
def page_cache_budget() -> int:
    """Half of ``min(RAM, this process's cgroup memory limit)``, in bytes (computed once per process)."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(ram, cgroup_memory_limit() or ram) // 2


def cache_room(to_come: int) -> int:
    """Bytes of shard files that the page cache can keep from one epoch to the next for a loader about
    to start: half the memory (``page_cache_budget``), and no more than ``KEEP_SHARE`` of what the page
    cache can still take now (``measure_free_memory``'s ``total``) once ``to_come`` bytes are set aside,
    what the loaders about to start will take (their batch slots and their workers' own memory,
    ``worker_bytes``).

    Why both: half the memory leaves the other half to the processes of one training job, but the ranks
    on one node each bring a main process, workers and batch slots. Four ranks (one worker each) under
    a 3,000 MB cap took about 1,800 MB of it, so a 1,440 MB dataset, under half the cap, was not
    streamed: the page cache then held a little less than the dataset, the blocks read ahead were
    evicted before they were read, and an epoch took 124-146 s instead of 17-24. Reckoned so, that
    dataset filled 97% of the room there; 88% under 3,150 MB, where the first epoch unstreamed took
    71 s; and 81% under 3,300 MB, where it took 21 s and the next one, from the page cache, 11 s
    (streamed, as three quarters now has it: 24 s and 19 s). So the share stays under the last good
    case: streaming a dataset that would have stayed cached costs a read of it an epoch, keeping one
    that does not fit costs every record at the disk's IOPS (``scripts/bench_cold.py --ranks``)."""
    return min(page_cache_budget(), int((measure_free_memory().total - to_come) * KEEP_SHARE))


def worker_bytes(start_method: str) -> int:
    """What one DataLoader worker started by ``start_method`` ("fork", "spawn", "forkserver") takes of
    its own (``FORKED_WORKER_BYTES``, ``STARTED_WORKER_BYTES``)."""
    return FORKED_WORKER_BYTES if start_method == "fork" else STARTED_WORKER_BYTES


def cgroup_memory_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> int | None:
    """The tightest memory limit on this process's control group and its ancestors, in bytes; None
    where there is none (or no cgroup file system).

    cgroup v2: ``memory.max`` ("max" is no limit). cgroup v1: the memory controller's
    ``hierarchical_memory_limit`` (``memory.stat``), which already takes the group's ancestors into
    account; a huge number there means no limit.
    """
    limits = [limit for group, v1 in _memory_groups(proc_cgroup, root)
              for limit in _limit(group, v1, _stat(group) if v1 else {})]
    return min(limits) if limits else None


class FreeMemory(NamedTuple):
    """One reading of the memory free for the page cache (``measure_free_memory``), in bytes."""

    total: int  # what the page cache can still take
    beyond_mapped: int  # the same, with the file pages the processes map counted as held


def measure_free_memory(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT,
                        meminfo: Path = MEMINFO) -> FreeMemory:
    """The memory the page cache can still take for this process now, measured on each call.

    ``total``: the least, over this process's memory group and each ancestor that has a limit, of that
    limit less the memory the group holds that reclaim cannot take back: all it is charged for but its
    file cache, shared memory kept (the processes' own memory, pinned buffers, a CUDA context, batch
    slots in shared memory, kernel memory: v2 ``memory.current`` - ``file`` + ``shmem``, v1
    ``memory.usage_in_bytes`` - ``total_cache`` + ``total_shmem``). Each ancestor is its own term:
    under a Slurm job's limit, the other tasks' groups hold memory too. And the machine's
    ``MemAvailable``, which bounds it where no group sets a limit. Never below 0.

    ``beyond_mapped``: the same, each group's term also less the file pages its processes map beyond
    its shared memory (mapped as well where batch slots are: v2 ``file_mapped``, v1
    ``total_mapped_file``); where no group sets a limit, ``MemAvailable`` as for ``total``. Reclaim can
    take those pages, but gives a mapped page used since its last pass another round while it takes a
    page nobody has read yet: under a cap, blocks read ahead go before the code of torch and the other
    libraries (71-92 MB mapped beyond the batch slots in a loader's processes on this project's 2-core
    machine: BENCHMARKS.md, "Some runs are slower, and why").
    """
    available = _mem_available(meminfo)
    total, beyond_mapped = [available], [available]
    for group, v1 in _memory_groups(proc_cgroup, root):
        stat = _stat(group) if v1 else {}  # v1 keeps its limit there: read once for both
        for limit in _limit(group, v1, stat):
            held, mapped = _held(group, v1, stat if v1 else _stat(group))
            total.append(limit - held)
            beyond_mapped.append(limit - held - mapped)
    return FreeMemory(max(0, min(total)), max(0, min(beyond_mapped)))


def _memory_groups(proc_cgroup: Path, root: Path) -> Iterator[tuple[Path, bool]]:
    """This process's memory cgroup and each ancestor up to its hierarchy's root, with whether it is
    cgroup v1 (the memory controller's own hierarchy) or v2 (the unified one); none where
    ``proc_cgroup`` cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            top, v1 = root / "memory", True
        elif controllers == "":
            top, v1 = root, False
        else:
            continue
        group = top / path.lstrip("/")
        while True:
            yield group, v1
            if group == top or top not in group.parents:
                break
            group = group.parent


def _limit(group: Path, v1: bool, stat: dict[str, str]) -> list[int]:
    """``[limit]`` of ``group`` in bytes, or ``[]`` where it has none (or it cannot be read); a v1
    group's is in its ``memory.stat``, ``stat``."""
    if v1:
        text = stat.get("hierarchical_memory_limit", "").strip()
    else:
        try:
            text = (group / "memory.max").read_text().strip()
        except OSError:
            return []
    return [int(text)] if text.isdigit() and 0 < int(text) < 1 << 60 else []


def _held(group: Path, v1: bool, stat: dict[str, str]) -> tuple[int, int]:
    """What ``group`` is charged for that reclaim cannot take back (``measure_free_memory``), and the
    file pages its processes map beyond its shared memory, its ``memory.stat`` being ``stat``; 0 for
    what is unknown."""
    usage, cache, shmem, mapped = (("memory.usage_in_bytes", "total_cache", "total_shmem", "total_mapped_file") if v1
                                   else ("memory.current", "file", "shmem", "file_mapped"))
    if not stat:
        return 0, 0
    try:
        shared = int(stat.get(shmem, 0))
        files = max(0, int(stat.get(mapped, 0)) - shared)  # the mapped count includes shared memory mapped
        return int((group / usage).read_text()) - int(stat.get(cache, 0)) + shared, files
    except (OSError, ValueError):
        return 0, 0


def _stat(group: Path) -> dict[str, str]:
    """``group``'s ``memory.stat`` as a mapping of names to values (as text); empty where it cannot be
    read."""
    try:
        text = (group / "memory.stat").read_text()
    except OSError:
        return {}
    return dict(line.split(" ", 1) for line in text.splitlines() if " " in line)


def _mem_available(meminfo: Path) -> int:
    """The machine's ``MemAvailable`` (bytes); its RAM where the file cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
