"""Per-record fields beyond the image and its class: their types, one value's checks, and their columns.

A dataset's schema (the manifest's ``fields``) is a list of ``FieldSpec``. Every record of a version-2
dataset also has its source path, kept as the built-in string column ``source``. Values are stored per
shard as plain numpy columns inside the shard (``Container`` named arrays), never pickled nor JSON per
record:

| type | a value | stored as | in a batch (``reader.make_loader(fields=...)``) |
|---|---|---|---|
| ``int`` | an integer | ``int64 [n]`` | ``int64 [B]`` tensor |
| ``float`` | a number | ``float64 [n]`` | ``float64 [B]`` tensor |
| ``str`` | text | UTF-8 bytes + ``int64 [n+1]`` offsets | list of ``str`` |
| ``labels`` | a list of class names (``classes``) or of ints | ``int64`` ids + offsets | list of ``int64 [k_i]`` |
| ``vector`` | exactly ``length`` numbers | ``float32 [n, length]`` | ``float32 [B, length]`` tensor |
| ``boxes`` | a list of boxes of 4 numbers each | ``float32 [m, 4]`` + offsets | list of ``float32 [k_i, 4]`` tensors |

Variable-length values (``str``, ``labels``, ``boxes``) are batched as lists, one tensor per sample,
since padding would need a pad value the reader cannot choose for the model.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from reader.format.errors import FormatError

FIELD_TYPES = ("int", "float", "str", "labels", "vector", "boxes")
SOURCE = "source"  # the built-in column: each record's source path
RESERVED_NAMES = ("image", "label", "index", "valid", SOURCE, "path")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_VARIABLE = {"str", "labels", "boxes"}
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_field_name(name: Any) -> None:
    """``ValueError`` unless ``name`` may name a field: a short identifier-like name, not a batch key."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in RESERVED_NAMES:
        raise ValueError(f"field name {name!r} is not allowed: use letters, digits, _ . - (not starting "
                         f"with a digit, at most 64), and none of {', '.join(RESERVED_NAMES)}")


