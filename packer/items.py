"""``pack_items()``: pack any iterable of images (a torch Dataset, a tar stream, an HF split...).

Each item is a mapping: ``image`` (a file path, the bytes of an image file, a PIL image, or a uint8
array ``H x W`` or ``H x W x 3|4``), optionally ``label`` (a class index, or a class name) and
``source`` (the name the record keeps as its source path; default: the path, else ``item-N``), and
any other keys as the record's fields (``reader.format.fields``). The items are read once, in order,
and cut into partitions of ``partition_size`` consecutive items, each encoded and written by one
worker process, with at most two partitions per worker held in memory: the output is the same bytes
whatever the number of workers. The same pre-transform as ``pack`` is applied to every image.

Labels: class names get ids in the order they first appear unless ``classes`` fixes the list (then an
unknown name is an error naming the item); integer labels index ``classes`` when given, else classes
``"0".."max"``. Either every item has a label or none has (a dataset without classes). Field types
come from ``fields`` declarations or from the first item's values (named multi-labels must be declared,
since their classes cannot be known from one item). A bad item is a ``PackError`` naming its index
and source name; nothing half-written is left as a dataset (a dataset already in ``dst``, overwritten
with ``force``, is removed first, its manifest first; the new manifest is written last; a failed pack
removes its temporaries, and its finished shards are removed by the next run). Unlike ``pack``, an
interrupted ``pack_items`` does not resume: the iterable would have to be read again from its start,
so a rerun repacks everything.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
from PIL import Image
from tqdm import tqdm

from packer.errors import PackError
from packer.merging import write_manifest
from packer.options import PackOptions
from packer.packing import check_on_error, worker_count
from packer.run.cleanup import cleaned_up_on_failure
from packer.run.destination import check_destination, remove_own_files
from packer.run.journal import PlanRecord
from packer.run.locking import claimed_destination
from packer.run.partitions import Partition
from packer.run.worker_pool import PackSettings, PartitionTask, pack_partitions
from packer.source.labels_file import declared_fields
from packer.source.scan import display_name
from reader.format import Manifest
from reader.format.fields import FieldSpec, infer_spec

DEFAULT_PARTITION_SIZE = 512
_RESERVED = ("image", "label", "source")


def pack_items(
    items: Iterable[Mapping[str, Any]],
    dst: str | os.PathLike,
    options: PackOptions | None = None,
    *,
    workers: int | None = None,
    classes: list[str] | None = None,
    fields: Mapping[str, str | FieldSpec] | None = None,
    on_error: str = "fail",
    force: bool = False,
    progress: bool = True,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    **settings: Any,
) -> Manifest:
    """Pack ``items`` (module docstring) into the dataset directory ``dst``; returns its manifest.

    ``options`` and the keywords named like its fields mean what they mean for ``packer.pack``.
    """
    options = PackOptions.of(options, settings, "pack_items")
    check_on_error(on_error)
    if partition_size < 1:
        raise PackError(f"partition_size must be positive, got {partition_size}")
    declared = declared_fields(fields)
    dst = Path(dst)
    check_destination(dst, force)
    planner = _Planner(classes, declared)
    with claimed_destination(dst, force), cleaned_up_on_failure(dst, None):
        remove_own_files(dst)  # nothing resumes: a dataset overwritten with force goes, its manifest first
        worker_settings = PackSettings(dst, Path("/"), options.storage, options.shard_size, options.transform,
                                       on_error, "items")
        with tqdm(unit="img", disable=not progress, desc="pack items") as bar:
            tasks = planner.tasks(items, worker_settings, partition_size)
            records = pack_partitions(tasks, worker_count(workers), bar.update)
        if not records:
            raise PackError("pack_items: no items to pack")
        manifest = options.manifest_draft(planner.classes, {"kind": "items", "root": None, "files": planner.count},
                                          [f.to_json() for f in planner.fields or []], bool(planner.labelled))
        partitions = [r.partition for r in records]
        return write_manifest(dst, PlanRecord("items", partitions, manifest, []), records)


class _Planner:
    """Reads the items once: checks each, gives labels their ids, and cuts them into partition tasks."""

    def __init__(self, classes: list[str] | None, declared: dict[str, FieldSpec]) -> None:
        self.fixed_classes = classes is not None
        self.classes = list(classes or [])
        self._ids = {name: i for i, name in enumerate(self.classes)}
        self.declared = declared
        self.fields: list[FieldSpec] | None = None
        self.labelled: bool | None = None
        self._names: bool | None = None  # whether labels are class names (else indices), from the first item
        self.count = 0

    def tasks(
        self, items: Iterable[Mapping[str, Any]], settings: PackSettings, size: int
    ) -> Iterator[PartitionTask]:
        chunk: list[tuple[Any, int, str, dict[str, Any]]] = []
        number = 0
        for item in items:
            chunk.append(self._record(item, self.count))
            self.count += 1
            if len(chunk) == size:
                yield self._task(settings, number, chunk)
                number, chunk = number + 1, []
        if chunk:
            yield self._task(settings, number, chunk)

    def _task(
        self, settings: PackSettings, number: int, chunk: list[tuple[Any, int, str, dict[str, Any]]]
    ) -> PartitionTask:
        start = self.count - len(chunk)
        values = {f.name: [record[3][f.name] for record in chunk] for f in self.fields or []}
        task_settings = PackSettings(**{**vars(settings), "fields": tuple(self.fields or ())})
        names = [display_name(r[2]) for r in chunk]
        return PartitionTask(task_settings, Partition(number, start, self.count), paths=names,
                             labels=np.array([r[1] for r in chunk], dtype=np.int64), sources=names, values=values,
                             images=[r[0] for r in chunk])

    def _record(self, item: Mapping[str, Any], index: int) -> tuple[Any, int, str, dict[str, Any]]:
        if not isinstance(item, Mapping) or "image" not in item:
            raise PackError(f"item {index}: expected a mapping with an 'image' (and label, source, fields), "
                            f"got {type(item).__name__}")
        image = _image(item["image"], index)
        source = item.get("source")
        if source is None:
            source = os.fspath(image) if isinstance(image, (str, Path)) else f"item-{index}"
        if not isinstance(source, str):
            raise PackError(f"item {index}: source {source!r} is not a string")
        where = f"item {index} ({display_name(source)})"
        label = self._label(item.get("label"), where)
        raw = {k: v for k, v in item.items() if k not in _RESERVED}
        if self.fields is None:
            self.fields = self._schema(raw, where)
        if set(raw) != {f.name for f in self.fields}:
            raise PackError(f"{where}: fields {', '.join(sorted(raw)) or 'none'} differ from the first item's "
                            f"({', '.join(f.name for f in self.fields) or 'none'})")
        values = {}
        for spec in self.fields:
            try:
                values[spec.name] = spec.parse(raw[spec.name])
            except ValueError as e:
                raise PackError(f"{where}: field {spec.name!r}: {e}") from None
        return image, label, source, values

    def _schema(self, raw: dict[str, Any], where: str) -> list[FieldSpec]:
        specs = []
        for name, value in raw.items():
            if name in self.declared:
                specs.append(self.declared[name])
                continue
            try:
                spec = infer_spec(name, [value])
            except ValueError as e:
                raise PackError(f"{where}: {e}") from None
            if spec.classes is not None:
                raise PackError(f"{where}: field {name!r} holds class names: declare its classes "
                                f"(fields={{{name!r}: 'labels:A,B,...'}})")
            specs.append(spec)
        unknown = sorted(set(self.declared) - set(raw))
        if unknown:
            raise PackError(f"{where}: field {unknown[0]!r} is declared but the items have no such key")
        return specs

    def _label(self, label: Any, where: str) -> int:
        has_label = label is not None
        if self.labelled is None:
            self.labelled = has_label
        if has_label != self.labelled:
            raise PackError(f"{where}: {'has a label' if has_label else 'has no label'}, unlike the first "
                            "item (label every item, or none)")
        if not has_label:
            return -1
        if self._names is None:
            self._names = isinstance(label, str)
        if isinstance(label, str) != self._names:
            raise PackError(f"{where}: label {label!r} mixes class names and integer labels (the first item's "
                            f"is {'a name' if self._names else 'an integer'})")
        if isinstance(label, str):
            if label not in self._ids:
                if self.fixed_classes:
                    raise PackError(f"{where}: label {label!r} is not one of the given classes")
                self._ids[label] = len(self.classes)
                self.classes.append(label)
            return self._ids[label]
        if isinstance(label, (int, np.integer)) and not isinstance(label, bool) and label >= 0:
            label = int(label)
            if self.fixed_classes and label >= len(self.classes):
                raise PackError(f"{where}: label {label} is not an index of the {len(self.classes)} given classes")
            if not self.fixed_classes:
                self.classes.extend(str(i) for i in range(len(self.classes), label + 1))
            return label
        raise PackError(f"{where}: label {label!r} is neither a class name nor a non-negative integer")


def _image(image: Any, index: int) -> Any:
    """The item's image as ``encode_image`` takes it (arrays become PIL images)."""
    if isinstance(image, (str, Path, bytes, Image.Image)):
        return image
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
            raise PackError(f"item {index}: an array image must be uint8 H x W or H x W x 3|4, "
                            f"got {image.dtype} {image.shape}")
        return Image.fromarray(image)
    raise PackError(f"item {index}: image is {type(image).__name__}; expected a path, bytes, a PIL image or a "
                    "uint8 array")
