"""PackedDataset: pixels and labels round-trip, batches in the requested order, errors name the file."""
from __future__ import annotations

import io
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from reader_helpers import CLASSES, Packed, chw, make_images, pack_images

import reader.dataset
import reader.mapped_copy
import reader.shard_io
from reader import PackedDataset
from reader.format import FormatError
from reader.format.jpeg_decode import STORE_ALIGNMENT, store_shift
from reader.packed_view import PackedView

COUNT = 23
SIZE = (24, 32)


def labels_for(count: int) -> list[int]:
    return [(i * 7) % len(CLASSES) for i in range(count)]


@pytest.fixture(scope="module")
def images() -> list[np.ndarray]:
    return make_images(COUNT, [SIZE])


@pytest.fixture(scope="module", params=[("lmdb", "raw"), ("lmdb", "jpeg"), ("hdf5", "raw"), ("hdf5", "jpeg")],
                ids=lambda p: "-".join(p))
def packed(request, images, tmp_path_factory) -> Packed:
    storage, encoding = request.param
    dst = tmp_path_factory.mktemp(f"{storage}-{encoding}") / "packed"
    return pack_images(dst, images, labels_for(COUNT), storage=storage, encoding=encoding,
                       records_per_shard=10)


def pack_one_shard(tmp_path: Path, images: list[np.ndarray], storage: str, encoding: str) -> Packed:
    return pack_images(tmp_path / "packed", images, labels_for(len(images)), storage=storage,
                       encoding=encoding, records_per_shard=len(images) + 1)


def shard_bounds(ds: PackedDataset) -> list[int]:
    return np.cumsum([0] + [s.records for s in ds.manifest.shards]).tolist()


def assert_close(got: torch.Tensor, image: np.ndarray, encoding: str) -> None:
    """Raw pixels round-trip exactly; JPEG (q95) stays within a few grey levels on average."""
    expected = chw(image)
    assert got.shape == expected.shape and got.dtype == torch.uint8
    error = np.abs(got.numpy().astype(np.int16) - expected).mean()
    assert error == 0 if encoding == "raw" else error < 5


def test_metadata(packed):
    ds = PackedDataset(packed.path)
    assert len(ds) == COUNT
    assert ds.classes == CLASSES
    assert ds.class_to_idx == {"cat": 0, "dog": 1, "eel": 2}
    assert ds.targets.dtype == np.int64
    assert ds.targets.tolist() == packed.labels
    assert ds.manifest.num_records == COUNT and len(ds.manifest.shards) >= 2


def test_items_round_trip(packed):
    ds = PackedDataset(packed.path)
    for i in (0, 9, 10, COUNT - 1, -1):
        image, label = ds[i]
        assert image.is_contiguous()
        assert isinstance(label, int) and label == packed.labels[i]
        assert_close(image, packed.images[i], packed.encoding)


def test_batch_in_requested_order_across_shards(packed):
    ds = PackedDataset(packed.path)
    last_of_first_shard = shard_bounds(ds)[1] - 1
    indices = [22, 3, 15, 3, 0, last_of_first_shard, last_of_first_shard + 1, 19]
    batch, labels = ds.read_batch(indices)
    assert batch.shape == (len(indices), 3, *SIZE) and batch.dtype == torch.uint8
    assert labels.dtype == torch.int64
    assert labels.tolist() == [packed.labels[i] for i in indices]
    for row, i in zip(batch, indices):
        assert_close(row, packed.images[i], packed.encoding)
        assert torch.equal(row, ds[i][0])


def test_jpeg_batch_is_channels_last(tmp_path, images):
    batch, _ = PackedDataset(pack_one_shard(tmp_path, images, "lmdb", "jpeg").path).read_batch([0, 1])
    assert batch.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("sizes", [[SIZE], [(24, 32), (17, 21), (9, 40)]], ids=["fixed-size", "variable-size"])
