"""Damaged metadata: manifests of the wrong types, keys or encoding, and record tables whose rows lie.
Each is one ``FormatError`` naming the file (and the record), from the reader, ``info`` and ``verify``;
a shard replaced under an open dataset is noticed instead of served against the old table."""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Callable

import h5py
import lmdb
import numpy as np
import pytest
import torch
from hostile_cases import assert_all_refused, damaged_copies
from hostile_helpers import (
    assert_one_line_error,
    edit_manifest,
    first_shard,
    flip_bytes,
    run_cli,
    set_manifest_bytes,
    tables_in_containers,
)

import packer
from reader import PackedDataset
from reader.format import FormatError, container
from reader.format.compressed_arrays import compress_table
from reader.format.lmdb_shard import TABLE_KEY, array_key


@pytest.fixture(params=["lmdb", "hdf5"])
def packed(request: pytest.FixtureRequest, tmp_path: Path, make_packed_dataset: Callable[..., Path]) -> Path:
    """Six 16x16 raw records of two classes in two shards, record tables looked up in the containers."""
    return tables_in_containers(make_packed_dataset(tmp_path, storage=request.param, resize=16, crop=16,
                                                    shard_size=4 * 768))


def write_manifest_bytes(data: bytes, *words: str) -> Callable[[Path], tuple[str, ...]]:
    def damage(dst: Path) -> tuple[str, ...]:
        (dst / "manifest.json").write_bytes(data)
        return ("manifest.json", *words)
    return damage


def edit(change: Callable[[dict], object], *words: str) -> Callable[[Path], tuple[str, ...]]:
    def damage(dst: Path) -> tuple[str, ...]:
        edit_manifest(dst, change)
        return ("manifest.json", *words)
    return damage


def manifest_fifo(dst: Path) -> tuple[str, ...]:
    (dst / "manifest.json").unlink()
    os.mkfifo(dst / "manifest.json")
    return "manifest.json", "not a regular file"


