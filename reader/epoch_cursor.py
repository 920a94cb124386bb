"""The set_epoch / resume rule of the reader's iterables that count their own epochs (``GPUDataset``,
``CUDAPrefetcher``), in one place.

``epoch`` is the epoch the next iteration runs and ``resume_at`` the batch it starts at: 0, or a loaded
state's position. ``set_epoch`` to another epoch drops that position (the loaded epoch is not the one
asked for); ``set_epoch`` to the same one keeps it, so ``load_state_dict`` then the usual
``set_epoch(epoch)`` resumes. Each iteration takes the cursor and moves it to the start of the next
epoch, as a plain loop without ``set_epoch`` expects.
"""
from __future__ import annotations

from reader.arguments import whole_number


class EpochCursor:
    """Mixed into a class that iterates by epochs (module docstring); it keeps ``epoch``, ``_resume_at``."""

    epoch: int = 0
    _resume_at: int = 0

    def _move_to_epoch(self, epoch: int) -> bool:
        """``set_epoch(epoch)``'s move; True when ``epoch`` is another epoch (a loaded position dropped)."""
        epoch = whole_number("epoch", epoch)
        moved = epoch != self.epoch
        if moved:
            self._resume_at = 0
        self.epoch = epoch
        return moved

    def _restore_position(self, epoch: int, batches: int) -> None:
        """A loaded state's position: the next iteration runs ``epoch`` from batch ``batches``."""
        self.epoch, self._resume_at = epoch, batches

    def _take_pass(self) -> tuple[int, int]:
        """``(epoch, first batch)`` of the iteration starting now; the cursor moves to the next epoch."""
        epoch, first = self.epoch, self._resume_at
        self.epoch, self._resume_at = epoch + 1, 0
        return epoch, first
