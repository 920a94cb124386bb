"""Which records of a dataset go to validation: the one rule behind ``reader.split`` (two ``Subset``s of
an open dataset) and ``packer split`` (two datasets on disk), so both choose the same records.

Stratified: every class keeps its share in both parts (``val_fraction * n_c`` of its ``n_c`` records,
rounded half up, go to validation), so a small validation set still sees every class in proportion.
Deterministic: the records chosen depend only on ``seed`` and the labels, never on the machine or the
rank, so every rank of a DDP job computes the same split without talking to the others. Both parts list
their records in file order. No torch here: the packer uses it without importing torch.
"""
from __future__ import annotations

import numbers

import numpy as np

from reader.arguments import whole_number


def split_indices(labels: np.ndarray, val_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)``: the positions of ``labels`` (one label per record, in file order) in each part,
    ascending, disjoint, together every position once. ``val_fraction`` is in (0, 1); ``seed`` an int of
    0 or more (``None`` is refused: the split would differ on every call and rank)."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, numbers.Real):
        raise TypeError(f"val_fraction must be a number between 0 and 1 (exclusive), got {val_fraction!r}")
    seed = whole_number("seed", seed)
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    rng = np.random.default_rng(seed)
    in_val = np.zeros(len(labels), dtype=bool)
    by_label = np.argsort(labels, kind="stable")  # O(N log N): each class's records, ascending, class by class
    grouped = labels[by_label]
    for members in np.split(by_label, np.flatnonzero(grouped[1:] != grouped[:-1]) + 1):
        chosen = rng.permutation(members)[:int(np.floor(val_fraction * len(members) + 0.5))]
        in_val[chosen] = True
    return np.flatnonzero(~in_val), np.flatnonzero(in_val)
