"""The types every manifest field must have, checked before a ``Manifest`` is built from JSON.

A manifest is input from whoever shared the dataset: a field of the wrong type would otherwise surface
later as a ``KeyError``, ``TypeError`` or a huge allocation far from its cause. ``check_manifest_data``
turns every such case into one ``FormatError`` naming the manifest and the field.
"""
from __future__ import annotations

import unicodedata
from typing import Any

from reader.format.errors import FormatError
from reader.format.fields import printable
from reader.format.records import MAX_SIDE
from reader.format.registry import ENCODINGS, STORAGES

SHARD_KEYS: dict[str, type | tuple[type, ...]] = {"file": str, "records": int, "bytes": int, "checksum": str}
SHARD_KEYS_V4 = {**SHARD_KEYS, "table_offset": (int, type(None))}  # version 4 adds where the table lies
SHARD_KEYS_V5 = {**SHARD_KEYS_V4, "table_bytes": (int, type(None))}  # version 5: its length, compressed
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format": str, "format_version": int, "tool_version": str, "storage": str, "encoding": str,
    "jpeg_quality": (int, type(None)), "shape": (list, type(None)), "classes": list, "shards": list,
    "transform": dict, "source": dict, "fields": list, "labelled": bool,
}
_OPTIONAL = {"jpeg_quality", "fields", "labelled"}  # fields and labelled: version 2 (default [] and true)


def check_manifest_data(data: dict[str, Any], origin: str) -> None:
    """Raise ``FormatError`` naming ``origin`` and the field unless ``data`` has the manifest's keys
    with the right types and values (derived keys ``class_to_idx``/``num_records`` removed first)."""
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise FormatError(f"{origin}: unknown manifest field {unknown[0]!r}")
    for key, kind in _FIELDS.items():
        if key not in data:
            if key in _OPTIONAL:
                continue
            raise FormatError(f"{origin}: the manifest has no {key!r} field")
        if kind is bool:
            if not isinstance(data[key], bool):
                raise FormatError(f"{origin}: {key} is {_describe(data[key])}, expected true or false")
        else:
            _check_type(data[key], kind, origin, key)
    if data["storage"] not in STORAGES:
        raise FormatError(f"{origin}: unknown storage {data['storage']!r} (expected one of {', '.join(STORAGES)})")
    if data["encoding"] not in ENCODINGS:
        raise FormatError(f"{origin}: unknown encoding {data['encoding']!r} (expected one of {', '.join(ENCODINGS)})")
    _check_shape(data["shape"], origin)
    _check_classes(data["classes"], origin)
    version = data["format_version"]
    _check_shards(data["shards"], SHARD_KEYS_V5 if version >= 5 else SHARD_KEYS_V4 if version >= 4 else SHARD_KEYS,
                  origin)
    _check_source(data["source"], origin)
    if data.get("format_version") == 1 and ("fields" in data or "labelled" in data):
        raise FormatError(f"{origin}: fields and labelled are version-2 keys, in a version-1 manifest")
    if data.get("labelled", True) is False and data["classes"]:
        raise FormatError(f"{origin}: an unlabelled dataset (labelled: false) lists classes")


def check_plain_name(name: str, origin: str) -> None:
    """Refuse a shard name that is not a plain file name inside the dataset directory."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise FormatError(f"{origin}: shard file {name!r} is not a plain file name inside the dataset "
                          "directory (no '/', no '..', not absolute)")


def _check_type(value: Any, kind: type | tuple[type, ...], origin: str, where: str) -> None:
    """``isinstance`` that does not take ``True`` for an int."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise FormatError(f"{origin}: {where} is {_describe(value)}, expected {wanted}")


def _describe(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__} ({str(value)[:40]!r})"


def _check_shape(shape: list[Any] | None, origin: str) -> None:
    if shape is None:
        return
    if len(shape) != 3 or any(isinstance(n, bool) or not isinstance(n, int) for n in shape) \
            or shape[0] != 3 or not all(1 <= n <= MAX_SIDE for n in shape[1:]):
        raise FormatError(f"{origin}: shape {str(shape)[:60]} is not [3, H, W] with 1 <= H, W <= {MAX_SIDE}")


def _check_classes(classes: list[Any], origin: str) -> None:
    for index, name in enumerate(classes):
        _check_type(name, str, origin, f"classes[{index}]")
    if len(set(classes)) != len(classes):
        raise FormatError(f"{origin}: classes holds the same name twice")
    first: dict[str, int] = {}
    for index, name in enumerate(classes):
        seen = first.setdefault(unicodedata.normalize("NFC", name), index)
        if seen != index:
            raise FormatError(f"{origin}: classes[{index}] {printable(name)!r} differs from classes[{seen}] only by "
                              "Unicode normalisation (NFC/NFD)")


def _check_shards(shards: list[Any], keys: dict[str, type | tuple[type, ...]], origin: str) -> None:
    names = set()
    for index, shard in enumerate(shards):
        where = f"shards[{index}]"
        _check_type(shard, dict, origin, where)
        if set(shard) != set(keys):
            raise FormatError(f"{origin}: {where} has keys {sorted(shard)}, expected {sorted(keys)}")
        for key, kind in keys.items():
            _check_type(shard[key], kind, origin, f"{where}.{key}")
        if min(shard["records"], shard["bytes"], shard.get("table_offset") or 0, shard.get("table_bytes") or 0) < 0:
            raise FormatError(f"{origin}: {where} has a negative record count, size, table offset or table length")
        if shard["records"] > shard["bytes"]:  # every record has a payload byte at least
            raise FormatError(f"{origin}: {where} ({printable(shard['file'])}) claims {shard['records']} records in "
                              f"{shard['bytes']} bytes")
        check_plain_name(shard["file"], origin)
        if shard["file"] in names:
            raise FormatError(f"{origin}: shard file {shard['file']!r} is listed twice")
        names.add(shard["file"])


def _check_source(source: dict[str, Any], origin: str) -> None:
    """The parts of ``source`` that ``info`` shows: the skipped list and the counts."""
    for key in ("files", "packed"):
        if key in source and source[key] is not None:
            _check_type(source[key], int, origin, f"source.{key}")
    skipped = source.get("skipped", [])
    _check_type(skipped, list, origin, "source.skipped")
    for index, entry in enumerate(skipped):
        _check_type(entry, dict, origin, f"source.skipped[{index}]")
        for key in ("path", "reason"):
            _check_type(entry.get(key), str, origin, f"source.skipped[{index}].{key}")
