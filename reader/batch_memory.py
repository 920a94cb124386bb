"""Batch buffers that are reused instead of freshly allocated, also across the DataLoader worker boundary.

Why: a fresh 38 MB batch (256 raw 224x224 images) is ~9,400 new pages, and faulting in a new page
costs 2-6 us on the virtual machines this was measured on: 20-50 ms per batch, five to ten times the
cost of reading the batch itself. Reusing buffers whose pages are already mapped removes that cost.
A new slot has its pages faulted in when it is made, before the batch's records are read
(``PackedDataset`` takes a JPEG batch's buffer first): on a cold cache a worker's first batches wait
for the disk, and that wait now covers the faults instead of the decode paying for them after it.

Three cases, picked per process:

- Main process (``num_workers=0``): a small pool of private buffers; a buffer is reused once no tensor
  refers to it any more (its storage's reference count is back to the pool's own).
- DataLoader worker started by ``make_loader`` (``enable_handoff`` is its ``worker_init_fn``): a
  small pool of shared-memory *slots*. Each slot ends with a trailer holding a magic tag and a state
  byte. ``hand_over`` (the collate function, run in the worker) marks a filled slot ``SENT``; the
  DataLoader passes the slot's file descriptor to the main process, which maps the same pages (torch
  keeps one mapping per slot while ``SlotReleaser`` holds it). On receipt the main process's
  ``SlotReleaser`` marks the slot ``RECEIVED``; once nothing there refers to the batch any more it
  writes ``FREE``, and the worker fills the slot again. (Releasing a ``SENT`` slot would be wrong:
  its batch may still be in the pipe, unseen by the main process.) The trailer also names the slot
  (worker pid, serial number); once the main process has mapped a slot it sets the trailer's
  ``KNOWN`` byte, and from then on the worker sends only a ``_SlotView`` (slot name, offset, shape,
  strides) that the main process turns back into a tensor on its mapping: no descriptor passed over a
  socket per batch (about a quarter of the main process's time per batch otherwise).
- Any other worker (a plain DataLoader): a fresh shared-memory buffer per batch, which the DataLoader
  sends without a copy; nobody would tell the worker when a slot is free.

A pool holds at most ``MAX_SLOTS`` buffers; past that (a consumer keeping many batches alive) batches
get fresh memory, so memory stays bounded and nothing waits for long. A ``make_loader`` worker makes
up to its batches in flight and one more slot at once (``enable_handoff``); beyond that it first waits
up to ``SLOT_WAIT_S`` for a slot to come back. Why: under a memory cap a slot made mid-epoch (38.5 MB)
is taken from the page cache, and the kernel then evicts blocks read ahead and not yet read, which
are read back around the pages it kept, at the disk's IOPS (BENCHMARKS.md, "Some runs are slower, and
why"); the slot that comes back a moment later (the main process frees a slot one batch late) costs
nothing. Where the slot is needed for good (a consumer that keeps a batch longer), the worker waits
once for that count and makes it.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import torch
from torch.utils.data import get_worker_info

from reader.torch_hooks import shared_uint8, storage_references

MAX_SLOTS = 8
MAGIC = b"packed-images\x00\x01\x02"
TRAILER = 64
STATE_BYTE = len(MAGIC)
KNOWN_BYTE = STATE_BYTE + 1  # set by the main process once it holds the slot's mapping
NAME_BYTES = slice(STATE_BYTE + 8, STATE_BYTE + 16)  # the slot's name: worker pid, serial (uint32 each)
FREE, SENT, RECEIVED = 0, 1, 2
_HEADROOM = 8  # slots for batches of varying size get 1/8 extra capacity, so slightly larger ones still fit
# Slots a worker's pool holds beyond its batches in flight: the one it fills, one the main process holds.
SLOTS_BEYOND_PREFETCH = 2
# How long a worker with a slot for each batch in flight and one more waits for one to come back before
# it makes another (module docstring), and how often it looks meanwhile.
SLOT_WAIT_S = 0.5
SLOT_POLL_S = 0.001


class _Slot:
    """One reusable buffer: ``capacity`` payload bytes followed by the trailer."""

    _serials = 0

    def __init__(self, capacity: int, shared: bool) -> None:
        self.tensor = _fresh(capacity + TRAILER, shared)
        self.tensor.zero_()  # faults every page in now, while a cold batch's blocks are still on their way
        self.capacity = capacity
        trailer = self.tensor.numpy()[capacity:]
        trailer[:STATE_BYTE] = np.frombuffer(MAGIC, dtype=np.uint8)
        trailer[STATE_BYTE] = FREE
        trailer[KNOWN_BYTE] = 0
        _Slot._serials += 1
        trailer[NAME_BYTES] = np.array([os.getpid(), _Slot._serials], np.uint32).view(np.uint8)

    def is_free(self) -> bool:
        """Free when marked so and no tensor but the slot's own refers to its memory (never, when this
        torch cannot count references: ``reader.torch_hooks``)."""
        return storage_references(self.tensor) == 1 and self.tensor.numpy()[-TRAILER + STATE_BYTE] == FREE


class _Pool:
    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self.slots: list[_Slot] = []
        self.full_batch: int | None = None  # the largest size ``reserve`` was told every batch has
        self.made_at_once: int | None = None  # slots made without waiting for one first (None: no wait)

    def reserve(self, nbytes: int) -> None:
        """Make a slot for a full batch of ``nbytes`` (if no slot fits one yet). From then on, a new slot
        for a batch of up to the largest size so reserved is made exactly that size, with no headroom."""
        self.full_batch = max(nbytes, self.full_batch or 0)
        if not any(slot.capacity >= nbytes for slot in self.slots) and len(self.slots) < MAX_SLOTS:
            self.slots.append(_Slot(_capacity(nbytes, self.full_batch), self.shared))

    def take(self, nbytes: int) -> torch.Tensor:
        """A ``uint8 [nbytes]`` view of a free slot, or of fresh memory when the pool is full. A new slot
        is a full batch's size where ``reserve`` said so and ``nbytes`` fits it, else ``nbytes`` with
        1/8 headroom. Past ``made_at_once`` slots, a new one is made only after ``SLOT_WAIT_S`` without
        one coming back, and the next count then waits again (module docstring)."""
        fitting = self._fitting(nbytes)
        if not fitting and self.made_at_once is not None and self.made_at_once <= len(self.slots) < MAX_SLOTS:
            deadline = time.monotonic() + SLOT_WAIT_S
            while not fitting and time.monotonic() < deadline:
                time.sleep(SLOT_POLL_S)
                fitting = self._fitting(nbytes)
            if not fitting:
                self.made_at_once = len(self.slots) + 1
        if fitting:
            return min(fitting, key=lambda s: s.capacity).tensor[:nbytes]
        free = [slot for slot in self.slots if slot.is_free()]
        if len(self.slots) >= MAX_SLOTS and free:
            self.slots.remove(free[0])
        if len(self.slots) < MAX_SLOTS:
            slot = _Slot(_capacity(nbytes, self.full_batch), self.shared)
            self.slots.append(slot)
            return slot.tensor[:nbytes]
        return _fresh(nbytes, self.shared)

    def _fitting(self, nbytes: int) -> list[_Slot]:
        """The free slots that hold ``nbytes``."""
        return [slot for slot in self.slots if slot.capacity >= nbytes and slot.is_free()]


def pool_bytes(workers: int, prefetch: int, batch_bytes: int, pinned: bool, exact: bool = False) -> int:
    """The memory a loader's batch buffers take once its workers run, for ``reader.loader`` to set aside
    before any exists: per worker a slot for each batch in flight (``prefetch``) and
    ``SLOTS_BEYOND_PREFETCH`` more, at most ``MAX_SLOTS``, each ``slot_size``; and, where batches are
    pinned, two pinned copies in the main process (the one in use and the next)."""
    slot = slot_size(batch_bytes, exact)
    return workers * min(prefetch + SLOTS_BEYOND_PREFETCH, MAX_SLOTS) * slot + (2 * batch_bytes if pinned else 0)


def slot_size(batch_bytes: int, exact: bool = False) -> int:
    """The bytes of a worker's slot made for a batch of ``batch_bytes``, its trailer included: that
    many where every batch has that size (``exact``: ``enable_handoff`` was told it), else with 1/8
    headroom for larger ones."""
    return _capacity(batch_bytes, batch_bytes if exact else None) + TRAILER


def _capacity(nbytes: int, full_batch: int | None = None) -> int:
    """The payload bytes of a slot made for a batch of ``nbytes``: a full batch's where every batch has
    that size (``full_batch``) and this one fits it, else 1/8 more, so that slightly larger batches fit."""
    if full_batch is not None and nbytes <= full_batch:
        return full_batch
    return nbytes + nbytes // _HEADROOM


_pool: _Pool | None = None
_pool_pid: int | None = None
_handoff_pid: int | None = None


def new_batch(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised ``uint8`` tensor of ``shape`` for one batch, from this process's pool."""
    nbytes = math.prod(shape)
    if get_worker_info() is not None and _handoff_pid != os.getpid():
        return _fresh(nbytes, shared=True).view(shape)
    return _this_pool().take(nbytes).view(shape)


