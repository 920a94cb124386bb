"""The pre-transform: what the packer does to each image, once, before storing it.

Steps, in this order (recorded in the manifest's ``transform`` as ``steps``):

1. **open** the file with PIL. More than ``max_pixels`` pixels is a decompression bomb and an error.
2. **draft** (JPEG only, when resizing): ask libjpeg for a reduced-DCT decode at the largest scale
   (1/2, 1/4, 1/8) that still gives at least the final resize target. It only kicks in when the target
   is at least 2x smaller than the stored image. The target is computed from the image as displayed,
   so an EXIF rotation of 90/270 degrees swaps the requested width and height. JPEGs that PIL reads
   as RGB or L are decoded by libjpeg-turbo at that same scale (PIL's pixels, faster): only the
   rectangle the resize and crop read where ``packer.image.jpeg_region`` is built and applies (the PIL
   resampler, a crop inside the image, no EXIF rotation), whole through simplejpeg otherwise; PIL
   decodes everything else, and any JPEG libjpeg-turbo reports a problem with.
3. **exif_transpose**: apply the EXIF orientation tag (the transposes ``ImageOps.exif_transpose``
   applies).
4. **to_rgb**, the colour rule, giving RGB uint8:
   - modes with alpha (RGBA, RGBa, LA, La, PA) and images with a transparency key (P, L or RGB with
     ``transparency``) are composited onto white;
   - 16-bit greyscale (I;16, I;16B, I;16L, I;16N) is scaled by ``>> 8``; 32-bit integer (I) is clipped
     to 0..65535 first; float (F) is clipped to 0..255 and rounded; all three are then grey RGB;
   - every other mode (CMYK, YCbCr, LAB, HSV, 1, L, P) goes through PIL's ``convert("RGB")`` (LAB
     needs a PIL built with littlecms; without it a LAB file is reported as unreadable).
5. **resize**, when asked: either the shorter side to N with the aspect kept (the longer side is
   ``int(N * long / short)``, as torchvision), or to exactly W x H; bilinear filter, antialiased when
   downscaling (PIL's ``resize``). The ``resampler`` says who computes it (``packer.image.resampling``):
   ``"pil"`` (the default with pillow-simd) or ``"torch"`` (the default with plain Pillow: torch's
   uint8 antialiased bilinear ``interpolate``, within one grey level of the PIL path, twice as fast
   as plain Pillow); the manifest records which, with its version.
6. **center_crop**, when asked, to W x H with torchvision's rounding
   (``top = int(round((h - ch) / 2.0))``). With a resize and the PIL resampler, the two steps are
   fused: PIL resamples only
   the source box that the crop keeps (``resize(crop_size, box=...)``), the same filter centred on the
   same source points, so a third less work; filter weights are rounded per output size, which moves
   about 1 pixel in 2,000 by one grey level against resize-then-crop. An image smaller than the crop
   is padded with black on both sides, as torchvision does (resized in full, then cropped).
7. **encode**: by the manifest's encoding (``reader.format.encoding``): ``raw`` is the uint8 pixels
   channel-major ``(3, H, W)``; ``jpeg`` is a baseline 4:2:0 JFIF JPEG at the given quality.
"""
from __future__ import annotations

import io
import os
import re
import stat
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import simplejpeg
from PIL import Image

from packer.image import jpeg_region
from packer.image.resampling import RESAMPLERS, resampler_library, torch_resize
from reader.format import ENCODINGS, encoding
from reader.format.raw_encoding import RawEncoding

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
DEFAULT_MAX_PIXELS = 89_478_485  # PIL's own default for Image.MAX_IMAGE_PIXELS
# Source files larger than this are refused: a photo is rarely over 100 MB, and a link to a huge file
# would otherwise be read whole into memory.
DEFAULT_MAX_FILE_BYTES = 1 << 30
STEPS = ("open", "draft", "exif_transpose", "to_rgb", "resize", "center_crop", "encode")
COLOUR_RULES = {
    "alpha": "RGBA, RGBa, LA, La, PA and images with a transparency key are composited onto white",
    "16-bit": "I;16, I;16B, I;16L, I;16N are scaled by >> 8 to grey",
    "I": "clipped to 0..65535, then >> 8 to grey",
    "F": "clipped to 0..255 and rounded to grey",
    "other": "PIL convert('RGB') (CMYK, YCbCr, LAB, HSV, 1, L, P)",
}

