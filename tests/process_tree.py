"""A test's child processes and all of theirs, found and killed through ``/proc``: launchers such as
torchrun start each rank in a session of its own, out of reach of a kill of the test's process group."""
from __future__ import annotations

import os
import signal
from pathlib import Path


def children_of(pid: int) -> list[int]:
    """The child processes of ``pid``, whichever of its threads started them, from ``/proc``."""
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            children += [int(child) for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return children


def descendants_of(pid: int) -> list[int]:
    """Every process below ``pid``: its children, theirs, and so on."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children_of(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. The tree is stopped first (SIGSTOP), walked again
    until no new process appears, then killed, so that none starts a child between the walk and the
    kill, nor is re-parented out of reach when its parent dies first."""
    stopped: set[int] = set()
    try:
        while True:
            new = {pid, *descendants_of(pid)} - stopped
            if not new:
                break
            for process in new:
                _signal(process, signal.SIGSTOP)
            stopped |= new
    finally:  # none left stopped for good, whatever the walk met
        for process in stopped:
            _signal(process, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    """Send ``signum`` to ``pid`` where it can be: a process gone, or one not this test's to signal, is
    left alone."""
    try:
        os.kill(pid, signum)
    except OSError:
        pass
