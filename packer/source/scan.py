"""Scanning the source: an ImageFolder tree or a labels file (CSV or JSON Lines), into an ordered plan.

ImageFolder follows torchvision exactly: classes are the sorted names of SRC's sub-folders, each class
folder is walked recursively (following links) in sorted order, files are kept when their lower-cased
name ends with one of torchvision's image extensions, so labels and order equal
``torchvision.datasets.ImageFolder(SRC)`` on any tree torchvision handles. Where torchvision would loop
or hang, the scan refuses instead: a folder reached a second time (a symlink loop such as
``ln -s .. SRC/a/loop``, or a second link to a folder already scanned) is not walked again and is
reported; DST inside SRC is left out.

Every image file (CSV rows alike) must be a regular file, or a symlink to one, of at most
``max_file_bytes``: a FIFO would block the pack forever and a link to ``/dev/zero`` would be read
without end. Such a file is a per-file error: it stops the pack, or with ``on_error="skip"`` is listed
with its reason. File names need not be UTF-8: they are kept as Python reads them (undecodable bytes
as surrogate escapes) to open the file, and written for people and the manifest with those bytes as
``\\xNN`` escapes (``display_name``), so a name never breaks the pack or the JSON.

Labels file (``packer.source.labels_file``: a CSV of ``path,label`` rows, optionally with a header and more
columns, or JSON Lines; blank lines ignored): paths relative to SRC and staying inside it, each listed
once, rows kept in file order; the other columns or keys are the records' extra fields. ``label_kind``:
``index`` keeps integer labels as they are (``classes`` are the string forms of ``0..max``, at most
``MAX_INDEX_CLASSES``); ``name`` takes labels as class names (``classes`` the sorted distinct names);
``auto`` (the default) chooses ``index`` when every label is a non-negative integer and ``name`` when
none is, and refuses a mix, naming the first row that does not fit, instead of switching silently.
"""
from __future__ import annotations

import os
import re
import stat
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from packer.errors import PackError
from packer.image.transforms import DEFAULT_MAX_FILE_BYTES, IMAGE_EXTENSIONS
from packer.source.labels_file import field_specs, parse_values, read_label_rows
from reader.format import FormatError, load_manifest
from reader.format.fields import FieldSpec

LABEL_KINDS = ("auto", "index", "name")
_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: "３" and "٣" are names, not class 3
# Integer labels name classes 0..max: more than this many classes is refused (10^9 would exhaust memory).
MAX_INDEX_CLASSES = 1_000_000


@dataclass(frozen=True)
class Skipped:
    """A source file left out of the dataset, and why. ``path`` is relative to the source root."""

    path: str
    reason: str


@dataclass
class Plan:
    """What to pack, in dataset order: ``paths`` relative to ``root`` and their int64 ``labels``.

    ``files`` counts the image files the source named; ``skipped`` holds those already left out while
    scanning (only with ``on_error="skip"``: CSV rows naming a file that does not exist). ``fields``
    is the schema of the extra fields and ``values`` their parsed values, one list per field aligned
    with ``paths``; ``labelled`` is False for a labels file without labels (then every label is -1).
    ``sources`` is what each record's source path is recorded as (aligned with ``paths``): by default
    the path relative to ``root`` as ``display_name`` shows it; a source that is not a folder of
    files gives each record the name it chooses.
    """

    kind: str
    root: Path
    classes: list[str]
    paths: list[str]
    labels: np.ndarray
    files: int
    skipped: list[Skipped] = field(default_factory=list)
    fields: list[FieldSpec] = field(default_factory=list)
    values: dict[str, list[Any]] = field(default_factory=dict)
    labelled: bool = True
    sources: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.sources:
            self.sources = [display_name(path) for path in self.paths]
        if len(self.sources) != len(self.paths):
            raise ValueError(f"a plan of {len(self.paths)} records has {len(self.sources)} source names")

    def __len__(self) -> int:
        return len(self.paths)


