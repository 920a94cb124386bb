"""reader.pinning: pinned copies made by the calling thread alone, byte for byte."""
from __future__ import annotations

import time

import pytest
import torch

from reader.pinning import copy_on_this_thread, pinned


@pytest.mark.parametrize("source", [
    torch.arange(3 * 5 * 7, dtype=torch.uint8).reshape(3, 5, 7),
    torch.tensor([-(2 ** 62), 7, 2 ** 40], dtype=torch.int64),
    torch.tensor([True, False, True]),
    torch.tensor([1.5, -0.25, 3e38], dtype=torch.bfloat16),
    torch.tensor(4.25),
    torch.empty(0, 3, dtype=torch.float32),
], ids=["uint8", "int64", "bool", "bfloat16", "0-d", "empty"])
def test_copy_is_exact_for_every_dtype_and_shape(source):
    copied = copy_on_this_thread(torch.zeros_like(source), source)
    assert copied.dtype == source.dtype and copied.shape == source.shape
    assert torch.equal(copied.view(-1).view(torch.uint8), source.view(-1).view(torch.uint8))  # bytes: NaN-proof


def test_copy_refuses_a_destination_of_another_shape_or_dtype():
    with pytest.raises(ValueError, match=r"cannot copy a torch.uint8 \(4,\) tensor into a torch.uint8 \(5,\) one"):
        copy_on_this_thread(torch.zeros(5, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"cannot copy a torch.int64 \(4,\) tensor into a torch.int32 \(4,\) one"):
        copy_on_this_thread(torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int64))


def test_copy_refuses_a_non_contiguous_destination():
    destination = torch.zeros(4, 3).t()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        copy_on_this_thread(destination, torch.arange(12.0).reshape(3, 4))
    assert not destination.any()


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
    """A batch-sized copy uses the calling thread's CPU only, where torch's ``copy_`` with two intra-op
    threads also runs (and then spins) the other one: the reason ``pinned`` does not call
    ``pin_memory()``."""
    source = torch.randint(0, 255, (256, 3, 224, 224), dtype=torch.uint8)
    destination = torch.empty_like(source)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        time.sleep(0.3)  # the spin of parallel work before this test ends (OpenMP's longest default: 0.2 s)
        mine, others_ours = _cpu_of_others(lambda: copy_on_this_thread(destination, source))
        _, others_torch = _cpu_of_others(lambda: destination.copy_(source))
    finally:
        torch.set_num_threads(threads)
    assert others_torch > 0.01, "torch's copy_ ran on one thread here: this check cannot tell them apart"
    assert others_ours < 0.25 * mine + 0.005, (mine, others_ours)
    assert torch.equal(destination, source)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_copies_into_page_locked_memory():
    source = torch.randint(0, 255, (16, 3, 32, 32), dtype=torch.uint8)
    copy = pinned(source)
    assert copy.is_pinned() and torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()
    assert pinned(copy) is copy
    strided = source.permute(0, 2, 3, 1)
    assert pinned(strided).is_pinned() and torch.equal(pinned(strided), strided)
    conjugate = torch.tensor([1 + 2j, -3j]).conj()
    assert torch.equal(pinned(conjugate), torch.tensor([1 - 2j, 3j]))
