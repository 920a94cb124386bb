"""Positional reads of record payloads from shard files: coalesced runs, scattered into their buffers.

A batch asks for records scattered over one or more shards. Per shard, the records are sorted by file
offset (LMDB may lay a later record before an earlier one across commit boundaries, so index order is
not file order) and neighbours closer than ``max_gap`` bytes are merged into one run. Each run is one
``os.preadv`` whose iovecs put every record's bytes straight into its destination buffer, while the
bytes between records (LMDB page padding and B-tree pages) land in a throwaway scratch buffer.

Block read-ahead, for slow disks (HDD, NFS): a quasi-random batch takes a few records from each of ~16
blocks of the files, so reading only those records costs one disk seek per ~16 records. Given the files'
block boundaries, a batch first reads its runs in file order without waiting for the disk: a run whose
pages are resident is copied from a read-only mapping of the shard (``reader.mapped_copy``), any other
with a non-blocking ``preadv`` (``RWF_NOWAIT``). At the first run that is not all in the page cache, it
asks the kernel for the *whole* blocks that run and every later one fall in
(``posix_fadvise(WILLNEED)``: asynchronous, no copy; already cached pages cost a lookup), then reads
them, so the disk sees long sequential reads and the next batches drawing from the same blocks find them
cached. The probing stops at the first miss because a non-blocking read that misses still starts a small
read-ahead of its own: probing every run of a cold batch would put one small disk request per record in
front of the big ones. A batch already in the page cache asks for no read-ahead.

Advice ahead of time: a worker that misses has nothing to decode until its blocks arrive, and the
disk idles while the workers decode what arrived. ``ShardFiles.advise`` lets the process that knows
the order (the loader's main process, ``reader.batch_stream``) advise the blocks of batches still
ahead through the same code path (same scattered-batch rule, same lock), so the disk reads the next
window of blocks while the workers decode the current one; when the workers get there, their own
advice finds the pages present or in flight and costs lookups. It remembers the blocks it advised
before, so the many batches drawing from one window advise each block once, and an epoch over a
dataset that the page cache holds advises nothing.

Streaming, for a dataset larger than the page cache can keep (``reader.memory_budget``; the loader
decides, ``reader.loader``): every epoch reads it from the disk again, and the pages of records already
read crowd out the blocks read ahead. Under a memory cgroup the kernel then cuts read-ahead short
(its allocations give up rather than reclaim) and evicts advised blocks before they are read: measured
on a 1.2 GB set under a 1000 MB cap, 1.8x the payload's bytes in IOs of 220-400 KiB, about 2x the
disk's time. So the pages of what was read are dropped (``POSIX_FADV_DONTNEED``: each record is read
once an epoch), and the reading ahead is the main process's, which advises each block once a pass
(clearing it first). A worker still advises the blocks of a batch it misses in, as on any cold read,
never clearing them: where the main process's advice got there first that costs page lookups, and
where the kernel evicted advised pages before they were read (memory the job took since: a model,
CUDA, a checkpoint's pages), the block is read whole again instead of record by record at the disk's
IOPS. Measured on the 1.4 GB JPEG set under a 1,500 MB cap, its reader taking 600 MB after its first
batch (``scripts/bench_cold.py --grow``): 891 img/s with the workers reading only their records, 3,023
with their advice. Who drops what:

- A batch gathered in a few blocks (quasi-random order): the main process drops each whole block once
  every batch reading it is received, and keeps a block the next pass advises while this one still reads
  it (``reader.streamed_blocks`` says why and how it knows).
- A batch scattered over many blocks (random order), which nobody advises: the worker that read it drops
  its records (``drop_behind``), except small ones (``DROP_MIN_RECORD_BYTES``). Measured on Linux 6.18,
  when workers dropped the records of every batch: a 1.4 GB set of 15 KB JPEGs under a 1,500 MB cap read
  at 680-700 img/s with the drops (the disk at its 200 IOPS in IOs of about 100 KB, both cores half in
  the kernel, the workers in uninterruptible waits), 3,060 img/s without them; the 1.2 GB raw set of
  150 KB records under a 1,000 MB cap: 587-593 img/s with its drops, 521 without. The likely cause: the
  kernel caches read-ahead in large folios of many pages (ext4 since Linux 6.16), and dropping the few
  pages inside a small record splits one, under its lock, while the advice reading the next blocks
  waits for it. A whole block's drop frees whole folios.

File descriptors are opened lazily and belong to the process that opened them: after a ``fork`` the
child opens its own (a ``spawn`` worker opens the dataset again: ``PackedDataset.__getstate__``).
The shard files' identities (``reader.format.FileIdentity``) are recorded when the dataset is opened.
Every open checks that the file is still that version, and every read of a shard an ``fstat`` of its
descriptor (about a microsecond), so a shard replaced or rewritten under a running job raises
``FormatError`` instead of serving other records against the old record table.

Bounded handles: a process keeps at most ``MAX_OPEN_SHARDS`` shards of a dataset open (the least
recently used one is closed first), whatever the dataset's shard count, so an epoch fits a cluster's
``ulimit -n`` of 256 or 1024 with room to spare; reopening a shard costs an ``open`` and an ``fstat``.
Warm records are copied from mappings (``reader.mapped_copy``) only for a dataset that a process can
keep mapped whole: at most ``MAX_OPEN_SHARDS`` shards and ``MAX_MAPPED_BYTES`` bytes. Such a dataset
never has a shard closed, its page tables stay filled across epochs, and the process's RSS, which
counts the mapped pages it touched, stays under that size. A larger dataset is read with ``preadv``
alone: one descriptor per open shard, nothing mapped, RSS unaffected by the dataset. Mapping shards in
turn would not pay: a fresh mapping faults its pages in again, and measured here, remapping a 435 MB
dataset's shards under a 128 MiB budget copied 26,800-28,100 records per CPU-second against
35,100-36,600 for ``preadv`` (raw 224x224, random batches of 256, one process).
"""
from __future__ import annotations

