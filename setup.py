"""Build the three optional C extensions (everything else is in setup.cfg).

``packer.image._jpeg_region`` needs a C compiler and libjpeg-turbo's headers (Debian/Ubuntu: ``libjpeg-dev``).
Where either is missing the build of the extension fails quietly (``optional=True``) and the packer
decodes whole JPEGs instead: the same pixels, slower (``packer/image/jpeg_region.py``).

``reader._guarded_copy`` needs only a C compiler: without it the reader reads warm records with
``preadv`` instead of copying them from a mapping: the same bytes, slower (``reader/mapped_copy.py``).

``reader._fork_guard`` needs only a C compiler: without it, on CPython 3.10 before 3.10.15 and 3.11
before 3.11.10, a forked DataLoader worker of a DDP rank can hang at its start, rarely
(``reader/fork_guard.py``).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("packer.image._jpeg_region", ["packer/image/_jpeg_region.c"], libraries=["jpeg"], optional=True),
        Extension("reader._guarded_copy", ["reader/_guarded_copy.c"], optional=True),
        Extension("reader._fork_guard", ["reader/_fork_guard.c"], optional=True),
    ]
)
