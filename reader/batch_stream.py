"""``BatchStream``: a ``ShardSampler``'s batches, as a batch sampler and, for the loader, endlessly.

Why endless: a DataLoader's workers only prefetch what its batch sampler has already produced. With a
batch sampler that stops at the end of each epoch, the first batches of the next epoch are only
requested when the next ``for`` loop starts, so every epoch begins with a full batch decode on the
critical path. A stream that runs on into the next epoch (``endless()``) lets the workers prepare it
while the current one is still being consumed; ``PackedLoader`` feeds that to its workers and cuts it
back into epochs of ``len(loader)`` batches. Iterating the ``BatchStream`` itself (what a framework
that walks ``loader.batch_sampler`` sees) yields one pass and ends, like torch's ``BatchSampler``.

Each pass is identified by ``(epoch, start)``: batches of ``rank_order(epoch)[start:]``, cut every
``batch_size`` samples, the last short batch dropped with ``drop_last``, exactly as
``BatchSampler(sampler, batch_size, drop_last)`` cuts them. The pass after ``(epoch, start)`` is
``(epoch + 1, 0)`` when ``epoch_step`` is 1 (``set_epoch`` called before every epoch) or the same
``(epoch, start)`` again when it is 0 (no ``set_epoch`` calls: the sampler repeats its epoch).

Advice ahead (optional): the stream knows the order far beyond what the workers have been given, so
it can tell the dataset which records come next. With an ``advise`` callable and a ``lookahead`` of
``n`` samples, each batch is passed to ``advise`` about ``n`` samples before it is yielded (the first
ones at once, when the stream starts). ``PackedDataset.advise`` then starts reading those records'
blocks, so on a slow disk the next window of quasi-random blocks is read while the workers decode the
current one, instead of only once a worker misses in it. The batches yielded are the same either way.
The lookahead may be a callable, asked again at every batch: a streamed loader's follows the memory
free as the job runs (``reader.lookahead.Lookahead``). When it shrinks, the batches beyond it are
yielded at once; when it grows, batches are advised before the next is yielded.

No lookahead at a stream's start: the DataLoader asks for its ``in_flight`` batches at once, and
advising them and the lookahead beyond queued three windows of blocks (about 70 MB of 24,000 JPEGs) in
the first 50 ms. A quasi-random first batch needs its whole first window, and the disk did not serve
that window first: on the throttled disk, the kernel cuts a block's read into several requests where
its pages are not contiguous in memory, and the later pieces queued behind the other windows' reads, so
that the first window was complete one throttle step (0.1 s) or more later in 9 and 11 runs of 16 in
two sets of runs (first batch 0.32-0.78 s against 0.23-0.24). So until the first batch is back (the
DataLoader asks for one more), the stream advises only the batches it hands out (with 2 workers, 4
batches, all in the first window), and the lookahead beyond them only then. The first batch then came
in 0.22-0.29 s in 68 runs of 68, epochs as before (BENCHMARKS.md, "The first window alone"). Every
batch is still advised before it is handed out, which a streamed view's drops rely on
(``reader.streamed_blocks``).

Record tables further ahead (optional, with ``read_tables``): advising a batch needs the record tables
of its shards, and a table read only then waits behind every block advised before it, while the
loader's main process, which both advises and hands batches out, waits with it. So each batch is also
passed to ``read_tables`` ``TABLE_LEAD`` lookaheads before it is advised (``PackedDataset.read_tables_ahead``
starts reading the tables it lacks): by the time it is advised, the blocks queued before its tables
have been read. Measured on a 1.2 GB raw set of 36 shards under a 1000 MB cap, its first epoch from
the slow disk: without it, the main process waited 0.5-0.7 s for each new table in the first batches
and the first batch came after 2.46 s; with tables one lookahead ahead it still waited up to 1.1 s;
with two, no table read took over 20 ms in 60 batches and the first batch came after 0.68 s. A
lookahead counts as one batch here where it is none (a streamed loader with no memory to advise
ahead): tables are small, and the same set under that loader waited 1.25 s for its first batch. The
first batches' tables are asked for before the loader's DataLoader forks its workers
(``read_first_tables``), so that the disk reads them while the workers start: a training script's first
cold batch then came 0.24-0.27 s after ``iter()`` in 24 runs of 26, against 0.28-0.40 s (24,000 JPEGs,
the slow disk; BENCHMARKS.md, "The record tables before the forks").
"""
from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Callable, Iterator

