"""``pinned``: a host tensor copied into pinned (page-locked) memory by the calling thread alone.

Why not ``Tensor.pin_memory()``: it copies with the calling thread's intra-op team, every core by
default, and after each parallel copy those threads spin-wait for more work (OpenMP's default wait
policy keeps each spinning for milliseconds). Pinning a 38 MB batch two dozen times a second then keeps
most of a 16-core machine's cores spinning in the training process, cores that the loader's workers
and the training step need. torch's own DataLoader avoids it by pinning on a thread it sets to one
intra-op thread, which also lowers the default of the threads torch starts later; the loader pins in
the training thread, whose setting is the user's. So the copy here is numpy's: one thread, the GIL
released while it runs, nothing changed for the caller. Destinations come from torch's caching host
allocator, as ``pin_memory()``'s do.
"""
from __future__ import annotations

import numpy as np
import torch


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when already pinned, else a pinned copy with its shape and dtype; a
    non-contiguous tensor, or a conjugate or negative view (whose bytes are not its values), is pinned
    by ``pin_memory()`` (its strides kept, its copy multi-threaded)."""
    if tensor.is_pinned():
        return tensor
    if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        return tensor.pin_memory()
    return copy_on_this_thread(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True), tensor)


def copy_on_this_thread(destination: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Copy contiguous ``source`` into contiguous ``destination`` (same shape and dtype, both on the
    CPU) as one memcpy on the calling thread, and return ``destination``; a non-contiguous one is a
    ``RuntimeError`` from torch."""
    if destination.shape != source.shape or destination.dtype != source.dtype:
        raise ValueError(f"cannot copy a {source.dtype} {tuple(source.shape)} tensor into a "
                         f"{destination.dtype} {tuple(destination.shape)} one")
    np.copyto(_bytes_of(destination), _bytes_of(source))
    return destination


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor of any dtype, as a numpy array sharing its memory (a
    non-contiguous one raises: ``view`` never copies)."""
    return tensor.detach().view(-1).view(torch.uint8).numpy()