def test_jpeg_images_are_decoded_off_the_non_temporal_boundary(tmp_path, sizes):
    """libjpeg-turbo writes a row that starts on a 32-byte boundary with non-temporal stores, about a
    tenth slower here (``reader.format.jpeg_decode``): every image of a batch starts 16 bytes past one,
    in a fresh buffer of the pool as in the reused one, and holds its record's pixels."""
    packed = pack_one_shard(tmp_path, make_images(6, sizes), "lmdb", "jpeg")
    ds = PackedDataset(packed.path)
    buffers = []
    for _ in range(2):
        batch, _ = ds.read_batch(list(range(6)))
        assert [image.data_ptr() % 32 for image in batch] == [16] * 6
        for image, expected in zip(batch, packed.images):
            assert_close(image, expected, "jpeg")
        buffers.append(batch[0].untyped_storage().data_ptr())
        del batch, image
    assert buffers[0] == buffers[1]  # the second batch reused the first one's buffer


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_batch_bytes_is_what_a_batch_takes_from_the_pool(tmp_path, images, encoding, monkeypatch):
    """What a worker reserves for its first batch slot (``PackedView.batch_nbytes``) is what a batch
    asks for, the JPEG decode room included, so that the first batch fits the slot made for it."""
    asked = []
    real = reader.dataset.new_batch
    monkeypatch.setattr(reader.dataset, "new_batch", lambda shape: asked.append(math.prod(shape)) or real(shape))
    ds = PackedDataset(pack_one_shard(tmp_path, images[:6], "lmdb", encoding).path)
    ds.read_batch(list(range(5)))
    assert asked == [ds.batch_bytes(5)]
    room = 32 if encoding == "jpeg" else 0
    assert PackedView(ds).batch_nbytes(5) == ds.batch_bytes(5) == 5 * 3 * math.prod(SIZE) + room


