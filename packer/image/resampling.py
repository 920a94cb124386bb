"""Which library resizes: PIL where it is pillow-simd, torch's uint8 antialiased bilinear otherwise.

The pre-transform's resize is PIL's bilinear, antialiased filter. pillow-simd (what ``scripts/setup_env`` installs)
runs it with AVX2 and is the fastest here. A plain ``pip install`` gets plain Pillow, whose resize is
2-3x slower; torch, already a dependency, has a SIMD uint8 antialiased bilinear ``interpolate`` on
channels-last tensors that was built to match PIL. Measured on 300 ImageNet-like photos, shorter side
256 and a 224 crop, one thread, the conversion to and from a tensor included
(``scripts/measure_resize.py``): pillow-simd 3,400-4,800 img/s, torch 1,200-2,000, plain Pillow
12.1 700-900. torch's resize-then-crop gave exactly pillow-simd's resize-then-crop pixels (0 of 11
million differ) and is within one grey level of pillow-simd's fused resize+crop (the packer's PIL
path); plain Pillow 12.1 itself differs from both by one grey level on 0.2-0.3% of those pixels
(on up to 6% in a mild downscale such as 40x30 to 32x24) and by 2 on about 1 pixel in 10 million.

``"pil"``: PIL's ``resize`` of only the box the crop keeps (``transforms.resize_and_crop``).
``"torch"``: ``torch.nn.functional.interpolate(..., mode="bilinear", antialias=True)`` of the whole
image to the resize target, then the crop. Each packing process runs torch on one thread (every core
already runs a packing process of its own). ``PACKER_RESAMPLER=pil|torch`` overrides the default.
"""
from __future__ import annotations

import importlib.metadata
import os
import warnings
from typing import Any

import numpy as np
import PIL
from PIL import Image

RESAMPLERS = ("pil", "torch")
_threads_set_in: int | None = None


def default_resampler() -> str:
    """``PACKER_RESAMPLER`` when set, else ``"pil"`` with pillow-simd and ``"torch"`` with plain Pillow."""
    chosen = os.environ.get("PACKER_RESAMPLER", "").strip().lower()
    if chosen:
        if chosen not in RESAMPLERS:
            raise ValueError(f"PACKER_RESAMPLER={chosen!r} is not one of {', '.join(RESAMPLERS)}")
        return chosen
    return "pil" if is_pillow_simd() else "torch"


def is_pillow_simd() -> bool:
    """pillow-simd versions carry a ``.postN`` suffix (12.1.1.post0); plain Pillow's do not."""
    return ".post" in PIL.__version__


def resampler_library(resampler: str) -> str:
    """What does the resizing, with its version, for the manifest: ``"pillow-simd 12.1.1.post0"``."""
    if resampler == "torch":  # the installed version, without importing torch (1.4-3 s) in the plan phase
        return f"torch {importlib.metadata.version('torch')}"
    return f"{'pillow-simd' if is_pillow_simd() else 'Pillow'} {PIL.__version__}"


def torch_resize(img: Image.Image, size: tuple[int, int], box: tuple[int, int, int, int] | None = None) -> Any:
    """``img`` (RGB or RGBX) resized to ``size`` (width, height) by torch's uint8 antialiased bilinear
    ``interpolate`` on a channels-last view of its pixels, then cut to ``box`` (left, top, right,
    bottom; inside ``size``) when given: a ``(3, H, W)`` uint8 tensor (a strided view; the caller
    makes it contiguous in the layout it needs)."""
    import torch

    global _threads_set_in
    if _threads_set_in != os.getpid():
        torch.set_num_threads(1)
        _threads_set_in = os.getpid()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        pixels = torch.from_numpy(np.asarray(img))  # (H, W, C): read only, never written
    batch = pixels.permute(2, 0, 1).unsqueeze(0)  # (1, C, H, W), channels-last in memory
    out = torch.nn.functional.interpolate(
        batch, size=(size[1], size[0]), mode="bilinear", antialias=True, align_corners=False
    )[0, :3]
    return out if box is None else out[:, box[1] : box[3], box[0] : box[2]]