import errno
import fcntl
import os
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Iterator

import numpy as np

from reader.format import FileIdentity, FormatError
from reader.format.shard_files import check_identity, open_checked
from reader.mapped_copy import GUARDED, MappedFile
from reader.streamed_blocks import StreamedBlocks, StreamPosition

IOV_MAX = os.sysconf("SC_IOV_MAX")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
DEFAULT_MAX_GAP = 64 << 10
# A batch whose uncached runs touch more blocks than this is scattered (random order): reading whole
# blocks would fetch far more than it needs, so it reads only its records. Quasi-random batches touch
# one window of blocks (16 by default), or two where a batch straddles windows.
MAX_READAHEAD_BLOCKS = 32
# One WILLNEED reads at most max(read-ahead, largest request) of the device (mm/readahead.c), so
# blocks are advised in pieces no longer than that; this is used where sysfs does not tell.
FALLBACK_ADVICE_BYTES = 512 << 10
MAX_ADVICE_BYTES = 2 << 20
# A streaming worker drops the records of a scattered batch it read only when they are this long or
# longer, on average over a shard's part of the batch (module doc, "Streaming").
DROP_MIN_RECORD_BYTES = 64 << 10
# Per dataset and process: shards open at once (each one descriptor, two while mapped: Python's mmap
# keeps a dup), at least a quasi-random window's (16 blocks, so at most 16 shards); and the largest
# dataset that is copied from mappings (the bound on the RSS that mapped pages add).
MAX_OPEN_SHARDS = 32
MAX_MAPPED_BYTES = 1 << 30


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


class _Run:
    """Neighbouring records read by one ``preadv``: file offset, iovecs, and how much is done."""

    __slots__ = ("start", "iovecs", "ends", "total", "done")

    def __init__(self, start: int) -> None:
        self.start = start
        self.iovecs: list[memoryview] = []
        self.ends: list[tuple[int, int]] = []  # (global record, its end relative to the run)
        self.total = 0
        self.done = 0

    def advance(self, n: int) -> None:
        self.done += n
        if self.done < self.total:
            self.iovecs = _skip_bytes(self.iovecs, n)


class _OpenShard:
    """One open shard of this process: its descriptor and, once warm records were copied, its mapping."""

    __slots__ = ("fd", "mapped")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.mapped: MappedFile | None = None

    def close(self) -> None:
        if self.mapped is not None:
            self.mapped.close()
        os.close(self.fd)


