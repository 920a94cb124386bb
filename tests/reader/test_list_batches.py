"""List batches (variable-size images, encoded records) are moved as the one buffer their tensors view."""
from __future__ import annotations

import torch

from reader.list_batches import moved_together, shared_buffer


def views_of_one_buffer() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Three images ``[3, H, W]`` and a payload viewing one flat buffer, HWC images permuted to CHW
    (the layout of a decoded variable-size batch), after 5 bytes the batch does not use."""
    flat = torch.arange(5 + 3 * 2 * 4 + 3 * 3 * 2 + 7 + 3 * 1 * 1, dtype=torch.int64).to(torch.uint8)
    sizes = [3 * 2 * 4, 3 * 3 * 2, 7, 3]
    parts = flat[5:].split(sizes)
    return flat, [parts[0].view(2, 4, 3).permute(2, 0, 1), parts[1].view(3, 3, 2), parts[2], parts[3].view(3, 1, 1)]


def test_views_of_one_buffer_move_as_one_copy() -> None:
    flat, tensors = views_of_one_buffer()
    span, start = shared_buffer(tensors)
    assert start == 5 and torch.equal(span, flat[5:])
    calls = []

    def move(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.numel())
        return tensor.clone()

    moved = moved_together(tensors, move)
    assert calls == [len(flat) - 5]
    for got, want in zip(moved, tensors):
        assert torch.equal(got, want) and got.stride() == want.stride()
        assert got.untyped_storage().data_ptr() == moved[0].untyped_storage().data_ptr()
    flat[5:] = 0
    assert all(got.any() for got in moved[:2]), "the copies are apart from the source buffer"


def test_tensors_of_several_buffers_move_one_by_one() -> None:
    _, tensors = views_of_one_buffer()
    apart = [tensors[0], tensors[1].clone()]
    assert shared_buffer(apart) is None
    assert shared_buffer(tensors[:1]) is None
    assert shared_buffer([tensors[0], tensors[1].float()]) is None
    calls = []
    moved = moved_together(apart, lambda tensor: calls.append(1) or tensor.clone())
    assert len(calls) == 2 and all(torch.equal(got, want) for got, want in zip(moved, apart))


def test_a_move_that_returns_its_input_keeps_the_views() -> None:
    """``.to(device)`` to the device a batch is already on returns it as it is (the CPU prefetcher)."""
    _, tensors = views_of_one_buffer()
    moved = moved_together(tensors, lambda tensor: tensor.to("cpu"))
    assert all(torch.equal(got, want) and got.data_ptr() == want.data_ptr() for got, want in zip(moved, tensors))


def test_a_few_small_views_of_a_large_buffer_move_one_by_one() -> None:
    big = torch.zeros(1 << 20, dtype=torch.uint8)
    assert shared_buffer([big[:10], big[-10:]]) is None
    assert shared_buffer([big[:10], big[10:30]]) is not None
