"""Damaged copies of a packed dataset, checked in one subprocess: the reader, ``info`` and ``verify``
must each refuse every copy with the right error naming the culprit, never crash or hang."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hostile_helpers import probe


@dataclass
class Case:
    """One damaged copy: the actions that must raise ``FormatError``, the words every error must hold,
    and whether ``verify`` raises (a bad manifest) or reports problems (a bad shard)."""

    path: Path
    names: tuple[str, ...]
    raising: tuple[str, ...] = ("read",)
    verify_raises: bool = False


def damaged_copies(
    packed: Path, damages: dict[str, Callable[[Path], tuple[str, ...]]], **case_options: object
) -> dict[str, Case]:
    """One copy of ``packed`` per damage; ``damage(copy)`` damages it and returns the words that every
    error about it must contain."""
    cases = {}
    for number, (label, damage) in enumerate(damages.items()):
        copy = packed.with_name(f"{packed.name}-case{number}")
        shutil.copytree(packed, copy, symlinks=True)
        cases[label] = Case(copy, damage(copy), **case_options)
    return cases


def assert_all_refused(cases: dict[str, Case]) -> None:
    """Run every case's actions and both verify depths in one subprocess and check each outcome."""
    jobs, expected = [], []
    for label, case in cases.items():
        for action in (*case.raising, "verify", "verify-deep"):
            jobs.append((action, case.path))
            expected.append((label, action, case))
    failures = []
    for (label, action, case), outcome in zip(expected, probe(jobs)):
        wanted = "FormatError" if action in case.raising or case.verify_raises else "ok"
        text = outcome.get("message", "") + "\n".join(outcome.get("problems", []))
        if outcome["outcome"] != wanted or not text or any(name not in text for name in case.names):
            failures.append(f"{label} / {action}: {outcome}")
    assert not failures, "\n".join(failures)
