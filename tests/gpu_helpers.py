"""What the GPU-side tests share: ImageNet's mean/std, the normalization by hand, and a reader-style
batch built from a dataset's samples (independent of how the dataset reads whole batches)."""
from __future__ import annotations

from typing import Sequence

import torch

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def normalized(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 3, H, W]`` normalized with ``MEAN``/``STD`` (0-1 units), in float64."""
    mean, std = torch.tensor(MEAN).double().view(3, 1, 1), torch.tensor(STD).double().view(3, 1, 1)
    return (images.double() / 255 - mean) / std


def batch_of(dataset: object, indices: Sequence[int]) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
    """``(images, int64 labels)`` as the reader yields them: a ``[B, 3, H, W]`` tensor when the samples
    share one size, else a list of ``[3, H_i, W_i]``."""
    samples = [dataset[i] for i in indices]
    images = [image for image, _ in samples]
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
    if len({tuple(image.shape) for image in images}) == 1:
        return torch.stack(images), labels
    return images, labels
