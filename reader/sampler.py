"""``ShardSampler``: record orders that keep reads long and sequential yet batches well mixed, for DDP.

Orders:

- ``"sequential"``: records in dataset order.
- ``"random"``: a uniform random permutation.
- ``"quasi_random"`` (default): the dataset is cut into blocks of contiguous records (about
  ``block_bytes`` of shard file each, less for small datasets: ``reader.blocks``), the blocks are shuffled,
  then records are shuffled within each window of ``buffer_blocks`` consecutive shuffled blocks. A
  batch draws from ~``buffer_blocks`` places in the files, so a slow disk sees long sequential reads,
  while a record can still land anywhere in the epoch.

Every order is a function of ``(seed, epoch)`` only: the same seed repeats, each epoch differs.

Distributed rule: the epoch order is made a multiple of ``world_size`` long, by wrapping around to its
beginning (``pad=True``, the default: the first few records of the order are seen twice) or by
dropping its tail (``pad=False``: a few records are skipped this epoch). Rank ``r`` then takes the
``r``-th contiguous slice of it, so every rank yields the same number of samples (no DDP hang at epoch
end), the ranks' slices are disjoint apart from the wrapped duplicates, and their union is the whole
dataset when padding. Contiguous slices (not strides) keep each rank's reads sequential.
``rank_share`` says which samples are such wrapped duplicates (``valid`` False), so that evaluation
counts every record exactly once (``make_loader(evaluation=True)`` yields that mask).

One seed per run: the order is one order for all ranks, split between them, so every rank must use the
same seed (and see the same dataset). When torch.distributed is initialised the ranks check this
with one collective at construction (``all_gather_object``: every rank must build its sampler, and
under NCCL each rank's CUDA device must be set first, as DDP needs anyway), and all raise
``ValueError`` when they disagree: a per-rank seed (``seed=rank``) would give overlapping shares, some
records seen twice and others never. The same collective tells each rank how many ranks share its
host (``reader.ranks.ranks_on_this_node``, for launchers that do not set ``LOCAL_WORLD_SIZE``).

Resume: ``start`` skips the first ``start`` samples of this rank's epoch order. It is part of
``state_dict()`` and stays in force until ``set_epoch`` moves to another epoch. ``len()`` stays the
whole epoch's length (``samples_done + samples_left``) while a resumed iteration yields only the
``samples_left``: a consumer that counts from its restored position (Lightning's ``batch_idx``, a
``for step in range(done, len(loader))`` loop, an LR schedule sized by ``len()``) reaches the
epoch's end exactly, as with torchdata's ``StatefulDistributedSampler``. The state records the
number of records (a state saved over a dataset of another size is refused), the quasi-random order's
block ``layout`` (a state saved mid-epoch over blocks cut otherwise, by another ``block_bytes=`` or
``buffer_blocks=`` or a release that cuts them differently, is refused: its order differs, so resuming
would repeat some records and skip others) and the ``world_size``;
ranks run in lockstep (equal batches), so after ``start`` samples on each of ``w`` ranks the epoch's
unseen samples are the tails of the ``w`` slices. Loaded with another world size, the sampler continues
the same epoch with exactly those: their concatenation, in order, is split again between the new ranks
(``history`` holds each such change). Nothing is lost or repeated (apart from wrapped duplicates when
the rest does not divide evenly, flagged in ``rank_share``), and the next epochs are the new world
size's ordinary epochs. Continuing was chosen over refusing because jobs are often resumed on whatever
number of GPUs is free, and an epoch of a large dataset is too long to throw away.
"""
from __future__ import annotations

from typing import Any, Iterator, cast

import numpy as np
import torch.distributed as dist
import xxhash
from torch.utils.data import Dataset, Sampler

from reader.arguments import saved_state, whole_number
from reader.epoch_order import EpochOrder, QuasiRandomOrder, RandomOrder
from reader.packed_view import as_view
from reader.ranks import across_the_process_group, note_hosts, rank_and_world_size, share_per_rank, this_host

ORDERS = ("sequential", "random", "quasi_random")
DEFAULT_BUFFER_BLOCKS = 16


