"""A spawned loader worker exits cleanly while its data queue's feeder thread is still in torch code.

torch's worker loop, once the loader shuts down, calls ``data_queue.cancel_join_thread()`` and returns,
so a spawned worker finalizes its interpreter while the queue's (daemon) feeder thread may still be
pickling or freeing a batch's tensors in C++ with the GIL released. On Python < 3.14 such a thread is
ended with ``pthread_exit`` when it takes the GIL back, and the unwinding through torch's C++ frames
calls ``std::terminate``: the worker dies by SIGABRT ("terminate called without an active exception";
pytorch/pytorch#38228). ``start_worker`` makes the worker wait for the feeder before finalizing.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hostile_helpers import subprocess_env

TIMEOUT_S = 120

WORKER = """
import multiprocessing
import sys
import threading

import torch

from reader import loader

STARTED = threading.Event()


class SlowToSend:
    # Pickled by the queue's feeder thread: one long torch call that releases the GIL, as pickling or
    # freeing a batch's tensors does (for far less time, hence a rare crash without a deterministic test).
    def __reduce__(self):
        STARTED.set()
        matrix = torch.ones(3000, 3000, dtype=torch.float64)
        matrix @ matrix
        return (int, ())


def worker(queue):
    loader.FEEDER_WAIT_S = 60.0  # however slow this machine's matrix product
    loader.start_worker(0)
    queue.put(SlowToSend())
    assert STARTED.wait(60)
    # what torch's _worker_loop does once the loader shuts down
    queue.cancel_join_thread()
    queue.close()


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=worker, args=(queue,))
    process.start()
    process.join(float(sys.argv[1]))
    print("exitcode", process.exitcode, flush=True)
"""


def test_spawned_worker_waits_for_its_queue_feeder(tmp_path: Path) -> None:
    script = tmp_path / "worker_exit.py"
    script.write_text(WORKER)
    done = subprocess.run([sys.executable, str(script), str(TIMEOUT_S / 2)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exitcode 0" in done.stdout, (done.stdout, done.stderr[-3000:])
