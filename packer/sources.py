"""Scanning the source: an ImageFolder tree or a CSV of ``path,label`` rows, into an ordered plan.

ImageFolder follows torchvision exactly: classes are the sorted names of SRC's sub-folders, each class
folder is walked recursively (following links) in sorted order, files are kept when their lower-cased
name ends with one of torchvision's image extensions, so labels and order equal
``torchvision.datasets.ImageFolder(SRC)``.

CSV: one ``path,label`` row per image (an optional ``path,label`` header, blank lines ignored), paths
relative to SRC, rows kept in file order. When every label is a non-negative integer, the labels are
kept as they are and ``classes`` are the string forms of ``0..max``; otherwise labels are class names
and ``classes`` are the sorted distinct names.
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from packer.errors import PackError
from packer.transforms import IMAGE_EXTENSIONS

_HEADER = ["path", "label"]


@dataclass(frozen=True)
class Skipped:
    """A source file left out of the dataset, and why. ``path`` is relative to the source root."""

    path: str
    reason: str


@dataclass
class Plan:
    """What to pack, in dataset order: ``paths`` relative to ``root`` and their int64 ``labels``.

    ``files`` counts the image files the source named; ``skipped`` holds those already left out while
    scanning (only with ``on_error="skip"``: CSV rows naming a file that does not exist).
    """

    kind: str
    root: Path
    classes: list[str]
    paths: list[str]
    labels: np.ndarray
    files: int
    skipped: list[Skipped] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.paths)


def scan_source(src: str | os.PathLike, labels: str | os.PathLike | None, on_error: str) -> Plan:
    """The plan for ``src``: an ImageFolder tree, or the CSV file ``labels`` when one is given."""
    root = Path(src).resolve()
    if not root.is_dir():
        raise PackError(f"{src}: source is not a directory")
    if labels is None:
        return scan_image_folder(root)
    return scan_csv(root, Path(labels), on_error)


def scan_image_folder(root: Path) -> Plan:
    """Classes from the sorted sub-folder names, images from a sorted recursive walk of each."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise PackError(f"{root}: no class sub-folders (an ImageFolder source holds one folder per class)")
    paths: list[str] = []
    labels: list[int] = []
    for index, name in enumerate(classes):
        for folder, _, files in sorted(os.walk(root / name, followlinks=True)):
            relative = Path(folder).relative_to(root).as_posix()
            for file_name in sorted(files):
                if file_name.lower().endswith(IMAGE_EXTENSIONS):
                    paths.append(f"{relative}/{file_name}")
                    labels.append(index)
    return Plan("imagefolder", root, classes, paths, np.array(labels, dtype=np.int64), files=len(paths))


def scan_csv(root: Path, csv_path: Path, on_error: str) -> Plan:
    """Rows of ``path,label`` naming files under ``root``; see the module docstring for the labels.

    Classes come from every row, so a skipped file never shifts the other labels.
    """
    rows = _read_rows(csv_path)
    classes, all_ids = _label_ids([label for _, _, label in rows])
    paths: list[str] = []
    kept: list[int] = []
    skipped: list[Skipped] = []
    for row_index, (line, path, _) in enumerate(rows):
        if not (root / path).is_file():
            reason = f"{csv_path}, line {line}: no such file {path!r} under {root}"
            if on_error == "skip":
                skipped.append(Skipped(path, reason))
                continue
            raise PackError(reason)
        paths.append(path)
        kept.append(row_index)
    return Plan("csv", root, classes, paths, all_ids[kept], files=len(rows), skipped=skipped)


def _read_rows(csv_path: Path) -> list[tuple[int, str, str]]:
    """``(line number, path, label)`` for each data row; malformed rows are errors naming the line."""
    try:
        with open(csv_path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            records = [(reader.line_num, row) for row in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise PackError(f"{csv_path}: cannot read the labels CSV ({e})") from None
    records = [(line, [cell.strip() for cell in row]) for line, row in records if any(c.strip() for c in row)]
    if records and [cell.lower() for cell in records[0][1]] == _HEADER:
        records = records[1:]
    rows = []
    for line, row in records:
        if len(row) != 2:
            raise PackError(f"{csv_path}, line {line}: expected 2 columns (path,label), found {len(row)}")
        path, label = row
        if not path:
            raise PackError(f"{csv_path}, line {line}: empty path")
        if Path(path).is_absolute():
            raise PackError(f"{csv_path}, line {line}: path {path!r} is absolute; paths are relative to SRC")
        if not label:
            raise PackError(f"{csv_path}, line {line}: empty label for {path!r}")
        rows.append((line, path, label))
    return rows


def _label_ids(names: list[str]) -> tuple[list[str], np.ndarray]:
    """Classes and int64 label ids: integers kept as they are, class names indexed in sorted order."""
    if names and all(name.isdecimal() for name in names):
        values = np.array([int(name) for name in names], dtype=np.int64)
        return [str(i) for i in range(int(values.max()) + 1)], values
    classes = sorted(set(names))
    index = {name: i for i, name in enumerate(classes)}
    return classes, np.array([index[name] for name in names], dtype=np.int64)
