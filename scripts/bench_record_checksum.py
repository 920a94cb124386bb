"""What a per-record checksum would cost on the read path: warm-cache read rates with and without
hashing every record, on a synthetic raw 224x224 dataset (LMDB), in one process.

    python scripts/bench_record_checksum.py [--records 2000] [--rounds 3]

Prints images/s and GB/s for reading batches of 256 (quasi-sequential and random order) as
``PackedDataset`` does, then the same with xxh3-64 (the fastest hash xxhash offers) computed over every
record's bytes, as a reader checking per-record checksums would have to. Also the one-off cost of
``PackedDataset(path, verify="full")``, which checksums whole shards at open instead.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reader import PackedDataset  # noqa: E402
from reader.format import DatasetWriter  # noqa: E402

SIDE = 224
BATCH = 256


def make_dataset(dst: Path, records: int) -> Path:
    """``records`` random raw 224x224 records in LMDB shards of 500."""
    rng = np.random.default_rng(0)
    dst.mkdir(parents=True)
    writer = DatasetWriter(dst, "lmdb", shard_size=500 * 3 * SIDE * SIDE)
    for i in range(records):
        writer.add(rng.integers(0, 256, 3 * SIDE * SIDE, dtype=np.uint8).tobytes(), 0, SIDE, SIDE,
                   source=f"synthetic/{i}")
    writer.finish(encoding="raw", shape=[3, SIDE, SIDE], classes=["x"], transform={}, source={},
                  tool_version="bench")
    return dst


def epoch(ds: PackedDataset, order: np.ndarray, hash_records: bool) -> float:
    start = time.perf_counter()
    for first in range(0, len(order), BATCH):
        images, _ = ds.__getitems__(order[first:first + BATCH])
        if hash_records:
            flat = images.numpy().reshape(len(images), -1)
            digests = [xxhash.xxh3_64_intdigest(row) for row in flat]
            assert len(digests) == len(images)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_dataset(Path(tmp) / "packed", args.records)
        ds = PackedDataset(path, readahead=False)
        rng = np.random.default_rng(1)
        orders = {"sequential": np.arange(len(ds)), "random": rng.permutation(len(ds))}
        epoch(ds, orders["sequential"], False)  # warm the page cache
        record_mb = 3 * SIDE * SIDE / 1e6
        print(f"{len(ds)} raw {SIDE}x{SIDE} records, batch {BATCH}, best of {args.rounds} rounds (alternating)")
        for name, order in orders.items():
            best = {False: float("inf"), True: float("inf")}
            for _ in range(args.rounds):
                for hash_records in (False, True):
                    best[hash_records] = min(best[hash_records], epoch(ds, order, hash_records))
            for hash_records, seconds in best.items():
                rate = len(ds) / seconds
                label = "read + xxh3-64 per record" if hash_records else "read only"
                print(f"  {name:<10} {label:<26} {rate:9.0f} img/s  {rate * record_mb / 1e3:5.2f} GB/s")
            print(f"  {name:<10} per-record checksum costs {100 * (best[True] / best[False] - 1):.0f}% more time")
        start = time.perf_counter()
        PackedDataset(path, verify="full")
        seconds = time.perf_counter() - start
        print(f"  PackedDataset(verify='full') at open: {seconds:.2f} s "
              f"({len(ds) * record_mb / 1e3 / seconds:.2f} GB/s of shards checksummed)")


if __name__ == "__main__":
    main()
