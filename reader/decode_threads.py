"""``DecodeThreads``: a batch's JPEG decodes spread over threads of the process that reads it.

Why: with a decoder that releases the GIL (``reader.format.jpeg_decode.releases_gil``), threads of one process
decode in parallel straight into the rows of one batch buffer, so one DataLoader worker can use
several cores without another process, another batch in flight, or another copy. The pool starts on
first use in each process (threads do not survive ``fork``), and the calling thread decodes its share
too.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from reader.arguments import whole_number


class DecodeThreads:
    """Calls ``decode(k)`` for every ``k < count`` on ``threads`` threads; 1 runs them in the caller."""

    def __init__(self, threads: int) -> None:
        self.threads = whole_number("decode_threads", threads, 1)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid: int | None = None

    def run(self, decode: Callable[[int], None], count: int) -> None:
        """Decode all ``count`` items, the k-th thread taking items k, k + threads, ...; the first
        exception raised by any decode is raised here once every thread has finished."""
        threads = min(self.threads, count)
        if threads <= 1:
            for k in range(count):
                decode(k)
            return
        pool = self._started()
        futures = [pool.submit(_each, decode, range(t, count, threads)) for t in range(1, threads)]
        try:
            _each(decode, range(0, count, threads))
        finally:
            for future in futures:
                future.exception()
        for future in futures:
            future.result()

    def _started(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="jpeg-decode")
            self._pool_pid = os.getpid()
        return self._pool


def _each(decode: Callable[[int], None], items: range) -> None:
    for k in items:
        decode(k)
