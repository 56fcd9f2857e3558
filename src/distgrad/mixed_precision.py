"""A Keras 3 `LossScaleOptimizer` that skips a step when *any* replica overflowed.

It imports only TensorFlow, Keras and the standard library: copy this one file (the
finiteness all-reduce at its end is generated from `non_finite.py`). Why
Keras' own wrapper misses an overflow on replica 1: docs/design.md,
"AllReplicasFiniteLossScaleOptimizer".
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

# The public names (the API page documents them); the other functions serve them.
__all__ = ["AllReplicasFiniteLossScaleOptimizer"]

# The oldest versions the version matrix passes (docs/versions.md). Older Keras fails here:
# < 3.5 does not sum gradients over replicas (keras-team/keras#19969).
NEEDED = {"tensorflow": (2, 16), "keras": (3, 10)}
if any(tuple(map(int, m.__version__.split(".")[:2])) < NEEDED[m.__name__] for m in (tf, keras)):
    raise ImportError(f"distgrad.mixed_precision needs TensorFlow >= 2.16 and Keras >= 3.10, found "
                      f"TensorFlow {tf.__version__} and Keras {keras.__version__}: "
                      "pip install -U 'tensorflow>=2.16' 'keras>=3.10'")


@keras.saving.register_keras_serializable(package="distgrad")
class AllReplicasFiniteLossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer):
    """Keras' `LossScaleOptimizer`, skipping a step unless every replica's gradients are finite.

    Keras' own wrapper takes the finiteness of the gradients from replica 0 only; this one
    ANDs every replica's flag (of every worker), so all skip together. With one replica it
    behaves exactly like Keras' wrapper.

    Args:
        inner_optimizer: the optimizer that makes the update.
        *args: Keras' `LossScaleOptimizer` arguments: `initial_scale` (default 2**15),
            `dynamic_growth_steps` (finite steps after which the scale doubles).
        **kwargs: the same, by keyword, and Keras' optimizer keyword arguments.

    State:
        Keras' (`dynamic_scale`, the step counter, the inner optimizer's variables), and
        `skipped_steps`: steps skipped because some replica's gradients overflowed (under
        `AccumulatingOptimizer`, a step is a micro-batch). At the end of a `fit` that
        skipped some, a `UserWarning` gives the count and the scale.

    Example:

    ```python
    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=AllReplicasFiniteLossScaleOptimizer(
            AccumulatingOptimizer(keras.optimizers.Adam(), accumulation_steps=4)),
            loss="mse")
    ```

    Raises:
        ValueError: `apply` in cross-replica context; (first step) 2+ replicas without
            merge_call (XLA on GPUs), where no loss-scale update can run.
    """

    def __init__(self, inner_optimizer, *args, **kwargs):
        super().__init__(inner_optimizer, *args, **kwargs)
        self._skips_reported = None  # `skipped_steps` when the step was traced / last fit
        # AccumulatingOptimizer refuses, on 2+ replicas, a wrapper that does not say this.
        if hasattr(inner_optimizer, "overflow_checked_on_every_replica"):
            inner_optimizer.overflow_checked_on_every_replica = True

    def build(self, var_list):
        super().build(var_list)
        self.skipped_steps = self.add_variable(
            shape=(), dtype="int", initializer="zeros", aggregation="none",
            name="skipped_steps")
        if not tf.executing_eagerly():  # created in a trace (no strategy): 0, not readable yet
            self._skips_reported = 0

    def _stateful_handle_non_finite_grads(self):
        super()._stateful_handle_non_finite_grads()  # the scale halves
        self.skipped_steps.assign_add(1)

    def finalize_variable_values(self, var_list):
        """Keras calls it at the end of every `fit`: the inner optimizer's, then a
        `UserWarning` if steps were skipped since the last call."""
        super().finalize_variable_values(var_list)
        if not self.built:
            return
        skipped, before = self._skipped_now(), self._skips_reported
        if before is not None and skipped > before:
            what = ("micro-batch(es)" if hasattr(self.inner_optimizer, "accumulation_steps")
                    else "step(s)")
            scale = float(keras.ops.convert_to_numpy(self.dynamic_scale))
            warnings.warn(
                f"{type(self).__name__}: {skipped - before} {what} skipped in this fit "
                f"({skipped} in all, `optimizer.skipped_steps`): their gradients overflowed "
                f"on some replica, and the loss scale was halved each time (now {scale:g}). "
                "A few are expected while the scale comes down from its initial value.",
                stacklevel=2)
        self._skips_reported = skipped

    def _skipped_now(self) -> int:
        with tf.init_scope():  # eager, also while a step is being traced
            return int(keras.ops.convert_to_numpy(self.skipped_steps))

    def apply(self, grads, trainable_variables=None):
        if self._skips_reported is None:  # the first trace: a restored count is not news
            self._skips_reported = self._skipped_now() if self.built else 0
        super().apply(grads, trainable_variables)

    # Keras' `_tf_apply`, with the AND over replicas in place of "take replica 0's value".
    def _tf_apply(self, grads, trainable_variables=None):
        if tf.distribute.in_cross_replica_context():
            raise ValueError("Call apply() inside strategy.run: it must be called in a replica "
                             "context.")
        # Keras branches on the same internal TF predicate: no merge_call available.
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                self._common_apply(grads, trainable_variables=trainable_variables)
                return
            # Keras' update is then a replica-context cond, in which TensorFlow cannot
            # update the inner optimizer's ONLY_FIRST_REPLICA `iterations`.
            raise ValueError(
                "Compile with jit_compile=False: "
                f"{type(self).__name__} cannot update on {context.num_replicas_in_sync} "
                "replicas without merge_call (XLA on GPUs), and Keras' own LossScaleOptimizer "
                "fails there too.")

        def _handle_cross_replica(distribution, grads, trainable_variables):
            finite_per_replica = distribution.extended.call_for_each_replica(
                self.check_finite, args=(grads,))
            # Each replica's partial gradients (summed later, in the inner optimizer).
            finite = finite_everywhere(distribution, finite_per_replica)

            def apply_fn():
                distribution.extended.call_for_each_replica(
                    self._stateful_handle_finite_grads, args=(grads, trainable_variables))

            # As in Keras: this cond must be built in cross-replica context, because
            # the inner optimizer's apply calls merge_call.
            keras.ops.cond(finite, apply_fn, self._stateful_handle_non_finite_grads)

        tf.distribute.get_replica_context().merge_call(
            _handle_cross_replica, args=(grads, trainable_variables))


# ---- generated from non_finite.py: finite_everywhere
# Copied here so that this file copies alone: edit non_finite.py, then run `make copies`.

def finite_everywhere(distribution, finite):
    """Cross-replica context: whether the per-replica flag `finite` holds on every replica
    of every worker (one small all-reduce on 2+ workers, none on one)."""
    local = distribution.experimental_local_results(finite)
    if distribution.num_replicas_in_sync == len(local):
        return tf.reduce_all(tf.stack(local))
    non_finite = distribution.experimental_distribute_values_from_function(
        lambda value_context: 1.0 - tf.cast(
            local[value_context.replica_id_in_sync_group % len(local)], tf.float32))
    return tf.equal(distribution.reduce(tf.distribute.ReduceOp.SUM, non_finite, axis=None), 0.0)


# ---- end of the code generated from non_finite.py
