"""The one exception the format raises for a dataset that does not match it."""
from __future__ import annotations


class FormatError(ValueError):
    """A dataset directory, manifest or shard does not match the format (the message names the file)."""
