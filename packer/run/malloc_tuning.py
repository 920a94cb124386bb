"""glibc malloc settings for packing: large buffers reused from the heap instead of fresh mmaps.

Every raw record (150 KB at 224x224) is allocated and freed several times on its way to disk: decoded,
resized, encoded, copied into LMDB's dirty pages. By default glibc serves blocks over
128 KiB with a fresh ``mmap`` and returns them with ``munmap``, so every record costs dozens of page
faults and zeroed pages; measured here, that was most of the writer's LMDB ``put`` time. Raising the
mmap threshold and the trim threshold keeps such blocks on the heap for reuse. Set in every process
that packs partitions, when it starts; a no-op where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20


def reuse_large_allocations() -> None:
    """Serve allocations up to 32 MiB from the heap and keep up to 256 MiB of freed heap for reuse."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
