"""The page cache budget: half of RAM, or of the memory cgroup's limit where one caps this process; the
memory free for the page cache now: the limit less what reclaim cannot take back; and, from both, whether
a loader's dataset streams, with the ranks sharing a node counted.

The parsing is checked on cgroup v1 and v2 trees written here; the real limit, where this machine lets
a test create a memory cgroup (root, cgroup v1 or v2 mounted writable), on a real process put in one.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_helpers import subprocess_env
from reader_helpers import make_images, memory_cgroup, pack_images

from reader.memory_budget import (
    FORKED_WORKER_BYTES,
    KEEP_SHARE,
    STARTED_WORKER_BYTES,
    cgroup_memory_limit,
    measure_free_memory,
    page_cache_budget,
    worker_bytes,
)
from reader.torch_hooks import worker_start_method

TIMEOUT_S = 60
NO_LIMIT_V1 = 9223372036854771712


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v1_takes_the_hierarchical_limit(tmp_path):
    write(tmp_path / "proc", "4:memory:/job/step\n3:cpuset:/\n0::/\n")
    write(tmp_path / "cg/memory/job/step/memory.stat", f"cache 5\nhierarchical_memory_limit {3 << 30}\nrss 7\n")
    assert cgroup_memory_limit(tmp_path / "proc", tmp_path / "cg") == 3 << 30
    write(tmp_path / "cg/memory/job/step/memory.stat", f"hierarchical_memory_limit {NO_LIMIT_V1}\n")
    assert cgroup_memory_limit(tmp_path / "proc", tmp_path / "cg") is None


def test_v2_takes_the_tightest_limit_up_the_tree(tmp_path):
    write(tmp_path / "proc", "0::/pod/container\n")
    write(tmp_path / "cg/pod/container/memory.max", "max\n")
    write(tmp_path / "cg/pod/memory.max", f"{2 << 30}\n")
    write(tmp_path / "cg/memory.max", f"{8 << 30}\n")
    assert cgroup_memory_limit(tmp_path / "proc", tmp_path / "cg") == 2 << 30
    write(tmp_path / "proc", "0::/\n")  # a container's own namespace: its limit is at the root
    assert cgroup_memory_limit(tmp_path / "proc", tmp_path / "cg") == 8 << 30


def test_free_memory_is_the_limit_less_what_reclaim_cannot_take(tmp_path):
    """All a group is charged for but its file cache counts as held (shared memory stays held, and mapped
    files where asked), at every level with a limit: a job's limit also covers its other tasks' groups."""
    meminfo = tmp_path / "meminfo"
    write(meminfo, f"MemTotal: {64 << 20} kB\nMemAvailable: {48 << 20} kB\n")  # 48 GiB available
    write(tmp_path / "proc", "4:memory:/job/task\n0::/\n")  # v1
    write(tmp_path / "cg/memory/job/task/memory.usage_in_bytes", f"{1200 << 20}\n")
    write(tmp_path / "cg/memory/job/task/memory.stat",
          f"cache {1}\nhierarchical_memory_limit {3 << 30}\ntotal_cache {500 << 20}\ntotal_shmem {300 << 20}\n")
    write(tmp_path / "cg/memory/job/memory.usage_in_bytes", f"{2500 << 20}\n")  # the job's other tasks
    write(tmp_path / "cg/memory/job/memory.stat",
          f"hierarchical_memory_limit {3 << 30}\ntotal_cache {600 << 20}\ntotal_shmem {300 << 20}\n")
    write(tmp_path / "cg/memory/memory.stat", f"hierarchical_memory_limit {NO_LIMIT_V1}\n")
    # the task holds 1200 - 500 + 300 = 1000 MiB, the job 2200 MiB: the job's term is the least
    assert measure_free_memory(tmp_path / "proc", tmp_path / "cg", meminfo).total == (3 << 30) - (2200 << 20)
    # beyond the mapped files: those beyond the shared memory (mapped too) count as held, the job's 100 MiB
    write(tmp_path / "cg/memory/job/memory.stat", f"hierarchical_memory_limit {3 << 30}\ntotal_cache {600 << 20}\n"
                                                  f"total_shmem {300 << 20}\ntotal_mapped_file {400 << 20}\n")
    assert measure_free_memory(tmp_path / "proc", tmp_path / "cg", meminfo).total == (3 << 30) - (2200 << 20)
    assert measure_free_memory(tmp_path / "proc", tmp_path / "cg", meminfo) == ((3 << 30) - (2200 << 20),
                                                                               (3 << 30) - (2300 << 20))
    write(tmp_path / "cg/memory/job/memory.stat", f"hierarchical_memory_limit {3 << 30}\ntotal_cache {600 << 20}\n"
                                                  f"total_shmem {300 << 20}\ntotal_mapped_file {200 << 20}\n")
    assert measure_free_memory(tmp_path / "proc", tmp_path / "cg", meminfo).beyond_mapped == (3 << 30) - (2200 << 20)
    write(tmp_path / "proc", "0::/pod/container\n")  # v2
    write(tmp_path / "cg/pod/container/memory.max", "max\n")
    write(tmp_path / "cg/pod/container/memory.current", f"{6 << 30}\n")
    write(tmp_path / "cg/pod/container/memory.stat", f"anon {5 << 30}\nfile {1 << 30}\nshmem 0\n")
    write(tmp_path / "cg/pod/memory.max", f"{8 << 30}\n")
    write(tmp_path / "cg/pod/memory.current", f"{7 << 30}\n")  # 1 GiB file cache of which 512 MiB shared memory
    write(tmp_path / "cg/pod/memory.stat", f"anon {5 << 30}\nkernel {1 << 29}\nfile {1 << 30}\nshmem {1 << 29}\n")
    assert measure_free_memory(tmp_path / "proc", tmp_path / "cg", meminfo).total == (8 << 30) - (6 << 30) - (1 << 29)
    write(tmp_path / "cg/pod/memory.stat", f"anon {5 << 30}\nkernel {1 << 29}\nfile {1 << 30}\nshmem {1 << 29}\n"
                                           f"file_mapped {3 << 28}\n")  # 768 MiB mapped: 256 MiB beyond shmem
    assert measure_free_memory(tmp_path / "proc", tmp_path / "cg", meminfo).total == (8 << 30) - (6 << 30) - (1 << 29)
    held = (6 << 30) + (3 << 28)  # memory.current less file, plus shmem, plus the 256 MiB mapped beyond it
    assert measure_free_memory(tmp_path / "proc", tmp_path / "cg", meminfo).beyond_mapped == (8 << 30) - held
    write(tmp_path / "cg/pod/memory.max", "max\n")  # no limit: the machine's available memory, for both
    assert measure_free_memory(tmp_path / "proc", tmp_path / "cg", meminfo) == (48 << 30, 48 << 30)
    write(tmp_path / "cg/pod/memory.max", f"{4 << 30}\n")  # over the limit: nothing free, never negative
    assert measure_free_memory(tmp_path / "proc", tmp_path / "cg", meminfo) == (0, 0)
    assert measure_free_memory(tmp_path / "proc", tmp_path / "cg", meminfo).total == 0


def test_no_cgroup_means_half_the_ram(tmp_path):
    assert cgroup_memory_limit(tmp_path / "absent", tmp_path) is None
    write(tmp_path / "proc", "0::/\n")
    assert cgroup_memory_limit(tmp_path / "proc", tmp_path / "empty") is None
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert page_cache_budget() <= ram // 2


def test_a_process_under_a_real_memory_limit_budgets_half_of_it():
    limit = 300 << 20
    group = memory_cgroup(limit)
    try:
        code = "from reader.memory_budget import page_cache_budget; print(page_cache_budget())"
        move_in = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        done = subprocess.run(["sh", "-c", move_in, "sh", sys.executable, "-c", code],
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=subprocess_env())
        assert done.returncode == 0, done.stderr
        assert int(done.stdout) == limit // 2
    finally:
        group.rmdir()


def test_shared_memory_held_under_a_real_limit_is_not_free(tmp_path):
    """A process in a real memory cgroup (1 GiB): its free memory is the limit less its own; 128 MiB of
    file cache it writes to a disk does not come off it, and 64 MiB of shared memory it writes (as batch
    slots are) does. Beyond the mapped files, the file once mapped and read comes off too, and the
    shared memory (mapped as well) only once."""
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout
    if kind.strip() == "tmpfs":
        pytest.skip("the test's files would be shared memory here (tmpfs): it needs a disk")
    limit = 1 << 30
    group = memory_cgroup(limit)
    code = """
