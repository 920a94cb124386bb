"""``make_loader``: a DataLoader over a ``PackedDataset`` that moves whole batches, and can resume.

The DataLoader hands each worker a list of indices; the worker calls ``PackedDataset.read_batch``
(which reads the batch in a few coalesced reads, through ``reader.packed_view`` for a ``Subset`` or a
``ConcatDataset``) and the collate function passes the batch through.
Workers are persistent, so shard descriptors and batch buffers stay warm from one epoch to the next,
and their prefetch runs on into the next epoch (``reader.batch_stream``), so an epoch does not start
with a stall.
On a slow disk the main process also advises the blocks of batches about one and a half windows of
quasi-random blocks ahead of the workers (``reader.batch_stream``, ``reader.lookahead``), so the disk
reads the next window while the workers decode the current one.
Batch buffers are shared-memory slots that go back to their worker once the batch is no longer used
in the main process (``reader.batch_memory``), so no batch pays for fresh pages.
"""
from __future__ import annotations

import atexit
import functools
import gc
import os
import threading
import time
from typing import Any, Callable, Iterator, Sequence, cast

import numpy as np
import numpy.ma  # noqa: F401  (np.unique imports it on first use: 35 ms on a cold first batch's path)
import torch
from torch.utils.data import Dataset

from reader.arguments import whole_number
from reader.batch_memory import SlotReleaser, enable_handoff, hand_over, pool_bytes, received_labels, slot_size
from reader.batch_stream import BatchStream
from reader.fork_guard import warn_where_unguarded
from reader.list_batches import is_encoded, moved_together
from reader.lookahead import Lookahead
from reader.memory_budget import cache_room, worker_bytes
from reader.packed_view import PackedView, check_own_reads
from reader.pinning import pinned
from reader.ranks import any_rank_on_this_host, ranks_on_this_node
from reader.sampler import DEFAULT_BUFFER_BLOCKS, ShardSampler
from reader.torch_hooks import HookedDataLoader, worker_start_method

MAX_DEFAULT_WORKERS = 8
# How long a worker that ends waits for its data queue's feeder thread (``start_worker``): it sends the
# batches already queued in milliseconds; it takes longer only when blocked on a full pipe the main
# process no longer reads, and then it blocks outside torch, where ending it is harmless.
FEEDER_WAIT_S = 2.0


