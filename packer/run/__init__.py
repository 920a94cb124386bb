"""How a pack runs: partitions, the worker processes (or Ray tasks) that pack them, the journal that makes
a rerun resume, the writer lock, and the clean-up that leaves DST clean when a pack stops early."""
