"""reader.pinning: pinned copies made by the calling thread alone, byte for byte, in any dense layout."""
from __future__ import annotations

import time

import pytest
import torch

from reader import PackedDataset, make_loader
from reader.pinning import copied_on_this_thread, memory_span, pinned

IMAGES = torch.arange(2 * 3 * 4 * 5, dtype=torch.uint8).reshape(2, 3, 4, 5)


@pytest.mark.parametrize("source", [
    IMAGES,
    IMAGES.contiguous(memory_format=torch.channels_last),
    IMAGES.permute(0, 2, 3, 1),
    IMAGES[1:],
    torch.arange(12.0).reshape(3, 4).t(),
    torch.tensor([-(2 ** 62), 7, 2 ** 40], dtype=torch.int64),
    torch.tensor([True, False, True]),
    torch.tensor([1.5, -0.25, 3e38], dtype=torch.bfloat16),
    torch.tensor(4.25),
    torch.empty(0, 3, dtype=torch.float32),
    torch.empty(3, 0, dtype=torch.float32),
    torch.empty(2, 0, 3, dtype=torch.float32),
    torch.arange(6, dtype=torch.int32).as_strided((2, 1, 3), (3, 7, 1)),
], ids=["uint8", "channels-last", "permuted", "offset", "transposed", "int64", "bool", "bfloat16", "0-d",
        "empty", "empty-last", "empty-middle", "size-1-odd-stride"])
def test_copy_is_exact_for_every_dtype_shape_and_dense_layout(source):
    copied = copied_on_this_thread(source)
    assert copied is not None
    assert (copied.dtype, copied.shape, copied.stride()) == (source.dtype, source.shape, source.stride())
    assert source.numel() == 0 or copied.data_ptr() != source.data_ptr()
    span = memory_span(source)
    assert torch.equal(memory_span(copied).view(torch.uint8), span.view(torch.uint8))  # bytes: NaN-proof
    assert torch.equal(copied, source)


@pytest.mark.parametrize("source", [
    IMAGES[:, :, ::2],
    torch.zeros(3, 1).expand(3, 4),
    torch.tensor([1 + 2j, -3j]).conj(),
    torch.tensor([1.0, -2.0])._neg_view(),
    torch.tensor([5.0]).to_sparse(),
    torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged),
], ids=["stepped", "expanded", "conjugate", "negative", "sparse", "nested"])
def test_what_one_memcpy_cannot_copy_is_refused(source):
    assert copied_on_this_thread(source) is None


def test_memory_span_is_the_elements_in_memory_order():
    channels_last = IMAGES.contiguous(memory_format=torch.channels_last)
    assert torch.equal(memory_span(channels_last), IMAGES.permute(0, 2, 3, 1).reshape(-1))
    assert memory_span(IMAGES[:, :, ::2]) is None and memory_span(torch.zeros(2, 1).expand(2, 3)) is None


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
@pytest.mark.parametrize("evaluation", [False, True], ids=["training", "evaluation"])
def test_every_tensor_the_loader_pins_takes_the_one_memcpy(tmp_path, make_packed_dataset, monkeypatch,
                                                           encoding, evaluation):
    """Every tensor the loader pins (images, labels, an evaluation batch's index and validity) takes
    the one-thread copy, not ``pin_memory()``'s fallback: the JPEG batches are channels-last views of a
    worker's slot. Checked at the loader's own ``pinned`` calls, which here copy into unpinned memory
    (no CUDA needed)."""
    pinned_here: list[torch.Tensor] = []

    def one_memcpy(tensor: torch.Tensor) -> torch.Tensor:
        copy = copied_on_this_thread(tensor)
        assert copy is not None, (tensor.dtype, tensor.shape, tensor.stride())
        pinned_here.append(copy)
        return copy

    monkeypatch.setattr("reader.loader.pinned", one_memcpy)
    path = make_packed_dataset(tmp_path, resize=16, crop=16, encoding=encoding)
    loader = make_loader(PackedDataset(path), 4, num_workers=1, pin_memory=True, evaluation=evaluation)
    batches = list(loader)
    assert sum(len(batch[1]) for batch in batches) == 6
    assert len(pinned_here) == len(batches) * len(batches[0])


def _cpu_of_others(copy) -> tuple[float, float]:
    """(CPU seconds of this thread, CPU seconds of the process's other threads) over 6 copies 20 ms
    apart, as a loader pins batches between training steps."""
    process, thread = time.process_time(), time.thread_time()
    for _ in range(6):
        copy()
        time.sleep(0.02)
    mine = time.thread_time() - thread
    return mine, time.process_time() - process - mine


def test_copy_keeps_torchs_thread_team_idle():
    """A batch-sized copy of the loader's channels-last layout uses the calling thread's CPU only, where
    torch's ``copy_`` with two intra-op threads also runs (and then spins) the other one: the reason
    ``pinned`` does not call ``pin_memory()``."""
    source = torch.randint(0, 255, (256, 224, 224, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    destination = torch.empty_like(source)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        time.sleep(0.3)  # the spin of parallel work before this test ends (OpenMP's longest default: 0.2 s)
        mine, others_ours = _cpu_of_others(lambda: copied_on_this_thread(source))
        _, others_torch = _cpu_of_others(lambda: destination.copy_(source))
    finally:
        torch.set_num_threads(threads)
    assert others_torch > 0.01, "torch's copy_ ran on one thread here: this check cannot tell them apart"
    assert others_ours < 0.25 * mine + 0.005, (mine, others_ours)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_copies_into_page_locked_memory():
    source = torch.randint(0, 255, (16, 3, 32, 32), dtype=torch.uint8)
    copy = pinned(source)
    assert copy.is_pinned() and torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()
    assert pinned(copy) is copy
    channels_last = source.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    copy = pinned(channels_last)
    assert copy.is_pinned() and torch.equal(copy, channels_last) and copy.stride() == channels_last.stride()
    stepped = source[:, :, ::2]
    assert pinned(stepped).is_pinned() and torch.equal(pinned(stepped), stepped)
    conjugate = torch.tensor([1 + 2j, -3j]).conj()
    assert torch.equal(pinned(conjugate), torch.tensor([1 - 2j, 3j]))
