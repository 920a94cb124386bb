"""``CUDAPrefetcher``: overlap the host-to-device copy and augmentation of batch k+1 with the step on k.

The copy runs on one side stream per prefetcher, created once. Before a batch is handed over, the
consumer's current stream waits on the side stream (a GPU-side wait: the host does not block), and
every tensor made on the side stream is ``record_stream``-ed on the consumer stream so the caching
allocator never hands its memory back to the side stream while the consumer still reads it (the race
in apex's prefetcher). Without CUDA the same code runs on the CPU, so training loops do not branch.

The preparing thread: batch k+1 is pulled from the loader (receiving it from a worker, and pinning
it where the loader pins), copied and augmented on a thread of the prefetcher's own (a daemon thread
a batch) while the training loop runs step k, so that none of that host work sits in the training
thread. The loop waits for the thread only when it is behind. The thread and the training loop never
use the loader at the same time: the loader's state is saved in the training thread between the
thread's pulls; a new pass, ``set_epoch``, ``state_dict`` and ``load_state_dict`` wait for the thread
first; and each pass's first batch, which the loop waits for anyway, is pulled by the training thread
(a loader starting its workers forks them from there, not from a second thread).

Encoded JPEG batches (``PackedDataset(decode=False)``: the workers only read) are decoded on that
thread, on the GPU with nvJPEG where torchvision has it (``reader.gpu.jpeg_batches``), then augmented
as usual; torchvision's decode blocks its calling thread until the batch is decoded.

Resume: the prefetcher holds one batch in advance, so the loader's own position is one batch ahead of
what the training loop received. ``state_dict()`` is therefore the loader's state snapshotted just
before the prefetcher pulled the batch after the last one handed over, plus the epoch and the number
of batches handed over. Augmentation draws come from a generator seeded per batch by
``(seed, epoch, rank, batch number)``, so they need no saved generator state: a resumed run draws
exactly what the uninterrupted run drew, and the state is the same on every rank.
"""
from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
import weakref
from typing import Any, Callable, Generator, Iterator, Protocol, Sequence

import torch

from reader.arguments import saved_position, whole_number
from reader.epoch_cursor import EpochCursor
from reader.gpu.augment import BatchAugment, augment_from, seeded_generator
from reader.gpu.jpeg_batches import decode_jpegs
from reader.list_batches import is_encoded, moved_together
from reader.pinning import pinned
from reader.ranks import rank_and_world_size

Batch = tuple[torch.Tensor, ...] | dict[str, Any]  # a mapping with make_loader(fields=...)
Pulled = tuple[Batch | None, float]  # a batch from the loader (None: the pass is over), and when it came


class Loader(Protocol):
    """What the prefetcher reads: batches, and how many an epoch has."""

    def __iter__(self) -> Iterator[Batch]: ...

    def __len__(self) -> int: ...


