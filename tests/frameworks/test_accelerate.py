"""Hugging Face accelerate (the optional ``accelerate`` extra) under torchrun with 2 CPU processes:
``accelerator.prepare(model, optimizer, make_loader(...))`` returns the loader as it is (each rank keeps
its own share, labels plain tensors), ``save_state``/``load_state`` resume it mid-epoch, and a loader
that accelerate rebuilds around make_loader's pieces still yields plain tensors (``accelerate_job.py``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from ddp_helpers import run_job, torchrun
from reader_helpers import make_images, write_dataset

pytest.importorskip("accelerate")

JOB = Path(__file__).resolve().parents[1] / "accelerate_job.py"
COUNT = 20  # 10 a rank: batches of 3, 3 and 3 and 1; 2 before the saved state
JOB_TIMEOUT_S = 300


def test_prepare_keeps_each_rank_share_and_resumes(tmp_path):
    dataset = write_dataset(tmp_path / "ids", make_images(COUNT, [(4, 4)]), list(range(COUNT)), storage="lmdb",
                            encoding="raw", records_per_shard=6, classes=[f"record{i}" for i in range(COUNT)])
    done = run_job(torchrun(str(JOB), str(dataset), str(tmp_path)), timeout_s=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout
    ranks = json.loads((tmp_path / "seen.json").read_text())
    for rank in ranks:
        assert rank["passed_through"], "prepare returned make_loader's loader itself"
        assert rank["len"] == 4, "10 records a rank in batches of 3: prepare did not split the share again"
        assert (len(rank["before"]), len(rank["after"])) == (6, 4), "2 batches, then the 2 left after load_state"
        assert rank["types"] == rank["rebuilt_types"] == ["Tensor"]
    seen = [i for rank in ranks for i in rank["before"] + rank["after"]]
    assert sorted(seen) == list(range(COUNT)), "every record once across the ranks, the resume included"