_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}
_WHITE = (255, 255, 255)
_EXIF_ORIENTATION = 0x0112
# EXIF orientation -> the transpose that shows the image upright (ImageOps.exif_transpose's table);
# orientations 5 to 8 swap width and height.
_ORIENTATION_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_TURBO_COLOURSPACES = ("RGB", "L")
T = TypeVar("T")


@dataclass(frozen=True)
class TransformSpec:
    """What to do to every image.

    Sizes follow torchvision: ``(height, width)``. (The CLI's ``WxH`` strings and the manifest's
    ``size`` lists are width first, as PIL and image tools write sizes; ``packer.cli`` and
    ``describe``/``from_description`` convert.)

    ``resize``: None, an int (shorter side to N, aspect kept) or ``(height, width)`` (exact size).
    ``crop``: None, an int (square) or ``(height, width)``: a center crop applied after the resize.
    ``max_pixels``: images larger than this are refused as decompression bombs.
    ``max_file_bytes``: source files larger than this are refused before they are read.
    ``resampler``: ``"pil"`` or ``"torch"``, who computes the resize (``packer.image.resampling``).
    """

    resize: int | tuple[int, int] | None = None
    crop: int | tuple[int, int] | None = None
    encoding: str = "raw"
    quality: int = 90
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    resampler: str = "pil"

    def __post_init__(self) -> None:
        _check_size("resize", self.resize)
        _check_size("crop", self.crop)
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding {self.encoding!r} is not one of {', '.join(ENCODINGS)}")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"quality {self.quality} is not between 1 and 100")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels {self.max_pixels} must be positive")
        if self.max_file_bytes < 1:
            raise ValueError(f"max_file_bytes {self.max_file_bytes} must be positive")
        if self.resampler not in RESAMPLERS:
            raise ValueError(f"resampler {self.resampler!r} is not one of {', '.join(RESAMPLERS)}")

    @property
    def crop_size(self) -> tuple[int, int] | None:
        """The crop as ``(height, width)``, or None."""
        return _as_pair(self.crop)

    @property
    def fixed_size(self) -> tuple[int, int] | None:
        """``(height, width)`` every output has, when the spec fixes it (a crop or an exact resize)."""
        if self.crop is not None:
            return self.crop_size
        if isinstance(self.resize, tuple):
            return self.resize
        return None

    @property
    def pil_resize(self) -> Any:
        """``resize`` in PIL's order: an int, or ``(width, height)``."""
        return _width_first(self.resize) if isinstance(self.resize, tuple) else self.resize

    @property
    def pil_crop(self) -> tuple[int, int] | None:
        """The crop in PIL's order, ``(width, height)``, or None."""
        return _width_first(self.crop_size)

    @classmethod
    def from_description(cls, transform: dict[str, Any]) -> TransformSpec:
        """The resize and crop of a manifest's ``transform`` (what ``describe`` wrote), to redo them."""
        resize, crop = transform.get("resize"), transform.get("crop")
        return cls(
            resize=None if resize is None else resize.get("shorter_side") or _width_first(resize["size"]),
            crop=None if crop is None else _width_first(crop["size"]),
            resampler=transform.get("resampler", "pil"),
        )

    def describe(self) -> dict[str, Any]:
        """The spec as the manifest's ``transform`` object: the steps, their parameters and the rules."""
        resize: dict[str, Any] | None = None
        if isinstance(self.resize, int):
            resize = {"shorter_side": self.resize}
        elif self.resize is not None:
            resize = {"size": list(self.pil_resize)}  # width first, as PIL writes sizes
        crop = self.pil_crop
        return {
            "steps": list(STEPS),
            "max_pixels": self.max_pixels,
            "draft": "JPEG reduced-DCT decode when the resize target is at least 2x smaller",
            "exif_transpose": True,
            "colour": dict(COLOUR_RULES),
            "resize": resize,
            "filter": "bilinear",
            "antialias": True,
            "resampler": self.resampler,
            "resampler_library": resampler_library(self.resampler),
            "crop": None if crop is None else {
                "size": list(crop), "rounding": "torchvision", "pad": 0,
                "fused_with_resize": "only the kept source box is resampled" if self.resampler == "pil"
                else "no: the whole image is resized, then cropped",
            },
            "encoding": self.encoding,
        }


def resize_target(width: int, height: int, resize: int | tuple[int, int] | None) -> tuple[int, int]:
    """The ``(width, height)`` an image of ``width x height`` is resized to (torchvision's rule for the
    shorter side); ``resize`` in PIL's order (``TransformSpec.pil_resize``)."""
    if resize is None:
        return width, height
    if isinstance(resize, tuple):
        return resize
    if width <= height:
        return resize, int(resize * height / width)
    return int(resize * width / height), resize


