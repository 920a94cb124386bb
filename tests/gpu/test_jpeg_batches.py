"""Encoded JPEG batches (``PackedDataset(decode=False)``): the workers read the records' bytes and
``CUDAPrefetcher`` decodes them (nvJPEG on a GPU, libjpeg-turbo on the host elsewhere), then augments
them as it augments decoded batches."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_helpers import MEAN, STD
from PIL import Image
from reader_helpers import jpeg_bytes, make_images, write_dataset

from reader import CUDAPrefetcher, PackedDataset, make_loader
from reader.gpu import jpeg_batches
from reader.gpu.jpeg_batches import decode_jpegs
from reader.list_batches import is_encoded

SIZES = [(24, 32), (30, 20), (16, 16), (28, 36)]


@pytest.fixture(scope="module")
def images() -> list[np.ndarray]:
    return make_images(10, SIZES, seed=3)


@pytest.fixture(scope="module")
def uncropped(tmp_path_factory: pytest.TempPathFactory, images: list[np.ndarray]) -> Path:
    """Ten JPEG records of four sizes, in this order, three to a shard."""
    return write_dataset(tmp_path_factory.mktemp("jpeg") / "packed", images, [k % 3 for k in range(10)],
                         storage="lmdb", encoding="jpeg", records_per_shard=3)


@pytest.fixture(scope="module")
def cropped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twelve 20x24 JPEG records (a fixed-shape dataset), HDF5, five to a shard."""
    return write_dataset(tmp_path_factory.mktemp("jpeg") / "packed", make_images(12, [(20, 24)], seed=4),
                         [k % 3 for k in range(12)], storage="hdf5", encoding="jpeg", records_per_shard=5)


def test_records_are_served_as_their_jpeg_bytes(uncropped: Path, images: list[np.ndarray]) -> None:
    dataset = PackedDataset(uncropped, decode=False)
    payloads, labels = dataset.read_batch([7, 0, 4, 9])
    assert [payload.numpy().tobytes() for payload in payloads] == [jpeg_bytes(images[k]) for k in (7, 0, 4, 9)]
    assert labels.tolist() == [1, 0, 1, 0]
    payload, label = dataset[5]
    assert payload.dim() == 1 and payload.dtype == torch.uint8 and label == 2
    assert payload.numpy().tobytes() == jpeg_bytes(images[5])


def test_fixed_shape_records_are_served_as_a_list_too(cropped: Path) -> None:
    payloads, _ = PackedDataset(cropped, decode=False).read_batch([0, 6, 11])
    assert is_encoded(payloads) and len(payloads) == 3


def test_decode_false_on_raw_pixels_is_one_clear_line(raw_path: Path) -> None:
    with pytest.raises(ValueError, match=r"decode=False serves encoded JPEG records, and this dataset's records are "
                                         r"raw pixels, which need no decoding: leave decode=True"):
        PackedDataset(raw_path, decode=False)


