"""Pitfall: `clipnorm` / `global_clipnorm` clip each replica's partial gradient.

In Keras 3 (`BaseOptimizer._backend_apply_gradients`), `_clip_gradients` runs before
`_backend_update_step`, whose first act is the SUM all-reduce. So under
MirroredStrategy the optimizer clips every replica's partial gradient and then sums
the clipped parts: a different update than one device clipping the full gradient.

tf-keras (Keras 2) clips *after* the all-reduce, in both its optimizers:
`reproduce_tf_keras` measures it in a tf-keras child
(`distgrad_course.pitfalls.tf_keras_clip_before_sync`). So Keras 3's order is a regression;
TensorFlow's maintainers called clipping before aggregation "usually wrong" in
tensorflow/tensorflow#33929.
"""

from __future__ import annotations

import dataclasses

import keras

from distgrad_course.lab.compare import FLOAT32_ATOL, WeightDiff, updates, weight_diff
from distgrad_course.lab.data import regression_data
from distgrad_course.lab.recipes import big_batch_reference, make_replica_step, run_steps


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


@dataclasses.dataclass(frozen=True)
class LegacyClipRecord:
    """tf-keras, one clipped SGD step, R replicas vs one device.

    `max_abs[(optimizer, option)]`: largest weight difference (optimizer "SGD" or
    "legacy.SGD", option "global_clipnorm" or "clipnorm"); `update_max_abs[...]`: the
    one-device update it is measured against; `full_gradient_norm` and
    `per_replica_gradient_norms`: all above `clip_norm`, so every run really clips.
    """

    tensorflow: str
    tf_keras: str
    replicas: int
    clip_norm: float
    max_abs: dict
    update_max_abs: dict
    full_gradient_norm: float
    per_replica_gradient_norms: tuple

    def within(self, optimizer: str, option: str, atol: float = FLOAT32_ATOL) -> bool:
        """Whether R replicas equal one device: largest weight difference <= `atol`
        (stricter than `check_close`'s rtol = atol = 1e-6)."""
        return self.max_abs[optimizer, option] <= atol


def reproduce_tf_keras(replicas: int = 2, clip_norm: float = 0.05,
                     examples: int = 16) -> LegacyClipRecord:
    """Run `tf_keras_clip_before_sync.clip_on_replicas` under tf-keras in a child
    (`distgrad_course.lab.tf_keras_runner.run_tf_keras`); several seconds of TensorFlow start-up."""
    from distgrad_course.lab.tf_keras_runner import run_tf_keras

    result = run_tf_keras("distgrad_course.pitfalls.tf_keras_clip_before_sync:clip_on_replicas",
                        replicas, clip_norm=clip_norm, examples=examples)
    pairs = [(name, option, diff) for name, options in result["results"].items()
             for option, diff in options.items()]
    return LegacyClipRecord(
        tensorflow=result.tensorflow,
        tf_keras=result.tf_keras,
        replicas=result.replicas,
        clip_norm=result["clip_norm"],
        max_abs={(n, o): d["max_abs"] for n, o, d in pairs},
        update_max_abs={(n, o): d["update_max_abs"] for n, o, d in pairs},
        full_gradient_norm=result["gradient_norms"]["full"],
        per_replica_gradient_norms=tuple(result["gradient_norms"]["per_replica"]),
    )
