"""The source path and extra fields of a packed dataset's records, one by one and as batches.

Read from the shards' columns (``reader.format.fields``) on first use, once per process, so opening a
dataset and reading images cost nothing more. Batches follow what a torch user expects: numbers as
tensors (``int`` int64 [B], ``float`` float64 [B], ``vector`` float32 [B, length]); variable-length
values as lists with one entry per sample (``str`` and the source path: ``str``; ``labels``: int64
tensors of the sample's class ids; ``boxes``: float32 [k, 4] tensors).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from reader.format import FormatError, Manifest
from reader.format.fields import SOURCE, Column
from reader.format.shard_tables import load_shard_columns


class RecordFields:
    """The columns of every record of one dataset, each loaded on its first use (the source column with
    the first of them), so that asking for a source path never reads a large vector field."""

    def __init__(self, root: Path, manifest: Manifest) -> None:
        self.root = root
        self.manifest = manifest
        self.names = [SOURCE, *(field.name for field in manifest.fields)]
        self._columns: dict[str, Column] = {}

    def columns(self, names: Sequence[str]) -> dict[str, Column]:
        """The columns ``names`` (known names: ``check_names``), read from every shard on first use."""
        missing = [name for name in names if name not in self._columns]
        if missing:
            if not self.manifest.has_sources:
                raise FormatError(f"{self.root}: a format-version-1 dataset stores no source paths nor "
                                  "fields (repack it with this packer to get them)")
            fields = [field for field in self.manifest.fields if field.name in missing]
            per_shard = [load_shard_columns(self.root, self.manifest.storage, shard, fields)
                         for shard in self.manifest.shards if shard.records]
            for name in (SOURCE, *(field.name for field in fields)):
                if per_shard:
                    self._columns.setdefault(name, Column.concatenate([shard[name] for shard in per_shard]))
        return {name: self._columns[name] for name in names}

    def check_names(self, names: Sequence[str]) -> None:
        unknown = [name for name in names if name not in self.names]
        if unknown:
            raise KeyError(f"{self.root}: no field {unknown[0]!r} (this dataset has: {', '.join(self.names)})")

    def batch(self, indices: np.ndarray, names: Sequence[str]) -> dict[str, Any]:
        """The named fields of the records at ``indices``, batched (module docstring)."""
        self.check_names(names)
        columns = self.columns(names)
        return {name: batch_of(columns[name], indices) for name in names}


def batch_of(column: Column, indices: np.ndarray) -> Any:
    """One column's values at ``indices`` as a batch (module docstring)."""
    kind = column.spec.type
    if kind in ("int", "float", "vector"):
        return torch.from_numpy(np.ascontiguousarray(column.values[indices]))
    if kind == "str":
        return [column.value(int(i)) for i in indices]
    return [torch.from_numpy(column.raw(int(i)).copy()) for i in indices]
