"""``append()``: add images to a finished dataset as new shards, swapping its manifest atomically.

The new images are packed with the dataset's own settings (storage, encoding, JPEG quality and
pre-transform, fields) into a staging directory inside it, ``.append-GGGG`` (G: one more than the
appends already made), exactly as ``pack`` would pack them: partitioned, on every core, resumable.
Their classes extend the dataset's by name (a class already there keeps its id; a new one gets the
next id), so no record is ever relabelled. The staged shards are then renamed into the dataset as
``append-GGGG-<name>`` (hard to collide with anything the packer writes) and the manifest listing old
and new shards replaces the old one in one atomic rename, the last step: a reader opening the dataset
meanwhile sees the old dataset or the new one, never a mix, and an interrupted append leaves the old
dataset intact; rerunning the same command finishes it.

Exactly once: the append holds the dataset's writer lock (``packer.run.locking``) from reading the manifest to
swapping it, and records in the manifest (``source.appended[].id``) a fingerprint of what it added: the
scanned source (paths, labels, fields, each file's size and modification time). The staging directory
is named after it too (``.append-GGGG-<id>``). A rerun that finds its fingerprint in the manifest took
effect already: it only removes what the interrupted run left (staging directory, shards moved in but
never listed) and adds nothing. A staging directory of another fingerprint is an append that never took
effect: it is removed, with the shards it had moved in. So an append interrupted anywhere and rerun,
once or several times, adds its records exactly once; appending the same unchanged source a second
time adds nothing either.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

import xxhash

from packer.errors import PackError
from packer.image.transforms import DEFAULT_MAX_FILE_BYTES
from packer.joining import reconciled_classes
from packer.options import DEFAULT_SHARD_SIZE, PackOptions
from packer.packing import pack
from packer.run.cleanup import cleaned_up_on_failure
from packer.run.destination import unwritable
from packer.run.journal import plan_fingerprint
from packer.run.locking import writer_lock
from packer.source.labels_file import read_label_rows
from packer.source.scan import is_class_index, reads_as_indices, scan_source
from packer.version import __version__
from reader.format import MANIFEST_NAME, FormatError, Manifest, ShardInfo, load_manifest
from reader.format.durable import fsync_directory

_GENERATION = re.compile(r"append-(\d{4,})-")
_STAGING = re.compile(r"\.append-\d{4,}(-[0-9a-f]+)?")  # without the id: staged by an older packer
_ID_IN_NAME = 16


def append(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    labels: str | os.PathLike | None = None,
    label_kind: str = "auto",
    workers: int | None = None,
    on_error: str = "fail",
    shard_size: int = DEFAULT_SHARD_SIZE,
    progress: bool = True,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> Manifest:
    """Pack the images of ``src`` (a folder or a ``labels`` file, as for ``pack``) and add them to the
    finished dataset ``dst`` (module docstring); returns the new manifest.

    A source that labels its images where the dataset does not (or the other way round), whose labels
    file has other fields than the dataset's (in any column order), or whose integer labels would become
    new classes beside the dataset's named ones, is refused before anything is packed, and so is a
    ``dst`` that cannot be written (read-only, no permission)."""
    dst = Path(dst)
    try:
        load_manifest(dst)
    except FormatError as e:
        raise PackError(f"--append: {e}") from None
    problem = unwritable(dst)
    if problem:
        raise PackError(f"{dst}: cannot append: {problem} (the dataset is left as it was)")
    with writer_lock(dst), cleaned_up_on_failure(dst):
        old = load_manifest(dst)  # read again under the lock: another writer may have swapped it meanwhile
        _check_transform_here(dst, old)
        return _append(Path(src), dst, old, labels=labels, label_kind=label_kind, workers=workers,
                       on_error=on_error, shard_size=shard_size, progress=progress, max_file_bytes=max_file_bytes)


def _append(src: Path, dst: Path, old: Manifest, **options: Any) -> Manifest:
    if not old.has_sources:
        raise PackError(f"{dst}: a format-version-1 dataset; repack it to append to it")
    _check_source_fits(src, options["labels"], options["label_kind"], old, dst)
    source_id = _source_id(src, dst, old, options)
    if any(isinstance(entry, dict) and entry.get("id") == source_id for entry in old.source.get("appended", [])):
        _remove_leftovers(dst, old)  # a rerun of an append that took effect: finish its cleanup only
        return old
    generation = 1 + max((int(m.group(1)) for s in old.shards if (m := _GENERATION.match(s.file))), default=0)
    staging = dst / f".append-{generation:04d}-{source_id[:_ID_IN_NAME]}"
    _remove_leftovers(dst, old, staging)
    if not (staging / MANIFEST_NAME).exists():
        _pack_staged(src, staging, old, **options)
    new = load_manifest(staging)
    if sorted(new.fields, key=lambda f: f.name) == sorted(old.fields, key=lambda f: f.name):
        new = dataclasses.replace(new, fields=old.fields)  # the labels file's columns in another order
    classes = reconciled_classes([dst, staging], [old, new])
    shards = [_moved_in(staging, dst, shard, f"append-{generation:04d}-{shard.file}") for shard in new.shards]
    fsync_directory(dst)
    joined = dataclasses.replace(old, classes=classes, shards=old.shards + shards, format_version=new.format_version,
                                 tool_version=__version__, source=_appended_source(old.source, new.source, source_id))
    joined.write(dst)
    _remove_leftovers(dst, joined)
    return joined


def _source_id(src: Path, dst: Path, old: Manifest, options: Mapping[str, Any]) -> str:
    """The fingerprint of what appending ``src`` would add: the scanned plan (paths, labels, classes,
    fields) and each file's size and modification time."""
    plan = scan_source(src, options["labels"], options["on_error"], max_file_bytes=options["max_file_bytes"],
                       label_kind=options["label_kind"], exclude=dst, fields={f.name: f for f in old.fields})
    digest = xxhash.xxh3_128(plan_fingerprint(plan, {}).encode())
    for path in plan.paths:
        try:
            st = os.stat(plan.root / path)
            digest.update(f"{st.st_size}:{st.st_mtime_ns};".encode())
        except OSError as e:
            digest.update(f"{e.errno};".encode())
    return digest.hexdigest()


