"""The torch resampler (the default on a plain Pillow install), forced here whatever is installed:
pixels within one grey level of PIL, the choice recorded in the manifest and shown by ``info``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from click.testing import CliRunner
from pack_helpers import raw_pixels, read_packed_records, reference_pixels, smooth_rgb
from PIL import Image

import packer
import packer.image.resampling
from packer.cli import main
from packer.image.resampling import default_resampler, is_pillow_simd
from packer.image.transforms import TransformSpec, load_image, load_record
from reader.format import encoding


def noisy_photo(path: Path, width: int, height: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    pixels = smooth_rgb(width, height, seed=seed).astype(int) + rng.integers(-20, 21, (height, width, 3))
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").save(path)
    return path


@pytest.mark.parametrize(("width", "height", "resize", "crop"), [
    (500, 375, 256, 224),  # downscale, landscape
    (333, 500, 256, 224),  # downscale, portrait
    (257, 256, 256, 224),  # barely smaller
    (90, 70, 128, 112),    # upscale
    (40, 30, 24, 28),      # a crop taller than the resized image: black padding
])
def test_torch_resize_is_within_one_grey_level_of_pil(
    tmp_path: Path, width: int, height: int, resize: int, crop: int
) -> None:
    path = noisy_photo(tmp_path / "a.png", width, height, seed=width)
    out = load_image(path, TransformSpec(resize=resize, crop=crop, resampler="torch"))
    assert out.mode == "RGB" and out.size == (crop, crop)
    got = np.asarray(out).astype(int)
    textbook = reference_pixels(path, resize, crop, fused=False).astype(int)  # PIL: resize, then crop
    diff = np.abs(got - textbook)
    assert diff.max() <= 1  # plain Pillow 12.1 differs by one level on up to 6% of pixels here
    if is_pillow_simd():  # measured: torch's uint8 path gives pillow-simd's very pixels
        np.testing.assert_array_equal(got, textbook)
    if crop <= resize:  # without padding, the PIL resampler resizes only the kept box
        fused = np.abs(got - reference_pixels(path, resize, crop).astype(int))
        assert fused.max() <= 1


def test_pack_with_torch_records_it_and_stays_within_one_grey_level(
    tmp_path: Path, make_image_folder: Callable[..., Path]
) -> None:
    src = make_image_folder(tmp_path / "src", per_class=3, size=(61, 47))
    manifest = packer.pack(src, tmp_path / "out", resize=32, crop=24, resampler="torch", workers=2,
                           partitions=2, progress=False)
    assert manifest.transform["resampler"] == "torch"
    assert manifest.transform["resampler_library"].startswith("torch 2.")
    assert manifest.transform["crop"]["fused_with_resize"] == "no: the whole image is resized, then cropped"
    for record, path in zip(read_packed_records(tmp_path / "out"), sorted(src.glob("*/*.png")), strict=True):
        diff = np.abs(raw_pixels(record).astype(int) - reference_pixels(path, 32, 24, fused=False).astype(int))
        assert diff.max() <= 1
    info = CliRunner().invoke(main, ["info", str(tmp_path / "out")]).output
    assert "bilinear antialiased (torch 2." in info


def test_the_cli_takes_the_resampler_from_the_environment(
    tmp_path: Path, make_image_folder: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_image_folder(tmp_path / "src", per_class=1)
    monkeypatch.setenv("PACKER_RESAMPLER", "torch")
    result = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "out"), "--resize", "16", "--quiet"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["transform"]["resampler"] == "torch"
    monkeypatch.setenv("PACKER_RESAMPLER", "magic")
    result = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "bad"), "--quiet"])
    assert result.exit_code == 1
    assert result.output == "Error: PACKER_RESAMPLER='magic' is not one of pil, torch\n"
    result = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "pil"), "--resampler", "pil", "--quiet"])
    assert result.exit_code == 0
    assert json.loads((tmp_path / "pil" / "manifest.json").read_text())["transform"]["resampler"] == "pil"


def test_the_default_is_pil_with_pillow_simd_and_torch_with_plain_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PACKER_RESAMPLER", raising=False)
    monkeypatch.setattr(packer.image.resampling.PIL, "__version__", "12.1.1.post0")
    assert default_resampler() == "pil"
    monkeypatch.setattr(packer.image.resampling.PIL, "__version__", "12.1.1")
    assert default_resampler() == "torch"


@pytest.mark.parametrize("resampler", ["pil", "torch"])
@pytest.mark.parametrize(("resize", "crop"), [(32, 24), (32, None), (20, 28), (None, 40), (40, 40)])
@pytest.mark.parametrize("kind", ["raw", "jpeg"])
@pytest.mark.parametrize("suffix", [".png", ".jpg"])
def test_the_record_is_the_encoded_image(tmp_path: Path, resampler: str, resize: int | None,
                                         crop: int | None, kind: str, suffix: str) -> None:
    """``load_record`` (RGBX from the JPEG decode handed to the encoding; torch's raw shortcut from the
    tensor) gives the bytes of ``encoding(kind).encode(load_image())``: with a crop, without, a padding
    crop, no resize, a resize to the image's own size."""
    path = noisy_photo(tmp_path / f"a{suffix}", 40 if resize == 40 else 61, 40 if resize == 40 else 47, seed=1)
    spec = TransformSpec(resize=resize, crop=crop, resampler=resampler, encoding=kind)
    image = load_image(path, spec)
    assert image.mode == "RGB"
    assert load_record(path, spec) == (encoding(kind).encode(image, 90), image.height, image.width)
