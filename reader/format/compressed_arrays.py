"""How a version-5 shard stores its record table and its named arrays: a ``.npy`` header, then the
array's bytes deflated (zlib) after two reversible steps that make them compress.

Why: stored as plain rows and columns, a record's table row (32 bytes), its source path (the path's
bytes and an 8-byte offset) and its fields cost 60-80 bytes a record, 3-5% of a 1.6-2.2 KB JPEG. The
columns are regular: offsets grow by small steps, labels and sizes repeat, paths share their folders.
Stored this way, the table and the source column take 2-6 bytes a record.

The steps, applied to each field of the array's dtype (a plain dtype is one field), in C order:

1. *delta*: an integer field wider than one byte is stored as its first value and then each value
   minus the one before, modulo 2^bits (a run of equal values becomes zeros; offsets become lengths);
2. *byte shuffle*: the field's values, ``itemsize`` bytes each, are stored as ``itemsize`` planes: every
   value's first byte, then every value's second byte, ... (the high bytes, mostly zero, form runs).

The fields' planes follow one another in the dtype's order, and the whole is one zlib stream (zlib is in
Python's standard library). Level 6, zlib's default: level 9 took 18 µs a record to deflate a table
(20 times as long) for 3% fewer bytes. Inflating takes about 0.15 µs a record. ``compress_array`` and
``decompress_array`` are the only code that knows this encoding.

A stored array is input from whoever made the dataset: ``decompress_array`` checks the header (as for
plain ``.npy`` bytes: ``records._npy_parts``), lets the caller refuse the dtype and shape before
anything is inflated, refuses a header claiming more bytes than deflate can produce from the stream
(1032 to 1) and inflates exactly the claimed bytes, no more.
"""
from __future__ import annotations

import io
import math
import zlib
from typing import Callable

import numpy as np

from reader.format.errors import FormatError
from reader.format.records import (
    check_array_layout,
    check_table_layout,
    npy_parts,
    offsets_as_gaps,
    offsets_from_gaps,
)

# deflate's longest match (258 bytes) costs at least 2 bits, so a stream inflates to at most about 1032
# times its size
MAX_DEFLATE_RATIO = 1032
_LEVEL = 6


def compress_array(array: np.ndarray) -> bytes:
    """``array`` as a ``.npy`` header followed by the deflated, delta-coded, byte-shuffled values."""
    array = np.ascontiguousarray(array)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    flat = array.reshape(-1)
    planes = [_shuffled(_deltas(_field(flat, name))) for name in _field_names(array.dtype)]
    return header.getvalue() + zlib.compress(b"".join(planes), _LEVEL)


def decompress_array(
    blob: bytes, shown: object, what: str, check_layout: Callable[[np.dtype, tuple[int, ...], bool], None],
) -> np.ndarray:
    """The array ``compress_array`` stored as ``blob``; ``FormatError`` naming ``shown`` and ``what``
    for anything else. ``check_layout(dtype, shape, fortran)`` refuses a header the caller does not
    accept before anything is inflated."""
    shape, fortran, dtype, stream = npy_parts(blob, shown, what)
    check_layout(dtype, shape, fortran)
    if min(shape, default=0) < 0:
        raise FormatError(f"{shown}: {what} has a negative dimension {shape}")
    nbytes = math.prod(shape) * dtype.itemsize  # Python integers: a huge shape cannot wrap around
    if nbytes > MAX_DEFLATE_RATIO * len(stream) + MAX_DEFLATE_RATIO:
        raise FormatError(f"{shown}: {what} claims {nbytes} bytes, more than its {len(stream)} compressed "
                          "bytes can hold (damaged)")
    data = _inflate_exactly(stream, nbytes, shown, what)
    flat = np.empty(math.prod(shape), dtype=dtype)
    start = 0
    for name in _field_names(dtype):
        field = _field(flat, name)
        size = field.size * field.dtype.itemsize
        field[...] = _undeltas(_unshuffled(data[start:start + size], field.dtype))
        start += size
    return flat.reshape(shape)


def compress_table(table: np.ndarray) -> bytes:
    """A record table as stored: each payload's offset as its gap after the previous payload's end
    (mostly 0: payloads lie back to back), then ``compress_array``."""
    return compress_array(offsets_as_gaps(table))


def decompress_table(blob: bytes, shown: object, records: int | None) -> np.ndarray:
    """The record table ``compress_table`` stored as ``blob``, of ``records`` rows when given."""
    def check(dtype: np.dtype, shape: tuple[int, ...], fortran: bool) -> None:
        check_table_layout(dtype, shape, shown, records, fortran)
    return offsets_from_gaps(decompress_array(blob, shown, "record table", check))


def decompress_column(blob: bytes, shown: object, what: str) -> np.ndarray:
    """A named array (a record column) ``compress_array`` stored as ``blob``, of a plain dtype."""
    def check(dtype: np.dtype, shape: tuple[int, ...], fortran: bool) -> None:
        check_array_layout(dtype, shape, shown, what, fortran)
    return decompress_array(blob, shown, what, check)


def _inflate_exactly(stream: bytes, nbytes: int, shown: object, what: str) -> bytes:
    """The ``nbytes`` bytes the zlib ``stream`` holds, which must end right after them."""
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(stream, max(nbytes, 1))  # a max_length of 0 would inflate everything
        ended = inflater.eof or (not inflater.decompress(inflater.unconsumed_tail, 1) and inflater.eof)
    except zlib.error as e:
        raise FormatError(f"{shown}: {what} is not a valid compressed array ({e})") from None
    if len(data) != nbytes or not ended or inflater.unused_data:
        raise FormatError(f"{shown}: {what}: its compressed stream does not hold exactly the {nbytes} bytes "
                          "its header says (damaged)")
    return data


def _field_names(dtype: np.dtype) -> list[str | None]:
    """The fields stored one after another: a structured dtype's names, or None for a plain dtype."""
    return list(dtype.names) if dtype.names else [None]


def _field(flat: np.ndarray, name: str | None) -> np.ndarray:
    return flat if name is None else flat[name]


def _is_delta_coded(dtype: np.dtype) -> bool:
    return dtype.kind in "iu" and dtype.itemsize > 1


def _deltas(values: np.ndarray) -> np.ndarray:
    """Integer values after the first as differences, in unsigned arithmetic (wrapping, so exact)."""
    if not _is_delta_coded(values.dtype) or values.size == 0:
        return np.ascontiguousarray(values)
    unsigned = np.ascontiguousarray(values).view(values.dtype.str.replace("i", "u"))
    return np.concatenate([unsigned[:1], np.diff(unsigned)])


def _undeltas(values: np.ndarray) -> np.ndarray:
    if not _is_delta_coded(values.dtype) or values.size == 0:
        return values
    unsigned = values.view(values.dtype.str.replace("i", "u"))
    return np.cumsum(unsigned, dtype=unsigned.dtype).view(values.dtype)


def _shuffled(values: np.ndarray) -> bytes:
    """The values' bytes as planes: every value's byte 0, then every value's byte 1, ..."""
    return values.view(np.uint8).reshape(values.size, values.dtype.itemsize).T.tobytes()


def _unshuffled(planes: bytes, dtype: np.dtype) -> np.ndarray:
    count = len(planes) // dtype.itemsize
    return np.frombuffer(planes, np.uint8).reshape(dtype.itemsize, count).T.copy().view(dtype).reshape(count)
