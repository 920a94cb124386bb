"""``reader.format.compressed_arrays``: how a version-5 shard stores its record table and columns. Every
array the format stores round-trips exactly, and bytes that are not such an array are a ``FormatError``
naming the shard and the array, with nothing inflated beyond what the header claims."""
from __future__ import annotations

import io
import tracemalloc
import zlib

import numpy as np
import pytest

from reader.format import FormatError
from reader.format.compressed_arrays import compress_array, compress_table, decompress_column, decompress_table
from reader.format.records import RECORD_TABLE_DTYPE

RNG = np.random.default_rng(0)
FILE = 1 << 30  # the size of the shard file the arrays are said to come from


@pytest.mark.parametrize("array", [
    np.arange(-3, 3, dtype="<i8"),
    np.array([2**63 - 1, -(2**63), 0, 5], dtype="<i8"),  # differences that wrap around
    RNG.random(7),
    RNG.random((5, 3)).astype("<f4"),
    np.frombuffer("dir/ü.png".encode(), dtype=np.uint8),
    np.zeros(0, dtype="<i8"),
    np.zeros((0, 4), dtype="<f4"),
], ids=["ints", "extremes", "floats", "vectors", "bytes", "empty", "empty-boxes"])
def test_every_column_round_trips(array: np.ndarray) -> None:
    back = decompress_column(compress_array(array), "shard", "array a", FILE, len(array))
    assert back.dtype == array.dtype and back.shape == array.shape and back.tobytes() == array.tobytes()


def test_a_record_table_round_trips_and_takes_a_few_bytes_a_record() -> None:
    """Offsets stored as gaps after the previous payload (0 back to back, anything else too, even a
    wrap-around), sizes, labels and sides as they are."""
    count = 10_000
    table = np.zeros(count, RECORD_TABLE_DTYPE)
    table["nbytes"] = RNG.integers(1_000, 3_000, count)
    table["offset"] = 4096 + np.cumsum(table["nbytes"]) - table["nbytes"]
    table["offset"][5_000:] += 8192  # a chunk boundary
    table["label"] = np.sort(RNG.integers(0, 1000, count))
    table["height"], table["width"] = 224, 224
    stored = compress_table(table)
    assert len(stored) < 4 * count
    assert decompress_table(stored, "shard", count, FILE).tobytes() == table.tobytes()
    odd = table[:3].copy()
    odd["offset"] = [2**64 - 5, 3, 0]
    odd["nbytes"][1] = 2**64 - 1
    odd["label"] = [-1, 5, -(2**63)]
    assert decompress_table(compress_table(odd), "shard", 3, FILE).tobytes() == odd.tobytes()


def test_each_table_read_has_a_dtype_of_its_own() -> None:
    """A header is parsed once for all the tables that share it, yet a caller that renames its table's
    fields (numpy changes a structured dtype in place) changes no other table, read before or after."""
    table = np.zeros(4, RECORD_TABLE_DTYPE)
    table["nbytes"] = 10
    stored = compress_table(table)
    first, second = (decompress_table(stored, "shard", 4, FILE) for _ in range(2))
    first.dtype.names = ("a", "b", "c", "d", "e")
    assert second.dtype.names == RECORD_TABLE_DTYPE.names
    assert decompress_table(stored, "shard", 4, FILE).tobytes() == table.tobytes()


def npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": shape})
    return header.getvalue()


NOT_32 = "array a: its compressed stream does not hold exactly the 32 bytes"
NOT_0 = "array a: its compressed stream does not hold exactly the 0 bytes"


