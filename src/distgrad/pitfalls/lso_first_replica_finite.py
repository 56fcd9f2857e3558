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
`AllReplicasFiniteLossScaleOptimizer` is the stock wrapper with the one-line fix:
skip the step unless *every* replica's gradients are finite.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from distgrad.pitfalls.loss_scale_patch import (
    DEFAULT_INITIAL_SCALE,
    PatchedFitRecord,
    _compile_patched,
    mixed_precision_policy,
    overflow_data,
)
from distgrad.pitfalls.loss_scale_patch import (
    reproduce as _patched_fit,
)


class AllReplicasFiniteLossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer):
    """Keras' `LossScaleOptimizer` that skips a step when *any* replica overflowed.

    Same as `LossScaleOptimizer._tf_apply` except that `finite` is the AND of every
    replica's `check_finite` (read in cross-replica context, where all per-replica
    values are visible: no extra collective), instead of replica 0's value. On the
    no-merge-call path (no strategy, or an XLA-compiled multi-replica step) the flag
    is all-reduced (MIN) across replicas.
    """

    def _tf_apply(self, grads, trainable_variables=None):
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                self._common_apply(grads, trainable_variables=trainable_variables)
                return
            finite = context.all_reduce(
                tf.distribute.ReduceOp.MIN, tf.cast(self.check_finite(grads), tf.float32)) > 0
            keras.ops.cond(
                finite,
                lambda: self._stateful_handle_finite_grads(grads, trainable_variables),
                self._stateful_handle_non_finite_grads)
            return

        def _handle_cross_replica(distribution, grads, trainable_variables):
            finite_per_replica = distribution.extended.call_for_each_replica(
                self.check_finite, args=(grads,))
            # The gradients are each replica's partial gradients (Keras 3 sums them
            # later, inside the inner optimizer): every replica must be finite.
            finite = tf.reduce_all(tf.stack(
                distribution.experimental_local_results(finite_per_replica)))

            def apply_fn():
                distribution.extended.call_for_each_replica(
                    self._stateful_handle_finite_grads, args=(grads, trainable_variables))

            # As in Keras: this cond must be built in cross-replica context, because
            # the inner optimizer's apply calls merge_call.
            keras.ops.cond(finite, apply_fn, self._stateful_handle_non_finite_grads)

        tf.distribute.get_replica_context().merge_call(
            _handle_cross_replica, args=(grads, trainable_variables))


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
    original = keras.mixed_precision.LossScaleOptimizer.check_finite

    def spy(self, grads):
        result = original(self, grads)
        replica = int(tf.get_static_value(
            tf.distribute.get_replica_context().replica_id_in_sync_group))

        def on_execution(value):
            flags[replica] = bool(value.numpy())
            return []

        # Record when the traced step executes (graph mode: eager collectives under
        # MirroredStrategy would disturb later strategies in the same process).
        tf.py_function(on_execution, [result], Tout=[])
        return result

    wrapper = AllReplicasFiniteLossScaleOptimizer if fixed else None
    keras.mixed_precision.LossScaleOptimizer.check_finite = spy
    try:
        with mixed_precision_policy("mixed_float16"):
            model, optimizer, _ = _compile_patched(strategy, "none", 1, 0.1, run_eagerly=False,
                                                   wrapper=wrapper)
            model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.LossScaleOptimizer.check_finite = original
    return FiniteFlags(
        overflow_replicas=tuple(overflow_replicas), finite_by_replica=dict(sorted(flags.items())),
        applied=int(optimizer.iterations.numpy()) == 1,
        weights_finite=all(np.all(np.isfinite(np.asarray(w))) for w in model.weights))
