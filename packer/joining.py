"""``join_datasets``: several finished datasets made with the same pre-transform, as one dataset.

What ``packer join OUT A B ...`` runs. The inputs must agree on everything a record's bytes and label
mean: storage, encoding, shape, JPEG quality, the pre-transform, and the classes, reconciled by name:
a label is an index into ``classes``, so every input's class list must be the same as, or a leading
part of, the longest one (CSV datasets with integer labels 0..7 and 0..9 join; ``[cat, dog]`` and
``[dog, cat]`` do not, nor do different names). Anything else is refused with a line naming the input
and what differs. Format versions 2 and later join into the newest of them (a reader of it reads every
shard as it was written: ``ShardInfo.table_offset`` and ``table_bytes`` say how); a version-1 dataset,
which stores no source paths, joins only version-1 datasets.

The shard files are not rewritten: each is hard-linked into OUT when OUT is on the same file system
(no bytes copied; the files are never written again once finished, so sharing them is safe), and
copied otherwise. Shards are renamed ``shard-NNNNN`` in the order of the inputs, then the manifest is
written last, as a pack does. Sizes are checked; checksums are carried over from the input manifests
(``packer verify OUT`` reads everything).
"""
from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from packer.errors import PackError
from packer.run.cleanup import cleaned_up_on_failure
from packer.run.destination import check_destination, remove_own_files
from packer.run.locking import claimed_destination
from packer.version import __version__
from reader.format import Manifest, ShardInfo, load_manifest, shard_file_name
from reader.format.durable import fsync_directory

_MUST_MATCH = ("storage", "encoding", "shape", "jpeg_quality", "fields", "labelled")
_LINK_REFUSED = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}


@dataclass
class JoinReport:
    """The joined dataset's manifest, and how many shards were hard-linked and how many copied."""

    manifest: Manifest
    linked: int
    copied: int


def join_datasets(
    out: str | os.PathLike, inputs: list[str | os.PathLike], force: bool = False
) -> JoinReport:
    """Join the finished datasets ``inputs``, in that order, into the new dataset ``out``."""
    out = Path(out)
    paths = [Path(p) for p in inputs]
    if len(paths) < 2:
        raise PackError("merge: give at least two datasets to join (or only DST to finish a partitioned pack)")
    if any(out.resolve() == p.resolve() for p in paths):
        raise PackError(f"{out}: the output cannot be one of the datasets being joined")
    inside = [p for p in paths if out.resolve().is_relative_to(p.resolve())]
    if inside:
        raise PackError(f"{out}: the output cannot be inside {inside[0]}, one of the datasets being joined")
    manifests = [load_manifest(p) for p in paths]
    classes = reconciled_classes(paths, manifests)
    check_destination(out, force)
    resolved = [p.resolve() for p in paths]
    repeated = next((p for i, p in enumerate(paths) if resolved[i] in resolved[:i]), None)
    if repeated is not None:
        raise PackError(f"{repeated}: named twice among the datasets to join; joining a dataset with itself "
                        "would hold every record twice")
    with claimed_destination(out, force), cleaned_up_on_failure(out):
        remove_own_files(out)
        return _join(out, paths, manifests, classes)


def _join(out: Path, paths: list[Path], manifests: list[Manifest], classes: list[str]) -> JoinReport:
    """Link or copy every input's shards into ``out`` under new names, then write the manifest."""
    shards: list[ShardInfo] = []
    linked = 0
    for path, manifest in zip(paths, manifests):
        for shard in manifest.shards:
            name = shard_file_name(len(shards), manifest.storage)
            linked += _link_or_copy(path / shard.file, out / name, shard)
            shards.append(replace(shard, file=name))
    fsync_directory(out)
    first = manifests[0]
    joined = Manifest(
        storage=first.storage, encoding=first.encoding, shape=first.shape, classes=classes, shards=shards,
        transform=first.transform, source=_joined_source(paths, manifests), tool_version=__version__,
        jpeg_quality=first.jpeg_quality, fields=first.fields, labelled=first.labelled,
        format_version=max(manifest.format_version for manifest in manifests),
    )
    joined.write(out)
    return JoinReport(joined, linked, len(shards) - linked)


def reconciled_classes(paths: list[Path], manifests: list[Manifest]) -> list[str]:
    """The joined class list, after checking that every input means the same by every field and label."""
    first, first_path = manifests[0], paths[0]
    widest = max(range(len(manifests)), key=lambda i: len(manifests[i].classes))
    longest = manifests[widest].classes
    for path, manifest in zip(paths[1:], manifests[1:]):
        if manifest.has_sources != first.has_sources:
            old, new = (path, first_path) if not manifest.has_sources else (first_path, path)
            raise PackError(
                f"{old}: format version 1 stores no source paths, so it joins only version-1 datasets "
                f"({new} is a later version); pack it again to join them"
            )
        for key in _MUST_MATCH:
            if getattr(manifest, key) != getattr(first, key):
                raise PackError(
                    f"{path}: {key} is {getattr(manifest, key)!r} but {first_path}'s is {getattr(first, key)!r}; "
                    "only datasets packed the same way can be joined"
                )
        differing = sorted(k for k in set(manifest.transform) | set(first.transform)
                           if manifest.transform.get(k) != first.transform.get(k))
        if differing:
            raise PackError(
                f"{path}: its pre-transform differs from {first_path}'s in {', '.join(differing)}; "
                "only datasets packed with the same pre-transform can be joined"
            )
    for path, manifest in zip(paths, manifests):
        if longest[: len(manifest.classes)] != manifest.classes:
            position = next(i for i, (a, b) in enumerate(zip(manifest.classes, longest)) if a != b)
            raise PackError(
                f"{path}: label {position} is class {manifest.classes[position]!r} there but "
                f"{longest[position]!r} in {paths[widest]}; labels are class positions, so the class lists "
                "must agree by name (one may only extend another)"
            )
    return list(longest)


def _link_or_copy(source: Path, target: Path, shard: ShardInfo) -> bool:
    """Hard-link ``source`` to ``target`` (True), or copy it where the file system will not (False)."""
    size = source.stat().st_size if source.is_file() else None
    if size != shard.bytes:
        raise PackError(f"{source}: {'missing' if size is None else f'{size} bytes'}, its manifest says "
                        f"{shard.bytes} bytes; run `packer verify` on it")
    try:
        os.link(source, target)
        return True
    except OSError as e:
        if e.errno not in _LINK_REFUSED:
            raise
    tmp = target.with_name(target.name + ".tmp")
    shutil.copyfile(source, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return False


def _joined_source(paths: list[Path], manifests: list[Manifest]) -> dict[str, object]:
    """The inputs' source summaries, with totals; skipped paths keep their input's source root."""
    skipped = [
        {"path": f"{m.source.get('root')}/{s['path']}", "reason": s["reason"]}
        for m in manifests for s in m.source.get("skipped", [])
    ]
    return {
        "kind": "merge",
        "root": ", ".join(str(m.source.get("root")) for m in manifests),
        "files": sum(int(m.source.get("files", m.num_records)) for m in manifests),
        "packed": sum(m.num_records for m in manifests),
        "skipped": skipped,
        "inputs": [{"dataset": str(p), **{k: v for k, v in m.source.items() if k != "skipped"}}
                   for p, m in zip(paths, manifests)],
    }
