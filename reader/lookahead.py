"""How far ahead of the workers a loader's main process advises blocks (``reader.batch_stream``).

About one and a half windows of quasi-random blocks (``LOOKAHEAD_WINDOWS``), so that the disk reads the
next window while the workers decode the current one. A streamed loader (a dataset larger than the
page cache, ``reader.shard_io``) advises less where memory is short: the window being read, the batches
in flight and the blocks advised ahead must fit in ``STREAM_SHARE`` (two fifths) of the memory free for
the page cache, and in what is left of it beyond the files the processes map (under a memory
cgroup's limit) and a batch slot per worker (``lookahead_samples`` says why).

When that is measured (``Lookahead``): first when the loader is made, before its workers exist, with
its batch buffers set aside; then again every ``REMEASURE_S`` seconds while it streams, since a job's
memory grows as it runs (a model moved to the GPU or CUDA started after the loader was made, spawned
workers importing torch, a checkpoint's pages). The advice ahead follows the readings, never above
the first. Each later reading sets aside the buffers not made yet, counting as made the slots batches
came back in and one more slot a worker (the one it may be filling). Why not a first reading when the
stream starts: the workers exist by then and have made their first slots, which no batch has come
back in yet, so that reading counted them twice; under a 900 MB cap it found no room for a window,
and the cap on later readings then kept the loader from advising anything ahead (3,743-3,891 img/s
against 4,523-4,909 on the 1.4 GB JPEG set).
"""
from __future__ import annotations

import time
import warnings
from typing import Callable

from torch.utils.data import Dataset

from reader.memory_budget import measure_free_memory
from reader.packed_view import PackedView, as_view
from reader.ranks import ranks_on_this_node

# How far ahead of the workers the main process advises blocks, in windows of ``buffer_blocks``
# blocks: over one, so that the next window's reads are always queued while the current one is read,
# with room for windows of uneven size.
LOOKAHEAD_WINDOWS = 1.5
# A streamed loader's blocks (the window its workers read, the batches in flight and those advised
# ahead) take at most this share of the memory free for the page cache (``lookahead_samples`` says why).
STREAM_SHARE = 0.4
# How often a streaming loader measures the free memory again (``Lookahead``): a reading costs about
# 0.5 ms of the main process (a few cgroup files), and a window takes a slow disk 0.2-1.3 s to read.
REMEASURE_S = 0.5
_warned_short_of_memory = False  # the warning of ``lookahead_samples`` comes once a process


