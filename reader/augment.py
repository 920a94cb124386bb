"""Batch-level image ops on the batch's own device: uint8 -> normalized float, flip, crop, resized crop.

Shared by ``CUDAPrefetcher`` and ``GPUDataset``. A batch is a uint8 tensor ``[B, 3, H, W]`` (any
strides, channels_last included). Work is split in two steps so that results are reproducible and
testable: ``BatchAugment.draw`` takes every per-sample random number from a seeded ``torch.Generator``
living on the batch's device (no host round trip, no synchronisation), and ``BatchAugment.apply`` is a
pure function of the batch and those draws.

Normalization units: ``mean`` and ``std`` may be given in 0-1 units (torchvision style,
``(0.485, 0.456, 0.406)``) or in 0-255 units (``(123.7, 116.3, 103.5)``). The rule: if every value of
``mean`` and of ``std`` is <= 1 they are 0-1 units and the uint8 pixels are scaled by 1/255 first;
otherwise they are 0-255 units. Either way the whole step is one fused multiply-add per channel,
``x * scale + shift``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

_RRC_ATTEMPTS = 10


def normalization_affine(mean: Sequence[float], std: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per-channel ``(scale, shift)`` such that ``uint8_pixel * scale + shift`` is the normalized value.

    Units follow the module rule: all of ``mean`` and ``std`` <= 1 means 0-1 units, else 0-255 units.
    """
    mean, std = [float(m) for m in mean], [float(s) for s in std]
    if len(mean) != len(std):
        raise ValueError(f"mean has {len(mean)} values but std has {len(std)}: give one of each per channel")
    if any(s <= 0 for s in std):
        raise ValueError(f"std must be positive, got {std}")
    unit = 255.0 if all(v <= 1.0 for v in mean + std) else 1.0
    scale = [1.0 / (unit * s) for s in std]
    shift = [-m / s for m, s in zip(mean, std)]
    return scale, shift


