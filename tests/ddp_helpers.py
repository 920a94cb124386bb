"""Running a test's ranks as real processes (DDP over gloo, or a launcher's job), bounded in time."""
from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import pytest
import torch.multiprocessing as mp
from hostile_helpers import subprocess_env
from process_tree import kill_tree

RANKS_TIMEOUT_S = 300  # a healthy 2-rank job here takes 5-20 s


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now, for the ranks' rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(fn: Callable[..., Any], args: tuple, nprocs: int, start_method: str,
              timeout_s: float = RANKS_TIMEOUT_S) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, waited for; a rank that raises fails the test with
    its traceback, and ranks still running after ``timeout_s`` are killed and fail it (a hung
    collective or rendezvous must not hang the suite)."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, start_method=start_method, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.exitcode is None:  # a reaped rank's pid may be another process's by now
                    kill_tree(process.pid)
            pytest.fail(f"{nprocs} ranks of {fn.__name__} still ran after {timeout_s:.0f} s: killed")


def run_job(command: list[str], timeout_s: float = RANKS_TIMEOUT_S,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` (a launcher such as torchrun, or a script whose framework starts the other ranks)
    with this checkout first on the path (``env``: default ``subprocess_env()``); its output is
    returned. Still running after ``timeout_s``, it is killed with every process below it (torchrun's
    ranks run in sessions of their own) and the test fails. The output goes through a file, not a
    pipe, so that no process left holding it can keep the test waiting."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True,
                                   env=subprocess_env() if env is None else env)
        timed_out = False
        try:
            process.wait(timeout=timeout_s)
        except BaseException as error:  # the timeout, or pytest-timeout's failure, a Ctrl-C: the job goes too
            kill_tree(process.pid)
            process.wait()
            if not isinstance(error, subprocess.TimeoutExpired):
                raise
            timed_out = True
        log.seek(0)
        output = log.read()
    if timed_out:
        pytest.fail(f"{' '.join(command)} still ran after {timeout_s:.0f} s: killed; its output:\n{output[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def torchrun(script: str, *args: str, ranks: int = 2) -> list[str]:
    """The command that runs ``script ARGS`` on ``ranks`` local CPU processes with torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", str(script), *args]
