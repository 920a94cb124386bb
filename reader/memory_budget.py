"""How much of a dataset the page cache can be expected to keep: half the memory this process may use.

The memory is the machine's RAM, or less where a control group caps it: a Slurm job, a container, a
Kubernetes pod, or ``../shared/tools/slowdisk``'s ``SLOW_MEM``. Under such a cap the page cache of
the group is charged to it, so a dataset larger than what is left is read from the disk again every
epoch, whatever the machine's RAM.

Half, because the rest belongs to the processes themselves (torch, the model, batches in flight in
shared memory) and to other jobs. A loader over a dataset larger than this streams it
(``reader.loader``): each record's pages are dropped once read, so that the cache holds the blocks
read ahead, not the ones already consumed.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


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
