"""Batches of encoded JPEG records (``PackedDataset(decode=False)``) decoded where they are used.

A batch of encoded records is a list of 1-D uint8 tensors, each one record's JPEG bytes
(``reader.list_batches.is_encoded``). ``decode_jpegs`` turns such a
list into images on the consumer's device: on a CUDA device with torchvision's nvJPEG decoder
(``torchvision.io.decode_jpeg(list, device="cuda")``: one batched call, on the GPU's hardware JPEG
decoders where it has them, A100/H100/H200), else on the host with libjpeg-turbo
(``reader.format.jpeg_decode``) and then copied. So the same training loop runs with and without a
GPU decoder; only the speed differs.

torchvision's GPU decode blocks the calling thread until the batch is decoded (it synchronizes its
own stream before returning), which is why ``CUDAPrefetcher`` calls it on a thread of its own.
"""
from __future__ import annotations

import threading
import warnings
from typing import Callable

import torch

from reader.format.jpeg_decode import decode_jpeg_into

GpuDecoder = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]
_gpu_decoder: GpuDecoder | None | bool = False  # False: not looked up yet; None: there is none
_lookup = threading.Lock()


def gpu_decoder() -> GpuDecoder | None:
    """torchvision's batched nvJPEG decode, or None where torchvision does not import (not
    installed, or a build that does not match this torch). Looked up once per process."""
    global _gpu_decoder
    with _lookup:
        if _gpu_decoder is False:
            try:
                from torchvision.io import ImageReadMode, decode_jpeg
            except Exception:  # ImportError, or a torchvision built for another torch (RuntimeError, OSError)
                _gpu_decoder = None
            else:
                def decode(payloads: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
                    return decode_jpeg(payloads, mode=ImageReadMode.RGB, device=device)
                _gpu_decoder = decode
    return _gpu_decoder  # type: ignore[return-value]


def decode_jpegs(payloads: list[torch.Tensor], device: torch.device) -> torch.Tensor | list[torch.Tensor]:
    """The JPEG ``payloads`` (1-D uint8 CPU tensors) decoded to uint8 RGB images on ``device``: one
    ``[B, 3, H, W]`` tensor when they all have one size, else a list of ``[3, H_i, W_i]``.

    On CUDA with a GPU decoder the batch is decoded on the decoder's own stream, which the current
    stream then waits for, into images allocated on the current stream. A payload that is
    not a JPEG raises ``ValueError`` naming its position in the batch (``packer verify --deep`` names
    the record); the GPU decoder's other errors (out of memory, a driver error) are raised as they are.
    """
    decoder = gpu_decoder() if device.type == "cuda" else None
    images = None
    if decoder is not None:
        try:
            images = decoder([payload.contiguous() for payload in payloads], device)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            if "nvJPEG" in str(e) and "not compiled" in str(e):  # a torchvision without nvJPEG: decode on the host
                _no_gpu_decoder(str(e))
            else:  # a payload the host refuses too is named; else the GPU decoder's own error stands
                for position, payload in enumerate(payloads):
                    _host_decode(position, payload)
                raise
    if images is None:
        images = [_host_decode(k, payload).to(device, non_blocking=True) for k, payload in enumerate(payloads)]
    if len({tuple(image.shape) for image in images}) == 1:
        return torch.stack(images)
    return list(images)


def _no_gpu_decoder(reason: str) -> None:
    global _gpu_decoder
    warnings.warn(f"JPEG batches are decoded on the CPU: {reason.splitlines()[0]}", RuntimeWarning, stacklevel=3)
    with _lookup:
        _gpu_decoder = None


def _host_decode(position: int, payload: torch.Tensor) -> torch.Tensor:
    """One payload decoded by libjpeg-turbo to a ``[3, H, W]`` uint8 tensor (decoded straight into
    pinned memory when CUDA is there, so that its copy to the device is asynchronous), as
    ``PackedDataset`` decodes by default (``fast_decode=True``), and with the GIL released where the
    system's TurboJPEG is there, so that the training thread runs on meanwhile."""
    import simplejpeg  # reader.format.jpeg_decode's binding; its header reader gives the size

    data = payload.numpy().tobytes()
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        out = torch.empty((height, width, 3), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        decode_jpeg_into(memoryview(data), out.numpy(), fast=True, release_gil=True)
    except ValueError as e:
        raise ValueError(f"sample {position} of the batch is not a valid JPEG payload ({e})") from None
    return out.permute(2, 0, 1)
