"""``info()``: what a packed dataset holds, from its manifest and the shard files on disk."""
from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from reader.format import MANIFEST_NAME, FormatError, load_manifest, load_shard_table
from reader.format.shard_files import check_stat


@dataclass(frozen=True)
class DatasetInfo:
    """A summary of a packed dataset. ``bytes_on_disk`` counts the manifest and the shard files present
    as regular files (a symlink is never followed); ``missing_shards`` names the shard files the manifest
    lists that are not there, ``damaged_shards`` says why each shard file that is there would be refused
    when the dataset is opened (``reader.format.shard_files.check_stat``: a symlink, FIFO or
    device, or not the manifest's size). ``packer verify`` checks the rest."""

    path: str
    storage: str
    encoding: str
    jpeg_quality: int | None
    shape: list[int] | None
    records: int
    classes: list[str]
    shards: int
    bytes_on_disk: int
    transform: dict[str, Any]
    source: dict[str, Any]
    tool_version: str
    format_version: int
    fields: list[dict[str, Any]]
    labelled: bool
    missing_shards: list[str]
    damaged_shards: list[str]

    @property
    def skipped(self) -> list[dict[str, str]]:
        return list(self.source.get("skipped", []))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (``packer info --json``)."""
        return asdict(self)


def info(path: str | os.PathLike) -> DatasetInfo:
    """Read ``path/manifest.json`` and look at the shard files without opening one (``DatasetInfo``);
    raises ``FormatError`` when it is not a dataset."""
    root = Path(path)
    manifest = load_manifest(root)
    on_disk = os.lstat(root / MANIFEST_NAME).st_size
    missing: list[str] = []
    damaged: list[str] = []
    for shard in manifest.shards:
        try:
            st = os.lstat(root / shard.file)
        except FileNotFoundError:
            missing.append(shard.file)
            continue
        if stat.S_ISREG(st.st_mode):
            on_disk += st.st_size
        try:
            check_stat(root / shard.file, st, shard.bytes)  # as opening the dataset checks it
        except FormatError as e:
            damaged.append(str(e))
    return DatasetInfo(
        path=str(root.resolve()),
        storage=manifest.storage,
        encoding=manifest.encoding,
        jpeg_quality=manifest.jpeg_quality,
        shape=manifest.shape,
        records=manifest.num_records,
        classes=list(manifest.classes),
        shards=len(manifest.shards),
        bytes_on_disk=on_disk,
        transform=manifest.transform,
        source=manifest.source,
        tool_version=manifest.tool_version,
        format_version=manifest.format_version,
        fields=[field.to_json() for field in manifest.fields],
        labelled=manifest.labelled,
        missing_shards=missing,
        damaged_shards=damaged,
    )


def class_counts(path: str | os.PathLike) -> dict[str, int]:
    """How many records each class has, counted from the shards' record tables (each shard is checked
    as the reader checks it); empty for an unlabelled dataset."""
    root = Path(path)
    manifest = load_manifest(root)
    if not manifest.labelled:
        return {}
    counts = np.zeros(len(manifest.classes), dtype=np.int64)
    for shard in manifest.shards:
        table = load_shard_table(root, manifest.storage, shard, manifest.label_range, manifest.encoding,
                                 manifest.shape)
        counts += np.bincount(table["label"], minlength=len(manifest.classes))
    return dict(zip(manifest.classes, counts.tolist()))


def describe_transform(transform: dict[str, Any]) -> str:
    """One line for people: the resize, filter and crop a manifest's ``transform`` records.

    The manifest is someone else's file: a description this packer did not write prints as
    ``unrecognised (...)`` rather than failing ``info``.
    """
    try:
        return _describe_known_transform(transform)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return f"unrecognised ({json.dumps(transform)[:80]})"


def _describe_known_transform(transform: dict[str, Any]) -> str:
    parts = []
    resize = transform.get("resize")
    if resize and "shorter_side" in resize:
        parts.append(f"resize shorter side to {resize['shorter_side']}")
    elif resize:
        parts.append("resize to {}x{}".format(*resize["size"]))
    if resize:
        library = f" ({transform['resampler_library']})" if transform.get("resampler_library") else ""
        parts.append(f"{transform.get('filter')}{' antialiased' if transform.get('antialias') else ''}{library}")
    crop = transform.get("crop")
    if crop:
        parts.append("center crop {}x{}".format(*crop["size"]))
    return ", ".join(parts) or "none (original sizes)"