class ShardSampler(Sampler[int]):
    """Record indices of one rank's share of a packed dataset's epoch (see the module docstring).

    ``dataset`` is a ``PackedDataset`` (or anything with ``len()`` and its ``manifest``), a ``Subset``
    or a ``ConcatDataset`` of them (``reader.packed_view``): the quasi-random blocks are those of the
    underlying files, so a subset or a concatenation keeps the slow-disk order. The indices are
    positions in ``dataset``. ``rank`` and ``world_size`` default to torch.distributed's when it is
    initialised, else to 0 and 1.
    """

    def __init__(
        self,
        dataset: Dataset,
        order: str = "quasi_random",
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        pad: bool = True,
        buffer_blocks: int = DEFAULT_BUFFER_BLOCKS,
    ) -> None:
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}: expected one of {', '.join(ORDERS)}")
        distributed = dist.is_available() and dist.is_initialized()
        self._ranks_by_default = rank is None and world_size is None and not distributed
        rank, world_size = rank_and_world_size(rank, world_size)
        if buffer_blocks < 1:
            raise ValueError(f"buffer_blocks must be positive, got {buffer_blocks}")
        seed = whole_number("seed", seed)
        view = as_view(dataset)
        self.num_records = len(view)
        self.order = order
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.pad = pad
        self.buffer_blocks = buffer_blocks
        self.epoch = 0
        self.start = 0
        self.history: list[tuple[int, int]] = []
        self._groups = view.block_groups()
        self._blocks_digest: str | None = None  # of which records each block holds (``layout``)
        self._orders: dict[tuple, EpochOrder] = {}
        if across_the_process_group(world_size):
            per_rank_seed = "pass the run's seed (e.g. make_loader(seed=args.seed)), not a per-rank one"
            _check_same_on_every_rank({
                "seed": (seed, per_rank_seed), "order": (order, per_rank_seed),
                "number of records": (self.num_records, per_rank_seed),
                "block layout": (self.layout(), "open the dataset with the same block_bytes= and buffer_blocks= "
                                                "on every rank")})

    def layout(self) -> str | None:
        """What the quasi-random order depends on besides seed and epoch, as one line: how many blocks,
        in windows of how many, and a digest of which records each block holds; None for the other
        orders, which do not depend on blocks. ``state_dict()`` keeps it, so that ``load_state_dict``
        refuses to resume mid-epoch over blocks cut otherwise (module docstring, "Resume")."""
        if self.order != "quasi_random":
            return None
        if self._blocks_digest is None:
            digest = xxhash.xxh3_64(self._groups.bounds.astype("<i8").tobytes())
            if self._groups.positions is not None:
                digest.update(self._groups.positions.astype("<i8").tobytes())
            self._blocks_digest = digest.hexdigest()
        return f"{self._groups.block_count} blocks in windows of {self.buffer_blocks}, xxh3 {self._blocks_digest}"

    @property
    def samples_per_rank(self) -> int:
        """How many samples each rank gets in the current pass (``start`` not applied)."""
        return self._fitted(self._remaining(self.history), self.world_size) // self.world_size

    @property
    def samples_done(self) -> int:
        """How many samples each rank had yielded of this epoch before the next one this sampler yields:
        ``start``, plus the ``start`` of every pass before a world-size change (the ranks ran in lockstep)."""
        return sum(self.passes_done())

    @property
    def samples_left(self) -> int:
        """How many samples an iteration yields now: this rank's share of the pass, less ``start``."""
        return self.samples_per_rank - self.start

    def passes_done(self) -> list[int]:
        """The samples each rank had yielded in each pass of this epoch so far: one entry per world-size
        change in ``history``, then this pass's ``start``."""
        return [start for _, start in self.history] + [self.start]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order to yield; moving to another epoch clears ``start``."""
        epoch = whole_number("epoch", epoch)
        if epoch != self.epoch:
            self.start = 0
            self.history = []
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "seed": self.seed, "order": self.order, "start": self.start,
                "world_size": self.world_size, "history": [list(step) for step in self.history],
                "records": self.num_records, "layout": self.layout()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``: the next iteration yields what the saved run would have next.

        A state saved with another world size continues the same epoch: the samples the saved ranks
        had not reached yet are split between this run's ranks (module docstring). A state without
        ``world_size`` (saved before it was recorded) is taken as this run's world size. A state saved
        over a dataset of another size (``records``), or mid-epoch over another quasi-random block
        ``layout()`` (both not checked in states saved before they were recorded), or with a missing or
        mistyped entry raises ``ValueError``/``TypeError`` naming it.
        """
        self.check_ranks()
        state = saved_state(state, ("epoch", "seed", "order", "start"))
        if state["order"] != self.order:
            raise ValueError(f"saved state is for order {state['order']!r}, this sampler uses "
                             f"{self.order!r}")
        if "records" in state and whole_number("saved records", state["records"]) != self.num_records:
            raise ValueError(f"saved state is for a dataset of {state['records']} records, this sampler's has "
                             f"{self.num_records}")
        epoch, seed = whole_number("saved epoch", state["epoch"]), whole_number("saved seed", state["seed"])
        steps = state.get("history", [])
        if not isinstance(steps, (list, tuple)) or not all(
                isinstance(step, (list, tuple)) and len(step) == 2 for step in steps):
            raise ValueError(f"saved history must be a list of [world_size, start] pairs, got {steps!r:.80}")
        history = [(whole_number("saved history world_size", world, 1), whole_number("saved history start", start))
                   for world, start in steps]
        saved_world = whole_number("saved world_size", state.get("world_size", self.world_size), 1)
        start = whole_number("saved start", state["start"])
        self._check_layout(state.get("layout"), [*history, (saved_world, start)])
        if saved_world != self.world_size:
            history, start = [*history, (saved_world, start)], 0
        remaining = self._remaining(history)
        per_rank = self._fitted(remaining, self.world_size) // self.world_size
        if not 0 <= start <= per_rank:
            raise ValueError(f"saved start {start} is outside this rank's {per_rank} samples")
        self.epoch, self.seed, self.history, self.start = epoch, seed, history, start

    def _check_layout(self, saved: object, passes: list[tuple[int, int]]) -> None:
        """Refuse a saved block ``layout()`` other than this sampler's where it matters: mid-epoch (the
        saved ``passes``, ``history`` then the last pass's ``(world_size, start)``, have begun the epoch
        and left some of it), where the rest of the epoch is the rest of the saved order. A state saved
        at an epoch's start or end resumes into an order of this sampler's own, as any new epoch does."""
        if saved is not None and not isinstance(saved, str):
            raise TypeError(f"saved layout must be a string or None, got {type(saved).__name__}")
        mine = self.layout()
        if saved is None or saved == mine:
            return
        begun = len(passes) > 1 or passes[-1][1] > 0
        if not begun or self._remaining(passes) == 0:
            return
        raise ValueError(
            f"saved state is mid-epoch in a quasi-random order over other blocks (saved: {saved}; this "
            f"sampler's: {mine}): the dataset was opened with another block_bytes= or buffer_blocks= than "
            "the saved run's, or by a reader release that cuts blocks otherwise, and resuming would repeat "
            "some records and skip others. Open it as the saved run did; or, to read this epoch again from "
            "its start, load the state with 'start' set to 0 and 'history' set to []")

    def __len__(self) -> int:
        """The whole epoch's samples on this rank: ``samples_done + samples_left`` (iteration yields
        the ``samples_left``; the module docstring says why)."""
        return self.samples_done + self.samples_left

    def __iter__(self) -> Iterator[int]:
        """This rank's share from ``start``, each window of the order built as it is reached."""
        self.check_ranks()
        skip = self.start
        for piece, _ in self.rank_pieces():
            cut = min(skip, len(piece))
            skip -= cut
            yield from piece[cut:].tolist()

    def check_ranks(self) -> None:
        """Raise ``RuntimeError`` when this sampler took rank 0 of 1 because torch.distributed was not
        initialised yet, and it has been since with more ranks: every rank would read the whole epoch.
        Frameworks initialise it inside ``fit`` (Lightning), after a loader passed to it was built."""
        if self._ranks_by_default and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                f"this loader was built before torch.distributed was initialised, so it reads the whole dataset "
                f"as rank 0 of 1, and so would each of the {dist.get_world_size()} ranks: build it after "
                "init_process_group (with Lightning: in the train_dataloader() hook of the LightningModule or "
                "DataModule), or pass rank= and world_size=")

    def rank_order(self, epoch: int | None = None) -> np.ndarray:
        """This rank's whole share of ``epoch`` (default: the current one), ``start`` not applied."""
        return self.rank_share(epoch)[0]

    def rank_share(self, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(indices, valid)``: this rank's share of ``epoch`` (default: the current one, continuing
        its ``history`` of world-size changes), ``start`` not applied; ``valid`` is False for the
        wrapped duplicates that only pad the share to equal length."""
        pieces = list(self.rank_pieces(epoch))
        if not pieces:
            return np.zeros(0, np.int64), np.zeros(0, bool)
        return np.concatenate([p for p, _ in pieces]), np.concatenate([v for _, v in pieces])

    def rank_pieces(self, epoch: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``rank_share(epoch)`` in consecutive pieces, each computed only when it is reached: only the
        windows of the epoch's order that this rank's share covers are built (``reader.epoch_order``)."""
        current = self.epoch if epoch is None else epoch
        if current == self.epoch and self.history:
            yield self._continued_share(self._epoch(current).whole())
            return
        total = self._fitted(self.num_records, self.world_size)
        per = total // self.world_size
        lo, hi = self.rank * per, (self.rank + 1) * per
        while lo < hi:  # positions past the order's end wrap around to its beginning (padding)
            turn, at = divmod(lo, self.num_records)
            end = min(hi, (turn + 1) * self.num_records)
            for piece in self._epoch(current).pieces(at, at + end - lo):
                yield piece, np.full(len(piece), turn == 0)
            lo = end

    def _continued_share(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This rank's share of the current epoch's ``order`` after the ``history`` of world-size changes."""
        valid = np.ones(len(order), dtype=bool)
        for world, start in self.history:
            order, valid = self._fit(order, valid, world)
            per = len(order) // world
            rest = (np.arange(world)[:, None] * per + np.arange(start, per)[None, :]).reshape(-1)
            order, valid = order[rest], valid[rest]
        order, valid = self._fit(order, valid, self.world_size)
        per = len(order) // self.world_size
        first = self.rank * per
        return order[first:first + per], valid[first:first + per]

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """Every record once, in ``epoch``'s order (default: the current epoch), before the split
        between ranks. Taking the epoch as an argument lets a loader prepare the next epoch's batches
        while this one is still being read, without touching the sampler's state."""
        return self._epoch(self.epoch if epoch is None else epoch).whole()

    def _epoch(self, epoch: int) -> EpochOrder:
        """``epoch``'s order, built piece by piece as it is read; the two most recent epochs are kept
        (the loader's stream runs into the next epoch while the current one is still being read)."""
        key = (self.order, self.seed, self.buffer_blocks, epoch)
        order = self._orders.get(key)
        if order is None:
            if self.order == "sequential":
                order = EpochOrder(self.num_records)
            else:
                rng = np.random.default_rng((self.seed, epoch))
                order = (RandomOrder(self.num_records, rng) if self.order == "random"
                         else QuasiRandomOrder(self._groups, self.buffer_blocks, rng))
            while len(self._orders) >= 2:
                del self._orders[next(iter(self._orders))]
            self._orders[key] = order
        return order

    def _remaining(self, history: list[tuple[int, int]]) -> int:
        """How many samples of the epoch are left after ``history``'s passes (padding included)."""
        remaining = self.num_records
        for world, start in history:
            per_rank = self._fitted(remaining, world) // world
            if not 0 <= start <= per_rank:
                raise ValueError(f"saved start {start} is outside the {per_rank} samples of each of "
                                 f"the {world} saved ranks")
            remaining = world * (per_rank - start)
        return remaining

    def _fitted(self, length: int, world: int) -> int:
        """``length`` padded (or cut, without ``pad``) to a multiple of ``world`` (``reader.ranks``)."""
        return share_per_rank(length, world, self.pad) * world

    def _fit(self, order: np.ndarray, valid: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
        total = self._fitted(len(order), world)
        if total <= len(order):
            return order[:total], valid[:total]
        wrapped = np.resize(np.arange(len(order)), total)
        return order[wrapped], valid[wrapped] & (np.arange(total) < len(order))


def _check_same_on_every_rank(checked: dict[str, tuple[Any, str]]) -> None:
    """Raise ``ValueError`` on every rank when the ranks passed different values, ``checked`` mapping
    each value's name to the value and what to do where the ranks disagree on it; and, in the same
    collective, learn how many ranks share this host (``reader.ranks.note_hosts``)."""
    gathered: list[dict | None] = [None] * dist.get_world_size()
    values = {name: value for name, (value, _) in checked.items()}
    dist.all_gather_object(gathered, {"values": values, "host": this_host()})
    entries = cast(list[dict], gathered)  # every rank sent one
    note_hosts([entry["host"] for entry in entries])
    for name, (_, remedy) in checked.items():
        seen = [entry["values"][name] for entry in entries]
        if len(set(seen)) > 1:
            each = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(seen))
            raise ValueError(
                f"ShardSampler: the ranks disagree on the {name} ({each}); it must be the same on every "
                f"rank: the sampler splits one order between the ranks itself, so {remedy}")
