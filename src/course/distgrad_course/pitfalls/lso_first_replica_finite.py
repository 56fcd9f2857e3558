"""Pitfall (in Keras itself): `LossScaleOptimizer` checks finiteness on replica 0 only.

`keras/src/optimizers/loss_scale_optimizer.py`, `LossScaleOptimizer._tf_apply`, under
`MirroredStrategy` (which needs `merge_call`):

    finite_per_replica = distribution.extended.call_for_each_replica(
        self.check_finite, args=(grads,))
    # Each replica computed the same `finite` value, since `grads` is
    # all-reduced across replicas. Arbitrarily take `finite` from the
    # first replica.
    finite = distribution.experimental_local_results(finite_per_replica)[0]

The comment is inherited from tf-keras, where it was true: there
`LossScaleOptimizer.apply_gradients` all-reduces the gradients *first*
(`self._optimizer.aggregate_gradients(...)`, "so that any NaN or Inf gradients are
propagated to each replica") and only then checks them. In Keras 3 nothing
all-reduces before `apply`: `TensorFlowTrainer.train_step` passes each replica's
*partial* gradients, and the SUM happens later, inside the inner optimizer
(`TFOptimizer._backend_update_step`). So an overflow confined to replica 1's shard
is invisible to the check, the step is applied, and the inner optimizer's all-reduce
sums `inf` into every replica's weights. An overflow on replica 0 (or on all
replicas) is skipped correctly.

`reproduce` shows it in plain `model.fit` with SGD under `mixed_float16`;
`finite_flags` shows what each replica's `check_finite` returned;
the fix, `distgrad.mixed_precision.AllReplicasFiniteLossScaleOptimizer`, is the stock
wrapper that skips the step unless *every* replica's gradients are finite.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
from distgrad_course.lab.mixed import DEFAULT_INITIAL_SCALE, mixed_precision_policy, overflow_data
from distgrad_course.lab.spy import spying
from distgrad_course.pitfalls.loss_scale_patch import PatchedFitRecord, compile_patched
from distgrad_course.pitfalls.loss_scale_patch import reproduce as _patched_fit


def reproduce(strategy, overflow_replicas=(1,), fixed: bool = False, micro_batches: int = 4,
              overflow_step: int = 2, learning_rate: float = 0.1,
              initial_scale: float = DEFAULT_INITIAL_SCALE) -> PatchedFitRecord:
    """Plain `model.fit` with `SGD` under `mixed_float16` (Keras' wrapper with its
    default initial scale -- exactly what `model.compile` adds --, or the fixed one with
    `fixed=True`), one example in the shard of each replica in `overflow_replicas` of
    micro-batch `overflow_step` overflowing float16."""
    wrapper = AllReplicasFiniteLossScaleOptimizer if fixed else None
    return _patched_fit(strategy, "none", micro_batches=micro_batches,
                        overflow_step=overflow_step, overflow_replicas=overflow_replicas,
                        learning_rate=learning_rate, wrapper=wrapper,
                        initial_scale=initial_scale)


@dataclasses.dataclass(frozen=True)
class FiniteFlags:
    """One eager step with an overflow on `overflow_replicas`: what each replica's
    `check_finite` returned, and whether the step was applied (`iterations` moved)."""

    overflow_replicas: tuple[int, ...]
    finite_by_replica: dict[int, bool]
    applied: bool
    weights_finite: bool


def finite_flags(strategy, overflow_replicas=(1,), micro_batch_per_replica: int = 4,
                 fixed: bool = False) -> FiniteFlags:
    """Run one micro-batch of `model.fit` and record `check_finite` per replica."""
    replicas = strategy.num_replicas_in_sync
    x, y = overflow_data(1, replicas * micro_batch_per_replica, 1, replicas, overflow_replicas)
    flags = {}

    def after(spec, owner, result):
        replica = int(tf.get_static_value(
            tf.distribute.get_replica_context().replica_id_in_sync_group))

        def on_execution(value):
            flags[replica] = bool(value.numpy())
            return []

        # Record when the traced step executes (graph mode: eager collectives under
        # MirroredStrategy would disturb later strategies in the same process).
        tf.py_function(on_execution, [result], Tout=[])

    wrapper = AllReplicasFiniteLossScaleOptimizer if fixed else None
    check_finite = ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer",
                    "check_finite")
    with spying([check_finite], after=after), mixed_precision_policy("mixed_float16"):
        model, optimizer, _ = compile_patched(strategy, "none", 1, 0.1, wrapper=wrapper)
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return FiniteFlags(
        overflow_replicas=tuple(overflow_replicas), finite_by_replica=dict(sorted(flags.items())),
        applied=int(optimizer.iterations.numpy()) == 1,
        weights_finite=all(np.all(np.isfinite(np.asarray(w))) for w in model.weights))
