"""The readers' LMDB page walk (``reader.format.lmdb_pages``) finds exactly what LMDB's API finds: values
inside leaf pages and on overflow pages, in trees of several levels, absent keys as None."""
from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np

from reader.format.lmdb_pages import paged_values


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