def _this_pool() -> _Pool:
    """This process's pool (a forked worker starts a pool of its own, of shared memory)."""
    global _pool, _pool_pid
    pid = os.getpid()
    if _pool is None or _pool_pid != pid:
        _pool, _pool_pid = _Pool(shared=get_worker_info() is not None), pid
    return _pool


def enable_handoff(worker_id: int, batch_nbytes: int | None = None, prefetch: int | None = None) -> None:
    """``worker_init_fn``: this worker's batches go to a main process that runs ``SlotReleaser``.

    With ``prefetch`` (the DataLoader's batches in flight a worker) the worker makes a slot for each
    and one more (for the batch the main process holds) at once, and waits before it makes more
    (``_Pool.take``).

    With ``batch_nbytes`` (a full batch's bytes, when every batch has the same size) the worker makes
    its first slot now, while it waits for its first indices: faulting in a 38 MB slot takes 35-50 ms,
    which a cold epoch's first batch would otherwise wait for after the main process has sent them.
    Its slots are then all made that size, with no headroom (``_Pool.reserve``): 4.8 MB less a slot of
    256 images of 224x224, 19 MB less a worker with its four.
    """
    global _handoff_pid
    _handoff_pid = os.getpid()
    if prefetch is not None:
        _this_pool().made_at_once = prefetch + SLOTS_BEYOND_PREFETCH - 1
    if batch_nbytes:
        _this_pool().reserve(batch_nbytes)


