"""``PackedDataset``: a packed dataset directory as a torch map-style dataset that reads whole batches.

Everything known about the records (file offsets, sizes, labels, heights, widths) is held in numpy
arrays: no per-record Python objects, so DataLoader workers do not slowly copy the parent's memory by
touching refcounts (pytorch #13246). Opening reads only the manifest and checks every shard file's name,
type and size (a ``stat`` each); a shard's record table is read, checked and put into those arrays when
one of its records is first needed in a process (``targets`` reads them all). So opening 1.28 million
records in 1,132 shards costs milliseconds, not seconds, in every process and rank. No file stays open
after ``__init__``; each process opens the shard files on first read, so the dataset is safe to use
under ``fork``, ``spawn`` and ``forkserver``, and pickles as its path, options and a fingerprint (O(1)): a
spawned worker opens the dataset again, checks that it is the one the loader opened, and reads the
tables of the shards it reads.

The hot path is ``read_batch``, which ``make_loader`` calls with a whole batch of indices: records
are grouped by shard and read in coalesced runs straight into the batch tensor (raw pixels) or into a
reused scratch buffer and then decoded straight into the batch tensor (JPEG). ``__getitems__`` follows
torch's convention instead (a list of ``(image, label)`` samples for any ``collate_fn``), so a plain
``DataLoader``, ``Subset`` or a user's wrapper sees an ordinary map-style dataset, with the same
coalesced reads. On a cold cache, whole
blocks of the files around the requested records are read ahead (``reader.shard_io``), cut exactly
like ``ShardSampler``'s quasi-random blocks, so a slow disk sees long sequential reads; ``advise``
lets the loader's main process start reading the blocks of batches still ahead.
"""
from __future__ import annotations

import math
import operator
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import xxhash
from torch.utils.data import Dataset

from reader import blocks
from reader.arguments import true_or_false, whole_number
from reader.batch_memory import new_batch
from reader.blocks import DEFAULT_BLOCK_BYTES, block_size
from reader.decode_threads import DecodeThreads
from reader.format import MANIFEST_NAME, FormatError, Manifest, encoding, load_manifest, load_shard_table
from reader.format.fields import SOURCE
from reader.format.jpeg_decode import padded_size, placed_room, placed_span
from reader.format.shard_files import check_shard_file
from reader.record_columns import RecordColumns
from reader.record_fields import RecordFields
from reader.shard_io import DEFAULT_MAX_GAP, ReadRequest, ShardFiles
from reader.streamed_blocks import StreamedBlocks, StreamPosition

Images = torch.Tensor | list[torch.Tensor]
Indices = Sequence[int] | np.ndarray  # record indices, as a list or an int array
Allocator = Callable[[tuple[int, ...]], torch.Tensor]
VERIFY_LEVELS = ("tables", "full")
# Shards whose record tables a loader reads when it is made, for the mean decoded size of JPEG records
# of varying sizes (``PackedDataset._mean_decoded_bytes``): a read each, about 5 ms on a 200-IOPS disk.
SIZE_SAMPLE_SHARDS = 4
_REOPEN = "_reopen"  # the key of what a pickled dataset needs to be opened again (``__getstate__``)


