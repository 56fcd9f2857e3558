"""The one argument guard of the lab (the reference files each keep their own, to stay
copyable alone)."""

from __future__ import annotations


def positive_int(name: str, value) -> int:
    """`value` if it is an integer >= 1 (not a bool); else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return value
