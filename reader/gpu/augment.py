"""Batch-level image ops on the batch's own device: uint8 -> normalized float, flip, crop, resized crop.

Shared by ``CUDAPrefetcher`` and ``GPUDataset``. A batch is what the reader yields: a uint8 tensor
``[B, 3, H, W]`` (any strides, channels_last included) for a fixed-size dataset, or a list of B uint8
tensors ``[3, H_i, W_i]`` for a dataset packed without a crop. A list is laid into the top-left corners
of one zeroed ``[B, 3, max H, max W]`` tensor (``stack_padded``) and every op reads only inside each
image's own size, so the padding never reaches the output. Sizes are ``(height, width)`` throughout.

Work is split in two steps so that results are reproducible and testable: ``BatchAugment.draw`` takes
every per-sample random number from a seeded ``torch.Generator`` living on the batch's device (no host
round trip, no synchronisation), and ``BatchAugment.apply`` is a pure function of the batch and those
draws.

Normalization units: ``mean`` and ``std`` may be given in 0-1 units (torchvision style,
``(0.485, 0.456, 0.406)``) or in 0-255 units (``(123.7, 116.3, 103.5)``). The rule: if every value of
``mean`` and of ``std`` is <= 1 they are 0-1 units and the uint8 pixels are scaled by 1/255 first;
otherwise they are 0-255 units. Either way the whole step is one fused multiply-add per channel,
``x * scale + shift``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from reader.arguments import true_or_false, whole_number
from reader.pinning import pinned

_RRC_ATTEMPTS = 10

Images = torch.Tensor | list[torch.Tensor]


def normalization_affine(mean: Sequence[float], std: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per-channel ``(scale, shift)`` such that ``uint8_pixel * scale + shift`` is the normalized value.

    Units follow the module rule: all of ``mean`` and ``std`` <= 1 means 0-1 units, else 0-255 units.
    """
    try:
        mean, std = [float(m) for m in mean], [float(s) for s in std]
    except (TypeError, ValueError):
        raise TypeError(
            f"mean and std must be sequences of numbers, one per channel, got mean={mean!r}, std={std!r}"
        ) from None
    if not all(math.isfinite(v) for v in mean + std):
        raise ValueError(f"mean and std must be finite numbers, got mean={mean}, std={std}")
    if len(mean) != len(std):
        raise ValueError(f"mean has {len(mean)} values but std has {len(std)}: give one of each per channel")
    if any(s <= 0 for s in std):
        raise ValueError(f"std must be positive, got {std}")
    unit = 255.0 if all(v <= 1.0 for v in mean + std) else 1.0
    scale = [1.0 / (unit * s) for s in std]
    shift = [-m / s for m, s in zip(mean, std)]
    return scale, shift


def seeded_generator(device: torch.device, *key: int) -> torch.Generator:
    """A generator on ``device`` seeded from the integers ``key`` (e.g. ``seed, epoch, rank, batch``):
    reproducible, and independent streams for different keys."""
    state = np.random.SeedSequence([int(k) for k in key]).generate_state(1, dtype=np.uint64)[0]
    generator = torch.Generator(device=device)
    generator.manual_seed(int(state) & ((1 << 63) - 1))
    return generator


def stack_padded(images: list[torch.Tensor]) -> torch.Tensor:
    """The images ``[C, H_i, W_i]`` in the top-left corners of one zeroed ``[B, C, max H, max W]`` tensor
    on their device (one copy each)."""
    if not images:
        raise ValueError("an empty list of images is not a batch")
    channels = images[0].shape[0]
    height = max(image.shape[1] for image in images)
    width = max(image.shape[2] for image in images)
    canvas = images[0].new_zeros((len(images), channels, height, width))
    for slot, image in zip(canvas, images):
        slot[:, : image.shape[1], : image.shape[2]].copy_(image)
    return canvas


