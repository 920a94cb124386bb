"""Cutting the plan into partitions, and choosing which partitions one task of a job packs.

A partition is a contiguous run of plan positions, packed into shards of its own by whichever process
packs it, so partitions can be packed in any order, by any number of processes or machines, and give
the same bytes. The default count depends on the number of records alone, never on the machine:

    records per partition = max(MIN_PARTITION_RECORDS, ceil(sqrt(records)))
    partitions            = ceil(records / records per partition)

so 12 images make 1 partition, 5,000 make 71 (of 70-71 records), ImageNet's 1.28 million make 1,132 (of
1,131-1,132), and a crawl of 20 million 4,472. Partition ``i`` holds positions
``[i * records // count, (i + 1) * records // count)``. The count changes only where shards begin and
end and what they are called, never the records or their order.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping

from packer.errors import PackError

MIN_PARTITION_RECORDS = 64


@dataclass(frozen=True)
class Partition:
    """Plan positions ``[start, end)``, packed as partition number ``index``."""

    index: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def default_partition_count(records: int) -> int:
    """How many partitions a plan of ``records`` images is cut into when the user does not say."""
    per_partition = max(MIN_PARTITION_RECORDS, math.isqrt(max(records - 1, 0)) + 1)
    return max(1, -(-records // per_partition))


def cut(records: int, count: int) -> list[Partition]:
    """``count`` partitions of near-equal size covering positions ``[0, records)`` in order."""
    if count < 1:
        raise PackError(f"partitions {count} must be 1 or more")
    count = min(count, max(records, 1))
    bounds = [i * records // count for i in range(count + 1)]
    return [Partition(i, bounds[i], bounds[i + 1]) for i in range(count)]


@dataclass(frozen=True)
class Part:
    """Task ``index`` (0-based) of ``count`` tasks: it packs partitions ``index``, ``index + count``, ..."""

    index: int
    count: int

    def select(self, partitions: list[Partition]) -> list[Partition]:
        return partitions[self.index :: self.count]

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_part(text: str, environ: Mapping[str, str] = os.environ) -> Part:
    """``"I/N"`` (0 <= I < N), or ``"slurm"``: this Slurm array task among the array's tasks.

    With ``slurm``, I is ``SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN`` (``_MIN`` defaults to 0) and N is
    ``SLURM_ARRAY_TASK_COUNT``, so ``--array=1-8`` and ``--array=0-7`` both give tasks 0..7 of 8.
    """
    if text.strip().lower() == "slurm":
        try:
            task = int(environ["SLURM_ARRAY_TASK_ID"]) - int(environ.get("SLURM_ARRAY_TASK_MIN", "0"))
            count = int(environ["SLURM_ARRAY_TASK_COUNT"])
        except KeyError as e:
            raise PackError(f"--part slurm: {e.args[0]} is not set (run it as a Slurm job array task)") from None
        except ValueError as e:
            raise PackError(f"--part slurm: a SLURM_ARRAY_TASK_* variable is not an integer ({e})") from None
    else:
        numbers = text.split("/")
        if len(numbers) != 2 or not all(n.strip().isdigit() for n in numbers):
            raise PackError(f"--part {text!r}: expected I/N (e.g. 0/8) or slurm")
        task, count = (int(n) for n in numbers)
    if count < 1 or not 0 <= task < count:
        raise PackError(f"--part {task}/{count}: need 0 <= I < N")
    return Part(task, count)