import mmap, os, sys, torch
from reader.memory_budget import measure_free_memory
before = measure_free_memory()
with open(sys.argv[1], "wb") as f:
    f.write(bytes(128 << 20))
    f.flush()
    os.fsync(f.fileno())
cached = measure_free_memory()
slot = torch.empty(64 << 20, dtype=torch.uint8).share_memory_()
slot.fill_(1)
slotted = measure_free_memory()
with open(sys.argv[1], "rb") as f:
    view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    sum(view[i] for i in range(0, len(view), mmap.PAGESIZE))  # every page mapped in
    mapped = measure_free_memory()
print(*before, *cached, *slotted, *mapped)
"""
    try:
        move_in = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        done = subprocess.run(["sh", "-c", move_in, "sh", sys.executable, "-c", code, str(tmp_path / "cache")],
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=subprocess_env())
        assert done.returncode == 0, done.stderr
        before, _, cached, cached_beyond, after, after_beyond, mapped, mapped_beyond = map(int, done.stdout.split())
        assert limit - (600 << 20) < before < limit  # torch's own memory held, well under the limit
        assert abs(before - cached) < (16 << 20)  # file cache is not held: reclaim can take it back
        assert (56 << 20) < cached - after < (90 << 20)  # the cgroup's counters lag by a few pages a core
        assert abs((after - after_beyond) - (cached - cached_beyond)) < (16 << 20)  # the slot counted once
        assert abs(mapped - after) < (16 << 20)  # mapping cached pages holds nothing more
        assert (112 << 20) < (mapped - mapped_beyond) - (after - after_beyond) < (144 << 20)  # the file mapped
    finally:
        group.rmdir()


def test_ranks_on_a_node_stream_a_dataset_that_one_rank_keeps_under_a_real_limit(tmp_path):
    """A process in a real memory cgroup (1 GiB) makes a loader over 16 MB of records (batches of 64 raw
    records of 128x128: 3 MB), far under half the limit: alone it keeps the dataset in the page cache;
    told that 64 ranks share the node (``LOCAL_WORLD_SIZE``), it streams it, since their loaders'
    batch slots and workers leave the page cache less than the dataset."""
    records = 320
    path = pack_images(tmp_path / "packed", make_images(4, [(128, 128)]) * (records // 4), [0] * records,
                       storage="lmdb", encoding="raw", records_per_shard=records).path
    group = memory_cgroup(1 << 30)
    code = """
