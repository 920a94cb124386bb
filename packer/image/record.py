"""One source file to one record: the pre-transform and the encoding, or why the file cannot be packed.

Each image becomes an ``Encoded`` payload or a ``Failure`` naming why it could not be read; the caller
decides whether a failure stops the pack.
"""
from __future__ import annotations

from typing import NamedTuple

from PIL import Image

from packer.image.transforms import ImageSource, SourceFileError, TransformSpec, load_record


class Encoded(NamedTuple):
    """One image's record payload and its size."""

    payload: bytes
    height: int
    width: int


class Failure(NamedTuple):
    """Why one image could not be packed."""

    reason: str


def encode_image(source: ImageSource, spec: TransformSpec) -> Encoded | Failure:
    """Apply the pre-transform and the encoding to one image (a file, its bytes or a PIL image).

    Whatever exception reading a broken file makes PIL raise (it is not limited to ``OSError``) is that
    file's ``Failure``, so that one bad file can be skipped rather than stop the whole pack.
    """
    try:
        return Encoded(*load_record(source, spec))
    except Exception as e:
        return Failure(describe_failure(e))


def describe_failure(error: Exception) -> str:
    """A short reason for a file that could not be packed, from the exception reading it raised."""
    message = str(error)
    if isinstance(error, SourceFileError):
        return message
    if isinstance(error, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return f"decompression bomb ({message})"
    if isinstance(error, Image.UnidentifiedImageError):
        return "not an image, or an unsupported image format"
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return f"unreadable file ({error.strerror})"
    lowered = message.lower()
    if "truncated" in lowered or "broken data stream" in lowered or isinstance(error, EOFError):
        return f"truncated or corrupt image ({message or type(error).__name__})"
    return f"cannot decode image ({type(error).__name__}: {message})"