@pytest.mark.parametrize(("stored", "message"), [
    (npy_header("<i8", (4,)) + b"\0" * 10, r"array a is not a valid compressed array \(Error -3"),
    (npy_header("<i8", (4,)) + zlib.compress(bytes(16)), "array a: its compressed stream does not hold exactly "
     r"the 32 bytes its header says \(damaged\)"),
    (npy_header("<i8", (4,)) + zlib.compress(bytes(32)) + b"more", NOT_32),
    (npy_header("<i8", (4,)) + zlib.compress(bytes(40)), NOT_32),
    (npy_header("<i8", (4,)) + zlib.compress(bytes(32))[:-3], NOT_32),
    (npy_header("|u1", (10**6,)) + b"\x78\xda", "array a claims 1000000 bytes, more than its 2 compressed "
     "bytes in a shard of 1073741824 can hold"),
    (npy_header("|u1", (2**64, 0)) + zlib.compress(b""), r"array a has the impossible shape \(18446744073709551616, "),
    (npy_header("<i8", ()) + zlib.compress(bytes(8)), r"array a has dtype int64 and shape \(\), not a plain column"),
    (npy_header("|O", (2,)) + b"", "array a has dtype object"),
    (npy_header("<i2", (2,)) + zlib.compress(bytes(4)), r"array a has dtype int16 and shape \(2,\), not a plain"),
    (b"garbage", r"array a is not valid \.npy data"),
    (npy_header("<i8", (4,))[:30], r"array a is not valid \.npy data"),  # a header cut short
    (b"\x93NUMPY\x03\x00" + npy_header("<i8", (4,))[8:], r"array a is not valid \.npy data \(KeyError"),
])
def test_bytes_that_are_not_a_stored_array_are_refused(stored: bytes, message: str) -> None:
    with pytest.raises(FormatError, match=rf"^shard: {message}"):
        decompress_column(stored, "shard", "array a", FILE, None)


def test_a_stream_is_never_inflated_past_the_claimed_bytes() -> None:
    """Nothing claimed, 100 MB of zeros in a 100 KB stream: refused after inflating one byte."""
    stored = npy_header("<i8", (0,)) + zlib.compress(bytes(100_000_000))
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=rf"^shard: {NOT_0}"):
            decompress_column(stored, "shard", "array a", FILE, None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10_000_000


def test_a_stream_never_inflates_past_32_bytes_per_byte_of_its_shard() -> None:
    """Within deflate's ratio, a claim is still refused when the shard file could not hold the
    records it would describe: 100 KB of zeros claimed by a column of a 3,000-byte shard."""
    stored = compress_array(np.zeros(100_000, np.uint8))
    with pytest.raises(FormatError, match=r"^shard: array a claims 100000 bytes, more than its \d+ compressed bytes in "
                                          r"a shard of 3000 can hold \(damaged\)$"):
        decompress_column(stored, "shard", "array a", 3000, None)
    assert decompress_column(stored, "shard", "array a", 3125, None).size == 100_000


def test_a_column_of_other_rows_than_its_shard_is_refused_before_inflating() -> None:
    """A fixed-size column (or offsets) claiming a billion rows where the shard holds 6 is refused from
    its header, with a memory peak of a few MB."""
    stored = npy_header("<i8", (10**9,)) + zlib.compress(bytes(8000))
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=r"^shard: array a has shape \(1000000000,\), not the 6 rows of its "
                                              r"shard$"):
            decompress_column(stored, "shard", "array a", FILE, 6)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10_000_000
    assert decompress_column(compress_array(np.arange(6)), "shard", "array a", FILE, 6).tolist() == list(range(6))


def test_a_claim_near_the_limit_takes_twice_its_size_to_inflate() -> None:
    """The inflated bytes and the array, no more (no copies per step)."""
    array = np.arange(2_000_000, dtype="<i8")  # 16 MB
    stored = compress_array(array)
    tracemalloc.start()
    try:
        back = decompress_column(stored, "shard", "array a", FILE, None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(back, array) and peak < 2.2 * array.nbytes


def test_a_table_of_another_row_count_or_dtype_is_refused_before_inflating() -> None:
    table = np.zeros(3, RECORD_TABLE_DTYPE)
    with pytest.raises(FormatError, match=r"^shard: record table has 3 rows, the manifest says 4$"):
        decompress_table(compress_table(table), "shard", 4, FILE)
    with pytest.raises(FormatError, match=r"^shard: record table has dtype int64"):
        decompress_table(compress_array(np.zeros(3, "<i8")), "shard", 3, FILE)