def center_crop_box(width: int, height: int, crop: tuple[int, int]) -> tuple[int, int, int, int]:
    """The ``(left, top, right, bottom)`` box of a torchvision center crop of ``crop = (width, height)``
    (PIL's order); negative means padding."""
    crop_width, crop_height = crop
    left = _crop_start(width, crop_width)
    top = _crop_start(height, crop_height)
    return left, top, left + crop_width, top + crop_height


def _crop_box(
    target: tuple[int, int], crop: tuple[int, int] | None
) -> tuple[tuple[int, int, int, int] | None, bool]:
    """The center crop's box in an image of size ``target`` (None without a crop), and whether it lies
    inside the image (else the crop pads)."""
    box = None if crop is None else center_crop_box(*target, crop)
    inside = box is not None and box[0] >= 0 and box[1] >= 0 and box[2] <= target[0] and box[3] <= target[1]
    return box, inside


def resize_and_crop(
    img: Image.Image, target: tuple[int, int], crop: tuple[int, int] | None, resampler: str = "pil"
) -> Image.Image:
    """Resize ``img`` to ``target`` then center-crop it to ``crop``. The PIL resampler resamples only
    the kept box; torch resizes the whole image, then it is cropped."""
    box, inside = _crop_box(target, crop)
    if resampler == "torch" and img.size != target:
        pixels = torch_resize(img, target, box if inside else None)
        out = Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy(), "RGB")
        return out if inside or box is None else out.crop(box)  # a crop larger than the image pads
    if not inside or box is None or crop is None:  # (no crop, or one that pads)
        out = img if img.size == target else img.resize(target, Image.Resampling.BILINEAR)
        return out if box is None else out.crop(box)
    if img.size == target:
        return img.crop(box)
    sx, sy = img.width / target[0], img.height / target[1]
    return img.resize(crop, Image.Resampling.BILINEAR, box=(box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy))


ImageSource = str | Path | bytes | Image.Image
"""Where an image comes from: a file path, a file's bytes, or a PIL image already in memory."""


def load_image(source: ImageSource, spec: TransformSpec) -> Image.Image:
    """Open ``source`` and apply the steps up to the crop: an RGB image of the final size.

    Raises whatever PIL raises for a bad file (``OSError``, ``SyntaxError``, ...), the
    ``DecompressionBombWarning`` (as an error) or ``DecompressionBombError`` for an image larger than
    ``max_pixels``, and ``ValueError`` for a zero-size image; the caller turns these into file errors.
    """
    return _load(source, spec, _resized_image)


def load_record(source: ImageSource, spec: TransformSpec) -> tuple[bytes, int, int]:
    """``load_image`` then the spec's encoding: ``(payload, height, width)``, the same bytes as
    ``encoding(spec.encoding).encode(load_image(source, spec), spec.quality)``, with two shortcuts: the
    encoding gets the RGBX image the fast JPEG decode gives (PIL's in-memory layout of RGB, whose
    conversion to RGB costs 0.04-0.05 ms an image), and with the torch resampler a raw payload comes
    straight from the resized tensor, skipping a PIL image (0.2-0.3 ms an image here)."""
    return _load(source, spec, _record)


def _load(
    source: ImageSource, spec: TransformSpec,
    finish: Callable[[Image.Image, Image.Image, tuple[int, int], TransformSpec], T],
) -> T:
    """Open ``source``, apply the steps up to the colour rule, and hand the upright RGB(X) image to
    ``finish(image, opened, resize target, spec)`` while the opened file is still open. A PIL image
    in memory takes the same steps (its EXIF orientation too) but has no file to draft from."""
    if isinstance(source, Image.Image):
        if source.width * source.height > spec.max_pixels:
            raise Image.DecompressionBombError(_over_pixel_limit(f"{source.width}x{source.height} pixels",
                                                                spec.max_pixels))
        return _upright(source, b"", spec, finish)
    data = source if isinstance(source, bytes) else read_source_file(source, spec.max_file_bytes)
    with _pixel_limit(spec.max_pixels), Image.open(io.BytesIO(data)) as img:
        return _upright(img, data, spec, finish)


