"""``pack()``: an image folder (or CSV list) in, a finished packed dataset out.

Steps: check DST, scan the source into an ordered plan, cut it into partitions (``packer.run.partitions``),
keep the partitions a previous run finished (checked by checksum), pack the others on every core, each
partition encoded and written into its own shards by one process (``packer.run.worker_pool``), and write
``manifest.json`` last (``merging``). The output is byte-identical for a given partition count whatever
``workers`` is and in whatever order the partitions finish. With ``part`` only one task's share of the
partitions is packed, and ``merge_parts`` writes the manifest once every task is done.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from packer.errors import PackError
from packer.merging import write_manifest
from packer.options import PackOptions
from packer.run.cleanup import cleaned_up_on_failure
from packer.run.destination import (
    PLAN_NAME,
    check_destination,
    create_destination,
    partition_files,
    remove_files,
    remove_own_files,
)
from packer.run.journal import PartRecord, PlanRecord, part_problem, plan_fingerprint
from packer.run.locking import claimed_destination
from packer.run.partitions import Part, Partition, cut, default_partition_count, expected_record_bytes, parse_part
from packer.run.worker_pool import PackSettings, PartitionTask, pack_partitions
from packer.source.labels_file import declared_fields
from packer.source.scan import Plan, class_name, scan_source
from packer.version import __version__
from reader.format import FORMAT_VERSION, MANIFEST_NAME, Manifest
from reader.format.fields import FieldSpec

ON_ERROR = ("fail", "skip")

Runner = Callable[[list[PartitionTask], Callable[[int], Any]], list[PartRecord]]


def pack(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    options: PackOptions | None = None,
    *,
    labels: str | os.PathLike | None = None,
    workers: int | None = None,
    on_error: str = "fail",
    force: bool = False,
    progress: bool = True,
    label_kind: str = "auto",
    partitions: int | None = None,
    part: Part | str | None = None,
    runner: Runner | None = None,
    fields: Mapping[str, str | FieldSpec] | None = None,
    base_classes: Sequence[str] = (),
    **settings: Any,
) -> Manifest | None:
    """Pack the images under ``src`` into the dataset directory ``dst`` and return its manifest.

    ``src`` is an ImageFolder tree (one sub-folder per class), or the root the ``labels`` CSV
    (``path,label`` rows) is relative to. How the images are packed is ``options`` (a ``PackOptions``),
    with any of its fields given as keywords applied on top (``storage``, ``resize``, ``crop``,
    ``encoding``, ``quality``, ``shard_size``, ``max_pixels``, ``max_file_bytes``, ``resampler``: sizes are
    ``(height, width)`` as torchvision, the CLI's ``WxH`` is width first). ``workers`` defaults to every
    core; 0 or 1 packs in this process.
    ``on_error="skip"`` leaves unreadable images out (listed in the manifest) instead of failing.
    ``partitions`` overrides the default partition count (``packer.run.partitions``). An interrupted pack
    resumes when rerun with the same arguments, keeping the partitions already finished.

    ``part`` (``"I/N"``, ``"slurm"`` or a ``Part``) packs only task I's share of the partitions and returns
    None; once every task is done, ``packer.merge_parts(dst)`` writes the manifest. ``runner`` packs the
    partition tasks instead of the local process pool (``packer.run.ray_runner``). Source files over
    ``max_file_bytes`` (or not regular files) are per-file errors; ``label_kind`` (``auto``, ``index``,
    ``name``) says how a CSV's labels are read (``packer.source.scan``). A failed or interrupted pack (a full
    disk, SIGINT, SIGTERM) leaves no temporary file of its own (``packer.run.cleanup``). ``labels`` may also be
    a JSON Lines file, and a labels file's other columns or keys are stored as each record's fields
    (``packer.source.labels_file``), typed by ``fields`` where given (``{"emb": "vector:128", "tags": "labels"}``
    or ``FieldSpec``s, each under its own name), inferred otherwise. Every record also keeps its source
    path. ``base_classes`` come first, keeping their ids, and the source's other classes follow (what
    ``packer.append`` needs to extend a dataset's classes without relabelling). Raises ``PackError`` on bad
    input and for a full disk.
    """
    options = PackOptions.of(options, settings, "pack")
    spec = options.transform
    check_on_error(on_error)
    processes = worker_count(workers)
    task_part = parse_part(part) if isinstance(part, str) else part
    dst = Path(dst)
    check_destination(dst, force)
    declared = declared_fields(fields)
    plan = scan_source(src, labels, on_error, max_file_bytes=options.max_file_bytes, label_kind=label_kind,
                       exclude=dst, fields=declared)
    if base_classes and plan.labelled:
        plan.classes, plan.labels = _extended_classes(list(base_classes), plan.classes, plan.labels)
    if not len(plan):
        raise PackError(f"{src}: no images to pack ({_empty_reason(plan)})")
    all_partitions = cut(len(plan), partitions or default_partition_count(len(plan), expected_record_bytes(spec)))
    decided = {"format_version": FORMAT_VERSION, "tool_version": __version__, "on_error": on_error,
               "partitions": len(all_partitions), **options.fingerprint()}
    create_destination(dst)
    mine = all_partitions if task_part is None else task_part.select(all_partitions)
    # the tasks of a --part job share DST by design; any other pack is DST's one writer
    with contextlib.nullcontext() if task_part is not None else claimed_destination(dst, force), \
            cleaned_up_on_failure(dst, None if task_part is None else [p.index for p in mine]):
        plan_record = _plan_record(dst, plan, options, all_partitions, plan_fingerprint(plan, decided))
        done = _finished_parts(dst, plan_record, mine)
        done_indices = {r.partition.index for r in done}
        _clear_leftovers(dst, done_indices, {p.index for p in mine} - done_indices, whole_plan=task_part is None)
        worker_settings = PackSettings(dst, plan.root, options.storage, options.shard_size, spec, on_error,
                                       plan_record.fingerprint, tuple(plan.fields))
        tasks = [_task(worker_settings, plan, p) for p in mine if p.index not in done_indices]
        total = sum(len(p) for p in mine)
        with tqdm(total=total, initial=total - sum(len(t.partition) for t in tasks), unit="img",
                  disable=not progress, desc="pack" if task_part is None else f"pack part {task_part}") as bar:
            run = runner or (lambda todo, on_records: pack_partitions(todo, processes, on_records))
            new = run(tasks, bar.update)
        if task_part is not None:
            return None
        records = sorted(done + new, key=lambda r: r.partition.index)
        return write_manifest(dst, plan_record, records)


def _extended_classes(base: list[str], classes: list[str], labels: np.ndarray) -> tuple[list[str], np.ndarray]:
    """``base`` then the new classes in their order; ``labels`` renumbered to match."""
    normalised = {class_name(name): name for name in base}
    for name in classes:
        if name not in normalised.values() and normalised.get(class_name(name)) is not None:
            raise PackError(f"class {name!r} differs from the dataset's class {normalised[class_name(name)]!r} "
                            "only by Unicode normalisation (NFC/NFD); it would be a second class that prints the "
                            "same: rename the source's class to the dataset's spelling")
    extended = base + [name for name in classes if name not in set(base)]
    index = {name: i for i, name in enumerate(extended)}
    renumber = np.array([index[name] for name in classes], dtype=np.int64)
    return extended, renumber[labels] if len(labels) else labels


def _plan_record(
    dst: Path, plan: Plan, options: PackOptions, partitions: list[Partition], fingerprint: str
) -> PlanRecord:
    """Save the plan record and return it as read back, so that the manifest ``pack`` writes and the one
    ``merge_parts`` writes later come from the same bytes."""
    manifest = options.manifest_draft(plan.classes, {"kind": plan.kind, "root": str(plan.root), "files": plan.files},
                                      [field.to_json() for field in plan.fields], plan.labelled)
    PlanRecord(fingerprint, partitions, manifest, plan.skipped).save(dst)
    saved = PlanRecord.load(dst)
    if saved is None:
        raise PackError(f"{dst / PLAN_NAME}: written but not readable back (is DST shared by a pack with "
                        "other options?)")
    return saved


def _clear_leftovers(dst: Path, done: set[int], todo: set[int], whole_plan: bool) -> None:
    """Remove what is in the way of packing the ``todo`` partitions. Packing the whole plan, that is
    every packer file but the plan and the ``done`` partitions' files; packing one task's share, only
    the files of its own ``todo`` partitions (and a manifest overwritten with ``force``), since other
    tasks may be writing theirs in ``dst`` at this moment."""
    if whole_plan:
        remove_own_files(dst, keep=partition_files(dst, done) | {PLAN_NAME})
    else:
        remove_files(dst, partition_files(dst, todo) | {MANIFEST_NAME})


def _finished_parts(dst: Path, plan: PlanRecord, partitions: list[Partition]) -> list[PartRecord]:
    """The part records of ``partitions`` that a previous run finished and whose shards still match."""
    done = []
    for partition in partitions:
        record = PartRecord.load(dst, partition.index)
        if record is not None and part_problem(dst, record, plan, partition.index) is None:
            done.append(record)
    return done


def _task(settings: PackSettings, plan: Plan, partition: Partition) -> PartitionTask:
    taken = slice(partition.start, partition.end)
    return PartitionTask(settings, partition, plan.paths[taken], plan.labels[taken], plan.sources[taken],
                         {name: values[taken] for name, values in plan.values.items()})


def check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise PackError(f"on_error {on_error!r} is not one of {', '.join(ON_ERROR)}")


def worker_count(workers: int | None) -> int:
    if workers is None:
        return len(os.sched_getaffinity(0))
    if workers < 0:
        raise PackError(f"workers {workers} must be 0 or more")
    return workers


def _empty_reason(plan: Plan) -> str:
    if plan.skipped:
        return f"all {plan.files} listed files were skipped"
    if plan.kind == "csv":
        return "the labels CSV lists no images"
    return f"no files with an image extension in its {len(plan.classes)} class folders"

