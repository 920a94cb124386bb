"""The region decode (packer.image.jpeg_region): only the rectangle the resize reads is decoded, and the
records are exactly those of a whole decode and of plain PIL."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
from pack_helpers import reference_pixels, smooth_rgb
from PIL import Image

from packer.image import jpeg_region
from packer.image.record import Failure, encode_image
from packer.image.transforms import TransformSpec, load_image, load_record

needs_region = pytest.mark.skipif(
    not jpeg_region.available(), reason="packer.image._jpeg_region is not built (no compiler or libjpeg-turbo headers)"
)

# (width, height, save options): every chroma subsampling (4:4:0 and 4:1:1, which PIL does not write,
# by simplejpeg), progressive, greyscale, odd sizes, a 16:9 photo, a portrait one, and one big enough
# for the 1/2-scale draft decode.
CASES = [
    (500, 375, {"subsampling": 2}),
    (500, 375, {"subsampling": 1}),
    (500, 375, {"subsampling": 0}),
    (333, 500, {"subsampling": 2, "progressive": True}),
    (641, 360, {"subsampling": 2}),
    (257, 256, {"subsampling": 2}),
    (1103, 811, {"subsampling": 2}),
    (471, 353, {"grey": True}),
    (500, 375, {"simplejpeg": "440"}),
    (375, 500, {"simplejpeg": "411"}),
]


def _photo(path: Path, width: int, height: int, options: dict[str, Any], seed: int) -> Path:
    rng = np.random.default_rng(seed)
    pixels = smooth_rgb(width, height, seed).astype(int) + rng.integers(-25, 26, (height, width, 3))
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    options = dict(options)
    if options.pop("grey", False):
        img = img.convert("L")
    if "simplejpeg" in options:
        path.write_bytes(simplejpeg.encode_jpeg(np.asarray(img), 90, "RGB", options["simplejpeg"]))
    else:
        img.save(path, quality=90, **options)
    return path


@pytest.fixture
def whole_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode whole files, as where the extension is not built."""
    monkeypatch.setattr(jpeg_region, "_checked", False)


