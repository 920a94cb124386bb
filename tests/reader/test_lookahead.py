"""A loader's lookahead: measured when the loader is made; for a streamed dataset measured again as it
streams, following the free memory down and back up, never above the first reading.

The schedule is checked against a free memory set by the test; the real thing on a process in a real
memory cgroup that takes most of its free memory while its lookahead is asked for.
"""
from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
from hostile_helpers import subprocess_env
from reader_helpers import make_images, memory_cgroup, pack_images

import reader.loader
import reader.lookahead
from reader import PackedDataset, make_loader
from reader.batch_memory import TRAILER
from reader.lookahead import LOOKAHEAD_WINDOWS, STREAM_SHARE, Lookahead, lookahead_samples
from reader.memory_budget import FORKED_WORKER_BYTES, FreeMemory
from reader.packed_view import PackedView

TIMEOUT_S = 60
RECORDS = 200


@pytest.fixture(scope="module")
def large_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 raw 256x256 records (39 MB) in one LMDB shard."""
    images = make_images(4, [(256, 256)]) * (RECORDS // 4)
    return pack_images(tmp_path_factory.mktemp("large") / "packed", images, [i % 3 for i in range(RECORDS)],
                       storage="lmdb", encoding="raw", records_per_shard=RECORDS).path


def streamed(path: Path) -> PackedView:
    view = PackedView(PackedDataset(path, block_bytes=1))  # one record a block
    view.streaming = True
    return view


def test_measured_when_made_then_again_as_it_streams_never_above_the_first(large_records, monkeypatch):
    """The first reading, when the loader is made, sets all its batch buffers aside; later ones, every
    ``REMEASURE_S``, set aside those not made yet (less the slots the workers may be filling), and the
    lookahead follows the free memory down (with the warning once a window no longer fits) and back up,
    never above the first reading."""
    view = streamed(large_records)
    shard_bytes = view.shard_bytes()
    record = shard_bytes // RECORDS
    window = shard_bytes * 16 // RECORDS
    reserved, unsent = 50 * record, 10 * record
    readings: list[int] = []
    free = reserved + round((window + 20 * record) / STREAM_SHARE)

    def measured() -> FreeMemory:  # no files mapped
        readings.append(free)
        return FreeMemory(free, free)

    monkeypatch.setattr(reader.lookahead, "measure_free_memory", measured)
    lookahead = Lookahead(view, 16, 8, reserved, unsent)
    first = lookahead()
    assert first == lookahead_samples(view, 16, 8, reserved) and 0 < first < round(LOOKAHEAD_WINDOWS * 16)
    assert lookahead() == first and len(readings) == 2  # when made, and here; not again before REMEASURE_S
    monkeypatch.setattr(reader.lookahead, "REMEASURE_S", 0.0)
    free -= unsent  # the workers' first slots made, none back yet: not counted twice
    assert lookahead() == first
    free -= reserved // 2 - unsent  # half the buffers made, back in batches: no longer set aside
    lookahead.made = lambda: reserved // 2
    assert lookahead() == first
    free = round((window + 14 * record) / STREAM_SHARE)  # all made, and memory taken besides
    lookahead.made = lambda: reserved
    assert lookahead() == lookahead_samples(view, 16, 8) and 0 < lookahead() < first
    free = int(window / STREAM_SHARE) - 3  # not a window
    monkeypatch.setattr(reader.lookahead, "_warned_short_of_memory", False)
    with pytest.warns(RuntimeWarning, match=r"room for this streamed dataset's blocks \(\d+ MiB: 0.4 of the \d+ "
                      "MiB free with the loader.s batch buffers made"):
        assert lookahead() == 0
    free = 100 * shard_bytes
    assert lookahead() == first


def test_every_reading_keeps_a_slot_per_worker_beyond_the_mapped_files(large_records, monkeypatch):
    """Where the files the processes map leave less than the share, each reading, the first and the
    later ones, bounds the blocks by what they leave less a batch slot per worker (``unsent``)."""
    view = streamed(large_records)
    record = view.shard_bytes() // RECORDS
    window = view.shard_bytes() * 16 // RECORDS
    reserved, unsent = 50 * record, 10 * record
    free = reserved + round((window + 20 * record) / STREAM_SHARE)
    beyond = reserved + unsent + window + 12 * record  # under the share once the slack is kept
    monkeypatch.setattr(reader.lookahead, "measure_free_memory", lambda: FreeMemory(free, beyond))
    lookahead = Lookahead(view, 16, 8, reserved, unsent)
    first = lookahead()
    assert first == lookahead_samples(view, 16, 8, reserved, unsent) == 12 * RECORDS * record // view.shard_bytes() - 8
    assert first < lookahead_samples(view, 16, 8, reserved)  # without the slack, more
    monkeypatch.setattr(reader.lookahead, "REMEASURE_S", 0.0)
    lookahead.made = lambda: reserved  # all made: later readings set nothing aside, but keep the slack
    free, beyond = free - reserved, beyond - reserved - 4 * record
    fewer = first - 4 * RECORDS * record // view.shard_bytes()
    assert lookahead() == lookahead_samples(view, 16, 8, 0, unsent) == fewer


def test_a_dataset_that_is_not_streamed_is_measured_once(large_records, monkeypatch):
    view = streamed(large_records)
    view.streaming = False
    monkeypatch.setattr(reader.lookahead, "REMEASURE_S", 0.0)
    monkeypatch.setattr(reader.lookahead, "measure_free_memory", lambda: pytest.fail("measured"))
    lookahead = Lookahead(view, 16, 8, 1 << 30, 1 << 29)
    assert lookahead() == lookahead() == round(LOOKAHEAD_WINDOWS * 16)


def test_under_a_real_memory_limit_the_lookahead_follows_what_the_process_takes(large_records):
    """A process in a real memory cgroup (1 GiB) asks a streamed view's lookahead (one window: the whole
    39 MB set) as it takes memory: 1.5 windows at the start; less once it holds all but about 200 MB of
    what was free; nothing, with the warning, at all but about 60 MB; all again once it lets go."""
    group = memory_cgroup(1 << 30)
    code = """
