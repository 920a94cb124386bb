"""``verify()``: check a packed dataset against its manifest, and optionally read back every record.

Always: every shard file exists, has the manifest's size and checksum, and a readable record table
with the manifest's record count whose rows are sane (labels index a class, payloads lie inside the
file, raw payloads are ``3*H*W`` bytes, sizes match a fixed ``shape``). With ``deep``: every record is
read through the container's own API (``Container.read_records``: LMDB ``txn.get``, an HDF5 dataset
slice) and must equal the bytes at the table's offset, and pass its encoding's check
(``Encoding.payload_problem``: a JPEG must decode, with PIL, to the recorded size).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from reader.format import (
    Encoding,
    FileIdentity,
    FormatError,
    Manifest,
    ShardInfo,
    container,
    encoding,
    file_checksum,
    load_manifest,
    table_problems,
)
from reader.format.fields import SOURCE, Column, printable
from reader.format.records import OUTSIDE_THE_FILE
from reader.format.shard_files import checked_shard, describe_file_type, fd_path, open_checked
from reader.format.shard_tables import load_shard_columns, table_at_offset

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
) -> dict[int, tuple[np.ndarray, np.ndarray, Column | None]]:
    """Checksums, sizes and record tables of every shard; returns the tables that could be read, each
    with the mask of its rows inside the file and its source column (None: version 1, or unreadable).

    A shard that is missing, not a regular file (a symlink, FIFO or device is never opened) or not of
    the manifest's size (LMDB would map missing pages) is reported and read no further.
    """
    tables: dict[int, tuple[np.ndarray, np.ndarray, Column | None]] = {}
    present = {number: st for number, shard in enumerate(manifest.shards)
               if (st := _shard_stat(root, shard, report)) is not None}
    total = sum(st.st_size for st in present.values())
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="checksums") as bar:
        for number, st in present.items():
            shard = manifest.shards[number]
            path = root / shard.file
            try:
                fd = open_checked(path, FileIdentity.of(st))
            except FormatError as e:
                report.problems.append(f"{shard.file}: {e}")
                continue
            try:
                opened = fd_path(fd)
                if file_checksum(opened, progress=bar.update) != shard.checksum:
                    report.problems.append(f"{shard.file}: checksum mismatch (the file is corrupt or changed)")
                table = container(manifest.storage).read_table(opened, path, shard.records,
                                                               compressed=shard.compressed)
                if shard.table_offset is not None and not _same_table_at_offset(fd, shard, st.st_size, path, table):
                    report.problems.append(f"{shard.file}: the record table at the manifest's table_offset "
                                           f"({shard.table_offset}) is not the one the container holds (the "
                                           "shard or the manifest was damaged or edited)")
            except FormatError as e:
                report.problems.append(f"{shard.file}: record table unreadable ({e})")
                continue
            finally:
                os.close(fd)
            sources = _record_sources(root, manifest, shard, report)
            tables[number] = (table, _check_table(shard.file, table, st.st_size, manifest, report, sources), sources)
            report.records += len(table)
    return tables


def _same_table_at_offset(fd: int, shard: ShardInfo, file_size: int, shown: Path, table: np.ndarray) -> bool:
    """Whether the bytes at the shard's ``table_offset`` are a record table equal to ``table`` (the
    container's); bytes that are no table at all are not (the container's table is then checked on)."""
    try:
        return table_at_offset(fd, shard, file_size, shown).tobytes() == table.tobytes()
    except FormatError:
        return False


def _shard_stat(root: Path, shard: ShardInfo, report: VerifyReport) -> os.stat_result | None:
    """The shard's ``lstat`` when it is a regular file of the manifest's size; else a reported problem."""
    try:
        st = os.lstat(root / shard.file)
    except FileNotFoundError:
        report.problems.append(f"{shard.file}: missing (the manifest lists it)")
        return None
    except OSError as e:
        report.problems.append(f"{shard.file}: cannot stat the file ({e.strerror})")
        return None
    if not stat.S_ISREG(st.st_mode):
        report.problems.append(f"{shard.file}: {describe_file_type(st.st_mode)}, not a regular file (not opened)")
        return None
    report.bytes += st.st_size
    if st.st_size != shard.bytes:
        report.problems.append(f"{shard.file}: {st.st_size} bytes, the manifest says {shard.bytes} "
                               "(truncated or changed; not read further)")
        return None
    return st


def _record_sources(root: Path, manifest: Manifest, shard: ShardInfo, report: VerifyReport) -> Column | None:
    """The shard's source column, after reading and checking all its record columns (source paths and
    fields: format version 2); None for version 1, or reported when they are damaged."""
    if not manifest.has_sources:
        return None
    try:
        return load_shard_columns(root, manifest.storage, shard, manifest.fields)[SOURCE]
    except FormatError as e:
        report.problems.append(f"{shard.file}: record columns unreadable ({e})")
        return None


def _check_table(
    name: str, table: np.ndarray, size: int, manifest: Manifest, report: VerifyReport, sources: Column | None
) -> np.ndarray:
    """Row-level sanity of one record table (labels, payload bounds, raw sizes, fixed shape); returns
    which rows are worth reading back (those inside the file)."""
    problems = table_problems(table, manifest.label_range, encoding(manifest.encoding), manifest.shape, size)
    readable = np.ones(len(table), dtype=bool)
    for what, indices in problems:
        _report_records(name, indices, what, report, sources)
        if what == OUTSIDE_THE_FILE:
            readable[indices] = False
    return readable


def _read_back(
    root: Path, manifest: Manifest, tables: dict[int, tuple[np.ndarray, np.ndarray, Column | None]],
    report: VerifyReport, progress: bool,
) -> None:
    """Every record through the container API, compared with the bytes at its offset, then decoded."""
    total = sum(len(table) for table, _, _ in tables.values())
    shard_container, payload_encoding = container(manifest.storage), encoding(manifest.encoding)
    with tqdm(total=total, unit="rec", disable=not progress, desc="records") as bar:
        for number, (table, readable, sources) in tables.items():
            shard = manifest.shards[number]
            path = root / shard.file
            bad: dict[str, list[int]] = {}
            try:
                with checked_shard(root, shard) as (fd, identity):
                    records = shard_container.read_records(fd_path(fd), identity.size, path, table)
                    for index, payload in enumerate(records):
                        bar.update()
                        if not readable[index]:
                            continue
                        row = table[index]
                        at_offset = os.pread(fd, int(row["nbytes"]), int(row["offset"]))
                        problem = _record_problem(payload, at_offset, row, payload_encoding)
                        if problem:
                            bad.setdefault(problem, []).append(index)
            except (OSError, FormatError) as e:
                report.problems.append(f"{shard.file}: the {manifest.storage} container cannot be read back ({e})")
                continue
            for problem, indices in bad.items():
                _report_records(shard.file, np.array(indices), problem, report, sources)


def _record_problem(payload: bytes | None, at_offset: bytes, row: np.void, encoding: Encoding) -> str | None:
    """What is wrong with one record, or None."""
    if payload is None:
        return "missing from the container"
    if payload != at_offset:
        return "container bytes differ from the bytes at the table's offset"
    return encoding.payload_problem(payload, int(row["height"]), int(row["width"]))


def _report_records(
    name: str, indices: np.ndarray, what: str, report: VerifyReport, sources: Column | None
) -> None:
    """One problem line per bad record (the first few, with its source path where the shard stores
    it), then a count of the rest."""
    for index in indices[:MAX_PROBLEMS_PER_CHECK].tolist():
        source = f" ({printable(sources.value(index))})" if sources is not None else ""
        report.problems.append(f"{name}: record {index}{source}: {what}")
    if len(indices) > MAX_PROBLEMS_PER_CHECK:
        report.problems.append(f"{name}: ... and {len(indices) - MAX_PROBLEMS_PER_CHECK} more records: {what}")

