"""Pitfall: `clipnorm` / `global_clipnorm` clip each replica's partial gradient.

In Keras 3 (`BaseOptimizer._backend_apply_gradients`), `_clip_gradients` runs before
`_backend_update_step`, whose first act is the SUM all-reduce. So under
MirroredStrategy the optimizer clips every replica's partial gradient and then sums
the clipped parts: a different update than one device clipping the full gradient.
(TensorFlow's old optimizers refused clipping under strategies for this reason,
tensorflow/tensorflow#33929.)
"""

from __future__ import annotations

import dataclasses

import keras

from distgrad.lab.compare import WeightDiff, updates, weight_diff
from distgrad.lab.data import regression_data
from distgrad.lab.recipes import big_batch_reference, make_replica_step, run_steps


@dataclasses.dataclass(frozen=True)
class ClipBeforeSyncRecord:
    """Distributed-with-optimizer-clipping vs one device, and the fix vs one device."""

    replicas: int
    clip_option: str
    optimizer_clipping_vs_one_device: WeightDiff
    clip_after_sync_vs_one_device: WeightDiff
    one_device_update_max_abs: float


def reproduce(strategy, clip_option: str = "global_clipnorm", clip_norm: float = 0.05,
              learning_rate: float = 0.1, examples: int = 16) -> ClipBeforeSyncRecord:
    if clip_option not in ("global_clipnorm", "clipnorm"):
        raise ValueError("clip_option must be 'global_clipnorm' or 'clipnorm'.")
    x, y = regression_data(examples)
    clipping = lambda: keras.optimizers.SGD(learning_rate, **{clip_option: clip_norm})  # noqa: E731
    reference = big_batch_reference(clipping, x, y)
    naive = run_steps(strategy, clipping, x, y, make_replica_step(len(x)))
    if clip_option == "global_clipnorm":
        fixed = run_steps(
            strategy, lambda: keras.optimizers.SGD(learning_rate), x, y,
            make_replica_step(len(x), apply="clip_after_sync", clip_norm=clip_norm),
        )
        fixed_diff = weight_diff(fixed.final, reference)
    else:
        fixed_diff = None
    one_device_update = max(abs(u).max() for u in updates(reference, naive.initial))
    return ClipBeforeSyncRecord(
        replicas=strategy.num_replicas_in_sync,
        clip_option=clip_option,
        optimizer_clipping_vs_one_device=weight_diff(naive.final, reference),
        clip_after_sync_vs_one_device=fixed_diff,
        one_device_update_max_abs=float(one_device_update),
    )
