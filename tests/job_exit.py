"""``end_process_group``: what a DDP job script of the suite calls last.

Why: frameworks leave the default process group to be destroyed at interpreter exit. A gloo thread
still freeing a finished collective's work then needs the GIL, is ended by the finalizing interpreter
(``pthread_exit`` through torch's C++ frames), and the process aborts with "terminate called without
an active exception". Seen in about 1 of 30 runs of ``lightning_ranks_job.py``: the core showed
``ProcessGroupGloo::runLoop`` freeing an ``AsyncAllreduceWork`` in ``take_gil`` while the main thread
was in ``Py_FinalizeEx``. Destroying the group first joins gloo's threads.
"""
from __future__ import annotations

import torch.distributed as dist


def end_process_group() -> None:
    """Destroy the default process group, if there is one, before the interpreter finalizes."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
