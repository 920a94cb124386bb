"""Streaming a dataset larger than the page cache can keep: blocks advised once a pass and dropped by the
main process once every batch reading them is received; records of scattered batches dropped by the
workers that read them.

Residency is read from the real page cache (``mincore`` over a mapping of the shard file), after real
reads of a real shard file; only the disk's slowness is simulated, where a test needs a cold cache.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from reader_helpers import make_images, pack_images

import reader.loader
import reader.lookahead
import reader.mapped_copy
import reader.shard_io
from reader import PackedDataset, make_loader
from reader.batch_memory import pool_bytes, slot_size
from reader.lookahead import LOOKAHEAD_WINDOWS, STREAM_SHARE, lookahead_samples
from reader.memory_budget import FreeMemory
from reader.packed_view import PackedView
from reader.shard_io import MAX_READAHEAD_BLOCKS
from reader.streamed_blocks import StreamedBlocks, StreamPosition

PAGE = os.sysconf("SC_PAGE_SIZE")
COUNT = 60
_libc = ctypes.CDLL(None, use_errno=True)


def resident_pages(path: Path) -> np.ndarray:
    """Which pages of the file at ``path`` the page cache holds (``mincore``)."""
    size = path.stat().st_size
    vector = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
        view = np.frombuffer(mapped, np.uint8)
        status = _libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vector)
        del view  # before the mapping closes
    assert status == 0, os.strerror(ctypes.get_errno())
    return np.frombuffer(vector, np.uint8) & 1 == 1


def cache(path: Path) -> None:
    """Put the whole file in the page cache, page by page; skip where the cache will not say so.

    Page by page, without read-ahead: a kernel with large folios (ext4 since Linux 6.16) may otherwise
    cache the file in pieces of many pages, and it drops a piece only when a drop covers all of it, so
    which pages of a record survive its drop would depend on how the file happened to be read.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for offset in range(0, os.fstat(fd).st_size, PAGE):
            os.pread(fd, 1, offset)
    finally:
        os.close(fd)
    if not resident_pages(path).all():
        pytest.skip("this file system does not keep what was read in the page cache")


