"""``reader.split`` groups classes with one sort; its result is the one the former per-class scan gave."""
from __future__ import annotations

import numpy as np
import pytest
from test_sampler import ManifestOnly

from reader import split


def reference_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """The former algorithm (one pass over all labels per class), verbatim."""
    rng = np.random.default_rng(seed)
    in_val = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels).tolist():
        members = np.flatnonzero(labels == label)
        chosen = rng.permutation(members)[:int(np.floor(val_fraction * len(members) + 0.5))]
        in_val[chosen] = True
    return np.flatnonzero(~in_val).tolist(), np.flatnonzero(in_val).tolist()


class Labelled(ManifestOnly):
    def __init__(self, labels: np.ndarray) -> None:
        super().__init__([len(labels)])
        self.targets = labels


@pytest.mark.parametrize("classes", [1, 7, 300])
def test_split_equals_the_former_per_class_scan(classes: int) -> None:
    rng = np.random.default_rng(classes)
    labels = rng.integers(0, classes, 5000) ** 2  # sparse, unordered label values
    for fraction, seed in [(0.1, 0), (0.5, 3), (0.97, 12)]:
        train, val = split(Labelled(labels), fraction, seed)
        assert (list(train.indices), list(val.indices)) == reference_split(labels, fraction, seed)