def default_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device``; None means the current CUDA device when there is one, else CPU.
    A CUDA device that is not there is a ``RuntimeError`` saying so (torch's own error comes later,
    from deep inside the first copy, and does not say what to change)."""
    if device is not None:
        chosen = torch.device(device)
        if chosen.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0 or (chosen.index or 0) >= count:
                raise RuntimeError(
                    f"device {str(device)!r}: torch sees {count} CUDA device{'s' * (count != 1)} "
                    f"(torch {torch.__version__}); pass device=None (CUDA when present, else CPU) or 'cpu', "
                    "or install a CUDA build of torch")
            if chosen.index is None:  # "cuda": the current device, named, so that other threads use it too
                return torch.device("cuda", torch.cuda.current_device())
        return chosen
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def forward_set_epoch(loader: object, epoch: int) -> None:
    """Tell the loader (or its batch sampler or sampler, for a plain DataLoader) which epoch starts."""
    for target in (loader, getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if hasattr(target, "set_epoch"):
            target.set_epoch(epoch)
            return


class CUDAPrefetcher(EpochCursor):
    """Wraps a loader of ``(uint8 images, int64 labels [B], *extras)`` batches and yields device batches
    ``(dtype images [B, 3, H', W'], int64 labels [B], *extras)``, normalized and augmented.

    ``images`` may be a ``[B, 3, H, W]`` tensor or, for a dataset packed without a crop, a list of
    ``[3, H_i, W_i]`` tensors, which an augmentation then brings to one size (``random_resized_crop``
    for training, ``center_crop`` with ``resize`` for evaluation). Extras (sample indices, a validity
    mask: any tensors with first dimension B) are copied to the device unchanged.

    The augmentation is ``augment=BatchAugment(...)``, or built from ``mean``, ``std`` and
    ``BatchAugment``'s keyword options given here (``flip=True``, ``random_resized_crop=224``, ...).

    At most two batches live on the device: the one being consumed and the next one in flight. The
    loader should pin its memory (``make_loader`` does when CUDA is there); unpinned batches are pinned
    here, on the host, before their asynchronous copy.

    Draws are seeded by ``(seed, epoch, rank, batch)``: ``seed`` is the run's seed (the same on every
    rank), ``rank`` is torch.distributed's when initialised (else 0), so ranks draw differently and
    every run repeats. Each iteration uses the epoch given to ``set_epoch``, or else the one after the
    previous iteration. ``state_dict()`` / ``load_state_dict()`` resume exactly after the batches the
    consumer received (see the module docstring); they need a loader with the same two methods.
    """

    def __init__(
        self,
        loader: Loader,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        *,
        augment: BatchAugment | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        rank: int | None = None,
        **augment_options: Any,
    ) -> None:
        self.loader = loader
        self.device = default_device(device)
        self.augment = augment_from(mean, std, augment, augment_options)
        self.seed = whole_number("seed", seed)
        self.rank = rank_and_world_size(None)[0] if rank is None else whole_number("rank", rank)
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._position: dict | None = None
        self._in_flight: _Preparing | None = None  # the batch the preparing thread works on, if any
        self._open_pass: weakref.ref[Generator[Batch, None, None]] | None = None  # the last pass started
        self.preparing_s = 0.0  # the consumer's waits for preparation (not for the loader), kept apart by StepTimer

    def __len__(self) -> int:
        """The loader's batches in a whole epoch (``make_loader``'s: also when resumed mid-epoch, when an
        iteration yields only the batches after ``state_dict()["batches"]``)."""
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration's draws, and forward it to the loader. Moving to another
        epoch than a loaded state's drops that state's position, as the loader does."""
        self._settle()
        if self._move_to_epoch(epoch):
            self._position = None
        forward_set_epoch(self.loader, self.epoch)

    def state_dict(self) -> dict:
        """Where the consumer is: ``{"epoch", "batches" (handed over this epoch), "seed", "loader"}``,
        the loader's state taken before it produced the batch after those. Between iterations: the
        position after the last batch handed over."""
        if self._position is not None:
            state = dict(self._position)  # saved by the training thread: the thread's pull may go on
        else:
            self._settle()
            state = {"epoch": self.epoch, "batches": self._resume_at, "seed": self.seed, "loader": self._loader_state()}
        if state["loader"] is None:
            raise TypeError(
                f"{type(self.loader).__name__} has no state_dict(): CUDAPrefetcher saves its position only over a "
                "loader that can save its own (reader.make_loader's can)"
            )
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``: the next iteration yields the batch after the saved ones, with the
        same augmentation draws as the saved run. A state that is not such a dict, or has an entry missing
        or mistyped, raises ``TypeError``/``ValueError`` naming it, before the loader's state is touched."""
        if not hasattr(self.loader, "load_state_dict"):
            raise TypeError(f"{type(self.loader).__name__} has no load_state_dict(): cannot resume it")
        state, epoch, batches, seed = saved_position(state, "loader")
        self._settle()
        self.loader.load_state_dict(state["loader"])
        self.seed = seed
        self._restore_position(epoch, batches)
        self._position = dict(state)

    def __iter__(self) -> Iterator[Batch]:
        """A pass; a pass still open on this prefetcher is closed first (its next ``next()`` ends it),
        as a DataLoader's new iterator resets the last one: both would read the same loader."""
        previous = self._open_pass() if self._open_pass is not None else None
        if previous is not None:
            previous.close()
        batches = self._batches(*self._take_pass())
        self._open_pass = weakref.ref(batches)
        return batches

    def _loader_state(self) -> dict | None:
        return self.loader.state_dict() if hasattr(self.loader, "state_dict") else None

    def _mark(self, epoch: int, batches: int) -> None:
        """Record the position after ``batches`` handed over: the loader's state before the next pull."""
        self._position = {"epoch": epoch, "batches": batches, "seed": self.seed, "loader": self._loader_state()}

    def _settle(self) -> None:
        """Wait until the preparing thread is done with the loader (called before the training thread
        uses the loader: a new pass, ``set_epoch``, ``state_dict``, ``load_state_dict``)."""
        if self._in_flight is not None:
            self._in_flight.settle()

    def _batches(self, epoch: int, first: int) -> Generator[Batch, None, None]:
        """Yield batch k while the preparing thread pulls batch k+1 from the loader and prepares it.
        Closing this generator (an early ``break`` does) waits for the batch in flight, then drops it
        and closes the loader's iterator; the position stays after the last batch handed over. Closed
        by an exception (Ctrl-C), it does not wait for a loader that may never answer."""
        self._settle()
        source = [iter(self.loader)]  # the thread's tasks reach it through this list, emptied at the end
        pending: _Preparing | None = None
        ready: Batch | None = None
        number = first
        try:
            self._mark(epoch, number)
            # The first pull is the training thread's, which waits for it anyway: a loader that starts
            # its workers then forks them from this thread, as it would without a prefetcher.
            pending = self._submit(source, epoch, number, (next(source[0], None), time.perf_counter()))
            while (ready := self._synced_for_consumer(pending)) is not None:
                number += 1
                self._mark(epoch, number)  # here, not in the thread: the loader is idle between pulls
                pending = self._submit(source, epoch, number)
                yield ready
            self._mark(epoch + 1, 0)
        finally:
            # The exception's class only: a frame holding the exception would be a cycle (exception,
            # traceback, this frame) keeping the prefetcher and the loader's workers alive until the
            # collector runs, which closes their queues before the DataLoader can stop its workers.
            closed_by = sys.exc_info()[0]
            if pending is not None:
                if closed_by is None or closed_by is GeneratorExit:
                    pending.settle()  # nothing is made after the loop ends
                pending.drop()
                if self._in_flight is pending:
                    self._in_flight = None
            pending = ready = None  # drop the batches in flight
            source.clear()  # and the loader's iterator (no finished task keeps it alive)

    def _submit(self, source: list[Iterator[Batch]], epoch: int, number: int,
                pulled: Pulled | None = None) -> _Preparing:
        """Hand the pull of batch ``number`` (unless ``pulled`` already) and its preparation to a
        preparing thread."""
        self._in_flight = _Preparing(lambda: self._pulled_and_prepared(source, epoch, number, pulled))
        return self._in_flight

    def _pulled_and_prepared(self, source: list[Iterator[Batch]], epoch: int, number: int,
                             pulled: Pulled | None) -> Pulled:
        """(The preparing thread.) The next batch from the loader, prepared (``_prepared``), or None at
        the end of the pass; and when the loader handed it over. The thread's current CUDA device is the
        prefetcher's, for the loader's code too."""
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with device:
            batch, at = (next(source[0], None), time.perf_counter()) if pulled is None else pulled
            return (None if batch is None else self._prepared(batch, epoch, number)), at

    def _prepared(self, batch: Batch, epoch: int, number: int) -> Batch:
        extras: list[Any] = []
        if isinstance(batch, dict):  # make_loader(fields=...): {"image", "label", <fields>}
            images, labels = batch["image"], batch["label"]
        else:
            images, labels, *extras = batch
        context = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with context:
            images = decode_jpegs(images, self.device) if is_encoded(images) else self._to_device(images)
            labels = self._to_device(labels).to(torch.int64)
            generator = seeded_generator(self.device, self.seed, epoch, self.rank, number)
            images = self.augment(images, generator)
            if isinstance(batch, dict):
                fields = {name: self._to_device(value) for name, value in batch.items()
                          if name not in ("image", "label")}
                return {"image": images, "label": labels, **fields}
            return (images, labels, *(self._to_device(extra) for extra in extras))

    def _to_device(self, tensors: Any) -> Any:
        """An asynchronous copy to the device (from pinned memory: unpinned tensors are pinned first);
        a list of views of one buffer (a batch of variable-size images) is copied as that buffer, other
        lists item by item, and what is not a tensor (a field's text) stays as it is."""
        if isinstance(tensors, (list, tuple)):
            return moved_together(list(tensors), self._to_device)
        if not isinstance(tensors, torch.Tensor):
            return tensors
        if self.stream is not None:
            tensors = pinned(tensors)
        return tensors.to(self.device, non_blocking=True)

    def _synced_for_consumer(self, pending: _Preparing) -> Batch | None:
        """Wait for the preparing thread's batch (None: the pass is over), then make the consumer's
        stream wait for it and protect its memory from reuse meanwhile. Of the time waited, what the
        thread spent preparing rather than waiting for the loader is added to ``preparing_s``."""
        waiting = time.perf_counter()
        batch, pulled = pending.result()
        self.preparing_s += max(0.0, time.perf_counter() - max(waiting, pulled))
        if batch is not None and self.stream is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_stream(self.stream)
            for tensor in _tensors(batch):
                tensor.record_stream(consumer)
        return batch


