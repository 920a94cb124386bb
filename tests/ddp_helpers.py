"""Running a test's ranks as real processes (DDP over gloo), bounded in time."""
from __future__ import annotations

import socket
import time
from typing import Any, Callable

import pytest
import torch.multiprocessing as mp

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
                process.kill()
            pytest.fail(f"{nprocs} ranks of {fn.__name__} still ran after {timeout_s:.0f} s: killed")