def display_name(path: str) -> str:
    """``path`` as printable text: bytes that are not UTF-8 (surrogate escapes) shown as ``\\xNN``."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def scan_source(
    src: str | os.PathLike,
    labels: str | os.PathLike | None,
    on_error: str,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    label_kind: str = "auto",
    exclude: str | os.PathLike | None = None,
    fields: Mapping[str, FieldSpec] | None = None,
) -> Plan:
    """The plan for ``src``: an ImageFolder tree, or the labels file ``labels`` (CSV or JSON Lines,
    ``packer.source.labels_file``) when one is given, with its fields typed by ``fields`` where declared.

    ``exclude`` (the destination) is a folder left out of an ImageFolder scan.
    """
    root = Path(src).resolve()
    if not root.is_dir():
        raise PackError(f"{display_name(str(src))}: source is not a directory")
    if label_kind not in LABEL_KINDS:
        raise PackError(f"label kind {label_kind!r} is not one of {', '.join(LABEL_KINDS)}")
    files = _FileCheck(root, on_error, max_file_bytes)
    if labels is None:
        if fields:
            raise PackError(f"fields {', '.join(fields)} are declared, but an image folder has no fields "
                            "(pass a labels file with those columns)")
        return scan_image_folder(root, files, exclude)
    return scan_labels_file(root, Path(labels), files, label_kind, fields or {})


class _FileCheck:
    """Per-file checks of the source: regular file (or a link to one) within the size limit.

    ``problem(relative)`` returns why the file cannot be packed (or None); ``report`` raises it in
    fail mode and collects it in skip mode.
    """

    def __init__(self, root: Path, on_error: str, max_file_bytes: int) -> None:
        self.root = root
        self.on_error = on_error
        self.max_file_bytes = max_file_bytes
        self.skipped: list[Skipped] = []

    def problem(self, relative: str) -> str | None:
        try:
            st = os.stat(self.root / relative)
        except FileNotFoundError:
            if os.path.islink(self.root / relative):
                return "unreadable file (broken symlink)"
            return "no such file"
        except OSError as e:
            return f"cannot stat the file ({e.strerror})"
        if not stat.S_ISREG(st.st_mode):
            return f"not a regular file ({_file_kind(st.st_mode)})"
        if st.st_size > self.max_file_bytes:
            return f"file is {st.st_size} bytes, over the limit of {self.max_file_bytes} (--max-file-size)"
        return None

    def report(self, relative: str, reason: str, context: str = "") -> None:
        """Fail with ``reason`` or, in skip mode, list the file as skipped."""
        shown = display_name(relative)
        if self.on_error == "skip":
            self.skipped.append(Skipped(shown, f"{context}{reason}"))
            return
        raise PackError(f"{context or display_name(str(self.root / relative)) + ': '}{reason}")


def _file_kind(mode: int) -> str:
    kinds = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")]
    return next((what for test, what in kinds if test(mode)), "a special file")


def scan_image_folder(root: Path, files: _FileCheck | None = None, exclude: str | os.PathLike | None = None) -> Plan:
    """Classes from the sorted sub-folder names, images from a sorted recursive walk of each."""
    files = files or _FileCheck(root, "fail", DEFAULT_MAX_FILE_BYTES)
    excluded = _identity(Path(exclude)) if exclude is not None else None
    class_dirs = sorted(entry.name for entry in os.scandir(root)
                        if _is_folder(entry, entry.name, files) and _identity(Path(entry.path)) != excluded)
    for name in [name for name in class_dirs if _is_packed_dataset(root / name)]:
        class_dirs.remove(name)  # an earlier pack's output, not a class: listed, whatever on_error says
        files.skipped.append(Skipped(display_name(name), "a packed dataset (it holds manifest.json), not a "
                                                         "class folder: left out"))
    if not class_dirs:
        raise PackError(f"{root}: no class sub-folders (an ImageFolder source holds one folder per class)")
    seen = {_identity(root): "SRC itself"}
    for name in reversed(class_dirs):
        seen[_identity(root / name)] = name
    paths: list[str] = []
    labels: list[int] = []
    count = 0
    for index, name in enumerate(class_dirs):
        for folder, names in _walk(root, name, seen, excluded, files):
            for file_name in names:
                if file_name.lower().endswith(IMAGE_EXTENSIONS):
                    count += 1
                    relative = f"{folder}/{file_name}"
                    reason = files.problem(relative)
                    if reason is not None:
                        files.report(relative, reason)
                        continue
                    paths.append(relative)
                    labels.append(index)
    classes = _folder_classes(root, class_dirs)
    return Plan("imagefolder", root, classes, paths, np.array(labels, dtype=np.int64), files=count,
                skipped=files.skipped)


def _folder_classes(root: Path, class_dirs: list[str]) -> list[str]:
    """The class names of ``class_dirs`` (``class_name``), refusing two folders whose names differ only
    by Unicode normalisation: they would be two classes that print the same."""
    classes = [class_name(display_name(name)) for name in class_dirs]
    first: dict[str, str] = {}
    for folder, name in zip(class_dirs, classes):
        if name in first:
            raise PackError(f"{root}: class folders {display_name(first[name])!r} and {display_name(folder)!r} "
                            "differ only by Unicode normalisation (NFC/NFD); rename one so that they differ "
                            "or merge them")
        first[name] = folder
    return classes


def _is_folder(entry: os.DirEntry, relative: str, files: _FileCheck) -> bool | None:
    """Whether ``entry`` is a folder (links followed); None, reported as a per-file error, when that
    cannot be told (a symlink to itself or a loop of links: ``ELOOP``; no permission)."""
    try:
        return entry.is_dir()
    except OSError as e:
        files.report(relative, f"cannot tell what it is ({e.strerror}: a symlink loop?)")
        return None


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _is_packed_dataset(folder: Path) -> bool:
    """Whether ``folder`` is a finished dataset of this format (its manifest loads)."""
    try:
        load_manifest(folder)
    except FormatError:
        return False
    return True


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _walk(
    root: Path, top: str, seen: dict[tuple[int, int] | None, str], excluded: tuple[int, int] | None,
    files: _FileCheck,
) -> list[tuple[str, list[str]]]:
    """``(folder relative to root, sorted file names)`` for ``top`` and every folder under it (links
    followed), in ``sorted(os.walk(...))`` order, as torchvision walks. A folder already scanned
    (``seen``: by device and inode) is a loop or a second link: reported, not walked again."""
    found = []
    pending = [top]
    while pending:
        folder = pending.pop()
        try:
            entries = sorted(os.scandir(root / folder), key=lambda entry: entry.name)
        except OSError as e:
            files.report(folder, f"cannot list the folder ({e.strerror})")
            continue
        names = []
        for entry in entries:
            relative = f"{folder}/{entry.name}"
            folder_entry = _is_folder(entry, relative, files)
            if folder_entry is None:
                continue
            if not folder_entry:
                names.append(entry.name)
                continue
            identity = _identity(Path(entry.path))
            if identity == excluded:
                continue
            if identity in seen:
                files.report(relative, f"folder already scanned as {display_name(seen[identity])!r} "
                                       "(a symlink loop or a second link to it); not scanned again")
                continue
            seen[identity] = relative
            pending.append(relative)
        found.append((folder, names))
    return sorted(found)


def scan_labels_file(
    root: Path, labels_path: Path, files: _FileCheck | None = None, label_kind: str = "auto",
    declared: Mapping[str, FieldSpec] | None = None,
) -> Plan:
    """Rows of a labels file naming files under ``root``; see the module docstring for the labels.

    Classes and field types come from every row, so a skipped file never shifts the other labels.
    """
    files = files or _FileCheck(root, "fail", DEFAULT_MAX_FILE_BYTES)
    rows, names = read_label_rows(labels_path)
    specs = field_specs(rows, names, declared or {}, labels_path)
    parse_values(rows, specs, labels_path)
    labelled = not rows or rows[0].label is not None
    if labelled:
        classes, all_ids = _label_ids([(r.line, r.path, r.label or "") for r in rows], labels_path, label_kind)
    else:
        classes, all_ids = [], np.full(len(rows), -1, dtype=np.int64)
    paths: list[str] = []
    kept: list[int] = []
    first_line: dict[str, int] = {}
    for row_index, row in enumerate(rows):
        context = f"{labels_path}, line {row.line}: "
        key = os.path.normpath(row.path)
        if key in first_line:
            files.report(row.path, f"{row.path!r} is listed again (first on line {first_line[key]})", context)
            continue
        first_line[key] = row.line
        reason = files.problem(row.path)
        if reason == "no such file":
            reason = f"no such file {row.path!r} under {root}"
        if reason is not None:
            files.report(row.path, reason if reason.startswith("no such") else f"{row.path!r}: {reason}", context)
            continue
        paths.append(row.path)
        kept.append(row_index)
    values = {spec.name: [rows[k].values[spec.name] for k in kept] for spec in specs}
    kind = "jsonl" if labels_path.suffix.lower() == ".jsonl" else "csv"
    return Plan(kind, root, classes, paths, all_ids[kept], files=len(rows), skipped=files.skipped,
                fields=specs, values=values, labelled=labelled)


def reads_as_indices(labels: list[str], label_kind: str) -> bool:
    """Whether a labels file's ``labels`` are class indices under ``label_kind`` (``auto``: when every one
    is an integer; a negative one is refused when the labels are read)."""
    return label_kind == "index" or (
        label_kind == "auto" and bool(labels) and all(_INTEGER.fullmatch(label) for label in labels))


def is_class_index(label: str) -> bool:
    """Whether ``label`` is a class index: ASCII digits (``int()`` would also read "３" and "٣")."""
    return _INTEGER.fullmatch(label) is not None and not label.startswith("-")


def class_name(name: str) -> str:
    """A class name as the dataset stores and compares it: Unicode NFC (macOS writes folder names in NFD;
    the same name typed on Linux is NFC)."""
    return unicodedata.normalize("NFC", name)


def _label_ids(rows: list[tuple[int, str, str]], csv_path: Path, label_kind: str) -> tuple[list[str], np.ndarray]:
    """Classes and int64 label ids: integers kept as they are, class names indexed in sorted order."""
    names = [label for _, _, label in rows]
    is_index = [_INTEGER.fullmatch(name) is not None for name in names]  # a negative one is refused below
    if label_kind == "auto" and any(is_index) and not all(is_index):
        line, path, label = rows[is_index.index(False) if is_index[0] else is_index.index(True)]
        raise PackError(
            f"{csv_path}, line {line}: label {label!r} for {path!r} mixes class names with integer labels; "
            "pass --label-kind index (integers only) or --label-kind name (every label a class name)"
        )
    if reads_as_indices(names, label_kind):
        return _index_labels(rows, csv_path)
    for line, path, label in rows:
        if not _is_text(label):
            raise PackError(f"{csv_path}, line {line}: label {label[:30]!r} for {path!r} is not valid Unicode "
                            "text (a lone surrogate)")
    names = [class_name(name) for name in names]
    classes = sorted(set(names))
    index = {name: i for i, name in enumerate(classes)}
    return classes, np.array([index[name] for name in names], dtype=np.int64)


def _index_labels(rows: list[tuple[int, str, str]], csv_path: Path) -> tuple[list[str], np.ndarray]:
    """Integer labels kept as they are; classes ``"0"..str(max)``, at most ``MAX_INDEX_CLASSES``."""
    for line, path, label in rows:
        if not is_class_index(label) or int(label) >= MAX_INDEX_CLASSES:
            raise PackError(
                f"{csv_path}, line {line}: label {label[:30]!r} for {path!r} is not an integer from 0 to "
                f"{MAX_INDEX_CLASSES - 1} in ASCII digits (integer labels index classes 0..max)"
            )
    values = np.array([int(label) for _, _, label in rows], dtype=np.int64)
    return [str(i) for i in range(int(values.max()) + 1 if len(values) else 0)], values
