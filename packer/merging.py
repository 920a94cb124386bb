"""Finishing a partitioned pack: every partition checked, then the one ``manifest.json`` written.

``merge_parts(dst)`` is what ``packer merge DST`` runs after the tasks of a job (Slurm array, several
machines) have each packed their partitions with ``--part``; ``pack`` ends with the same assembly.
"""
from __future__ import annotations

import os
from pathlib import Path

from packer.errors import PackError
from packer.run.cleanup import cleaned_up_on_failure
from packer.run.destination import PLAN_NAME, remove_own_files
from packer.run.journal import PartRecord, PlanRecord, part_problem
from packer.run.locking import writer_lock
from reader.format import MANIFEST_NAME, Manifest
from reader.format.fields import FieldSpec

_SHOWN_PROBLEMS = 5


def merge_parts(dst: str | os.PathLike) -> Manifest:
    """Check that every partition of the pack in ``dst`` is finished (record counts, shard sizes and
    checksums) and write its manifest. Raises ``PackError`` naming every missing or broken part."""
    dst = Path(dst)
    if not dst.is_dir():
        raise PackError(f"{dst}: no such directory")
    with writer_lock(dst), cleaned_up_on_failure(dst):
        return _merge_parts(dst)


def _merge_parts(dst: Path) -> Manifest:
    plan = PlanRecord.load(dst)
    if plan is None:
        if (dst / MANIFEST_NAME).exists():
            raise PackError(f"{dst}: already a finished dataset (it has a {MANIFEST_NAME}); nothing to merge")
        raise PackError(f"{dst}: no readable {PLAN_NAME}, so no partitioned pack was started here")
    records = [PartRecord.load(dst, p.index) for p in plan.partitions]
    problems = [
        problem for index, record in enumerate(records)
        if (problem := part_problem(dst, record, plan, index)) is not None
    ]
    if problems:
        shown = "; ".join(problems[:_SHOWN_PROBLEMS])
        more = f"; and {len(problems) - _SHOWN_PROBLEMS} more" if len(problems) > _SHOWN_PROBLEMS else ""
        raise PackError(
            f"{dst}: cannot merge, {len(problems)} of {len(plan.partitions)} parts are missing or broken "
            f"({shown}{more}); rerun the pack for those parts"
        )
    return write_manifest(dst, plan, [r for r in records if r is not None])


def write_manifest(dst: Path, plan: PlanRecord, records: list[PartRecord]) -> Manifest:
    """The manifest of the finished partitions ``records`` (all of them, in partition order), written
    atomically to ``dst``; then every other packer file there (plan and part records, leftovers) goes."""
    manifest = assemble_manifest(plan, records)
    manifest.write(dst)
    # the plan and part records, copies of the plan left by killed tasks, files of an older plan
    remove_own_files(dst, keep={MANIFEST_NAME} | {s.file for s in manifest.shards})
    return manifest


def assemble_manifest(plan: PlanRecord, records: list[PartRecord]) -> Manifest:
    """The partitions' shards in partition order, and every skipped file in plan order."""
    skipped = list(plan.scan_skipped) + [s for r in records for _, s in sorted(r.skipped, key=lambda p: p[0])]
    packed = sum(r.records for r in records)
    source = dict(plan.manifest["source"])
    if packed == 0:
        where = source["root"] if source.get("root") is not None else "pack_items"  # items have no root
        raise PackError(f"{where}: every one of the {source['files']} images was skipped; nothing to pack")
    source.update(packed=packed, skipped=[{"path": s.path, "reason": s.reason} for s in skipped])
    fields = [FieldSpec.from_json(f, PLAN_NAME) for f in plan.manifest.get("fields", [])]
    shards = [s for r in records for s in r.shards]
    return Manifest(**{**plan.manifest, "source": source, "shards": shards, "fields": fields})
