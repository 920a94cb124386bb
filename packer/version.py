"""The packer's version, from the installed ``packed-images`` distribution (recorded in every manifest)."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("packed-images")
except PackageNotFoundError:
    __version__ = "0.0.0"
