"""A third encoding, written only to show that adding one is this module plus one registry line.

``test_new_container.py`` copies it into a copy of ``reader/format`` and adds it to ``registry.py``.
``png``: a lossless PNG of the RGB image, decoded by PIL into the batch row.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

from reader.format.encoding import Encoding


class PngEncoding(Encoding):
    name = "png"

    def encode(self, image: Image.Image, quality: int) -> bytes:
        out = io.BytesIO()
        image.convert("RGB").save(out, format="PNG")  # PNG has no RGBX
        return out.getvalue()

    def decode_into(self, payload: memoryview, out: np.ndarray, *, fast: bool, release_gil: bool) -> None:
        try:
            with Image.open(io.BytesIO(payload)) as img:
                pixels = np.asarray(img.convert("RGB"))
        except Exception as e:
            raise ValueError(f"not a valid png payload ({type(e).__name__}: {e})") from None
        if pixels.shape != out.shape:
            raise ValueError(f"png payload is {pixels.shape}, the record {out.shape}")
        out[...] = pixels

    def payload_problem(self, payload: bytes, height: int, width: int) -> str | None:
        try:
            self.decode_into(memoryview(payload), np.empty((height, width, 3), np.uint8), fast=False,
                             release_gil=False)
        except ValueError as e:
            return str(e)
        return None
