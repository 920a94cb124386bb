"""Variable-size data (packed with --resize, no --crop) through make_loader and CUDAPrefetcher: training
with random_resized_crop, evaluation with resize + center crop against an independent computation, and
extra batch tensors passed through."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import MEAN, STD, batch_of, normalized
from PIL import Image
from reader_helpers import CLASSES, make_images

import packer
from reader import CUDAPrefetcher, PackedDataset, make_loader

SOURCE_SIZES = [(20, 30), (33, 17), (25, 25), (16, 40), (40, 28), (18, 18), (30, 45), (22, 35)]


@pytest.fixture(params=["raw", "jpeg"])
def uncropped(tmp_path: Path, request: pytest.FixtureRequest) -> PackedDataset:
    """Eight images of different aspect ratios, packed with shorter side 16 and no crop, raw or JPEG
    (whose batches the reader decodes channels-last)."""
    for k, image in enumerate(make_images(len(SOURCE_SIZES), SOURCE_SIZES)):
        path = tmp_path / "src" / CLASSES[k % 3] / f"{k}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path)
    packer.pack(tmp_path / "src", tmp_path / "packed", resize=16, encoding=request.param, workers=0, progress=False)
    dataset = PackedDataset(tmp_path / "packed")
    assert dataset.manifest.shape is None
    assert len({tuple(dataset[i][0].shape) for i in range(len(dataset))}) == 6
    return dataset


def resize_then_center_crop(image: torch.Tensor, shorter: int, crop: int) -> torch.Tensor:
    """torchvision's ``Resize(shorter)`` then ``CenterCrop(crop)`` (antialiased bilinear), by hand."""
    height, width = image.shape[1:]
    if width <= height:
        new_w, new_h = shorter, int(shorter * height / width)
    else:
        new_w, new_h = int(shorter * width / height), shorter
    resized = F.interpolate(image[None].double(), size=(new_h, new_w), mode="bilinear", align_corners=False,
                            antialias=True)[0]
    top, left = int(round((new_h - crop) / 2.0)), int(round((new_w - crop) / 2.0))
    return resized[:, top : top + crop, left : left + crop]


def test_evaluation_center_crop_pixels(uncropped: PackedDataset) -> None:
    loader = make_loader(uncropped, batch_size=3, num_workers=0, order="sequential")
    prefetcher = CUDAPrefetcher(loader, MEAN, STD, device="cpu", center_crop=12, resize=14, antialias=True)
    batches = list(prefetcher)
    assert [tuple(images.shape) for images, _ in batches] == [(3, 3, 12, 12), (3, 3, 12, 12), (2, 3, 12, 12)]
    images = torch.cat([images for images, _ in batches]).double()
    for i in range(len(uncropped)):
        image, label = uncropped[i]
        torch.testing.assert_close(images[i], normalized(resize_then_center_crop(image, 14, 12)), atol=1e-5, rtol=0)
    assert torch.cat([labels for _, labels in batches]).tolist() == [uncropped[i][1] for i in range(len(uncropped))]


@pytest.mark.parametrize("workers", [0, 2])
def test_training_random_resized_crop_gives_fixed_size_batches(uncropped: PackedDataset, workers: int) -> None:
    loader = make_loader(uncropped, batch_size=3, num_workers=workers, seed=5)
    prefetcher = CUDAPrefetcher(loader, MEAN, STD, random_resized_crop=10, flip=True, channels_last=True, seed=5)
    for epoch in range(2):
        prefetcher.set_epoch(epoch)
        batches = list(prefetcher)
        assert all(images.shape[1:] == (3, 10, 10) and images.dtype == torch.float32 for images, _ in batches)
        assert all(images.is_contiguous(memory_format=torch.channels_last) for images, _ in batches)
        labels = sorted(torch.cat([labels for _, labels in batches]).tolist())
        assert labels == sorted(uncropped[i][1] for i in range(len(uncropped)))


def test_variable_sizes_without_a_size_op_are_refused_with_the_way_out(uncropped: PackedDataset) -> None:
    prefetcher = CUDAPrefetcher(make_loader(uncropped, batch_size=3, num_workers=0), MEAN, STD, flip=True)
    with pytest.raises(ValueError, match="different sizes .* give random_resized_crop=SIZE .* center_crop=SIZE"):
        next(iter(prefetcher))


class ExtrasLoader:
    """Batches of the reader's kind followed by extras: int64 sample indices and a bool validity mask."""

    def __init__(self, dataset: PackedDataset, batch_size: int) -> None:
        self.dataset, self.batch_size = dataset, batch_size

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    def __iter__(self):
        for start in range(0, len(self.dataset), self.batch_size):
            indices = list(range(start, min(start + self.batch_size, len(self.dataset))))
            images, labels = batch_of(self.dataset, indices)
            yield images, labels, torch.tensor(indices), torch.tensor([i % 2 == 0 for i in indices])


@pytest.mark.parametrize("fixed_size", [False, True])
def test_extras_pass_through_unchanged(uncropped: PackedDataset, raw_path: Path, fixed_size: bool) -> None:
    dataset = PackedDataset(raw_path) if fixed_size else uncropped
    options = {} if fixed_size else {"random_resized_crop": 8}
    batches = list(CUDAPrefetcher(ExtrasLoader(dataset, 4), MEAN, STD, device="cpu", **options))
    assert all(len(batch) == 4 for batch in batches)
    indices = torch.cat([batch[2] for batch in batches])
    mask = torch.cat([batch[3] for batch in batches])
    assert indices.dtype == torch.int64 and indices.tolist() == list(range(len(dataset)))
    assert mask.dtype == torch.bool and mask.tolist() == [i % 2 == 0 for i in range(len(dataset))]
    if fixed_size:
        expected = normalized(batch_of(dataset, range(len(dataset)))[0])
        torch.testing.assert_close(torch.cat([batch[0] for batch in batches]).double(), expected, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_variable_size_evaluation_equals_cpu_on_another_stream(uncropped: PackedDataset) -> None:
    def prefetcher(device: str) -> CUDAPrefetcher:
        loader = make_loader(uncropped, batch_size=3, num_workers=0, order="sequential")
        return CUDAPrefetcher(loader, MEAN, STD, device=device, center_crop=12, resize=14, antialias=True)

    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        got = [(images * 1, labels * 1) for images, labels in prefetcher("cuda")]
    torch.cuda.synchronize()
    expected = list(prefetcher("cpu"))
    assert len(got) == len(expected) == 3
    for (images, labels), (want_images, want_labels) in zip(got, expected):
        assert images.device.type == "cuda"
        torch.testing.assert_close(images.cpu(), want_images, atol=1e-5, rtol=0)
        assert torch.equal(labels.cpu(), want_labels)
