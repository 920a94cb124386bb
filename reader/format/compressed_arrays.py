"""How a version-5 shard stores its record table and its named arrays: a ``.npy`` header, then the
array's bytes deflated (zlib) after two reversible steps that make them compress (delta-coded integers,
byte planes; the table's offsets as gaps). FORMAT.md ("Compressed arrays") specifies the bytes and
gives the figures: why (a plain table row and source path cost 64-76 bytes a record) and what they
cost now. ``compress_array``/``compress_table`` and ``decompress_column``/``decompress_table`` are the
only code that knows this encoding.

zlib level 6, its default: level 9 took 18 µs a record to deflate a table (20 times as long) for 3%
fewer bytes.

A stored array is input from whoever made the dataset. Decompressing checks the header (as for plain
``.npy`` bytes: ``records.npy_parts``), lets the caller refuse the dtype and shape before anything is
inflated, refuses a claim of more bytes than deflate can produce from the stream (1032 to 1) or than
``MAX_INFLATED_PER_FILE_BYTE`` times the shard file's size, and inflates exactly the claimed bytes.
"""
from __future__ import annotations

import io
import math
import zlib
from typing import Callable

import numpy as np

from reader.format.errors import FormatError
from reader.format.records import check_array_layout, check_table_layout, npy_parts

# deflate's longest match (258 bytes) costs at least 2 bits, so a stream inflates to at most about 1032
# times its size
MAX_DEFLATE_RATIO = 1032
# A stored array inflates to at most this many bytes per byte of its shard file: a record table's
# 32-byte row per record, and a record has a payload byte at least. A column larger than that would
# have to be as large in the file, unless it compresses over 32 to 1 and dwarfs the payloads.
MAX_INFLATED_PER_FILE_BYTE = 32
_LEVEL = 6


def compress_array(array: np.ndarray) -> bytes:
    """``array`` as a ``.npy`` header followed by the deflated, delta-coded, byte-shuffled values."""
    array = np.ascontiguousarray(array)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    flat = array.reshape(-1)
    planes = [_shuffled(_deltas(_field(flat, name))) for name in _field_names(array.dtype)]
    return header.getvalue() + zlib.compress(b"".join(planes), _LEVEL)


def compress_table(table: np.ndarray) -> bytes:
    """A record table as stored: each payload's offset as its gap after the previous payload's end
    (mostly 0: payloads lie back to back), then ``compress_array``."""
    return compress_array(_offsets_as_gaps(table))


def decompress_table(blob: bytes, shown: object, records: int | None, file_size: int) -> np.ndarray:
    """The record table ``compress_table`` stored as ``blob`` in a shard file of ``file_size`` bytes,
    of ``records`` rows when given."""
    def check(dtype: np.dtype, shape: tuple[int, ...], fortran: bool) -> None:
        check_table_layout(dtype, shape, shown, records, fortran)
    return _offsets_from_gaps(_decompress_array(blob, shown, "record table", check, file_size))


def decompress_column(blob: bytes, shown: object, what: str, file_size: int, rows: int | None) -> np.ndarray:
    """A named array (a record column) ``compress_array`` stored as ``blob`` in a shard file of
    ``file_size`` bytes, of a plain dtype and ``rows`` rows (None: any)."""
    def check(dtype: np.dtype, shape: tuple[int, ...], fortran: bool) -> None:
        check_array_layout(dtype, shape, shown, what, fortran)
        if rows is not None and shape[:1] != (rows,):
            raise FormatError(f"{shown}: {what} has shape {shape}, not the {rows} rows of its shard")
    return _decompress_array(blob, shown, what, check, file_size)


def _decompress_array(
    blob: bytes, shown: object, what: str, check_layout: Callable[[np.dtype, tuple[int, ...], bool], None],
    file_size: int,
) -> np.ndarray:
    """The array ``compress_array`` stored as ``blob``; ``FormatError`` naming ``shown`` and ``what``
    for anything else. ``check_layout(dtype, shape, fortran)`` refuses a header the caller does not
    accept before anything is inflated."""
    shape, fortran, dtype, stream = npy_parts(blob, shown, what)
    check_layout(dtype, shape, fortran)
    limit = min(MAX_DEFLATE_RATIO * (len(stream) + 1), MAX_INFLATED_PER_FILE_BYTE * file_size)
    nbytes = math.prod(shape) * dtype.itemsize  # Python integers: a huge shape cannot wrap around
    if nbytes > limit:
        raise FormatError(f"{shown}: {what} claims {nbytes} bytes, more than its {len(stream)} compressed "
                          f"bytes in a shard of {file_size} can hold (damaged)")
    if min(shape, default=0) < 0 or max(shape, default=0) > limit:  # (2**64, 0): no bytes, yet no array
        raise FormatError(f"{shown}: {what} has the impossible shape {shape} (damaged)")
    planes = np.frombuffer(_inflate_exactly(stream, nbytes, shown, what), dtype=np.uint8)
    flat = np.empty(math.prod(shape), dtype=dtype)
    start = 0
    for name in _field_names(dtype):
        field = _field(flat, name)
        size = field.size * field.dtype.itemsize
        _unshuffle_into(field, planes[start:start + size])
        start += size
    return flat.reshape(shape)


def _offsets_as_gaps(table: np.ndarray) -> np.ndarray:
    """A copy of ``table`` whose ``offset`` is each payload's gap after the previous one's end (the
    first: its offset), in wrapping unsigned arithmetic so that any table round-trips exactly."""
    stored = table.copy()
    ends = table["offset"] + table["nbytes"]
    stored["offset"][1:] = table["offset"][1:] - ends[:-1]
    return stored


def _offsets_from_gaps(stored: np.ndarray) -> np.ndarray:
    """The table ``_offsets_as_gaps`` stored, its offsets back from the gaps and the lengths, in place
    (``stored`` is the array just inflated)."""
    offsets = stored["offset"]
    offsets[1:] += stored["nbytes"][:-1]
    np.cumsum(offsets, dtype=np.uint64, out=offsets)
    return stored


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


def _unshuffle_into(field: np.ndarray, planes: np.ndarray) -> None:
    """Fill ``field`` (one dtype field of the inflated array) from its byte ``planes``, undoing the
    deltas. A plain array's bytes are written in place (a structured field goes through one copy), so
    inflating holds the inflated bytes and the array, twice the claim, no more."""
    itemsize, count = field.dtype.itemsize, field.size
    values = field if field.flags.c_contiguous else np.empty(count, dtype=field.dtype)
    values.view(np.uint8).reshape(count, itemsize)[...] = planes.reshape(itemsize, count).T
    if _is_delta_coded(field.dtype) and count:
        unsigned = values.view(field.dtype.str.replace("i", "u"))
        np.cumsum(unsigned, dtype=unsigned.dtype, out=unsigned)
    if values is not field:
        field[...] = values


def _shuffled(values: np.ndarray) -> bytes:
    """The values' bytes as planes: every value's byte 0, then every value's byte 1, ..."""
    return values.view(np.uint8).reshape(values.size, values.dtype.itemsize).T.tobytes()

