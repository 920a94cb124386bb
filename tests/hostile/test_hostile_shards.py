"""Damaged and hostile shard files: truncations, names that leave the dataset, non-regular files,
HDF5 links to other files. Each case ends in a ``FormatError`` from the reader, a problem from
``verify`` and one CLI error line, all naming the shard; never a SIGBUS, a hang or a traceback."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest
from hostile_cases import assert_all_refused, damaged_copies
from hostile_helpers import (
    assert_one_line_error,
    edit_manifest,
    first_shard,
    run_cli,
    set_manifest_bytes,
    tables_in_containers,
)

import packer
from reader import PackedDataset
from reader.format import DatasetWriter, FormatError

FRACTIONS = [0.0, 0.1, 0.5, 0.9, 0.999]


@pytest.fixture(params=["lmdb", "hdf5"])
def packed(request: pytest.FixtureRequest, tmp_path: Path, make_packed_dataset: Callable[..., Path]) -> Path:
    """Six 16x16 raw records in two shards, record tables looked up in the containers."""
    return tables_in_containers(make_packed_dataset(tmp_path, storage=request.param, resize=16, crop=16,
                                                    shard_size=4 * 768))


def truncate(fraction: float, hide: bool) -> Callable[[Path], tuple[str, ...]]:
    """Cut the first shard to ``fraction`` of its size; ``hide``: and make the manifest agree."""
    def damage(dst: Path) -> tuple[str, ...]:
        shard = first_shard(dst)
        size = int(shard.stat().st_size * fraction)
        os.truncate(shard, size)
        if hide:
            set_manifest_bytes(dst, 0, size)
        return (shard.name,)
    return damage


def test_truncated_shards_are_refused_before_mapping(packed: Path) -> None:
    cases = damaged_copies(packed, {f"truncated to {f}": truncate(f, hide=False) for f in FRACTIONS})
    assert_all_refused(cases)
    truncated = cases["truncated to 0.5"].path
    assert_one_line_error(run_cli("verify", truncated, "--deep", "--quiet"), str(truncated), "problems")


def test_truncations_hidden_in_the_manifest_are_refused(packed: Path) -> None:
    """The author edited the manifest to the truncated size: the container's own header is checked (a
    shard of 0 bytes cannot hold its records: the manifest itself is refused)."""
    cases = damaged_copies(packed, {f"truncated to {f}": truncate(f, hide=True) for f in FRACTIONS})
    cases["truncated to 0.0"].verify_raises = True
    assert_all_refused(cases)


def rename_shard(name: str) -> Callable[[Path], tuple[str, ...]]:
    def damage(dst: Path) -> tuple[str, ...]:
        edit_manifest(dst, lambda data: data["shards"][0].update(file=name))
        return "manifest.json", "not a plain file name"
    return damage


def test_shard_names_leaving_the_dataset_are_refused(tmp_path: Path, make_packed_dataset) -> None:
    packed = make_packed_dataset(tmp_path, resize=16, crop=16)
    names = ["../other/shard-00000.lmdb", "/etc/passwd", "/dev/zero", "..", ".", "", "sub/shard.lmdb"]
    cases = damaged_copies(packed, {name: rename_shard(name) for name in names},
                           raising=("read", "info"), verify_raises=True)
    assert_all_refused(cases)
    assert_one_line_error(run_cli("info", cases["/etc/passwd"].path), "/etc/passwd", "not a plain file name")


def replace_shard(make: Callable[[Path], None], kind: str) -> Callable[[Path], tuple[str, ...]]:
    def damage(dst: Path) -> tuple[str, ...]:
        shard = first_shard(dst)
        shard.unlink()
        make(shard)
        return shard.name, kind
    return damage


def test_non_regular_shards_are_never_opened(packed: Path, tmp_path: Path) -> None:
    genuine = tmp_path / "genuine-shard"
    genuine.write_bytes(first_shard(packed).read_bytes())
    cases = damaged_copies(packed, {
        "fifo": replace_shard(os.mkfifo, "a FIFO"),
        "link to /dev/zero": replace_shard(lambda p: p.symlink_to("/dev/zero"), "a symlink"),
        "link to /etc/passwd": replace_shard(lambda p: p.symlink_to("/etc/passwd"), "a symlink"),
        "link to a genuine shard elsewhere": replace_shard(lambda p: p.symlink_to(genuine), "a symlink"),
        "directory": replace_shard(Path.mkdir, "a directory"),
    })
    assert_all_refused(cases)
    assert_one_line_error(run_cli("verify", cases["fifo"].path, "--quiet"), "problems")


def external_link(f: h5py.File, table: np.ndarray, outside: Path) -> None:
    with h5py.File(outside, "w") as other:
        other["table"] = table
    f["table"] = h5py.ExternalLink(str(outside), "/table")


def soft_link(f: h5py.File, table: np.ndarray, outside: Path) -> None:
    f["hidden"] = table
    f["table"] = h5py.SoftLink("/hidden")


def external_storage(f: h5py.File, table: np.ndarray, outside: Path) -> None:
    outside.write_bytes(table.tobytes())
    f.create_dataset("table", shape=table.shape, dtype=table.dtype, external=[(str(outside), 0, h5py.h5f.UNLIMITED)])


def virtual_dataset(f: h5py.File, table: np.ndarray, outside: Path) -> None:
    with h5py.File(outside, "w") as other:
        other["table"] = table
    layout = h5py.VirtualLayout(shape=table.shape, dtype=table.dtype)
    layout[:] = h5py.VirtualSource(str(outside), "table", shape=table.shape)
    f.create_virtual_dataset("table", layout)


def relink_table(
    make: Callable[[h5py.File, np.ndarray, Path], None], what: str
) -> Callable[[Path], tuple[str, ...]]:
    """Replace ``/table`` of the first HDF5 shard by what ``make`` builds, and fix the manifest's size."""
    def damage(dst: Path) -> tuple[str, ...]:
        shard = first_shard(dst)
        with h5py.File(shard, "r+") as f:
            table = f["table"][()]
            del f["table"]
            make(f, table, dst.parent / f"{dst.name}-outside")
        set_manifest_bytes(dst, 0, shard.stat().st_size)
        return shard.name, what
    return damage


