"""``pack()``: an image folder (or CSV list) in, a finished packed dataset out.

Steps: check DST, scan the source into an ordered plan, resume from the journal where it allows, decode
and encode on every core (``pipeline``), append the results in plan order to size-bounded shards
(``shard_sequence``), and write ``manifest.json`` last. The output is byte-identical whatever
``workers`` is: every image is transformed independently and written in plan order.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from tqdm import tqdm

from packer.cleanup import cleaned_up_on_failure
from packer.destination import JOURNAL_NAME, check_destination, remove_own_files
from packer.errors import PackError
from packer.journal import Journal, plan_fingerprint, resume_journal
from packer.malloc_tuning import reuse_large_allocations
from packer.pipeline import Failure, encode_in_order
from packer.shard_sequence import ShardSequence
from packer.sources import Plan, Skipped, display_name, scan_source
from packer.transforms import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS, TransformSpec
from packer.version import __version__
from reader.format import FORMAT_VERSION, STORAGES, Manifest

ON_ERROR = ("fail", "skip")


def pack(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    labels: str | os.PathLike | None = None,
    storage: str = "lmdb",
    resize: int | tuple[int, int] | None = None,
    crop: int | tuple[int, int] | None = None,
    encoding: str = "raw",
    quality: int = 90,
    shard_size: int = 512 << 20,
    workers: int | None = None,
    on_error: str = "fail",
    force: bool = False,
    progress: bool = True,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    label_kind: str = "auto",
) -> Manifest:
    """Pack the images under ``src`` into the dataset directory ``dst`` and return its manifest.

    ``src`` is an ImageFolder tree (one sub-folder per class), or the root the ``labels`` CSV
    (``path,label`` rows) is relative to. ``resize`` and ``crop`` take an int (shorter side / square) or
    ``(width, height)``; see ``packer.transforms`` for the exact pre-transform. ``shard_size`` bounds
    each shard's payload bytes. ``workers`` defaults to every core; 0 or 1 packs in this process.
    ``on_error="skip"`` leaves unreadable images out (listed in the manifest) instead of failing.
    Source files over ``max_file_bytes`` (or not regular files) are such per-file errors;
    ``label_kind`` (``auto``, ``index``, ``name``) says how a CSV's labels are read (``packer.sources``).
    An interrupted pack resumes when rerun with the same arguments; a failed or interrupted one (a full
    disk, SIGINT, SIGTERM) leaves no temporary file (``packer.cleanup``). Raises ``PackError`` on bad
    input and for a full disk.
    """
    spec = _transform_spec(resize, crop, encoding, quality, max_pixels, max_file_bytes)
    _check_options(storage, shard_size, on_error)
    worker_count = _worker_count(workers)
    dst = Path(dst)
    check_destination(dst, force)
    plan = scan_source(src, labels, on_error, max_file_bytes=max_file_bytes, label_kind=label_kind, exclude=dst)
    if not len(plan):
        raise PackError(f"{src}: no images to pack ({_empty_reason(plan)})")
    options = {
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "storage": storage,
        "shard_size": shard_size,
        "on_error": on_error,
        "transform": dataclasses.asdict(spec),
    }
    dst.mkdir(parents=True, exist_ok=True)
    with cleaned_up_on_failure(dst):
        journal = resume_journal(dst, plan_fingerprint(plan, options))
        remove_own_files(dst, keep={JOURNAL_NAME} | {s.file for s in journal.shards})
        journal.save(dst)
        _write_records(plan, spec, journal, dst, storage, shard_size, on_error, worker_count, progress)
        if not journal.shards:
            raise PackError(f"{src}: every one of the {plan.files} images was skipped; nothing to pack")
        manifest = _manifest(plan, spec, journal, storage)
        manifest.write(dst)
    (dst / JOURNAL_NAME).unlink()
    return manifest


def _write_records(
    plan: Plan,
    spec: TransformSpec,
    journal: Journal,
    dst: Path,
    storage: str,
    shard_size: int,
    on_error: str,
    workers: int,
    progress: bool,
) -> None:
    """Encode the plan from the journal's resume position on and append it, in order, to shards."""
    reuse_large_allocations()
    start = journal.resume_position
    shards = ShardSequence(
        dst, storage, shard_size, len(journal.shards), lambda info, end: journal.add_shard(info, end, dst)
    )
    results = encode_in_order([str(plan.root / p) for p in plan.paths[start:]], spec, workers)
    with tqdm(total=len(plan), initial=start, unit="img", disable=not progress, desc="pack") as bar:
        try:
            for position, result in enumerate(results, start):
                if isinstance(result, Failure):
                    skipped = Skipped(display_name(plan.paths[position]), result.reason)
                    if on_error == "fail":
                        raise PackError(f"{plan.root / skipped.path}: {skipped.reason}")
                    journal.skipped.append((position, skipped))
                else:
                    shards.add(result, int(plan.labels[position]), position)
                bar.update()
            shards.finish(len(plan))
        except BaseException:
            shards.abort()
            raise
        finally:
            results.close()


def _manifest(plan: Plan, spec: TransformSpec, journal: Journal, storage: str) -> Manifest:
    skipped = plan.skipped + [s for _, s in journal.skipped]
    fixed = spec.fixed_size
    packed = sum(s.records for s in journal.shards)
    return Manifest(
        storage=storage,
        encoding=spec.encoding,
        shape=None if fixed is None else [3, fixed[1], fixed[0]],
        classes=plan.classes,
        shards=list(journal.shards),
        transform=spec.describe(),
        source={
            "kind": plan.kind,
            "root": str(plan.root),
            "files": plan.files,
            "packed": packed,
            "skipped": [dataclasses.asdict(s) for s in skipped],
        },
        tool_version=__version__,
        jpeg_quality=spec.quality if spec.encoding == "jpeg" else None,
    )


def _transform_spec(
    resize: int | tuple[int, int] | None,
    crop: int | tuple[int, int] | None,
    encoding: str,
    quality: int,
    max_pixels: int,
    max_file_bytes: int,
) -> TransformSpec:
    try:
        return TransformSpec(resize, crop, encoding, quality, max_pixels, max_file_bytes)
    except ValueError as e:
        raise PackError(str(e)) from None


def _check_options(storage: str, shard_size: int, on_error: str) -> None:
    if storage not in STORAGES:
        raise PackError(f"storage {storage!r} is not one of {', '.join(STORAGES)}")
    if shard_size < 1:
        raise PackError(f"shard_size {shard_size} must be a positive number of bytes")
    if on_error not in ON_ERROR:
        raise PackError(f"on_error {on_error!r} is not one of {', '.join(ON_ERROR)}")


def _worker_count(workers: int | None) -> int:
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

