"""The pack journal: what an unfinished pack has written, so that a rerun resumes instead of restarting.

``DST/.pack-journal.json`` (written atomically after every finished shard) holds a fingerprint of the
plan and options, each finished shard's ``ShardInfo``, the plan position each shard ends at, and the
files skipped so far. A rerun with the same fingerprint keeps the leading shards whose checksum still
matches and goes on from the end of the last one; anything else starts over. The journal is removed
once ``manifest.json`` is written. Resuming assumes the source files did not change in between.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from packer.destination import JOURNAL_NAME
from packer.sources import Plan, Skipped
from reader.format import ShardInfo, file_checksum
from reader.format.manifest import write_file_atomically


@dataclass
class Journal:
    """Finished shards (with the plan position each ends at) and the skipped files before that point.

    ``skipped`` pairs each skipped file with its plan position, so that a resume keeps exactly the
    ones before the point it restarts from.
    """

    fingerprint: str
    shards: list[ShardInfo] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    skipped: list[tuple[int, Skipped]] = field(default_factory=list)

    @property
    def resume_position(self) -> int:
        """The plan position of the first record not yet in a finished shard."""
        return self.ends[-1] if self.ends else 0

    def add_shard(self, info: ShardInfo, end: int, dst: Path) -> None:
        """Record a finished shard ending before plan position ``end``, and save the journal."""
        self.shards.append(info)
        self.ends.append(end)
        self.save(dst)

    def save(self, dst: Path) -> None:
        data = {
            "fingerprint": self.fingerprint,
            "shards": [dataclasses.asdict(s) for s in self.shards],
            "ends": self.ends,
            "skipped": [{"index": i, "path": s.path, "reason": s.reason} for i, s in self.skipped],
        }
        write_file_atomically(dst / JOURNAL_NAME, json.dumps(data, indent=1).encode())


def resume_journal(dst: Path, fingerprint: str) -> Journal:
    """The journal to continue from: the saved one cut to its still-valid shards, or a fresh one."""
    saved = _load(dst / JOURNAL_NAME)
    if saved is None or saved.fingerprint != fingerprint:
        return Journal(fingerprint)
    kept = 0
    for info in saved.shards:
        path = dst / info.file
        if not path.is_file() or path.stat().st_size != info.bytes or file_checksum(path) != info.checksum:
            break
        kept += 1
    journal = Journal(fingerprint, saved.shards[:kept], saved.ends[:kept])
    journal.skipped = [(i, s) for i, s in saved.skipped if i < journal.resume_position]
    return journal


def plan_fingerprint(plan: Plan, options: dict[str, Any]) -> str:
    """A digest of everything that decides the output: the plan (paths, labels, classes) and options."""
    digest = xxhash.xxh3_128()
    header = {"kind": plan.kind, "root": str(plan.root), "classes": plan.classes, "options": options}
    digest.update(json.dumps(header, sort_keys=True).encode())
    digest.update("\0".join(plan.paths).encode("utf-8", "surrogateescape"))  # names need not be UTF-8
    digest.update(plan.labels.tobytes())
    return digest.hexdigest()


def _load(path: Path) -> Journal | None:
    """The saved journal, or None when there is none or it cannot be read (then the pack starts over)."""
    try:
        data = json.loads(path.read_text())
        return Journal(
            fingerprint=data["fingerprint"],
            shards=[ShardInfo(**s) for s in data["shards"]],
            ends=[int(e) for e in data["ends"]],
            skipped=[(int(s["index"]), Skipped(s["path"], s["reason"])) for s in data["skipped"]],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
