"""``split_dataset``: a finished dataset written again as two, its training and validation parts.

What ``packer split SRC TRAIN VAL`` runs. The records are those ``reader.split(PackedDataset(SRC),
val_fraction, seed)`` chooses (one rule: ``reader.split_rule``), each part in file order. Why on disk:
a validation part read through ``reader.split`` is scattered over every block of the files, so where
the dataset does not stay in the page cache (a slow disk, a dataset larger than memory) every
validation pass reads the whole dataset; split on disk, a pass reads only its own records.

Records are copied, never decoded: each payload's bytes, label, size, source path and fields go into
the new shards as they were, under the source's classes, encoding and pre-transform; each part gets new
checksums and its manifest last, as a pack does. Every source shard is checked against its manifest
checksum before its records are copied, so a damaged shard is refused, not given fresh checksums.
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import PackError
from packer.options import DEFAULT_SHARD_SIZE
from packer.run.cleanup import cleaned_up_on_failure
from packer.run.destination import check_destination, remove_own_files
from packer.run.locking import claimed_destination
from packer.version import __version__
from reader.format import DatasetWriter, Manifest, load_manifest
from reader.format.fields import SOURCE, Column
from reader.format.shard_files import checked_shard
from reader.format.shard_tables import load_shard_columns, load_shard_table
from reader.split_rule import split_indices

PARTS = ("train", "val")


@dataclass
class SplitReport:
    """The two new datasets' manifests."""

    train: Manifest
    val: Manifest


def split_dataset(
    src: str | os.PathLike, train_out: str | os.PathLike, val_out: str | os.PathLike, val_fraction: float,
    seed: int = 0, shard_size: int = DEFAULT_SHARD_SIZE, force: bool = False,
) -> SplitReport:
    """Write the finished dataset ``src`` again as two new datasets, ``train_out`` and ``val_out``: the
    records ``reader.split(PackedDataset(src), val_fraction, seed)`` puts in each part, copied, in file
    order, in shards of at most ``shard_size`` payload bytes. ``force`` replaces finished datasets there."""
    src, outs = Path(src), (Path(train_out), Path(val_out))
    manifest = load_manifest(src)
    if outs[0].resolve() == outs[1].resolve():
        raise PackError(f"{outs[0]}: the training and validation parts need directories of their own")
    for out in outs:
        if out.resolve() == src.resolve() or out.resolve().is_relative_to(src.resolve()):
            raise PackError(f"{out}: a part cannot be written in {src}, the dataset being split")
        check_destination(out, force)
    tables = [load_shard_table(src, manifest.storage, shard, manifest.label_range, manifest.encoding,
                               manifest.shape, checksum=True) for shard in manifest.shards]
    labels = np.concatenate([table["label"] for table in tables]) if tables else np.zeros(0, np.int64)
    try:
        train, val = split_indices(labels.astype(np.int64), val_fraction, seed)
    except (TypeError, ValueError) as e:
        raise PackError(f"split: {e}") from None
    for part, chosen in zip(PARTS, (train, val)):
        if len(chosen) == 0:
            raise PackError(f"{src}: a val_fraction of {val_fraction} leaves the {part} part of its "
                            f"{len(labels)} records empty; choose a fraction that gives both parts records")
    in_val = np.zeros(len(labels), dtype=bool)
    in_val[val] = True
    with ExitStack() as stack:
        for out in outs:
            stack.enter_context(claimed_destination(out, force))
            stack.enter_context(cleaned_up_on_failure(out))
            remove_own_files(out)
        writers = [DatasetWriter(out, manifest.storage, shard_size, fields=manifest.fields) for out in outs]
        try:
            _copy_records(src, manifest, tables, in_val, writers)
            finished = [writer.finish(encoding=manifest.encoding, classes=manifest.classes, shape=manifest.shape,
                                      transform=manifest.transform, tool_version=__version__,
                                      jpeg_quality=manifest.jpeg_quality, labelled=manifest.labelled,
                                      source=_split_source(src, manifest, part, len(chosen), val_fraction, seed))
                        for writer, part, chosen in zip(writers, PARTS, (train, val))]
        except BaseException:
            for writer in writers:
                writer.abort()
            raise
    return SplitReport(*finished)


def _copy_records(src: Path, manifest: Manifest, tables: list[np.ndarray], in_val: np.ndarray,
                  writers: list[DatasetWriter]) -> None:
    """Every record of ``src``, shard by shard, to the writer of its part (``in_val``: record by record,
    in dataset order), with its label, size, source path and fields."""
    first = 0
    for shard, table in zip(manifest.shards, tables):
        columns = (load_shard_columns(src, manifest.storage, shard, manifest.fields) if manifest.has_sources
                   else None)
        with checked_shard(src, shard) as (fd, _):
            for row, record in enumerate(table):
                offset, nbytes = int(record["offset"]), int(record["nbytes"])
                payload = os.pread(fd, nbytes, offset)
                if len(payload) != nbytes:
                    raise PackError(f"{src / shard.file}: record {row}: the file ends inside it (changed while "
                                    "it was split?)")
                source, fields = _record_extras(columns, manifest, row, first + row)
                writers[int(in_val[first + row])].add(payload, int(record["label"]), int(record["height"]),
                                                      int(record["width"]), source=source, fields=fields)
        first += len(table)


def _record_extras(columns: dict[str, Column] | None, manifest: Manifest, row: int,
                   index: int) -> tuple[str, dict[str, Any]]:
    """Record ``row`` of a shard (``index`` of the dataset): its source path and field values as the
    writer takes them; a version-1 dataset stores none, so its records are named by their index."""
    if columns is None:
        return f"record {index}", {}
    return columns[SOURCE].value(row), {field.name: field.parse(columns[field.name].value(row))
                                        for field in manifest.fields}


def _split_source(src: Path, manifest: Manifest, part: str, records: int, val_fraction: float,
                  seed: int) -> dict[str, Any]:
    """The new part's ``source`` summary: where its records came from, and how they were chosen."""
    return {"kind": "split", "root": str(src), "files": records, "packed": records, "skipped": [],
            "split": {"part": part, "val_fraction": val_fraction, "seed": seed, "of": manifest.num_records,
                      "source": {k: v for k, v in manifest.source.items() if k != "skipped"}}}