def lookahead_samples(dataset: Dataset, buffer_blocks: int, in_flight: int = 0, reserved: int = 0,
                      margin: int = 0, stacklevel: int = 2) -> int:
    """``LOOKAHEAD_WINDOWS`` windows of ``buffer_blocks`` of the dataset's blocks, in samples; for a
    streamed view (``PackedView.streaming``) at most what keeps the window the workers read, the
    ``in_flight`` samples they were given and the blocks advised ahead within the *room* for blocks:
    ``STREAM_SHARE`` of the memory free for the page cache now (``measure_free_memory``) once
    ``reserved`` bytes (batch buffers the loader is about to make) are set aside, and no more than what
    is left of it beyond the files the processes map (where a memory cgroup sets a limit) less
    ``margin`` bytes of slack (``Lookahead`` passes a batch slot per worker); each rank on this node
    (``ranks_on_this_node``) counted with its own buffers, share and slack.
    Where that room does not hold even one window, a ``RuntimeWarning`` says so and what to change,
    once a process (a loader made each epoch would repeat it), with ``stacklevel`` as
    ``warnings.warn`` takes it.

    Why the bound: under a memory cap, the kernel evicts blocks advised ahead before they are used,
    and every record of them is then read again on its own, at the disk's IOPS; it starts well before
    the blocks alone fill the free memory, since what it reclaims first is what was advised and not
    yet read. Measured with 96,000 JPEG records (1.4 GB, 90 MB windows) on the slow disk
    (``scripts/bench_cold.py --mem``), epoch 1: under a 1,500 MB cap 134 MB advised ahead read at
    1.15x the disk's time, bound by the two cores; under 900 MB (about 300 MB left for the page cache
    once the workers run), 11-53 MB ahead read 3,950-5,440 img/s, 92 MB 1,260 and 134 MB 472: the
    81 MB window, the batches in flight and the advice took 48% of what was free in the last good
    case, 60% in the first bad one. Two fifths leave about 28 MB ahead there, measured while the loader
    runs (its workers' memory counted), and 130 MB under 1,500 MB. A third left 8 MB ahead and read
    3,930-4,010 img/s under 900 MB, against 4,750-5,550 with two fifths. (Before, a quarter of the cap
    was allowed, more than is free where the loader's own batch slots or a CUDA process take most of it.)

    Why the second bound: under a cap, reclaim takes blocks read ahead and not yet read before the
    pages of the libraries the processes map (``measure_free_memory``'s ``beyond_mapped``), and a
    worker makes a batch slot (38.5 MB for 256 images of 224x224) where none comes back in time
    (``reader.batch_memory``), at the cap. The three fifths that the share leaves cover both where
    memory is plenty, but not where it is short: the 24,000 JPEG records (357 MB) under a 600 MB cap,
    with 150-170 MB free once the slots are set aside, of which the mapped libraries take 71-92 MB,
    read their first epoch at 1.16-1.53x the disk's time and a later one at 1.37-1.71x, reading back
    blocks evicted before they were read; with the bound, which leaves nothing ahead there, the first
    epoch at 1.02-1.12x in all but one of 33 readings (BENCHMARKS.md, "Some runs are slower, and why",
    which also gives the later epochs). Where memory is not that short the share is the smaller bound:
    the same records under 700 MB (250-270 MB free, 100-117 MB beyond the files and slots, 99-109 MB
    the share) and the 1.4 GB set under 900 MB (465 MB free, about 300 MB beyond) advise as before.
    """
    global _warned_short_of_memory
    view = as_view(dataset)
    blocks = max(view.block_groups().block_count, 1)
    samples = round(LOOKAHEAD_WINDOWS * buffer_blocks * len(view) / blocks)
    if view.streaming:
        shard_bytes = max(view.shard_bytes(), 1)
        ranks = ranks_on_this_node()
        reading = measure_free_memory()
        free = (reading.total - ranks * reserved) // ranks  # this rank's part
        unmapped = (reading.beyond_mapped - ranks * reserved) // ranks - margin
        window = shard_bytes * min(buffer_blocks, blocks) // blocks
        share = max(0, min(int(free * STREAM_SHARE), unmapped))
        if share < window and not _warned_short_of_memory:
            _warned_short_of_memory = True
            held = (f"once the loader's batch buffers still to be made, {reserved >> 20} MiB, are set aside"
                    if reserved else "with the loader's batch buffers made")
            warnings.warn(
                f"make_loader: the page cache's room for this streamed dataset's blocks ({share >> 20} MiB: "
                f"{STREAM_SHARE:g} of the {max(free, 0) >> 20} MiB free {held}, and no more than the "
                f"{max(unmapped, 0) >> 20} MiB that the files the processes map and a batch slot per worker "
                "leave"
                f"{f', for each of {ranks} ranks on this node' if ranks > 1 else ''}) is under one read "
                f"window ({window >> 20} MiB: buffer_blocks x block_bytes): "
                "blocks read ahead will be evicted before they are read, and read again. Give the job "
                "more memory, or pass PackedDataset(block_bytes=...) or make_loader(buffer_blocks=...) "
                "smaller, or fewer workers or a smaller batch",
                RuntimeWarning, stacklevel=stacklevel)
        room = (share - window) * len(view) // shard_bytes - in_flight
        samples = max(0, min(samples, room))
    return samples


class Lookahead:
    """A loader's lookahead in samples, as ``lookahead_samples`` gives it: taken when made, with the
    ``reserved`` bytes of batch buffers set aside, and for a streamed view taken again every
    ``REMEASURE_S`` seconds as it is asked for, never above the first reading (module docstring). A
    later reading sets aside ``reserved`` less what ``made()`` says exists (the loader's
    ``buffer_bytes_made``: the slots batches came back in) and less ``unsent``, the slots the workers
    may have made that no batch has come back in yet. Every reading also keeps a batch slot per worker
    (``unsent`` is that much) of slack beyond the files the processes map (``lookahead_samples``'
    ``margin``): a worker still makes a slot where none comes back in time (``reader.batch_memory``),
    whatever the reckoning expects."""

    def __init__(self, view: PackedView, buffer_blocks: int, in_flight: int, reserved: int,
                 unsent: int = 0) -> None:
        self.view = view
        self.buffer_blocks = buffer_blocks
        self.in_flight = in_flight
        self.reserved = reserved
        self.unsent = unsent
        self.made: Callable[[], int] = lambda: 0
        self._first = self._now = lookahead_samples(view, buffer_blocks, in_flight, reserved, unsent, stacklevel=4)
        self._measured = time.monotonic()

    def __call__(self) -> int:
        """Samples to advise ahead now."""
        if self.view.streaming and time.monotonic() - self._measured >= REMEASURE_S:
            to_come = max(0, self.reserved - self.made() - self.unsent)
            self._now = min(self._first, lookahead_samples(self.view, self.buffer_blocks, self.in_flight, to_come,
                                                           self.unsent))
            self._measured = time.monotonic()
        return self._now
