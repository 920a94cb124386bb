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
possible on those releases; upgrading CPython, or ``make_loader(..., multiprocessing_context=
"forkserver")`` with a main module that is safe to import, avoids it.
"""
from __future__ import annotations

import sys

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
    this process are now safe from that hang: True where the CPython has the fix or the guard is in,
    False where it lacks both (the extension not built)."""
    if sys.implementation.name != "cpython" or not forks_can_hang():
        return True
    return _fork_guard is not None and _fork_guard.install()
