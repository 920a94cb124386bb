"""``verify()``: check a packed dataset against its manifest, and optionally read back every record.

Always: every shard file exists, has the manifest's size and checksum, and a readable record table
with the manifest's record count whose rows are sane (labels index a class, payloads lie inside the
file, raw payloads are ``3*H*W`` bytes, sizes match a fixed ``shape``). With ``deep``: every record is
read through the container's own API (LMDB ``txn.get``, an HDF5 dataset slice) and must equal the bytes
at the table's offset, and it must decode (raw: its size; JPEG: PIL decodes it to the recorded size).
"""
from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np
from PIL import Image
from tqdm import tqdm

from reader.format import (
    FormatError,
    Manifest,
    file_checksum,
    load_manifest,
    read_record_table,
    table_problems,
)
from reader.format.hdf5_shard import RECORDS_DATASET
from reader.format.hdf5_shard import open_readonly as open_hdf5
from reader.format.lmdb_shard import open_readonly as open_lmdb
from reader.format.lmdb_shard import record_key

MAX_PROBLEMS_PER_CHECK = 5


@dataclass
class VerifyReport:
    """What was checked and every problem found; each problem names the shard (and record) at fault."""

    path: str
    shards: int = 0
    records: int = 0
    bytes: int = 0
    deep: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(path: str | os.PathLike, deep: bool = False, progress: bool = True) -> VerifyReport:
    """Check the dataset at ``path``; raises ``FormatError`` only when it has no readable manifest."""
    root = Path(path)
    manifest = load_manifest(root)
    report = VerifyReport(str(root), shards=len(manifest.shards), deep=deep)
    tables = _check_files(root, manifest, report, progress)
    if deep:
        _read_back(root, manifest, tables, report, progress)
    packed = manifest.source.get("packed")
    if packed is not None and packed != manifest.num_records:
        report.problems.append(
            f"manifest: source.packed is {packed} but the shards hold {manifest.num_records} records"
        )
    return report


def _check_files(
    root: Path, manifest: Manifest, report: VerifyReport, progress: bool
) -> dict[int, np.ndarray]:
    """Checksums, sizes and record tables of every shard; returns the tables that could be read."""
    tables: dict[int, np.ndarray] = {}
    present = [(root / s.file).is_file() for s in manifest.shards]
    total = sum((root / s.file).stat().st_size for s, ok in zip(manifest.shards, present) if ok)
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="checksums") as bar:
        for number, (shard, exists) in enumerate(zip(manifest.shards, present)):
            path = root / shard.file
            if not exists:
                report.problems.append(f"{shard.file}: missing (the manifest lists it)")
                continue
            size = path.stat().st_size
            report.bytes += size
            if size != shard.bytes:
                report.problems.append(f"{shard.file}: {size} bytes, the manifest says {shard.bytes}")
            if file_checksum(path, progress=bar.update) != shard.checksum:
                report.problems.append(f"{shard.file}: checksum mismatch (the file is corrupt or changed)")
            try:
                table = read_record_table(manifest.storage, path)
            except FormatError as e:
                report.problems.append(f"{shard.file}: record table unreadable ({e})")
                continue
            if len(table) != shard.records:
                report.problems.append(
                    f"{shard.file}: record table has {len(table)} rows, the manifest says {shard.records}"
                )
            _check_table(shard.file, table, size, manifest, report)
            tables[number] = table
            report.records += len(table)
    return tables


def _check_table(name: str, table: np.ndarray, size: int, manifest: Manifest, report: VerifyReport) -> None:
    """Row-level sanity of one record table: labels, payload bounds, raw sizes, fixed shape."""
    problems = table_problems(table, len(manifest.classes), manifest.encoding, manifest.shape, size)
    for what, indices in problems:
        _report_records(name, indices, what, report)


def _read_back(
    root: Path, manifest: Manifest, tables: dict[int, np.ndarray], report: VerifyReport, progress: bool
) -> None:
    """Every record through the container API, compared with the bytes at its offset, then decoded."""
    total = sum(len(t) for t in tables.values())
    with tqdm(total=total, unit="rec", disable=not progress, desc="records") as bar:
        for number, table in tables.items():
            name = manifest.shards[number].file
            path = root / name
            bad: dict[str, list[int]] = {}
            try:
                with open(path, "rb") as f:
                    for index, payload in enumerate(_container_records(manifest.storage, path, table)):
                        row = table[index]
                        at_offset = os.pread(f.fileno(), int(row["nbytes"]), int(row["offset"]))
                        problem = _record_problem(payload, at_offset, row, manifest.encoding)
                        if problem:
                            bad.setdefault(problem, []).append(index)
                        bar.update()
            except (OSError, lmdb.Error) as e:
                report.problems.append(f"{name}: the {manifest.storage} container cannot be read back ({e})")
                continue
            for problem, indices in bad.items():
                _report_records(name, np.array(indices), problem, report)


def _container_records(storage: str, path: Path, table: np.ndarray) -> Iterator[bytes | None]:
    """Each record's payload as the container's own API returns it (None when it is absent)."""
    if storage == "lmdb":
        env = open_lmdb(path)
        try:
            with env.begin() as txn:
                for index in range(len(table)):
                    yield txn.get(record_key(index))
        finally:
            env.close()
        return
    with open_hdf5(path) as f:
        records = f[RECORDS_DATASET]
        start = 0
        for nbytes in table["nbytes"].tolist():
            yield records[start : start + nbytes].tobytes()
            start += nbytes


def _record_problem(payload: bytes | None, at_offset: bytes, row: np.void, encoding: str) -> str | None:
    """What is wrong with one record, or None."""
    if payload is None:
        return "missing from the container"
    if payload != at_offset:
        return "container bytes differ from the bytes at the table's offset"
    if encoding == "jpeg":
        return _jpeg_problem(payload, int(row["height"]), int(row["width"]))
    return None


def _jpeg_problem(payload: bytes, height: int, width: int) -> str | None:
    try:
        with Image.open(io.BytesIO(payload)) as img:
            img.load()
            size = img.size
    except Exception as e:
        return f"JPEG does not decode ({type(e).__name__}: {e})"
    if size != (width, height):
        return f"JPEG decodes to {size[0]}x{size[1]}, the table says {width}x{height}"
    return None


def _report_records(name: str, indices: np.ndarray, what: str, report: VerifyReport) -> None:
    """One problem line per bad record (the first few), then a count of the rest."""
    for index in indices[:MAX_PROBLEMS_PER_CHECK].tolist():
        report.problems.append(f"{name}: record {index}: {what}")
    if len(indices) > MAX_PROBLEMS_PER_CHECK:
        report.problems.append(f"{name}: ... and {len(indices) - MAX_PROBLEMS_PER_CHECK} more records: {what}")

