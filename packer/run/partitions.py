"""Cutting the plan into partitions, and choosing which partitions one task of a job packs.

A partition is a contiguous run of plan positions, packed into shards of its own by whichever process
packs it, so partitions can be packed in any order, by any number of processes or machines, and give
the same bytes. The default count depends on the plan alone (how many records, and how large the
transform makes them), never on the machine. Each shard belongs to one partition, so a partition's
bytes bound its shards' length, and with it how long a read of one shard's neighbouring records can be
on a disk (HDD, network share): partitions are made long enough to hold ``MIN_PARTITION_BYTES`` of
payloads by an estimate of a record's size (``expected_record_bytes``), and no shorter than the
square root of the record count (so that the count of partitions, shards and open files grows only as
the square root of the dataset):

    records per partition = max(MIN_PARTITION_RECORDS, ceil(sqrt(records)),
                                ceil(MIN_PARTITION_BYTES / expected record bytes))
    partitions            = ceil(records / records per partition)

A raw record's size is known from the crop or exact resize (``3*H*W``); a JPEG one is taken as a
sixteenth of that (photos at quality 90 compress 1:10 to 1:20); without a fixed size the shorter side
of the resize (or 256 px) stands for both sides. The estimate errs low, which only makes partitions
longer. So 24,000 JPEGs of 224 px make 7 partitions of about 3,430 records (27 MB each, at 8 KB a
record) where the square-root rule alone made 155 of 1.6 MB; 24,000 raw 224 px records make 108 of
about 33 MB; 12 images make 1 partition, and ImageNet's 1.28 million JPEGs 360. Fewer partitions
means fewer processes can pack a small dataset at once (``--partitions`` overrides the count).
Partition ``i`` holds positions ``[i * records // count, (i + 1) * records // count)``. The count
changes only where shards begin and end and what they are called, never the records or their order.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping

from packer.errors import PackError
from packer.image.transforms import TransformSpec

MIN_PARTITION_RECORDS = 64
MIN_PARTITION_BYTES = 32 << 20
JPEG_RATIO = 16  # how many times smaller than raw pixels a JPEG record is taken to be
UNSIZED_SIDE = 256  # the side taken for images that the transform does not resize


@dataclass(frozen=True)
class Partition:
    """Plan positions ``[start, end)``, packed as partition number ``index``."""

    index: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def expected_record_bytes(spec: TransformSpec) -> int:
    """A low estimate of one record's payload bytes under ``spec`` (module docstring)."""
    side = spec.resize if isinstance(spec.resize, int) else UNSIZED_SIDE
    height, width = spec.fixed_size or (side, side)
    raw = 3 * height * width
    return raw if spec.encoding == "raw" else max(1, raw // JPEG_RATIO)


def default_partition_count(records: int, record_bytes: int) -> int:
    """How many partitions a plan of ``records`` images of about ``record_bytes`` each is cut into
    when the user does not say."""
    per_partition = max(MIN_PARTITION_RECORDS, math.isqrt(max(records - 1, 0)) + 1,
                        -(-MIN_PARTITION_BYTES // max(record_bytes, 1)))
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
