"""How far ahead of the workers a loader's main process advises blocks (``reader.batch_stream``).

About one and a half windows of quasi-random blocks (``LOOKAHEAD_WINDOWS``), so that the disk reads the
next window while the workers decode the current one. A streamed loader (a dataset larger than the
page cache, ``reader.shard_io``) advises less where memory is short: the window being read, the batches
in flight and the blocks advised ahead must fit in a ``STREAM_SHARE``-th of the memory free for the page
cache (``lookahead_samples`` says why).

When that is measured (``Lookahead``): first when the loader's stream starts (its first batch), not
when the loader is made, since a training script often moves its model to the GPU, or starts CUDA,
between the two; then again every ``REMEASURE_S`` seconds while it streams, since a job's memory grows
as it runs (a model or CUDA started after the first batch, spawned workers importing torch, a
checkpoint's pages). Each reading sets aside the loader's batch buffers that do not exist yet: they
are made as the stream runs (a worker makes a slot when all of its others are in use), and a reading
that counted only those already made advised too much ahead, which the slots made next then evicted.
The advice ahead follows the readings, never above the first.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable

from torch.utils.data import Dataset

from reader.memory_budget import free_memory
from reader.packed_view import PackedView, as_view
from reader.ranks import ranks_on_this_node

# How far ahead of the workers the main process advises blocks, in windows of ``buffer_blocks``
# blocks: over one, so that the next window's reads are always queued while the current one is read,
# with room for windows of uneven size.
LOOKAHEAD_WINDOWS = 1.5
# A streamed loader's blocks (the window its workers read and those advised ahead) take at most this
# share of the memory free for the page cache (``lookahead_samples`` says why).
STREAM_SHARE = 3
# How often a streaming loader measures the free memory again (``Lookahead``): a reading costs about
# 0.5 ms of the main process (a few cgroup files), and a window takes a slow disk 0.2-1.3 s to read.
REMEASURE_S = 0.5
_warned_short_of_memory = False  # the warning of ``lookahead_samples`` comes once a process


def lookahead_samples(dataset: Dataset, buffer_blocks: int, in_flight: int = 0, reserved: int = 0) -> int:
    """``LOOKAHEAD_WINDOWS`` windows of ``buffer_blocks`` of the dataset's blocks, in samples; for a
    streamed view (``PackedView.streaming``) at most what keeps the window the workers read, the
    ``in_flight`` samples they were given and the blocks advised ahead within a ``STREAM_SHARE``-th of
    the memory free for the page cache now (``free_memory``) once ``reserved`` bytes (batch buffers the
    loader is about to make) are set aside, each rank on this node (``ranks_on_this_node``) counted with
    its own buffers and share. Where that share does not hold even one window, a ``RuntimeWarning``
    says so and what to change, once a process (a loader made each epoch would repeat it).

    Why the bound: under a memory cap, the kernel evicts blocks advised ahead before they are used,
    and every record of them is then read again on its own, at the disk's IOPS; it starts well before
    the blocks alone fill the free memory, since what it reclaims first is what was advised and not
    yet read. Measured with 96,000 JPEG records (1.4 GB, 90 MB windows) on the slow disk
    (``scripts/bench_cold.py --mem``), epoch 1: under a 1,500 MB cap 134 MB advised ahead read at
    1.15x the disk's time, bound by the two cores; under 900 MB (about 300 MB left for the page cache
    once the workers run), 11-53 MB ahead read 3,950-5,440 img/s, 92 MB 1,260 and 134 MB 472. A third
    gives 31 MB ahead there and 130 MB under 1,500 MB. (Before, a quarter of the cap was allowed, more
    than is free where the loader's own batch slots or a CUDA process take most of it.)
    """
    global _warned_short_of_memory
    view = as_view(dataset)
    blocks = max(view.block_groups().block_count, 1)
    samples = round(LOOKAHEAD_WINDOWS * buffer_blocks * len(view) / blocks)
    if view.streaming:
        shard_bytes = max(view.shard_bytes(), 1)
        ranks = ranks_on_this_node()
        free = (free_memory() - ranks * reserved) // ranks  # this rank's part
        window = shard_bytes * min(buffer_blocks, blocks) // blocks
        if free // STREAM_SHARE < window and not _warned_short_of_memory:
            _warned_short_of_memory = True
            held = (f"once the loader's batch buffers still to be made, {reserved >> 20} MiB, are set aside"
                    if reserved else "with all the loader's batch buffers made")
            warnings.warn(
                f"make_loader: the memory free for the page cache ({max(free, 0) >> 20} MiB {held}"
                f"{f', for each of {ranks} ranks on this node' if ranks > 1 else ''}) is under {STREAM_SHARE} read "
                f"windows of this streamed dataset ({window >> 20} MiB each: buffer_blocks x block_bytes): "
                "blocks read ahead will be evicted before they are read, and records read one by one at "
                "the disk's IOPS. Give the job more memory, or pass PackedDataset(block_bytes=...) or "
                "make_loader(buffer_blocks=...) smaller, or fewer workers or a smaller batch",
                RuntimeWarning, stacklevel=2)
        room = (free // STREAM_SHARE - window) * len(view) // shard_bytes - in_flight
        samples = max(0, min(samples, room))
    return samples


class Lookahead:
    """A loader's lookahead in samples, as ``lookahead_samples`` gives it, taken when first asked for
    (the stream's start) and, for a streamed view, again every ``REMEASURE_S`` seconds after, never
    above the first reading (module docstring). Each reading sets aside the ``reserved`` bytes of batch
    buffers less what ``made()`` says of them exists already (the loader's ``buffer_bytes_made``)."""

    def __init__(self, view: PackedView, buffer_blocks: int, in_flight: int, reserved: int) -> None:
        self.view = view
        self.buffer_blocks = buffer_blocks
        self.in_flight = in_flight
        self.reserved = reserved
        self.made: Callable[[], int] = lambda: 0
        self._first: int | None = None
        self._now = 0
        self._measured = 0.0

    def __call__(self) -> int:
        """Samples to advise ahead now."""
        if self._first is None or (self.view.streaming and time.monotonic() - self._measured >= REMEASURE_S):
            to_come = max(0, self.reserved - self.made())
            samples = lookahead_samples(self.view, self.buffer_blocks, self.in_flight, to_come)
            self._first = samples if self._first is None else self._first
            self._now = min(self._first, samples)
            self._measured = time.monotonic()
        return self._now
