"""Which rank this process is, and how many there are: one rule for every reader class."""
from __future__ import annotations

import torch.distributed as dist

from reader.arguments import whole_number


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
