"""The weight comparison every proof ends with, its tolerances, and the optimizer table.

Equivalence is the course's core proof: two training recipes that should compute the
same update (R replicas vs 1 device, k accumulated micro-batches vs one big batch) are
run from identical initial weights on identical data, and their weights compared.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

# float32 tolerances used by every equivalence check (see DEVELOPERS.md: never loosen).
FLOAT32_RTOL = 1e-6
FLOAT32_ATOL = 1e-6


# The optimizers every equivalence sweep runs: plain, stateful (momentum), adaptive
# (Adam: bias correction counts updates), and decoupled weight decay (AdamW).
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
}


def weights_of(model_or_variables) -> list[np.ndarray]:
    """The current values of a model's weights (or of a list of variables) as numpy."""
    variables = getattr(model_or_variables, "weights", model_or_variables)
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


@dataclasses.dataclass(frozen=True)
class WeightDiff:
    """How far two weight lists are apart: largest absolute and relative difference."""

    max_abs: float
    max_rel: float

    def within(self, rtol: float = FLOAT32_RTOL, atol: float = FLOAT32_ATOL) -> bool:
        return self.max_abs == 0.0 or self.max_rel <= rtol or self.max_abs <= atol


def weight_diff(actual, expected) -> WeightDiff:
    """Compare two weight lists elementwise; raises ValueError if shapes differ."""
    actual, expected = list(actual), list(expected)
    if len(actual) != len(expected):
        raise ValueError(f"{len(actual)} weights vs {len(expected)} weights.")
    max_abs = max_rel = 0.0
    for a, e in zip(actual, expected):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        if a.shape != e.shape:
            raise ValueError(f"weight shapes differ: {a.shape} vs {e.shape}.")
        diff = np.abs(a - e)
        max_abs = max(max_abs, float(diff.max(initial=0.0)))
        max_rel = max(max_rel, float((diff / np.maximum(np.abs(e), 1e-30)).max(initial=0.0)))
    return WeightDiff(max_abs, max_rel)


def check_close(actual, expected, rtol: float = FLOAT32_RTOL, atol: float = FLOAT32_ATOL,
                what: str = "weights") -> WeightDiff:
    """Assert two weight lists agree like `np.allclose(actual, expected, rtol, atol)`.

    Returns the `WeightDiff` (so lessons can print it); raises AssertionError naming
    `what` and the largest differences otherwise.
    """
    diff = weight_diff(actual, expected)
    for a, e in zip(actual, expected):
        if not np.allclose(a, e, rtol=rtol, atol=atol):
            raise AssertionError(
                f"{what} differ: max abs diff {diff.max_abs:.3e}, max rel diff "
                f"{diff.max_rel:.3e} (rtol={rtol}, atol={atol})."
            )
    return diff


def check_not_close(actual, expected, rtol: float = FLOAT32_RTOL, atol: float = FLOAT32_ATOL,
                    what: str = "weights") -> WeightDiff:
    """Assert two weight lists are *not* allclose: a pitfall must produce a real difference."""
    diff = weight_diff(actual, expected)
    if all(np.allclose(a, e, rtol=rtol, atol=atol) for a, e in zip(actual, expected)):
        raise AssertionError(f"{what} unexpectedly agree (max abs diff {diff.max_abs:.3e}).")
    return diff


def updates(after, before) -> list[np.ndarray]:
    """The change each weight went through: `after - before`, elementwise."""
    return [np.asarray(a) - np.asarray(b) for a, b in zip(after, before)]


def update_ratio(update, reference_update) -> float:
    """The scalar r with update == r * reference_update (least squares over all weights).

    Used to show an update that is exactly R times too large.
    """
    u = np.concatenate([np.ravel(x) for x in update]).astype(np.float64)
    r = np.concatenate([np.ravel(x) for x in reference_update]).astype(np.float64)
    return float(u @ r / (r @ r))


def mirrored_copies_agree(variables) -> bool:
    """True when every per-device copy of every mirrored variable holds the same value."""
    for variable in variables:
        inner = getattr(variable, "value", variable)
        copies = getattr(inner, "values", (inner,))
        first = np.asarray(copies[0])
        if any(not np.array_equal(first, np.asarray(c)) for c in copies[1:]):
            return False
    return True
