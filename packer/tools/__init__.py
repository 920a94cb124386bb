"""What people run on a finished dataset: ``info``, ``verify``, ``show`` and ``bench``."""
