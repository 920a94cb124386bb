"""Warm records copied from a mapping of the shard: same bytes as ``preadv``, no ``preadv`` at all,
and a shard that shrinks after it was mapped gets the changed-file error, not SIGBUS."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hostile_helpers import subprocess_env
from reader_helpers import make_images, pack_images

import reader.shard_io
from reader import PackedDataset
from reader.format import FormatError
from reader.mapped_copy import GUARDED, PAGE, MappedFile


@pytest.fixture
def packed(tmp_path):
    images = make_images(12, [(40, 24)])
    return pack_images(tmp_path / "packed", images, [i % 3 for i in range(12)], storage="hdf5",
                       encoding="raw", records_per_shard=20)


def test_resident_pages_and_bounds(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(bytes(range(256)) * (3 * PAGE // 256))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, 3 * PAGE)
        mapped = MappedFile(fd)
        assert mapped.resident(10, 3 * PAGE)
        assert not mapped.resident(10, 3 * PAGE + 1)
        assert not mapped.resident(5, 5)
        out = bytearray(300)
        assert mapped.copy(PAGE - 100, [memoryview(out)[:100], memoryview(out)[100:]]) == 300
        assert bytes(out) == path.read_bytes()[PAGE - 100:PAGE + 200]
    finally:
        os.close(fd)


def test_warm_batch_is_copied_without_preadv(packed, monkeypatch):
    ds = PackedDataset(packed.path)
    (packed.path / "part-00000-shard-00000.h5").read_bytes()
    calls = []
    real_preadv = os.preadv
    monkeypatch.setattr(reader.shard_io.os, "preadv", lambda *a: calls.append(a) or real_preadv(*a))
    order = [11, 0, 5, 5, 3]
    batch, labels = ds.read_batch(order)
    assert calls == []
    assert labels.tolist() == [packed.labels[i] for i in order]
    for row, i in zip(batch, order):
        np.testing.assert_array_equal(row.numpy(), packed.images[i].transpose(2, 0, 1))


def test_shard_truncated_after_mapping_reports_the_record(packed):
    ds = PackedDataset(packed.path)
    ds.read_batch([0, 11])
    os.truncate(packed.path / "part-00000-shard-00000.h5", int(ds._offsets[9]) + 10)
    with pytest.raises(FormatError, match=r"part-00000-shard-00000\.h5: shard file was replaced or changed"):
        ds.read_batch([0, 9])


def test_a_copy_from_a_mapping_of_a_file_truncated_under_it_returns_short(tmp_path):
    """The guarded copy itself: the mapping outlives the file's end, and no SIGBUS reaches the process."""
    if not GUARDED:
        pytest.skip("reader._guarded_copy is not built here (no C compiler)")
    path = tmp_path / "file"
    path.write_bytes(bytes(range(256)) * (4 * PAGE // 256))
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = MappedFile(fd)
        os.truncate(path, PAGE + 10)
        out = [memoryview(bytearray(PAGE)), memoryview(bytearray(PAGE)), memoryview(bytearray(PAGE))]
        assert mapped.copy(0, out) == 2 * PAGE  # the first two whole; the third hits the missing page
        assert bytes(out[1][:10]) == bytes(range(10))
        mapped.close()
    finally:
        os.close(fd)


def test_without_the_guarded_copy_no_shard_is_mapped(packed, monkeypatch):
    monkeypatch.setattr(reader.shard_io, "GUARDED", False)
    ds = PackedDataset(packed.path)
    (packed.path / "part-00000-shard-00000.h5").read_bytes()
    batch, labels = ds.read_batch([11, 0, 5])
    assert all(entry.mapped is None for entry in ds._files._open.values())
    for row, i in zip(batch, [11, 0, 5]):
        np.testing.assert_array_equal(row.numpy(), packed.images[i].transpose(2, 0, 1))


# Run in a subprocess: argv = dataset, shard, pristine copy of it, workers, rounds. Each round opens the
# dataset while the shard is whole, then reads it in batches; from the first batch on, a thread runs
# `cp PRISTINE SHARD` over it again and again (each cp truncates the file, then writes it back), and
# lets the last cp finish before the next open. Prints one JSON line: batches, FormatErrors, messages.
REWRITTEN = r"""
import json, subprocess, sys, threading
from reader import PackedDataset, make_loader
from reader.format import FormatError

path, shard, pristine, workers, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
copying, idle = threading.Event(), threading.Lock()

def rewrite():
    while True:
        copying.wait()
        with idle:
            subprocess.run(["cp", pristine, shard], check=True)

threading.Thread(target=rewrite, daemon=True).start()
batches, errors, messages = 0, 0, set()
for _ in range(rounds):
    ds = PackedDataset(path)
    loader = make_loader(ds, 16, num_workers=workers, order="sequential")
    try:
        for _ in range(3):
            for images, labels in loader:
                batches += 1
                copying.set()  # from the first batch on: the workers are reading ahead by then
    except FormatError as e:
        errors += 1
        message = str(e).strip().splitlines()[-1]  # from a worker: torch's wrapper, then the traceback
        messages.add(message.removeprefix("reader.format.errors.FormatError: ")[:200])
    finally:
        copying.clear()
        with idle:  # the last cp has finished: the shard is whole for the next open
            del loader
print(json.dumps({"batches": batches, "errors": errors, "messages": sorted(messages)}))
print(sorted(messages), file=sys.stderr)
"""


# Run in a subprocess: argv = dataset, shard, pristine copy of it, workers, rounds. A thread runs
# `cp PRISTINE SHARD` over the shard again and again, leaving it whole for a moment between copies; each
# round opens the dataset afresh and reads its first batches, so the shard's record table is read (lazily,
# in the process reading, or a loader worker) while the shard may be truncated under it. Prints one JSON
# line: rounds read, FormatErrors, messages.
REOPENED = r"""
import json, random, subprocess, sys, threading, time
from reader import PackedDataset, make_loader
from reader.format import FormatError

path, shard, pristine, workers, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

def rewrite():
    while True:
        subprocess.run(["cp", pristine, shard], check=True)
        time.sleep(random.random() / 500)

threading.Thread(target=rewrite, daemon=True).start()
read, errors, messages = 0, 0, set()
for _ in range(rounds):
    try:
        loader = make_loader(PackedDataset(path), 16, num_workers=workers, order="sequential")
        for batch, _ in zip(loader, range(2 * workers + 1)):
            pass
        read += 1
    except FormatError as e:
        errors += 1
        message = str(e).strip().splitlines()[-1]  # from a worker: torch's wrapper, then the traceback
        messages.add(message.removeprefix("reader.format.errors.FormatError: ")[:200])
print(json.dumps({"read": read, "errors": errors, "messages": sorted(messages)}))
"""


def run_rewritten(tmp_path, loop: str, workers: int, rounds: int) -> tuple[str, dict]:
    """Run ``loop`` (``REWRITTEN`` or ``REOPENED``) on a 160-record raw LMDB dataset in two shards, the
    first one rewritten; the shard's path and the loop's JSON line. A SIGBUS fails the test (rc -7)."""
    images = make_images(160, [(64, 64)])
    packed = pack_images(tmp_path / "packed", images, [i % 3 for i in range(160)], storage="lmdb",
                         encoding="raw", records_per_shard=80)
    shard = sorted(packed.path.glob("*.lmdb"))[0]
    pristine = tmp_path / "pristine"
    pristine.write_bytes(shard.read_bytes())
    done = subprocess.run([sys.executable, "-c", loop, str(packed.path), str(shard), str(pristine), str(workers),
                           str(rounds)], capture_output=True, text=True, timeout=240, env=subprocess_env())
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-3000:]}"
    return str(shard), json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_rewritten_in_place_while_read_is_a_format_error_never_sigbus(tmp_path, workers):
    shard, seen = run_rewritten(tmp_path, REWRITTEN, workers, 12)
    assert seen["errors"] > 0, seen
    # each a FormatError naming the shard: changed since opened, truncated, shrank while read, or (a
    # worker reading the shard's table for the first time mid-epoch) its table cut short
    assert all(message.startswith(f"{shard}: ") for message in seen["messages"]), seen


@pytest.mark.parametrize("workers, rounds", [(0, 30), (2, 8)])
def test_a_shard_rewritten_while_its_table_is_read_is_a_format_error_never_sigbus(tmp_path, workers, rounds):
    """The record table is read when a process first needs the shard (mid-epoch), with ``pread``: a
    shard truncated under that read gives a ``FormatError`` naming it, where LMDB's map gave SIGBUS."""
    shard, seen = run_rewritten(tmp_path, REOPENED, workers, rounds)
    assert seen["read"] + seen["errors"] == rounds and seen["errors"] > 0, seen
    assert all(message.startswith(f"{shard}: ") for message in seen["messages"]), seen