def three_of(images: list[np.ndarray]) -> int:
    """What ``batch_bytes_estimate(3)`` makes of decoded ``images``: three of their mean size, padded to
    32 bytes, and the decode room."""
    return 3 * -(-int(np.mean([image.size for image in images])) // 32) * 32 + 32


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_a_batch_s_memory_is_estimated_where_its_shapes_vary(tmp_path, encoding, monkeypatch):
    """For the loader's memory reckoning: the exact size where shapes are fixed; where they vary, the mean
    stored record, or for JPEG records that are decoded the mean decoded one (padded as a batch places
    them) over the records whose tables were read, those of shards spread from the first to the last
    read first where none is: a batch's real allocation, within the padding."""
    fixed = PackedDataset(pack_one_shard(tmp_path / "fixed", make_images(4, [(12, 16)]), "lmdb", encoding).path)
    assert fixed.batch_bytes_estimate(3) == fixed.batch_bytes(3)
    sizes = [(13, 15)] * 8 + [(40, 24)] * 8  # small images fill the first shards, as one class can
    packed = pack_images(tmp_path / "varied", make_images(16, sizes), [0] * 16, storage="lmdb", encoding=encoding,
                         records_per_shard=2)
    ds = PackedDataset(packed.path)
    shards = ds.manifest.shards
    assert ds.batch_bytes(3) is None and len(shards) > 4
    stored = 3 * ds.manifest.total_bytes // len(ds)
    if encoding == "raw":
        assert ds.batch_bytes_estimate(3) == stored
        return
    assert PackedDataset(packed.path, decode=False).batch_bytes_estimate(3) == stored

    estimate = ds.batch_bytes_estimate(3)
    loaded = ds._records.loaded.tolist()
    assert loaded[0] and loaded[-1] and sum(loaded) == 4  # four tables, the first and the last among them
    starts = np.cumsum([0] + [shard.records for shard in shards])
    sampled = [image for k, shard in enumerate(loaded) if shard for image in packed.images[starts[k]:starts[k + 1]]]
    assert estimate == three_of(sampled)
    ds.read_batch(list(range(len(ds))))  # reads every table
    assert ds.batch_bytes_estimate(3) == three_of(packed.images) == 3 * 1760 + 32
    assert PackedView(ds).batch_bytes_estimate(3) == ds.batch_bytes_estimate(3)

    asked = []
    real = reader.dataset.new_batch
    monkeypatch.setattr(reader.dataset, "new_batch", lambda shape: asked.append(math.prod(shape)) or real(shape))
    ds.read_batch([0, len(ds) - 1])  # one image of each size: the mean's
    assert asked == [32 + 608 + 2880] and 0 <= ds.batch_bytes_estimate(2) - asked[0] <= 2 * 32


def test_decode_destination_offset():
    for address in range(0, 4096 + 64, 4):
        shift = store_shift(address)
        assert 0 <= shift < STORE_ALIGNMENT and (address + shift) % STORE_ALIGNMENT == 16


def test_each_shard_run_is_one_read(packed, monkeypatch):
    """Neighbouring records are coalesced: a batch spanning two shards is one preadv per shard."""
    calls = []
    real_preadv = os.preadv

    def counting_preadv(fd, buffers, offset, flags=0):
        calls.append(len(buffers))
        return real_preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(reader.shard_io.os, "preadv", counting_preadv)
    ds = PackedDataset(packed.path, readahead=False)
    bounds = shard_bounds(ds)
    indices = list(range(bounds[0] + 1, bounds[2]))[::-1]
    batch, _ = ds.read_batch(indices)
    assert len(calls) == 2
    for row, i in zip(batch, indices):
        assert_close(row, packed.images[i], packed.encoding)


def test_runs_split_at_iovec_limit(packed, monkeypatch):
    monkeypatch.setattr(reader.shard_io, "IOV_MAX", 4)
    batch, _ = PackedDataset(packed.path).read_batch(list(range(COUNT)))
    for row, image in zip(batch, packed.images):
        assert_close(row, image, packed.encoding)


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_variable_size_records(tmp_path, storage, encoding):
    images = make_images(7, [(16, 24), (32, 16), (20, 20)], seed=1)
    packed = pack_images(tmp_path / "packed", images, labels_for(7), storage=storage,
                         encoding=encoding, records_per_shard=4)
    ds = PackedDataset(packed.path)
    assert ds.manifest.shape is None
    indices = [6, 1, 4, 2]
    batch, labels = ds.read_batch(indices)
    assert isinstance(batch, list) and labels.tolist() == [packed.labels[i] for i in indices]
    for image, i in zip(batch, indices):
        assert_close(image, packed.images[i], encoding)
    assert_close(ds[5][0], packed.images[5], encoding)


def test_out_of_range_index(packed):
    ds = PackedDataset(packed.path)
    with pytest.raises(IndexError):
        ds[COUNT]
    with pytest.raises(IndexError):
        ds.read_batch([0, -COUNT - 1])
    with pytest.raises(TypeError):
        ds[1.5]


def test_empty_batch(packed):
    ds = PackedDataset(packed.path)
    images, labels = ds.read_batch([])
    assert images.shape == (0, 3, *SIZE) and images.dtype == torch.uint8
    assert labels.shape == (0,) and labels.dtype == torch.int64
    assert ds.__getitems__(np.zeros(0, np.int32)) == []


def test_huge_unsigned_index_is_named_as_given(packed):
    ds = PackedDataset(packed.path)
    with pytest.raises(IndexError, match=f"index {2**63 + 5} is out of range for {COUNT} records"):
        ds.read_batch(np.array([2**63 + 5], np.uint64))
    assert ds.read_batch(np.array([3, 1], np.int32))[1].tolist() == [packed.labels[3], packed.labels[1]]


def test_fields_and_source_check_the_index_without_fields(packed):
    ds = PackedDataset(packed.path)
    assert ds.manifest.fields == [] and ds.fields(COUNT - 1) == {}
    for method in (ds.fields, ds.source):
        with pytest.raises(IndexError, match=f"index {COUNT} is out of range for {COUNT} records"):
            method(COUNT)
        with pytest.raises(IndexError, match=f"index {-COUNT - 1} is out of range"):
            method(-COUNT - 1)


@pytest.mark.parametrize("options, error, message", [
    ({"block_bytes": "8"}, TypeError, "block_bytes must be an int, got '8'"),
    ({"block_bytes": 1.5}, TypeError, "block_bytes must be an int, got 1.5"),
    ({"block_bytes": None}, TypeError, "block_bytes must be an int, got None"),
    ({"max_gap": -1}, ValueError, "max_gap must be 0 or more, got -1"),
    ({"max_gap": "4096"}, TypeError, "max_gap must be an int, got '4096'"),
    ({"readahead": "no"}, TypeError, "readahead must be True or False, got 'no'"),
    ({"fast_decode": None}, TypeError, "fast_decode must be True or False, got None"),
    ({"decode_threads": "2"}, TypeError, "decode_threads must be an int, got '2'"),
])
def test_bad_argument_types_are_named(tmp_path, images, options, error, message):
    path = pack_one_shard(tmp_path, images[:2], "lmdb", "raw").path
    with pytest.raises(error, match=f"^{message}$"):
        PackedDataset(path, **options)
    assert len(PackedDataset(path, block_bytes=np.int64(1 << 20), max_gap=0, readahead=np.bool_(False))) == 2


def test_a_file_is_not_a_dataset(tmp_path, images):
    path = pack_one_shard(tmp_path, images[:2], "lmdb", "raw").path
    with pytest.raises(FormatError, match="manifest.json: not a directory"):
        PackedDataset(path / "manifest.json")


def test_shard_truncated_after_open_is_noticed(tmp_path, images):
    packed = pack_images(tmp_path / "packed", images, labels_for(COUNT), storage="hdf5",
                         encoding="raw", records_per_shard=10)
    ds = PackedDataset(packed.path)
    assert shard_bounds(ds)[:3] == [0, 10, 20]
    ds[10]
    os.truncate(packed.path / "part-00000-shard-00001.h5", int(ds._offsets[15]) + 10)
    ds[0]
    with pytest.raises(FormatError, match=r"part-00000-shard-00001\.h5: shard file was replaced or changed since"):
        ds[10]
    with pytest.raises(FormatError, match=r"part-00000-shard-00001\.h5: shard file is \d+ bytes, the manifest says"):
        PackedDataset(packed.path)


def test_corrupt_jpeg_names_file_and_record(tmp_path, images):
    packed = pack_one_shard(tmp_path, images, "hdf5", "jpeg")
    ds = PackedDataset(packed.path)
    shard = packed.path / "part-00000-shard-00000.h5"
    before = shard.stat()
    with open(shard, "r+b") as f:  # bit rot: same size, same modification time
        f.seek(int(ds._offsets[4]))
        f.write(b"\0" * 64)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(FormatError, match=r"part-00000-shard-00000\.h5: record 4 .*not a valid jpeg payload"):
        ds[4]


def test_read_only_directory_stays_untouched(tmp_path, images):
    for storage in ("lmdb", "hdf5"):
        dst = pack_one_shard(tmp_path / storage, images, storage, "raw").path
        before = sorted(p.name for p in dst.iterdir())
        dst.chmod(0o555)
        try:
            ds = PackedDataset(dst)
            ds.read_batch(list(range(COUNT)))
            ds.close()
        finally:
            dst.chmod(0o755)
        assert sorted(p.name for p in dst.iterdir()) == before


def test_no_open_files_after_init(packed):
    def open_files() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    path = str(packed.path)
    ds = PackedDataset(packed.path)
    assert not any(name.startswith(path) for name in open_files())
    ds[0]
    assert any(name.startswith(path) for name in open_files())
    ds.close()
    assert not any(name.startswith(path) for name in open_files())


def test_fast_decode_option_stays_close_to_pil(tmp_path, images):
    packed = pack_one_shard(tmp_path, images, "hdf5", "jpeg")
    accurate, fast = PackedDataset(packed.path, fast_decode=False), PackedDataset(packed.path)
    for i in (0, 7):
        start, size = int(accurate._offsets[i]), int(accurate._nbytes[i])
        with open(packed.path / "part-00000-shard-00000.h5", "rb") as f:
            f.seek(start)
            reference = chw(np.asarray(Image.open(io.BytesIO(f.read(size))).convert("RGB")))
        for ds, tolerance in ((accurate, 0.5), (fast, 3)):
            assert np.abs(ds[i][0].numpy().astype(np.int16) - reference).mean() < tolerance


def test_batch_buffers_are_reused_only_once_dropped(packed):
    ds = PackedDataset(packed.path)
    first, _ = ds.read_batch([0, 1, 2])
    kept = first.clone()
    second, _ = ds.read_batch([3, 4, 5])
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first, kept)
    address = second.data_ptr()
    del second
    third, _ = ds.read_batch([6, 7, 8])
    assert third.data_ptr() == address
    for row, i in zip(third, [6, 7, 8]):
        assert_close(row, packed.images[i], packed.encoding)


