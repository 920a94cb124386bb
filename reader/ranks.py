"""Which rank this process is, how many there are, and how an epoch is split between them: one rule for
every reader class."""
from __future__ import annotations

import os
import socket
from typing import cast

import torch.distributed as dist

from reader.arguments import whole_number

# (world size, ranks on this host) from the last note_hosts: used while that process group lasts
_ranks_on_this_host: tuple[int, int] | None = None


def rank_and_world_size(rank: int | None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments where given, else torch.distributed's when it is
    initialised, else ``(0, 1)``."""
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    rank, world_size = whole_number("rank", rank, None), whole_number("world_size", world_size, None)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in range for world_size {world_size}")
    return rank, world_size


def share_per_rank(count: int, world_size: int, pad: bool) -> int:
    """The DDP split rule: an epoch of ``count`` samples is made a multiple of ``world_size`` long, by
    wrapping around to its start (``pad``) or by dropping its tail, and rank ``r`` takes the ``r``-th
    contiguous slice of it, this many samples long. Every rank gets the same number (no DDP hang at an
    epoch's end), and contiguous slices keep each rank's reads sequential."""
    return -(-count // world_size) if pad else count // world_size


def ranks_on_this_node() -> int:
    """The training processes on this node that share its cores and memory: ``LOCAL_WORLD_SIZE`` where
    the launcher sets it (torchrun, accelerate); else, once the ranks have compared their samplers (one
    collective, ``note_hosts``) and while that process group lasts, the ranks on this host (by host
    name), as under Lightning's own DDP launcher, Slurm's ``srun`` or ``mpirun``, which do not set it;
    else 1 (before the first sampler, after ``destroy_process_group``)."""
    if os.environ.get("LOCAL_WORLD_SIZE"):
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    if _ranks_on_this_host is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    world_size, count = _ranks_on_this_host
    return count if world_size == dist.get_world_size() else 1


def note_hosts(hosts: list[str]) -> None:
    """Record, from every rank's host name (``this_host()``, gathered in rank order), how many ranks
    run on this process's host (``ranks_on_this_node``)."""
    global _ranks_on_this_host
    _ranks_on_this_host = (len(hosts), hosts.count(this_host()))


def any_rank_on_this_host(flag: bool, world_size: int) -> bool:
    """``flag``, or'ed over the ranks on this host where torch.distributed runs these ``world_size``
    ranks (one collective, which every rank must reach: ``make_loader`` is built on every rank, as its
    sampler's seed check needs); ``flag`` itself elsewhere. For decisions that the ranks of one node
    must take alike although each measures the node at its own moment."""
    if not across_the_process_group(world_size):
        return flag
    here = this_host()
    gathered: list[tuple[str, bool] | None] = [None] * world_size
    dist.all_gather_object(gathered, (here, flag))
    return any(seen for host, seen in cast(list[tuple[str, bool]], gathered) if host == here)


def across_the_process_group(world_size: int) -> bool:
    """Whether ``world_size`` ranks are torch.distributed's whole process group (initialised, more than
    one rank): where the ranks' samplers and loaders compare notes in a collective, which each rank
    then reaches in the same order."""
    return dist.is_available() and dist.is_initialized() and 1 < world_size == dist.get_world_size()


def this_host() -> str:
    """This machine's name, as the ranks compare it."""
    return socket.gethostname()