def augment_from(
    mean: Sequence[float] | None, std: Sequence[float] | None, augment: BatchAugment | None, options: dict[str, Any]
) -> BatchAugment:
    """The ``BatchAugment`` a consumer was given: either ``augment`` itself, or one built from ``mean``,
    ``std`` and ``BatchAugment``'s keyword ``options`` (so that consumers take either, without
    repeating its arguments)."""
    if augment is not None:
        if mean is not None or std is not None or options:
            raise TypeError("give either augment=BatchAugment(...) or mean, std and its options, not both")
        return augment
    if mean is None or std is None:
        raise TypeError("give mean and std (and BatchAugment's options), or augment=BatchAugment(...)")
    return BatchAugment(mean, std, **options)


def _pair(name: str, size: int | Sequence[int]) -> tuple[int, int]:
    """``size`` (an int for a square, or ``(height, width)``) as two positive ints, or an error naming ``name``."""
    if isinstance(size, numbers.Integral) and not isinstance(size, bool):
        side = whole_number(name, size, 1)
        return side, side
    if isinstance(size, (str, bytes)) or not isinstance(size, Sequence) or len(size) != 2:
        raise TypeError(f"{name} must be an int or a (height, width) pair of ints, got {size!r}")
    return whole_number(f"{name} height", size[0], 1), whole_number(f"{name} width", size[1], 1)


def _bounds(name: str, value: Sequence[float]) -> tuple[float, float]:
    """``value`` as a ``(min, max)`` pair of floats, or a ``TypeError`` naming ``name``."""
    if (isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2
            or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value)):
        raise TypeError(f"{name} must be a (min, max) pair of numbers, got {value!r}")
    return float(value[0]), float(value[1])