def epoch_generator(seed: int, epoch: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from ``(seed, epoch)``: reproducible, and distinct per epoch."""
    state = np.random.SeedSequence([int(seed), int(epoch)]).generate_state(1, dtype=np.uint64)[0]
    generator = torch.Generator(device=device)
    generator.manual_seed(int(state) & ((1 << 63) - 1))
    return generator


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    height, width = size
    return int(height), int(width)


@dataclass(frozen=True)
class AugmentDraws:
    """Every random choice for one batch, as device tensors of length B (None for a disabled op).

    ``flip``: bool, mirror the sample horizontally. ``top``/``left``: the crop's corner, and
    ``height``/``width`` its size (a fixed-size crop has every height/width equal to the crop size).
    """

    flip: torch.Tensor | None
    top: torch.Tensor | None
    left: torch.Tensor | None
    height: torch.Tensor | None
    width: torch.Tensor | None


class BatchAugment:
    """Turns uint8 ``[B, 3, H, W]`` batches into normalized ``dtype`` batches, with optional augmentation.

    Order of operations: crop (``crop``: a random fixed-size window; or ``random_resized_crop``: a
    random box of relative area in ``scale`` and aspect ratio in ``ratio``, as torchvision's
    RandomResizedCrop draws it, resized to the output size with bilinear interpolation, no
    antialiasing), then horizontal flip (``flip``: each sample with probability 1/2), then
    normalization (see the module docstring), then the cast to ``dtype`` and, with
    ``channels_last``, the channels_last memory format. Normalization is computed in float32 whatever
    ``dtype`` is, so results agree across devices and dtypes up to the final rounding.
    """

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        *,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        flip: bool = False,
        crop: int | Sequence[int] | None = None,
        random_resized_crop: int | Sequence[int] | None = None,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
    ) -> None:
        if crop is not None and random_resized_crop is not None:
            raise ValueError("give either crop or random_resized_crop, not both")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {tuple(scale)}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {tuple(ratio)}")
        self.scale_shift = normalization_affine(mean, std)
        self.dtype = dtype
        self.channels_last = channels_last
        self.flip = flip
        self.crop = None if crop is None else _pair(crop)
        self.random_resized_crop = None if random_resized_crop is None else _pair(random_resized_crop)
        self.area_scale = (float(scale[0]), float(scale[1]))
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self._affine_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """The ``(H, W)`` of the output for inputs of size ``(height, width)``."""
        return self.crop or self.random_resized_crop or (height, width)

    def __call__(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Draw this batch's random choices from ``generator`` and apply them."""
        batch, _, height, width = images.shape
        return self.apply(images, self.draw(batch, height, width, generator))

    def draw(self, batch: int, height: int, width: int, generator: torch.Generator) -> AugmentDraws:
        """Every per-sample random choice for a batch of ``batch`` images of size ``(height, width)``."""
        device = generator.device
        top = left = box_h = box_w = None
        if self.crop is not None:
            box_h, box_w = self._fixed_crop_sizes(batch, height, width, device)
            top, left = self._corners(box_h, box_w, height, width, generator)
        elif self.random_resized_crop is not None:
            box_h, box_w = self._random_box_sizes(batch, height, width, generator)
            top, left = self._corners(box_h, box_w, height, width, generator)
        flip = None
        if self.flip:
            flip = torch.rand(batch, generator=generator, device=device) < 0.5
        return AugmentDraws(flip=flip, top=top, left=left, height=box_h, width=box_w)

    def apply(self, images: torch.Tensor, draws: AugmentDraws) -> torch.Tensor:
        """The augmented, normalized batch for ``images`` (uint8) and this batch's ``draws``."""
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"expected a uint8 batch [B, C, H, W], got {images.dtype} {tuple(images.shape)}")
        scale, shift = self._affine(images.device, images.shape[1])
        if self.crop is not None:
            images = _crop(images, draws.top, draws.left, *self.crop, draws.flip)
        elif self.random_resized_crop is not None:
            images = _resized_crop(
                images, draws.top, draws.left, draws.height, draws.width, *self.random_resized_crop, draws.flip
            )
        elif draws.flip is not None:
            images = torch.where(draws.flip.view(-1, 1, 1, 1), images.flip(-1), images)
        out = torch.addcmul(shift, images, scale)
        out = out.to(self.dtype)
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        return out.contiguous(memory_format=memory_format)

    def _affine(self, device: torch.device, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        scale, shift = self.scale_shift
        if channels != len(scale):
            raise ValueError(f"batch has {channels} channels but mean/std have {len(scale)} values")
        if device not in self._affine_cache:
            self._affine_cache[device] = (
                torch.tensor(scale, dtype=torch.float32, device=device).view(-1, 1, 1),
                torch.tensor(shift, dtype=torch.float32, device=device).view(-1, 1, 1),
            )
        return self._affine_cache[device]

    def _fixed_crop_sizes(
        self, batch: int, height: int, width: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        crop_h, crop_w = self.crop
        if crop_h > height or crop_w > width:
            raise ValueError(f"crop {crop_h}x{crop_w} is larger than the images ({height}x{width})")
        return (
            torch.full((batch,), crop_h, dtype=torch.int64, device=device),
            torch.full((batch,), crop_w, dtype=torch.int64, device=device),
        )

    @staticmethod
    def _corners(
        box_h: torch.Tensor, box_w: torch.Tensor, height: int, width: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform top-left corners such that each box fits inside the image."""
        u = torch.rand(2, box_h.numel(), generator=generator, device=generator.device, dtype=torch.float64)
        top = (u[0] * (height - box_h + 1)).floor().long()
        left = (u[1] * (width - box_w + 1)).floor().long()
        return top, left

    def _random_box_sizes(
        self, batch: int, height: int, width: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """torchvision's RandomResizedCrop box sizes, vectorized: up to 10 tries per sample, first fit wins.

        A sample whose 10 tries all fail falls back to the largest centred box with its aspect ratio
        clamped to ``ratio``, as torchvision does.
        """
        device = generator.device
        u = torch.rand(2, batch, _RRC_ATTEMPTS, generator=generator, device=device, dtype=torch.float64)
        area = height * width * (self.area_scale[0] + u[0] * (self.area_scale[1] - self.area_scale[0]))
        aspect = torch.exp(self.log_ratio[0] + u[1] * (self.log_ratio[1] - self.log_ratio[0]))
        tries_w = torch.sqrt(area * aspect).round().long()
        tries_h = torch.sqrt(area / aspect).round().long()
        fits = (tries_w > 0) & (tries_w <= width) & (tries_h > 0) & (tries_h <= height)
        first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)
        box_w = tries_w.gather(1, first).squeeze(1)
        box_h = tries_h.gather(1, first).squeeze(1)
        fallback_h, fallback_w = self._fallback_box(height, width)
        any_fit = fits.any(dim=1)
        box_h = torch.where(any_fit, box_h, torch.full_like(box_h, fallback_h))
        box_w = torch.where(any_fit, box_w, torch.full_like(box_w, fallback_w))
        return box_h, box_w

    def _fallback_box(self, height: int, width: int) -> tuple[int, int]:
        min_ratio, max_ratio = math.exp(self.log_ratio[0]), math.exp(self.log_ratio[1])
        in_ratio = width / height
        if in_ratio < min_ratio:
            return int(round(width / min_ratio)), width
        if in_ratio > max_ratio:
            return height, int(round(height * max_ratio))
        return height, width


def _columns(flip: torch.Tensor | None, taps: torch.Tensor) -> torch.Tensor:
    """Per-sample column indices ``[B, W]``, reversed for the samples to mirror: a flip costs no pass."""
    if flip is None:
        return taps
    return torch.where(flip.view(-1, 1), taps.flip(1), taps)


def _crop(
    images: torch.Tensor,
    top: torch.Tensor,
    left: torch.Tensor,
    crop_h: int,
    crop_w: int,
    flip: torch.Tensor | None,
) -> torch.Tensor:
    """Per-sample fixed-size windows ``[top:top+crop_h, left:left+crop_w]`` (mirrored where ``flip``),
    gathered in one indexing op."""
    device = images.device
    rows = top.view(-1, 1, 1) + torch.arange(crop_h, device=device).view(1, -1, 1)
    cols = _columns(flip, left.view(-1, 1) + torch.arange(crop_w, device=device).view(1, -1))
    samples = torch.arange(images.shape[0], device=device).view(-1, 1, 1)
    # Advanced indices around a slice put the indexed dims first: [B, crop_h, crop_w, C].
    return images.permute(0, 2, 3, 1)[samples, rows, cols.unsqueeze(1)].permute(0, 3, 1, 2)


def _source_index(
    start: torch.Tensor, size: torch.Tensor, out_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear taps along one axis, as ``F.interpolate(mode="bilinear", align_corners=False)`` computes
    them on each sample's box: lower index, upper index (both absolute) and the upper tap's weight."""
    device = start.device
    box = size.to(torch.float32).view(-1, 1)
    centres = (torch.arange(out_size, device=device, dtype=torch.float32).view(1, -1) + 0.5) * (box / out_size) - 0.5
    centres = centres.clamp_min(0)
    low = centres.floor().long()
    weight = centres - low
    high = torch.minimum(low + 1, size.view(-1, 1) - 1)
    low = torch.minimum(low, size.view(-1, 1) - 1)
    offset = start.view(-1, 1)
    return low + offset, high + offset, weight


def _resized_crop(
    images: torch.Tensor,
    top: torch.Tensor,
    left: torch.Tensor,
    box_h: torch.Tensor,
    box_w: torch.Tensor,
    out_h: int,
    out_w: int,
    flip: torch.Tensor | None,
) -> torch.Tensor:
    """Per-sample boxes resized to ``(out_h, out_w)`` with separable bilinear interpolation (mirrored
    where ``flip``), as float32. Rows are gathered from the uint8 batch (cheap), columns from the
    row-interpolated float rows."""
    batch, channels, _, width = images.shape
    row_low, row_high, row_w = _source_index(top, box_h, out_h)
    row_shape = (batch, channels, out_h, width)
    upper = images.gather(2, row_low.view(batch, 1, out_h, 1).expand(row_shape)).to(torch.float32)
    lower = images.gather(2, row_high.view(batch, 1, out_h, 1).expand(row_shape)).to(torch.float32)
    rows = torch.lerp(upper, lower, row_w.view(batch, 1, out_h, 1))
    col_low, col_high, col_w = (_columns(flip, taps) for taps in _source_index(left, box_w, out_w))
    col_shape = (batch, channels, out_h, out_w)
    left_taps = rows.gather(3, col_low.view(batch, 1, 1, out_w).expand(col_shape))
    right_taps = rows.gather(3, col_high.view(batch, 1, 1, out_w).expand(col_shape))
    return torch.lerp(left_taps, right_taps, col_w.view(batch, 1, 1, out_w))