class ColdDisk:
    """Stands in for a cold page cache: no page of a mapped shard is resident, reads with
    ``RWF_NOWAIT`` find nothing (or are refused, like on a file system without non-blocking reads),
    and every WILLNEED is recorded as (fd, offset, len)."""

    def __init__(self, monkeypatch, nowait_error: OSError = BlockingIOError(11, "cold")) -> None:
        self.advice: list[tuple[int, int, int]] = []
        self.blocking_reads = 0
        real_preadv = os.preadv

        def preadv(fd, buffers, offset, flags=0):
            if flags & os.RWF_NOWAIT:
                raise nowait_error
            self.blocking_reads += 1
            return real_preadv(fd, buffers, offset)

        def fadvise(fd, offset, length, advice):
            assert advice == os.POSIX_FADV_WILLNEED
            self.advice.append((fd, offset, length))

        monkeypatch.setattr(reader.shard_io.os, "preadv", preadv)
        monkeypatch.setattr(reader.shard_io.os, "posix_fadvise", fadvise)
        monkeypatch.setattr(reader.mapped_copy.MappedFile, "resident", lambda self, start, end: False)

    def advised_bytes(self) -> set[int]:
        return {b for _, offset, length in self.advice for b in range(offset, offset + length)}


@pytest.fixture(scope="module")
def page_sized_images() -> list[np.ndarray]:
    """Images whose JPEGs are over 2 KB, so that LMDB stores them in file order (overflow pages)."""
    return make_images(COUNT, [(72, 96)])


