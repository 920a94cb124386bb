"""What the GPU-side tests share: ImageNet's mean/std, the normalization by hand, real PNG images read
back, and a reader-style batch built from a dataset's samples (independent of how the dataset reads
whole batches)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def normalized(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 3, H, W]`` normalized with ``MEAN``/``STD`` (0-1 units), in float64."""
    mean, std = torch.tensor(MEAN).double().view(3, 1, 1), torch.tensor(STD).double().view(3, 1, 1)
    return (images.double() / 255 - mean) / std


def png_images(folder: Path, sizes: Sequence[tuple[int, int]], seed: int) -> list[torch.Tensor]:
    """Random RGB images of ``sizes`` (height, width) written to ``folder`` as PNG and read back: uint8
    ``[3, H_i, W_i]`` each."""
    rng = np.random.default_rng(seed)
    images = []
    for i, (height, width) in enumerate(sizes):
        path = folder / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        with Image.open(path) as img:
            images.append(torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1))
    return images


def batch_of(dataset: object, indices: Sequence[int]) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
    """``(images, int64 labels)`` as the reader yields them: a ``[B, 3, H, W]`` tensor when the samples
    share one size, else a list of ``[3, H_i, W_i]``."""
    samples = [dataset[i] for i in indices]
    images = [image for image, _ in samples]
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
    if len({tuple(image.shape) for image in images}) == 1:
        return torch.stack(images), labels
    return images, labels