def evict(path: Path) -> None:
    """Drop the whole file from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def inner_pages(offset: int, nbytes: int) -> range:
    """The pages lying wholly inside ``[offset, offset + nbytes)``."""
    return range(-(-offset // PAGE), (offset + nbytes) // PAGE)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """One LMDB shard of raw records of about five pages each (72x96x3 bytes)."""
    images = make_images(COUNT, [(72, 96)])
    return pack_images(tmp_path_factory.mktemp("streaming") / "packed", images, [i % 3 for i in range(COUNT)],
                       storage="lmdb", encoding="raw", records_per_shard=COUNT + 1)


@pytest.fixture(autouse=True)
def drop_records_of_any_size(monkeypatch):
    """These records are 20 KB, under the size a streaming read drops (tested on its own below)."""
    monkeypatch.setattr(reader.shard_io, "DROP_MIN_RECORD_BYTES", 0)


def shard_file(ds: PackedDataset) -> Path:
    return ds.path / ds.manifest.shards[0].file


def blocks_of(packed_path: Path, records_per_block: int) -> PackedDataset:
    shard = PackedDataset(packed_path).manifest.shards[0]
    return PackedDataset(packed_path, block_bytes=-(-records_per_block * shard.bytes // shard.records))


# A batch over more blocks than a read ahead gathers (random order): the main process advises none of
# them, so the worker that reads it drops it. With one record a block, these records are such a batch.
SCATTERED = list(range(MAX_READAHEAD_BLOCKS + 8))


def test_drop_behind_drops_the_pages_of_a_scattered_batch(packed):
    ds = blocks_of(packed.path, 1)
    path = shard_file(ds)
    cache(path)
    ds.drop_behind = True
    read = SCATTERED
    images, labels = ds.read_batch(read)
    for row, i in zip(images, read):
        assert (row.numpy() == packed.images[i].transpose(2, 0, 1)).all()
    assert labels.tolist() == [packed.labels[i] for i in read]
    resident = resident_pages(path)
    dropped = {page for i in read for page in inner_pages(int(ds._offsets[i]), int(ds._nbytes[i]))}
    assert dropped and not resident[sorted(dropped)].any()
    kept = {page for i in set(range(COUNT)) - set(read)
            for page in inner_pages(int(ds._offsets[i]), int(ds._nbytes[i]))}
    assert resident[sorted(kept)].all()  # no record that was not read lost a page


def test_a_gathered_batch_is_left_to_the_main_process(packed):
    """A batch within a few blocks (quasi-random order): its blocks are the main process's to drop, once
    every batch reading them is received, so the worker keeps the pages (the next pass may share them)."""
    ds = blocks_of(packed.path, 5)
    path = shard_file(ds)
    cache(path)
    ds.drop_behind = True
    ds.read_batch([3, 17, 4, 40])
    assert resident_pages(path).all()


def test_records_under_the_drop_size_keep_their_pages(packed, monkeypatch):
    ds = blocks_of(packed.path, 1)
    path = shard_file(ds)
    cache(path)
    ds.drop_behind = True
    size = int(ds.manifest.shards[0].bytes // COUNT)
    monkeypatch.setattr(reader.shard_io, "DROP_MIN_RECORD_BYTES", 2 * size)
    ds.read_batch(SCATTERED)
    assert resident_pages(path).all()
    monkeypatch.setattr(reader.shard_io, "DROP_MIN_RECORD_BYTES", size // 2)
    ds.read_batch(SCATTERED)
    assert not resident_pages(path)[sorted(inner_pages(int(ds._offsets[4]), int(ds._nbytes[4])))].any()


def slow_disk(monkeypatch) -> None:
    """Reads that do not wait find nothing cached, as on a disk slower than the probe. (Here a miss's
    own small read-ahead may complete before the non-blocking read gives up, and it then succeeds.)"""
    real_preadv = os.preadv

    def preadv(fd, buffers, offset, flags=0):
        if flags & os.RWF_NOWAIT:
            raise BlockingIOError(11, "cold")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(reader.shard_io.os, "preadv", preadv)


class FadviseLog:
    """Every ``posix_fadvise`` as ``(advice, offset, length)``; reads that do not wait find nothing cached."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[int, int, int]] = []
        slow_disk(monkeypatch)
        monkeypatch.setattr(reader.shard_io.os, "posix_fadvise",
                            lambda fd, offset, length, advice: self.calls.append((advice, offset, length)))
        monkeypatch.setattr(reader.mapped_copy.MappedFile, "resident", lambda self, start, end: False)

    def of(self, advice: int) -> list[tuple[int, int]]:
        return [(offset, length) for kind, offset, length in self.calls if kind == advice]


def test_a_streaming_read_advises_the_blocks_it_misses_and_drops_nothing_of_a_gathered_batch(packed, monkeypatch):
    """A cold gathered batch read with drop_behind asks for its blocks, as any cold read does, without
    clearing them (the main process clears a block once a pass, before its own advice), and drops
    nothing (the main process drops its blocks)."""
    ds = blocks_of(packed.path, 5)
    ds.targets  # the table: block bounds known
    disk = FadviseLog(monkeypatch)
    ds.drop_behind = True
    ds.read_batch([12, 6, 13])
    bounds = ds._files._block_starts
    assert disk.of(os.POSIX_FADV_DONTNEED) == []
    assert {offset for offset, _ in disk.of(os.POSIX_FADV_WILLNEED)} >= {int(bounds[1]), int(bounds[2])}


