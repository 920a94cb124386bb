"""Records the page cache already holds, copied from a read-only mapping of the shard file.

Why: on a warm page cache a ``preadv`` spends most of its time in the kernel walking the page cache
4 KiB at a time, while a ``memcpy`` from a mapping whose page tables are already filled runs at memory
bandwidth. Raw 224x224 records per second, measured on two of the VMs this was written on: ``preadv``
28,000 against 60,000 per core on one; 52,000 against 64,000-68,000 on one core and 86,000 against
94,000 for two processes on the other. The mapping is made once per process and shard; its page tables
fill on the first epoch and stay. The mapping is only read where ``mincore`` says the run's last page is
resident (read-ahead fills a block's pages in file order) and the file still reaches the run's end
(checked once per batch), so a cold read takes the ``preadv`` path, with its block read-ahead, instead
of faulting its pages in one by one, and a shard truncated before the batch gets the usual error
instead of ``SIGBUS``.
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
        """Whether bytes ``[start, end)`` lie in the mapping and their last page is in memory.

        One ``mincore`` of one page: the call, not the pages, is what costs here (2-3 us, a sixth of
        copying a 150 KB record), and asking for every page would cost a quarter of the copy. The last
        page stands for the run because read-ahead fills a block's pages in file order; a run cached
        only in part is rare, and then faults in what is missing."""
        if end > len(self.bytes) or start >= end:
            return False
        last = (end - 1) - (end - 1) % PAGE
        return _libc.mincore(self.address + last, PAGE, self._pages_address) == 0 and bool(self._pages[0] & 1)

    def copy(self, start: int, destinations: list[memoryview]) -> int:
        """Copy consecutive bytes from ``start`` into each destination in turn; the bytes copied."""
        position = start
        for destination in destinations:
            n = len(destination)
            np.frombuffer(destination, np.uint8)[:] = self.bytes[position:position + n]
            position += n
        return position - start
