"""``manifest.json``: what a packed dataset holds, how it was made, and each shard's checksum."""
from __future__ import annotations

import dataclasses
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import xxhash

from reader.format.durable import write_file_atomically
from reader.format.errors import FormatError
from reader.format.fields import FieldSpec
from reader.format.manifest_schema import check_manifest_data
from reader.format.records import RECORD_TABLE_DTYPE

FORMAT_NAME = "packed-images"
FORMAT_VERSION = 5
# version 1: no source paths, no fields, every record labelled; 1-2: one LMDB value per record, no manifest
# checksum; 1-3: no table_offset (readers look every record table up in its container); 1-4: tables and
# columns stored uncompressed (no table_bytes)
READABLE_VERSIONS = (1, 2, 3, 4, 5)
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20
# A manifest larger than this is refused before it is read: a million skipped files listed with their
# reasons take about 150 MB.
MAX_MANIFEST_BYTES = 1 << 30
# A manifest with more JSON values than this (counted as its commas, before parsing) is refused: parsed,
# each value costs 50-100 bytes of Python objects, so 30 million class names in a manifest under the size
# cap would take 4 GB. A million skipped files take 2 million values, a million classes 2 million
# (``classes`` and ``class_to_idx``); parsing the largest manifest allowed takes about 2 GB.
MAX_MANIFEST_VALUES = 20_000_000


@dataclass(frozen=True)
class ShardInfo:
    """One shard file: its name relative to the dataset directory, record count, size and checksum;
    (version 4) where its record table lies in it: ``table_offset``, or None where the table must be
    looked up in the container (shards written before version 4, or by a container that cannot say);
    and (version 5) the length of its stored table, ``table_bytes``: a shard with one stores its table
    and columns compressed (``compressed_arrays``), one without (None: written before version 5, kept
    by an append) stores them as plain rows and ``.npy`` columns."""

    file: str
    records: int
    bytes: int
    checksum: str
    table_offset: int | None = None
    table_bytes: int | None = None

    @property
    def compressed(self) -> bool:
        """Whether the shard stores its record table and columns compressed (format version 5 on)."""
        return self.table_bytes is not None

    @property
    def stored_table_nbytes(self) -> int:
        """The bytes the shard stores its record table in (those at ``table_offset``)."""
        return self.table_bytes if self.table_bytes is not None else self.records * RECORD_TABLE_DTYPE.itemsize


