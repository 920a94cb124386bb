"""Every shard container and record encoding of the format, registered here and nowhere else.

Adding one is a new module with its class (``reader.format.container.Container`` or
``reader.format.encoding.Encoding``) plus one line below; FORMAT.md shows how.
"""
from __future__ import annotations

from reader.format.container import Container
from reader.format.encoding import Encoding
from reader.format.errors import FormatError
from reader.format.hdf5_shard import Hdf5Container
from reader.format.jpeg_encoding import JpegEncoding
from reader.format.lmdb_shard import LmdbContainer
from reader.format.raw_encoding import RawEncoding

_CONTAINERS: dict[str, Container] = {c.storage: c for c in (LmdbContainer(), Hdf5Container())}
_ENCODINGS: dict[str, Encoding] = {e.name: e for e in (RawEncoding(), JpegEncoding())}

STORAGES = tuple(_CONTAINERS)
ENCODINGS = tuple(_ENCODINGS)


def container(storage: str) -> Container:
    """The container registered as ``storage``; ``FormatError`` naming it when there is none."""
    try:
        return _CONTAINERS[storage]
    except KeyError:
        raise FormatError(f"unknown storage {storage!r} (expected one of {', '.join(STORAGES)})") from None


def encoding(name: str) -> Encoding:
    """The encoding registered as ``name``; ``FormatError`` naming it when there is none."""
    try:
        return _ENCODINGS[name]
    except KeyError:
        raise FormatError(f"unknown encoding {name!r} (expected one of {', '.join(ENCODINGS)})") from None


def containers() -> tuple[Container, ...]:
    """Every registered container (for the names of their files)."""
    return tuple(_CONTAINERS.values())


def shard_file_name(index: int, storage: str) -> str:
    """The file name of shard number ``index``: fixed-width, so names sort in shard order."""
    return f"shard-{index:05d}{container(storage).suffix}"