def one_shard_of_blocks(tmp_path, images, storage, encoding, records_per_block):
    """A one-shard dataset whose read-ahead blocks hold ``records_per_block`` records each."""
    packed = pack_one_shard(tmp_path, images, storage, encoding)
    assert (np.diff(PackedDataset(packed.path)._offsets) > 0).all()
    shard = PackedDataset(packed.path).manifest.shards[0]
    block_bytes = -(-records_per_block * shard.bytes // shard.records)
    return PackedDataset(packed.path, block_bytes=block_bytes), packed


def block_span(ds: PackedDataset, first: int, last: int) -> range:
    """File bytes from record ``first``'s block start (or the file's start) to record ``last``'s end."""
    start = 0 if first == 0 else int(ds._offsets[first])
    return range(start, int(ds._offsets[last] + ds._nbytes[last]))


@pytest.mark.parametrize("storage", ["lmdb", "hdf5"])
@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_cold_batch_reads_its_whole_blocks_ahead(tmp_path, page_sized_images, monkeypatch, storage,
                                                encoding):
    ds, packed = one_shard_of_blocks(tmp_path, page_sized_images, storage, encoding, records_per_block=5)
    disk = ColdDisk(monkeypatch)
    indices = [12, 6, 13]  # blocks 1 and 2 (records 5-9 and 10-14), not blocks 0, 3, 4
    batch, labels = ds.read_batch(indices)
    advised = disk.advised_bytes()
    assert set(block_span(ds, 5, 14)) <= advised
    assert not advised & set(block_span(ds, 0, 4))
    assert not advised & set(range(int(ds._offsets[15]), int(ds._offsets[-1] + ds._nbytes[-1])))
    assert disk.blocking_reads >= 1
    assert labels.tolist() == [packed.labels[i] for i in indices]
    for row, i in zip(batch, indices):
        assert_close(row, packed.images[i], encoding)


def test_cached_batch_asks_for_nothing(tmp_path, images, monkeypatch):
    ds, packed = one_shard_of_blocks(tmp_path, images, "lmdb", "raw", records_per_block=5)
    (tmp_path / "packed" / "part-00000-shard-00000.lmdb").read_bytes()  # now in the page cache
    advice = []
    monkeypatch.setattr(reader.shard_io.os, "posix_fadvise", lambda *args: advice.append(args))
    batch, _ = ds.read_batch([12, 6, 13, 0])
    assert advice == []
    assert_close(batch[3], packed.images[0], "raw")


def test_scattered_batch_reads_only_its_records(tmp_path, images, monkeypatch):
    ds, packed = one_shard_of_blocks(tmp_path, images, "hdf5", "raw", records_per_block=2)
    disk = ColdDisk(monkeypatch)
    monkeypatch.setattr(reader.shard_io, "MAX_READAHEAD_BLOCKS", 2)
    batch, _ = ds.read_batch([0, 8, 16])
    assert disk.advice == []
    for row, i in zip(batch, [0, 8, 16]):
        assert_close(row, packed.images[i], "raw")
    ds.read_batch([0, 3])
    assert disk.advised_bytes() >= set(block_span(ds, 0, 3))


def test_file_system_without_nonblocking_reads_still_reads_ahead(tmp_path, page_sized_images,
                                                                monkeypatch):
    ds, packed = one_shard_of_blocks(tmp_path, page_sized_images, "lmdb", "jpeg", records_per_block=5)
    disk = ColdDisk(monkeypatch, nowait_error=OSError(95, "Operation not supported"))
    for indices in ([7], [21, 2]):
        batch, _ = ds.read_batch(indices)
        for row, i in zip(batch, indices):
            assert_close(row, packed.images[i], "jpeg")
    assert set(block_span(ds, 0, 9)) | set(block_span(ds, 20, 22)) <= disk.advised_bytes()


def test_readahead_off_and_bad_values(tmp_path, images, monkeypatch):
    packed = pack_one_shard(tmp_path, images, "hdf5", "jpeg")
    path = packed.path
    disk = ColdDisk(monkeypatch)
    batch, _ = PackedDataset(path, readahead=False).read_batch([4, 9])
    assert disk.advice == [] and disk.blocking_reads == 1
    assert_close(batch[1], packed.images[9], "jpeg")
    with pytest.raises(ValueError, match="block_bytes must be positive, got 0"):
        PackedDataset(path, block_bytes=0)


def test_advise_asks_once_for_the_whole_blocks_of_the_records(tmp_path, page_sized_images, monkeypatch):
    ds, packed = one_shard_of_blocks(tmp_path, page_sized_images, "lmdb", "jpeg", records_per_block=5)
    disk = ColdDisk(monkeypatch)
    ds.advise([12, 6, 13])  # blocks 1 and 2 (records 5-9 and 10-14)
    advised = disk.advised_bytes()
    assert set(block_span(ds, 5, 14)) <= advised
    assert not advised & set(block_span(ds, 0, 4))
    assert not advised & set(range(int(ds._offsets[15]), int(ds._offsets[-1] + ds._nbytes[-1])))
    assert disk.blocking_reads == 0
    calls = len(disk.advice)
    ds.advise([9, 5, 14, 11])  # the same blocks again: nothing new to ask for
    assert len(disk.advice) == calls
    ds.advise([14, 2])  # block 0 is new, block 2 is not
    added = disk.advised_bytes() - advised
    assert set(block_span(ds, 0, 4)) <= added and min(added) == 0 and max(added) < ds._offsets[5]
    batch, _ = ds.read_batch([2, 14])
    for row, i in zip(batch, [2, 14]):
        assert_close(row, packed.images[i], "jpeg")


def test_advise_remembers_its_blocks_and_skips_scattered_records(tmp_path, images, monkeypatch):
    ds, _ = one_shard_of_blocks(tmp_path, images, "hdf5", "raw", records_per_block=2)
    disk = ColdDisk(monkeypatch)
    monkeypatch.setattr(reader.shard_io, "MAX_READAHEAD_BLOCKS", 2)
    ds.targets  # reads the table, which gives the shard its block bounds
    ds.advise([0, 8, 16])  # three blocks: scattered
    assert disk.advice == []
    for indices in ([0], [4], [0], [8], [0], [4]):
        ds.advise(indices)
    starts = [offset for _, offset, _ in disk.advice]
    assert starts.count(0) == 1 and starts.count(int(ds._offsets[4])) == 1 and starts.count(int(ds._offsets[8])) == 1
    # a streamed pass remembers its own (tests/reader/test_streaming.py)


def test_advise_over_several_shards_skips_only_the_scattered_one(tmp_path, page_sized_images, monkeypatch):
    """A batch's blocks are found for all shards at once; the scattered rule still holds per shard."""
    packed = pack_images(tmp_path / "packed", page_sized_images, labels_for(COUNT), storage="lmdb",
                         encoding="jpeg", records_per_shard=10)
    shard = PackedDataset(packed.path).manifest.shards[1]
    ds = PackedDataset(packed.path, block_bytes=-(-2 * shard.bytes // shard.records))  # 2 records a block
    monkeypatch.setattr(reader.shard_io, "MAX_READAHEAD_BLOCKS", 2)
    disk = ColdDisk(monkeypatch)
    ds.advise([0, 4, 8, 12, 13, 21])  # shard 0: three blocks (scattered); shard 1: one block; shard 2: one
    shard_of_fd = {entry.fd: shard for shard, entry in ds._files._open.items()}
    assert sorted({shard_of_fd[fd] for fd, _, _ in disk.advice}) == [1, 2]
    by_shard = {s: {b for fd, offset, length in disk.advice if shard_of_fd[fd] == s
                    for b in range(offset, offset + length)} for s in (1, 2)}
    assert set(range(int(ds._offsets[12]), int(ds._offsets[13] + ds._nbytes[13]))) <= by_shard[1]
    assert not by_shard[1] & set(range(int(ds._offsets[14]), int(ds._offsets[19] + ds._nbytes[19])))
    assert set(range(int(ds._offsets[21]), int(ds._offsets[21] + ds._nbytes[21]))) <= by_shard[2]


def test_advise_without_read_ahead_does_nothing(tmp_path, images, monkeypatch):
    packed = pack_one_shard(tmp_path, images, "lmdb", "raw")
    disk = ColdDisk(monkeypatch)
    PackedDataset(packed.path, readahead=False).advise([1, 2, 3])
    assert disk.advice == []
    with pytest.raises(IndexError, match="out of range"):
        PackedDataset(packed.path).advise([COUNT])
