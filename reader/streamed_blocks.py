"""``StreamedBlocks``: which read-ahead blocks of a streamed dataset are in use, kept by the loader's main
process, which advises them (``reader.batch_stream``) and drops each one once every batch reading it is
received.

A dataset larger than the page cache is streamed (``reader.shard_io``, "Streaming"): every block is read
from the disk once a pass, and its pages must go once read, or they crowd out the blocks read ahead.
Who drops them, and when:

- **The main process drops whole blocks, once the last batch reading one is received.** It knows the
  order, so it knows each block's last batch; the workers only know their own batch. A whole block is one
  long range of pages, which the kernel drops whole; dropping the records of each batch in the workers
  split the kernel's large folios under their lock (records under 64 KiB were left in the cache for that
  reason, and filled it).
- **A block the next pass advises while this pass still reads it is kept**, neither cleared before the
  next pass's advice nor dropped after this pass's last batch: its pages are what both need. Before,
  a new pass cleared each block it advised (``clear`` in ``ShardFiles``) and the workers dropped what
  they read, so where the next pass's first blocks were among this pass's last ones, each side dropped
  pages the other was about to read, and a worker then read them record by record behind the advice
  queued for the next pass (a 2 s stall at the end of every epoch of a 1.2 GB raw set under a 1000 MB
  cap, which cost its first epoch 9-14%).

When a batch is received: the DataLoader gives its workers at most ``in_flight`` batches (workers times
prefetch factor) beyond those its loop has taken, and asks the batch sampler for the next only after
taking one, in order. So when ``BatchStream`` hands out its batch number ``n``, batches ``0 .. n -
in_flight`` have been received (``StreamPosition.received``). A wrong count would only drop pages early
(records read again from the disk) or late (kept longer): never a wrong batch. When the DataLoader's
workers are reset (a loop cut short, a resume), its new stream starts again at batch 0, and the blocks
the last stream still held are dropped (``PackedView``): torch's persistent workers acknowledge a reset
only after the tasks queued before it, so the last stream's batches are all in.

Each process keeps its own ledger: DDP ranks on one node read disjoint contiguous slices of one order,
so only the window cut by the edge of two slices has blocks that both read, one rank at the start of
its epoch and the other at the end. The first drops them when done, and the second reads them again
(one window a rank an epoch, which a page cache too small for the dataset would not have kept anyway).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StreamPosition:
    """Where the loader's index stream is when it advises a batch: the batch's number in this stream
    (``batch``, from 0 when the DataLoader's workers start or are reset), the number of its pass in the
    stream (``pass_number``), and how many of the stream's batches the DataLoader has received so far
    (``received``: batches ``0 .. received - 1``)."""

    batch: int
    pass_number: int
    received: int


class StreamedBlocks:
    """The blocks of one dataset that a stream has advised and not yet dropped (module docstring).

    ``touch`` records a batch's blocks as the stream advises it and says which blocks to advise;
    ``finished`` says which blocks every batch so far has done with, and forgets them."""

    def __init__(self) -> None:
        self._pass_of: dict[int, int] = {}  # block -> the pass that advised it
        self._last_use: dict[int, int] = {}  # block -> the last batch reading it
        self._uses: deque[tuple[int, int]] = deque()  # (batch, block) in the order advised

    def touch(self, blocks: list[int], at: StreamPosition) -> tuple[list[int], list[int]]:
        """Record that batch ``at.batch`` reads ``blocks``; returns the blocks this pass has not advised
        yet, as ``(to clear, then advise; to advise as they are)``: a block still in use by an earlier
        pass's batches keeps its pages."""
        cleared: list[int] = []
        kept: list[int] = []
        for block in blocks:
            if self._pass_of.get(block) != at.pass_number:
                (kept if block in self._last_use else cleared).append(block)
                self._pass_of[block] = at.pass_number
            self._last_use[block] = at.batch
            self._uses.append((at.batch, block))
        return cleared, kept

    def finished(self, received: int) -> list[int]:
        """The blocks whose batches (advised so far) are all among the first ``received``: their pages can
        go. They are forgotten, so a later batch reading one advises it again."""
        done: list[int] = []
        while self._uses and self._uses[0][0] < received:
            batch, block = self._uses.popleft()
            if self._last_use.get(block) == batch:
                del self._last_use[block]
                del self._pass_of[block]
                done.append(block)
        return done
