"""Reading a labels file: a CSV or a JSON Lines file naming images, their labels and extra fields.

CSV: one row per image. Without a header, exactly ``path,label``. With a header (its first cell is
``path``), the columns are ``path``, optionally ``label``, and any others, each one field. A CSV cell
of a list type (``labels``, ``vector``, ``boxes``) is a JSON array (``"[0.5, 1.5]"``), and a column
whose every cell is one is inferred as a list type; other cells are text, read as an integer or a
number when the field is one.

JSON Lines (a file ending in ``.jsonl``): one JSON object per line, ``{"path": ..., "label": ...,
<field>: <value>, ...}``; ``label`` may be left out of every line (a dataset without classes). Its
values keep their JSON types: a string such as ``"007"`` stays text.

Field types (``reader.format.fields``) are inferred from all the values of a field, or declared
(``declare_field("emb:vector:128")``, ``--field emb:vector:128`` on the command line; for named
multi-labels ``tags:labels:cat,dog,fish`` fixes the class list, and a name outside it is an error).
Every row must have every field; a bad value is a ``PackError`` naming the file, the line and the field.
"""
from __future__ import annotations

import csv
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from packer.errors import PackError
from reader.format.fields import FIELD_TYPES, FieldSpec, check_field_name, infer_spec

_HEADER = ["path", "label"]


@dataclass
class LabelRow:
    """One image of the labels file: its line, path, label text (None: no label) and raw field values."""

    line: int
    path: str
    label: str | None
    values: dict[str, Any] = field(default_factory=dict)


def declared_fields(fields: Mapping[str, str | FieldSpec] | None) -> dict[str, FieldSpec]:
    """``pack``'s ``fields`` argument as ``FieldSpec``s by name: each value a ``FieldSpec`` or a declaration
    (``"vector:128"``, ``"labels:A,B"``) of the field under its key, which must be the field's name."""
    declared = {name: f if isinstance(f, FieldSpec) else declare_field(f"{name}:{f}")
                for name, f in (fields or {}).items()}
    misnamed = [(name, f.name) for name, f in declared.items() if f.name != name]
    if misnamed:
        raise PackError(f"fields: the key {misnamed[0][0]!r} holds a FieldSpec named {misnamed[0][1]!r} "
                        "(a field's key is its name)")
    return declared


def declare_field(text: str) -> FieldSpec:
    """``name:type``, ``name:vector:LENGTH`` or ``name:labels:CLASS,CLASS,...`` as a ``FieldSpec``."""
    name, _, rest = text.partition(":")
    kind, _, argument = rest.partition(":")
    try:
        if kind == "vector":
            if not argument.isdecimal():
                raise ValueError(f"a vector field is declared as {name}:vector:LENGTH")
            return FieldSpec(name, kind, length=int(argument))
        if kind == "labels" and argument:
            classes = [c.strip() for c in argument.split(",") if c.strip()]
            if not classes or len(set(classes)) != len(classes):
                repeated = [c for c in classes if classes.count(c) > 1][:1]
                raise ValueError(f"class {repeated[0]!r} is listed twice" if repeated else "it names no class")
            return FieldSpec(name, kind, classes=tuple(classes))
        if argument or kind not in FIELD_TYPES:
            raise ValueError(f"expected NAME:TYPE with TYPE one of {', '.join(FIELD_TYPES)}")
        return FieldSpec(name, kind)
    except ValueError as e:
        raise PackError(f"field declaration {text!r}: {e}") from None


