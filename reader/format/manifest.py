"""``manifest.json``: what a packed dataset holds, how it was made, and each shard's checksum."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import xxhash

FORMAT_NAME = "packed-images"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20


class FormatError(ValueError):
    """A dataset directory, manifest or shard does not match the format (the message names the file)."""


@dataclass(frozen=True)
class ShardInfo:
    """One shard file: its name relative to the dataset directory, record count, size and checksum."""

    file: str
    records: int
    bytes: int
    checksum: str


@dataclass
class Manifest:
    """The dataset's description. ``shape`` is ``[C, H, W]`` when every record shares it, else None.

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
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

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
        data["class_to_idx"] = self.class_to_idx
        data["num_records"] = self.num_records
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, origin: str = MANIFEST_NAME) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise FormatError(f"{origin}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise FormatError(f"{origin}: not a {FORMAT_NAME} manifest")
        if data.get("format_version") != FORMAT_VERSION:
            raise FormatError(
                f"{origin}: format version {data.get('format_version')} is not supported "
                f"(this reader reads version {FORMAT_VERSION})"
            )
        data.pop("class_to_idx", None)
        data.pop("num_records", None)
        try:
            data["shards"] = [ShardInfo(**s) for s in data["shards"]]
            return cls(**data)
        except (KeyError, TypeError) as e:
            raise FormatError(f"{origin}: malformed manifest ({e})") from None

    def write(self, directory: Path) -> Path:
        """Write the manifest atomically (temporary name, fsync, rename): the dataset's commit point."""
        path = Path(directory) / MANIFEST_NAME
        write_file_atomically(path, self.to_json().encode())
        return path


def load_manifest(directory: str | os.PathLike) -> Manifest:
    """Read ``directory/manifest.json``; a missing one means the directory is not a finished dataset."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise FormatError(
            f"{directory}: no {MANIFEST_NAME}, so this is not a finished packed dataset "
            "(never packed, or a pack that did not complete)"
        )
    return Manifest.from_json(path.read_text(), origin=str(path))


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


def fsync_directory(directory: Path) -> None:
    """Make renames inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)
