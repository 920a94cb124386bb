"""``PackOptions``: every setting that decides a dataset's bytes, with its default and its checks, once.

``pack``, ``pack_items``, ``append`` and the command line build one and pass it on; the pre-transform it
implies (``transform``), the part of a pack's fingerprint it decides (``fingerprint``) and the manifest
draft (``manifest_draft``) all come from here, and ``from_manifest`` reads a finished dataset's back (what
``--append`` packs with). Adding a setting means a field here, its check in ``__post_init__``, and its
command-line option. What does not decide the bytes (workers, progress, ``on_error``, ``force``) is an
argument of the verbs, not an option here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from packer.errors import PackError
from packer.image.resampling import default_resampler
from packer.image.transforms import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS, TransformSpec
from packer.version import __version__
from reader.format import STORAGES, Manifest

DEFAULT_QUALITY = 90
DEFAULT_SHARD_SIZE = 512 << 20


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """How a dataset is packed.

    ``storage``: the shard container (``lmdb``, ``hdf5``). ``resize``, ``crop``: an int (shorter side /
    square) or ``(height, width)``, as torchvision (``packer.image.transforms``). ``encoding``: ``raw`` or
    ``jpeg``; ``quality``: the JPEG quality (used by ``jpeg`` only; the CLI refuses ``--quality`` without
    it). ``shard_size``: each shard's payload bytes at most. ``max_pixels``, ``max_file_bytes``: larger
    images or source files are refused. ``resampler``: ``pil`` or ``torch``; None is
    ``packer.image.resampling``'s default for this install. Raises ``PackError`` naming the first setting that
    is out of range.
    """

    storage: str = "lmdb"
    resize: int | tuple[int, int] | None = None
    crop: int | tuple[int, int] | None = None
    encoding: str = "raw"
    quality: int = DEFAULT_QUALITY
    shard_size: int = DEFAULT_SHARD_SIZE
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    resampler: str | None = None

    def __post_init__(self) -> None:
        if self.resampler is None:
            try:
                object.__setattr__(self, "resampler", default_resampler())
            except ValueError as e:  # PACKER_RESAMPLER names none
                raise PackError(str(e)) from None
        if self.storage not in STORAGES:
            raise PackError(f"storage {self.storage!r} is not one of {', '.join(STORAGES)}")
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) or self.shard_size < 1:
            raise PackError(f"shard_size {self.shard_size!r} must be a positive number of bytes")
        self.transform  # its settings are checked now, not at the first image

    @classmethod
    def of(cls, options: PackOptions | None, settings: Mapping[str, Any], caller: str) -> PackOptions:
        """``options`` with ``settings`` (keyword arguments named like the fields) applied: what the
        verbs' keyword APIs take. An unknown name is a ``TypeError`` naming ``caller``, as Python's own."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
        return dataclasses.replace(options or cls(), **settings) if settings else options or cls()

    @classmethod
    def from_manifest(cls, manifest: Manifest, shard_size: int = DEFAULT_SHARD_SIZE) -> PackOptions:
        """The options ``manifest``'s dataset was packed with (its shard size is not recorded: given)."""
        spec = TransformSpec.from_description(manifest.transform)
        return cls(storage=manifest.storage, resize=spec.resize, crop=spec.crop, encoding=manifest.encoding,
                   quality=manifest.jpeg_quality or DEFAULT_QUALITY, shard_size=shard_size,
                   max_pixels=manifest.transform.get("max_pixels", DEFAULT_MAX_PIXELS), resampler=spec.resampler)

    @property
    def transform(self) -> TransformSpec:
        """The pre-transform these options imply."""
        try:
            return TransformSpec(self.resize, self.crop, self.encoding, self.quality, self.max_pixels,
                                 self.max_file_bytes, resampler=str(self.resampler))
        except ValueError as e:
            raise PackError(str(e)) from None

    def fingerprint(self) -> dict[str, Any]:
        """What these options add to a pack's fingerprint (``packer.run.journal.plan_fingerprint``)."""
        return {"storage": self.storage, "shard_size": self.shard_size,
                "transform": dataclasses.asdict(self.transform)}

    def manifest_draft(self, classes: list[str], source: dict[str, Any], fields: list[dict[str, Any]],
                       labelled: bool) -> dict[str, Any]:
        """The manifest's keys that a pack knows before its shards are written."""
        spec = self.transform
        fixed = spec.fixed_size
        return {
            "storage": self.storage, "encoding": spec.encoding, "shape": None if fixed is None else [3, *fixed],
            "classes": classes, "transform": spec.describe(), "source": source, "tool_version": __version__,
            "jpeg_quality": spec.quality if spec.encoding == "jpeg" else None, "fields": fields,
            "labelled": labelled,
        }
