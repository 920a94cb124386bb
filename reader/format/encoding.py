"""What a record encoding is: the base class every payload encoding (raw, JPEG, ...) implements.

An ``Encoding`` owns both directions for its payloads: ``encode`` (the packer's last step, from the
pre-transformed RGB image), the reader's decode into a batch row, the payload size its records must
have (checked in every record table), and the deeper check ``packer verify --deep`` makes of each
payload. The encodings are registered in ``reader.format.registry``.
"""
from __future__ import annotations

import abc

import numpy as np
from PIL import Image


class Encoding(abc.ABC):
    """One payload encoding. ``stores_pixels``: the payload already is the ``(3, H, W)`` uint8 tensor,
    so the reader reads it straight into the batch and never calls ``decode_into``."""

    name: str
    stores_pixels: bool = False
    size_rule: str = ""  # the payload size ``payload_nbytes`` fixes, for people (e.g. "3*H*W bytes")

    @abc.abstractmethod
    def encode(self, image: Image.Image, quality: int) -> bytes:
        """The payload of an RGB image (``quality`` is used by lossy encodings only). The image is PIL
        mode ``RGB`` or ``RGBX`` (PIL's in-memory layout of RGB, the same three bands, which the packer's
        JPEG decode gives): an encoding whose library cannot take ``RGBX`` converts it."""

    def decode_into(self, payload: memoryview, out: np.ndarray, *, fast: bool, release_gil: bool) -> None:
        """Decode a payload into ``out``, a C-contiguous ``uint8 (H, W, 3)`` array of the record's size;
        ``ValueError`` when it is not a valid payload of that size."""
        raise TypeError(f"{self.name} payloads are pixels already: read them, there is nothing to decode")

    def payload_nbytes(self, height: np.ndarray, width: np.ndarray) -> np.ndarray | None:
        """The payload size records of these sizes must have, or None when it varies (compressed)."""
        return None

    def payload_problem(self, payload: bytes, height: int, width: int) -> str | None:
        """What is wrong with one payload beyond its size, or None (``packer verify --deep``)."""
        return None