def hand_over(batch: tuple) -> tuple:
    """Collate function run in the worker: mark the batch's slot as owned by the main process, send
    a slot the main process knows as a ``_SlotView`` (``SlotReleaser.receive`` makes it a tensor),
    and then the labels by value (``received_labels`` makes them a tensor again).

    Only to a main process known to unwrap them: ``_SlotView`` and by-value labels are sent only for a
    slot whose ``KNOWN`` byte the main process's ``SlotReleaser`` has set. A loader that some framework
    rebuilt around this collate function (accelerate's ``prepare_data_loader``, say) has no
    ``SlotReleaser``, so its batches stay plain tensors: no internal type reaches user code.

    Why by value: a small tensor crossing to the main process is moved into a new shared-memory file
    whose descriptor is passed over a socket, about 0.2 ms in the worker and more in the main process
    per batch; 2 KB of pickled numpy costs a tenth of that.
    """
    if _handoff_pid == os.getpid() and isinstance(batch, tuple) and len(batch) >= 2:
        images, labels = batch[0], batch[1]
        trailer = _trailer_of(images)
        if trailer is not None:
            state = trailer.numpy()
            state[STATE_BYTE] = SENT
            if state[KNOWN_BYTE]:
                if isinstance(images, torch.Tensor):
                    images = _SlotView(state[NAME_BYTES].tobytes(), int(images.storage_offset()),
                                       tuple(images.shape), tuple(images.stride()))
                if isinstance(labels, torch.Tensor):
                    labels = _ByValue(labels.numpy())
        batch = (images, labels, *batch[2:])
    return batch