def test_a_streaming_read_reads_an_evicted_block_whole_again(packed, monkeypatch):
    """Advised pages the kernel evicted before a worker got to them (memory the job took since): the
    worker's read of one record brings its whole block back into the page cache, not just the record."""
    ds = blocks_of(packed.path, 5)
    path = shard_file(ds)
    cache(path)  # (skips where the page cache will not say what it holds)
    evict(path)
    assert not resident_pages(path).any()
    slow_disk(monkeypatch)
    ds.drop_behind = True
    ds.read_batch([6])
    bounds = ds._files._block_starts
    block = range(-(-int(bounds[1]) // PAGE), int(bounds[2]) // PAGE)
    deadline = time.monotonic() + 5
    while not resident_pages(path)[block.start:block.stop].all() and time.monotonic() < deadline:
        time.sleep(0.01)  # the rest of the block is read in the background
    assert resident_pages(path)[block.start:block.stop].all()
    later = sorted({page for i in range(20, COUNT) for page in inner_pages(int(ds._offsets[i]), int(ds._nbytes[i]))})
    assert not resident_pages(path)[later].any()  # nor the records of the blocks after the next


def test_streamed_advice_reads_each_block_once_a_pass_and_drops_it_once_received(packed, monkeypatch):
    ds = blocks_of(packed.path, 5)
    ds.targets
    bounds = ds._files._block_starts

    def block(k: int) -> tuple[int, int]:
        return int(bounds[k]), int(bounds[k + 1] - bounds[k])

    disk = FadviseLog(monkeypatch)
    streamed = StreamedBlocks()
    ds.advise([12, 6], streamed, StreamPosition(batch=0, pass_number=0, received=0))  # blocks 1 and 2
    assert disk.of(os.POSIX_FADV_DONTNEED) == [block(1), block(2)]  # cleared, then read
    assert {offset for offset, _ in disk.of(os.POSIX_FADV_WILLNEED)} >= {block(1)[0], block(2)[0]}
    calls = len(disk.calls)
    ds.advise([9, 11], streamed, StreamPosition(1, 0, 0))  # blocks 1 and 2 again: advised in this pass
    assert len(disk.calls) == calls
    ds.advise([27], streamed, StreamPosition(2, 0, 1))  # batch 0 received: block 1 and 2 still read by 1
    assert disk.of(os.POSIX_FADV_DONTNEED) == [block(1), block(2), block(5)]
    ds.advise([7], streamed, StreamPosition(3, 1, 1))  # the next pass reads block 1, which batch 1 reads
    assert disk.of(os.POSIX_FADV_DONTNEED) == [block(1), block(2), block(5)]  # kept, not cleared
    assert disk.of(os.POSIX_FADV_WILLNEED)[-1][0] == block(1)[0]
    ds.advise([], streamed, StreamPosition(4, 1, 2))  # batch 1 received: block 2 done, block 1 is batch 3's
    assert disk.of(os.POSIX_FADV_DONTNEED)[3:] == [block(2)]
    ds.advise([], streamed, StreamPosition(5, 1, 4))  # batches 2 and 3 received
    assert sorted(disk.of(os.POSIX_FADV_DONTNEED)[4:]) == [block(1), block(5)]
    calls = len(disk.calls)
    ds.advise([9], StreamedBlocks(), None)  # no stream position: the process's own memory, no clearing
    ds.advise([9])
    assert len(disk.calls) == calls + 1 and disk.calls[-1][0] == os.POSIX_FADV_WILLNEED


def test_a_streamed_pass_neither_reads_ahead_nor_clears_the_record_table(packed, monkeypatch):
    """The last block ends with the last record: the table and the container's pages after it are
    never advised, so clearing a block never drops the table that the workers are about to read."""
    ds = blocks_of(packed.path, 5)
    ds.targets
    info = ds.manifest.shards[0]
    table = range(info.table_offset, info.table_offset + 32 * info.records)
    records_end = int((ds._offsets + ds._nbytes).max())
    assert records_end <= table.start < shard_file(ds).stat().st_size
    disk = FadviseLog(monkeypatch)
    ds.advise(np.arange(COUNT), StreamedBlocks(), StreamPosition(0, 0, 0))
    assert disk.calls and all(offset + length <= records_end and length > 0 for _, offset, length in disk.calls)
    advised = {b for offset, length in disk.of(os.POSIX_FADV_WILLNEED) for b in range(offset, offset + length)}
    assert all(set(range(int(o), int(o + n))) <= advised for o, n in zip(ds._offsets, ds._nbytes))


RECORDS_PER_BLOCK = 5
BATCH = 2


def dropped_as_received(ds: PackedDataset) -> tuple[bool, list[int], list[int]]:
    """A fork loader's first epoch over ``ds`` (blocks of 5 records), cached page by page, in order
    (``evaluation=True``), batches of 2, 2 workers with one batch in flight each: whether it streamed, the
    indices it yielded, and the blocks found in the cache, checked as each batch arrives, among those
    whose every record was in a batch yielded before it (so received: the main process drops those
    blocks). Blocks 0-3 are left out: the stream, running on into the next epoch, advises them again
    before this epoch ends."""
    loader = make_loader(ds, BATCH, num_workers=2, prefetch_factor=1, evaluation=True, multiprocessing_context="fork")
    cache(shard_file(ds))
    indices: list[int] = []
    found: list[int] = []
    for k, (_, _, batch_indices, _) in enumerate(loader):
        resident = resident_pages(shard_file(ds))
        for block in range(4, COUNT // RECORDS_PER_BLOCK):
            records = range(block * RECORDS_PER_BLOCK, (block + 1) * RECORDS_PER_BLOCK)
            if records[-1] // BATCH < k:
                pages = [page for i in records for page in inner_pages(int(ds._offsets[i]), int(ds._nbytes[i]))]
                found += [block] if resident[pages].any() else []
        indices += batch_indices.tolist()
    return loader.view.streaming, indices, found


@pytest.mark.parametrize("budget_share", [0.5, 0.0], ids=["lookahead", "no-lookahead"])
def test_a_loader_streams_only_a_dataset_larger_than_the_budget(packed, monkeypatch, budget_share):
    """The main process of a streaming loader drops each block once every batch reading it is received,
    also when its budget leaves no room to advise ahead (each batch then advised as it is handed out);
    a loader over a dataset that fits keeps it."""
    ds = blocks_of(packed.path, RECORDS_PER_BLOCK)
    assert ds.block_starts().size == COUNT // RECORDS_PER_BLOCK
    monkeypatch.setattr(reader.loader, "cache_room", lambda to_come: 2 * ds.manifest.total_bytes)
    streaming, indices, found = dropped_as_received(ds)
    assert not streaming and indices == list(range(COUNT))
    assert len(found) > 20  # every block checked, in every batch after it, was there
    monkeypatch.setattr(reader.loader, "cache_room", lambda to_come: int(ds.manifest.total_bytes * budget_share) or 4)
    if budget_share:  # room to advise a quarter of the set beyond the window (the whole set here)
        reserved = pool_bytes(2, 1, ds.batch_bytes(BATCH), pinned=False, exact=True)
        total = ds.manifest.total_bytes
        free = reserved + round((total + total // 4) / STREAM_SHARE)
        monkeypatch.setattr(reader.lookahead, "measure_free_memory", lambda: FreeMemory(free, free))
        streaming, indices, found = dropped_as_received(ds)
    else:  # no memory free for the page cache: no advice ahead, and a warning says why
        monkeypatch.setattr(reader.lookahead, "measure_free_memory", lambda: FreeMemory(0, 0))
        monkeypatch.setattr(reader.lookahead, "_warned_short_of_memory", False)
        with pytest.warns(RuntimeWarning, match="room for this streamed dataset's blocks"):
            streaming, indices, found = dropped_as_received(ds)
    assert streaming and indices == list(range(COUNT))
    # The kernel may read a page or two back around a later block's advice (large folios), so allow two.
    assert len(found) <= 2, found
    assert not make_loader(ds, 8, num_workers=0).view.streaming  # no workers: no advice, nothing dropped
    assert not ds.drop_behind  # the workers' copies read for a streamed loader, not the caller's dataset


def test_a_streamed_loader_advises_within_a_share_of_the_free_memory(packed, monkeypatch):
    """The window the workers read, the samples they were given and the blocks advised ahead fit in a
    ``STREAM_SHARE`` of the memory free once the loader's batch buffers are set aside, and in what the
    files the processes map and a batch slot per worker leave of it; where not even a window fits,
    nothing is advised ahead and a warning names the sizes and what to change."""
    ds = PackedDataset(packed.path, block_bytes=1)  # the smallest blocks: one record each
    shard_bytes = ds.manifest.total_bytes
    blocks = ds.block_starts().size
    unbounded = round(LOOKAHEAD_WINDOWS * 16 * len(ds) / blocks)
    window = shard_bytes * 16 // blocks
    monkeypatch.setattr(reader.loader, "cache_room", lambda to_come: shard_bytes // 4)  # streamed
    reserved = pool_bytes(2, 1, ds.batch_bytes(4), pinned=False, exact=True)  # 2 workers, prefetch 1
    free = reserved + round((window + 20 * shard_bytes // len(ds)) / STREAM_SHARE)
    monkeypatch.setattr(reader.lookahead, "measure_free_memory", lambda: FreeMemory(free, free))
    loader = make_loader(ds, 4, num_workers=2, buffer_blocks=16, prefetch_factor=1, pin_memory=False)
    assert loader.view.streaming
    room = (int((free - reserved) * STREAM_SHARE) - window) * len(ds) // shard_bytes - 2 * 1 * 4
    assert 0 < room < unbounded
    assert lookahead_samples(loader.view, 16, 8, reserved) == room
    assert loader.batch_sampler.lookahead_batches == -(-room // 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this node share the memory: each its part
    monkeypatch.setattr(reader.lookahead, "_warned_short_of_memory", False)
    with pytest.warns(RuntimeWarning, match="for each of 2 ranks on this node"):  # not a window each now
        assert lookahead_samples(loader.view, 16, 8, reserved) == 0
    monkeypatch.setattr(reader.lookahead, "measure_free_memory", lambda: FreeMemory(2 * free, 2 * free))
    assert lookahead_samples(loader.view, 16, 8, reserved) == room
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    # files mapped (libraries) beyond the shared memory: the room is what they leave, less a slot a worker
    slot = slot_size(ds.batch_bytes(4), exact=True)
    record = shard_bytes // len(ds)
    unmapped = window + 10 * record
    beyond = reserved + 2 * slot + unmapped
    monkeypatch.setattr(reader.lookahead, "measure_free_memory", lambda: FreeMemory(free, beyond))
    assert lookahead_samples(loader.view, 16, 8, reserved, 2 * slot) == (unmapped - window) * len(ds) // shard_bytes - 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # each rank its part of the memory, and its own slack
    monkeypatch.setattr(reader.lookahead, "measure_free_memory", lambda: FreeMemory(2 * free, 2 * beyond))
    assert lookahead_samples(loader.view, 16, 8, reserved, 2 * slot) == (unmapped - window) * len(ds) // shard_bytes - 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    # the share holds a window, what the mapped files and the slack leave does not: warned all the same
    monkeypatch.setattr(reader.lookahead, "measure_free_memory",
                        lambda: FreeMemory(free, reserved + 2 * slot + window // 2))
    monkeypatch.setattr(reader.lookahead, "_warned_short_of_memory", False)
    with pytest.warns(RuntimeWarning, match=r"room for this streamed dataset's blocks \(0 MiB: 0.4 of the \d+ MiB free "
                      r".*no more than the 0 MiB that the files the processes map and a batch slot per worker leave"):
        assert lookahead_samples(loader.view, 16, 8, reserved, 2 * slot) == 0
    starving = FreeMemory(reserved + window, reserved + window)
    monkeypatch.setattr(reader.lookahead, "measure_free_memory", lambda: starving)
    monkeypatch.setattr(reader.lookahead, "_warned_short_of_memory", False)
    with pytest.warns(RuntimeWarning, match=r"room for this streamed dataset's blocks \(0 MiB: 0.4 of the 0 MiB free "
                      r".*under one read window \(0 MiB: buffer_blocks x block_bytes\).*"
                      r"PackedDataset\(block_bytes=\.\.\.\)") as caught:
        starved = make_loader(ds, 4, num_workers=2, buffer_blocks=16, prefetch_factor=1, pin_memory=False)
    assert caught[0].filename == __file__  # it points at the make_loader call
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a process: a loader made again each epoch says nothing more
        make_loader(ds, 4, num_workers=2, buffer_blocks=16, prefetch_factor=1, pin_memory=False)
    assert starved.batch_sampler.lookahead_batches == 0
    labels = [label for _, batch_labels in starved for label in batch_labels.tolist()]
    assert labels == ds.targets[starved.shard_sampler.rank_order()].tolist()  # slower, never wrong


def test_a_new_stream_drops_the_blocks_the_last_one_held(packed, monkeypatch):
    """The DataLoader's workers reset (a loop cut short, a resume): the last stream's batches are all in
    by then, so the blocks it still held are dropped, not left to crowd the cache."""
    ds = blocks_of(packed.path, 5)
    ds.targets
    bounds = ds._files._block_starts
    view = PackedView(ds)
    view.streaming = True
    disk = FadviseLog(monkeypatch)
    view.advise(np.array([6, 12]), StreamPosition(0, 0, 0))  # blocks 1 and 2
    view.advise(np.array([27]), StreamPosition(1, 0, 0))  # block 5
    assert len(disk.of(os.POSIX_FADV_DONTNEED)) == 3  # each cleared before its advice
    view.advise(np.array([41]), StreamPosition(0, 0, 0))  # a new stream: block 8
    dropped = disk.of(os.POSIX_FADV_DONTNEED)[3:]
    assert sorted(dropped)[:3] == [(int(bounds[k]), int(bounds[k + 1] - bounds[k])) for k in (1, 2, 5)]
    assert dropped[3] == (int(bounds[8]), int(bounds[9] - bounds[8]))  # the new stream's block, cleared
