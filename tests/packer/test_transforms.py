"""The pre-transform against plain PIL computations: sizes, crop rounding, colour rules, EXIF, draft."""
from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
from pack_helpers import reference_pixels, smooth_rgb
from PIL import Image, ImageOps

from packer.image.transforms import (
    TransformSpec,
    center_crop_box,
    load_image,
    resize_target,
    to_rgb,
)
from reader.format import encoding


def test_resize_target_follows_torchvision_shorter_side_rule() -> None:
    assert resize_target(500, 375, 256) == (341, 256)
    assert resize_target(375, 500, 256) == (256, 341)
    assert resize_target(300, 300, 100) == (100, 100)
    assert resize_target(640, 480, (320, 200)) == (320, 200)
    assert resize_target(640, 480, None) == (640, 480)


def test_center_crop_uses_torchvision_rounding_and_pads_small_images() -> None:
    assert center_crop_box(341, 256, (224, 224)) == (58, 16, 282, 240)
    assert center_crop_box(225, 225, (224, 224)) == (0, 0, 224, 224)  # round(0.5) == 0
    assert center_crop_box(227, 229, (224, 224)) == (2, 2, 226, 226)  # round(1.5) == 2, round(2.5) == 2
    assert center_crop_box(10, 20, (13, 20)) == (-1, 0, 12, 20)  # padding (13 - 10) // 2 on the left