def read_label_rows(path: Path) -> tuple[list[LabelRow], list[str]]:
    """The rows of a CSV or JSON Lines labels file, and its field names in file order."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise PackError(f"{path}: the labels file is not a regular file")
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows, names = (_jsonl_rows if _is_jsonl(path) else _csv_rows)(f, path)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise PackError(f"{path}: cannot read the labels file ({e})") from None
    for row in rows:
        _check_path(row, path)
    labelled = [row.label is not None for row in rows]
    if any(labelled) and not all(labelled):
        row = rows[labelled.index(False)]
        raise PackError(f"{path}, line {row.line}: no label for {row.path!r}, while other lines have one "
                        "(label every image, or none)")
    return rows, names


def field_specs(
    rows: list[LabelRow], names: list[str], declared: Mapping[str, FieldSpec], labels_path: Path
) -> list[FieldSpec]:
    """The schema: each field declared or inferred from its values (text cells of a CSV are read as
    JSON lists when all of them are, else as integers or numbers where they are; JSON Lines values as
    they are)."""
    unknown = sorted(set(declared) - set(names))
    if unknown:
        raise PackError(f"{labels_path}: field {unknown[0]!r} is declared but the labels file has no such "
                        f"column or key (it has: {', '.join(names) or 'none'})")
    specs = []
    for name in names:
        try:
            check_field_name(name)
        except ValueError as e:
            raise PackError(f"{labels_path}: column or key {name!r} cannot be a field: {e}") from None
        values = [row.values[name] for row in rows if name in row.values]
        if name in declared:
            specs.append(_with_classes(declared[name], values, labels_path))
            continue
        try:
            specs.append(infer_spec(name, values if _is_jsonl(labels_path) else _cell_values(values)))
        except ValueError as e:
            raise PackError(f"{labels_path}: {e} (e.g. --field {name}:TYPE)") from None
    return specs


def _with_classes(spec: FieldSpec, values: list[Any], labels_path: Path) -> FieldSpec:
    """A declared ``NAME:labels`` without a class list takes its classes from the file, as an inferred
    one does: the sorted names when the values are names (integers stay integer labels)."""
    if spec.type != "labels" or spec.classes is not None:
        return spec
    try:
        inferred = infer_spec(spec.name, values if _is_jsonl(labels_path) else _cell_values(values))
    except ValueError:
        return spec  # mixed values: parsing names the first bad row
    return inferred if inferred.type == "labels" else spec


def parse_values(rows: list[LabelRow], specs: list[FieldSpec], labels_path: Path) -> None:
    """Check and normalise every row's field values in place (a CSV's text cells read as JSON lists or
    numbers where the field is one); the first bad one is a ``PackError``."""
    cells = not _is_jsonl(labels_path)
    for row in rows:
        for spec in specs:
            where = f"{labels_path}, line {row.line}: field {spec.name!r}"
            if spec.name not in row.values or row.values[spec.name] is None:
                raise PackError(f"{where} is missing for {row.path!r} (every image needs every field)")
            value = row.values[spec.name]
            if cells and isinstance(value, str) and spec.type in ("labels", "vector", "boxes"):
                value = _json_cell(value, where)
            elif cells and isinstance(value, str) and spec.type in ("int", "float"):
                value = _number_or_text(value)
            try:
                row.values[spec.name] = spec.parse(value)
            except ValueError as e:
                raise PackError(f"{where}: {e}") from None


def _csv_rows(f: Any, path: Path) -> tuple[list[LabelRow], list[str]]:
    reader = csv.reader(f)
    records = [(reader.line_num, [cell.strip() for cell in row]) for row in reader]
    records = [(line, row) for line, row in records if any(row)]
    if not records or records[0][1][0].lower() != "path":
        for line, row in records:
            if len(row) != 2:
                raise PackError(f"{path}, line {line}: expected 2 columns (path,label), found {len(row)}; "
                                "a CSV with more columns needs a header row (path,label,FIELD,...)")
        return [LabelRow(line, row[0], row[1]) for line, row in records], []
    header = [cell if cell.lower() not in _HEADER else cell.lower() for cell in records[0][1]]
    if len(set(header)) != len(header) or "" in header:
        raise PackError(f"{path}, line {records[0][0]}: the header has an empty or repeated column name")
    names = [name for name in header if name not in _HEADER]
    rows = []
    for line, row in records[1:]:
        if len(row) != len(header):
            raise PackError(f"{path}, line {line}: expected {len(header)} columns ({','.join(header)}), "
                            f"found {len(row)}")
        cells = dict(zip(header, row))
        rows.append(LabelRow(line, cells["path"], cells.get("label"), {n: cells[n] for n in names}))
    return rows, names


def _jsonl_rows(f: Any, path: Path) -> tuple[list[LabelRow], list[str]]:
    rows, names = [], {}
    for line, text in enumerate(f, start=1):
        if not text.strip():
            continue
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise PackError(f"{path}, line {line}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("path"), str):
            raise PackError(f"{path}, line {line}: expected an object with a \"path\" string")
        label = data.pop("label", None)
        if label is not None and (isinstance(label, bool) or not isinstance(label, (str, int))):
            raise PackError(f"{path}, line {line}: label {label!r} is neither a class name nor an integer")
        image = data.pop("path")
        names.update(dict.fromkeys(data))
        rows.append(LabelRow(line, image, None if label is None else str(label), data))
    return rows, list(names)


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == ".jsonl"


def _check_path(row: LabelRow, labels_path: Path) -> None:
    if not row.path:
        raise PackError(f"{labels_path}, line {row.line}: empty path")
    if "\0" in row.path:
        raise PackError(f"{labels_path}, line {row.line}: path {row.path!r} holds a NUL character, which no file "
                        "name can")
    if Path(row.path).is_absolute():
        raise PackError(f"{labels_path}, line {row.line}: path {row.path!r} is absolute; paths are relative to SRC")
    if os.path.normpath(row.path).split(os.sep)[0] == "..":
        raise PackError(f"{labels_path}, line {row.line}: path {row.path!r} leaves SRC; paths stay inside it")
    if row.label == "":
        raise PackError(f"{labels_path}, line {row.line}: empty label for {row.path!r}")


def _cell_values(values: list[Any]) -> list[Any]:
    """A column's values for type inference: a CSV column whose every cell is a JSON list as those
    lists (a list type), else each cell as an int or a float where it is one."""
    lists = [_json_list(value) for value in values]
    if lists and all(parsed is not None for parsed in lists):
        return lists
    return [_number_or_text(value) for value in values]


def _json_list(value: Any) -> list | None:
    """A CSV cell holding a JSON list, parsed; None for anything else."""
    if not isinstance(value, str) or not value.startswith("["):
        return None
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return None
    return parsed if isinstance(parsed, list) else None


def _number_or_text(value: Any) -> Any:
    """A CSV cell read as an int or a float when it is one; anything else as it is."""
    if not isinstance(value, str):
        return value
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _json_cell(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise PackError(f"{where}: {text[:40]!r} is not a JSON list ({e})") from None