@dataclass(frozen=True)
class FieldSpec:
    """One field: its name, type, the ``length`` of a ``vector``, and the class names of a ``labels``
    field whose values are names (None: integer labels)."""

    name: str
    type: str
    length: int | None = None
    classes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_field_name(self.name)
        if self.type not in FIELD_TYPES:
            raise ValueError(f"field {self.name!r}: type {self.type!r} is not one of {', '.join(FIELD_TYPES)}")
        if (self.type == "vector") != (self.length is not None):
            raise ValueError(f"field {self.name!r}: a length is given for vectors, and only for them")
        if self.length is not None and not (isinstance(self.length, int) and self.length >= 1):
            raise ValueError(f"field {self.name!r}: vector length {self.length!r} must be a positive integer")
        if self.classes is not None and self.type != "labels":
            raise ValueError(f"field {self.name!r}: classes are given for labels fields only")

    def declaration(self, most_classes: int = 5) -> str:
        """The field as ``--field`` declares it (``emb:vector:512``, ``tags:labels:cat,dog``), for people:
        a label field's classes past ``most_classes`` are shortened to ``,...``."""
        declaration = f"{self.name}:{self.type}"
        if self.length is not None:
            return f"{declaration}:{self.length}"
        if self.classes:
            more = ",..." if len(self.classes) > most_classes else ""
            return f"{declaration}:{','.join(self.classes[:most_classes])}{more}"
        return declaration

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "type": self.type}
        if self.length is not None:
            data["length"] = self.length
        if self.classes is not None:
            data["classes"] = list(self.classes)
        return data

    @classmethod
    def from_json(cls, data: Any, origin: str) -> FieldSpec:
        """A field of a manifest's schema; anything else is a ``FormatError`` naming ``origin``."""
        if not isinstance(data, dict) or set(data) - {"name", "type", "length", "classes"}:
            raise FormatError(f"{origin}: a field must be an object with name, type, length, classes")
        classes = data.get("classes")
        if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
            raise FormatError(f"{origin}: field classes must be a list of strings")
        try:
            return cls(data["name"], data["type"], data.get("length"), None if classes is None else tuple(classes))
        except KeyError as e:
            raise FormatError(f"{origin}: a field has no {e.args[0]!r}") from None
        except (ValueError, TypeError) as e:
            raise FormatError(f"{origin}: {e}") from None

    def parse(self, value: Any) -> Any:
        """One value checked and normalised (int, float, str, list of ints, list of floats, list of
        4-float lists); ``ValueError`` saying what is wrong with it."""
        if self.type == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"expected an integer, got {_shown(value)}")
            if not -(1 << 63) <= value < (1 << 63):
                raise ValueError(f"integer {value} does not fit in 64 bits")
            return value
        if self.type == "float":
            return _number(value)
        if self.type == "str":
            if not isinstance(value, str):
                raise ValueError(f"expected text, got {_shown(value)}")
            return value
        if self.type == "vector":
            numbers = _list(value, "numbers")
            if len(numbers) != self.length:
                raise ValueError(f"expected a list of {self.length} numbers, got {len(numbers)}")
            return [_float32(v) for v in numbers]
        if self.type == "boxes":
            boxes = _list(value, "boxes")
            for box in boxes:
                if not isinstance(box, list) or len(box) != 4:
                    raise ValueError(f"expected boxes of 4 numbers each, got {_shown(box)}")
            return [[_float32(v) for v in box] for box in boxes]
        return self._parse_labels(value)

    def _parse_labels(self, value: Any) -> list[int]:
        items = _list(value, "labels")
        if self.classes is None:
            for item in items:
                if isinstance(item, str):
                    raise ValueError(f"got the class name {_shown(item)}, but the field has no class list: declare "
                                     f"one ({self.name}:labels:A,B,...), or give integer labels")
                if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                    raise ValueError(f"expected a list of non-negative integer labels, got {_shown(item)}")
                if item >= 1 << 63:
                    raise ValueError(f"label {_shown(item)} does not fit in 64 bits")
            return items
        index = {name: i for i, name in enumerate(self.classes)}
        for item in items:
            if item not in index:
                raise ValueError(f"unknown class {_shown(item)} (the field's classes: {_shown_classes(self.classes)})")
        return [index[item] for item in items]

    def columns(self, values: Sequence[Any], prefix: str) -> dict[str, np.ndarray]:
        """The named arrays that store ``values`` (parsed ones) of one shard, named ``prefix...``."""
        if self.type == "int":
            return {prefix: np.asarray(values, dtype=np.int64).reshape(len(values))}
        if self.type == "float":
            return {prefix: np.asarray(values, dtype=np.float64).reshape(len(values))}
        if self.type == "vector":
            return {prefix: np.asarray(values, dtype=np.float32).reshape(len(values), self.length or 0)}
        if self.type == "str":
            encoded = [v.encode("utf-8", "surrogateescape") for v in values]
            return _with_offsets(prefix, np.frombuffer(b"".join(encoded), dtype=np.uint8), [len(e) for e in encoded])
        if self.type == "labels":
            return _with_offsets(prefix, np.asarray([i for v in values for i in v], dtype=np.int64),
                                 [len(v) for v in values])
        boxes = np.asarray([b for v in values for b in v], dtype=np.float32).reshape(-1, 4)
        return _with_offsets(prefix, boxes, [len(v) for v in values])

    def column_rows(self, prefix: str, records: int) -> dict[str, int | None]:
        """The named arrays of this field's column in a shard of ``records`` records, each with the
        rows it must have (None: any, the values of a variable-length column)."""
        if self.type in _VARIABLE:
            return {f"{prefix}.values": None, f"{prefix}.offsets": records + 1}
        return {prefix: records}

    def read_column(self, arrays: dict[str, np.ndarray], prefix: str, records: int, shown: object) -> Column:
        """The column stored under ``prefix`` for ``records`` records, checked (dtype, shape, offsets
        within the values, label ids of a class) so that a damaged shard is a ``FormatError`` naming
        ``shown``."""
        dtype = {"int": np.int64, "float": np.float64, "vector": np.float32, "str": np.uint8,
                 "labels": np.int64, "boxes": np.float32}[self.type]
        if self.type not in _VARIABLE:
            values = arrays[prefix]
            shape = (records, self.length) if self.type == "vector" else (records,)
            if values.dtype != dtype or values.shape != shape:
                raise FormatError(f"{shown}: column {prefix} has dtype {values.dtype} and shape {values.shape}, "
                                  f"expected {np.dtype(dtype)} {shape}")
            return Column(self, values, None)
        values, offsets = arrays[f"{prefix}.values"], arrays[f"{prefix}.offsets"]
        rows = values.shape[1:] == (4,) if self.type == "boxes" else values.ndim == 1
        if values.dtype != dtype or not rows:
            raise FormatError(f"{shown}: column {prefix} has values of dtype {values.dtype} and shape {values.shape}")
        if (offsets.dtype != np.int64 or offsets.shape != (records + 1,) or (offsets[:1] != 0).any()
                or (np.diff(offsets) < 0).any() or offsets[-1] != len(values)):
            raise FormatError(f"{shown}: column {prefix} has damaged offsets")
        if self.type == "labels" and len(values):
            top = len(self.classes) if self.classes is not None else None
            bad = (values < 0) | (values >= top) if top is not None else values < 0
            if bad.any():
                what = f"a class of the field's {top}" if top is not None else "a non-negative label"
                raise FormatError(f"{shown}: column {prefix} holds {values[bad][0]}, not {what}")
        return Column(self, values, offsets)


