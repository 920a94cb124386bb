"""How much of a dataset the page cache can be expected to keep: half the memory this process may use.

The memory is the machine's RAM, or less where a control group caps it: a Slurm job, a container, a
Kubernetes pod, or ``scripts/slowdisk``'s ``SLOW_MEM``. Under such a cap the page cache of
the group is charged to it, so a dataset larger than what is left is read from the disk again every
epoch, whatever the machine's RAM.

Half, because the rest belongs to the processes themselves (torch, the model, batches in flight in
shared memory) and to other jobs. A loader over a dataset larger than this streams it
(``reader.loader``): each record's pages are dropped once read, so that the cache holds the blocks
read ahead, not the ones already consumed.

How far ahead a streamed loader may read is measured rather than assumed (``free_memory``): what the
group can still give the page cache now, its limit less the memory that reclaim cannot take back
(the processes' own memory, shared-memory batches, pinned buffers, a CUDA context). A fixed share
of the limit overshoots where those take most of it: the blocks read ahead are then evicted before
they are read, and every record is read again on its own at the disk's IOPS.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")


@functools.cache
def page_cache_budget() -> int:
    """Half of ``min(RAM, this process's cgroup memory limit)``, in bytes (computed once per process)."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(ram, cgroup_memory_limit() or ram) // 2


def cgroup_memory_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> int | None:
    """The tightest memory limit on this process's control group and its ancestors, in bytes; None
    where there is none (or no cgroup file system).

    cgroup v2: ``memory.max`` of the group and each ancestor ("max" is no limit). cgroup v1: the
    memory controller's ``hierarchical_memory_limit`` (``memory.stat``), which already takes the
    ancestors into account; a huge number there means no limit.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if "memory" in controllers.split(","):
            limits += _v1_limit(root / "memory" / relative)
        elif controllers == "":
            group = root / relative
            while True:
                limits += _v2_limit(group / "memory.max")
                if group == root or root not in group.parents:
                    break
                group = group.parent
    real = [limit for limit in limits if 0 < limit < 1 << 60]
    return min(real) if real else None


def _v1_limit(group: Path) -> list[int]:
    try:
        for line in (group / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "hierarchical_memory_limit":
                return [int(value)]
    except (OSError, ValueError):
        pass
    return []


def _v2_limit(path: Path) -> list[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return []
    return [int(text)] if text.isdigit() else []


def free_memory(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT,
                meminfo: Path = MEMINFO) -> int:
    """Bytes the page cache can still take for this process now, measured on each call.

    Under memory limits: the least, over each limited group of this process (as in
    ``cgroup_memory_limit``), of its limit less the memory it holds that reclaim cannot take back:
    anonymous memory (the processes' own, pinned buffers, a CUDA context) and shared memory (batch
    slots); cgroup v2 ``anon`` + ``shmem`` of ``memory.stat``, v1 ``total_rss`` + ``total_shmem``. The
    machine's ``MemAvailable`` too, which bounds it where no group sets a limit.
    """
    free = [_mem_available(meminfo)]
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if "memory" in controllers.split(","):
            group = root / "memory" / relative
            limit, held = _v1_limit(group), _held(group, ("total_rss", "total_shmem"))
            free += [limit[0] - held] if limit and 0 < limit[0] < 1 << 60 else []
        elif controllers == "":
            group = root / relative
            while True:
                limit = _v2_limit(group / "memory.max")
                free += [limit[0] - _held(group, ("anon", "shmem"))] if limit else []
                if group == root or root not in group.parents:
                    break
                group = group.parent
    return max(0, min(free))


def _held(group: Path, names: tuple[str, ...]) -> int:
    """The sum of ``names`` in ``group``'s ``memory.stat`` (0 for those absent)."""
    try:
        stat = dict(line.split(" ", 1) for line in (group / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return 0
    return sum(int(stat[name]) for name in names if stat.get(name, "").strip().isdigit())


def _mem_available(meminfo: Path) -> int:
    """The machine's ``MemAvailable`` (bytes); its RAM where the file cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