class ShardFiles:
    """Read-only descriptors on a dataset's shard files, opened on first use in each process, at most
    ``MAX_OPEN_SHARDS`` at once (least recently used closed first; see the module doc).

    ``identities[s]`` is what shard file ``s`` was when the dataset was opened (see the module doc).

    ``block_layout[s]`` (optional: block read-ahead) is ``(blocks, file bytes)`` of shard file ``s``, and
    ``set_block_bounds(s, bounds)`` gives, once its record table is read, where those blocks start: the
    byte offsets, then where the last block ends (``reader.blocks.block_bounds``: the end of the
    records; fewer offsets than blocks leave empty blocks at that end). Until
    then nothing of shard ``s`` is read ahead. Without a layout, only the requested records are read.
    Blocks are numbered over all shards in order (shard 0's blocks, then shard 1's, ...), so that a
    batch's blocks in every shard are found with a few array operations instead of a loop over shards.

    ``drop_behind`` (set in the workers of a loader that streams the dataset: module doc): ``read``
    copies nothing from mappings (mapped pages cannot be dropped) and drops the pages of the records it
    read where the main process does not drop their blocks (a batch scattered over many blocks: random
    order).
    """

    def __init__(
        self, paths: list[Path], identities: list[FileIdentity], max_gap: int = DEFAULT_MAX_GAP,
        block_layout: list[tuple[int, int]] | None = None,
    ) -> None:
        self.paths = [Path(p) for p in paths]
        self.identities = identities
        self.max_gap = max_gap
        self.block_layout = block_layout
        if block_layout is not None:
            # each shard's first global block number (then the total); each shard's origin in one
            # address space where the shard files lie end to end; every block's start in it, then the
            # end (a shard's blocks spread evenly over it until its bounds are known, to keep them sorted)
            counts = np.array([blocks for blocks, _ in block_layout], np.int64).reshape(-1)
            sizes = np.array([size for _, size in block_layout], np.int64).reshape(-1)
            self._first_block = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            self._shard_origin = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            shard_of = np.repeat(np.arange(len(counts)), counts)
            within = np.arange(len(shard_of), dtype=np.int64) - self._first_block[shard_of]
            spread = within * sizes[shard_of] // np.maximum(counts[shard_of], 1)
            self._block_starts = np.concatenate([self._shard_origin[shard_of] + spread, self._shard_origin[-1:]])
        self._bounds_known = np.zeros(len(self.paths), bool)
        self._blocks_end = [identity.size for identity in identities]  # per shard: where its last block ends
        self._pid: int | None = None
        self._open: OrderedDict[int, _OpenShard] = OrderedDict()  # least recently used first
        self._map_shards = GUARDED and len(paths) <= MAX_OPEN_SHARDS and \
            sum(identity.size for identity in identities) <= MAX_MAPPED_BYTES
        self._advice_bytes: dict[int, int] = {}
        self._advised: set[int] = set()  # global blocks this process advised (not streamed)
        self.drop_behind = False
        self._nowait = True
        self._gap = memoryview(bytearray(0))

    def set_block_bounds(self, shard: int, bounds: np.ndarray) -> None:
        """Where shard ``shard``'s read-ahead blocks start, then its end (see the class docstring)."""
        if self.block_layout is None:
            return
        first, last = int(self._first_block[shard]), int(self._first_block[shard + 1])
        starts = np.asarray(bounds[:-1], np.int64)[:last - first]
        filled = np.concatenate([starts, np.full(last - first - len(starts), int(bounds[-1]), np.int64)])
        self._block_starts[first:last] = self._shard_origin[shard] + filled
        self._blocks_end[shard] = int(bounds[-1])
        self._bounds_known[shard] = True

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Close this process's descriptors and mappings (those inherited through ``fork`` are the
        child's own copies, so closing them never disturbs the parent)."""
        shards, self._open = self._open, OrderedDict()
        for entry in shards.values():
            entry.close()

    def _shard(self, shard: int) -> _OpenShard:
        """Shard ``shard`` open in this process, checked to be the file the dataset opened; the least
        recently used shard is closed first when ``MAX_OPEN_SHARDS`` are open."""
        pid = os.getpid()
        if self._pid != pid:
            self.close()
            self._pid = pid
            self._gap = memoryview(bytearray(self.max_gap))
        entry = self._open.get(shard)
        if entry is None:
            while len(self._open) >= MAX_OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()
            entry = self._open[shard] = _OpenShard(open_checked(self.paths[shard], self.identities[shard]))
        else:
            check_identity(self.paths[shard], entry.fd, self.identities[shard])
            self._open.move_to_end(shard)
        return entry

    def read(self, shard: int, request: ReadRequest) -> None:
        """Fill every destination of ``request`` with its record's bytes from shard number ``shard``."""
        entry = self._shard(shard)
        fd = entry.fd
        runs = self._runs(request)
        if self.block_layout is None or not self._bounds_known[shard]:
            pending = runs
        else:
            mapped = None if self.drop_behind else self._mapped(entry)  # mapped pages cannot be dropped
            cached = 0
            while cached < len(runs) and (self._copy_mapped(shard, mapped, runs[cached])
                                          or self._read_cached(fd, runs[cached])):
                cached += 1
            pending = runs[cached:]
            if pending:
                self._read_ahead(shard, fd, pending)
        for run in pending:
            self._read_run(shard, fd, run)
        if self.drop_behind and request.nbytes.mean() >= DROP_MIN_RECORD_BYTES and self._scattered(shard, request):
            _drop_pages(fd, request)

    def _scattered(self, shard: int, request: ReadRequest) -> bool:
        """Whether the main process leaves ``request``'s records out of its advice (no block bounds, or
        over ``MAX_READAHEAD_BLOCKS`` blocks: random order), so that a streaming worker drops them itself."""
        if self.block_layout is None or not self._bounds_known[shard]:
            return True
        return self._gathered_blocks(shard, request.offsets, request.offsets + request.nbytes) is None

    def _runs(self, request: ReadRequest) -> list[_Run]:
        """The request's records in file order, cut into runs at holes over ``max_gap`` or ``IOV_MAX``."""
        order = np.argsort(request.offsets, kind="stable")
        offsets = request.offsets[order].tolist()
        nbytes = request.nbytes[order].tolist()
        records = request.records[order].tolist()
        destinations = [request.destinations[k] for k in order.tolist()]
        max_iovecs = IOV_MAX - 1
        runs: list[_Run] = []
        run = None
        position = 0
        for offset, size, record, destination in zip(offsets, nbytes, records, destinations):
            gap = offset - position
            if run is None or gap < 0 or gap > self.max_gap or len(run.iovecs) >= max_iovecs:
                run = _Run(offset)
                runs.append(run)
            elif gap:
                run.iovecs.append(self._gap[:gap])
            run.iovecs.append(destination)
            position = offset + size
            run.ends.append((record, position - run.start))
        for run in runs:
            run.total = run.ends[-1][1]
        return runs

    def _mapped(self, entry: _OpenShard) -> MappedFile | None:
        """This process's mapping of the open shard; None for a dataset too large to map (module doc),
        where the guarded copy is not built, or when the file's size changed (its records are then
        read with ``preadv``, which reports it)."""
        if not self._map_shards:
            return None
        if entry.mapped is None:
            try:
                entry.mapped = MappedFile(entry.fd)
            except (OSError, ValueError):
                return None
        return entry.mapped if entry.mapped.size == os.fstat(entry.fd).st_size else None

    def _copy_mapped(self, shard: int, mapped: MappedFile | None, run: _Run) -> bool:
        """Copy ``run`` from the mapping when all its pages are resident (``reader.mapped_copy``); a
        copy cut short by the file shrinking under it is the changed-file ``FormatError``."""
        if mapped is None or not mapped.resident(run.start + run.done, run.start + run.total):
            return False
        wanted = run.total - run.done
        copied = mapped.copy(run.start + run.done, run.iovecs)
        if copied < wanted:
            fd = self._open[shard].fd
            check_identity(self.paths[shard], fd, self.identities[shard])
            raise FormatError(f"{self.paths[shard]}: shard file shrank while its records were read (rewritten "
                              "in place?); open the dataset again")
        run.advance(copied)
        return True

    def _read_cached(self, fd: int, run: _Run) -> bool:
        """Read what of ``run`` the page cache holds, without waiting for the disk; True if complete.

        A file system that cannot read without waiting answers ``EOPNOTSUPP`` once; from then on every
        run goes to the disk path (and is read ahead there).
        """
        if not self._nowait:
            return False
        try:
            n = os.preadv(fd, run.iovecs, run.start, os.RWF_NOWAIT)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self._nowait = False
            return False
        run.advance(n)
        return run.done >= run.total

    def advise(self, shards: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray,
               streamed: StreamedBlocks | None = None, at: StreamPosition | None = None) -> None:
        """Start reading, in the background, the whole blocks that hold these records (record ``k`` is
        ``nbytes[k]`` bytes at ``offsets[k]`` of shard file ``shards[k]``).

        For a process that knows which records come next (the loader's main process): the disk then
        reads the next blocks while the current ones are decoded. Nothing happens without block
        boundaries or for a shard whose records here are scattered over more than
        ``MAX_READAHEAD_BLOCKS`` blocks. A block is advised once per process, so the many batches
        drawing from the same blocks, and warm epochs, make no system call.

        A streamed dataset (``streamed``, its blocks in use, and ``at``, the stream's position: the
        module doc, "Streaming", and ``reader.streamed_blocks``): first the blocks that every received
        batch has done with are dropped, then each block a batch of this pass reads is advised once a
        pass, cleared first unless an earlier pass still reads it.
        """
        if streamed is not None and at is not None:
            for block in streamed.finished(at.received):
                self._drop_block(block)
        known = self._bounds_known[shards]
        if not known.all():
            shards, offsets, nbytes = shards[known], offsets[known], nbytes[known]
        if self.block_layout is None or len(offsets) == 0:
            return
        blocks = self._touched_blocks(shards, offsets, offsets + nbytes)
        shard_of = np.searchsorted(self._first_block, blocks, "right") - 1
        gathered = np.bincount(shard_of)[shard_of] <= MAX_READAHEAD_BLOCKS
        shard_of, blocks = shard_of[gathered].tolist(), blocks[gathered].tolist()
        if streamed is not None and at is not None:
            cleared, kept = streamed.touch(blocks, at)
            fresh = sorted([(block, True) for block in cleared] + [(block, False) for block in kept])
        else:
            fresh = [(block, False) for block in blocks if block not in self._advised]
            self._advised.update(block for block, _ in fresh)
        shard_of_block = dict(zip(blocks, shard_of))
        # in file order (blocks are numbered so), one call per run of blocks of one shard and one kind
        for (shard, clear), run in groupby(fresh, lambda item: (shard_of_block[item[0]], item[1])):
            self._advise_blocks(shard, self._shard(shard).fd, [block for block, _ in run], clear=clear)

    def advise_bytes(self, shard: int, offset: int, nbytes: int) -> None:
        """Start reading, in the background, ``nbytes`` bytes at ``offset`` of shard ``shard`` (a record
        table: ``PackedDataset.read_tables_ahead``); a file system that refuses the advice is left alone."""
        try:
            os.posix_fadvise(self._shard(shard).fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:
            return

    def _read_ahead(self, shard: int, fd: int, pending: list[_Run]) -> None:
        """Ask the kernel to read every block that ``pending`` runs touch, unless they are scattered."""
        starts = np.fromiter((run.start + run.done for run in pending), np.int64, len(pending))
        ends = np.fromiter((run.start + run.total for run in pending), np.int64, len(pending))
        blocks = self._gathered_blocks(shard, starts, ends)
        if blocks is not None:
            self._advise_blocks(shard, fd, blocks)

    def _gathered_blocks(self, shard: int, starts: np.ndarray, ends: np.ndarray) -> list[int] | None:
        """The blocks of shard ``shard`` that its byte ranges ``[starts, ends)`` touch, or None when they
        are scattered over more than ``MAX_READAHEAD_BLOCKS`` (random order: nobody reads those ahead)."""
        blocks = self._touched_blocks(np.full(len(starts), shard), starts, ends)
        return blocks.tolist() if len(blocks) <= MAX_READAHEAD_BLOCKS else None

    def _touched_blocks(self, shards: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The sorted global numbers of the blocks that the byte ranges ``[starts, ends)`` of the shard
        files ``shards`` touch (read-ahead on only)."""
        origins = self._shard_origin[shards]
        low, high = self._first_block[shards], self._first_block[shards + 1] - 1
        first = np.clip(np.searchsorted(self._block_starts, origins + starts, "right") - 1, low, high)
        last = np.clip(np.searchsorted(self._block_starts, origins + ends - 1, "right") - 1, low, high)
        spans = last - first + 1
        within = np.arange(int(spans.sum())) - np.repeat(np.cumsum(spans) - spans, spans)
        return np.unique(np.repeat(first, spans) + within)

    def _advise_blocks(self, shard: int, fd: int, blocks: list[int], clear: bool = False) -> None:
        """``posix_fadvise(WILLNEED)`` the whole ``blocks`` (global numbers, all in shard ``shard``), in
        device-sized pieces, under the shard's advice lock.

        The advice is asynchronous and only advice: pages already cached cost a lookup, not a read,
        and a file system that refuses it just leaves the records to be read on their own.

        ``clear`` (a streamed dataset) first drops what the cache holds of each block: the pages that
        dropping records left behind, each shared by two records. The kernel cuts its read around
        every page present, so those pages, one per record, would turn the block's read into one
        disk request per record.
        """
        piece = self._advice_piece(shard, fd)
        with _advice_lock(fd):
            try:
                for block in blocks:
                    start, end = self._block_range(shard, block)
                    if end <= start:  # an empty block (and a length of 0 would mean "to the file's end")
                        continue
                    if clear:
                        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
                    for offset in range(start, end, piece):
                        os.posix_fadvise(fd, offset, min(piece, end - offset), os.POSIX_FADV_WILLNEED)
            except OSError:
                return

    def _block_range(self, shard: int, block: int) -> tuple[int, int]:
        """Where global block ``block`` of shard ``shard`` lies in its file: ``(start, end)``, ending at
        the shard's last record (an empty block has ``end <= start``)."""
        origin = int(self._shard_origin[shard])
        start = int(self._block_starts[block]) - origin
        return start, min(int(self._block_starts[block + 1]) - origin, self._blocks_end[shard])

    def _drop_block(self, block: int) -> None:
        """Drop global block ``block``'s pages from the page cache (a streamed pass is done with it)."""
        shard = int(np.searchsorted(self._first_block, block, "right") - 1)
        start, end = self._block_range(shard, block)
        if end <= start:  # (a length of 0 would mean "to the file's end")
            return
        try:
            os.posix_fadvise(self._shard(shard).fd, start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError:
            return

    def _advice_piece(self, shard: int, fd: int) -> int:
        piece = self._advice_bytes.get(shard)
        if piece is None:
            piece = self._advice_bytes[shard] = willneed_limit(fd)
        return piece

    def _read_run(self, shard: int, fd: int, run: _Run) -> None:
        """Finish ``run`` with blocking ``preadv`` calls; continues after a partial read, fails on end
        of file."""
        while run.done < run.total:
            try:
                n = os.preadv(fd, run.iovecs, run.start + run.done)
            except OSError as e:
                raise OSError(
                    e.errno, f"reading record {run.ends[0][0]} and following failed: {e.strerror}",
                    str(self.paths[shard]),
                ) from None
            if n == 0:
                missing = next(record for record, end in run.ends if end > run.done)
                raise FormatError(
                    f"{self.paths[shard]}: shard is truncated: record {missing} ends past the end of "
                    f"the file (file offset {run.start + run.done}); the file changed or is damaged"
                )
            run.advance(n)


def _drop_pages(fd: int, request: ReadRequest) -> None:
    """Drop from the page cache the whole pages inside the records just read (records that touch are
    one range; a page shared with a record not read is kept)."""
    order = np.argsort(request.offsets, kind="stable")
    starts = request.offsets[order].astype(np.int64)
    ends = starts + request.nbytes[order]
    cuts = np.flatnonzero(starts[1:] != ends[:-1]) + 1
    firsts = -(-starts[np.r_[0, cuts]] // PAGE_SIZE) * PAGE_SIZE
    lasts = ends[np.r_[cuts - 1, len(ends) - 1]] // PAGE_SIZE * PAGE_SIZE
    try:
        for first, last in zip(firsts.tolist(), lasts.tolist()):
            if last > first:
                os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_DONTNEED)
    except OSError:
        return


@contextmanager
def _advice_lock(fd: int) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the shard file while advising it.

    DataLoader workers miss the same blocks at the same moment. Two WILLNEEDs over the same range at
    once interleave page by page (each skips the pages the other just added), which cuts the disk
    requests into pieces of a few pages: on a 200-IOPS disk two workers then read 3x slower than one.
    Serialised, the second finds every page present and only looks them up. Where locks are not
    available (some NFS mounts), the advice goes ahead unlocked.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def willneed_limit(fd: int) -> int:
    """How many bytes one ``posix_fadvise(WILLNEED)`` on ``fd`` reads: the larger of the device's
    read-ahead and largest request (sysfs ``read_ahead_kb``, ``max_sectors_kb``), at most 2 MiB.

    The device is the file system's block device (or, for a partition, its disk); a file system with no
    block device (NFS, FUSE) gets ``FALLBACK_ADVICE_BYTES``.
    """
    dev = os.fstat(fd).st_dev
    device = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{device}/queue", f"{device}/../queue"):
        try:
            kib = max(int(Path(queue, name).read_text()) for name in ("read_ahead_kb", "max_sectors_kb"))
        except (OSError, ValueError):
            continue
        return min(MAX_ADVICE_BYTES, max(kib << 10, PAGE_SIZE))
    return FALLBACK_ADVICE_BYTES


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
