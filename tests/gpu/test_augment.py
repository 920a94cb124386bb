"""BatchAugment against references computed by hand on real PNG images (CPU always, CUDA when present)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import png_images

from reader.gpu.augment import BatchAugment, normalization_affine, seeded_generator

MEAN_01, STD_01 = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MEAN_255, STD_255 = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """Six 20x24 RGB images written as PNG and read back: uint8 [6, 3, 20, 24]."""
    return torch.stack(png_images(tmp_path_factory.mktemp("png"), [(20, 24)] * 6, seed=7))


def normalize_by_hand(images: torch.Tensor, mean: tuple, std: tuple, unit: float) -> torch.Tensor:
    pixels = images.to(torch.float64) / unit
    return (pixels - torch.tensor(mean, dtype=torch.float64).view(3, 1, 1)) / torch.tensor(
        std, dtype=torch.float64
    ).view(3, 1, 1)


def test_unit_rule() -> None:
    scale, shift = normalization_affine(MEAN_01, STD_01)
    assert scale[0] == pytest.approx(1 / (255 * 0.229)) and shift[0] == pytest.approx(-0.485 / 0.229)
    scale, shift = normalization_affine(MEAN_255, STD_255)
    assert scale[0] == pytest.approx(1 / 58.395) and shift[0] == pytest.approx(-123.675 / 58.395)
    with pytest.raises(ValueError, match="std must be positive"):
        normalization_affine((0.5,) * 3, (0.0, 1.0, 1.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("units", ["0-1", "0-255"])
def test_normalization_both_units(batch: torch.Tensor, device: str, units: str) -> None:
    mean, std, unit = (MEAN_01, STD_01, 255.0) if units == "0-1" else (MEAN_255, STD_255, 1.0)
    augment = BatchAugment(mean, std)
    out = augment(batch.to(device), seeded_generator(torch.device(device), 0, 0))
    assert out.dtype == torch.float32 and out.device.type == device
    torch.testing.assert_close(out.cpu().double(), normalize_by_hand(batch, mean, std, unit), atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_dtypes(batch: torch.Tensor, device: str, dtype: torch.dtype) -> None:
    out = BatchAugment(MEAN_01, STD_01, dtype=dtype)(batch.to(device), seeded_generator(torch.device(device), 0, 0))
    assert out.dtype == dtype
    expected = normalize_by_hand(batch, MEAN_01, STD_01, 255.0).to(dtype)
    torch.testing.assert_close(out.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_in_and_out(batch: torch.Tensor, device: str) -> None:
    images = batch.to(device).contiguous(memory_format=torch.channels_last)
    out = BatchAugment(MEAN_01, STD_01, channels_last=True)(images, seeded_generator(torch.device(device), 0, 0))
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.cpu().double(), normalize_by_hand(batch, MEAN_01, STD_01, 255.0), atol=1e-5, rtol=0)
    plain = BatchAugment(MEAN_01, STD_01)(images, seeded_generator(torch.device(device), 0, 0))
    assert plain.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
def test_flip_mirrors_exactly_the_drawn_samples(batch: torch.Tensor, device: str) -> None:
    augment = BatchAugment((0.0,) * 3, (1.0,) * 3, flip=True)
    generator = seeded_generator(torch.device(device), 3, 0)
    draws = augment.draw([(20, 24)] * len(batch), generator)
    out = augment.apply(batch.to(device), draws).cpu()
    flips = draws.flip.cpu()
    assert 0 < int(flips.sum()) < len(batch), "seed 3 should flip some samples and keep others"
    for i, flipped in enumerate(flips.tolist()):
        expected = batch[i].flip(-1) if flipped else batch[i]
        torch.testing.assert_close(out[i] * 255, expected.float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_random_crop_matches_slicing(batch: torch.Tensor, device: str) -> None:
    augment = BatchAugment((0.0,) * 3, (1.0,) * 3, crop=(9, 11), flip=True)
    draws = augment.draw([(20, 24)] * len(batch), seeded_generator(torch.device(device), 1, 0))
    out = augment.apply(batch.to(device), draws).cpu()
    assert out.shape == (len(batch), 3, 9, 11)
    tops, lefts = draws.top.cpu().tolist(), draws.left.cpu().tolist()
    assert len(set(zip(tops, lefts))) > 1, "corners are drawn per sample"
    for i, (top, left, flipped) in enumerate(zip(tops, lefts, draws.flip.cpu().tolist())):
        assert 0 <= top <= 20 - 9 and 0 <= left <= 24 - 11
        window = batch[i, :, top : top + 9, left : left + 11]
        expected = window.flip(-1) if flipped else window
        torch.testing.assert_close(out[i] * 255, expected.float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_random_resized_crop_matches_interpolate_per_box(batch: torch.Tensor, device: str) -> None:
    augment = BatchAugment(MEAN_01, STD_01, random_resized_crop=(8, 10), flip=True, scale=(0.2, 1.0))
    draws = augment.draw([(20, 24)] * len(batch), seeded_generator(torch.device(device), 5, 0))
    out = augment.apply(batch.to(device), draws).cpu().double()
    assert out.shape == (len(batch), 3, 8, 10)
    boxes = zip(*(t.cpu().tolist() for t in (draws.top, draws.left, draws.height, draws.width, draws.flip)))
    for i, (top, left, height, width, flipped) in enumerate(boxes):
        assert top + height <= 20 and left + width <= 24
        assert 0.2 * 480 - 24 <= height * width <= 480, "box area follows scale (up to rounding)"
        box = batch[i : i + 1, :, top : top + height, left : left + width].double()
        resized = F.interpolate(box, size=(8, 10), mode="bilinear", align_corners=False, antialias=False)[0]
        expected = normalize_by_hand(resized.flip(-1) if flipped else resized, MEAN_01, STD_01, 255.0)
        torch.testing.assert_close(out[i], expected, atol=1e-4, rtol=0)


def test_random_resized_crop_falls_back_to_centre_box() -> None:
    augment = BatchAugment((0.5,) * 3, (0.5,) * 3, random_resized_crop=4, scale=(1.0, 1.0), ratio=(2.0, 3.0))
    draws = augment.draw([(20, 20)] * 3, seeded_generator(torch.device("cpu"), 0, 0))
    # A square 20x20 image cannot hold a box of full area with aspect 2..3: torchvision's fallback is
    # the largest box with the ratio clamped to 2, i.e. 10 rows by 20 columns.
    assert draws.height.tolist() == [10] * 3 and draws.width.tolist() == [20] * 3


def test_draws_are_seeded_and_differ_across_epochs(batch: torch.Tensor) -> None:
    augment = BatchAugment(MEAN_01, STD_01, random_resized_crop=8, flip=True)
    cpu = torch.device("cpu")
    first = augment(batch, seeded_generator(cpu, 11, 0))
    again = augment(batch, seeded_generator(cpu, 11, 0))
    next_epoch = augment(batch, seeded_generator(cpu, 11, 1))
    other_seed = augment(batch, seeded_generator(cpu, 12, 0))
    assert torch.equal(first, again)
    assert not torch.equal(first, next_epoch)
    assert not torch.equal(first, other_seed)


def test_bad_options_are_refused(batch: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="at most one of crop, random_resized_crop and center_crop"):
        BatchAugment(MEAN_01, STD_01, crop=8, random_resized_crop=8)
    with pytest.raises(ValueError, match="larger than the images"):
        BatchAugment(MEAN_01, STD_01, crop=32)(batch, seeded_generator(torch.device("cpu"), 0, 0))
    with pytest.raises(ValueError, match="uint8 batch"):
        BatchAugment(MEAN_01, STD_01)(batch.float(), seeded_generator(torch.device("cpu"), 0, 0))
    with pytest.raises(ValueError, match="dtype"):
        BatchAugment(MEAN_01, STD_01, dtype=torch.int32)


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """Five RGB PNGs of different sizes (one 3x larger than the outputs below) read back as uint8
    [3, H_i, W_i]: what the reader yields for a dataset packed without a crop."""
    return png_images(tmp_path_factory.mktemp("ragged"), [(20, 30), (33, 17), (25, 25), (16, 40), (60, 48)], seed=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("antialias", [False, True])
def test_random_resized_crop_of_variable_sizes_matches_interpolate(
    ragged: list[torch.Tensor], device: str, antialias: bool
) -> None:
    augment = BatchAugment(MEAN_255, STD_255, random_resized_crop=(12, 10), flip=True, antialias=antialias)
    generator = seeded_generator(torch.device(device), 4, 0)
    sizes = [tuple(image.shape[1:]) for image in ragged]
    draws = augment.draw(sizes, generator)
    out = augment([image.to(device) for image in ragged], seeded_generator(torch.device(device), 4, 0)).cpu()
    assert out.shape == (5, 3, 12, 10) and out.dtype == torch.float32
    boxes = zip(*(t.cpu().tolist() for t in (draws.top, draws.left, draws.height, draws.width, draws.flip)))
    for i, (top, left, height, width, flipped) in enumerate(boxes):
        box = ragged[i][None, :, top : top + height, left : left + width].double()
        resized = F.interpolate(box, size=(12, 10), mode="bilinear", align_corners=False, antialias=antialias)[0]
        expected = normalize_by_hand(resized.flip(-1) if flipped else resized, MEAN_255, STD_255, 1.0)
        torch.testing.assert_close(out[i].double(), expected, atol=1e-4, rtol=0)


def test_random_resized_crop_boxes_are_drawn_on_each_whole_image(ragged: list[torch.Tensor]) -> None:
    """Geometry over many draws: every box lies inside its own image, its area is the drawn share of
    that image's area and its aspect ratio within the range (up to the rounding of each side), and the
    boxes reach every part of the image, not only a central crop."""
    augment = BatchAugment(MEAN_01, STD_01, random_resized_crop=8, scale=(0.25, 0.75), ratio=(0.5, 2.0))
    sizes = [tuple(image.shape[1:]) for image in ragged] * 40
    draws = augment.draw(sizes, seeded_generator(torch.device("cpu"), 8, 0))
    top, left, height, width = (t.double() for t in (draws.top, draws.left, draws.height, draws.width))
    image_h = torch.tensor([h for h, _ in sizes], dtype=torch.float64)
    image_w = torch.tensor([w for _, w in sizes], dtype=torch.float64)
    assert bool(((top >= 0) & (left >= 0) & (top + height <= image_h) & (left + width <= image_w)).all())
    share = height * width / (image_h * image_w)
    slack = (height + width + 1) / (image_h * image_w)  # each side rounded by at most half a pixel
    assert bool(((share >= 0.25 - slack) & (share <= 0.75 + slack)).all())
    aspect = width / height
    assert bool(((aspect >= 0.5 * (1 - 1 / height) / (1 + 1 / width)) &
                 (aspect <= 2.0 * (1 + 1 / height) / (1 - 1 / width))).all())
    assert bool(((top + height == image_h) & (top > 0)).any()) and bool(((left + width == image_w) & (left > 0)).any())
    assert bool((top == 0).any()) and bool((left == 0).any())
    assert torch.equal(draws.scale, torch.stack([height, width]) / 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("antialias", [False, True])
def test_resize_then_center_crop_matches_an_independent_computation(
    ragged: list[torch.Tensor], device: str, antialias: bool
) -> None:
    augment = BatchAugment(MEAN_01, STD_01, center_crop=(14, 12), resize=16, antialias=antialias)
    out = augment([image.to(device) for image in ragged], seeded_generator(torch.device(device), 0)).cpu()
    assert out.shape == (5, 3, 14, 12)
    for i, image in enumerate(ragged):
        height, width = image.shape[1:]
        # torchvision's Resize(16) then CenterCrop((14, 12)), by hand.
        new_h, new_w = (16, int(16 * width / height)) if height <= width else (int(16 * height / width), 16)
        resized = F.interpolate(image[None].double(), size=(new_h, new_w), mode="bilinear",
                                align_corners=False, antialias=antialias)[0]
        top, left = int(round((new_h - 14) / 2.0)), int(round((new_w - 12) / 2.0))
        expected = normalize_by_hand(resized[:, top : top + 14, left : left + 12], MEAN_01, STD_01, 255.0)
        torch.testing.assert_close(out[i].double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_center_crop_of_stored_sizes_is_exact(ragged: list[torch.Tensor], device: str) -> None:
    out = BatchAugment((0.0,) * 3, (1.0,) * 3, center_crop=16)([image.to(device) for image in ragged],
                                                             seeded_generator(torch.device(device), 0)).cpu()
    for i, image in enumerate(ragged):
        top, left = int(round((image.shape[1] - 16) / 2.0)), int(round((image.shape[2] - 16) / 2.0))
        torch.testing.assert_close(out[i] * 255, image[:, top : top + 16, left : left + 16].float(), atol=1e-4, rtol=0)


def test_variable_sizes_need_an_op_that_makes_one_size(ragged: list[torch.Tensor]) -> None:
    cpu = seeded_generator(torch.device("cpu"), 0)
    with pytest.raises(ValueError, match=r"different sizes \(20x30, 33x17, 25x25, \.\.\.\): give random_resized_crop"):
        BatchAugment(MEAN_01, STD_01, flip=True)(ragged, cpu)
    with pytest.raises(ValueError, match=r"crop 17x17 is larger than the images \(sample 3 of the batch is 16x40\)"):
        BatchAugment(MEAN_01, STD_01, crop=17)(ragged, cpu)
    with pytest.raises(ValueError, match=r"center_crop 20x20 is larger than an image of 20x30 resized to 16x24"):
        BatchAugment(MEAN_01, STD_01, center_crop=20, resize=16)(ragged, cpu)
    with pytest.raises(ValueError, match="resize .* given with center_crop"):
        BatchAugment(MEAN_01, STD_01, resize=16)
    random_crop = BatchAugment(MEAN_01, STD_01, crop=16)(ragged, cpu)
    assert random_crop.shape == (5, 3, 16, 16)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"crop": 0}, ValueError, "crop must be positive, got 0"),
        ({"crop": (0, 4)}, ValueError, "crop height must be positive, got 0"),
        ({"crop": -1}, ValueError, "crop must be positive, got -1"),
        ({"crop": 4.5}, TypeError, "crop must be an int or a (height, width) pair of ints, got 4.5"),
        ({"crop": (3,)}, TypeError, "crop must be an int or a (height, width) pair of ints, got (3,)"),
        ({"random_resized_crop": 0}, ValueError, "random_resized_crop must be positive, got 0"),
        ({"random_resized_crop": (8, -3)}, ValueError, "random_resized_crop width must be positive, got -3"),
        ({"center_crop": 0}, ValueError, "center_crop must be positive, got 0"),
        ({"center_crop": 4, "resize": 0}, ValueError, "resize must be positive, got 0"),
        ({"center_crop": 4, "resize": 4.5}, TypeError, "resize must be an int, got 4.5"),
        ({"center_crop": 4, "resize": True}, TypeError, "resize must be an int, got True"),
    ],
)
def test_output_sizes_must_be_positive_ints(options: dict, error: type, message: str) -> None:
    """A size of 0 gave empty batches, a negative one a torch error deep inside, and random_resized_crop=0 a
    ZeroDivisionError: each is refused where it is given, naming the option."""
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        BatchAugment(MEAN_01, STD_01, **options)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"flip": 0.2}, TypeError, "flip must be True or False, got 0.2"),
        ({"flip": "no"}, TypeError, "flip must be True or False, got 'no'"),
        ({"channels_last": "no"}, TypeError, "channels_last must be True or False, got 'no'"),
        ({"antialias": "no"}, TypeError, "antialias must be True or False, got 'no'"),
        ({"std": (0.2, float("nan"), 0.2)}, ValueError, "mean and std must be finite numbers, got mean=[0.485, 0.456, "
         "0.406], std=[0.2, nan, 0.2]"),
        ({"mean": (0.5, float("inf"), 0.5)}, ValueError, "mean and std must be finite numbers, got mean=[0.5, inf, "
         "0.5], std=[0.229, 0.224, 0.225]"),
        ({"mean": 0.5}, TypeError, "mean and std must be sequences of numbers, one per channel, got mean=0.5, "
         "std=(0.229, 0.224, 0.225)"),
        ({"random_resized_crop": 8, "scale": 0.5}, TypeError, "scale must be a (min, max) pair of numbers, got 0.5"),
        ({"random_resized_crop": 8, "scale": (0.5,)}, TypeError,
         "scale must be a (min, max) pair of numbers, got (0.5,)"),
        ({"random_resized_crop": 8, "ratio": (1, 2, 3)}, TypeError,
         "ratio must be a (min, max) pair of numbers, got (1, 2, 3)"),
    ],
)
def test_flags_normalization_and_ranges_are_checked(options: dict, error: type, message: str) -> None:
    """flip=0.2 flipped half the samples (any non-empty value was true), a NaN std gave NaN batches, and a
    scalar scale or mean failed inside with a message naming neither: each is refused, naming it."""
    arguments = {"mean": MEAN_01, "std": STD_01, **options}
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        BatchAugment(**arguments)
