"""What an unfinished pack has written, so that a rerun (or ``packer merge``) knows what is done.

Two kinds of small JSON files in DST, each written atomically:

- ``.pack-plan.json``: the fingerprint of the plan and options, the partitions' position ranges and
  everything the manifest needs besides the shards (classes, transform, source summary). Written by
  whoever starts packing the plan; every task of one job writes the same bytes.
- ``.part-NNNNN.json``, one per *finished* partition, written after its last shard is published: the
  fingerprint, its range, its shards (``ShardInfo``) and the files it skipped. Its presence, with a
  matching fingerprint and shards whose size and checksum still match, is what "partition done" means.

A rerun keeps the partitions that are done and redoes every other one from scratch. All of these files
are removed once ``manifest.json`` is written. Resuming assumes the source files did not change.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from packer.run.destination import PLAN_NAME, part_record_name
from packer.run.partitions import Partition
from packer.source.scan import Plan, Skipped
from reader.format import ShardInfo, file_checksum
from reader.format.durable import fsync_directory, write_file_atomically


@dataclass
class PlanRecord:
    """The plan as the partitions' tasks and ``merge`` see it: no paths, only what the manifest needs."""

    fingerprint: str
    partitions: list[Partition]
    manifest: dict[str, Any]
    scan_skipped: list[Skipped] = field(default_factory=list)

    def save(self, dst: Path) -> None:
        data = {
            "fingerprint": self.fingerprint,
            "partitions": [[p.start, p.end] for p in self.partitions],
            "manifest": self.manifest,
            "scan_skipped": [dataclasses.asdict(s) for s in self.scan_skipped],
        }
        # The tasks of a job may all write it at once: each stages its copy under a name of its own.
        staged = dst / f"{PLAN_NAME}.{socket.gethostname()}-{os.getpid()}"
        write_file_atomically(staged, json.dumps(data, indent=1).encode())
        os.replace(staged, dst / PLAN_NAME)
        fsync_directory(dst)

    @classmethod
    def load(cls, dst: Path) -> PlanRecord | None:
        """The saved plan record, or None when there is none or it cannot be read."""
        data = _read_json(dst / PLAN_NAME)
        try:
            return cls(
                fingerprint=data["fingerprint"],
                partitions=[Partition(i, int(s), int(e)) for i, (s, e) in enumerate(data["partitions"])],
                manifest=dict(data["manifest"]),
                scan_skipped=[Skipped(s["path"], s["reason"]) for s in data["scan_skipped"]],
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class PartRecord:
    """One finished partition: its shards in order, and the files it skipped with their positions."""

    fingerprint: str
    partition: Partition
    shards: list[ShardInfo]
    skipped: list[tuple[int, Skipped]] = field(default_factory=list)

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)

    def save(self, dst: Path) -> None:
        data = {
            "fingerprint": self.fingerprint,
            "partition": self.partition.index,
            "start": self.partition.start,
            "end": self.partition.end,
            "shards": [dataclasses.asdict(s) for s in self.shards],
            "skipped": [{"index": i, "path": s.path, "reason": s.reason} for i, s in self.skipped],
        }
        write_file_atomically(dst / part_record_name(self.partition.index), json.dumps(data, indent=1).encode())

    @classmethod
    def load(cls, dst: Path, index: int) -> PartRecord | None:
        """Partition ``index``'s record, or None when there is none or it cannot be read."""
        data = _read_json(dst / part_record_name(index))
        try:
            return cls(
                fingerprint=data["fingerprint"],
                partition=Partition(int(data["partition"]), int(data["start"]), int(data["end"])),
                shards=[ShardInfo(**s) for s in data["shards"]],
                skipped=[(int(s["index"]), Skipped(s["path"], s["reason"])) for s in data["skipped"]],
            )
        except (KeyError, TypeError, ValueError):
            return None


def part_problem(dst: Path, record: PartRecord | None, expected: PlanRecord, index: int) -> str | None:
    """Why partition ``index`` is not done (None when it is): no record (or one that cannot be read),
    another plan, a record count that does not add up, or a shard missing or not matching its size and
    checksum."""
    partition = expected.partitions[index]
    name = f"part {index} (records {partition.start}-{partition.end - 1})"
    if record is None:
        why = "{} cannot be read" if (dst / part_record_name(index)).exists() else "no {}"
        return f"{name}: not finished ({why.format(part_record_name(index))})"
    if record.fingerprint != expected.fingerprint or record.partition != partition:
        return f"{name}: {part_record_name(index)} belongs to another pack (other source or options)"
    if record.records + len(record.skipped) != len(partition):
        return f"{name}: holds {record.records} records and {len(record.skipped)} skipped, expected {len(partition)}"
    for shard in record.shards:
        path = dst / shard.file
        if not path.is_file():
            return f"{name}: {shard.file} is missing"
        if path.stat().st_size != shard.bytes or file_checksum(path) != shard.checksum:
            return f"{name}: {shard.file} does not match its recorded size and checksum"
    return None


def plan_fingerprint(plan: Plan, options: dict[str, Any]) -> str:
    """A digest of everything that decides the output: the plan (paths, labels, classes, source names,
    fields) and options."""
    digest = xxhash.xxh3_128()
    header = {"kind": plan.kind, "root": str(plan.root), "classes": plan.classes, "options": options}
    digest.update(json.dumps(header, sort_keys=True).encode())
    digest.update("\0".join(plan.paths).encode("utf-8", "surrogateescape"))  # names need not be UTF-8
    digest.update(plan.labels.tobytes())
    digest.update("\0".join(plan.sources).encode("utf-8", "surrogateescape"))
    fields = {f.name: {"spec": f.to_json(), "values": plan.values[f.name]} for f in plan.fields}
    digest.update(json.dumps({"labelled": plan.labelled, "fields": fields}, sort_keys=True).encode())
    return digest.hexdigest()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