def _upright(
    img: Image.Image, data: bytes, spec: TransformSpec,
    finish: Callable[[Image.Image, Image.Image, tuple[int, int], TransformSpec], T],
) -> T:
    width, height = img.size
    if width == 0 or height == 0:
        raise ValueError(f"zero-size image ({width}x{height})")
    orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
    rotated = orientation in _ORIENTATION_TRANSPOSE and orientation >= 5
    target = resize_target(*((height, width) if rotated else (width, height)), spec.pil_resize)
    draft = None if spec.resize is None else (target[1], target[0]) if rotated else target
    out = _decode(img, data, draft, _kept(target, spec) if orientation not in _ORIENTATION_TRANSPOSE else None)
    if orientation in _ORIENTATION_TRANSPOSE:
        out = out.transpose(_ORIENTATION_TRANSPOSE[orientation])
    return finish(to_rgb(out), img, target, spec)


def _resized_image(
    out: Image.Image, opened: Image.Image, target: tuple[int, int], spec: TransformSpec
) -> Image.Image:
    out = resize_and_crop(out, target, spec.pil_crop, spec.resampler)
    if out.mode == "RGBX":
        return out.convert("RGB")
    return opened.copy() if out is opened else out


def _record(
    out: Image.Image, opened: Image.Image, target: tuple[int, int], spec: TransformSpec
) -> tuple[bytes, int, int]:
    box, inside = _crop_box(target, spec.pil_crop)
    if spec.encoding == "raw" and spec.resampler == "torch" and out.size != target and (inside or box is None):
        pixels = torch_resize(out, target, box)  # (3, H, W)
        return RawEncoding.encode_planes(pixels.numpy()), pixels.shape[1], pixels.shape[2]
    image = resize_and_crop(out, target, spec.pil_crop, spec.resampler)  # RGB or RGBX
    return encoding(spec.encoding).encode(image, spec.quality), image.height, image.width


class SourceFileError(OSError):
    """A source file that is not one to read: not a regular file, or over the size limit."""