def compressed_table_bomb(dst: Path) -> tuple[str, ...]:
    """An HDF5-compressed ``/table`` of a million bytes (gzip chunks of HDF5's own) in a file of a few KB,
    and a manifest that agrees with it: refused before it is inflated, as every chunked dataset is."""
    def bomb(f: h5py.File, table: np.ndarray, outside: Path) -> None:
        f.create_dataset("table", shape=(1_000_000,), dtype=table.dtype, chunks=(100_000,), compression="gzip")
    return relink_table(bomb, "is stored in chunks")(dst)


def test_hdf5_tables_in_other_files_are_refused(tmp_path: Path, make_packed_dataset: Callable[..., Path]) -> None:
    dst = tables_in_containers(make_packed_dataset(tmp_path, storage="hdf5", resize=16, crop=16, shard_size=10**6))
    assert_all_refused(damaged_copies(dst, {
        "external link": relink_table(external_link, "externallink"),
        "soft link": relink_table(soft_link, "softlink"),
        "external raw storage": relink_table(external_storage, "external files"),
        "virtual dataset": relink_table(virtual_dataset, "virtual dataset"),
        "a compressed table of a million bytes": compressed_table_bomb,
    }))


def rewrite_records(make: Callable[[h5py.File, np.ndarray], None]) -> Callable[[Path], tuple[str, ...]]:
    """Replace ``/records`` of the first HDF5 shard by what ``make`` builds from its bytes."""
    def damage(dst: Path) -> tuple[str, ...]:
        shard = first_shard(dst)
        with h5py.File(shard, "r+") as f:
            records = f["records"][()]
            del f["records"]
            make(f, records)
        set_manifest_bytes(dst, 0, shard.stat().st_size)
        return (shard.name,)
    return damage


def chunked_records(f: h5py.File, records: np.ndarray) -> None:
    # one chunk far larger than the data: HDF5 would inflate all of it for each record's slice
    f.create_dataset("records", data=records, maxshape=(None,), chunks=(1 << 20,), compression="gzip")


def scalar_records(f: h5py.File, records: np.ndarray) -> None:
    f["records"] = np.uint8(7)


