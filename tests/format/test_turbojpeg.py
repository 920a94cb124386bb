"""The GIL-releasing TurboJPEG decoder: the same pixels as simplejpeg, errors as ValueError, a
fallback where the library is missing, and threaded batch decodes equal to one-thread decodes."""
from __future__ import annotations

import ctypes
import io

import numpy as np
import pytest
import simplejpeg
from PIL import Image
from reader_helpers import make_images, pack_images

import reader.format.jpeg_decode
import reader.format.turbojpeg
from reader import PackedDataset
from reader.format import FormatError

needs_turbojpeg = pytest.mark.skipif(not reader.format.turbojpeg.available(),
                                     reason="libturbojpeg0 is not installed")


def jpeg(image: np.ndarray, subsampling: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, "JPEG", quality=90, subsampling=subsampling)
    return out.getvalue()


@pytest.fixture(scope="module")
def photos() -> list[np.ndarray]:
    return make_images(4, [(37, 29), (64, 48)])


@needs_turbojpeg
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("subsampling", [0, 2], ids=["4:4:4", "4:2:0"])
def test_same_pixels_as_simplejpeg(photos, fast, subsampling):
    for image in photos:
        payload = jpeg(image, subsampling)
        expected = simplejpeg.decode_jpeg(payload, colorspace="RGB", fastdct=fast, fastupsample=fast)
        out = np.full(image.shape, 7, np.uint8)
        reader.format.turbojpeg.decode_into(memoryview(payload), out, fast=fast)
        np.testing.assert_array_equal(out, expected)


@needs_turbojpeg
def test_bad_bytes_and_wrong_size_raise_value_error(photos):
    payload = jpeg(photos[0], 2)
    out = np.empty(photos[0].shape, np.uint8)
    with pytest.raises(ValueError):
        reader.format.turbojpeg.decode_into(memoryview(b"\0" * 64 + payload[64:]), out, fast=True)
    with pytest.raises(ValueError):
        reader.format.turbojpeg.decode_into(memoryview(payload[: len(payload) // 2]), out, fast=True)
    h, w, _ = photos[0].shape
    with pytest.raises(ValueError, match=f"decodes to {w}x{h}, the record table says {w + 1}x{h}"):
        reader.format.turbojpeg.decode_into(memoryview(payload), np.empty((h, w + 1, 3), np.uint8), fast=True)


@needs_turbojpeg
def test_library_calls_release_the_gil():
    """ctypes releases the GIL around calls into a ``CDLL`` (a ``PyDLL`` would keep it); the speed
    this buys is measured by the benchmark, not asserted here."""
    library = reader.format.turbojpeg._library()
    assert isinstance(library, ctypes.CDLL) and not isinstance(library, ctypes.PyDLL)


def test_without_turbojpeg_threads_decode_with_simplejpeg(tmp_path, monkeypatch, photos):
    packed = pack_images(tmp_path / "packed", photos, [0, 1, 0, 1], storage="lmdb", encoding="jpeg",
                         records_per_shard=10)
    with_library = PackedDataset(packed.path, decode_threads=2).read_batch([0, 1, 2, 3])[0]
    monkeypatch.setattr(reader.format.turbojpeg, "available", lambda: False)
    monkeypatch.setattr(reader.format.turbojpeg, "decode_into", None)
    assert not reader.format.jpeg_decode.releases_gil()
    without = PackedDataset(packed.path, decode_threads=2).read_batch([0, 1, 2, 3])[0]
    for a, b in zip(with_library, without):
        assert torch_equal(a, b)


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


@pytest.mark.parametrize("size", [[(24, 32)], [(24, 32), (17, 9)]], ids=["fixed", "variable"])
def test_decode_threads_give_the_same_batch(tmp_path, size, monkeypatch):
    calls = []
    real_decode = reader.format.turbojpeg.decode_into
    monkeypatch.setattr(reader.format.turbojpeg, "decode_into",
                        lambda *a, **k: calls.append(1) or real_decode(*a, **k))
    images = make_images(19, size)
    packed = pack_images(tmp_path / "packed", images, [i % 3 for i in range(19)], storage="lmdb",
                         encoding="jpeg", records_per_shard=8)
    order = [5, 0, 18, 3, 3, 11, 7, 1, 2, 4, 6, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    one, labels_one = PackedDataset(packed.path).read_batch(order)
    three, labels_three = PackedDataset(packed.path, decode_threads=3).read_batch(order)
    assert labels_one.tolist() == labels_three.tolist()
    assert len(calls) == (len(order) if reader.format.turbojpeg.available() else 0)
    for a, b in zip(one, three):
        assert torch_equal(a, b)


def test_decode_threads_report_the_bad_record(tmp_path):
    images = make_images(9, [(24, 32)])
    packed = pack_images(tmp_path / "packed", images, [0] * 9, storage="hdf5", encoding="jpeg",
                         records_per_shard=20)
    offset = int(PackedDataset(packed.path)._offsets[5])
    with open(packed.path / "part-00000-shard-00000.h5", "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * 64)
    ds = PackedDataset(packed.path, decode_threads=2)
    with pytest.raises(FormatError, match=r"part-00000-shard-00000\.h5: record 5 .*not a valid jpeg payload"):
        ds.read_batch(list(range(9)))
    with pytest.raises(ValueError, match="decode_threads must be positive, got 0"):
        PackedDataset(packed.path, decode_threads=0)