def test_decoded_batches_equal_the_workers_decode(cropped: Path, uncropped: Path) -> None:
    """Without a GPU decoder the prefetcher decodes on the host with the workers' decoder: the same pixels
    and labels, batch for batch, with the same augmentation draws; also from spawned workers."""
    for path, options in ((cropped, {"flip": True}), (uncropped, {"random_resized_crop": 12, "flip": True})):
        def batches(decode: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
            loader = make_loader(PackedDataset(path, decode=decode), 4, num_workers=2, seed=5)
            return [(images.clone(), labels) for images, labels in
                    CUDAPrefetcher(loader, MEAN, STD, device="cpu", seed=1, **options)]

        encoded, decoded = batches(False), batches(True)
        assert len(encoded) == len(decoded) == 3
        for (got, got_labels), (want, want_labels) in zip(encoded, decoded):
            assert torch.equal(got_labels, want_labels)
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_decode_jpegs_sizes(images: list[np.ndarray]) -> None:
    payloads = [torch.frombuffer(bytearray(jpeg_bytes(images[k])), dtype=torch.uint8) for k in (0, 4, 1)]
    mixed = decode_jpegs(payloads, torch.device("cpu"))
    assert isinstance(mixed, list) and [tuple(image.shape) for image in mixed] == [(3, 24, 32), (3, 24, 32),
                                                                                   (3, 30, 20)]
    same = decode_jpegs(payloads[:2], torch.device("cpu"))
    assert isinstance(same, torch.Tensor) and same.shape == (2, 3, 24, 32)
    reference = np.asarray(Image.open(io.BytesIO(jpeg_bytes(images[0]))).convert("RGB")).transpose(2, 0, 1)
    assert np.abs(same[0].numpy().astype(int) - reference).mean() < 4  # fast DCT and upsampling against PIL


def test_a_payload_that_is_not_a_jpeg_is_named(images: list[np.ndarray]) -> None:
    good = torch.frombuffer(bytearray(jpeg_bytes(images[0])), dtype=torch.uint8)
    bad = torch.frombuffer(bytearray(b"\x89PNG\r\n\x1a\n" + bytes(40)), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^sample 1 of the batch is not a valid JPEG payload"):
        decode_jpegs([good, bad], torch.device("cpu"))


def test_is_encoded_tells_payloads_from_images() -> None:
    assert is_encoded([torch.zeros(5, dtype=torch.uint8)])
    assert not is_encoded([torch.zeros(3, 4, 4, dtype=torch.uint8)])
    assert not is_encoded(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))
    assert not is_encoded([])
    assert not is_encoded([torch.zeros(5, dtype=torch.float32)])


def test_early_break_with_a_decode_in_flight(uncropped: Path) -> None:
    loader = make_loader(PackedDataset(uncropped, decode=False), 3, num_workers=0)
    prefetcher = CUDAPrefetcher(loader, MEAN, STD, device="cpu", random_resized_crop=8)
    for _ in prefetcher:
        break
    assert prefetcher.state_dict()["batches"] == 1
    assert [tuple(images.shape) for images, _ in prefetcher] == [(3, 3, 8, 8)] * 3 + [(1, 3, 8, 8)]


def test_resume_mid_epoch_yields_the_rest(cropped: Path) -> None:
    def prefetcher() -> CUDAPrefetcher:
        loader = make_loader(PackedDataset(cropped, decode=False), 3, num_workers=0, seed=2)
        return CUDAPrefetcher(loader, MEAN, STD, device="cpu", flip=True)

    whole = [(images.clone(), labels) for images, labels in prefetcher()]
    first = prefetcher()
    iterator = iter(first)
    next(iterator)
    state = first.state_dict()
    resumed = prefetcher()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(whole) - 1
    for (got, got_labels), (want, want_labels) in zip(rest, whole[1:]):
        assert torch.equal(got_labels, want_labels) and torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_decode_is_close_to_the_host_decode_on_another_stream(uncropped: Path) -> None:
    """nvJPEG and libjpeg-turbo differ in their IDCT and chroma upsampling, by a few grey levels."""
    loader = make_loader(PackedDataset(uncropped, decode=False), 4, num_workers=0, order="sequential")
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        got = [(images.float().clone(), labels) for images, labels in
               CUDAPrefetcher(loader, (0.0,) * 3, (1 / 255,) * 3, device="cuda", center_crop=16)]
    torch.cuda.synchronize()
    host = make_loader(PackedDataset(uncropped, decode=False), 4, num_workers=0, order="sequential")
    want = list(CUDAPrefetcher(host, (0.0,) * 3, (1 / 255,) * 3, device="cpu", center_crop=16))
    for (images, labels), (reference, reference_labels) in zip(got, want):
        assert images.device.type == "cuda"
        assert torch.equal(labels.cpu(), reference_labels)
        assert (images.cpu() - reference).abs().mean() < 4.0


def test_a_concat_of_encoded_and_decoded_datasets_is_one_clear_line(cropped: Path) -> None:
    mixed = torch.utils.data.ConcatDataset([PackedDataset(cropped, decode=False), PackedDataset(cropped)])
    with pytest.raises(ValueError, match=r"^ConcatDataset mixes datasets opened with decode=False and decode=True"):
        make_loader(mixed, 4, num_workers=0)


def test_gpu_decoder_errors(images: list[np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    """A payload the host refuses too is named; the decoder's other errors (out of memory, a driver
    error on good data) are raised as they are, not blamed on the data. (A stand-in decoder: no GPU.)"""
    good = torch.frombuffer(bytearray(jpeg_bytes(images[0])), dtype=torch.uint8)
    bad = torch.frombuffer(bytearray(b"\xff\xd8 not a JPEG"), dtype=torch.uint8)
    cuda = torch.device("cuda")
    for error in (torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("nvjpeg: driver error")):
        def failing(payloads: list[torch.Tensor], device: torch.device, error: Exception = error) -> list:
            raise error

        monkeypatch.setattr(jpeg_batches, "_gpu_decoder", failing)
        with pytest.raises(type(error), match=str(error)):
            decode_jpegs([good, good], cuda)
    with pytest.raises(ValueError, match=r"^sample 1 of the batch is not a valid JPEG payload"):
        decode_jpegs([good, bad], cuda)