@dataclass(frozen=True)
class Column:
    """One field's values for consecutive records (one shard, or several concatenated)."""

    spec: FieldSpec
    values: np.ndarray
    offsets: np.ndarray | None  # None for fixed-size types

    def __len__(self) -> int:
        return len(self.values) if self.offsets is None else len(self.offsets) - 1

    def value(self, i: int) -> Any:
        """Record ``i``'s value as plain Python (the class names of a named ``labels`` field)."""
        if self.offsets is None:
            return self.values[i].tolist()
        part = self.values[self.offsets[i]:self.offsets[i + 1]]
        if self.spec.type == "str":
            return part.tobytes().decode("utf-8", "surrogateescape")
        if self.spec.type == "labels" and self.spec.classes is not None:
            return [self.spec.classes[k] for k in part.tolist()]
        return part.tolist()

    def raw(self, i: int) -> Any:
        """Record ``i``'s value as numpy (a scalar, a row, or its slice of the values)."""
        if self.offsets is None:
            return self.values[i]
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    @staticmethod
    def concatenate(columns: Sequence[Column]) -> Column:
        spec = columns[0].spec
        values = np.concatenate([c.values for c in columns])
        if columns[0].offsets is None:
            return Column(spec, values, None)
        starts = np.cumsum([0] + [len(c.values) for c in columns[:-1]])
        parts = [np.zeros(1, np.int64)] + [c.offsets[1:] + start for c, start in zip(columns, starts)
                                           if c.offsets is not None]
        return Column(spec, values, np.concatenate(parts).astype(np.int64))


SOURCE_SPEC = FieldSpec("source_path", "str")  # the source column's type (its name is reserved for fields)


def field_prefix(name: str) -> str:
    """The named-array prefix of a field's column inside a shard."""
    return f"field.{name}"


def record_columns(
    fields: Sequence[FieldSpec], sources: Sequence[str], values: Mapping[str, Sequence[Any]]
) -> dict[str, np.ndarray]:
    """Every named array of one shard: the source column, then one column per field."""
    arrays = SOURCE_SPEC.columns(sources, SOURCE)
    for field in fields:
        arrays.update(field.columns(values[field.name], field_prefix(field.name)))
    return arrays


