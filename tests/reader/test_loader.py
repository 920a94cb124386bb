"""make_loader: batches equal the dataset's records, under fork and spawn workers, resumable."""
from __future__ import annotations

import contextlib
import gc
import os
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from reader_helpers import make_images, pack_images

import reader.loader
import reader.torch_hooks
from reader import PackedDataset, batch_memory, make_loader
from reader.format.jpeg_decode import STORE_ALIGNMENT
from reader.loader import PackedLoader

COUNT = 37
BATCH = 8


@pytest.fixture(scope="module")
def raw_path(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("raw") / "packed"
    return pack_images(dst, make_images(COUNT, [(16, 24)]), [i % 3 for i in range(COUNT)],
                       storage="lmdb", encoding="raw", records_per_shard=15).path


@pytest.fixture(scope="module")
def jpeg_path(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("jpeg") / "packed"
    return pack_images(dst, make_images(COUNT, [(16, 24)]), [i % 3 for i in range(COUNT)],
                       storage="hdf5", encoding="jpeg", records_per_shard=15).path


def collect(loader: PackedLoader) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    images, labels = [], []
    for batch_images, batch_labels in loader:
        images.append(batch_images)
        labels.append(batch_labels)
    return images, labels


def assert_batches_match_records(ds: PackedDataset, loader: PackedLoader) -> None:
    """Every yielded row equals ``ds[i]`` for the sampler's indices, in order, each record once."""
    images, labels = collect(loader)
    indices = loader.shard_sampler.rank_order()
    flat_images = torch.cat(images)
    assert flat_images.dtype == torch.uint8 and flat_images.shape == (COUNT, 3, 16, 24)
    assert torch.cat(labels).dtype == torch.int64
    assert torch.cat(labels).tolist() == ds.targets[indices].tolist()
    assert sorted(indices.tolist()) == list(range(COUNT))
    for row, i in zip(flat_images, indices.tolist()):
        assert torch.equal(row, ds[i][0])


def test_in_process_loader(raw_path):
    ds = PackedDataset(raw_path)
    loader = make_loader(ds, BATCH, num_workers=0, order="random", seed=1)
    assert len(loader) == -(-COUNT // BATCH)
    assert_batches_match_records(ds, loader)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_processes(raw_path, jpeg_path, context):
    for path in (raw_path, jpeg_path):
        ds = PackedDataset(path)
        ds[0]
        loader = make_loader(ds, BATCH, num_workers=2, seed=2, multiprocessing_context=context)
        assert loader.persistent_workers
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert_batches_match_records(ds, loader)


def test_epochs_differ_and_seed_repeats(raw_path):
    ds = PackedDataset(raw_path)

    def run_epoch(seed: int, epoch: int) -> tuple[list[int], list[int]]:
        loader = make_loader(ds, BATCH, num_workers=0, order="random", seed=seed)
        loader.set_epoch(epoch)
        labels = torch.cat(collect(loader)[1]).tolist()
        return loader.shard_sampler.rank_order().tolist(), labels

    order, labels = run_epoch(4, 1)
    assert labels == ds.targets[order].tolist()
    assert run_epoch(4, 1) == (order, labels)
    assert run_epoch(4, 0)[0] != order


def test_loader_reads_whole_batches(raw_path, monkeypatch):
    def no_single_items(self, index):
        raise AssertionError("the loader must call read_batch, not __getitem__ or __getitems__")

    monkeypatch.setattr(PackedDataset, "__getitem__", no_single_items)
    monkeypatch.setattr(PackedDataset, "__getitems__", no_single_items)
    loader = make_loader(PackedDataset(raw_path), BATCH, num_workers=0)
    assert sum(len(labels) for _, labels in loader) == COUNT


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_equals_uninterrupted(raw_path, num_workers):
    ds = PackedDataset(raw_path)
    uninterrupted = make_loader(ds, BATCH, num_workers=num_workers, seed=7, drop_last=True)
    uninterrupted.set_epoch(3)
    expected, _ = collect(uninterrupted)

    first = make_loader(ds, BATCH, num_workers=num_workers, seed=7, drop_last=True)
    first.set_epoch(3)
    batches = iter(first)
    seen = [next(batches)[0] for _ in range(2)]
    state = first.state_dict()
    assert state == {"epoch": 3, "seed": 7, "order": "quasi_random", "start": 2 * BATCH, "world_size": 1,
                     "history": [], "records": COUNT, "layout": first.shard_sampler.layout()}

    resumed = make_loader(ds, BATCH, num_workers=num_workers, seed=0, drop_last=True)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)
    assert len(resumed) == len(expected) and resumed.batches_done() == 2, "len() is the whole epoch's"
    rest, _ = collect(resumed)
    assert len(seen) + len(rest) == len(expected)
    for got, want in zip(seen + rest, expected):
        assert torch.equal(got, want)
    assert resumed.state_dict()["start"] == len(expected) * BATCH


def test_ranks_get_equal_batches(raw_path):
    ds = PackedDataset(raw_path)
    loaders = [make_loader(ds, BATCH, num_workers=0, rank=r, world_size=2) for r in range(2)]
    labels = [torch.cat(collect(loader)[1]) for loader in loaders]
    assert len(labels[0]) == len(labels[1]) == -(-COUNT // 2)
    indices = np.concatenate([loader.shard_sampler.rank_order() for loader in loaders])
    assert set(indices.tolist()) == set(range(COUNT))


def test_jpeg_loader_yields_batches(jpeg_path):
    ds = PackedDataset(jpeg_path)
    images, labels = next(iter(make_loader(ds, BATCH, num_workers=0, order="sequential")))
    assert images.shape == (BATCH, 3, 16, 24) and labels.tolist() == ds.targets[:BATCH].tolist()
    for row, i in zip(images, range(BATCH)):
        assert torch.equal(row, ds[i][0])


def test_worker_batches_reuse_shared_slots(raw_path):
    """Batches come back in a few recycled shared-memory slots, even when epochs are cut short."""
    ds = PackedDataset(raw_path)
    loader = make_loader(ds, 4, num_workers=2, order="random", multiprocessing_context="fork", pin_memory=False)
    for epoch in range(6):
        loader.set_epoch(epoch)
        if epoch % 2:
            next(iter(loader))
            continue
        seen = 0
        for images, labels in loader:
            assert batch_memory._trailer_of(images) is not None
            for row, i in zip(images, labels):
                assert ds.targets[loader.shard_sampler.rank_order()[seen]] == i
                assert torch.equal(row, ds[int(loader.shard_sampler.rank_order()[seen])][0])
                seen += 1
        assert seen == COUNT
    assert len(loader._releaser._trailers) <= 2 * batch_memory.MAX_SLOTS


def test_batches_kept_alive_are_never_overwritten(raw_path, monkeypatch):
    """Holding more batches than a worker's pool has slots falls back to fresh memory, intact."""
    monkeypatch.setattr(batch_memory, "MAX_SLOTS", 2)
    ds = PackedDataset(raw_path)
    loader = make_loader(ds, 2, num_workers=2, order="sequential", multiprocessing_context="fork")
    images, labels = collect(loader)
    flat = torch.cat(images)
    assert torch.cat(labels).tolist() == ds.targets.tolist()
    for i, row in enumerate(flat):
        assert torch.equal(row, ds[i][0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_batches_from_workers(raw_path):
    ds = PackedDataset(raw_path)
    loader = make_loader(ds, BATCH, num_workers=2, order="sequential", pin_memory=True)
    seen = 0
    for images, labels in loader:
        assert images.is_pinned() and labels.is_pinned()
        for row in images:
            assert torch.equal(row, ds[seen][0])
            seen += 1
    assert seen == COUNT


@pytest.mark.parametrize("options, error, message", [
    ({"batch_size": 1.5}, TypeError, "batch_size must be an int, got 1.5"),
    ({"batch_size": None}, TypeError, "batch_size must be an int, got None"),
    ({"batch_size": 0}, ValueError, "batch_size must be positive, got 0"),
    ({"num_workers": 1.5}, TypeError, "num_workers must be an int, got 1.5"),
    ({"seed": None}, TypeError, "seed must be an int, got None"),
    ({"order": ""}, ValueError, "unknown order '': expected one of sequential, random, quasi_random"),
    ({"fields": "source"}, TypeError, r"fields must be a list of field names, got the string 'source' "
                                      r"\(for one field: fields=\['source'\]\)"),
])
def test_bad_arguments_are_named(raw_path, options, error, message):
    with pytest.raises(error, match=f"^{message}$"):
        make_loader(PackedDataset(raw_path), **{"batch_size": BATCH, "num_workers": 0, **options})


def test_state_from_a_dataset_of_another_size_is_refused(raw_path):
    loader = make_loader(PackedDataset(raw_path), BATCH, num_workers=0)
    assert loader.state_dict()["start"] == 0 and len(loader) == -(-COUNT // BATCH)
    next(iter(loader))
    state = loader.state_dict()
    smaller = make_loader(torch.utils.data.Subset(PackedDataset(raw_path), range(COUNT - 3)), BATCH, num_workers=0)
    with pytest.raises(ValueError, match=f"^saved state is for a dataset of {COUNT} records, this sampler's has "
                                         f"{COUNT - 3}$"):
        smaller.load_state_dict(state)
    assert len(smaller) == -(-(COUNT - 3) // BATCH), "the refused state left the loader as it was"


class Flipped(PackedDataset):
    """A user's subclass that changes what an item is: make_loader would never call this."""

    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        return image.flip(-1), label


class Batched(PackedDataset):
    def __getitems__(self, indices):
        return [(image.flip(-1), label) for image, label in super().__getitems__(indices)]


@pytest.mark.parametrize("cls, methods", [(Flipped, "__getitem__"), (Batched, "__getitems__")])
@pytest.mark.parametrize("wrap", ["plain", "subset", "concat"])
def test_a_subclass_that_reads_its_own_way_is_refused(raw_path, cls, methods, wrap):
    ds = cls(raw_path)
    given = {"plain": ds, "subset": torch.utils.data.Subset(ds, range(5)),
             "concat": torch.utils.data.ConcatDataset([PackedDataset(raw_path), ds])}[wrap]
    with pytest.raises(TypeError, match=f"^make_loader reads the records of {cls.__name__} with "
                                        rf"PackedDataset\.read_batch, so its own {methods} would never run; give it "
                                        "to a plain torch DataLoader instead, or apply that code to make_loader's "
                                        "batches$"):
        make_loader(given, BATCH, num_workers=0)


def test_jpeg_batch_is_decoded_shard_by_shard_as_each_is_read(jpeg_path, monkeypatch):
    """A JPEG batch's records are decoded right after their shard's read, before the next shard is
    read: on a cold cache the decode then overlaps the disk reading the next shard's blocks."""
    ds = PackedDataset(jpeg_path)
    events = []
    real_read, real_decode = ds._files.read, ds._decode
    monkeypatch.setattr(ds._files, "read", lambda shard, request: (events.append(("read", shard)),
                                                                   real_read(shard, request))[1])
    monkeypatch.setattr(ds, "_decode", lambda record, payload, out: (events.append(("decode", int(record))),
                                                                     real_decode(record, payload, out))[1])
    order = np.random.default_rng(3).permutation(COUNT)
    images, labels = ds.read_batch(order)
    shard_of = ds._shard_of(order)
    assert len(np.unique(shard_of)) >= 3
    expected = []
    for shard in np.unique(shard_of).tolist():
        expected += [("read", shard)] + [("decode", int(i)) for i in order[shard_of == shard]]
    assert events == expected
    assert labels.tolist() == ds.targets[order].tolist()
    for image, i in zip(images, order.tolist()):
        assert torch.equal(image, ds[i][0])


def test_workers_make_their_first_slot_before_their_first_batch(raw_path, jpeg_path, tmp_path):
    """make_loader's workers make a full batch's slot when they start (its pages faulted in), for
    datasets whose batches all have one size; the first batch then takes that slot, and later slots
    are made that size too (batches of other sizes get headroom)."""
    for path, room in ((raw_path, 0), (jpeg_path, STORE_ALIGNMENT)):  # JPEG: room to place the images
        loader = make_loader(PackedDataset(path), BATCH, num_workers=2)
        assert loader.worker_init_fn.keywords == {"batch_nbytes": BATCH * 3 * 16 * 24 + room, "prefetch": 2}
    mixed = pack_images(tmp_path / "mixed", make_images(6, [(16, 24), (12, 20)]), [0] * 6,
                        storage="lmdb", encoding="raw", records_per_shard=15).path
    keywords = make_loader(PackedDataset(mixed), BATCH, num_workers=2, prefetch_factor=3).worker_init_fn.keywords
    assert keywords == {"batch_nbytes": None, "prefetch": 3}
    pool = batch_memory._Pool(shared=False)
    pool.reserve(1000)
    pool.reserve(900)  # fits the slot made already
    (slot,) = pool.slots
    assert slot.capacity == 1000  # every full batch has that size: no headroom
    first = pool.take(1000)
    assert first.data_ptr() == slot.tensor.data_ptr() and len(pool.slots) == 1
    second = pool.take(800)  # the first slot is in use: a new one, a full batch's size
    assert second.data_ptr() == pool.slots[1].tensor.data_ptr() and pool.slots[1].capacity == 1000
    larger = pool.take(1200)  # over a full batch: a slot with headroom
    assert larger.data_ptr() == pool.slots[2].tensor.data_ptr()
    assert pool.slots[2].capacity == 1200 + 1200 // batch_memory._HEADROOM


class Sentinel:
    """Garbage in a reference cycle that writes, when freed, its name and which process freed it."""

    def __init__(self, record: Path, name: str) -> None:
        self.record, self.name, self.cycle = record, name, self

    def __del__(self) -> None:
        with open(self.record, "a") as out:
            out.write(f"{self.name} {os.getpid()}\n")


def freed(record: Path) -> list[str]:
    """The sentinels freed so far, as "NAME PID" lines, sorted."""
    return sorted(record.read_text().splitlines()) if record.exists() else []


def cuda_loader_with_collecting_workers(raw_path: Path, monkeypatch: pytest.MonkeyPatch) -> PackedLoader:
    """A loader with 2 forked workers, made by a process that has started CUDA (patched), whose workers
    collect garbage at their start, as a worker's collector would at some allocation."""
    start_worker = reader.loader.start_worker

    def collecting_start(worker_id: int, **options: object) -> None:
        gc.collect()
        start_worker(worker_id, **options)

    monkeypatch.setattr(reader.loader, "start_worker", collecting_start)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the parent holds CUDA memory
    return make_loader(PackedDataset(raw_path), 8, num_workers=2, multiprocessing_context="fork", pin_memory=False)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection while the block runs (the thresholds at 0): only explicit ones."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(0)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def leave_garbage(record: Path) -> None:
    """Two ``Sentinel``s left as garbage: "old" in the collector's oldest generation, where only a full
    collection looks, and "young", just made."""
    old = [Sentinel(record, "old")]
    gc.collect()  # alive, it joins the oldest generation
    old.clear()
    Sentinel(record, "young")


@contextlib.contextmanager
def full_collections() -> Iterator[list[int]]:
    """A list that gets an entry for each full collection started while the block runs."""
    full: list[int] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.callbacks.append(watch)
    try:
        yield full
    finally:
        gc.callbacks.remove(watch)


def test_forked_workers_do_not_inherit_the_parents_garbage(raw_path: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked worker that collected garbage inherited from the parent would free, in the child, the
    CUDA tensors of such garbage, which aborts it ("CUDA error: initialization error", seen on an H200):
    the parent's objects are frozen while the workers are forked, and the parent collects that garbage
    itself, the young at once (released, the frozen objects are in the oldest generation), the old at
    its next full collection, as without a loader. No full collection delays the first batch."""
    record, me = tmp_path / "freed", os.getpid()
    loader = cuda_loader_with_collecting_workers(raw_path, monkeypatch)
    with collector_paused():
        leave_garbage(record)
        with full_collections() as full:
            assert sum(len(labels) for _, labels in loader) == len(loader.dataset)
            gc.collect(1)
        assert full == [] and gc.get_freeze_count() == 0
        assert f"young {me}" in freed(record)  # (where a young collection takes part of the old one, "old" too)
        gc.collect()
        assert freed(record) == [f"old {me}", f"young {me}"]


def test_a_process_that_froze_objects_itself_keeps_them_frozen(raw_path: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Releasing the loader's freeze would release the process's own frozen objects too: there the
    garbage is collected before the fork instead, and what the process froze stays frozen."""
    record, me = tmp_path / "freed", os.getpid()
    loader = cuda_loader_with_collecting_workers(raw_path, monkeypatch)
    mine = ["an object the process froze"]
    with collector_paused():
        gc.freeze()
        try:
            leave_garbage(record)
            assert sum(len(labels) for _, labels in loader) == len(loader.dataset)
            assert not any(tracked is mine for tracked in gc.get_objects())  # the generations list no frozen one
        finally:
            gc.unfreeze()
    assert freed(record) == [f"old {me}", f"young {me}"]


def test_one_freeze_for_forked_workers_at_a_time() -> None:
    """A second thread's loader waits while another thread's workers are forked frozen: it would take
    that freeze for the process's own, and fork its workers with the garbage unfrozen."""
    events: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def first() -> None:
        with reader.torch_hooks.garbage_kept_from_forked_workers(True):
            entered.set()
            release.wait(30)
            events.append("first released")

    def second() -> None:
        with reader.torch_hooks.garbage_kept_from_forked_workers(True):
            events.append("second frozen")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    assert entered.wait(30)
    threads[1].start()
    threads[1].join(0.5)
    release.set()
    for thread in threads:
        thread.join(30)
    assert events == ["first released", "second frozen"] and gc.get_freeze_count() == 0


def test_a_process_without_cuda_forks_workers_without_a_full_collection(raw_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is frozen or collected for a process without CUDA, whose garbage holds no CUDA tensor."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # as on a machine without a GPU
    asked: list[bool] = []
    keeping = reader.torch_hooks.garbage_kept_from_forked_workers
    monkeypatch.setattr(reader.torch_hooks, "garbage_kept_from_forked_workers",
                        lambda forking: asked.append(forking) or keeping(forking))
    loader = make_loader(PackedDataset(raw_path), 8, num_workers=2, multiprocessing_context="fork", pin_memory=False)
    with collector_paused(), full_collections() as full:
        iterator = iter(loader)
        next(iterator)
    assert full == [] and asked == [False]
    del iterator