class PackedDataset(Dataset):
    """Records of a packed dataset as ``(uint8 tensor [3, H, W], int label)`` pairs.

    ``fast_decode`` (JPEG datasets only) uses libjpeg-turbo's fast DCT and chroma upsampling: about 8%
    faster, within about 2 grey levels of an accurate decode (see ``reader.format.jpeg_decode``). ``max_gap`` is the
    largest hole in the file (bytes) that a single read spans to join two requested records.

    ``decode=False`` (JPEG datasets only) serves each record as its encoded JPEG bytes, a 1-D uint8
    tensor, instead of its pixels: for ``CUDAPrefetcher``, which decodes such batches on the GPU with
    nvJPEG (``reader.gpu.jpeg_batches``), so that the loader's workers only read. Batches of encoded
    records are lists, one tensor per record, whatever the manifest's shape.

    ``decode_threads`` (JPEG datasets only) decodes each batch on that many threads of the reading
    process (``reader.decode_threads``), with TurboJPEG, which releases the GIL (``reader.format.jpeg_decode``).
    The default, 1, decodes on the calling thread with simplejpeg: on a machine where the DataLoader's
    worker processes already fill the cores, threads add nothing (measured in BENCHMARKS.md).

    ``block_bytes`` (default 8 MiB) sets the dataset's block layout (``reader.blocks``, see
    ``block_starts``): the blocks ``ShardSampler`` shuffles in quasi-random order and, with ``readahead``
    (the default), the blocks read ahead when a batch misses the page cache. The sampler and the loader take
    the layout from here, so the two always agree. A batch whose records are not all cached asks the kernel
    for the whole blocks they lie in, so the next batches of the sampler's window read from memory and the
    disk streams 8 MiB blocks instead of seeking for every few records: what makes quasi-random order run at
    disk bandwidth on an HDD or NFS. Cached batches pay nothing for it, and a scattered batch (random order
    over more than 32 blocks) reads only its own records.

    The dataset is untrusted input: opening it checks every shard's name, type and size, a shard's record
    table is checked (``reader.format.load_shard_table``) before any of its records is served or its
    labels are used, and reads refuse a shard replaced since the open (a ``FormatError`` naming the
    file). ``verify="full"`` also checksums every shard against the manifest at open and reads every
    table there (reading the whole dataset once, like ``packer verify``), so that no damaged payload
    byte is ever served.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        fast_decode: bool = True,
        max_gap: int = DEFAULT_MAX_GAP,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        readahead: bool = True,
        decode_threads: int = 1,
        decode: bool = True,
        verify: str = "tables",
    ) -> None:
        block_bytes = whole_number("block_bytes", block_bytes, 1)
        max_gap = whole_number("max_gap", max_gap)
        fast_decode = true_or_false("fast_decode", fast_decode)
        readahead = true_or_false("readahead", readahead)
        if verify not in VERIFY_LEVELS:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_LEVELS)}, got {verify!r}")
        self.path = Path(path)
        self.block_bytes = block_bytes
        self.readahead = readahead
        self.manifest: Manifest = load_manifest(self.path)
        self.fast_decode = fast_decode
        self._encoding = encoding(self.manifest.encoding)
        self.decode = true_or_false("decode", decode)
        if not decode and self._encoding.stores_pixels:
            raise ValueError(f"{self.path}: decode=False serves encoded JPEG records, and this dataset's records "
                             f"are {self.manifest.encoding} pixels, which need no decoding: leave decode=True")
        self.record_fields = RecordFields(self.path, self.manifest)
        self.decode_threads = DecodeThreads(decode_threads)
        shards = self.manifest.shards
        identities = [check_shard_file(self.path, shard) for shard in shards]
        self._shard_starts = np.concatenate([[0], np.cumsum([s.records for s in shards], dtype=np.int64)])
        self._block_size = block_size(shards, block_bytes)
        layout = [(blocks.block_count(s.records, s.bytes, self._block_size), max(s.bytes, 1)) for s in shards] \
            if readahead else None
        self._files = ShardFiles([self.path / s.file for s in shards], identities, max_gap, layout)
        self._columns: RecordColumns | None = None
        self._scratch = bytearray(0)
        self._tables_asked: set[int] = set()  # shards whose tables ``read_tables_ahead`` asked for
        self._stale: str | None = None  # why a received copy refuses to read (``__setstate__``)
        if verify == "full":
            for shard in range(len(shards)):
                self._load_table(shard, checksum=True)
        # what opening sets, which pickling leaves out (``__getstate__``); a subclass's own attributes are kept
        self._opened = frozenset(self.__dict__) | {"_opened"}

    def __getstate__(self) -> dict:
        """What a worker needs to open the dataset again: its path, options and a fingerprint of what
        this process opened (manifest, shard identities), plus a subclass's own attributes. O(1) in
        records and shards, so a spawned worker starts as fast at 14 million records as at 1,000, and a
        script that lacks its ``if __name__ == "__main__":`` guard fails with Python's own message:
        CPython's spawn writes the payload into a pipe that the failing child never reads, so a
        payload over the pipe's 64 KiB made the parent hang."""
        state = {key: value for key, value in self.__dict__.items() if key not in self._opened}
        options = {"fast_decode": self.fast_decode, "max_gap": self._files.max_gap, "block_bytes": self.block_bytes,
                   "readahead": self.readahead, "decode_threads": self.decode_threads.threads,
                   "decode": self.decode}
        state[_REOPEN] = {"path": self.path, "options": options, "fingerprint": self._fingerprint()}
        return state

    def __setstate__(self, state: dict) -> None:
        """Open the dataset again (a worker). A dataset that is no longer what the sender opened is
        refused at this copy's first read, with a ``FormatError`` that the DataLoader hands to the
        training process (raised here, it would only kill the worker: "exited unexpectedly")."""
        state = dict(state)
        reopen = state.pop(_REOPEN)
        try:
            PackedDataset.__init__(self, reopen["path"], **reopen["options"])
        except FormatError as e:  # a shard removed, the manifest damaged...: refused at the first read too
            self.__dict__.update(state)
            self.path, self._stale = reopen["path"], str(e)
            return
        manifest, shards = self._fingerprint()
        if manifest != reopen["fingerprint"][0]:
            self._stale = (f"{self.path / MANIFEST_NAME}: changed after the loader's process opened the dataset "
                           "(repacked or appended to?); open the dataset again")
        elif shards != reopen["fingerprint"][1]:
            self._stale = (f"{self.path}: a shard file was replaced or changed after the loader's process opened "
                           "the dataset (copied over?); open the dataset again")
        self.__dict__.update(state)

    def _fingerprint(self) -> tuple[str, str]:
        """Hashes of the manifest and of every shard file's identity, as this process opened them."""
        return (xxhash.xxh3_128_hexdigest(repr(self.manifest).encode()),
                xxhash.xxh3_128_hexdigest(repr(self._files.identities).encode()))

    @property
    def _records(self) -> RecordColumns:
        """This process's record columns (filled shard by shard as ``_load`` reads their tables)."""
        if self._columns is None:
            self._columns = RecordColumns(len(self), len(self.manifest.shards))
        return self._columns

    def _load(self, idx: np.ndarray) -> np.ndarray:
        """Read the record tables of the shards of records ``idx`` not read yet in this process; ``idx``."""
        loaded = self._records.loaded
        shards = np.unique(self._shard_of(idx)) if len(idx) else idx
        for shard in shards[~loaded[shards]].tolist():
            self._load_table(shard)
        return idx

    def _load_table(self, shard: int, checksum: bool = False) -> None:
        info = self.manifest.shards[shard]
        table = load_shard_table(self.path, self.manifest.storage, info, self.manifest.label_range,
                                 self.manifest.encoding, self.manifest.shape, checksum=checksum,
                                 opened=self._files.identities[shard])
        first = int(self._shard_starts[shard])
        self._records.fill(shard, slice(first, first + len(table)), table)
        if self.readahead:
            self._files.set_block_bounds(shard, blocks.block_bounds(table["offset"], table["nbytes"], info,
                                                                         self._block_size))

    def _all_records(self) -> RecordColumns:
        """The record columns with every shard's table read."""
        records = self._records
        for shard in np.flatnonzero(~records.loaded).tolist():
            self._load_table(shard)
        return records

    @property
    def targets(self) -> np.ndarray:
        """Every record's label (int64); reads every shard's record table on first use in a process."""
        return self._all_records().labels

    @property
    def _offsets(self) -> np.ndarray:
        """Every record's byte offset in its shard (reads every table; for tests and tools)."""
        return self._all_records().offsets

    @property
    def _nbytes(self) -> np.ndarray:
        """Every record's payload size (reads every table; for tests and tools)."""
        return self._all_records().nbytes

    def source(self, index: int) -> str | None:
        """Where record ``index`` came from: its path relative to the packed source (or the name the
        packing code gave it); None for a format-version-1 dataset, which does not store it."""
        record = int(self._checked_indices([index])[0])
        if not self.manifest.has_sources:
            return None
        return self.record_fields.columns([SOURCE])[SOURCE].value(record)

    def fields(self, index: int) -> dict[str, Any]:
        """Record ``index``'s extra fields as plain Python values (``reader.format.fields``)."""
        record = int(self._checked_indices([index])[0])
        if not self.manifest.fields:
            return {}
        columns = self.record_fields.columns([field.name for field in self.manifest.fields])
        return {name: column.value(record) for name, column in columns.items()}

    def block_starts(self) -> np.ndarray:
        """The index of every block's first record: the layout the sampler shuffles and read-ahead reads."""
        return blocks.dataset_block_starts(self.manifest.shards, self.block_bytes)

    @property
    def classes(self) -> list[str]:
        return self.manifest.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        return self.manifest.class_to_idx

    def __len__(self) -> int:
        return int(self._shard_starts[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """One record: a contiguous ``uint8 [3, H, W]`` tensor and its label."""
        return self.__getitems__([operator.index(index)])[0]

    def __getitems__(self, indices: Indices) -> list[tuple[torch.Tensor, int]]:
        """Samples ``[(uint8 [3, H, W] contiguous, int label), ...]`` in the requested order.

        torch's convention for ``__getitems__``: what a plain ``DataLoader`` (or ``Subset``) hands to
        its ``collate_fn``, so the default collate stacks them. The records are read in one go, with
        the coalesced reads of ``read_batch``, into ordinary process memory, never a ``make_loader``
        batch slot (whose memory goes back to a pool).
        """
        idx = self._checked_indices(indices)
        images = self._read(idx, _private_batch)
        if isinstance(images, torch.Tensor) and images.is_contiguous():
            samples = list(images.unbind(0))
        else:
            samples = [image.contiguous() for image in images]
        return list(zip(samples, self._records.labels[idx].tolist()))

    def batch_bytes(self, count: int) -> int | None:
        """The bytes a batch of ``count`` records takes from the batch memory pool (``reader.batch_memory``)
        when every record has the same shape (manifest ``shape``) and is decoded, decode room included
        (``_decode_target``); else None (the sizes vary)."""
        if self.manifest.shape is None or not self.decode:
            return None
        pixels = count * math.prod(self.manifest.shape)
        return pixels if self._encoding.stores_pixels else placed_room(pixels)

    def batch_bytes_estimate(self, count: int) -> int:
        """About what a batch of ``count`` records takes from the batch memory pool: ``batch_bytes``
        where that is known; for JPEG records of varying sizes that are decoded, ``count`` records of the
        mean decoded size (``_mean_decoded_bytes``), decode room included; else (raw records, or JPEG
        served undecoded) the records' mean stored size. For the loader's memory reckoning
        (``reader.lookahead``), never for an allocation.

        Why not a ratio to the stored size: what a byte of JPEG decodes to ranges from 7 to 26 bytes
        between quality 95 and 50 on the same photos (resized to 256 px), so any one ratio sets aside
        half or twice the memory the batches take."""
        exact = self.batch_bytes(count)
        if exact is not None:
            return exact
        if self._encoding.stores_pixels or not self.decode:
            return count * self.manifest.total_bytes // max(len(self), 1)
        return placed_room(count * self._mean_decoded_bytes())

    def _mean_decoded_bytes(self) -> int:
        """The mean bytes a decoded record takes in a batch of varying sizes (height x width x 3, rounded
        up as ``padded_size`` places it), over the records whose table this process has read; where it
        has read none, first the tables of up to ``SIZE_SAMPLE_SHARDS`` shards with records, spread
        evenly from the first to the last (shards follow the source's order: a class, or one source of
        a joined or appended dataset, can fill a shard, and its images can be smaller or larger)."""
        records = self._records
        if not records.loaded.any():
            filled = np.flatnonzero(np.diff(self._shard_starts))
            spread = np.linspace(0, len(filled) - 1, min(SIZE_SAMPLE_SHARDS, len(filled))).round()
            for shard in np.unique(filled[spread.astype(np.int64)]).tolist():
                self._load_table(shard)
        pixels = count = 0
        for shard in np.flatnonzero(records.loaded).tolist():  # their rows only: the others' pages stay unmapped
            rows = slice(int(self._shard_starts[shard]), int(self._shard_starts[shard + 1]))
            pixels += int(np.dot(records.heights[rows], records.widths[rows]))
            count += rows.stop - rows.start
        return padded_size(3 * pixels // count) if count else 0

    def read_batch(self, indices: Indices) -> tuple[Images, torch.Tensor]:
        """A whole batch, in the requested order: ``(uint8 [B, 3, H, W], int64 [B])``, zero-copy.

        When the records' sizes vary (manifest ``shape`` is null) the images are a list of
        ``[3, H, W]`` tensors instead. JPEG batches are decoded channels-last: the tensor has shape
        ``[B, 3, H, W]`` with ``channels_last`` strides, which models and ``.to()`` accept as is; with
        ``decode=False`` they are a list of 1-D uint8 tensors, each record's JPEG bytes. The
        batch lives in a reused buffer (``reader.batch_memory``): this is ``make_loader``'s hot path
        (it passes the batch through an identity collate), not a list of samples.
        """
        idx = self._checked_indices(indices)
        return self._read(idx, new_batch), torch.from_numpy(self._records.labels[idx])

    def _read(self, idx: np.ndarray, allocate: Allocator) -> Images:
        if self._encoding.stores_pixels:
            return self._read_raw(idx, allocate)
        if not self.decode:
            return self._read_stored(idx, allocate)
        return self._read_decoded(idx, allocate)

    def advise(self, indices: Indices, streamed: StreamedBlocks | None = None,
               at: StreamPosition | None = None) -> None:
        """Start reading, in the background, the whole read-ahead blocks that hold these records.

        Called with the records of a batch still ahead in the order (``reader.batch_stream``), so the
        disk reads them while the current batches are decoded. It does nothing with read-ahead off,
        for records scattered over many blocks (random order), or for blocks this process advised
        before. When the caller streams the dataset, ``streamed`` and ``at`` (its blocks in use and the
        stream's position, ``reader.streamed_blocks``) make it advise each block once a pass and drop
        the blocks the received batches are done with (``ShardFiles.advise``). It waits for the disk
        only to read the record tables of shards this process has not read yet (``read_tables_ahead``
        starts those reads earlier).
        """
        if not self.readahead:
            return
        idx = self._checked_indices(indices)
        records = self._records
        self._files.advise(self._shard_of(idx), records.offsets[idx], records.nbytes[idx], streamed, at)

    def read_tables_ahead(self, indices: Indices) -> None:
        """Start reading, in the background, the record tables of the shards of records ``indices`` that
        this process has not read yet, where the manifest says where they lie (format 4; for older
        datasets nothing happens). Each table is asked for once; nothing waits for the disk.

        Why: ``advise`` needs a shard's table to find its blocks, and a table read only then waits
        behind every block advised before it; the loader's main process, which advises, then stops
        handing out batches meanwhile (``reader.batch_stream`` calls this well before ``advise``).
        """
        if not self.readahead:
            return
        shards = np.unique(self._shard_of(np.asarray(indices, np.int64)))
        for shard in shards[~self._records.loaded[shards]].tolist():
            info = self.manifest.shards[shard]
            if shard not in self._tables_asked and info.table_offset is not None:
                self._files.advise_bytes(shard, info.table_offset, info.stored_table_nbytes)
            self._tables_asked.add(shard)

    @property
    def drop_behind(self) -> bool:
        """Whether reads drop the pages of the records they read where the main process does not drop
        their blocks (a batch scattered over many blocks: ``reader.shard_io``, "Streaming"): set in
        the workers of a loader that streams a dataset larger than the page cache can keep
        (``reader.loader``)."""
        return self._files.drop_behind

    @drop_behind.setter
    def drop_behind(self, value: bool) -> None:
        self._files.drop_behind = true_or_false("drop_behind", value)

    def close(self) -> None:
        """Close the shard files this process opened (they reopen on the next read)."""
        self._files.close()

    def _checked_indices(self, indices: Indices) -> np.ndarray:
        if self._stale is not None:
            raise FormatError(self._stale)
        idx = np.asarray(indices)
        if idx.size == 0:
            return idx.astype(np.int64).reshape(0)
        if idx.dtype.kind not in "iu" or idx.ndim != 1:
            raise TypeError(f"{self.path}: indices must be a flat sequence of ints, got {indices!r:.80}")
        n = len(self)
        bad = (idx < -n) | (idx >= n)  # before the cast, so a huge unsigned index is named as given
        if bad.any():
            raise IndexError(f"{self.path}: index {idx[bad][0]} is out of range for {n} records")
        idx = idx.astype(np.int64)
        return self._load(np.where(idx < 0, idx + n, idx))

    def _read_raw(self, idx: np.ndarray, allocate: Allocator) -> Images:
        records = self._records
        nbytes = records.nbytes[idx]
        if self.manifest.shape is not None:
            batch = allocate((len(idx), *self.manifest.shape))
            self._read_payloads(idx, _split(batch, nbytes))
            return batch
        return [part.view(3, h, w) for part, h, w in
                zip(self._read_stored(idx, allocate), records.heights[idx].tolist(), records.widths[idx].tolist())]

    def _read_stored(self, idx: np.ndarray, allocate: Allocator) -> list[torch.Tensor]:
        """The records' payloads as they are stored, one 1-D uint8 tensor each, views of one buffer
        (``decode=False``; raw records of varying sizes are these, viewed as images)."""
        nbytes = self._records.nbytes[idx]
        flat = allocate((int(nbytes.sum()),))
        self._read_payloads(idx, _split(flat, nbytes))
        return list(flat.split(nbytes.tolist()))

    def _read_decoded(self, idx: np.ndarray, allocate: Allocator) -> Images:
        """Read the payloads into the scratch buffer and decode them into the batch, each shard's records
        as soon as they are read (all at once with ``decode_threads``). The batch is taken before the
        reads: a fresh buffer's pages are faulted in when it is made (``reader.batch_memory``), so on a
        cold cache that work overlaps the disk reading the blocks instead of following it."""
        records = self._records
        nbytes = records.nbytes[idx]
        total = int(nbytes.sum())
        images: Images  # what is returned: CHW views of the HWC ``outputs`` the records decode into
        if self.manifest.shape is not None:
            _, h, w = self.manifest.shape
            batch = _decode_target(allocate, len(idx) * h * w * 3).view(len(idx), h, w, 3)
            outputs: np.ndarray | list[np.ndarray] = batch.numpy()
            images = batch.permute(0, 3, 1, 2)
        else:  # images of other sizes, each starting where the one before ends, padded (padded_size)
            heights, widths = records.heights[idx].tolist(), records.widths[idx].tolist()
            sizes = [3 * h * w for h, w in zip(heights, widths)]
            starts = np.cumsum([0] + [padded_size(size) for size in sizes]).tolist()
            flat = _decode_target(allocate, starts[-1])
            pixels = [flat[start:start + size].view(h, w, 3)
                      for start, size, h, w in zip(starts, sizes, heights, widths)]
            outputs = [image.numpy() for image in pixels]
            images = [image.permute(2, 0, 1) for image in pixels]
        if len(self._scratch) < total:
            self._scratch = bytearray(total + total // 4)
        payloads = _split_view(memoryview(self._scratch)[:total], nbytes)

        def decode(members: list[int]) -> None:
            self.decode_threads.run(lambda k: self._decode(idx[members[k]], payloads[members[k]],
                                                           outputs[members[k]]), len(members))

        if self.decode_threads.threads > 1:  # threads are handed the whole batch at once, not a shard's part
            self._read_payloads(idx, payloads)
            decode(list(range(len(idx))))
        else:  # decoded shard by shard, as each shard is read (``_read_payloads``)
            self._read_payloads(idx, payloads, then=decode)
        return images

    def _decode(self, record: int, payload: memoryview, out: np.ndarray) -> None:
        try:
            self._encoding.decode_into(payload, out, fast=self.fast_decode,
                                       release_gil=self.decode_threads.threads > 1)
        except ValueError as e:
            shard = self._shard_of(np.asarray([record]))[0]
            within = record - self._shard_starts[shard]
            raise FormatError(f"{self._files.paths[shard]}: record {within} of this shard (dataset "
                              f"record {record}) is not a valid {self._encoding.name} payload of its recorded "
                              f"size: {e}") from None

    def _shard_of(self, idx: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._shard_starts, idx, side="right") - 1

    def _read_payloads(self, idx: np.ndarray, destinations: list[memoryview],
                       then: Callable[[list[int]], None] | None = None) -> None:
        """Fill ``destinations[k]`` with record ``idx[k]``'s payload, one shard at a time, calling
        ``then`` with the positions ``k`` of each shard's records once they are read.

        ``_read_decoded`` decodes each shard's records there, so it decodes while the disk still
        reads the next shard's blocks (advised ahead by the loader's main process, in shard order): on a
        cold cache a batch then waits after its last block only for that shard's decode, not the whole
        batch's (BENCHMARKS.md, "Cold reads from a slow disk")."""
        shards = self._shard_of(idx)
        for shard in np.unique(shards).tolist():
            members = np.flatnonzero(shards == shard).tolist()
            records = idx[members]
            self._files.read(shard, ReadRequest(
                offsets=self._records.offsets[records],
                nbytes=self._records.nbytes[records],
                destinations=[destinations[k] for k in members],
                records=records,
            ))
            if then is not None:
                then(members)


def _decode_target(allocate: Allocator, nbytes: int) -> torch.Tensor:
    """``nbytes`` of a new batch buffer for JPEG records to be decoded into, starting where libjpeg-turbo
    writes with ordinary stores rather than past the cache (``reader.format.jpeg_decode``, "Where the
    pixels go")."""
    flat = allocate((placed_room(nbytes),))
    return flat[placed_span(flat.data_ptr(), nbytes)]


def _private_batch(shape: tuple[int, ...]) -> torch.Tensor:
    """Fresh process-private memory: for samples that leave through someone else's collate."""
    return torch.empty(shape, dtype=torch.uint8)


def _split(tensor: torch.Tensor, nbytes: np.ndarray) -> list[memoryview]:
    """Consecutive byte ranges of a C-contiguous uint8 tensor, one per record."""
    if len(nbytes) == 0:  # an empty batch: memoryview cannot cast a view with a zero in its shape
        return []
    return _split_view(tensor.numpy().data.cast("B"), nbytes)


def _split_view(view: memoryview, nbytes: np.ndarray) -> list[memoryview]:
    ends = np.cumsum(nbytes).tolist()
    starts = [0, *ends[:-1]]
    return [view[a:b] for a, b in zip(starts, ends)]
