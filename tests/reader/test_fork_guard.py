"""Forks from a process whose C threads keep entering the interpreter (as torch.distributed's backend
threads do under DDP) all complete once ``reader`` is imported, on the CPython releases whose forked
child can otherwise wait forever on the interpreter-list lock (``reader.fork_guard``); and so do forks
made by a C thread, which the guard's handler also runs in."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch.distributed as dist
from hostile_helpers import subprocess_env

from reader import PackedDataset, fork_guard, make_loader

FORKS = 600
# What both scripts start with: the guard (by importing reader), and the check of one child
PRELUDE = """
import ctypes, json, os, signal, sys, threading, time, tracemalloc
import reader
from reader.fork_guard import install
def stuck_child(child):
    \"\"\"1 (killed) when ``child`` has not exited within 5 s, else 0.\"\"\"
    deadline = time.monotonic() + 5
    while not os.waitpid(child, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            return 1
        time.sleep(0.002)
    return 0
"""
# Threads started by C (pthread_create through ctypes) that run a Python callback: each one creates its
# interpreter state under that lock, without the GIL. Without the guard, 13 of 2,000 such forks hung on
# CPython 3.11.7 here, so a test of 600 would miss a lost guard about one time in fifty; with it, none
# of 2,000 did.
FORK_WHILE_C_THREADS_ENTER = PRELUDE + """
libc = ctypes.CDLL(None)
@ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
def enter(_):
    return None
def keep_entering(stop):
    thread = ctypes.c_ulong()
    while not stop.is_set():
        libc.pthread_create(ctypes.byref(thread), None, enter, None)
        libc.pthread_join(thread, None)
stop = threading.Event()
for _ in range(8):
    threading.Thread(target=keep_entering, args=(stop,), daemon=True).start()
stuck = 0
for _ in range(int(sys.argv[1])):
    child = os.fork()
    if child == 0:
        os._exit(0)
    stuck += stuck_child(child)
stop.set()
print(json.dumps({"guarded": install(), "stuck": stuck}))
"""

# fork() called by a C thread (pthread_create with fork as its start routine: as a C++ library's
# system() does) while tracemalloc traces the allocations and a Python thread runs: the guard's new lock
# must not come through tracemalloc's allocator, which takes a GIL that no thread of the child holds
# (9 of 20 such children hung when it did)
C_THREAD_FORKS_WHILE_TRACING = PRELUDE + """
tracemalloc.start()
stop = threading.Event()
def spin():
    while not stop.is_set():
        pass
threading.Thread(target=spin, daemon=True).start()
libc = ctypes.CDLL(None)
fork = ctypes.cast(libc.fork, ctypes.c_void_p)
stuck = 0
for _ in range(int(sys.argv[1])):
    thread, child = ctypes.c_ulong(), ctypes.c_void_p()
    libc.pthread_create(ctypes.byref(thread), None, fork, None)
    libc.pthread_join(thread, ctypes.byref(child))  # the child's only thread returns: it exits
    stuck += stuck_child(child.value)
stop.set()
print(json.dumps({"guarded": install(), "stuck": stuck}))
"""


@pytest.mark.parametrize("version, hangs", [
    ((3, 10, 12), True), ((3, 10, 15), False), ((3, 11, 7), True), ((3, 11, 9), True), ((3, 11, 10), False),
    ((3, 12, 0), False), ((3, 13, 5), False),
])
def test_the_releases_whose_forks_can_hang(version, hangs):
    assert fork_guard.forks_can_hang(version) is hangs


@pytest.mark.parametrize("script, forks", [(FORK_WHILE_C_THREADS_ENTER, FORKS), (C_THREAD_FORKS_WHILE_TRACING, 20)],
                         ids=["c-threads-enter", "c-thread-forks-while-tracing"])
def test_forks_complete(script, forks):
    if fork_guard.forks_can_hang() and fork_guard._fork_guard is None:
        pytest.skip("reader._fork_guard is not built here (no C compiler)")
    run = subprocess.run([sys.executable, "-c", script, str(forks)], capture_output=True, text=True, timeout=240,
                         env=subprocess_env())
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"guarded": True, "stuck": 0}


@pytest.mark.parametrize("context, ddp, warned", [
    (None, True, True), ("forkserver", True, False), (None, False, False),
])
def test_a_rank_about_to_fork_unguarded_is_told_the_remedies(raw_path, tmp_path, monkeypatch, context, ddp, warned):
    """Where the guard is missing on a CPython whose forks can hang, a DDP rank's loader that forks its
    workers warns, naming the extension and the ways out; one that starts them otherwise, or a process
    without DDP, does not."""
    monkeypatch.setattr(fork_guard, "_fork_guard", None)
    monkeypatch.setattr(fork_guard, "forks_can_hang", lambda: True)
    if ddp:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            make_loader(PackedDataset(raw_path), 4, num_workers=1, multiprocessing_context=context)
    finally:
        if ddp:
            dist.destroy_process_group()
    about_forks = [w for w in seen if issubclass(w.category, RuntimeWarning) and "_fork_guard" in str(w.message)]
    assert len(about_forks) == warned
    if warned:
        message = str(about_forks[0].message)
        assert "python/cpython#112275" in message and "reader._fork_guard, which prevents it, is not built" in message
        assert "3.11.10" in message and 'multiprocessing_context="forkserver"' in message
        assert about_forks[0].filename == __file__, "the warning points at the make_loader call"
