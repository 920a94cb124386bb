"""JPEG payloads decoded by libjpeg-turbo straight into a row of the caller's batch buffer.

Two bindings of the same library: simplejpeg, which holds the GIL while it decodes, and the system's
TurboJPEG through ctypes (``reader.format.turbojpeg``), which releases it so that threads of one process
decode in parallel. Both decode to the same pixels for the same flags (``tests/format/test_turbojpeg.py``).
A caller decoding on one thread gets simplejpeg: it is about 5% faster per image here (its bundled
libjpeg-turbo 3 against the system's 2.1, and no ctypes calls); callers decoding on several threads
ask for ``release_gil`` and get TurboJPEG where ``libturbojpeg0`` is installed, simplejpeg elsewhere.

``fast=True`` selects libjpeg-turbo's fast integer DCT and fast chroma upsampling. Measured on 224x224
q90 photos-like JPEGs on one core: 4,840 img/s against 4,470 img/s for the accurate path (+8%), for a
mean absolute difference of 1.7 grey levels from PIL's decode (the q90 encoding itself is 8.5 levels
from the source pixels, 8.6 with ``fast``).

Where the pixels go: libjpeg-turbo's x86 colour conversion and merged upsampling write an output row
with non-temporal stores (``vmovntdq``, past the cache, then an ``sfence`` at the end of each call) when
the row starts on a ``STORE_ALIGNMENT`` (32-byte, AVX2) boundary, and with ordinary stores otherwise
(``jdcolext-avx2.asm``, ``jdmrgext-avx2.asm``). For rows of a few hundred bytes that are read again soon
(the batch goes to the main process, then to the GPU), the ordinary stores are faster: on this
project's 2-core VM (AMD EPYC), 224x224 q90 records took 216 us against 244 us on the boundary (fast
path, median of 8 rounds; ``scripts/bench_decode_placement.py``, BENCHMARKS.md "Reading"). A batch
slot starts on a page (a private buffer on 64 bytes), and a 224 px row is 672 bytes (21 x 32), so
without care every row of every image was written past the cache. So a decode destination starts
``store_shift(address)`` bytes past its buffer's address: 16 bytes past a 32-byte boundary, still
16-byte aligned for whatever reads the pixels next (an SSE2-only CPU, whose libjpeg-turbo tests 16
bytes, keeps its non-temporal stores), and the images of a batch of mixed sizes each start
``padded_size`` bytes after the one before. Rows of a width whose 3 bytes a pixel are not a multiple
of 32 start at varying offsets, and some of them on the boundary.
"""
from __future__ import annotations

import numpy as np
import simplejpeg

from reader.format import turbojpeg

STORE_ALIGNMENT = 32  # rows starting on this boundary are written with non-temporal stores (module doc)
STORE_OFFSET = 16  # where a decode destination starts past such a boundary


def store_shift(address: int) -> int:
    """How many bytes past ``address`` a decode destination starts (0 to ``STORE_ALIGNMENT - 1``):
    ``STORE_OFFSET`` bytes past a ``STORE_ALIGNMENT`` boundary, where libjpeg-turbo writes its rows with
    ordinary stores (module docstring, "Where the pixels go")."""
    return (STORE_OFFSET - address) % STORE_ALIGNMENT


def placed_room(nbytes: int) -> int:
    """The bytes to allocate for ``nbytes`` of decode destination to fit once shifted by ``store_shift``."""
    return nbytes + STORE_ALIGNMENT


def placed_span(address: int, nbytes: int) -> slice:
    """Where in a buffer of ``placed_room(nbytes)`` bytes starting at ``address`` its ``nbytes`` of decode
    destination lie: from ``store_shift(address)``."""
    shift = store_shift(address)
    return slice(shift, shift + nbytes)


def padded_size(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``STORE_ALIGNMENT``: how far apart consecutive images of a
    batch start, so that all start alike."""
    return -(-nbytes // STORE_ALIGNMENT) * STORE_ALIGNMENT


def releases_gil() -> bool:
    """Whether ``decode_jpeg_into(..., release_gil=True)`` lets other threads run while it decodes."""
    return turbojpeg.available()


def decode_jpeg_into(payload: memoryview, out: np.ndarray, *, fast: bool, release_gil: bool = False) -> None:
    """Decode a JPEG into ``out``, a C-contiguous ``uint8 (H, W, 3)`` array of the image's exact size,
    with TurboJPEG when ``release_gil`` and it is available, else with simplejpeg.

    Raises ValueError when the bytes are not a JPEG or decode to a size other than ``out``'s.
    """
    if release_gil and turbojpeg.available():
        turbojpeg.decode_into(payload, out, fast=fast)
        return
    image = simplejpeg.decode_jpeg(
        payload, colorspace="RGB", fastdct=fast, fastupsample=fast, buffer=out
    )
    if image.shape != out.shape:
        raise ValueError(f"decodes to {image.shape[1]}x{image.shape[0]}, the record table says "
                         f"{out.shape[1]}x{out.shape[0]}")