import sys, time, warnings
import numpy as np
from reader import PackedDataset
from reader.lookahead import REMEASURE_S, Lookahead
from reader.memory_budget import measure_free_memory
from reader.packed_view import PackedView
view = PackedView(PackedDataset(sys.argv[1], block_bytes=1))
view.streaming = True
lookahead = Lookahead(view, len(view), 0, 0)
answers = [lookahead()]
held = []
for left in (200, 60):
    held.append(np.ones(max(measure_free_memory().total - (left << 20), 0), np.uint8))
    time.sleep(REMEASURE_S)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answers.append(lookahead())
    answers.append(len(caught))
del held
time.sleep(REMEASURE_S)
print(*answers, lookahead())
"""
    try:
        move_in = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        done = subprocess.run(["sh", "-c", move_in, "sh", sys.executable, "-c", code, str(large_records)],
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=subprocess_env())
        assert done.returncode == 0, done.stderr
        first, fewer, warned_fewer, none, warned_none, again = map(int, done.stdout.split())
        assert first == again == round(LOOKAHEAD_WINDOWS * RECORDS)
        assert 0 < fewer < first and not warned_fewer
        assert none == 0 and warned_none == 1
    finally:
        group.rmdir()


def test_a_loader_reckons_its_batches_from_the_record_tables(tmp_path, monkeypatch):
    """For JPEG records of varying sizes a loader with workers reckons its batch slots as the record
    tables say (``PackedDataset.batch_bytes_estimate``, which reads some), both to decide whether the
    dataset streams (``cache_room``, given the slots of the ranks' loaders) and, streamed, to set the
    slots aside; a loader without workers reads no table when made."""
    sizes = [(13, 15), (40, 24)]
    path = pack_images(tmp_path / "varied", make_images(12, sizes), [0] * 12, storage="lmdb", encoding="jpeg",
                       records_per_shard=4).path
    ds = PackedDataset(path)
    make_loader(ds, 4, num_workers=0)
    assert ds._columns is None
    asked: list[int] = []
    monkeypatch.setattr(reader.loader, "cache_room", lambda to_come: asked.append(to_come) or 1)  # streamed
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    loader = make_loader(ds, 4, num_workers=2, pin_memory=False, multiprocessing_context="fork")
    batch = 4 * -(-(13 * 15 * 3 + 40 * 24 * 3) // 2 // 32) * 32 + 32
    slot = batch + batch // 8 + TRAILER
    assert loader.view.streaming and ds._columns is not None and ds._columns.loaded.all()  # its 4 shards
    assert loader.batch_sampler.lookahead.unsent == 2 * slot
    assert asked == [3 * (2 * 4 * slot + 2 * FORKED_WORKER_BYTES)]  # 3 ranks: 2 workers of 4 slots each

def test_the_loader_s_lookahead_counts_the_buffers_made(large_records, monkeypatch):
    """make_loader's stream gets a ``Lookahead``, measured when the loader is made with all its batch
    buffers set aside, which learns from the loader which of them exist (the slots its batches came
    back in), without a reference to it."""
    readings: list[int] = []
    monkeypatch.setattr(reader.lookahead, "measure_free_memory",
                        lambda: readings.append(1 << 40) or FreeMemory(1 << 40, 1 << 40))
    monkeypatch.setattr(reader.loader, "cache_room", lambda to_come: 1)  # streamed
    ds = PackedDataset(large_records, block_bytes=1)
    loader = make_loader(ds, 8, num_workers=2, pin_memory=False, multiprocessing_context="fork")
    lookahead = loader.batch_sampler.lookahead
    assert loader.view.streaming and isinstance(lookahead, Lookahead) and len(readings) == 1
    slot = ds.batch_bytes(8) + TRAILER  # every full batch has that size: no headroom
    assert lookahead.made() == 0 and lookahead.unsent == 2 * slot
    labels = [label for _, batch_labels in loader for label in batch_labels.tolist()]
    assert labels == ds.targets[loader.shard_sampler.rank_order()].tolist()
    assert lookahead.made() == loader.buffer_bytes_made()
    assert 2 * slot <= loader.buffer_bytes_made() <= lookahead.reserved  # a slot a worker at least
    gone = weakref.ref(loader)
    gc.disable()
    try:
        del loader
        assert gone() is None  # no cycle through the lookahead: a discarded loader's workers end at once
    finally:
        gc.enable()
