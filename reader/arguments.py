"""Checks of arguments given to the reader: a value of the wrong type or out of range is refused where
it is given, with a ``TypeError`` or ``ValueError`` naming the argument, the value and what is allowed,
instead of failing later deep inside numpy or torch (or, worse, being silently truncated)."""
from __future__ import annotations

import numbers
from typing import Any, Sequence

import numpy as np


def whole_number(name: str, value: Any, minimum: int | None = 0) -> int:
    """``value`` as an ``int`` (a Python or numpy integer, not a bool) of at least ``minimum`` (None: any)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {'positive' if minimum == 1 else f'{minimum} or more'}, got {value}")
    return int(value)


def true_or_false(name: str, value: Any) -> bool:
    """``value`` as a ``bool`` (a Python or numpy bool only: a string such as ``"no"`` would be true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def saved_state(state: Any, keys: Sequence[str]) -> dict:
    """``state``, checked to be a dict holding every one of ``keys``, as a ``state_dict()`` returned it."""
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict takes the dict state_dict() returned, got {type(state).__name__}")
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"saved state has no {', '.join(missing)} (loading it needs {', '.join(keys)}), "
                         f"got keys {sorted(map(str, state))}")
    return state


def saved_position(state: Any, *more_keys: str) -> tuple[dict, int, int, int]:
    """A ``GPUDataset``'s or ``CUDAPrefetcher``'s saved state (holding ``more_keys`` too) and its checked
    ``(epoch, batches, seed)``: where the saved run was and what its draws were seeded with."""
    state = saved_state(state, ("epoch", "batches", "seed", *more_keys))
    return (state, whole_number("saved epoch", state["epoch"]), whole_number("saved batches", state["batches"]),
            whole_number("saved seed", state["seed"]))
