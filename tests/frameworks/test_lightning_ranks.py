"""Lightning's own DDP launcher (``Trainer(devices=2, strategy="ddp")`` run as a plain script, not under
torchrun) sets no ``LOCAL_WORLD_SIZE``: its ranks count the ranks on their host from the sampler's
collective, so the streaming decision, the read-ahead and the default number of workers see both."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ddp_helpers import run_job
from reader_helpers import make_images, pack_images

pytest.importorskip("lightning")

JOB = Path(__file__).resolve().parents[1] / "lightning_ranks_job.py"
JOB_TIMEOUT_S = 180


def test_lightning_ranks_count_the_ranks_on_their_node(tmp_path):
    dataset = pack_images(tmp_path / "packed", make_images(8, [(4, 4)]), [i % 2 for i in range(8)],
                          storage="lmdb", encoding="raw", records_per_shard=4).path
    done = run_job([sys.executable, str(JOB), str(dataset), str(tmp_path)], timeout_s=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks == [{"LOCAL_WORLD_SIZE": None, "ranks_on_this_node": 2}] * 2
