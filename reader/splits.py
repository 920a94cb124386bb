"""``split``: a deterministic, stratified train/validation split of a packed dataset, as two ``Subset``s
(the rule, shared with ``packer split``, is ``reader.split_rule``)."""
from __future__ import annotations

from typing import Sequence, cast

from torch.utils.data import Dataset, Subset

from reader.packed_view import as_view
from reader.split_rule import split_indices


def split(dataset: Dataset, val_fraction: float, seed: int = 0) -> tuple[Subset, Subset]:
    """``(train, val)`` subsets of ``dataset`` (a ``PackedDataset``, or a ``Subset`` or
    ``ConcatDataset`` of them): disjoint, together every record once, each class split in proportion,
    both in file order (``reader.split_rule``).

    Both work with ``make_loader`` and with a plain ``DataLoader``. ``val_fraction`` is in (0, 1);
    ``seed`` is an int of 0 or more (``None`` is refused: the split would differ on every call and rank).
    On a disk too slow to keep the dataset in the page cache, ``packer split`` writes the two parts as
    datasets of their own, so that a validation pass reads only its records.
    """
    train, val = split_indices(as_view(dataset).targets, val_fraction, seed)  # int arrays: Subset takes any indexable
    return Subset(dataset, cast(Sequence[int], train)), Subset(dataset, cast(Sequence[int], val))