def test_hdf5_records_stored_otherwise_are_refused_by_verify_deep(
    tmp_path: Path, make_packed_dataset: Callable[..., Path]
) -> None:
    """The reader reads payloads at the table's offsets, never through ``/records``; ``verify --deep``
    reads ``/records`` through HDF5, so it must be contiguous and one dimension, or reported."""
    dst = make_packed_dataset(tmp_path, storage="hdf5", resize=16, crop=16, shard_size=10**6)
    damages = {"chunked": rewrite_records(chunked_records), "scalar": rewrite_records(scalar_records)}
    cases = damaged_copies(dst, damages, raising=())
    for label, case in cases.items():
        report = packer.verify(case.path, deep=True, progress=False)
        words = "is stored in chunks" if label == "chunked" else "has shape (), not one dimension"
        assert any(words in problem for problem in report.problems), (label, report.problems)


def test_a_shard_claiming_more_records_than_bytes_is_refused_with_the_manifest(packed: Path) -> None:
    """Every record has a payload byte at least: 10**15 records in a shard of a few KB is refused before
    anything is allocated for them."""
    edit_manifest(packed, lambda data: data["shards"][0].update(records=10**15))
    with pytest.raises(FormatError, match=r"manifest\.json: shards\[0\] \(part-\S+\) claims 1000000000000000 "
                                          r"records in \d+ bytes$"):
        PackedDataset(packed)


def damage_lmdb(edit: Callable[[bytearray, int, int], None], *words: str) -> Callable[[Path], tuple[str, ...]]:
    """Damage the first shard's B-tree with ``edit(data, node, page_size)``, ``node`` being where the
    leaf node of the record table starts (its key ``~table`` is 8 bytes on)."""
    def damage(dst: Path) -> tuple[str, ...]:
        shard = first_shard(dst)
        data = bytearray(shard.read_bytes())
        assert data.count(b"\x06\x00~table") == 1
        edit(data, data.index(b"\x06\x00~table") - 6, int.from_bytes(data[40:44], "little"))
        shard.write_bytes(bytes(data))
        return (shard.name, *words)
    return damage


def table_size(data: bytearray, node: int, page_size: int) -> None:
    data[node:node + 4] = b"\xff\xff\xff\x7f"  # 2 GiB


def table_page(data: bytearray, node: int, page_size: int) -> None:
    data[node + 14:node + 22] = (1 << 40).to_bytes(8, "little")


def root_page(data: bytearray, node: int, page_size: int) -> None:
    for meta in (0, page_size):  # md_root of the main database, in both meta pages
        data[meta + 128:meta + 136] = (int.from_bytes(data[meta + 136:meta + 144], "little") + 3).to_bytes(8, "little")


def overflow_number(data: bytearray, node: int, page_size: int) -> None:
    first = int.from_bytes(data[node + 14:node + 22], "little") * page_size
    data[first:first + 8] = (7).to_bytes(8, "little")


def lmdb_dataset_with_a_large_table(dst: Path) -> Path:
    """Raw records of random sizes and classes in one LMDB shard: their record table stays larger than
    half a page when compressed (about 4 bytes a record), so LMDB keeps it in overflow pages."""
    rng = np.random.default_rng(0)
    writer = DatasetWriter(dst, "lmdb", 10**7)
    for k in range(800):
        height, width = (int(side) for side in rng.integers(1, 33, 2))
        writer.add(rng.integers(0, 256, 3 * height * width, dtype=np.uint8).tobytes(), int(rng.integers(100)),
                   height, width, source=f"r/{k}.png")
    manifest = writer.finish(encoding="raw", classes=[f"c{i}" for i in range(100)], shape=None, transform={},
                             source={"kind": "test"}, tool_version="test")
    assert manifest.shards[0].table_bytes > 4096
    return dst


def test_lmdb_trees_pointing_outside_the_file_are_refused_by_the_page_walk(tmp_path: Path) -> None:
    """The record table is looked up with ``pread`` (``reader.format.lmdb_pages``): every page and value
    it would read is checked against the meta page's last page first, every page's own number too."""
    dst = tables_in_containers(lmdb_dataset_with_a_large_table(tmp_path / "packed"))
    assert_all_refused(damaged_copies(dst, {
        "the table's size past the file": damage_lmdb(table_size, "past the last page", "damaged"),
        "the table's overflow page past the file": damage_lmdb(table_page, "past the last page", "damaged"),
        "the root page past the last page": damage_lmdb(root_page, "past the last page", "damaged"),
        "an overflow page numbered as another": damage_lmdb(overflow_number, "is numbered 7", "damaged"),
    }))
