"""``raw``: uint8 RGB pixels, channel-major ``(3, H, W)``: exactly the tensor a model gets."""
from __future__ import annotations

import numpy as np
from PIL import Image

from reader.format.encoding import Encoding


class RawEncoding(Encoding):
    name = "raw"
    stores_pixels = True
    size_rule = "3*H*W bytes"

    def encode(self, image: Image.Image, quality: int) -> bytes:
        """The planes of an RGB image, or of an RGBX one (PIL's in-memory layout of RGB: the same bands)."""
        return b"".join(image.tobytes("raw", band) for band in "RGB")  # one plane per channel

    @staticmethod
    def encode_planes(planes: np.ndarray) -> bytes:
        """The payload of pixels already channel-major (a resampler's ``uint8 (3, H, W)`` output)."""
        if planes.dtype != np.uint8 or planes.ndim != 3 or planes.shape[0] != 3:
            raise ValueError(f"raw planes must be uint8 (3, H, W), got {planes.dtype} {planes.shape}")
        return np.ascontiguousarray(planes).tobytes()

    def payload_nbytes(self, height: np.ndarray, width: np.ndarray) -> np.ndarray:
        return 3 * height * width
