"""The suite's bound on a multi-process job holds where a launcher puts the ranks out of reach of a
process-group kill: a hung torchrun job fails its test in time, and none of its ranks lives on (a
rank left holding the job's output once kept a whole CI run waiting)."""
from __future__ import annotations

import time

import pytest
from ddp_helpers import run_job, torchrun

HANG = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
time.sleep(3600)
"""
TIMEOUT_S = 30  # torchrun starts its two ranks in 2-5 s here, with a cold cache on a slow machine longer


def test_a_hung_torchrun_job_fails_and_leaves_no_rank_behind(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=f"still ran after {TIMEOUT_S} s: killed"):
        run_job(torchrun(str(script), str(tmp_path)), timeout_s=TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S + 30
    pid_files = [tmp_path / f"rank{rank}.pid" for rank in range(2)]
    assert all(path.exists() for path in pid_files), f"torchrun did not start both ranks in {TIMEOUT_S} s"
    for pid in [int(path.read_text()) for path in pid_files]:
        assert _gone_within(pid, 5), f"rank process {pid} outlived its job"


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` stops running within ``seconds`` (SIGKILL takes effect asynchronously; a zombie
    not yet reaped by its new parent counts as gone)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