@dataclass
class Manifest:
    """The dataset's description. ``shape`` is ``[C, H, W]`` when every record shares it, else None.

    ``fields`` is the schema of the records' extra fields (``reader.format.fields``); ``labelled`` is
    False for a dataset of images (and fields) without classes, whose records all have label -1.
    Version-2 datasets store every record's source path; version-1 datasets (read as they are) do not.

    ``transform`` is the pre-transform spec the packer applied, ``source`` what it read (kind, root,
    file counts and every skipped file with its reason). Both are plain JSON, recorded as written.
    """

    storage: str
    encoding: str
    shape: list[int] | None
    classes: list[str]
    shards: list[ShardInfo]
    transform: dict[str, Any]
    source: dict[str, Any]
    tool_version: str
    jpeg_quality: int | None = None
    fields: list[FieldSpec] = dataclasses.field(default_factory=list)
    labelled: bool = True
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    @property
    def label_range(self) -> int | None:
        """How many classes the labels index, or None for an unlabelled dataset (labels all -1)."""
        return len(self.classes) if self.labelled else None

    @property
    def has_sources(self) -> bool:
        """Whether the shards store each record's source path (format version 2 on)."""
        return self.format_version >= 2

    @property
    def num_records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.classes)}

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["fields"] = [field.to_json() for field in self.fields]
        if self.format_version == 1:  # a version-1 manifest read back is written as it was
            del data["fields"], data["labelled"]
        if self.format_version < 5 and any(shard.compressed for shard in self.shards):
            raise ValueError("compressed shards (table_bytes) need a manifest of format version 5 on")
        for shard in data["shards"]:
            if self.format_version < 4:
                del shard["table_offset"]
            if self.format_version < 5:
                del shard["table_bytes"]
        data["class_to_idx"] = self.class_to_idx
        data["num_records"] = self.num_records
        if self.format_version >= 3:
            data["checksum"] = manifest_checksum(data)
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, origin: str = MANIFEST_NAME) -> Manifest:
        """Parse and check a manifest; anything that is not one raises ``FormatError`` naming ``origin``.

        A version-3 manifest must carry the checksum of its own content, and ``class_to_idx`` must agree
        with ``classes``."""
        values = (text.count(b",") if isinstance(text, bytes) else text.count(",")) + 1
        if values > MAX_MANIFEST_VALUES:
            raise FormatError(f"{origin}: about {values} JSON values, more than any manifest holds "
                              f"({MAX_MANIFEST_VALUES}); refused before parsing, which would take "
                              f"{values * 50 >> 30}+ GiB of memory")
        try:
            data = json.loads(text)
        except UnicodeDecodeError as e:
            raise FormatError(f"{origin}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer too long to convert
            raise FormatError(f"{origin}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise FormatError(f"{origin}: not a {FORMAT_NAME} manifest")
        if data.get("format_version") not in READABLE_VERSIONS or isinstance(data.get("format_version"), bool):
            raise FormatError(
                f"{origin}: format version {str(data.get('format_version'))[:20]} is not supported "
                f"(this reader reads versions {', '.join(map(str, READABLE_VERSIONS))}; a newer packer wrote it)"
            )
        _check_own_checksum(data, origin)
        class_to_idx = data.pop("class_to_idx", None)
        data.pop("num_records", None)
        check_manifest_data(data, origin)
        _check_class_to_idx(data["classes"], class_to_idx, origin)
        data["shards"] = [ShardInfo(**s) for s in data["shards"]]
        _check_tables_inside(data["shards"], origin)
        fields = data.get("fields", [])
        data["fields"] = [FieldSpec.from_json(f, f"{origin}: fields[{i}]") for i, f in enumerate(fields)]
        if len({f.name for f in data["fields"]}) != len(data["fields"]):
            raise FormatError(f"{origin}: two fields have the same name")
        return cls(**data)

    def write(self, directory: Path) -> Path:
        """Write the manifest atomically (temporary name, fsync, rename): the dataset's commit point."""
        path = Path(directory) / MANIFEST_NAME
        write_file_atomically(path, self.to_json().encode())
        return path


def manifest_checksum(data: dict[str, Any]) -> str:
    """``"xxh3_128:<hex>"`` of a manifest's content: every key but ``checksum``, as canonical JSON
    (sorted keys, no spaces, ASCII), so that it does not depend on how the file was indented."""
    content = {key: value for key, value in data.items() if key != "checksum"}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_128_hexdigest(canonical.encode())}"


def _check_own_checksum(data: dict[str, Any], origin: str) -> None:
    """A version-3 manifest's ``checksum`` must be that of its content (older ones have none)."""
    stored = data.pop("checksum", None)
    if data["format_version"] < 3:
        if stored is not None:
            raise FormatError(f"{origin}: a checksum in a version-{data['format_version']} manifest")
        return
    if stored is None:
        raise FormatError(f"{origin}: the manifest has no 'checksum' field")
    if stored != manifest_checksum(data):
        raise FormatError(f"{origin}: its content does not match its checksum (the manifest was damaged or "
                          "edited); restore it from a good copy")


def _check_tables_inside(shards: list[ShardInfo], origin: str) -> None:
    """Refuse a shard whose stored record table, at its ``table_offset``, would end past its ``bytes``
    (which its file must have): a damaged or edited manifest, found before any shard is opened."""
    for index, shard in enumerate(shards):
        if shard.table_offset is not None and shard.table_offset + shard.stored_table_nbytes > shard.bytes:
            raise FormatError(f"{origin}: shards[{index}] puts its record table's {shard.stored_table_nbytes} bytes "
                              f"at offset {shard.table_offset}, past the end of its {shard.bytes} bytes")


def _check_class_to_idx(classes: list[str], class_to_idx: Any, origin: str) -> None:
    """``class_to_idx``, where present, must be what ``classes`` says."""
    if class_to_idx is not None and class_to_idx != {name: i for i, name in enumerate(classes)}:
        raise FormatError(f"{origin}: class_to_idx does not agree with classes (a class named or numbered "
                          "differently in the two)")


def load_manifest(directory: str | os.PathLike) -> Manifest:
    """Read ``directory/manifest.json``; a missing one means the directory is not a finished dataset.

    The manifest must be a regular file of at most ``MAX_MANIFEST_BYTES`` (it is opened without
    blocking, so a FIFO in its place is refused rather than waited on).
    """
    path = Path(directory) / MANIFEST_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        fd = None
    except NotADirectoryError:
        raise FormatError(f"{directory}: not a directory (a packed dataset is a directory holding its "
                          f"{MANIFEST_NAME})") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot be opened ({e.strerror})") from None
    if fd is None:
        raise FormatError(
            f"{directory}: no {MANIFEST_NAME}, so this is not a finished packed dataset "
            "(never packed, or a pack that did not complete)"
        )
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # a directory, a device, a FIFO: refused before any read
        os.close(fd)
        raise FormatError(f"{path}: not a regular file")
    with open(fd, "rb", closefd=True) as f:
        if st.st_size > MAX_MANIFEST_BYTES:
            raise FormatError(f"{path}: {st.st_size} bytes, more than any manifest ({MAX_MANIFEST_BYTES})")
        text = f.read(MAX_MANIFEST_BYTES + 1)
    return Manifest.from_json(text, origin=str(path))


def file_checksum(path: str | os.PathLike, progress: Callable[[int], object] | None = None) -> str:
    """Checksum of a whole file as ``"xxh3_128:<hex>"``; ``progress`` is called with each chunk's size."""
    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
            if progress is not None:
                progress(n)
    return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}"
