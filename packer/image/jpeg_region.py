"""Decode only the part of a JPEG that the resize and center crop will read.

With ``--resize 256 --crop 224`` a 4:3 photo loses a third of its columns to the crop (a 16:9 one
nearly half), yet a whole decode reconstructs every pixel. The optional C extension
``packer.image._jpeg_region`` (``setup.py``) has libjpeg-turbo reconstruct only a rectangle: columns outside
it skip the inverse DCT, chroma upsampling and colour conversion, rows above and below it are only
entropy-decoded. (The rows below are still read to the end of the data so that a file cut short or
damaged there is refused exactly as a whole decode refuses it.) Measured here on the benchmark's
ImageNet-like photos (``scripts/bench_pack.py``), where the rectangle is 63% of the pixels on average:
0.86 -> 0.79 ms of CPU an image for the decode, -0.06 ms for the whole pack (BENCHMARKS.md, Packing).

The pixels are those of a whole decode. The rectangle is the source box the PIL resize reads
(``transforms.resize_and_crop``: every output pixel reads its source within ``support = max(scale, 1)``
of its centre) widened by ``MARGIN`` pixels, because libjpeg-turbo's smooth chroma upsampling treats
the rectangle's own edge as an image edge: its outermost column can differ from a whole decode, and is
never read. The pixels outside the rectangle are left unwritten and are never read either:
``tests/packer/test_jpeg_region.py`` decodes into buffers filled with 0 and with 255 and gets the same
records as a whole decode, for 4:4:4, 4:2:2 and 4:2:0, progressive files, greyscale and reduced scales;
4:4:0 and 4:1:1 files are decoded whole (``available``).

Where the extension was not built (no compiler or no libjpeg-turbo headers), or its first decode does
not give the pixels simplejpeg gives for the same file (another libjpeg version), ``available()`` is
False and callers decode whole files: same output, slower.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import simplejpeg

MARGIN = 4  # pixels beyond the resize's support: more than the 1-2 edge columns upsampling may change
REGION_SUBSAMPLINGS = ("444", "422", "420", "Gray")  # decoded by region where they agree (``available``)
_checked: bool | None = None  # built, and agrees on 4:2:0 (False: callers decode whole files)
_agreeing: dict[str, bool] = {}  # each subsampling asked about, once ``_checked``


def _extension() -> Any:
    try:
        from packer.image import _jpeg_region  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _jpeg_region


def available(subsampling: str = "420") -> bool:
    """Whether the region decoder is built and gives simplejpeg's pixels for JPEGs of this chroma
    ``subsampling`` (as ``simplejpeg.decode_jpeg_header`` names it), checked once a process and once
    per subsampling. Only ``REGION_SUBSAMPLINGS``: on the lent GPU machine's system libjpeg-turbo the
    region decode of a 4:4:0 photo differed from simplejpeg's whole decode although a small test image
    agreed (cause not established), so 4:4:0 and 4:1:1 files, rare (PIL writes neither), are decoded
    whole everywhere, and the packer's records never depend on the machine's libjpeg."""
    global _checked
    if _checked is None:
        _checked = _extension() is not None and _agrees_with_simplejpeg("420")
    if not _checked or subsampling not in REGION_SUBSAMPLINGS:
        return False
    if subsampling not in _agreeing:
        _agreeing[subsampling] = _agrees_with_simplejpeg(subsampling)
    return _agreeing[subsampling]


def source_box(
    size: tuple[int, int], target: tuple[int, int], crop_box: tuple[int, int, int, int]
) -> tuple[int, int, int, int]:
    """The ``(left, top, right, bottom)`` of an image of ``size = (width, height)`` that resizing it to
    ``target`` and keeping ``crop_box`` (in ``target``'s pixels) reads, with ``MARGIN``, inside the image."""
    scale_x, scale_y = size[0] / target[0], size[1] / target[1]
    reach_x = math.ceil(max(scale_x, 1.0)) + MARGIN
    reach_y = math.ceil(max(scale_y, 1.0)) + MARGIN
    return (
        max(0, math.floor(crop_box[0] * scale_x) - reach_x),
        max(0, math.floor(crop_box[1] * scale_y) - reach_y),
        min(size[0], math.ceil(crop_box[2] * scale_x) + reach_x),
        min(size[1], math.ceil(crop_box[3] * scale_y) + reach_y),
    )


def decode(
    data: bytes, gray: bool, scale: int, size: tuple[int, int], box: tuple[int, int, int, int]
) -> np.ndarray:
    """The JPEG ``data`` decoded at ``1/scale`` (whose image is ``size = (width, height)``) as a
    ``(height, width, 4)`` RGBX array (``(height, width)`` when ``gray``) of which only ``box`` is
    written (and the last row); the rest is uninitialised memory. Raises ``ValueError`` on any libjpeg
    error or warning."""
    shape = (size[1], size[0]) if gray else (size[1], size[0], 4)
    out = np.empty(shape, np.uint8)
    _extension().decode(data, gray, scale, *box, out)
    return out


def _agrees_with_simplejpeg(subsampling: str) -> bool:
    """Decode a small test image of this chroma ``subsampling``, cut to a box at odd offsets, both
    ways: same pixels?"""
    y, x = np.mgrid[0:48, 0:80]
    pattern = np.stack([(x * 7 + y * 3) % 256, (x * y) % 256, (x * 11 - y * 5) % 256], axis=-1).astype(np.uint8)
    gray = subsampling == "Gray"
    if gray:
        data = simplejpeg.encode_jpeg(np.ascontiguousarray(pattern[:, :, :1]), quality=90, colorspace="GRAY")
    else:
        data = simplejpeg.encode_jpeg(pattern, quality=90, colorspace="RGB", colorsubsampling=subsampling)
    whole = simplejpeg.decode_jpeg(data, colorspace="GRAY" if gray else "RGBX")
    left, top, right, bottom = 21, 9, 59, 37
    part = np.empty((48, 80) if gray else (48, 80, 4), np.uint8)
    try:
        _extension().decode(data, gray, 1, left - MARGIN, top - MARGIN, right + MARGIN, bottom + MARGIN, part)
    except ValueError:
        return False
    if gray:
        whole = whole.reshape(part.shape)
    return bool(np.array_equal(part[top:bottom, left:right], whole[top:bottom, left:right]))
