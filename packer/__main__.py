"""``python -m packer``: the same command line as the ``packer`` console script."""
from packer.cli import main

main()
