"""libjpeg-turbo's TurboJPEG API through ctypes: a JPEG decoder that releases the GIL while it decodes.

Why: simplejpeg holds the GIL for the whole decode, so two threads decode no faster than one. A
ctypes call releases the GIL for as long as the C function runs, so threads of one process decode
in parallel, straight into rows of the batch buffer (no copy, no process boundary per image).

The system library (Debian/Ubuntu package ``libturbojpeg0``) is loaded on first use; where it is
missing, ``available()`` is False and callers keep the simplejpeg path. Same flags as simplejpeg's
``fastdct``/``fastupsample``, so the same pixels (``tests/format/test_turbojpeg.py`` compares them).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading

import numpy as np

_TJPF_RGB = 0
_TJFLAG_FASTUPSAMPLE = 256
_TJFLAG_FASTDCT = 2048
_LIBRARY_NAMES = ("libturbojpeg.so.0", "turbojpeg")

_lib: ctypes.CDLL | None = None
_loaded = False
_local = threading.local()


def _library() -> ctypes.CDLL | None:
    """The TurboJPEG library with its signatures declared, or None when it cannot be loaded."""
    global _lib, _loaded
    if _loaded:
        return _lib
    _loaded = True
    for name in _LIBRARY_NAMES:
        path = name if name.endswith(".0") else ctypes.util.find_library(name)
        if not path:
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        lib.tjInitDecompress.restype = ctypes.c_void_p
        lib.tjInitDecompress.argtypes = []
        lib.tjDecompressHeader3.restype = ctypes.c_int
        lib.tjDecompressHeader3.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulong,
            ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        lib.tjDecompress2.restype = ctypes.c_int
        lib.tjDecompress2.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.tjGetErrorStr2.restype = ctypes.c_char_p
        lib.tjGetErrorStr2.argtypes = [ctypes.c_void_p]
        lib.tjDestroy.restype = ctypes.c_int
        lib.tjDestroy.argtypes = [ctypes.c_void_p]
        _lib = lib
        break
    return _lib


def available() -> bool:
    """Whether the TurboJPEG library could be loaded in this process."""
    return _library() is not None


def _handle(lib: ctypes.CDLL) -> int:
    """This thread's decompressor (TurboJPEG handles must not be shared between threads)."""
    handle = getattr(_local, "handle", None)
    if handle is None:
        handle = lib.tjInitDecompress()
        if not handle:
            raise MemoryError("tjInitDecompress failed")
        _local.handle = handle
    return handle


def decode_into(payload: memoryview, out: np.ndarray, *, fast: bool) -> None:
    """Decode a JPEG into ``out``, a C-contiguous ``uint8 (H, W, 3)`` array of the image's exact size.

    The GIL is released during the header parse and the decode. Raises ValueError when the bytes are
    not a JPEG (including one libjpeg-turbo only warns about, such as a truncated file) or decode to
    a size other than ``out``'s. Call only when ``available()``.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("libturbojpeg is not installed (check turbojpeg.available() first)")
    handle = _handle(lib)
    source = np.frombuffer(payload, dtype=np.uint8)
    source_ptr, size = source.ctypes.data, source.size
    width, height, subsampling, colorspace = (ctypes.c_int(), ctypes.c_int(), ctypes.c_int(),
                                              ctypes.c_int())
    if lib.tjDecompressHeader3(handle, source_ptr, size, ctypes.byref(width), ctypes.byref(height),
                               ctypes.byref(subsampling), ctypes.byref(colorspace)) != 0:
        raise _failure(lib, handle)
    if (height.value, width.value, 3) != out.shape:
        raise ValueError(f"decodes to {width.value}x{height.value}, the record table says "
                         f"{out.shape[1]}x{out.shape[0]}")
    flags = _TJFLAG_FASTDCT | _TJFLAG_FASTUPSAMPLE if fast else 0
    if lib.tjDecompress2(handle, source_ptr, size, out.ctypes.data, width.value, 3 * width.value,
                         height.value, _TJPF_RGB, flags) != 0:
        raise _failure(lib, handle)


def _failure(lib: ctypes.CDLL, handle: int) -> ValueError:
    """The error of a failed call; the handle is dropped (a failed decode can leave it unusable, so
    this thread's next call starts a fresh one)."""
    error = ValueError(lib.tjGetErrorStr2(handle).decode(errors="replace"))
    lib.tjDestroy(handle)
    _local.handle = None
    return error
