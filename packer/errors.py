"""The one exception the packer raises for problems the user can fix (bad input, bad options, bad DST)."""
from __future__ import annotations


class PackError(ValueError):
    """Packing cannot go on; the message names the file or option at fault and what is wrong with it."""