@needs_region
@pytest.mark.parametrize("case", range(len(CASES)))
def test_region_decode_gives_the_records_of_a_whole_decode_and_of_plain_pil(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: int
) -> None:
    width, height, options = CASES[case]
    path = _photo(tmp_path / "a.jpg", width, height, options, seed=case)
    spec = TransformSpec(resize=256, crop=224)
    calls: list[tuple[int, int, int, int]] = []
    decode = jpeg_region.decode
    monkeypatch.setattr(jpeg_region, "decode", lambda *args: calls.append(args[4]) or decode(*args))
    region_raw, region_image = load_record(path, spec), np.asarray(load_image(path, spec))
    if options.get("simplejpeg") in ("440", "411"):
        assert calls == []  # decoded whole everywhere (jpeg_region.available)
    else:
        box = calls[0]
        size = (width, height) if width < 1000 else ((width + 1) // 2, (height + 1) // 2)
        assert len(calls) == 2 and (box[2] - box[0]) * (box[3] - box[1]) < 0.9 * size[0] * size[1]
    monkeypatch.setattr(jpeg_region, "_checked", False)
    assert load_record(path, spec) == region_raw
    np.testing.assert_array_equal(np.asarray(load_image(path, spec)), region_image)
    # plain PIL, independently: decode (with PIL's draft), convert, resize the crop's box
    np.testing.assert_array_equal(region_image, reference_pixels(path, 256, 224, draft=width > 1000))


@needs_region
def test_a_subsampling_the_region_decoder_gets_wrong_is_decoded_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the system's libjpeg-turbo decodes one subsampling's regions unlike simplejpeg, files of
    that subsampling are decoded whole and the others by region."""
    extension = jpeg_region._extension()

    class WrongFor422:
        @staticmethod
        def decode(data: bytes, gray: bool, scale: int, *box_and_out: Any) -> None:
            extension.decode(data, gray, scale, *box_and_out)
            if simplejpeg.decode_jpeg_header(data)[3] == "422":
                box_and_out[-1][..., 0] ^= 1

    monkeypatch.setattr(jpeg_region, "_extension", lambda: WrongFor422)
    monkeypatch.setattr(jpeg_region, "_agreeing", {})
    assert jpeg_region.available("420") and not jpeg_region.available("422")
    assert not jpeg_region.available("440") and not jpeg_region.available("411")
    spec = TransformSpec(resize=256, crop=224)
    boxes: list[tuple[int, int, int, int]] = []
    decode = jpeg_region.decode
    monkeypatch.setattr(jpeg_region, "decode", lambda *args: boxes.append(args[4]) or decode(*args))
    path_422 = _photo(tmp_path / "422.jpg", 500, 375, {"subsampling": 1}, seed=1)
    path_420 = _photo(tmp_path / "420.jpg", 500, 375, {"subsampling": 2}, seed=0)
    records = [load_record(path_422, spec), load_record(path_420, spec)]
    assert len(boxes) == 1  # the 4:2:0 file's region; the 4:2:2 file was decoded whole
    monkeypatch.setattr(jpeg_region, "_checked", False)
    assert records == [load_record(path_422, spec), load_record(path_420, spec)]


@needs_region
@pytest.mark.parametrize("fill", [0, 255])
def test_pixels_outside_the_rectangle_are_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fill: int
) -> None:
    """The region decoder leaves the rest of its buffer unwritten: whatever is there, same record."""
    paths = [_photo(tmp_path / f"{i}.jpg", w, h, o, seed=i) for i, (w, h, o) in enumerate(CASES)]
    spec = TransformSpec(resize=256, crop=224)
    expected = [load_record(path, spec) for path in paths]

    def into_filled(data: bytes, gray: bool, scale: int, size: tuple[int, int], box: tuple[int, ...]) -> np.ndarray:
        out = np.full((size[1], size[0]) if gray else (size[1], size[0], 4), fill, np.uint8)
        jpeg_region._extension().decode(data, gray, scale, *box, out)
        return out

    monkeypatch.setattr(jpeg_region, "decode", into_filled)
    assert [load_record(path, spec) for path in paths] == expected


@needs_region
def test_the_rectangle_needs_its_margin(tmp_path: Path) -> None:
    """Without the margin the rectangle's outermost column is upsampled as an image edge: it differs
    from a whole decode, which is why ``source_box`` widens the rectangle past what the resize reads."""
    data = _photo(tmp_path / "a.jpg", 500, 375, {"subsampling": 2}, seed=7).read_bytes()
    whole = np.asarray(Image.open(tmp_path / "a.jpg").convert("RGBX"))
    differs = 0
    for left in range(40, 72):
        part = jpeg_region.decode(data, False, 1, (500, 375), (left, 20, left + 301, 300))
        differs += not np.array_equal(part[20:300, left : left + 301], whole[20:300, left : left + 301])
    assert differs > 0


@needs_region
@pytest.mark.parametrize("cut", [0.98, 0.6])
def test_a_jpeg_cut_short_is_refused_as_a_whole_decode_refuses_it(tmp_path: Path, cut: float) -> None:
    """A file cut short below the crop (0.98) or inside it (0.6) is not accepted because the crop
    drops the missing rows: the region decode still reads the data to its end."""
    data = _photo(tmp_path / "a.jpg", 500, 375, {"subsampling": 2}, seed=3).read_bytes()
    path = tmp_path / "cut.jpg"
    path.write_bytes(data[: int(len(data) * cut)])
    spec = TransformSpec(resize=256, crop=224)
    with pytest.raises(ValueError, match="JPEG region decode failed: Premature end of JPEG file"):
        jpeg_region.decode(path.read_bytes(), False, 1, (500, 375), (100, 10, 400, 300))
    result = encode_image(path, spec)
    assert isinstance(result, Failure) and result.reason.startswith("truncated or corrupt image")


def test_a_cut_file_fails_the_same_way_without_the_region_decoder(tmp_path: Path, whole_decode: None) -> None:
    data = _photo(tmp_path / "a.jpg", 500, 375, {"subsampling": 2}, seed=3).read_bytes()
    path = tmp_path / "cut.jpg"
    path.write_bytes(data[: int(len(data) * 0.98)])
    result = encode_image(path, TransformSpec(resize=256, crop=224))
    assert isinstance(result, Failure) and result.reason.startswith("truncated or corrupt image")


@needs_region
def test_the_decoder_refuses_a_rectangle_or_buffer_that_does_not_fit(tmp_path: Path) -> None:
    data = _photo(tmp_path / "a.jpg", 64, 48, {"subsampling": 2}, seed=1).read_bytes()
    decode = jpeg_region._extension().decode
    with pytest.raises(ValueError, match="scale_denom 3 is not 1, 2, 4 or 8"):
        decode(data, False, 3, 0, 0, 10, 10, np.empty((16, 22, 4), np.uint8))
    with pytest.raises(ValueError, match="does not fit the scaled image"):
        decode(data, False, 1, 0, 0, 65, 48, np.empty((48, 64, 4), np.uint8))
    with pytest.raises(ValueError, match="does not fit the scaled image"):
        decode(data, False, 2, 0, 0, 10, 10, np.empty((48, 64, 4), np.uint8))  # a buffer for scale 1
    for misshaped in (np.empty((64, 48, 4), np.uint8), np.empty(48 * 64 * 4, np.uint8),
                      np.empty((48, 64, 2, 2), np.uint8), np.empty((48, 64, 2), np.uint16)):
        with pytest.raises(ValueError, match="does not fit the scaled image"):  # the right size, not shape
            decode(data, False, 1, 0, 0, 10, 10, misshaped)
    with pytest.raises(ValueError, match="does not fit the scaled image"):
        decode(data, True, 1, 0, 0, 10, 10, np.empty((48, 64 * 4), np.uint8))  # grey wants (48, 64)
    huge = bytearray(data)  # a header claiming 65000x65000 pixels: refused before any decoding
    sof = huge.find(b"\xff\xc0")
    huge[sof + 5:sof + 9] = (65000).to_bytes(2, "big") * 2
    with pytest.raises(ValueError, match="does not fit the scaled image"):
        decode(bytes(huge), False, 1, 0, 0, 10, 10, np.empty((48, 64, 4), np.uint8))
    with pytest.raises(ValueError, match="not C-contiguous"):
        decode(data, False, 1, 0, 0, 10, 10, np.empty((64, 48, 4), np.uint8).transpose(1, 0, 2))
    with pytest.raises(ValueError, match="JPEG region decode failed: Not a JPEG file"):
        decode(b"GIF89a" + bytes(100), False, 1, 0, 0, 10, 10, np.empty((48, 64, 4), np.uint8))


def test_a_decoder_that_disagrees_with_simplejpeg_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    class Shifted:
        """Decodes one column to the right of where it should: the self-check must catch it."""

        @staticmethod
        def decode(data: bytes, gray: bool, scale: int, left: int, top: int, right: int, bottom: int,
                   out: np.ndarray) -> None:
            out[:, 1:] = simplejpeg.decode_jpeg(data, colorspace="RGBX")[:, :-1]

    monkeypatch.setattr(jpeg_region, "_extension", lambda: Shifted)
    monkeypatch.setattr(jpeg_region, "_checked", None)
    assert not jpeg_region.available()


def test_without_the_extension_the_region_decoder_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jpeg_region, "_extension", lambda: None)
    monkeypatch.setattr(jpeg_region, "_checked", None)
    assert not jpeg_region.available()


@pytest.mark.parametrize("resize, crop, resampler", [(256, None, "pil"), (256, 300, "pil"), (256, 224, "torch")])
def test_no_region_where_the_resize_reads_the_whole_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resize: int, crop: int | None, resampler: str
) -> None:
    """No crop, a crop larger than the image (padding), or torch's resize of the whole image: whole decode."""
    path = _photo(tmp_path / "a.jpg", 300, 260, {"subsampling": 2}, seed=2)
    monkeypatch.setattr(jpeg_region, "decode", lambda *args: pytest.fail("region decode used"))
    load_record(path, TransformSpec(resize=resize, crop=crop, resampler=resampler))


def test_no_region_for_an_exif_rotated_photo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    img = Image.fromarray(smooth_rgb(300, 200, seed=4), "RGB")
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "r.jpg"
    img.save(path, quality=90, exif=exif)
    monkeypatch.setattr(jpeg_region, "decode", lambda *args: pytest.fail("region decode used"))
    out = load_image(path, TransformSpec(resize=128, crop=100))
    assert out.size == (100, 100)
