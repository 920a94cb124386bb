"""Descriptors and mappings bounded per process, whatever the shard count (issue 22 items 1 and 5).

A dataset of 2,100 one-record shards is read for a whole epoch in a subprocess whose ``RLIMIT_NOFILE``
is 256, with no worker and with two (fork and spawn); the subprocess counts, for itself and its worker
processes, the descriptors and mappings of shard files (``/proc/PID/fd``, ``/proc/PID/maps``) and
reports the most it saw. A reader that kept every shard open needs two descriptors a shard and fails
after about 120 shards. A second test reads datasets just within and just over ``MAX_MAPPED_BYTES``
and reads the RSS of the shard mappings in ``/proc/self/smaps``.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from hostile_helpers import subprocess_env
from reader_helpers import make_images, pack_images

import packer
import reader.shard_io
from reader import PackedDataset
from reader.shard_io import MAX_OPEN_SHARDS

TABLE_READ_FDS = 2

SHARDS = 2100
LIMIT = 256
TIMEOUT_S = 240

# Run in the subprocess: argv = dataset, descriptor limit, then configurations "WORKERS:START_METHOD".
# Prints one JSON line per configuration after its epoch.
EPOCH = r"""
import json, os, resource, sys
from collections import Counter
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from reader import PackedDataset, make_loader

def handles(pid):
    # descriptors and mapped files of shards in process pid (0, 0 once it has gone)
    fds = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                fds += os.readlink(f"/proc/{pid}/fd/{fd}").endswith(".lmdb")
            except FileNotFoundError:  # closed meanwhile (listdir's own descriptor, say)
                pass
        with open(f"/proc/{pid}/maps") as f:
            return fds, len({line.split()[-1] for line in f if line.rstrip().endswith(".lmdb")})
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0

def processes():
    children = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            children.update(int(pid) for pid in f.read().split())
    return [os.getpid(), *children]

ds = PackedDataset(sys.argv[1])
for config in sys.argv[3:]:
    workers, method = int(config.split(":")[0]), config.split(":")[1]
    loader = make_loader(ds, 16, num_workers=workers, multiprocessing_context=method if workers else None)
    labels, most_fds, most_maps = Counter(), 0, 0
    for k, (images, batch_labels) in enumerate(loader):
        labels.update(batch_labels.tolist())
        assert all(int(image[0, 0, 0]) == label * 10 for image, label in zip(images, batch_labels.tolist()))
        if k % 4 == 0:
            for pid in processes():
                fds, maps = handles(pid)
                most_fds, most_maps = max(most_fds, fds), max(most_maps, maps)
    del loader
    print(json.dumps({"config": config, "labels": dict(labels), "fds": most_fds, "maps": most_maps}), flush=True)
"""


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """2,100 shards of one 4x4 record each (labels ``i % 7``, pixels ``10 * label``), packed on tmpfs
    where there is one (LMDB's sync per shard is what costs elsewhere)."""
    shm = Path("/dev/shm")
    root = tmp_path_factory.mktemp("many")
    if shm.is_dir():
        root = shm / f"{root.name}-{root.parent.name}"
    items = ({"image": np.full((4, 4, 3), 10 * (i % 7), np.uint8), "label": i % 7} for i in range(SHARDS))
    packer.pack_items(items, root / "packed", partition_size=1, workers=2, progress=False)
    yield root / "packed"
    shutil.rmtree(root, ignore_errors=True)


def test_an_epoch_over_2100_shards_under_ulimit_n_256(many_shards: Path) -> None:
    """One subprocess (one open: opening 2,100 shards takes seconds), three loaders in turn."""
    configs = ["0:fork", "2:fork", "2:spawn"]
    done = subprocess.run([sys.executable, "-c", EPOCH, str(many_shards), str(LIMIT), *configs],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [report["config"] for report in reports] == configs
    for report in reports:
        assert report["labels"] == {str(label): len(range(label, SHARDS, 7)) for label in range(7)}, report
        # per process: a descriptor per open shard, and a dataset this large is never mapped by the
        # reader; besides those, the one shard whose record table is being read (the first time one of
        # its records is needed) has its checked descriptor and the page walk's open, and nothing mapped
        assert 0 < report["fds"] <= MAX_OPEN_SHARDS + TABLE_READ_FDS and report["maps"] == 0, report


@pytest.mark.parametrize("fits", [True, False])
def test_mapped_shard_pages_in_rss_stay_under_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          fits: bool) -> None:
    """A dataset within ``MAX_MAPPED_BYTES`` is copied from mappings (RSS within its size); a larger one
    is read with ``preadv`` alone (no shard mapped, no RSS from it), with the same pixels."""
    packed = pack_images(tmp_path / "packed", make_images(64, [(64, 64)]), [i % 3 for i in range(64)],
                         storage="lmdb", encoding="raw", records_per_shard=8)
    total = 0
    for shard in packed.path.glob("*.lmdb"):
        total += len(shard.read_bytes())  # in the page cache, so batches can be copied from mappings
    monkeypatch.setattr(reader.shard_io, "MAX_MAPPED_BYTES", total if fits else total - 1)
    ds = PackedDataset(packed.path)
    for _ in range(2):
        for start in range(0, 64, 8):
            batch, _ = ds.read_batch(list(range(start, start + 8)))
            np.testing.assert_array_equal(batch[0].numpy(), packed.images[start].transpose(2, 0, 1))
            assert _shard_rss(packed.path) <= reader.shard_io.MAX_MAPPED_BYTES
    assert (_shard_rss(packed.path) > 0) == fits
    ds.close()
    assert _shard_rss(packed.path) == 0


def _shard_rss(folder: Path) -> int:
    """Bytes of the mappings of ``folder``'s shard files resident in this process (``/proc/self/smaps``);
    other tests' datasets, still mapped in the same process (pytest-xdist), are not counted."""
    total, in_shard = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                in_shard = fields[-1].endswith(".lmdb") and fields[-1].startswith(f"{folder}/")
            elif in_shard and fields[0] == "Rss:":
                total += int(fields[1]) << 10
    return total