import os, sys, warnings
from reader import PackedDataset, make_loader
from reader.memory_budget import measure_free_memory
warnings.simplefilter("ignore")  # 64 ranks get no room to read ahead, and are told so
os.environ.pop("LOCAL_WORLD_SIZE", None)  # alone, even where the suite runs under torchrun
ds = PackedDataset(sys.argv[1])
alone = make_loader(ds, 64, num_workers=2, pin_memory=False, multiprocessing_context="fork").view.streaming
os.environ["LOCAL_WORLD_SIZE"] = "64"
shared = make_loader(ds, 64, num_workers=2, pin_memory=False, multiprocessing_context="fork").view.streaming
print(alone, shared, measure_free_memory().total)
"""
    try:
        move_in = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        done = subprocess.run(["sh", "-c", move_in, "sh", sys.executable, "-c", code, str(path)],
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=subprocess_env())
        assert done.returncode == 0, done.stderr
        alone, shared, free = done.stdout.split()
        assert (alone, shared) == ("False", "True")
        slot = 64 * 3 * 128 * 128  # a batch: one size, so slots have no headroom
        assert 16 << 20 < (int(free) - (2 * 4 * slot + 2 * FORKED_WORKER_BYTES)) * KEEP_SHARE  # room for one rank
        assert int(free) < 64 * 2 * 4 * slot  # 64 ranks' slots alone take more than is free
    finally:
        group.rmdir()


def test_a_worker_s_own_memory_follows_how_it_starts(tmp_path):
    """Spawned and forkserver workers import torch each, so count more than forked ones; asking how a
    loader's workers start, or making one, leaves the default start method unset, so that the
    program may still set it."""
    assert worker_bytes(worker_start_method("fork")) == FORKED_WORKER_BYTES
    assert worker_bytes(worker_start_method(multiprocessing.get_context("spawn"))) == STARTED_WORKER_BYTES
    assert worker_bytes("forkserver") == STARTED_WORKER_BYTES
    code = """
import multiprocessing, sys
import torch
from reader import PackedDataset, make_loader
from reader.torch_hooks import worker_start_method
asked = worker_start_method(None)
make_loader(PackedDataset(sys.argv[1]), 2, num_workers=2)
print(asked in multiprocessing.get_all_start_methods(), multiprocessing.get_start_method(allow_none=True))
"""
    path = pack_images(tmp_path / "packed", make_images(4, [(8, 8)]), [0] * 4,
                       storage="lmdb", encoding="raw", records_per_shard=4).path
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=subprocess_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "None"]
