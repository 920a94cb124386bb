"""``BatchStream``: a ``ShardSampler``'s batches, epoch after epoch, as one endless batch sampler.

Why: a DataLoader's workers only prefetch what its batch sampler has already produced. With a batch
sampler that stops at the end of each epoch, the first batches of the next epoch are only requested
when the next ``for`` loop starts, so every epoch begins with a full batch decode on the critical
path. A stream that runs on into the next epoch lets the workers prepare it while the current one
is still being consumed; ``PackedLoader`` cuts the stream back into epochs of ``len(loader)`` batches.

Each pass is identified by ``(epoch, start)``: batches of ``rank_order(epoch)[start:]``, cut every
``batch_size`` samples, the last short batch dropped with ``drop_last``, exactly as
``BatchSampler(sampler, batch_size, drop_last)`` cuts them. The pass after ``(epoch, start)`` is
``(epoch + 1, 0)`` when ``epoch_step`` is 1 (``set_epoch`` called before every epoch) or the same
``(epoch, start)`` again when it is 0 (no ``set_epoch`` calls: the sampler repeats its epoch).
"""
from __future__ import annotations

from typing import Iterator

from torch.utils.data import Sampler

from reader.sampler import ShardSampler


class BatchStream(Sampler[list[int]]):
    """Endless batches of ``sampler``'s passes, starting at its current ``(epoch, start)``.

    ``len()`` is the number of batches in the sampler's current pass (what one epoch of the loader
    yields). The stream ends only if a pass has no batch at all, since every later pass would be
    empty too.
    """

    def __init__(self, sampler: ShardSampler, batch_size: int, drop_last: bool) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.epoch_step = 1

    def __len__(self) -> int:
        return self.batches_in(len(self.sampler))

    def batches_in(self, samples: int) -> int:
        """How many batches ``samples`` samples make."""
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def following(self, epoch: int, start: int) -> tuple[int, int]:
        """The pass this stream yields after the pass ``(epoch, start)``."""
        return (epoch + 1, 0) if self.epoch_step else (epoch, start)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.sampler.epoch, self.sampler.start
        while True:
            order = self.sampler.rank_order(epoch)[start:]
            count = self.batches_in(len(order))
            if count == 0:
                return
            for i in range(count):
                yield order[i * self.batch_size:(i + 1) * self.batch_size].tolist()
            epoch, start = self.following(epoch, start)
