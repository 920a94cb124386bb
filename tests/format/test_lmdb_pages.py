"""The readers' LMDB page walk (``reader.format.lmdb_pages``) finds exactly what LMDB's API finds: values
inside leaf pages and on overflow pages, in trees of several levels, absent keys as None; and the meta
pages it starts from are read and picked as LMDB picks them, whatever the page size."""
from __future__ import annotations

import struct
from pathlib import Path

import lmdb
import numpy as np
import pytest

from reader.format import FormatError
from reader.format.lmdb_pages import LmdbMeta, check_lmdb_meta, paged_values


def test_the_page_walk_finds_every_value_lmdb_finds(tmp_path: Path) -> None:
    path = tmp_path / "shard.lmdb"
    rng = np.random.default_rng(0)
    sizes = rng.choice([0, 1, 100, 2000, 5000, 70_000], size=3000)  # inline and overflow values
    items = {i.to_bytes(8, "big"): rng.bytes(int(n)) for i, n in enumerate(sizes)}
    items[b"~array/source"] = rng.bytes(3)
    items[b"~table"] = rng.bytes(9000)
    env = lmdb.open(str(path), subdir=False, lock=False, map_size=1 << 30, max_dbs=0)
    for start in range(0, len(items), 500):  # several commits, as the packer makes
        with env.begin(write=True) as txn:
            for key in sorted(items)[start:start + 500]:
                txn.put(key, items[key])
    depth = env.stat()["depth"]
    env.close()
    assert depth >= 3  # branch pages above the leaves
    with paged_values(path, path.stat().st_size, path) as values:
        for key, value in items.items():
            assert values.get(key, "value") == value, key
        for absent in (b"", b"\x00", b"~arr", b"~array/fields", b"~tablf", b"\xff" * 9):
            assert values.get(absent, "value") is None


def _metas(page_size: int, last_pages: tuple[int, int], txnids: tuple[int, int]) -> bytes:
    """Two LMDB meta pages of ``page_size`` bytes (an empty main database) with these last pages and
    transaction ids."""
    pages = bytearray(2 * page_size)
    for number in (0, 1):
        at = number * page_size
        struct.pack_into("<QHH", pages, at, number, 0, 0x08)  # page number, padding, P_META
        struct.pack_into("<II", pages, at + 16, 0xBEEFC0DE, 1)  # magic, data version
        struct.pack_into("<I", pages, at + 40, page_size)  # the free-page database's md_pad
        struct.pack_into("<QQQ", pages, at + 128, (1 << 64) - 1, last_pages[number], txnids[number])
    return bytes(pages)


@pytest.mark.parametrize("page_size", [4096, 8192, 65536])
def test_both_meta_pages_are_read_for_any_page_size(tmp_path: Path, page_size: int) -> None:
    """The first read takes meta page 1 along when pages are 4 KiB; other sizes read it on its own, and
    either way the meta with the higher transaction id is the one used."""
    path = tmp_path / "shard.lmdb"
    path.write_bytes(_metas(page_size, (0, 1), (5, 6)))
    assert check_lmdb_meta(path, 2 * page_size, path) == LmdbMeta(page_size, (1 << 64) - 1, 0, 1)
    path.write_bytes(_metas(page_size, (1, 0), (9, 6)))
    assert check_lmdb_meta(path, 2 * page_size, path).last_page == 1
    path.write_bytes(_metas(page_size, (0, 1), (5, 6))[:page_size + 100])
    with pytest.raises(FormatError, match=r"shard\.lmdb: not an LMDB shard \(too short for its meta pages\)"):
        check_lmdb_meta(path, page_size + 100, path)
