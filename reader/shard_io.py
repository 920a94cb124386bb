"""Positional reads of record payloads from shard files: coalesced runs, scattered into their buffers.

A batch asks for records scattered over one or more shards. Per shard, the records are sorted by file
offset (LMDB may lay a later record before an earlier one across commit boundaries, so index order is
not file order) and neighbours closer than ``max_gap`` bytes are merged into one run. Each run is one
``os.preadv`` whose iovecs put every record's bytes straight into its destination buffer, while the
bytes between records (LMDB page padding and B-tree pages) land in a throwaway scratch buffer.

File descriptors are opened lazily and belong to the process that opened them: after a ``fork`` the
child opens its own, and a pickled reader (``spawn``) carries only the paths.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reader.format import FormatError

IOV_MAX = os.sysconf("SC_IOV_MAX")
DEFAULT_MAX_GAP = 64 << 10


@dataclass(frozen=True)
class ReadRequest:
    """Records to read from one shard: file offsets, lengths, where each goes, and their global indices.

    ``destinations[k]`` is a writable buffer of exactly ``nbytes[k]`` bytes; ``records`` are used only
    to name a record in errors.
    """

    offsets: np.ndarray
    nbytes: np.ndarray
    destinations: list[memoryview]
    records: np.ndarray


class ShardFiles:
    """Read-only descriptors on a dataset's shard files, opened on first use in each process."""

    def __init__(self, paths: list[Path], max_gap: int = DEFAULT_MAX_GAP) -> None:
        self.paths = [Path(p) for p in paths]
        self.max_gap = max_gap
        self._pid: int | None = None
        self._fds: dict[int, int] = {}
        self._gap = memoryview(bytearray(0))

    def __getstate__(self) -> dict:
        return {"paths": self.paths, "max_gap": self.max_gap}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["paths"], state["max_gap"])

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Close this process's descriptors (descriptors inherited through ``fork`` are the child's own
        copies, so closing them never disturbs the parent)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def _fd(self, shard: int) -> int:
        pid = os.getpid()
        if self._pid != pid:
            self.close()
            self._pid = pid
            self._gap = memoryview(bytearray(self.max_gap))
        fd = self._fds.get(shard)
        if fd is None:
            path = self.paths[shard]
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise OSError(e.errno, f"cannot open shard file: {e.strerror}", str(path)) from None
            self._fds[shard] = fd
        return fd

    def read(self, shard: int, request: ReadRequest) -> None:
        """Fill every destination of ``request`` with its record's bytes from shard number ``shard``."""
        fd = self._fd(shard)
        order = np.argsort(request.offsets, kind="stable")
        offsets = request.offsets[order].tolist()
        nbytes = request.nbytes[order].tolist()
        records = request.records[order].tolist()
        destinations = [request.destinations[k] for k in order.tolist()]
        max_iovecs = IOV_MAX - 1
        iovecs: list[memoryview] = []
        run_records: list[tuple[int, int]] = []  # (global record index, its end relative to the run)
        run_start = position = 0
        for offset, size, record, destination in zip(offsets, nbytes, records, destinations):
            gap = offset - position
            if iovecs and (gap < 0 or gap > self.max_gap or len(iovecs) >= max_iovecs):
                self._read_run(shard, fd, iovecs, run_start, run_records)
                iovecs, run_records = [], []
            if not iovecs:
                run_start = position = offset
                gap = 0
            if gap:
                iovecs.append(self._gap[:gap])
            iovecs.append(destination)
            position = offset + size
            run_records.append((record, position - run_start))
        if iovecs:
            self._read_run(shard, fd, iovecs, run_start, run_records)

    def _read_run(
        self, shard: int, fd: int, iovecs: list[memoryview], start: int, records: list[tuple[int, int]]
    ) -> None:
        """One ``preadv`` for a whole run; continues after a partial read, fails on end of file."""
        total = records[-1][1]
        done = 0
        while done < total:
            try:
                n = os.preadv(fd, iovecs, start + done)
            except OSError as e:
                raise OSError(
                    e.errno, f"reading record {records[0][0]} and following failed: {e.strerror}",
                    str(self.paths[shard]),
                ) from None
            if n == 0:
                missing = next(record for record, end in records if end > done)
                raise FormatError(
                    f"{self.paths[shard]}: shard is truncated: record {missing} ends past the end of "
                    f"the file (file offset {start + done}); the file changed or is damaged"
                )
            done += n
            iovecs = _skip_bytes(iovecs, n)


def _skip_bytes(iovecs: list[memoryview], n: int) -> list[memoryview]:
    """The iovecs left once the first ``n`` bytes have been filled."""
    k = 0
    while k < len(iovecs) and n >= len(iovecs[k]):
        n -= len(iovecs[k])
        k += 1
    rest = iovecs[k:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest
