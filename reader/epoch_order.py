"""One epoch's record order, built piece by piece as it is reached instead of all at once.

``ShardSampler``'s orders (see ``reader.sampler``) are functions of ``(seed, epoch)``. Built whole, the
quasi-random order of 1.28 million records took 0.3 s of sorting on the thread that hands out batches,
at every epoch boundary, and under DDP every rank built all of it to keep ``1/world_size``. Here an
epoch's order is an object that answers ``pieces(lo, hi)``, its positions ``lo..hi-1``, computing only
the windows of blocks those positions fall in:

- quasi-random: the block shuffle costs O(blocks) when the epoch starts; window ``j``'s records are
  then shuffled when it is first reached, in O(n_j log n_j). The numbers that shuffle them are the ones a
  single ``rng.random(N)`` after the block shuffle would draw for those positions: the bit generator is
  advanced to the window's first position (PCG64 ``advance``, one 64-bit draw per double), so the order
  is the same as the one the whole-array algorithm gives (``reference_quasi_random`` in the tests).
- random: one ``rng.permutation(N)``, made on first use (a Fisher-Yates shuffle cannot be cut).
- sequential: slices of ``0..N-1``.
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple, cast

import numpy as np
from numpy.random import PCG64, Generator  # numpy loads its random module lazily: here, not at the first epoch


class BlockGroups(NamedTuple):
    """A sequence's positions grouped by quasi-random block, blocks in ascending order.

    Block ``b`` holds ``positions[bounds[b]:bounds[b + 1]]`` (ascending); ``positions`` is None when it
    would be ``0..N-1`` (a whole dataset, whose blocks are contiguous), so nothing per record is kept.
    """

    positions: np.ndarray | None
    bounds: np.ndarray

    @property
    def block_count(self) -> int:
        return len(self.bounds) - 1

    @staticmethod
    def of(block_ids: np.ndarray) -> "BlockGroups":
        """The groups of positions whose blocks are ``block_ids`` (any integers, one per position)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if len(ids) == 0:
            return BlockGroups(None, np.zeros(1, np.int64))
        in_order = bool((ids[1:] >= ids[:-1]).all())
        positions = None if in_order else np.argsort(ids, kind="stable")
        grouped = ids if positions is None else ids[positions]
        cuts = np.flatnonzero(grouped[1:] != grouped[:-1]) + 1
        return BlockGroups(positions, np.concatenate([[0], cuts, [len(ids)]]).astype(np.int64))


class EpochOrder:
    """Positions ``0..N-1`` in one epoch's order; ``pieces(lo, hi)`` yields ``order[lo:hi]`` in pieces."""

    def __init__(self, size: int) -> None:
        self.size = size

    def pieces(self, lo: int, hi: int) -> Iterator[np.ndarray]:
        yield np.arange(lo, hi, dtype=np.int64)

    def whole(self) -> np.ndarray:
        """The whole order as one array."""
        parts = list(self.pieces(0, self.size))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class RandomOrder(EpochOrder):
    """A uniform permutation, drawn from ``rng`` on first use."""

    def __init__(self, size: int, rng: Generator) -> None:
        super().__init__(size)
        self._rng = rng
        self._order: np.ndarray | None = None

    def pieces(self, lo: int, hi: int) -> Iterator[np.ndarray]:
        if self._order is None:
            self._order = self._rng.permutation(self.size).astype(np.int64)
        yield self._order[lo:hi]


class QuasiRandomOrder(EpochOrder):
    """The blocks of ``groups`` shuffled, then the records of each window of ``buffer_blocks`` consecutive
    shuffled blocks shuffled, window by window as positions are asked for (module docstring)."""

    def __init__(self, groups: BlockGroups, buffer_blocks: int, rng: Generator) -> None:
        sizes = np.diff(groups.bounds)
        super().__init__(int(sizes.sum()))
        self._groups = groups
        self._buffer_blocks = buffer_blocks
        count = groups.block_count
        self._ranked = rng.permutation(count) if self.size else np.zeros(0, np.int64)  # the block at each rank
        self._state = rng.bit_generator.state
        ends = np.concatenate([[0], np.cumsum(sizes[self._ranked])]).astype(np.int64)
        self._window_bounds = ends[np.r_[0:count:buffer_blocks, count]] if count else np.zeros(1, np.int64)
        self._last: tuple[int, np.ndarray] | None = None

    def pieces(self, lo: int, hi: int) -> Iterator[np.ndarray]:
        if lo >= hi:
            return
        bounds = self._window_bounds
        first = int(np.searchsorted(bounds, lo, side="right")) - 1
        for window in range(first, len(bounds) - 1):
            start, end = int(bounds[window]), int(bounds[window + 1])
            if start >= hi:
                return
            yield self._window(window)[max(lo, start) - start:min(hi, end) - start]

    def _window(self, window: int) -> np.ndarray:
        """Window ``window``'s records in their shuffled order (the last one asked for is kept)."""
        if self._last is not None and self._last[0] == window:
            return self._last[1]
        blocks = self._ranked[window * self._buffer_blocks:(window + 1) * self._buffer_blocks]
        starts, lengths = self._groups.bounds[blocks], np.diff(self._groups.bounds)[blocks]
        total = int(lengths.sum())
        records = np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
        if self._groups.positions is not None:
            records = self._groups.positions[records]
        bit_generator = PCG64()  # default_rng's
        bit_generator.state = cast(Any, self._state)
        bit_generator.advance(int(self._window_bounds[window]))
        within = Generator(bit_generator).random(total)
        order = records[np.argsort(within, kind="stable")].astype(np.int64)
        self._last = (window, order)
        return order