class _Preparing:
    """One batch pulled and prepared on a daemon thread of its own (a thread a batch costs some tens of
    microseconds). Daemon, so that a loader that never answers does not keep the process from exiting;
    at exit, work still under way is given ``EXIT_WAIT_S`` to finish (``_wait_at_exit``) while threads
    can still run, and waits once the interpreter is finalizing end at once (a daemon thread is stopped
    there without finishing). Where no thread can start (shutdown), the work runs in the calling thread."""

    def __init__(self, work: Callable[[], Pulled]) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._result: Pulled | None = None
        self._error: BaseException | None = None
        self._dropped = False
        self._thread = threading.Thread(target=self._run, args=(work,), name="CUDAPrefetcher", daemon=True)
        _under_way.add(self)
        try:
            self._thread.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            self._run(work)

    def _run(self, work: Callable[[], Pulled]) -> None:
        try:
            result = work()
            with self._lock:
                if not self._dropped:
                    self._result = result
        except BaseException as e:  # handed to the training thread by result()
            with self._lock:
                if not self._dropped:
                    self._error = e
        finally:
            self._done.set()

    def result(self) -> Pulled:
        """The prepared batch and when it was pulled, once ready, or the thread's exception raised here;
        handed over once (this object keeps no reference to either: an error's traceback holds the
        batch's tensors)."""
        self._done.wait()
        with self._lock:
            result, self._result = self._result, None
            error, self._error = self._error, None
        if error is not None:
            raise error
        assert result is not None
        return result

    def drop(self) -> None:
        """Forget the result or error, whenever the thread sets it (a batch nobody will take)."""
        with self._lock:
            self._dropped = True
            self._result = self._error = None

    def settle(self, timeout: float | None = None) -> None:
        """Wait until the work is done, unless called from its own thread (a generator closed by the
        garbage collector running there, which would wait for itself) or while the interpreter is
        finalizing (the thread may have been stopped)."""
        if threading.current_thread() is not self._thread and not sys.is_finalizing():
            self._done.wait(timeout)


# The work under way, waited for at exit (``_Preparing``).
EXIT_WAIT_S = 5.0
_under_way: weakref.WeakSet[_Preparing] = weakref.WeakSet()


@atexit.register
def _wait_at_exit() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for preparing in list(_under_way):
        preparing.settle(max(0.0, deadline - time.monotonic()))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a batch: a tuple, a mapping, and lists of tensors within them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
