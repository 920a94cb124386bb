"""``RecordColumns``: one process's per-record facts of a dataset, filled shard by shard.

``PackedDataset`` reads a shard's record table only when one of its records is first needed in a process
(``reader.dataset``). The tables land here, in five int64 columns over the whole dataset allocated once
with ``np.zeros`` (so pages of shards never read stay unallocated), with a flag per shard saying whether
its rows are filled.
"""
from __future__ import annotations

import numpy as np


class RecordColumns:
    """File offset, payload size, label, height and width of every record of a dataset of ``records``
    records in ``shards`` shards; ``loaded[s]`` says whether shard ``s``'s rows are filled."""

    def __init__(self, records: int, shards: int) -> None:
        self.offsets = np.zeros(records, np.int64)
        self.nbytes = np.zeros(records, np.int64)
        self.labels = np.zeros(records, np.int64)
        self.heights = np.zeros(records, np.int64)
        self.widths = np.zeros(records, np.int64)
        self.loaded = np.zeros(shards, bool)

    def fill(self, shard: int, rows: slice, table: np.ndarray) -> None:
        """Shard ``shard``'s record ``table`` (``reader.format.records``), at the dataset's ``rows``."""
        self.offsets[rows] = table["offset"]
        self.nbytes[rows] = table["nbytes"]
        self.labels[rows] = table["label"]
        self.heights[rows] = table["height"]
        self.widths[rows] = table["width"]
        self.loaded[shard] = True
