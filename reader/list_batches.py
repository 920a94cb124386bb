"""List batches: variable-size images, or encoded records, as a list of tensors that view one buffer.

``PackedDataset`` reads such a batch into one flat buffer (a ``make_loader`` batch slot) and returns
views of it, one per record: ``[3, H_i, W_i]`` images (``manifest.shape`` is null) or, with
``decode=False``, 1-D uint8 tensors holding each record's JPEG bytes. Decoded images are always 3-D,
so the two kinds never look alike (``is_encoded``). Moving such a list as its one buffer
(``moved_together``) costs one pin and one host-to-device copy, where moving each view costs 256 of
each for a batch of 256.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

# How much larger than its views' bytes a shared span may be and still be moved whole: a batch's views
# fill their buffer, but for a slot's few spare bytes and, between decoded JPEG images of mixed sizes, up
# to 31 bytes each (``reader.format.jpeg_decode.padded_size``).
MAX_SPAN_OVERHEAD = 1.25


def is_encoded(images: Any) -> bool:
    """Whether ``images`` is a batch of encoded records: a non-empty list of 1-D uint8 tensors."""
    return (isinstance(images, (list, tuple)) and len(images) > 0
            and all(isinstance(image, torch.Tensor) and image.dim() == 1 and image.dtype == torch.uint8
                    for image in images))


def shared_buffer(tensors: Sequence[Any]) -> tuple[torch.Tensor, int] | None:
    """The 1-D uint8 span of the one storage that every tensor of ``tensors`` views, and where it
    starts in that storage (elements); None when they are not all non-empty uint8 views of one
    storage, when there are fewer than two, or when the span holds much more than they do
    (``MAX_SPAN_OVERHEAD``: a few small views of a large buffer are moved one by one, not with it)."""
    if len(tensors) < 2 or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.numel() > 0
                                   for t in tensors):
        return None
    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() or t.device != tensors[0].device
           for t in tensors):
        return None
    extents = [(t.storage_offset(), t.storage_offset() + 1 + sum((size - 1) * stride for size, stride
                                                                  in zip(t.shape, t.stride()))) for t in tensors]
    start, end = min(a for a, _ in extents), max(b for _, b in extents)
    if end > storage.nbytes() or end - start > MAX_SPAN_OVERHEAD * sum(t.numel() for t in tensors):
        return None
    span = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage, start, (end - start,), (1,))
    return span, start


def moved_together(tensors: list[Any], move: Callable[[Any], Any]) -> list[Any]:
    """``[move(t) for t in tensors]``, done as one ``move`` of the buffer they share (``shared_buffer``)
    and views of its result with the same shapes and strides; item by item when they share none (or
    are not all tensors). ``move`` returns a contiguous copy of the 1-d span (``reader.pinning.pinned``,
    ``.to(device)``) or the span itself (``.to()`` the device it is on)."""
    shared = shared_buffer(tensors)
    if shared is None:
        return [move(tensor) for tensor in tensors]
    span, start = shared
    moved = move(span)
    return [moved.as_strided(t.shape, t.stride(), moved.storage_offset() + t.storage_offset() - start)
            for t in tensors]
