"""``pinned``: a host tensor copied into pinned (page-locked) memory by the calling thread alone.

Why not ``Tensor.pin_memory()``: it copies with the calling thread's intra-op team, every core by
default, and after each parallel copy those threads spin-wait for more work (OpenMP's default wait
policy keeps each spinning for milliseconds). Pinning a 38 MB batch two dozen times a second then keeps
most of a 16-core machine's cores spinning in the training process, cores that the loader's workers
and the training step need. torch's own DataLoader avoids it by pinning on a thread it sets to one
intra-op thread, which also lowers the default of the threads torch starts later; the loader pins in
the training thread, whose setting is the user's. So the copy here is numpy's: one memcpy on one
thread, the GIL released while it runs, nothing changed for the caller. It takes any dense layout, not
only a contiguous one: the loader's image batches are channels-last (each image's HWC pixels viewed as
CHW), and the copy keeps the source's strides, as ``pin_memory()`` does. Destinations come from torch's
caching host allocator, as ``pin_memory()``'s do.
"""
from __future__ import annotations

import numpy as np
import torch


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when already pinned, else a pinned copy with its shape, strides and dtype; one
    that no single memcpy copies (see ``copied_on_this_thread``) is pinned by ``pin_memory()``, whose
    copy is multi-threaded."""
    if tensor.is_pinned():
        return tensor
    copy = copied_on_this_thread(tensor, pin_memory=True)
    return tensor.pin_memory() if copy is None else copy


def copied_on_this_thread(tensor: torch.Tensor, *, pin_memory: bool = False) -> torch.Tensor | None:
    """A copy of a CPU ``tensor`` with its shape, strides and dtype, made as one memcpy on the calling
    thread (into pinned memory with ``pin_memory``), detached from autograd; None where one memcpy
    cannot make it: not a plain strided CPU tensor (sparse, nested), elements that leave
    gaps or share memory (``memory_span``), or bytes that are not the values (a conjugate or negative
    view)."""
    if (tensor.layout != torch.strided or tensor.is_nested or tensor.device.type != "cpu"
            or tensor.is_conj() or tensor.is_neg()):
        return None
    span = memory_span(tensor)
    if span is None:
        return None
    flat = torch.empty(span.shape, dtype=tensor.dtype, pin_memory=pin_memory)
    np.copyto(_bytes_of(flat), _bytes_of(span))
    return flat.as_strided(tensor.shape, tensor.stride())


def memory_span(tensor: torch.Tensor) -> torch.Tensor | None:
    """The memory holding a tensor's elements, as a 1-d view of them in memory order, where they fill it
    without gaps or overlap in any order of dimensions (contiguous, channels-last, transposed, permuted);
    None where they do not (a slice with a step, an expanded tensor)."""
    if tensor.numel() > 0:
        expected = 1
        for stride, size in sorted((stride, size) for stride, size in zip(tensor.stride(), tensor.shape)
                                   if size != 1):
            if stride != expected:
                return None
            expected *= size
    return tensor.as_strided((tensor.numel(),), (1,))


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor of any dtype, as a numpy array sharing its memory (a
    non-contiguous one raises: ``view`` never copies)."""
    return tensor.detach().view(-1).view(torch.uint8).numpy()