def test_manifests_of_the_wrong_shape_are_one_format_error(tmp_path: Path, make_packed_dataset) -> None:
    packed = make_packed_dataset(tmp_path, resize=16, crop=16)
    text = (packed / "manifest.json").read_text()
    cases = damaged_copies(packed, {
        "latin-1 bytes": write_manifest_bytes(text.replace('"cat"', '"caf\xe9"').encode("latin-1")),
        "not JSON": write_manifest_bytes(text[: len(text) // 2].encode()),
        "deep nesting": write_manifest_bytes(b"[" * 200_000),
        "a list": write_manifest_bytes(b"[1, 2]"),
        "huge integer": write_manifest_bytes(
            text.replace('"format_version": 5', '"format_version": 5' + "0" * 5000).encode()),
        "a flipped byte in a class name": write_manifest_bytes(
            text.replace('"cat"', '"cbt"').encode(), "does not match its checksum", "damaged or edited"),
        "no checksum": write_manifest_bytes(
            json.dumps({k: v for k, v in json.loads(text).items() if k != "checksum"}).encode(), "'checksum'"),
        "class_to_idx disagrees": edit(lambda d: d.update(class_to_idx={"dog": 0, "cat": 1}),
                                       "class_to_idx does not agree with classes"),
        "30 million class names": write_manifest_bytes(
            text.replace('"classes": [', '"classes": [' + '"",' * 30_000_000).encode(),
            "JSON values, more than any manifest holds"),
        "records a string": edit(lambda d: d["shards"][0].update(records="3"), "shards[0].records", "str"),
        "negative bytes": edit(lambda d: d["shards"][0].update(bytes=-1), "negative"),
        "boolean records": edit(lambda d: d["shards"][0].update(records=True), "shards[0].records"),
        "shard without checksum": edit(lambda d: d["shards"][0].pop("checksum"), "shards[0]", "keys"),
        "shards a dict": edit(lambda d: d.update(shards={}), "shards", "dict"),
        "classes of ints": edit(lambda d: d.update(classes=[1, 2]), "classes[0]"),
        "duplicate classes": edit(lambda d: d.update(classes=["cat", "cat"]), "same name twice"),
        "shape of a string": edit(lambda d: d.update(shape=[3, "16", 16]), "shape"),
        "shape too large": edit(lambda d: d.update(shape=[3, 10**9, 10**9]), "shape"),
        "unknown storage": edit(lambda d: d.update(storage="zip"), "unknown storage 'zip'"),
        "missing classes": edit(lambda d: d.pop("classes"), "'classes'"),
        "unknown key": edit(lambda d: d.update(extra=1), "unknown manifest field 'extra'"),
        "shard listed twice": edit(lambda d: d["shards"].append(d["shards"][0]), "listed twice"),
        "skipped not a list": edit(lambda d: d["source"].update(skipped="all"), "source.skipped"),
        "FIFO": manifest_fifo,
    }, raising=("read", "info"), verify_raises=True)
    assert_all_refused(cases)
    for label in ("latin-1 bytes", "deep nesting", "records a string"):
        assert_one_line_error(run_cli("info", cases[label].path), "manifest.json")
        assert_one_line_error(run_cli("verify", cases[label].path, "--quiet"), "manifest.json")


def test_info_survives_an_unfamiliar_transform(tmp_path: Path, make_packed_dataset) -> None:
    packed = make_packed_dataset(tmp_path, resize=16, crop=16)
    edit_manifest(packed, lambda d: d.update(transform={"resize": [1, 2], "crop": "center"}))
    done = run_cli("info", packed)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "transform  unrecognised" in done.stdout


def rewrite_table(change: Callable[[np.ndarray, int], object], *words: str) -> Callable[[Path], tuple[str, ...]]:
    """Apply ``change(table, file_size)`` to the first shard's record table, store it, fix the manifest."""
    def damage(dst: Path) -> tuple[str, ...]:
        shard = first_shard(dst)
        table = container("lmdb" if shard.suffix == ".lmdb" else "hdf5").read_table(shard, shard, compressed=True)
        change(table, shard.stat().st_size)
        store_table(shard, table)
        set_manifest_bytes(dst, 0, shard.stat().st_size)
        return (shard.name, *words)
    return damage


def store_table(shard: Path, table: np.ndarray | bytes) -> None:
    """Put ``table`` (an array, stored compressed as the writer would, or stored bytes for LMDB) in place
    of the shard's record table."""
    if isinstance(table, np.ndarray):
        table = compress_table(table)
    if shard.suffix == ".h5":
        with h5py.File(shard, "r+") as f:
            del f["table"]
            f["table"] = np.frombuffer(table, np.uint8)
        return
    env = lmdb.open(str(shard), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(TABLE_KEY, table)
    env.close()


def set_row(record: int, **values: int) -> Callable[[np.ndarray, int], None]:
    def change(table: np.ndarray, file_size: int) -> None:
        for key, value in values.items():
            table[record][key] = value(table, file_size) if callable(value) else value
    return change


def one_row_short(dst: Path) -> tuple[str, ...]:
    edit_manifest(dst, lambda d: d["shards"][0].update(records=d["shards"][0]["records"] + 1))
    return first_shard(dst).name, "rows, the manifest says 5"


def test_lying_record_tables_are_refused_on_open(packed: Path) -> None:
    cases = damaged_copies(packed, {
        "label past the classes": rewrite_table(set_row(1, label=2), "record 1", "label is not a class index"),
        "negative label": rewrite_table(set_row(2, label=-1), "record 2", "label is not a class index"),
        "offset past the end": rewrite_table(set_row(1, offset=10**9), "record 1", "outside the file"),
        "offset wrapping around": rewrite_table(set_row(0, offset=2**64 - 5), "record 0", "outside the file"),
        "nbytes off by one": rewrite_table(set_row(2, nbytes=769), "record 2"),
        "zero height": rewrite_table(set_row(1, height=0), "record 1", "height or width is 0"),
        "overlapping records": rewrite_table(set_row(1, offset=lambda t, size: t[0]["offset"] + 8), "overlaps"),
        "one row short": one_row_short,
    })
    assert_all_refused(cases)


def npy_bytes(header: bytes) -> bytes:
    """A ``.npy`` version 1.0 file whose header dictionary is ``header`` and with no data."""
    header = header + b" " * (-(len(header) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header


def raw_lmdb_table(blob: bytes, *words: str) -> Callable[[Path], tuple[str, ...]]:
    def damage(dst: Path) -> tuple[str, ...]:
        shard = first_shard(dst)
        store_table(shard, blob)
        set_manifest_bytes(dst, 0, shard.stat().st_size)
        return (shard.name, *words)
    return damage


def test_damaged_npy_tables_never_allocate_or_leak_parser_errors(tmp_path: Path, make_packed_dataset) -> None:
    dst = tables_in_containers(make_packed_dataset(tmp_path, storage="lmdb", resize=16, crop=16, shard_size=4 * 768))
    dtype = "[('offset', '<u8'), ('nbytes', '<u8'), ('label', '<i8'), ('height', '<u4'), ('width', '<u4')]"
    assert_all_refused(damaged_copies(dst, {
        "a trillion rows": raw_lmdb_table(npy_bytes(
            f"{{'descr': {dtype}, 'fortran_order': False, 'shape': (1000000000000,), }}".encode()), "rows"),
        "unterminated header": raw_lmdb_table(npy_bytes(b"{'descr': '<u8', 'shape': (("), "not valid .npy"),
        "object dtype": raw_lmdb_table(npy_bytes(b"{'descr': '|O', 'fortran_order': False, 'shape': (4,), }"),
                                       "dtype object"),
        "not npy": raw_lmdb_table(b"garbage", "not valid .npy"),
        "not a zlib stream": raw_lmdb_table(npy_bytes(
            f"{{'descr': {dtype}, 'fortran_order': False, 'shape': (4,), }}".encode()) + b"\0" * 10,
            "not a valid compressed array"),
        "fewer bytes than the header says": raw_lmdb_table(npy_bytes(
            f"{{'descr': {dtype}, 'fortran_order': False, 'shape': (4,), }}".encode()) + zlib.compress(b"\0" * 100),
            "does not hold exactly the 128 bytes"),
        "bytes after the stream": raw_lmdb_table(npy_bytes(
            f"{{'descr': {dtype}, 'fortran_order': False, 'shape': (4,), }}".encode()) + zlib.compress(b"\0" * 128)
            + b"more", "does not hold exactly the 128 bytes"),
    }))


def raw_lmdb_array(name: str, blob: bytes, *words: str) -> Callable[[Path], tuple[str, ...]]:
    def damage(dst: Path) -> tuple[str, ...]:
        shard = first_shard(dst)
        env = lmdb.open(str(shard), subdir=False, lock=False)
        with env.begin(write=True) as txn:
            txn.put(array_key(name), blob)
        env.close()
        set_manifest_bytes(dst, 0, shard.stat().st_size)
        return (shard.name, *words)
    return damage


def test_damaged_npy_arrays_never_allocate_or_leak_parser_errors(tmp_path: Path, make_packed_dataset) -> None:
    """Shapes whose element count wraps around 64 bits, or has a negative side, against an empty body.
    The source column is read when asked for (``ds.source``), not to read pixels: ``verify`` reports it."""
    dst = make_packed_dataset(tmp_path, storage="lmdb", resize=16, crop=16, shard_size=4 * 768)
    damages = {
        f"shape {shape}": raw_lmdb_array("source.values", npy_bytes(
            f"{{'descr': '|u1', 'fortran_order': False, 'shape': {shape}, }}".encode()), "source.values")
        for shape in ("(4294967296, 4294967296)", "(-1, 0)", "(0, -5)")
    }
    damages["a billion bytes claimed by a 2-byte stream"] = raw_lmdb_array("source.values", npy_bytes(
        b"{'descr': '|u1', 'fortran_order': False, 'shape': (1000000000,), }") + b"\x78\xda",
        "source.values claims 1000000000 bytes, more than its 2 compressed bytes in a shard of")
    assert_all_refused(damaged_copies(dst, damages, raising=()))


def repack_with_other_labels(src: Path, dst: Path) -> None:
    """``pack --force`` into the same directory, with the classes swapped (cat becomes zebra)."""
    (src / "cat").rename(src / "zebra")
    packer.pack(src, dst, resize=16, crop=16, shard_size=4 * 768, workers=0, progress=False, force=True,
                storage=packer.info(dst).storage)


@pytest.mark.parametrize("tables", ["at table_offset", "in the container"])
def test_shard_replaced_under_an_open_dataset_is_noticed(
    tmp_path: Path, make_packed_dataset: Callable[..., Path], tables: str
) -> None:
    """A shard this process already has open is still the old file (its records still match the old
    table); one it opens after the repack is refused, whichever way its table is read."""
    packed = make_packed_dataset(tmp_path, storage="lmdb", resize=16, crop=16, shard_size=4 * 768)
    if tables == "in the container":
        tables_in_containers(packed)
    ds = PackedDataset(packed)
    first, label = ds[0]
    repack_with_other_labels(packed.with_name("images"), packed)
    with pytest.raises(FormatError, match=r"shard-00001\.\w+: shard file was replaced or changed since"):
        ds.read_batch([0, 5])
    again, again_label = ds[0]
    assert torch.equal(again, first) and again_label == label == 0
    fresh = PackedDataset(packed)
    assert fresh.classes == ["dog", "zebra"] and torch.equal(fresh[3][0], first) and fresh[3][1] == 1


def as_is(batch: object) -> object:
    return batch


def test_dataset_repacked_before_a_worker_opens_it_is_noticed(tmp_path: Path, make_packed_dataset) -> None:
    packed = make_packed_dataset(tmp_path, resize=16, crop=16, shard_size=4 * 768)
    ds = PackedDataset(packed)
    repack_with_other_labels(packed.with_name("images"), packed)
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=1,
                                         multiprocessing_context="spawn", collate_fn=as_is)
    with pytest.raises(FormatError, match=r"/manifest\.json: changed after the loader's process opened the dataset"):
        next(iter(loader))


def test_verify_full_refuses_a_flipped_payload_byte_that_tables_cannot_see(packed: Path) -> None:
    shard = first_shard(packed)
    offset = int(container(packer.info(packed).storage).read_table(shard, shard, compressed=True)[1]["offset"])
    flip_bytes(shard, np.array([offset + 100]))
    assert PackedDataset(packed)[1][1] == 0  # the label and table are intact; one pixel is not
    with pytest.raises(FormatError, match=rf"{shard.name}: checksum mismatch"):
        PackedDataset(packed, verify="full")
    with pytest.raises(ValueError, match="verify must be one of tables, full"):
        PackedDataset(packed, verify="deep")