def read_source_file(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``; anything else raises ``OSError``.

    Opened without blocking and checked with ``fstat``: a FIFO or device put in place of an image
    (even after the scan) is refused instead of blocking the pack or being read without end.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    with open(fd, "rb", closefd=True) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SourceFileError("not a regular file")
        if st.st_size > max_bytes:
            raise SourceFileError(f"file is {st.st_size} bytes, over the limit of {max_bytes} (--max-file-size)")
        # Ask for what fstat says plus one byte, which shows a file still growing: asking for the
        # limit would allocate the limit (1 GiB by default) for every file, an mmap and munmap each.
        data = f.read(st.st_size + 1)
        if len(data) > st.st_size:
            data += f.read(max_bytes + 1 - len(data))
    if len(data) > max_bytes:
        raise SourceFileError(f"file grew past the limit of {max_bytes} bytes while it was read")
    return data


def _kept(target: tuple[int, int], spec: TransformSpec) -> tuple[tuple[int, int], tuple[int, int, int, int]] | None:
    """``(target, crop box)`` when the resize to ``target`` reads only part of the image: the PIL
    resampler with a center crop inside the target (``resize_and_crop``'s fused path); else None."""
    box, inside = _crop_box(target, spec.pil_crop)
    return (target, box) if spec.resampler == "pil" and inside and box is not None else None


def _decode(
    img: Image.Image, data: bytes, draft: tuple[int, int] | None,
    kept: tuple[tuple[int, int], tuple[int, int, int, int]] | None = None,
) -> Image.Image:
    """The pixels of the opened ``img`` (whose file bytes are ``data``), at a reduced JPEG scale
    when ``draft`` asks for it.

    A JPEG that PIL reads as RGB or L is decoded straight from its bytes by libjpeg-turbo, at exactly
    the scale PIL's ``draft`` would pick: the same pixels as PIL, without PIL's chunked decoding. When
    ``kept`` says the resize to ``target`` then reads only ``crop box`` of it (``_kept``), only the
    source rectangle that reads is decoded (``packer.image.jpeg_region``, where it is built; the other pixels
    are never read); otherwise simplejpeg decodes it whole. Colour comes out as RGBX, PIL's own memory
    layout for RGB, wrapped without a copy; the caller turns it into RGB once the image is small. When
    libjpeg-turbo reports any problem with the data, PIL decodes it instead and has the last word on
    whether the file is readable.
    """
    if img.format == "JPEG" and img.mode in _TURBO_COLOURSPACES:
        scale = _draft_scale(img.size, draft)
        size = (-(-img.width // scale), -(-img.height // scale))
        pixels = _turbo_decode(data, img.mode == "L", scale, size, kept)
        if pixels is not None and pixels.shape[:2] == (size[1], size[0]):
            mode = "L" if img.mode == "L" else "RGBX"
            return Image.frombuffer(mode, size, pixels, "raw", mode, 0, 1)
    if img.format == "JPEG" and draft is not None:
        img.draft("RGB", draft)
    img.load()
    return img


def _turbo_decode(
    data: bytes, gray: bool, scale: int, size: tuple[int, int],
    kept: tuple[tuple[int, int], tuple[int, int, int, int]] | None,
) -> np.ndarray | None:
    """libjpeg-turbo's decode of ``data`` at ``1/scale`` (an image of ``size``): only the rectangle
    ``kept`` needs where it is smaller than the image and the region decoder is available, else whole;
    None when libjpeg-turbo reports a problem."""
    try:
        if kept is not None and jpeg_region.available(simplejpeg.decode_jpeg_header(data)[3]):
            box = jpeg_region.source_box(size, *kept)
            if box != (0, 0, *size):
                return jpeg_region.decode(data, gray, scale, size, box)
        return simplejpeg.decode_jpeg(
            data, colorspace="GRAY" if gray else "RGBX", min_width=size[0], min_height=size[1]
        )
    except ValueError:
        return None


def _draft_scale(size: tuple[int, int], draft: tuple[int, int] | None) -> int:
    """The JPEG scale denominator PIL's ``draft`` picks: the largest of 8, 4, 2 leaving ``draft`` whole."""
    if draft is None:
        return 1
    fits = min(size[0] // draft[0], size[1] // draft[1])
    return next((s for s in (8, 4, 2) if fits >= s), 1)


@contextmanager
def _pixel_limit(max_pixels: int) -> Iterator[None]:
    """PIL's decompression-bomb limit set to ``max_pixels``, its warning raised as an error, and what
    either says put in this limit's terms (``_over_pixel_limit``): PIL raises its error past twice the
    limit and names that, so ``--max-pixels 1000`` would otherwise read "exceeds limit of 2000"."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                yield
            except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
                size = re.search(r"Image size \((\d+) pixels\)", str(e))
                raise Image.DecompressionBombError(_over_pixel_limit(
                    f"{size.group(1)} pixels" if size else "more pixels", max_pixels)) from None
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _over_pixel_limit(size: str, max_pixels: int) -> str:
    """The message for an image of ``size`` ("WxH pixels") refused by the ``max_pixels`` limit."""
    return f"image of {size}, over the limit of {max_pixels} (--max-pixels)"


def to_rgb(img: Image.Image) -> Image.Image:
    """The colour rule (see the module docstring): any PIL mode to RGB uint8.

    RGBX (PIL's in-memory layout of RGB, as the fast JPEG decode delivers it) is left as it is: the
    caller converts it to RGB once the image has been resized and cropped.
    """
    if img.mode in ("RGB", "RGBX") and "transparency" not in img.info:
        return img
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("LA").convert("RGBA") if img.mode == "La" else img.convert("RGBA")
        background = Image.new("RGB", img.size, _WHITE)
        background.paste(rgba, mask=rgba)
        return background
    if img.mode.startswith("I;16") or img.mode == "I":
        pixels = np.clip(np.asarray(img), 0, 65535).astype(np.uint32) >> 8
        return _grey_to_rgb(pixels.astype(np.uint8))
    if img.mode == "F":
        return _grey_to_rgb(np.rint(np.clip(np.asarray(img), 0, 255)).astype(np.uint8))
    return img.convert("RGB")


def _grey_to_rgb(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(pixels).convert("RGB")


def _crop_start(size: int, crop: int) -> int:
    if crop > size:
        return -((crop - size) // 2)
    return int(round((size - crop) / 2.0))


def _width_first(size: tuple[int, int] | list[int] | None) -> tuple[int, int] | None:
    """A size pair with its two sides swapped: ``(height, width)`` <-> ``(width, height)``."""
    return None if size is None else (size[1], size[0])


def _as_pair(size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    if isinstance(size, int):
        return size, size
    return size


def _check_size(name: str, size: object) -> None:
    pair_ok = isinstance(size, tuple) and len(size) == 2 and all(map(_is_positive_int, size))
    if size is not None and not _is_positive_int(size) and not pair_ok:
        raise ValueError(f"{name} {size!r} must be a positive int or a (height, width) pair of them")


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