def read_record_columns(
    fields: Sequence[FieldSpec], arrays: dict[str, np.ndarray], records: int, shown: object
) -> dict[str, Column]:
    """The source column (under ``SOURCE``) and every field's column of one shard, checked."""
    columns = {SOURCE: SOURCE_SPEC.read_column(arrays, SOURCE, records, shown)}
    for field in fields:
        columns[field.name] = field.read_column(arrays, field_prefix(field.name), records, shown)
    return columns


def column_rows(fields: Sequence[FieldSpec], records: int) -> dict[str, int | None]:
    """The named arrays ``record_columns`` writes for a shard of ``records`` records, with the rows
    each must have (None: any), for ``Container.read_arrays``: a compressed array claiming other rows
    is refused before it is inflated."""
    rows = SOURCE_SPEC.column_rows(SOURCE, records)
    for field in fields:
        rows.update(field.column_rows(field_prefix(field.name), records))
    return rows


def infer_spec(name: str, values: Sequence[Any]) -> FieldSpec:
    """The type of a field from its JSON values: int, float (numbers, not all integers), str, vector
    (lists of numbers, some not integers; its length the most common one), boxes (lists of 4-number lists),
    labels (lists of strings, named classes, or of integers). When the values disagree, the type is
    inferred from the most common kind of value that fits one (so that checking each value then names
    the odd rows out, even when a bad value is as common as good ones); ``ValueError`` when no kind fits."""
    try:
        return _infer(name, list(values))
    except ValueError as error:
        kinds = [_kind(v) for v in values]
        for common in sorted(dict.fromkeys(kinds), key=kinds.count, reverse=True):  # ties: first seen first
            try:
                return _infer(name, [v for v, kind in zip(values, kinds) if kind == common])
            except ValueError:
                continue
        raise error


def _kind(value: Any) -> str:
    if _is_number(value):
        return "number"
    return type(value).__name__


def _infer(name: str, present: list[Any]) -> FieldSpec:
    if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return FieldSpec(name, "int")
    if all(_is_number(v) for v in present):
        return FieldSpec(name, "float")
    if all(isinstance(v, str) for v in present):
        return FieldSpec(name, "str")
    if all(isinstance(v, list) for v in present):
        items = [item for v in present for item in v]
        if items and all(isinstance(item, list) for item in items):
            return FieldSpec(name, "boxes")
        if all(isinstance(item, str) for item in items):
            return FieldSpec(name, "labels", classes=tuple(sorted(set(items))))
        lengths = [len(v) for v in present]
        if all(_is_number(item) for item in items) and not all(isinstance(item, int) for item in items):
            return FieldSpec(name, "vector", length=max(set(lengths), key=lengths.count))  # the usual length
        if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            return FieldSpec(name, "labels")
    raise ValueError(f"field {name!r}: cannot tell its type from its values (mixed or unsupported); "
                     f"declare it as one of {', '.join(FIELD_TYPES)}")


def printable(text: str) -> str:
    """``text`` for a one-line message: characters that are not printable (a newline, an escape
    sequence a hostile dataset stored as a source path) shown as Python escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _with_offsets(prefix: str, flat: np.ndarray, lengths: list[int]) -> dict[str, np.ndarray]:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return {f"{prefix}.values": flat, f"{prefix}.offsets": offsets}


def _is_number(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the range of a float
        return False


def _number(value: Any) -> float:
    if not _is_number(value):
        raise ValueError(f"expected a finite number, got {_shown(value)}")
    return float(value)


def _float32(value: Any) -> float:
    """A number of a ``vector`` or ``boxes`` value, which are stored as float32: one past its range
    would be stored as infinity."""
    number = _number(value)
    if abs(number) > _FLOAT32_MAX:
        raise ValueError(f"{_shown(value)} is beyond the float32 range (+-3.4e38) these values are stored in")
    return number


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of {what}, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _shown_classes(classes: Sequence[str]) -> str:
    return ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
