"""Records the page cache already holds, copied from a read-only mapping of the shard file.

Why: on a warm page cache a ``preadv`` spends most of its time in the kernel walking the page cache
4 KiB at a time, while a ``memcpy`` from a mapping whose page tables are already filled runs at memory
bandwidth. Raw 224x224 records per second, measured on two of the VMs this was written on: ``preadv``
28,000 against 60,000 per core on one; 52,000 against 64,000-68,000 on one core and 86,000 against
94,000 for two processes on the other. The mapping is made once per process and shard, for datasets
small enough to stay mapped whole (``reader.shard_io``); its page tables fill on the first epoch.
The mapping is only read where ``mincore`` says the run's last page is resident (read-ahead fills a
block's pages in file order), so a cold read takes the ``preadv`` path, with its block read-ahead,
instead of faulting its pages in one by one.

A file rewritten in place (``cp``, ``rsync --inplace``) can shrink between any check and the copy, and
touching a mapped page past a file's end raises ``SIGBUS``. So the copy is the C extension
``reader._guarded_copy``, which catches that fault on its own source range and returns short; the
caller reports the changed file. Where the extension is not built (no C compiler at install),
``GUARDED`` is False and the reader never maps a shard: every record is read with ``preadv``.
"""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

try:
    from reader._guarded_copy import copy as _guarded_copy
except ImportError:  # built without a C compiler: preadv only
    _guarded_copy = None

GUARDED = _guarded_copy is not None
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


class MappedFile:
    """A read-only mapping of one shard file, as large as the file was when mapped; ``close()``
    unmaps it (the pages leave the process's RSS; the page cache keeps them)."""

    def __init__(self, fd: int) -> None:
        self.size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, self.size, prot=mmap.PROT_READ) if self.size else None
        self._view = np.frombuffer(self._map, np.uint8) if self._map is not None else np.zeros(0, np.uint8)
        self.address = self._view.ctypes.data
        self._pages = np.zeros(1, np.uint8)
        self._pages_address = self._pages.ctypes.data

    def close(self) -> None:
        self._view = np.zeros(0, np.uint8)
        self.size = 0
        if self._map is not None:
            self._map.close()
            self._map = None

    def resident(self, start: int, end: int) -> bool:
        """Whether bytes ``[start, end)`` lie in the mapping and their last page is in memory.

        One ``mincore`` of one page: the call, not the pages, is what costs here (2-3 us, a sixth of
        copying a 150 KB record), and asking for every page would cost a quarter of the copy. The last
        page stands for the run because read-ahead fills a block's pages in file order; a run cached
        only in part is rare, and then faults in what is missing."""
        if end > self.size or start >= end:
            return False
        last = (end - 1) - (end - 1) % PAGE
        return _libc.mincore(self.address + last, PAGE, self._pages_address) == 0 and bool(self._pages[0] & 1)

    def copy(self, start: int, destinations: list[memoryview]) -> int:
        """Copy consecutive bytes from ``start`` into each destination in turn; the bytes copied, fewer
        than the destinations hold when the file shrank under the copy (only whole destinations count)."""
        assert _guarded_copy is not None, "MappedFile is only used with reader._guarded_copy built"
        return _guarded_copy(self.address + start, self.size - start, destinations)
