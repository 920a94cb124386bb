"""Seeded fuzzing: random bytes of a small dataset's shard files flipped, a few seconds in all.

For every damaged copy: ``verify`` (and ``verify --deep``) fails naming the shard; ``PackedDataset`` either raises
``FormatError`` naming the shard or returns every label right and every record's pixels right, except
the records whose payload bytes were flipped (the default ``verify="tables"`` does not hash payloads);
``PackedDataset(verify="full")`` always raises ``FormatError``. Nothing else: no other exception, no
signal, no hang (all of it runs in one subprocess, with a timeout)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from hostile_helpers import flip_bytes, probe

from reader.format import container, load_manifest

SEED = 8
COPIES = 12
MAX_FLIPS = 3


def flipped_records(table: np.ndarray, positions: np.ndarray) -> set[int]:
    """Records of a shard whose payload holds one of ``positions``."""
    inside = (positions[:, None] >= table["offset"][None, :].astype(np.int64)) & (
        positions[:, None] < (table["offset"] + table["nbytes"])[None, :].astype(np.int64))
    return set(np.flatnonzero(inside.any(axis=0)).tolist())


@pytest.mark.parametrize("storage, encoding", [("lmdb", "raw"), ("hdf5", "raw"), ("lmdb", "jpeg"), ("hdf5", "jpeg")])
def test_flipped_bytes_never_give_anything_but_format_errors_or_right_data(
    tmp_path: Path, make_packed_dataset: Callable[..., Path], storage: str, encoding: str
) -> None:
    dst = make_packed_dataset(tmp_path, storage=storage, encoding=encoding, resize=16, crop=16,
                              shard_size=4 * 768)
    manifest = load_manifest(dst)
    starts = np.cumsum([0] + [s.records for s in manifest.shards])
    rng = np.random.default_rng([SEED, len(storage), len(encoding)])
    copies = []
    for number in range(COPIES):
        shard_number = int(rng.integers(len(manifest.shards)))
        shard = manifest.shards[shard_number]
        table = container(storage).read_table(dst / shard.file, dst / shard.file, compressed=shard.compressed)
        positions = rng.integers(0, shard.bytes, int(rng.integers(1, MAX_FLIPS + 1)))
        copy = tmp_path / f"fuzz{number}"
        shutil.copytree(dst, copy)
        flip_bytes(copy / shard.file, positions)
        damaged = {int(starts[shard_number]) + r for r in flipped_records(table, positions)}
        copies.append((copy, shard.file, damaged, positions.tolist()))
    actions = ("verify", "verify-deep", "read", "read-full")
    jobs = [("read", dst)] + [(action, copy) for copy, *_ in copies for action in actions]
    outcomes = probe(jobs)
    reference = outcomes[0]
    assert reference["outcome"] == "ok", reference
    failures = []
    for k, (copy, name, damaged, positions) in enumerate(copies):
        verify, verify_deep, read, read_full = outcomes[1 + 4 * k: 5 + 4 * k]
        where = f"{copy.name} ({name} bytes {positions})"
        for report in (verify, verify_deep):
            if report["outcome"] != "ok" or not any(p.startswith(f"{name}: ") for p in report["problems"]):
                failures.append(f"{where} verify: {json.dumps(report)[:300]}")
        if read["outcome"] == "FormatError":
            if name not in read["message"]:
                failures.append(f"{where} read: {read['message']}")
        elif read["outcome"] != "ok" or read["labels"] != reference["labels"] or any(
                got != want for r, (got, want) in enumerate(zip(read["digests"], reference["digests"]))
                if r not in damaged):
            failures.append(f"{where} read served wrong data or failed otherwise: {json.dumps(read)[:300]}")
        if read_full["outcome"] != "FormatError" or name not in read_full["message"]:
            failures.append(f"{where} read verify='full': {json.dumps(read_full)[:300]}")
    assert not failures, "\n".join(failures)


def test_flipped_manifest_bytes_give_format_errors_or_a_readable_dataset(
    tmp_path: Path, make_packed_dataset: Callable[..., Path]
) -> None:
    """The manifest is parsed in this process (no container library involved, nothing to crash):
    whatever the damage, the reader, ``verify`` and ``info`` either work or raise ``FormatError``."""
    import packer
    from reader import PackedDataset
    from reader.format import FormatError

    dst = make_packed_dataset(tmp_path, resize=16, crop=16, shard_size=4 * 768)
    original = (dst / "manifest.json").read_bytes()
    rng = np.random.default_rng(SEED)
    for _ in range(60):
        data = bytearray(original)
        for position in rng.integers(0, len(data), int(rng.integers(1, MAX_FLIPS + 1))).tolist():
            data[position] ^= int(rng.integers(1, 256))
        (dst / "manifest.json").write_bytes(bytes(data))
        for action in (lambda: PackedDataset(dst)[0], lambda: packer.verify(dst, progress=False),
                       lambda: packer.info(dst)):
            try:
                action()
            except FormatError as e:
                assert "manifest.json" in str(e) or "shard-" in str(e), e
