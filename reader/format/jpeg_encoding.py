"""``jpeg``: a baseline 4:2:0 JFIF JPEG of the RGB image, decoded by libjpeg-turbo (``reader.format.jpeg_decode``)."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

from reader.format.encoding import Encoding
from reader.format.jpeg_decode import decode_jpeg_into


class JpegEncoding(Encoding):
    name = "jpeg"

    def encode(self, image: Image.Image, quality: int) -> bytes:
        """PIL's JPEG writer takes RGBX as it is (the same bytes as from the RGB image)."""
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=quality, subsampling="4:2:0", optimize=False, progressive=False)
        return out.getvalue()

    def decode_into(self, payload: memoryview, out: np.ndarray, *, fast: bool, release_gil: bool) -> None:
        decode_jpeg_into(payload, out, fast=fast, release_gil=release_gil)

    def payload_problem(self, payload: bytes, height: int, width: int) -> str | None:
        """Decoded by PIL, an independent decoder, to the recorded size."""
        try:
            with Image.open(io.BytesIO(payload)) as img:
                img.load()
                size = img.size
        except Exception as e:
            return f"JPEG does not decode ({type(e).__name__}: {e})"
        if size != (width, height):
            return f"JPEG decodes to {size[0]}x{size[1]}, the table says {width}x{height}"
        return None
