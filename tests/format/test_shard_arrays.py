"""Named arrays beside a shard's record table, through each container's own API: they round-trip, the
record table's offsets stay true when large arrays share the table's commit, and a missing or damaged
array is a ``FormatError`` naming the shard and the array."""
from __future__ import annotations

from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest

from reader.format import STORAGES, FormatError, container
from reader.format.compressed_arrays import compress_array
from reader.format.lmdb_shard import array_key

ARRAYS = {
    "ints": np.arange(-3, 3, dtype="<i8"),
    "floats": np.linspace(0, 1, 6, dtype="<f8"),
    "vectors": np.arange(12, dtype="<f4").reshape(6, 2),
    "bytes": np.frombuffer("dir/ü.png".encode(), dtype=np.uint8),
    # 1.6 MB that deflate cannot shrink: LMDB overflow pages in the table's commit
    "big": np.random.default_rng(0).integers(0, 1 << 62, 200_000, dtype="<i8"),
}


def write_shard(path: Path, arrays: dict[str, np.ndarray]) -> list[bytes]:
    """Six small payloads (inside LMDB leaf pages) and ``arrays``; returns the payloads."""
    payloads = [bytes([k]) * (100 + k) for k in range(6)]
    writer = container("lmdb" if path.suffix == ".lmdb" else "hdf5").writer(path)
    for k, payload in enumerate(payloads):
        writer.append(payload, k, 1, 1)
    writer.finish(arrays)
    return payloads


@pytest.mark.parametrize("storage", STORAGES)
def test_named_arrays_round_trip_and_the_table_offsets_stay_true(tmp_path: Path, storage: str) -> None:
    shard = tmp_path / f"shard{container(storage).suffix}"
    payloads = write_shard(shard, ARRAYS)
    size = shard.stat().st_size
    arrays = container(storage).read_arrays(shard, size, shard, dict.fromkeys(ARRAYS), compressed=True)
    for name, array in ARRAYS.items():
        assert arrays[name].dtype == array.dtype and np.array_equal(arrays[name], array), name
    table = container(storage).read_table(shard, shard, len(payloads), compressed=True)
    data = shard.read_bytes()
    assert [data[o : o + n] for o, n in zip(table["offset"].tolist(), table["nbytes"].tolist())] == payloads
    assert list(container(storage).read_records(shard, size, shard, table)) == payloads


@pytest.mark.parametrize("storage", STORAGES)
def test_a_missing_array_is_a_format_error_naming_the_shard_and_the_array(tmp_path: Path, storage: str) -> None:
    shard = tmp_path / f"shard{container(storage).suffix}"
    write_shard(shard, {"ints": ARRAYS["ints"]})
    with pytest.raises(FormatError, match=rf"^{shard}: .*(array 'absent'|/arrays/absent)"):
        container(storage).read_arrays(shard, shard.stat().st_size, shard, {"ints": 6, "absent": 6}, compressed=True)


def store(shard: Path, name: str, stored: np.ndarray | h5py.ExternalLink) -> None:
    """Put ``stored`` (compressed as a writer would) in place of the shard's array ``name``, as a damaged
    or hostile file would."""
    blob = stored if isinstance(stored, h5py.ExternalLink) else compress_array(stored)
    if shard.suffix == ".h5":
        with h5py.File(shard, "r+") as f:
            del f[f"arrays/{name}"]
            f[f"arrays/{name}"] = blob if isinstance(blob, h5py.ExternalLink) else np.frombuffer(blob, np.uint8)
        return
    env = lmdb.open(str(shard), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(array_key(name), blob)
    env.close()


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(("stored", "message"), [
    (np.zeros(3, dtype=[("a", "<i8"), ("b", "<f4")]), r"array ints has dtype .* not a plain column"),
    (np.zeros(3, dtype="<i2"), r"array ints has dtype int16 and shape \(3,\), not a plain column"),
    (np.zeros((2, 2, 2), dtype="<i8"), r"array ints has dtype int64 and shape \(2, 2, 2\), not a plain column"),
])
def test_an_array_of_another_dtype_or_shape_is_refused(
    tmp_path: Path, storage: str, stored: np.ndarray, message: str
) -> None:
    shard = tmp_path / f"shard{container(storage).suffix}"
    write_shard(shard, {"ints": ARRAYS["ints"]})
    store(shard, "ints", stored)
    with pytest.raises(FormatError, match=rf"^{shard}: {message}"):
        container(storage).read_arrays(shard, shard.stat().st_size, shard, {"ints": 6}, compressed=True)


def test_an_hdf5_array_linked_to_another_file_is_refused(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["ints"] = ARRAYS["ints"]
    shard = tmp_path / "shard.h5"
    write_shard(shard, {"ints": ARRAYS["ints"]})
    store(shard, "ints", h5py.ExternalLink(str(tmp_path / "other.h5"), "ints"))
    with pytest.raises(FormatError, match=rf"^{shard}: /arrays/ints is externallink, not a dataset stored in this"):
        container("hdf5").read_arrays(shard, shard.stat().st_size, shard, {"ints": 6}, compressed=True)


@pytest.mark.parametrize("storage", STORAGES)
def test_an_array_no_reader_accepts_is_refused_before_the_shard_is_finished(tmp_path: Path, storage: str) -> None:
    shard = tmp_path / f"shard{container(storage).suffix}"
    writer = container(storage).writer(shard)
    writer.append(b"x", 0, 1, 1)
    with pytest.raises(ValueError, match=rf"^{shard}: array names has dtype <U1 and shape \(1,\); a shard stores "
                                         r"int64, float64, float32, uint8 arrays of one or two dimensions$"):
        writer.finish({"ints": ARRAYS["ints"], "names": np.array(["a"])})
    writer.abort()
    assert list(tmp_path.iterdir()) == []
