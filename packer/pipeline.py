"""Decoding and encoding images on every core, handing the results back in plan order.

Work goes out in chunks of ``CHUNK_SIZE`` images to a pool of forked processes, with at most
``CHUNKS_PER_WORKER`` chunks per worker in flight, so memory stays bounded however slow the writer is.
Each image comes back as an ``Encoded`` payload or a ``Failure`` naming why it could not be read; the
caller decides whether a failure stops the pack. With ``workers <= 1`` the same code runs in-process.
"""
from __future__ import annotations

import multiprocessing
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Iterator, NamedTuple, Sequence

from PIL import Image

from packer.cleanup import leave_interrupts_to_the_parent
from packer.errors import PackError
from packer.transforms import SourceFileError, TransformSpec, encode, load_image

CHUNK_SIZE = 32
CHUNKS_PER_WORKER = 3


class Encoded(NamedTuple):
    """One image's record payload and its size."""

    payload: bytes
    height: int
    width: int


class Failure(NamedTuple):
    """Why one image could not be packed."""

    reason: str


def encode_file(path: str, spec: TransformSpec) -> Encoded | Failure:
    """Apply the pre-transform and the encoding to one file.

    Whatever exception reading a broken file makes PIL raise (it is not limited to ``OSError``) is that
    file's ``Failure``, so that one bad file can be skipped rather than stop the whole pack.
    """
    try:
        img = load_image(path, spec)
        payload = encode(img, spec.encoding, spec.quality)
    except Exception as e:
        return Failure(describe_failure(e))
    return Encoded(payload, img.height, img.width)


def encode_chunk(paths: Sequence[str], spec: TransformSpec) -> list[Encoded | Failure]:
    """``encode_file`` over a chunk of paths, in order (the unit of work sent to a worker process)."""
    return [encode_file(path, spec) for path in paths]


def encode_in_order(
    paths: Sequence[str], spec: TransformSpec, workers: int
) -> Iterator[Encoded | Failure]:
    """One result per path, in the order of ``paths``, computed by ``workers`` processes."""
    chunks = (paths[i : i + CHUNK_SIZE] for i in range(0, len(paths), CHUNK_SIZE))
    if workers <= 1:
        for chunk in chunks:
            yield from encode_chunk(chunk, spec)
        return
    executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=leave_interrupts_to_the_parent)
    try:
        pending: deque[Future[list[Encoded | Failure]]] = deque()
        for chunk in chunks:
            pending.append(executor.submit(encode_chunk, chunk, spec))
            if len(pending) >= workers * CHUNKS_PER_WORKER:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    except BrokenProcessPool as e:
        raise PackError(
            f"an image-encoding worker process died ({e}); if it ran out of memory, use fewer workers"
        ) from None
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def describe_failure(error: Exception) -> str:
    """A short reason for a file that could not be packed, from the exception reading it raised."""
    message = str(error)
    if isinstance(error, SourceFileError):
        return message
    if isinstance(error, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return f"decompression bomb ({message})"
    if isinstance(error, Image.UnidentifiedImageError):
        return "not an image, or an unsupported image format"
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return f"unreadable file ({error.strerror})"
    lowered = message.lower()
    if "truncated" in lowered or "broken data stream" in lowered or isinstance(error, EOFError):
        return f"truncated or corrupt image ({message or type(error).__name__})"
    return f"cannot decode image ({type(error).__name__}: {message})"
