"""Records the page cache already holds, copied from a read-only mapping of the shard file.

Why: on a warm page cache a ``preadv`` spends most of its time in the kernel walking the page cache
4 KiB at a time (measured here: 86% system time, about 28,000 raw 224x224 records per core-second);
a ``memcpy`` from a mapping whose page tables are already filled runs at memory bandwidth (about
60,000 per core-second). The mapping is made once per process and shard; its page tables fill on
the first epoch and stay. The mapping is only read where ``mincore`` says every page of the run is
resident and the file still reaches the run's end (checked once per batch), so a cold read never
blocks in a page fault (it takes the ``preadv`` path, with its block read-ahead) and a shard
truncated before the batch gets the usual error instead of ``SIGBUS``.
"""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


class MappedFile:
    """A read-only mapping of one shard file, as it was when mapped."""

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        self.bytes = np.frombuffer(mmap.mmap(fd, size, prot=mmap.PROT_READ), np.uint8) if size else \
            np.zeros(0, np.uint8)
        self.address = self.bytes.ctypes.data
        self._pages = np.zeros(1, np.uint8)
        self._pages_address = self._pages.ctypes.data

    def resident(self, start: int, end: int) -> bool:
        """Whether bytes ``[start, end)`` lie in the mapping and their first and last pages are in
        memory (one ``mincore`` over both ends: asking for every page of a 150 KB record costs a
        quarter of its copy; a run cached only in part is rare, and then faults in what is missing)."""
        if end > len(self.bytes) or start >= end:
            return False
        first, last = start - start % PAGE, (end - 1) - (end - 1) % PAGE
        pages, address = self._pages, self._pages_address
        if _libc.mincore(self.address + first, PAGE, address) != 0 or not pages[0] & 1:
            return False
        return last == first or (_libc.mincore(self.address + last, PAGE, address) == 0
                                 and bool(pages[0] & 1))

    def copy(self, start: int, destinations: list[memoryview]) -> int:
        """Copy consecutive bytes from ``start`` into each destination in turn; the bytes copied."""
        position = start
        for destination in destinations:
            n = len(destination)
            np.frombuffer(destination, np.uint8)[:] = self.bytes[position:position + n]
            position += n
        return position - start
