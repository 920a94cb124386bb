"""Lightning's own DDP launcher (``Trainer(devices=2, strategy="ddp")`` run as a plain script, not under
torchrun) sets no ``LOCAL_WORLD_SIZE``: its ranks count the ranks on their host from the sampler's
collective, so the streaming decision, the read-ahead and the default number of workers see both."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ddp_helpers import run_job
from hostile_helpers import subprocess_env
from reader_helpers import make_images, pack_images

pytest.importorskip("lightning")

JOB = Path(__file__).resolve().parents[1] / "lightning_ranks_job.py"
JOB_TIMEOUT_S = 180
# What a launcher around the suite (torchrun, a Slurm or MPI job) would leave in the environment, and
# Lightning would take for a cluster of its own
LAUNCHER_VARIABLES = {"LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "NODE_RANK"}
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_")


def test_lightning_ranks_count_the_ranks_on_their_node(tmp_path):
    dataset = pack_images(tmp_path / "packed", make_images(8, [(4, 4)]), [i % 2 for i in range(8)],
                          storage="lmdb", encoding="raw", records_per_shard=4).path
    env = {name: value for name, value in subprocess_env().items()
           if name not in LAUNCHER_VARIABLES and not name.startswith(LAUNCHER_PREFIXES)}
    done = run_job([sys.executable, str(JOB), str(dataset), str(tmp_path)], timeout_s=JOB_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks == [{"LOCAL_WORLD_SIZE": None, "ranks_on_this_node": 2}] * 2
