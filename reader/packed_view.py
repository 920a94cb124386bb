"""``PackedView``: a ``PackedDataset``, a ``Subset`` of one, a ``ConcatDataset`` of them (nested in any
way) as one sequence of packed records, so that ``make_loader`` and ``ShardSampler`` work on all three.

Each position of the view is a record of one part (a ``PackedDataset``). Knowing that, the view can

- read a batch of positions with the parts' coalesced reads (``read_batch``: zero-copy for a single
  part; a batch that mixes parts of a ``ConcatDataset`` is gathered into one batch buffer);
- tell which quasi-random block of the files each position lies in (``block_ids``), so that a subset or
  a concatenation keeps the slow-disk order: the sampler shuffles those blocks and mixes records within
  windows of them, exactly as it does for a whole dataset;
- give the labels of its positions (``targets``), for a stratified split (``reader.splits``);
- gather the source paths and extra fields of a batch of positions (``field_batch``).

Anything else (a user's own wrapper ``Dataset``) is refused with one line that says what works: such a
dataset goes through a plain ``DataLoader``, since ``PackedDataset`` follows torch's conventions.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset

from reader.batch_memory import new_batch
from reader.dataset import Images, Indices, PackedDataset
from reader.epoch_order import BlockGroups
from reader.streamed_blocks import StreamedBlocks, StreamPosition


class PackedView(Dataset):
    """Positions ``0..len-1`` of ``source``, each a ``(part, record)`` of a ``PackedDataset``.

    ``source`` is a ``PackedDataset`` (or anything with its ``manifest``, ``len`` and ``read_batch``),
    a ``Subset`` or a ``ConcatDataset`` of such, nested in any way; ``TypeError`` otherwise. This is the
    dataset of ``make_loader``'s DataLoader: its ``__getitems__`` returns a whole collated batch for
    that loader's identity collate, so it is not meant for a plain ``DataLoader`` (give that the
    ``source`` itself).
    """

    def __init__(self, source: Dataset) -> None:
        self.source = source
        self._source_name = _name(source)
        parts, part_of, record_of = _resolve(source)
        decodes = {getattr(part, "decode", True) for part in parts}
        if len(decodes) > 1:
            raise ValueError(f"{self._source_name} mixes datasets opened with decode=False and decode=True: a batch "
                             "is either encoded JPEG records or pixels; open every part the same way")
        self.decodes = all(decodes)  # False: batches are encoded records (``PackedDataset(decode=False)``)
        self.parts: list[PackedDataset] = parts
        self._length = len(part_of)
        # per position: [part, record]; None for a whole single part (the identity: nothing per record)
        self._located = None if record_of is None else torch.from_numpy(np.stack([part_of, record_of]))
        self.streaming = False
        self._streamed: dict[int, StreamedBlocks] = {}  # per part, its blocks in use (streaming)
        self._last_advised = -1  # the stream batch last advised (a lower one: a new stream)

    def __getstate__(self) -> dict:
        """Everything but ``source`` (the given dataset; a ``Subset``'s index list is O(records)): a
        worker reads through ``parts`` and the position table, moved to shared memory first so that a
        spawned worker receives a handle to it, not a copy (torch's reductions for multiprocessing).
        The worker's copy has ``source`` None, and none of the main process's advice memory."""
        if self._located is not None and not self._located.is_shared():
            self._located.share_memory_()
        return {**self.__dict__, "source": None, "_streamed": {}, "_last_advised": -1}

    def __len__(self) -> int:
        return self._length

    def shard_bytes(self) -> int:
        """About how many bytes of shard files an epoch over the view reads: each part's bytes in
        proportion to the view's records in it."""
        if self._located is None:
            return self.parts[0].manifest.total_bytes
        counts = np.bincount(self._located.numpy()[0], minlength=len(self.parts))
        return int(sum(part.manifest.total_bytes * int(count) // max(len(part), 1)
                       for part, count in zip(self.parts, counts)))

    def batch_nbytes(self, batch_size: int) -> int | None:
        """The bytes a full batch takes from the batch memory pool when every record has the same shape
        (manifest ``shape``) in every part and is decoded (``PackedDataset.batch_bytes``: the largest
        part's); else None (encoded records vary in size)."""
        shapes = {None if part.manifest.shape is None else tuple(part.manifest.shape) for part in self.parts}
        sizes = [part.batch_bytes(batch_size) for part in self.parts]
        known = [size for size in sizes if size is not None]
        return max(known) if len(shapes) == 1 and len(known) == len(sizes) else None

    def batch_bytes_estimate(self, batch_size: int) -> int:
        """About what a batch takes from the batch memory pool: the largest part's
        ``PackedDataset.batch_bytes_estimate``."""
        return max(part.batch_bytes_estimate(batch_size) for part in self.parts)

    @property
    def readahead(self) -> bool:
        """Whether some part reads blocks ahead."""
        return any(getattr(part, "readahead", False) for part in self.parts)

    @property
    def targets(self) -> np.ndarray:
        """The label of every position (int64)."""
        if self._located is None:
            return np.asarray(self.parts[0].targets, dtype=np.int64)
        labels = np.zeros(len(self), np.int64)
        part_of, record_of = self._positions()
        for k, part in enumerate(self.parts):
            members = part_of == k
            labels[members] = np.asarray(part.targets, dtype=np.int64)[record_of[members]]
        return labels

    def block_ids(self) -> np.ndarray:
        """The block (each part's own layout, ``PackedDataset.block_starts``) of every position, as ids
        numbered across the parts in part order."""
        ids = np.zeros(len(self), np.int64)
        first = 0
        part_of, record_of = self._positions()
        for k, part in enumerate(self.parts):
            starts = part.block_starts()
            members = part_of == k
            ids[members] = first + np.searchsorted(starts, record_of[members], side="right") - 1
            first += len(starts)
        return ids

    def block_groups(self) -> BlockGroups:
        """The positions grouped by block (``block_ids``): for a whole dataset straight from its block
        layout, without a per-record array."""
        if self._located is None:
            return BlockGroups(None, np.append(self.parts[0].block_starts(), len(self)).astype(np.int64))
        return BlockGroups.of(self.block_ids())

    def check_fields(self, names: Sequence[str]) -> None:
        """``KeyError`` naming a field some part does not have; ``ValueError`` naming one whose type
        (vector length, label classes) differs between parts, which could not be batched together."""
        for part in self.parts:
            part.record_fields.check_names(names)
        for name in names:
            specs = [(part.path, spec) for part in self.parts for spec in part.manifest.fields if spec.name == name]
            for path, spec in specs[1:]:
                if spec != specs[0][1]:
                    raise ValueError(f"field {name!r} is {specs[0][1].declaration()} in {specs[0][0]} but "
                                     f"{spec.declaration()} in {path}: a field batched from several datasets "
                                     "needs the same type (vector length, label classes) in each")

    def field_batch(self, positions: Indices, names: Sequence[str]) -> dict[str, Any]:
        """The named fields (``reader.record_fields``) of the records at ``positions``, batched."""
        if self._located is None:
            return self.parts[0].record_fields.batch(np.asarray(positions, dtype=np.int64), names)
        part_of, records = self.locate(positions)
        out: dict[str, Any] = {}
        for k in np.unique(part_of).tolist():
            members = np.flatnonzero(part_of == k)
            for name, values in self.parts[k].record_fields.batch(records[members], names).items():
                if isinstance(values, torch.Tensor):
                    if name not in out:
                        out[name] = values.new_empty((len(records), *values.shape[1:]))
                    out[name][torch.from_numpy(members)] = values
                else:
                    slots = out.setdefault(name, [None] * len(records))
                    for member, value in zip(members.tolist(), values):
                        slots[member] = value
        return out

    def locate(self, positions: Indices) -> tuple[np.ndarray, np.ndarray]:
        """``(part index, record)`` of each position."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and (pos.min() < 0 or pos.max() >= len(self)):
            bad = pos[(pos < 0) | (pos >= len(self))][0]
            raise IndexError(f"position {bad} is out of range for {len(self)} records of {self._source_name}")
        if self._located is None:
            return np.zeros(len(pos), np.int64), pos
        located = self._located.numpy()[:, pos]
        return located[0], located[1]

    def _positions(self) -> tuple[np.ndarray, np.ndarray]:
        """``(part, record)`` of every position (made on the fly for the identity)."""
        if self._located is None:
            return np.zeros(len(self), np.int64), np.arange(len(self), dtype=np.int64)
        located = self._located.numpy()
        return located[0], located[1]

    def __getitems__(self, positions: Indices) -> tuple[Images, torch.Tensor]:
        return self.read_batch(positions)

    def read_batch(self, positions: Indices) -> tuple[Images, torch.Tensor]:
        """The records at ``positions`` as one batch, like ``PackedDataset.read_batch``."""
        if self._located is None:
            return self.parts[0].read_batch(positions)
        part_of, records = self.locate(positions)
        used = np.unique(part_of).tolist()
        if len(used) == 1:
            return self.parts[used[0]].read_batch(records)
        pieces = [(np.flatnonzero(part_of == k), *self.parts[k].read_batch(records[part_of == k])) for k in used]
        labels = torch.empty(len(records), dtype=torch.int64)
        for members, _, part_labels in pieces:
            labels[members] = part_labels
        return _gathered([(members, images) for members, images, _ in pieces], len(records)), labels

    def advise(self, positions: Indices, at: StreamPosition | None = None) -> None:
        """``PackedDataset.advise`` for each part's records among ``positions``, the batch ``at`` of the
        loader's stream. A ``streaming`` view keeps each part's blocks in use (``reader.streamed_blocks``)
        over one stream (a batch numbered lower than the last starts a new one), and drops, in every
        part, the blocks the received batches are done with; otherwise each part remembers what it
        advised."""
        if not self.streaming or at is None:
            for k, records in self._reading_ahead(positions):
                self.parts[k].advise(records)
            return
        if at.batch <= self._last_advised:  # a new stream: the DataLoader's workers were reset
            self._forget_stream()
        self._last_advised = at.batch
        reading = dict(self._reading_ahead(positions))
        for k, part in enumerate(self.parts):
            if k in reading or k in self._streamed:
                streamed = self._streamed.setdefault(k, StreamedBlocks())
                part.advise(reading.get(k, np.zeros(0, np.int64)), streamed, at)

    def _forget_stream(self) -> None:
        """Drop the blocks the last stream still held and start new ledgers. Safe: a DataLoader resets
        its workers only once each has finished every task it had (torch's persistent workers
        acknowledge the reset after their queued batches), so the last stream's batches are all in."""
        everything = StreamPosition(batch=self._last_advised, pass_number=-1, received=sys.maxsize)
        for k, streamed in self._streamed.items():
            self.parts[k].advise(np.zeros(0, np.int64), streamed, everything)
        self._streamed = {}

    def read_tables_ahead(self, positions: Indices) -> None:
        """``PackedDataset.read_tables_ahead`` for each part's records among ``positions``."""
        for k, records in self._reading_ahead(positions):
            self.parts[k].read_tables_ahead(records)

    def _reading_ahead(self, positions: Indices) -> list[tuple[int, np.ndarray]]:
        """``(part index, its records)`` among ``positions``, for each part that reads ahead."""
        part_of, records = self.locate(positions)
        return [(k, records if self._located is None else records[part_of == k])
                for k in np.unique(part_of).tolist() if getattr(self.parts[k], "readahead", False)]

    def enter_worker(self) -> None:
        """In a loader's worker process: a ``streaming`` view's parts drop the pages of the scattered
        batches they read (``PackedDataset.drop_behind``), the worker's own copies only."""
        if self.streaming:
            for part in self.parts:
                part.drop_behind = True

    def __getitem__(self, position: int) -> tuple[torch.Tensor, int]:
        part_of, records = self.locate([position])
        return self.parts[int(part_of[0])][int(records[0])]


def as_view(dataset: Dataset) -> PackedView:
    """``dataset`` itself when it is a ``PackedView``, else a view of it."""
    return dataset if isinstance(dataset, PackedView) else PackedView(dataset)


def _gathered(pieces: list[tuple[np.ndarray, Images]], count: int) -> Images:
    """One batch of ``count`` images from the parts' batches, each piece going to its ``members``,
    copied into one new batch buffer (the parts' buffers go back to their pool at once)."""
    tensors = [images for _, images in pieces if isinstance(images, torch.Tensor)]
    if len(tensors) == len(pieces) and len({t.shape[1:] for t in tensors}) == 1:
        _, channels, height, width = tensors[0].shape
        if all(t.stride(1) == 1 for t in tensors):  # all channels-last (decoded JPEG): keep that layout
            batch = new_batch((count, height, width, channels)).permute(0, 3, 1, 2)
        else:
            batch = new_batch((count, channels, height, width))
        for (members, _), images in zip(pieces, tensors):
            batch[torch.from_numpy(members)] = images
        return batch
    ordered: list[torch.Tensor] = [torch.empty(0)] * count
    for members, part_images in pieces:
        for k, image in zip(members.tolist(), part_images):
            ordered[k] = image
    # One buffer for all (a make_loader worker hands over the slot behind the first image only).
    flat = new_batch((sum(image.numel() for image in ordered),))
    return [part.view(image.shape).copy_(image)
            for part, image in zip(flat.split([image.numel() for image in ordered]), ordered)]


def _resolve(dataset: Dataset) -> tuple[list, np.ndarray, np.ndarray | None]:
    """``(parts, part index per position, record per position)``; records ``None`` for a whole
    single part (the identity, kept without arrays)."""
    if hasattr(dataset, "manifest") and not isinstance(dataset, (Subset, ConcatDataset)):
        return [dataset], np.zeros(len(dataset), np.int64), None  # type: ignore[arg-type]
    if isinstance(dataset, Subset):
        parts, part_of, record_of = _resolve(dataset.dataset)
        given = np.asarray(dataset.indices).reshape(-1)
        if given.size and given.dtype.kind not in "iub":  # a float index would silently be truncated
            raise TypeError(f"Subset indices must be ints, got {given[0]!r} (dtype {given.dtype}) in the Subset of "
                            f"{_name(dataset.dataset)}")
        indices = given.astype(np.int64)
        size = len(part_of)
        if indices.size and (indices.min() < -size or indices.max() >= size):
            bad = indices[(indices < -size) | (indices >= size)][0]
            raise IndexError(f"Subset index {bad} is out of range for {size} records of "
                             f"{_name(dataset.dataset)}")
        indices = np.where(indices < 0, indices + size, indices)
        if record_of is None:
            record_of = np.arange(size, dtype=np.int64)
        return parts, part_of[indices], record_of[indices]
    if isinstance(dataset, ConcatDataset):
        parts = []
        part_ofs: list[np.ndarray] = []
        records: list[np.ndarray] = []
        for child in dataset.datasets:
            child_parts, child_part_of, child_records = _resolve(child)
            numbers = []
            for part in child_parts:
                known = [k for k, seen in enumerate(parts) if seen is part]
                numbers.append(known[0] if known else len(parts))
                if not known:
                    parts.append(part)
            part_ofs.append(np.asarray(numbers, np.int64)[child_part_of])
            records.append(np.arange(len(child_part_of), dtype=np.int64) if child_records is None
                           else child_records)
        if not parts:
            raise ValueError("make_loader: the ConcatDataset holds no dataset")
        return parts, np.concatenate(part_ofs), np.concatenate(records)
    raise TypeError(
        f"make_loader, ShardSampler and split take a PackedDataset, a Subset or a ConcatDataset of them, "
        f"not {type(dataset).__name__}; give this dataset to a plain torch DataLoader instead "
        f"(PackedDataset works there like any map-style dataset)")


def _name(dataset: Dataset) -> str:
    path = getattr(dataset, "path", None)
    return str(path) if path is not None else type(dataset).__name__


def check_own_reads(dataset: Dataset) -> None:
    """Refuse a dataset whose class overrides how items are read (``__getitem__``/``__getitems__``):
    ``make_loader`` reads its records with ``PackedDataset.read_batch`` (an override of which is honoured),
    so that code would silently never run.
    Checks a ``PackedDataset``, ``Subset`` or ``ConcatDataset`` subclass at any depth."""
    for base in (PackedDataset, Subset, ConcatDataset):
        if isinstance(dataset, base):
            own = [name for name in ("__getitem__", "__getitems__")
                   if getattr(type(dataset), name, None) is not getattr(base, name, None)]
            if own:
                raise TypeError(
                    f"make_loader reads the records of {type(dataset).__name__} with PackedDataset.read_batch, so its "
                    f"own {' and '.join(own)} would never run; give it to a plain torch DataLoader instead, or "
                    "apply that code to make_loader's batches")
    for child in [getattr(dataset, "dataset", None), *getattr(dataset, "datasets", [])]:
        if isinstance(child, Dataset):
            check_own_reads(child)