import numpy as np
from torch.utils.data import Sampler

from reader.arguments import whole_number
from reader.sampler import ShardSampler
from reader.streamed_blocks import StreamPosition

TABLE_LEAD = 2  # lookaheads between a batch's ``read_tables`` and its ``advise`` (module docstring)
Samples = int | Callable[[], int]  # a lookahead: a number of samples, or what gives it now


class BatchStream(Sampler[list[int]]):
    """Batches of ``sampler``'s passes, starting at its current ``(epoch, start)``.

    ``iter()`` yields the current pass; ``endless()`` runs on pass after pass, and ends only if a pass
    has no batch at all, since every later pass would be empty too. ``len()`` is the number of batches
    in the sampler's whole epoch, those already yielded before a resume included (``batches_done``);
    an iteration yields the ``batches_left`` (``ShardSampler``'s module docstring says why). ``advise`` (called with a
    batch's indices as a numpy array and its ``StreamPosition``: its number in this ``endless()``, its
    pass's, and how many batches the DataLoader has received, given that it holds ``in_flight`` batches
    beyond those (``reader.streamed_blocks``)) sees
    every batch of ``endless()`` ``ceil(lookahead / batch_size)`` batches before it is yielded
    (``lookahead``: samples, or a callable giving them, asked at every batch), except at the start,
    where each of the ``in_flight`` batches is advised as it is handed out and the lookahead beyond them
    once the first batch is back (module docstring), and
    ``read_tables`` (called with a batch's indices) ``TABLE_LEAD`` times as many batches (at least
    ``TABLE_LEAD``) before that
    (see the module docstring).

    ``sampler`` must be a ``ShardSampler``: a framework that rebuilds the loader around its own
    sampler (Lightning's ``use_distributed_sampler=True``) gets a ``TypeError`` that says what to turn
    off, since ``make_loader`` already gives each rank its share.
    """

    def __init__(
        self,
        sampler: ShardSampler,
        batch_size: int,
        drop_last: bool,
        *,
        advise: Callable[[np.ndarray, StreamPosition], None] | None = None,
        read_tables: Callable[[np.ndarray], None] | None = None,
        lookahead: Samples = 0,
        in_flight: int = 0,
    ) -> None:
        if not isinstance(sampler, ShardSampler):
            raise TypeError(
                f"make_loader's batch sampler needs its ShardSampler, got {type(sampler).__name__}: something "
                "(Lightning's Trainer with use_distributed_sampler=True) is rebuilding the loader around another "
                "sampler. make_loader already splits every epoch between the ranks (seeded, resumable): keep it "
                "as is with Trainer(use_distributed_sampler=False)")
        batch_size = whole_number("batch_size", batch_size, 1)
        if isinstance(lookahead, int) and lookahead < 0:
            raise ValueError(f"lookahead must be 0 or more samples, got {lookahead}")
        if in_flight < 0:
            raise ValueError(f"in_flight must be 0 or more batches, got {in_flight}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.epoch_step = 1
        self.advise = advise
        self.read_tables = read_tables
        self.lookahead = lookahead
        self.in_flight = in_flight

    @property
    def lookahead_batches(self) -> int:
        """How many batches ahead of the one yielded the stream advises now (0 without ``advise``)."""
        if self.advise is None:
            return 0
        samples = self.lookahead() if callable(self.lookahead) else self.lookahead
        return -(-samples // self.batch_size)

    def __len__(self) -> int:
        return self.batches_done() + self.batches_left()

    def batches_done(self) -> int:
        """Batches yielded of the sampler's epoch before its position (each pass's samples, in batches;
        a short last batch counts as one)."""
        return sum(-(-samples // self.batch_size) for samples in self.sampler.passes_done())

    def batches_left(self) -> int:
        """Batches an iteration yields now: those of the sampler's samples left."""
        return self.batches_in(self.sampler.samples_left)

    def batches_in(self, samples: int) -> int:
        """How many batches ``samples`` samples make."""
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def following(self, epoch: int, start: int) -> tuple[int, int]:
        """The pass this stream yields after the pass ``(epoch, start)``."""
        return (epoch + 1, 0) if self.epoch_step else (epoch, start)

    def __iter__(self) -> Iterator[list[int]]:
        """The batches of the sampler's current pass, then the end."""
        for batch in self._pass(self.sampler.epoch, self.sampler.start):
            yield batch.tolist()

    def read_first_tables(self) -> None:
        """Ask for the record tables of the batches that ``endless()`` reads the tables of before its
        first advice, now: ``PackedLoader`` calls this before its DataLoader forks the workers, so the
        tables are on their way (``read_tables`` only advises them) while the workers start, and the
        first window is advised as soon as ``endless()`` begins (module docstring, "Record tables
        further ahead"). ``endless()`` asks for them again, which costs a set lookup per shard."""
        if self.advise is None or self.read_tables is None:
            return
        for _, batch in islice(self._batches(), self._tables_lead(self.lookahead_batches) + 1):
            self.read_tables(batch)

    def _tables_lead(self, lookahead: int) -> int:
        """How many batches ahead of its advice a batch's record tables are asked for, with ``lookahead``
        batches advised ahead: ``TABLE_LEAD`` lookaheads, a lookahead of none counting as one (module
        docstring); none without ``read_tables``."""
        return TABLE_LEAD * max(lookahead, 1) if self.read_tables is not None else 0

    def endless(self) -> Iterator[list[int]]:
        """Pass after pass from the sampler's current one, each batch advised ahead and its record tables
        read further ahead (module docstring)."""
        batches = self._batches()
        advise = self.advise
        if advise is None:
            for _, batch in batches:
                yield batch.tolist()
            return
        coming: deque[tuple[int, np.ndarray]] = deque()  # tables asked for, not advised yet
        ahead: deque[np.ndarray] = deque()  # advised, not yielded yet
        advised = yielded = 0

        def advise_next() -> None:
            nonlocal advised
            number, batch = coming.popleft()
            advise(batch, StreamPosition(advised, number, max(0, yielded - max(self.in_flight, 1) + 1)))
            advised += 1
            ahead.append(batch)

        for number, batch in batches:
            if self.read_tables is not None:
                self.read_tables(batch)
            coming.append((number, batch))
            lookahead = self.lookahead_batches
            while len(coming) > self._tables_lead(lookahead):
                advise_next()
            # nothing advised beyond the batches handed out until the first one is back (module docstring)
            while len(ahead) > (lookahead if yielded >= self.in_flight else 0):
                yield ahead.popleft().tolist()
                yielded += 1
        while coming:
            advise_next()
        while ahead:
            yield ahead.popleft().tolist()
            yielded += 1

    def _batches(self) -> Iterator[tuple[int, np.ndarray]]:
        """The stream's batches as index arrays, pass after pass, each with its pass's number."""
        epoch, start = self.sampler.epoch, self.sampler.start
        number = 0
        while True:
            empty = True
            for batch in self._pass(epoch, start):
                empty = False
                yield number, batch
            if empty:
                return
            epoch, start = self.following(epoch, start)
            number += 1

    def _pass(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """The batches of the pass ``(epoch, start)``, cut as ``BatchSampler`` cuts them, each as soon as
        the sampler has built the part of the order it needs (``ShardSampler.rank_pieces``): no pass
        waits for a whole epoch's order."""
        pending = np.zeros(0, np.int64)
        skip = start
        for piece, _ in self.sampler.rank_pieces(epoch):
            cut = min(skip, len(piece))
            skip -= cut
            pending = np.concatenate([pending, piece[cut:]]) if len(pending) else piece[cut:]
            full = len(pending) // self.batch_size
            for i in range(full):
                yield pending[i * self.batch_size:(i + 1) * self.batch_size]
            pending = pending[full * self.batch_size:]
        if len(pending) and not self.drop_last:
            yield pending
