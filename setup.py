"""Build the one optional C extension, ``packer._jpeg_region`` (everything else is in setup.cfg).

It needs a C compiler and libjpeg-turbo's headers (Debian/Ubuntu: ``libjpeg-dev``). Where either is
missing the build of the extension fails quietly (``optional=True``) and the packer decodes whole JPEGs
instead: the same pixels, slower (``packer/jpeg_region.py``).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("packer._jpeg_region", ["packer/_jpeg_region.c"], libraries=["jpeg"], optional=True),
    ]
)