def default_num_workers() -> int:
    """The cores this process may use, shared among the ranks on this node (``ranks_on_this_node``:
    where the launcher does not say, known once the ranks have built a sampler), at most 8."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(MAX_DEFAULT_WORKERS, cores // ranks_on_this_node()))


Batch = tuple  # (images: uint8 [B,3,H,W] or B x [3,H,W], labels: int64 [B], *extras with first dim B)


class PackedLoader(HookedDataLoader):
    """A DataLoader that counts the batches it yields, so that ``state_dict()`` can resume mid-epoch.

    ``set_epoch(e)`` selects the epoch's order (call it before each epoch); ``state_dict()`` after
    any batch, then ``load_state_dict()`` on a new loader, yields exactly the batches the first
    loader would have yielded next. ``len()`` is always the whole epoch's number of batches, also
    after ``load_state_dict()``: a resumed loop yields only the ``len(loader) - batches_done()``
    batches left, so a consumer that counts from its restored position (Lightning's ``batch_idx``,
    ``CUDAPrefetcher``'s ``"batches"``, an LR schedule sized by ``len()``) ends the epoch exactly where
    an uninterrupted run would. With ``pin_batches`` each batch is copied into pinned memory by
    the iterating thread alone (``reader.pinning``; torch's caching host allocator reuses those
    blocks), which also frees its shared-memory slot at once.

    Epochs: each ``for`` loop yields the sampler's current epoch; without ``set_epoch`` calls every
    loop repeats the same epoch, as torch's ``DistributedSampler`` does. With workers, the batch
    sampler is a ``BatchStream`` and one worker iterator lives across loops: while a loop is read,
    the workers already prepare the next loop's first batches, guessing its epoch from how this
    loop's epoch followed the last complete loop's (the next epoch, or the same one again when
    ``set_epoch`` was not called). When a loop starts anywhere else (after a ``break`` or an
    unfinished loop, an unexpected ``set_epoch``, ``load_state_dict``), the
    worker iterator is reset, which drops the batches prepared in advance: a lost head start, never
    a wrong batch. After the last epoch the workers have decoded a few batches nobody reads. The
    workers get that endless stream (``BatchStream.endless``) while ``batch_sampler`` itself, walked
    directly, yields one epoch.

    Frameworks: Lightning uses it as it is (with ``use_distributed_sampler=False``, and built in a
    ``train_dataloader()`` hook under DDP); accelerate's ``prepare`` returns it unchanged, since
    every rank already reads its own share (batches stay on the host: ``CUDAPrefetcher`` moves them).

    ``evaluation``: each batch also carries the int64 dataset index of every sample and a bool mask,
    False for the padding samples that make the ranks' shares equal (see ``make_loader``).
    """

    # accelerate's ``prepare`` returns a loader so marked as it is (``Accelerator.prepare_data_loader``):
    # otherwise it rebuilds it around ``BatchSamplerShard``, which would split each rank's share again.
    _is_accelerate_prepared = True

    def __init__(self, *args, pin_batches: bool = False, evaluation: bool = False,
                 fields: Sequence[str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.evaluation = evaluation
        self.fields = list(fields) if fields is not None else None
        self._pin_batches = pin_batches
        self._releaser = SlotReleaser()
        self._pinned_bytes: list[int] = []  # the first two pinned batches' bytes (``buffer_bytes_made``)
        self._yielded = 0
        self._epoch_start = self.shard_sampler.start
        self._stream_next: tuple[int, int] | None = None
        self._last_complete_epoch: int | None = None

    @property
    def stream(self) -> BatchStream:
        """The batch sampler ``make_loader`` gave this loader."""
        return cast(BatchStream, self.batch_sampler)

    @property
    def view(self) -> PackedView:
        """The dataset the workers read (``source`` as one sequence of packed records)."""
        return cast(PackedView, self.dataset)

    @property
    def shard_sampler(self) -> ShardSampler:
        return self.stream.sampler

    @property
    def source(self) -> Dataset:
        """The dataset given to ``make_loader`` (``dataset`` is the ``PackedView`` the workers read)."""
        return self.view.source

    def buffer_bytes_made(self) -> int:
        """How much of the batch memory ``pool_bytes`` sets aside for this loader exists now: the slots
        batches came in, and the pinned copies (two in use at once: the first two batches pinned)."""
        return self.buffer_bytes_counter()()

    def buffer_bytes_counter(self) -> Callable[[], int]:
        """``buffer_bytes_made`` as a callable that holds no reference to the loader, for its
        ``Lookahead``: the loader holds that, and a cycle would keep a discarded loader's workers alive
        until the cyclic garbage collector ran."""
        return functools.partial(_bytes_made, self._releaser, self._pinned_bytes)

    def index_batches(self) -> "_EndlessBatches":
        """The endless stream, so that workers prefetch across epochs (the class docstring)."""
        return _EndlessBatches(self.stream)

    def batch_receiver(self) -> Callable[[Batch], Batch]:
        """Shows every batch received from a worker to the ``SlotReleaser`` (no slot stays marked as in
        use, even for batches dropped when an epoch is cut short)."""
        return functools.partial(_received, self._releaser)

    def set_epoch(self, epoch: int) -> None:
        self.shard_sampler.set_epoch(epoch)
        self._yielded = 0
        self._epoch_start = self.shard_sampler.start

    def state_dict(self) -> dict:
        """The sampler's state with ``start`` moved past every sample yielded so far this epoch."""
        state = self.shard_sampler.state_dict()
        state["start"] = self._epoch_start + self._yielded
        return state

    def batches_done(self) -> int:
        """Batches of the current epoch yielded before the position a resumed loop starts at."""
        return self.stream.batches_done()

    def load_state_dict(self, state: dict) -> None:
        """Continue after a ``state_dict()``: the next loop yields that epoch's batches left (``len()``
        stays the whole epoch's)."""
        self.shard_sampler.load_state_dict(state)
        self._yielded = 0
        self._epoch_start = self.shard_sampler.start
        self._stream_next = None

    def __iter__(self) -> Iterator[Batch | dict[str, Any]]:  # type: ignore[override]
        self.shard_sampler.check_ranks()
        epoch, start = self.shard_sampler.epoch, self.shard_sampler.start
        self._yielded = 0
        self._epoch_start = start
        self._releaser.release_unused()
        count = self.stream.batches_left()
        if count == 0:
            return
        batches = self._stream_at(epoch, start)
        self._stream_next = None
        share = self.shard_sampler.rank_share(epoch) if self.evaluation else None
        order = self.shard_sampler.rank_order(epoch) if self.fields is not None else None
        for _ in range(count):
            batch = next(batches)
            batch = (batch[0], received_labels(batch[1]), *batch[2:])
            if share is not None:
                taken = slice(start + self._yielded, start + self._yielded + len(batch[1]))
                batch = (*batch, torch.from_numpy(share[0][taken]), torch.from_numpy(share[1][taken]))
            if self._pin_batches:
                batch = (_pinned(batch[0]), *(pinned(tensor) for tensor in batch[1:]))
                if len(self._pinned_bytes) < 2:
                    images = batch[0]
                    self._pinned_bytes.append(images.nbytes if isinstance(images, torch.Tensor)
                                              else sum(image.nbytes for image in images))
            self._releaser.release_unused()
            taken = slice(start + self._yielded, start + self._yielded + len(batch[1]))
            self._yielded += len(batch[1])
            yield batch if order is None else self._as_mapping(batch, order[taken])
        self._stream_next = self.stream.following(epoch, start)
        self._last_complete_epoch = epoch

    def _as_mapping(self, batch: Batch, positions: np.ndarray) -> dict[str, Any]:
        """A batch as ``{"image", "label", ("index", "valid"), <fields>...}`` (``fields=`` asked for)."""
        mapping = {"image": batch[0], "label": batch[1]}
        if self.evaluation:
            mapping.update(index=batch[2], valid=batch[3])
        mapping.update(self.view.field_batch(positions, self.fields or []))
        return mapping

    def _stream_at(self, epoch: int, start: int) -> Iterator[Batch]:
        """An iterator whose next batch is the first of the pass ``(epoch, start)``: the live worker
        iterator when it is already there, else a new or reset one (which drops what it prefetched)."""
        live = self.live_iterator()
        if live is not None and self._stream_next == (epoch, start):
            return live
        self.stream.epoch_step = int(self._last_complete_epoch != epoch)
        self.stream.read_first_tables()
        return super().__iter__()


class _EndlessBatches:
    """What the DataLoader's iterators draw from: ``stream.endless()``, with the current pass's length."""

    def __init__(self, stream: BatchStream) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[list[int]]:
        return self.stream.endless()

    def __len__(self) -> int:
        return len(self.stream)


def _bytes_made(releaser: SlotReleaser, pinned_bytes: list[int]) -> int:
    return releaser.slot_bytes() + sum(pinned_bytes)


def _received(releaser: SlotReleaser, data: Batch) -> Batch:
    return (data[0], releaser.receive(data[1]), *data[2:])


def _pinned(images: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """The batch's images in pinned memory: a list of views of one buffer as one pinned copy of it
    (``reader.list_batches``); encoded records stay where they are, since they are decoded from host
    memory (nvJPEG reads them itself, the host decoder needs no pinning)."""
    if not isinstance(images, list):
        return pinned(images)
    if is_encoded(images):
        return images
    return moved_together(images, pinned)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    num_workers: int | None = None,
    order: str | None = None,
    seed: int = 0,
    drop_last: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    pad: bool = True,
    evaluation: bool = False,
    buffer_blocks: int = DEFAULT_BUFFER_BLOCKS,
    prefetch_factor: int | None = None,
    pin_memory: bool | None = None,
    multiprocessing_context: str | None = None,
    fields: Sequence[str] | None = None,
) -> PackedLoader:
    """A loader yielding ``(uint8 [B, 3, H, W], int64 [B])`` batches of ``dataset``.

    ``dataset``: a ``PackedDataset``, a ``Subset`` of one (e.g. from ``reader.split``) or a
    ``ConcatDataset`` of them, nested in any way; the quasi-random order then shuffles the blocks of
    the underlying files, so a subset or a mix reads as sequentially as a whole dataset. Batches that
    mix datasets of a ``ConcatDataset`` are gathered with one copy. Anything else raises ``TypeError``
    (use a plain ``DataLoader`` for it: ``PackedDataset`` follows torch's conventions there), and so
    does a subclass of those three that overrides ``__getitem__`` or ``__getitems__``, which
    ``make_loader`` would never call.

    Order (default ``"quasi_random"``, ``"sequential"`` with ``evaluation``), seed, rank, world_size, pad
    and buffer_blocks go to ``ShardSampler`` (the blocks are the dataset's: ``block_bytes``). ``seed`` is
    the run's seed, the same on every rank (checked when torch.distributed is initialised: there
    ``make_loader`` is collective, called by every rank in the same order, unless ``world_size`` differs
    from the process group's; its two ``all_gather_object`` calls check the seed and count the ranks
    on each host, and make the ranks of a host stream alike). ``num_workers``
    defaults to ``default_num_workers()`` (0 reads in the calling process); ``prefetch_factor`` (batches in
    flight per worker) to 2; ``pin_memory`` (batches copied to pinned memory before they are yielded) to
    whether CUDA is available. ``multiprocessing_context`` ("fork", "spawn", "forkserver") is passed to the
    DataLoader.

    ``evaluation=True``: batches are ``(images, labels, indices, valid)``. Every rank gets a disjoint
    contiguous share of the dataset, padded to the same number of samples (so the same number of
    batches: no DDP hang); ``indices`` (int64) are the samples' positions in ``dataset`` and ``valid``
    (bool) is False for the padding, so that sums of ``metric * valid`` over all ranks count every
    sample exactly once (docs/reading.md, "Evaluation with DDP").

    ``fields`` (names of the dataset's extra fields, and ``"source"`` for the source paths): batches
    become mappings ``{"image", "label", <each field>}`` (plus ``"index"``, ``"valid"`` with
    ``evaluation``), the fields batched as ``reader.record_fields`` says. The main process gathers
    them from columns it reads once; the default tuples are unchanged. The datasets of a
    ``ConcatDataset`` must agree on each such field's type (else ``ValueError``).

    With workers and a dataset that reads ahead (``readahead``), the main process advises
    each batch's blocks about one and a half windows before the workers get it, less where a streamed
    dataset's memory is short (``reader.lookahead``), and asks for the record tables of its shards
    further ahead still (``reader.batch_stream``).
    """
    if evaluation and (drop_last or not pad):
        raise ValueError("make_loader(evaluation=True) covers every sample exactly once: it needs "
                         "drop_last=False and pad=True")
    batch_size = whole_number("batch_size", batch_size, 1)
    if num_workers is not None:
        num_workers = whole_number("num_workers", num_workers)
    if isinstance(fields, str):
        raise TypeError(f"fields must be a list of field names, got the string {fields!r} "
                        f"(for one field: fields=[{fields!r}])")
    check_own_reads(dataset)
    view = PackedView(dataset)
    if fields is not None:
        view.check_fields(fields)
    order = ("sequential" if evaluation else "quasi_random") if order is None else order
    sampler = ShardSampler(view, order=order, seed=seed, rank=rank, world_size=world_size,
                           pad=pad, buffer_blocks=buffer_blocks)
    workers = default_num_workers() if num_workers is None else num_workers
    advise = view.advise if workers > 0 and view.readahead else None
    prefetch = (2 if prefetch_factor is None else prefetch_factor) if workers > 0 else None
    in_flight = workers * (prefetch or 0)  # batches the DataLoader's workers hold beyond those received
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    # for JPEG records of varying sizes the estimate reads some record tables
    batch_bytes = view.batch_bytes_estimate(batch_size) if advise else 0
    batch_nbytes = view.batch_nbytes(batch_size)  # every full batch's size, where they have one
    exact = batch_nbytes is not None  # the workers' slots are then made that size (``enable_handoff``)
    reserved = pool_bytes(workers, prefetch or 0, batch_bytes, pin, exact)
    start_method = worker_start_method(multiprocessing_context)
    # streamed where the page cache cannot keep the dataset once this rank's loader and those of the
    # other ranks on this node run (each alike); where one rank of the node finds so, all stream: the
    # pages one drops are the others' too
    to_come = ranks_on_this_node() * (reserved + workers * worker_bytes(start_method))
    streams = advise is not None and view.shard_bytes() > cache_room(to_come)
    view.streaming = any_rank_on_this_host(streams, sampler.world_size) and advise is not None  # all ask
    if workers > 0:
        warn_where_unguarded(start_method)
    lookahead = Lookahead(view, buffer_blocks, in_flight * batch_size, reserved,
                          unsent=workers * slot_size(batch_bytes, exact)) if advise else 0
    loader = PackedLoader(
        view,
        batch_sampler=BatchStream(sampler, batch_size, drop_last, advise=advise, lookahead=lookahead,
                                  read_tables=view.read_tables_ahead if advise else None, in_flight=in_flight),
        collate_fn=hand_over,
        worker_init_fn=functools.partial(start_worker, batch_nbytes=batch_nbytes, prefetch=prefetch),
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=prefetch,
        pin_batches=pin,
        evaluation=evaluation,
        multiprocessing_context=multiprocessing_context,
        fields=fields,
    )
    if isinstance(lookahead, Lookahead):
        lookahead.made = loader.buffer_bytes_counter()
    return loader


def start_worker(worker_id: int, batch_nbytes: int | None = None, prefetch: int | None = None) -> None:
    """``worker_init_fn`` of ``make_loader``: hand batches over (``enable_handoff``, which makes the
    first batch slot now when every batch has ``batch_nbytes``, and makes slots beyond the ``prefetch``
    batches in flight and one more only after a wait), drop the pages read of a streamed
    dataset (``PackedView.enter_worker``) and freeze the objects the worker starts with (``gc.freeze``).

    Why freeze: a worker starts with torch's ~170,000 objects (inherited under fork, imported under
    spawn). A full collection walks them all, about 0.1 s on a slow core, once every few hundred
    batches as the worker's own short-lived objects are promoted: a pause longer than the whole prefetch
    queue, so the training loop waited for one batch once an epoch (``scripts/bench_scale.py``'s gap
    column). Frozen objects are skipped by collections; the worker's own garbage is still collected.

    Also, at exit, wait for the data queue's feeder thread (``_join_queue_feeders``).
    """
    enable_handoff(worker_id, batch_nbytes, prefetch)
    info = torch.utils.data.get_worker_info()
    if info is not None and isinstance(info.dataset, PackedView):
        info.dataset.enter_worker()
    gc.freeze()
    atexit.register(_join_queue_feeders)


def _join_queue_feeders() -> None:
    """Wait, at most ``FEEDER_WAIT_S`` seconds, for this process's ``multiprocessing`` queue feeder threads.

    Why: when the loader shuts down, torch's worker loop calls ``data_queue.cancel_join_thread()`` and
    returns while the queue's feeder (a daemon thread) may still be pickling or freeing a batch's
    tensors, in torch's C++ with the GIL released. A spawned worker then finalizes its interpreter
    (fork and forkserver workers end with ``os._exit``, so this handler never runs there), and on
    Python < 3.14 a daemon thread taking the GIL back during finalization is ended with
    ``pthread_exit``, whose unwinding through torch's C++ frames calls ``std::terminate``: the worker
    died by SIGABRT ("terminate called without an active exception", pytorch/pytorch#38228), about
    one worker shutdown in twenty. ``atexit`` handlers run before finalization starts; torch's own
    ``close()`` has already queued the feeder's end, so the wait lasts until the queued batches are sent.
    The feeder is found by the name CPython's ``multiprocessing.queues`` gives it (3.10-3.13); were it
    renamed, nothing is joined and the exit is as before.
    """
    deadline = time.monotonic() + FEEDER_WAIT_S
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread" and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