def test_load_image_equals_plain_pil_on_png(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    Image.fromarray(smooth_rgb(61, 47, seed=3), "RGB").save(path)
    out = load_image(path, TransformSpec(resize=32, crop=24))
    assert out.mode == "RGB" and out.size == (24, 24)
    np.testing.assert_array_equal(np.asarray(out), reference_pixels(path, 32, 24))


def test_jpeg_draft_equals_pil_draft_and_stays_close_to_full_decode(tmp_path: Path) -> None:
    path = tmp_path / "big.jpg"
    Image.fromarray(smooth_rgb(256, 200, seed=5), "RGB").save(path, quality=95)
    out = np.asarray(load_image(path, TransformSpec(resize=48, crop=40)))
    np.testing.assert_array_equal(out, reference_pixels(path, 48, 40, draft=True))
    textbook = reference_pixels(path, 48, 40, draft=False, fused=False)
    assert np.abs(out.astype(int) - textbook.astype(int)).mean() < 3


def test_fused_resize_crop_is_within_one_level_of_resize_then_crop(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate([(500, 375), (333, 500), (257, 256), (640, 480)]):
        path = tmp_path / f"{i}.png"
        noisy = smooth_rgb(w, h, seed=i).astype(int) + rng.integers(-20, 21, (h, w, 3))
        Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB").save(path)
        out = np.asarray(load_image(path, TransformSpec(resize=256, crop=224))).astype(int)
        textbook = reference_pixels(path, 256, 224, fused=False).astype(int)
        diff = np.abs(out - textbook)
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_greyscale_jpeg_becomes_grey_rgb(tmp_path: Path) -> None:
    path = tmp_path / "grey.jpg"
    Image.fromarray(smooth_rgb(64, 48, seed=6)[:, :, 0], "L").save(path, quality=95)
    out = np.asarray(load_image(path, TransformSpec(resize=20)))
    img = Image.open(path)
    img.draft("RGB", (26, 20))
    expected = np.asarray(img.convert("RGB").resize((26, 20), Image.BILINEAR))
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(tmp_path: Path, orientation: int) -> None:
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(smooth_rgb(48, 32, seed=orientation), "RGB").save(path, quality=95, exif=exif)
    out = load_image(path, TransformSpec())
    expected = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    assert out.size == expected.size == ((32, 48) if orientation >= 5 else (48, 32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_exif_rotation_swaps_the_draft_request(tmp_path: Path) -> None:
    path = tmp_path / "portrait.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(smooth_rgb(200, 100, seed=9), "RGB").save(path, quality=95, exif=exif)
    out = load_image(path, TransformSpec(resize=(80, 40)))  # (height, width)
    assert out.size == (40, 80)
    upright = ImageOps.exif_transpose(Image.open(path)).convert("RGB").resize((40, 80), Image.BILINEAR)
    assert np.abs(np.asarray(out).astype(int) - np.asarray(upright).astype(int)).mean() < 3


def _composited_on_white(rgba: np.ndarray) -> np.ndarray:
    alpha = rgba[..., 3:4].astype(np.float64) / 255
    return rgba[..., :3] * alpha + 255 * (1 - alpha)


def test_rgba_is_composited_onto_white() -> None:
    rgba = np.dstack([smooth_rgb(16, 12, seed=1), np.linspace(0, 255, 16 * 12).reshape(12, 16)]).astype(np.uint8)
    out = np.asarray(to_rgb(Image.fromarray(rgba, "RGBA"))).astype(int)
    assert np.abs(out - _composited_on_white(rgba)).max() <= 1
    assert (out[0, 0] == 255).all()  # fully transparent corner is white


def test_la_and_pa_and_palette_transparency_are_composited_onto_white() -> None:
    la = Image.fromarray(np.dstack([np.full((4, 4), 10), np.full((4, 4), 0)]).astype(np.uint8), "LA")
    assert (np.asarray(to_rgb(la)) == 255).all()
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    palette.info["transparency"] = 1
    assert (np.asarray(to_rgb(palette)) == 255).all()
    opaque = palette.copy()
    opaque.info.pop("transparency")
    assert tuple(np.asarray(to_rgb(opaque))[0, 0]) == (200, 10, 10)
    pa = Image.new("PA", (2, 2))
    pa.putpalette([50, 60, 70] + [0] * 765)
    assert (np.asarray(to_rgb(pa)) == 255).all()  # alpha 0 everywhere


def test_sixteen_bit_and_int_and_float_modes_follow_the_documented_rule() -> None:
    values16 = np.array([[0, 255, 256, 65535]], dtype=np.uint16)
    out16 = np.asarray(to_rgb(Image.fromarray(values16)))
    assert out16[..., 0].tolist() == [[0, 0, 1, 255]] and (out16[..., 0] == out16[..., 2]).all()
    values32 = np.array([[-5, 512, 65535, 100000]], dtype=np.int32)
    assert np.asarray(to_rgb(Image.fromarray(values32)))[..., 1].tolist() == [[0, 2, 255, 255]]
    floats = np.array([[-3.0, 10.4, 10.6, 300.0]], dtype=np.float32)
    assert np.asarray(to_rgb(Image.fromarray(floats)))[..., 0].tolist() == [[0, 10, 11, 255]]


@pytest.mark.parametrize("mode", ["CMYK", "YCbCr", "HSV", "1", "L", "P"])
def test_other_modes_use_pil_convert(mode: str) -> None:
    img = Image.fromarray(smooth_rgb(8, 6, seed=2), "RGB").convert(mode)
    out = to_rgb(img)
    assert out.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(out), np.asarray(img.convert("RGB")))


def test_raw_encoding_is_channel_major() -> None:
    pixels = smooth_rgb(5, 4, seed=4)
    payload = encoding("raw").encode(Image.fromarray(pixels, "RGB"), 90)
    np.testing.assert_array_equal(np.frombuffer(payload, np.uint8).reshape(3, 4, 5), pixels.transpose(2, 0, 1))


def test_jpeg_encoding_is_baseline_420_at_the_quality() -> None:
    payload = encoding("jpeg").encode(Image.fromarray(smooth_rgb(32, 24, seed=4), "RGB"), 75)
    img = Image.open(io.BytesIO(payload))
    assert img.format == "JPEG" and img.size == (32, 24) and "progressive" not in img.info
    assert img.layer[0][1:3] == (2, 2)  # luma sampled 2x2 against chroma: 4:2:0


@pytest.mark.parametrize("max_pixels", [5000, 1000])  # PIL warns past its limit and errs past twice it
def test_decompression_bomb_limit_names_the_limit_given(tmp_path: Path, max_pixels: int) -> None:
    path = tmp_path / "big.png"
    Image.new("RGB", (100, 100)).save(path)
    message = f"image of 10000 pixels, over the limit of {max_pixels} (--max-pixels)"
    with pytest.raises(Image.DecompressionBombError, match=re.escape(message)):
        load_image(path, TransformSpec(max_pixels=max_pixels))
    with pytest.raises(Image.DecompressionBombError,
                       match=re.escape(f"image of 100x100 pixels, over the limit of {max_pixels} (--max-pixels)")):
        load_image(Image.new("RGB", (100, 100)), TransformSpec(max_pixels=max_pixels))
    assert load_image(path, TransformSpec(max_pixels=10000)).size == (100, 100)


def test_spec_rejects_bad_sizes() -> None:
    for bad in [0, -3, (10,), (10, 0), "10", (1.5, 2), True]:
        with pytest.raises(ValueError):
            TransformSpec(resize=bad)
    with pytest.raises(ValueError):
        TransformSpec(encoding="png")
    assert TransformSpec(resize=(30, 20), crop=None).fixed_size == (30, 20)
    assert TransformSpec(resize=30, crop=(16, 12)).fixed_size == (16, 12)
    assert TransformSpec(resize=(30, 20), crop=(16, 12)).pil_crop == (12, 16)  # (height, width) -> PIL's
    assert TransformSpec(resize=30).fixed_size is None


@pytest.mark.parametrize("resize, crop", [(256, 224), ((320, 200), None), (None, (16, 12)), (None, None)])
def test_spec_round_trips_through_its_manifest_description(resize, crop) -> None:
    spec = TransformSpec(resize=resize, crop=crop)
    again = TransformSpec.from_description(spec.describe())
    assert (again.resize, again.crop_size) == (spec.resize, spec.crop_size)