def _remove_leftovers(dst: Path, manifest: Manifest, staging: Path | None = None) -> None:
    """Remove what interrupted appends left in ``dst``: staging directories other than ``staging``, and
    appended shard files that ``manifest`` does not list, except those ``staging`` has already moved in
    (its rerun moves the rest and lists them)."""
    listed = {shard.file for shard in manifest.shards}
    if staging is not None and (staging / MANIFEST_NAME).is_file():
        prefix = staging.name[1:].rsplit("-", 1)[0]  # append-GGGG
        listed |= {f"{prefix}-{shard.file}" for shard in load_manifest(staging).shards}
    for entry in sorted(os.scandir(dst), key=lambda e: e.name):
        if _STAGING.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False) and entry.path != str(staging):
            shutil.rmtree(entry.path)
        elif _GENERATION.match(entry.name) and entry.name not in listed and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
    fsync_directory(dst)


def _pack_staged(src: str | os.PathLike, staging: Path, old: Manifest, shard_size: int, **options: Any) -> None:
    """Pack ``src`` into ``staging`` with ``old``'s settings and classes first."""
    pack(src, staging, PackOptions.from_manifest(old, shard_size), fields={field.name: field for field in old.fields},
         base_classes=old.classes, **options)


def _check_transform_here(dst: Path, old: Manifest) -> None:
    """Refuse, before packing anything, to append where this install would not redo ``old``'s
    pre-transform exactly (the staged dataset's would then differ, and joining it would be refused
    after the whole pack): above all a resize by another library than the dataset's (plain Pillow
    where the dataset was resized by pillow-simd, or another torch version), which shifts pixels."""
    here = PackOptions.from_manifest(old).transform.describe()
    differing = sorted(k for k in set(here) | set(old.transform) if here.get(k) != old.transform.get(k))
    if "resampler_library" in differing:
        raise PackError(
            f"{dst}: was resized by {old.transform.get('resampler_library')} "
            f"({old.transform.get('resampler')} resampler), but here "
            f"that resampler is {here['resampler_library']}: the appended images would not be resized the same "
            "way; append with the same install (scripts/setup_env reinstalls pillow-simd), or pack a new dataset")
    if differing:
        raise PackError(f"{dst}: its pre-transform differs in {', '.join(differing)} from what this packer "
                        f"({__version__}) does; pack a new dataset instead of appending")


def _check_source_fits(
    src: str | os.PathLike, labels: str | os.PathLike | None, label_kind: str, old: Manifest, dst: Path
) -> None:
    """Refuse, before packing anything, a source whose records could not join ``old``'s: labelled where the
    dataset is not or the other way round, with other fields (in any order) than the dataset's, or with
    integer labels (class indices) for a dataset whose classes are names, which would silently become
    new classes "0", "1", ..."""
    names: list[str] = []
    if labels is None:  # an image folder: labels from its class folders, no fields
        where, labelled = Path(src), True
    else:
        rows, names = read_label_rows(Path(labels))
        where, labelled = Path(labels), not rows or rows[0].label is not None
        indices = reads_as_indices([row.label for row in rows if row.label is not None], label_kind)
        named = [name for name in old.classes if not is_class_index(name)]
        if labelled and indices and named:
            raise PackError(f"{where}: its labels are class indices, but the classes of {dst} are names "
                            f"({', '.join(named[:3])}{', ...' if len(named) > 3 else ''}); write the class "
                            "names, or pass --label-kind name to add the numbers as new classes")
    if labelled != old.labelled:
        raise PackError(f"{where}: its images {'have labels' if labelled else 'have no labels'}, but the records of "
                        f"{dst} {'have' if old.labelled else 'have none'}; an appended source must label every "
                        "image or none, as the dataset does")
    expected = [field.name for field in old.fields]
    if sorted(names) != sorted(expected):
        raise PackError(f"{where}: fields {', '.join(names) or 'none'} differ from {dst}'s "
                        f"({', '.join(expected) or 'none'}); an appended source needs the same fields")


def _moved_in(staging: Path, dst: Path, shard: ShardInfo, name: str) -> ShardInfo:
    """Rename a staged shard into the dataset (done already when a rerun finds it there)."""
    target = dst / name
    if (staging / shard.file).exists():
        os.replace(staging / shard.file, target)
    elif not target.is_file() or target.stat().st_size != shard.bytes:
        raise PackError(f"{staging / shard.file}: missing, and not moved to {target} either; "
                        f"remove {staging} and append again")
    return dataclasses.replace(shard, file=name)


def _appended_source(old: Mapping[str, Any], new: Mapping[str, Any], source_id: str) -> dict[str, Any]:
    """The dataset's source, with the appended source's counts, skipped files and fingerprint added."""
    entry = {**{k: new.get(k) for k in ("kind", "root", "files", "packed")}, "id": source_id}
    appended = [*old.get("appended", []), entry]
    return {**old, "files": (old.get("files") or 0) + (new.get("files") or 0),
            "packed": (old.get("packed") or 0) + (new.get("packed") or 0),
            "skipped": [*old.get("skipped", []), *new.get("skipped", [])], "appended": appended}