def _sizes_on(device: torch.device, sizes: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Heights and widths as int64 tensors on ``device`` (made there when the batch has one size)."""
    if len(set(sizes)) == 1:
        height, width = sizes[0]
        return (torch.full((len(sizes),), height, dtype=torch.int64, device=device),
                torch.full((len(sizes),), width, dtype=torch.int64, device=device))
    heights, widths = _device_tensor([[h for h, _ in sizes], [w for _, w in sizes]], device, torch.int64)
    return heights, widths


def _device_tensor(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``values`` on ``device`` without blocking the host: a CUDA copy goes through pinned memory."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return pinned(host).to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True)
class AugmentDraws:
    """Every per-sample choice for one batch, as device tensors of length B (None for a disabled op).

    ``flip``: bool, mirror the sample horizontally. ``top``/``left``/``height``/``width``: the region of
    each stored image the output is taken from (a fixed-size crop: the window; a resized crop: its box;
    a resize then center crop: the whole image). For a resampled output, ``scale`` ``[2, B]`` float64
    holds the source pixels per output pixel (rows, columns), ``offset`` ``[2, B]`` the position of the
    output's first pixel on the resampled grid (the center crop's corner), and ``taps`` the filter taps
    per output pixel (a bound, the same for the whole batch).
    """

    flip: torch.Tensor | None = None
    top: torch.Tensor | None = None
    left: torch.Tensor | None = None
    height: torch.Tensor | None = None
    width: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    taps: int = 2


class BatchAugment:
    """Turns uint8 batches (a ``[B, 3, H, W]`` tensor, or a list of ``[3, H_i, W_i]``) into normalized
    ``dtype`` batches of one size, with optional augmentation.

    At most one of the geometric ops, all sizes ``(height, width)`` (an int means a square):

    - ``crop``: a random fixed-size window of each image (every image must hold it);
    - ``random_resized_crop`` (training, the ImageNet recipe): a random box of the WHOLE stored image,
      of relative area in ``scale`` and aspect ratio in ``ratio`` as torchvision's RandomResizedCrop draws
      it (per image, on its own size), resized to this size with bilinear interpolation;
    - ``center_crop`` (evaluation): the center window of this size (torchvision's rounding), after
      resizing each image's shorter side to ``resize`` (torchvision's ``Resize(resize)`` rounding) when
      ``resize`` is given.

    With none of them the images must all have one size. ``antialias`` makes the resizes antialiased
    (as ``F.interpolate(..., antialias=True)``; a few more taps per pixel when shrinking); without it
    they are plain bilinear (``align_corners=False``). Then horizontal flip (``flip``: each sample with
    probability 1/2), normalization (see the module docstring), the cast to ``dtype`` and, with
    ``channels_last``, the channels_last memory format. Arithmetic is float32 whatever ``dtype`` is, so
    results agree across devices and dtypes up to the final rounding.
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
        center_crop: int | Sequence[int] | None = None,
        resize: int | None = None,
        antialias: bool = False,
    ) -> None:
        if sum(op is not None for op in (crop, random_resized_crop, center_crop)) > 1:
            raise ValueError("give at most one of crop, random_resized_crop and center_crop")
        if resize is not None:
            resize = whole_number("resize", resize, 1)
        if resize is not None and center_crop is None:
            raise ValueError(f"resize (the shorter side, got {resize}) is a positive size, given with center_crop")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
        scale, ratio = _bounds("scale", scale), _bounds("ratio", ratio)
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {tuple(scale)}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {tuple(ratio)}")
        self.scale_shift = normalization_affine(mean, std)
        self.dtype = dtype
        self.channels_last = true_or_false("channels_last", channels_last)
        self.flip = true_or_false("flip", flip)
        self.crop = None if crop is None else _pair("crop", crop)
        self.random_resized_crop = (
            None if random_resized_crop is None else _pair("random_resized_crop", random_resized_crop)
        )
        self.center_crop = None if center_crop is None else _pair("center_crop", center_crop)
        self.resize = resize
        self.antialias = true_or_false("antialias", antialias)
        self.area_scale = (float(scale[0]), float(scale[1]))
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self._affine_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def resamples(self) -> bool:
        """Whether outputs are interpolated (a resized crop, or a resize before the center crop)."""
        return self.random_resized_crop is not None or self.resize is not None

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """The ``(H, W)`` of the output for inputs of size ``(height, width)``."""
        return self.crop or self.random_resized_crop or self.center_crop or (height, width)

    def __call__(self, images: Images, generator: torch.Generator) -> torch.Tensor:
        """Draw this batch's random choices from ``generator`` and apply them."""
        if isinstance(images, (list, tuple)):
            sizes = [(int(image.shape[1]), int(image.shape[2])) for image in images]
            images = stack_padded(list(images))
        else:
            sizes = [(int(images.shape[2]), int(images.shape[3]))] * images.shape[0]
        return self.apply(images, self.draw(sizes, generator))

    def draw(self, sizes: Sequence[tuple[int, int]], generator: torch.Generator) -> AugmentDraws:
        """Every per-sample choice for a batch of images of ``sizes`` ``[(height, width), ...]``."""
        self._check_sizes(sizes)
        if self.random_resized_crop is not None:
            geometry = self._random_resized_boxes(sizes, generator)
        elif self.resize is not None:
            geometry = self._resized_center_crops(sizes, generator.device)
        elif self.crop is not None or self.center_crop is not None:
            geometry = self._windows(sizes, generator)
        else:
            geometry = {}
        flip = None
        if self.flip:
            flip = torch.rand(len(sizes), generator=generator, device=generator.device) < 0.5
        return AugmentDraws(flip=flip, **geometry)

    def _random_resized_boxes(self, sizes: Sequence[tuple[int, int]], generator: torch.Generator) -> dict:
        heights, widths = _sizes_on(generator.device, sizes)
        box_h, box_w = self._random_box_sizes(heights, widths, generator)
        top, left = self._corners(box_h, box_w, heights, widths, generator)
        assert self.random_resized_crop is not None  # drawn only with it
        out_h, out_w = self.random_resized_crop
        scale = torch.stack([box_h.to(torch.float64) / out_h, box_w.to(torch.float64) / out_w])
        taps = self._taps_bound(max(h for h, _ in sizes) / out_h, max(w for _, w in sizes) / out_w)
        return dict(top=top, left=left, height=box_h, width=box_w, scale=scale, offset=torch.zeros_like(scale),
                    taps=taps)

    def _resized_center_crops(self, sizes: Sequence[tuple[int, int]], device: torch.device) -> dict:
        heights, widths = _sizes_on(device, sizes)
        geometry = self._center_geometries(sizes)
        plan = _device_tensor([[g[k] for g in geometry] for k in range(4)], device, torch.float64)
        taps = self._taps_bound(max(g[0] for g in geometry), max(g[1] for g in geometry))
        return dict(top=torch.zeros_like(heights), left=torch.zeros_like(widths), height=heights, width=widths,
                    scale=plan[:2], offset=plan[2:], taps=taps)

    def _windows(self, sizes: Sequence[tuple[int, int]], generator: torch.Generator) -> dict:
        """Fixed-size windows: drawn uniformly (``crop``), or centred (``center_crop`` without resize)."""
        window = self.crop or self.center_crop
        assert window is not None  # drawn only with one of them
        window_h, window_w = window
        if self.crop is not None:
            heights, widths = _sizes_on(generator.device, sizes)
            box_h, box_w = torch.full_like(heights, window_h), torch.full_like(widths, window_w)
            top, left = self._corners(box_h, box_w, heights, widths, generator)
        else:
            geometry = self._center_geometries(sizes)
            top, left = _device_tensor([[g[2] for g in geometry], [g[3] for g in geometry]], generator.device,
                                       torch.int64)
            box_h, box_w = torch.full_like(top, window_h), torch.full_like(left, window_w)
        return dict(top=top, left=left, height=box_h, width=box_w)

    def apply(self, images: torch.Tensor, draws: AugmentDraws) -> torch.Tensor:
        """The augmented, normalized batch for ``images`` (uint8 ``[B, C, H, W]``, each image in the
        top-left corner of its slot) and this batch's ``draws``."""
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"expected a uint8 batch [B, C, H, W], got {images.dtype} {tuple(images.shape)}")
        scale, shift = self._affine(images.device, images.shape[1])
        if draws.scale is not None:
            assert draws.offset is not None and draws.top is not None and draws.left is not None
            assert draws.height is not None and draws.width is not None and draws.taps is not None
            out_h, out_w = self.output_size(*images.shape[2:])
            rows = _taps(draws.top, draws.height, draws.scale[0], draws.offset[0], out_h, draws.taps, self.antialias)
            cols = _taps(draws.left, draws.width, draws.scale[1], draws.offset[1], out_w, draws.taps, self.antialias)
            images = _resample(images, rows, cols, draws.flip)
        elif draws.top is not None and draws.left is not None:
            window = self.crop or self.center_crop
            assert window is not None  # a window was drawn
            crop_h, crop_w = window
            images = _crop(images, draws.top, draws.left, crop_h, crop_w, draws.flip)
        elif draws.flip is not None:
            images = torch.where(draws.flip.view(-1, 1, 1, 1), images.flip(-1), images)
        out = torch.addcmul(shift, images, scale)
        out = out.to(self.dtype)
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        return out.contiguous(memory_format=memory_format)

    def _check_sizes(self, sizes: Sequence[tuple[int, int]]) -> None:
        """Refuse, naming the sample, a batch the options cannot turn into one output size."""
        window = self.crop or (self.center_crop if self.resize is None else None)
        if window is not None:
            for i, (height, width) in enumerate(sizes):
                if window[0] > height or window[1] > width:
                    name = "crop" if self.crop else "center_crop"
                    raise ValueError(
                        f"{name} {window[0]}x{window[1]} is larger than the images (sample {i} of the batch is "
                        f"{height}x{width}); give a smaller size, or resize= with center_crop, or use "
                        "random_resized_crop, which takes any size"
                    )
        elif self.resize is None and self.random_resized_crop is None and len(set(sizes)) > 1:
            raise ValueError(
                f"the images of this batch have different sizes ({', '.join(f'{h}x{w}' for h, w in sizes[:3])}, "
                "...): give random_resized_crop=SIZE (training) or center_crop=SIZE with resize=SHORTER_SIDE "
                "(evaluation) to make them one size"
            )

    def _center_geometries(self, sizes: Sequence[tuple[int, int]]) -> list[tuple[float, float, int, int]]:
        """``_center_geometry`` of each image, computed once per distinct size."""
        per_size = {size: self._center_geometry(*size) for size in dict.fromkeys(sizes)}
        return [per_size[size] for size in sizes]

    def _center_geometry(self, height: int, width: int) -> tuple[float, float, int, int]:
        """For one image: ``(row scale, column scale, top, left)`` of the center crop on the resized grid
        (torchvision's Resize(shorter side) and CenterCrop rounding); scales are 1 without ``resize``."""
        assert self.center_crop is not None  # only for center crops
        new_h, new_w = height, width
        if self.resize is not None:
            if width <= height:
                new_w, new_h = self.resize, int(self.resize * height / width)
            else:
                new_w, new_h = int(self.resize * width / height), self.resize
            if self.center_crop[0] > new_h or self.center_crop[1] > new_w:
                raise ValueError(
                    f"center_crop {self.center_crop[0]}x{self.center_crop[1]} is larger than an image of "
                    f"{height}x{width} resized to {new_h}x{new_w}: make resize at least the crop's size"
                )
        top = int(round((new_h - self.center_crop[0]) / 2.0))
        left = int(round((new_w - self.center_crop[1]) / 2.0))
        return height / new_h, width / new_w, top, left

    def _taps_bound(self, row_scale: float, col_scale: float) -> int:
        """Taps per output pixel for source pixels per output pixel up to these: 2 for plain bilinear;
        the antialiased filter spans 2 x max(scale, 1) source pixels, so it covers at most the ceiling
        of that many pixel centres, plus one for float rounding at the edges."""
        if not self.antialias:
            return 2
        return math.ceil(2 * max(row_scale, col_scale, 1.0)) + 1

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

    @staticmethod
    def _corners(
        box_h: torch.Tensor, box_w: torch.Tensor, height: torch.Tensor, width: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform top-left corners such that each box fits inside its image."""
        u = torch.rand(2, box_h.numel(), generator=generator, device=generator.device, dtype=torch.float64)
        top = (u[0] * (height - box_h + 1)).floor().long()
        left = (u[1] * (width - box_w + 1)).floor().long()
        return top, left

    def _random_box_sizes(
        self, height: torch.Tensor, width: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """torchvision's RandomResizedCrop box sizes, vectorized: up to 10 tries per sample, first fit wins.

        A sample whose 10 tries all fail falls back to the largest centred box with its aspect ratio
        clamped to ``ratio``, as torchvision does.
        """
        batch, device = height.numel(), generator.device
        u = torch.rand(2, batch, _RRC_ATTEMPTS, generator=generator, device=device, dtype=torch.float64)
        height, width = height.view(-1, 1), width.view(-1, 1)
        area = height * width * (self.area_scale[0] + u[0] * (self.area_scale[1] - self.area_scale[0]))
        aspect = torch.exp(self.log_ratio[0] + u[1] * (self.log_ratio[1] - self.log_ratio[0]))
        tries_w = torch.sqrt(area * aspect).round().long()
        tries_h = torch.sqrt(area / aspect).round().long()
        fits = (tries_w > 0) & (tries_w <= width) & (tries_h > 0) & (tries_h <= height)
        first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)
        box_w = tries_w.gather(1, first).squeeze(1)
        box_h = tries_h.gather(1, first).squeeze(1)
        fallback_h, fallback_w = self._fallback_box(height.squeeze(1), width.squeeze(1))
        any_fit = fits.any(dim=1)
        return torch.where(any_fit, box_h, fallback_h), torch.where(any_fit, box_w, fallback_w)

    def _fallback_box(self, height: torch.Tensor, width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        min_ratio, max_ratio = math.exp(self.log_ratio[0]), math.exp(self.log_ratio[1])
        height, width = height.to(torch.float64), width.to(torch.float64)
        in_ratio = width / height
        narrow, wide = in_ratio < min_ratio, in_ratio > max_ratio
        box_h = torch.where(narrow, (width / min_ratio).round(), height)
        box_w = torch.where(wide, (height * max_ratio).round(), width)
        return box_h.long(), box_w.long()


def _columns(flip: torch.Tensor | None, taps: torch.Tensor) -> torch.Tensor:
    """Per-sample column indices ``[B, W, ...]``, reversed for the samples to mirror: a flip costs no pass."""
    if flip is None:
        return taps
    return torch.where(flip.view(-1, *[1] * (taps.dim() - 1)), taps.flip(1), taps)


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


def _taps(
    start: torch.Tensor,
    length: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    out_size: int,
    taps: int,
    antialias: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Interpolation taps along one axis, per sample: absolute source indices and float32 weights, both
    ``[B, out_size, taps]``, as ``F.interpolate(mode="bilinear", align_corners=False, antialias=...)``
    computes them for the segment ``[start, start + length)`` resized by ``1 / scale``, output pixel i
    being pixel ``i + offset`` of the resized grid. Unused taps have weight 0 and a valid index."""
    device = start.device
    scale, length = scale.view(-1, 1), length.view(-1, 1)
    positions = torch.arange(out_size, device=device, dtype=torch.float64).view(1, -1)
    centres = scale * (positions + offset.view(-1, 1) + 0.5)
    if antialias:
        support = scale.clamp_min(1.0)
        first = (centres - support + 0.5).floor().clamp_min(0)
        stop = torch.minimum((centres + support + 0.5).floor(), length.to(torch.float64))
        position = first.unsqueeze(-1) + torch.arange(taps, device=device, dtype=torch.float64)
        distance = (position - centres.unsqueeze(-1) + 0.5) / support.unsqueeze(-1)
        weight = (1 - distance.abs()).clamp_min(0) * (position < stop.unsqueeze(-1))
        weight = weight / weight.sum(-1, keepdim=True).clamp_min(1e-12)
        index = torch.minimum(position.long(), length.unsqueeze(-1) - 1)
    else:
        source = (centres - 0.5).clamp_min(0)
        low = source.floor()
        upper_weight = source - low
        low = torch.minimum(low.long(), length - 1)
        index = torch.stack([low, torch.minimum(low + 1, length - 1)], -1)
        weight = torch.stack([1 - upper_weight, upper_weight], -1)
    return index + start.view(-1, 1, 1), weight.to(torch.float32)


def _resample(
    images: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor],
    cols: tuple[torch.Tensor, torch.Tensor],
    flip: torch.Tensor | None,
) -> torch.Tensor:
    """The separable interpolation of each image with its own ``rows`` and ``cols`` taps (see ``_taps``),
    mirrored where ``flip``, as float32 ``[B, C, out_h, out_w]``. Rows are gathered from the uint8 batch
    (cheap), columns from the row-interpolated float rows."""
    batch, channels, _, width = images.shape
    row_index, row_weight = rows
    col_index, col_weight = (_columns(flip, taps) for taps in cols)
    out_h, out_w = row_index.shape[1], col_index.shape[1]
    interpolated_rows = _filter(images, 2, row_index, row_weight, (batch, 1, out_h, 1), (batch, channels, out_h, width))
    return _filter(interpolated_rows, 3, col_index, col_weight, (batch, 1, 1, out_w), (batch, channels, out_h, out_w))


def _filter(
    source: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    weight: torch.Tensor,
    view: tuple[int, ...],
    shape: tuple[int, ...],
) -> torch.Tensor:
    """``sum_k weight[..., k] * source`` gathered along ``dim`` at ``index[..., k]``, in float32: one
    gather per tap; two taps (plain bilinear, weights summing to 1) are one ``lerp``."""
    def tap(k: int) -> torch.Tensor:
        return source.gather(dim, index[:, :, k].view(view).expand(shape))

    if index.shape[2] == 2:
        return torch.lerp(tap(0).to(torch.float32), tap(1).to(torch.float32), weight[:, :, 1].view(view))
    out = torch.zeros(shape, dtype=torch.float32, device=source.device)
    for k in range(index.shape[2]):
        out.addcmul_(tap(k), weight[:, :, k].view(view))
    return out
