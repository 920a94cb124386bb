"""``split``: a deterministic, stratified train/validation split of a packed dataset, as two ``Subset``s.

Stratified: every class keeps its share in both parts (``val_fraction * n_c`` of its ``n_c`` records,
rounded half up, go to validation), so a small validation set still sees every class in proportion.
Deterministic: the records chosen depend only on ``seed`` and the labels, never on the machine or the
rank, so every rank of a DDP job computes the same split without talking to the others. Both parts list
their records in file order: ``make_loader`` shuffles them in quasi-random blocks of the files, and a
sequential evaluation reads the validation set front to back.
"""
from __future__ import annotations

import numbers
from typing import Sequence, cast

import numpy as np
from torch.utils.data import Dataset, Subset

from reader.arguments import whole_number
from reader.packed_view import as_view


def split(dataset: Dataset, val_fraction: float, seed: int = 0) -> tuple[Subset, Subset]:
    """``(train, val)`` subsets of ``dataset`` (a ``PackedDataset``, or a ``Subset`` or
    ``ConcatDataset`` of them): disjoint, together every record once, each class split in proportion.

    Both work with ``make_loader`` and with a plain ``DataLoader``. ``val_fraction`` is in (0, 1);
    ``seed`` is an int of 0 or more (``None`` is refused: the split would differ on every call and rank).
    """
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, numbers.Real):
        raise TypeError(f"val_fraction must be a number between 0 and 1 (exclusive), got {val_fraction!r}")
    seed = whole_number("seed", seed)
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    labels = as_view(dataset).targets
    rng = np.random.default_rng(seed)
    in_val = np.zeros(len(labels), dtype=bool)
    by_label = np.argsort(labels, kind="stable")  # O(N log N): each class's records, ascending, class by class
    grouped = labels[by_label]
    for members in np.split(by_label, np.flatnonzero(grouped[1:] != grouped[:-1]) + 1):
        chosen = rng.permutation(members)[:int(np.floor(val_fraction * len(members) + 0.5))]
        in_val[chosen] = True
    train, val = np.flatnonzero(~in_val), np.flatnonzero(in_val)  # int arrays: Subset takes any indexable
    return Subset(dataset, cast(Sequence[int], train)), Subset(dataset, cast(Sequence[int], val))