class _SlotView:
    """A batch tensor in a slot the main process has mapped already: the slot's name and the view."""

    __slots__ = ("name", "offset", "shape", "stride")

    def __init__(self, name: bytes, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.name, self.offset, self.shape, self.stride = name, offset, shape, stride


class _ByValue:
    """A numpy array that ``received_labels`` turns back into a tensor in the main process."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


def received_labels(labels: object) -> object:
    """The labels of a batch from ``hand_over`` as a tensor again (anything else as it is)."""
    return torch.from_numpy(labels.array) if isinstance(labels, _ByValue) else labels


class SlotReleaser:
    """Main-process side: keeps each slot seen mapped, and frees it for its worker once unused."""

    def __init__(self) -> None:
        self._trailers: dict[int, torch.Tensor] = {}
        self._named: dict[bytes, torch.Tensor] = {}

    def receive(self, batch: object) -> object:
        """Take over the slot behind a batch just received from a worker, and return the batch with
        its images a tensor on that slot (anything else is returned as it is).

        Called on receipt, before anything else can refer to the batch: a slot still marked ``SENT``
        may be in flight, so only ``RECEIVED`` slots are ever released. A slot seen for the first
        time is marked ``KNOWN``, so its worker sends only its name from then on; a ``_SlotView`` is
        made a tensor here, at once, so that a batch the DataLoader holds back (it arrived before
        its turn) keeps its slot in use.
        """
        if not isinstance(batch, tuple) or not batch:
            return batch
        images = batch[0]
        if isinstance(images, _SlotView):
            trailer = self._named[images.name]
            batch = (torch.empty(0, dtype=torch.uint8).set_(
                trailer.untyped_storage(), images.offset, images.shape, images.stride), *batch[1:])
        else:
            found = _trailer_of(images)
            if found is None:
                return batch
            trailer, state = found, found.numpy()
            self._trailers.setdefault(trailer.data_ptr(), trailer)
            self._named.setdefault(state[NAME_BYTES].tobytes(), trailer)
            state[KNOWN_BYTE] = 1
        trailer.numpy()[STATE_BYTE] = RECEIVED
        return batch

    def slot_bytes(self) -> int:
        """The bytes of every slot this process has received a batch in (what ``pool_bytes`` set aside
        that exists now, pinned copies apart)."""
        return sum(trailer.untyped_storage().nbytes() for trailer in self._trailers.values())

    def release_unused(self) -> None:
        """Mark free every received slot that no tensor in this process refers to any more."""
        for trailer in self._trailers.values():
            if storage_references(trailer) == 1:
                state = trailer.numpy()
                if state[STATE_BYTE] == RECEIVED:
                    state[STATE_BYTE] = FREE


def _trailer_of(images: object) -> torch.Tensor | None:
    """The trailer of the slot ``images`` lives in, or None when it is not in a slot."""
    if isinstance(images, list):
        images = images[0] if images else None
    if not isinstance(images, torch.Tensor):
        return None
    storage = images.untyped_storage()
    size = storage.nbytes()
    if size < TRAILER:
        return None
    trailer = torch.empty(0, dtype=torch.uint8).set_(storage, size - TRAILER, (TRAILER,))  # type: ignore[call-overload]
    return trailer if trailer.numpy()[:STATE_BYTE].tobytes() == MAGIC else None


def _fresh(nbytes: int, shared: bool) -> torch.Tensor:
    return shared_uint8(nbytes) if shared else torch.empty(nbytes, dtype=torch.uint8)
