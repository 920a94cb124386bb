"""Forked DataLoader workers that cannot hang at their start on the CPython releases where a fork can.

CPython before 3.10.15 and 3.11.10 (3.12 has the fix) takes an interpreter lock in the child of
``os.fork()`` before resetting it (python/cpython#112275). Where another thread of the parent held
that lock at the fork, the child waits for it forever, before it runs a line of Python. A thread holds
it without the GIL when it enters the interpreter from C++: under DDP, torch.distributed's backend
threads do so to free tensors that Python dropped while a collective still held them, as
``all_gather_object`` leaves them (the sampler's seed check and the node's streaming decision, just
before the loader forks its workers; Lightning's broadcasts). Seen with Lightning over gloo on 3.11.7:
two DDP test jobs in 52 hung at an epoch's start, a new loader's worker stuck in
``PyOS_AfterFork_Child`` and its rank waiting for the first batch.

``install()`` (run when ``reader`` is imported) registers the child-side reset of that lock that the
fixed releases make, from the C extension ``reader._fork_guard``, for every later fork of the process:
the reader's workers, and any other library's. Workers stay forked (no forkserver, which would start
slower and import the training script once more). Where the extension is not built the hang stays
possible on those releases, and ``make_loader`` says so to a DDP rank about to fork its workers
(``warn_where_unguarded``): upgrading CPython, or ``make_loader(..., multiprocessing_context=
"forkserver")`` with a main module that is safe to import, avoids it.
"""
from __future__ import annotations

import sys
import warnings

try:
    from reader import _fork_guard
except ImportError:  # no C compiler at install time (setup.py)
    _fork_guard = None  # type: ignore[assignment]

# the first release of each affected minor version that resets the lock in the child itself
FORK_FIXED_IN: dict[tuple[int, int], tuple[int, int, int]] = {(3, 10): (3, 10, 15), (3, 11): (3, 11, 10)}


def forks_can_hang(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether a child of ``os.fork()`` on CPython ``version`` can wait forever on the interpreter lock
    that a thread of its parent held at the fork (``FORK_FIXED_IN``)."""
    fixed = FORK_FIXED_IN.get((version[0], version[1]))
    return fixed is not None and tuple(version[:3]) < fixed


def install() -> bool:
    """Guard every later fork of this process where this CPython needs it (once); whether forks from
    this process are now safe from that hang: True where the CPython has the fix (or the interpreter is
    not CPython) or the guard is in, False where it lacks both (the extension not built)."""
    if sys.implementation.name != "cpython" or not forks_can_hang():
        return True
    return _fork_guard is not None and _fork_guard.install()


def warn_where_unguarded(start_method: str) -> None:
    """A ``RuntimeWarning`` naming the remedies where a DDP rank is about to fork its workers
    (``start_method`` "fork") on a CPython whose forks can hang, without the guard (the extension not
    built): the hang is rare, and silent when it comes."""
    import torch.distributed as dist  # here: importing reader (which installs the guard) needs no torch

    if start_method != "fork" or install() or not (dist.is_available() and dist.is_initialized()):
        return
    version = ".".join(map(str, sys.version_info[:3]))
    warnings.warn(
        f"this DDP rank forks its DataLoader workers on CPython {version}, where a forked worker can hang "
        "at its start (python/cpython#112275), and reader._fork_guard, which prevents it, is not built "
        "(no C compiler at install): upgrade CPython (3.10.15, 3.11.10 or later), reinstall with a C "
        "compiler, or pass multiprocessing_context=\"forkserver\" from a script with an "
        "if __name__ == \"__main__\": guard", RuntimeWarning, stacklevel=3)
