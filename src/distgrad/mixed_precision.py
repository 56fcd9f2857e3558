"""A Keras 3 `LossScaleOptimizer` that skips a step when *any* replica overflowed.

Keras' own wrapper, under `MirroredStrategy`, takes the finiteness of the gradients from
replica 0 only (`LossScaleOptimizer._tf_apply`: "Arbitrarily take `finite` from the
first replica"). The comment is inherited from tf-keras, where the gradients were
all-reduced before the check; in Keras 3 the wrapper sees each replica's *partial*
gradients and the sum happens later, inside the inner optimizer. An overflow confined
to another replica's shard is therefore applied, and the all-reduce sums `inf` into
every copy of the weights. `distgrad.pitfalls.lso_first_replica_finite` reproduces it.

This file imports only TensorFlow and Keras: copy it into a project and use
`AllReplicasFiniteLossScaleOptimizer` where Keras would build a `LossScaleOptimizer`.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

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

    Pass it to `model.compile(optimizer=...)` under a `mixed_float16` policy (Keras then
    does not add its own wrapper), or use it in a custom loop exactly like Keras'
    `LossScaleOptimizer`; it composes with accumulation as
    `AllReplicasFiniteLossScaleOptimizer(AccumulatingOptimizer(inner, k))`.

    It takes the constructor arguments of Keras' `LossScaleOptimizer`: `inner_optimizer`
    (the optimizer that makes the update), `initial_scale` (default 2**15),
    `dynamic_growth_steps` (finite steps after which the scale doubles) and its
    keyword arguments.

    State: that of `LossScaleOptimizer` (`dynamic_scale`, its step counter and the
    inner optimizer's variables), and `skipped_steps`: the steps it skipped because some
    replica's gradients overflowed (under `AccumulatingOptimizer`, a step is a
    micro-batch). `model.save` and `tf.train.Checkpoint` save it.

    Nothing skipped is silent: at the end of every `fit` that skipped steps, a
    `UserWarning` says how many and the scale they brought it to (a few are expected
    while the scale comes down from its initial 2**15);
    `distgrad.AccumulationCallback` puts the count into `fit`'s logs.

    Contract, per call of `apply` / `apply_gradients` in replica context:
        * every replica's gradients finite: they are unscaled and applied (the inner
          optimizer all-reduces them) and the scale may grow, as in Keras;
        * any replica's gradients non-finite: no replica applies anything, the scale
          halves; the decision is the same on every replica, of every worker (read in
          cross-replica context: on one worker every replica's flag is visible there, no
          extra collective; on several workers of a MultiWorkerMirroredStrategy, one
          small all-reduce of the flags across workers, so that all skip together).
        With one replica it behaves exactly like Keras' wrapper.

    Raises:
        ValueError: `apply` called in cross-replica context; (first step) 2+ replicas
            without merge_call (XLA on GPUs), where no loss-scale update can run.
    """

    def __init__(self, inner_optimizer, *args, **kwargs):
        super().__init__(inner_optimizer, *args, **kwargs)
        self._skips_reported = None  # `skipped_steps` when the step was traced / last fit
        # distgrad's AccumulatingOptimizer refuses, on 2+ replicas, a wrapper that does not
        # say this.
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

    # Keras computes `finite` inside `_tf_apply` (private), and no public hook sees
    # all replicas' flags, so the override is of that method: Keras' body, with the
    # AND over replicas in place of "take replica 0's value".
    def _tf_apply(self, grads, trainable_variables=None):
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        # Keras branches on the same internal TF predicate: no merge_call available.
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                self._common_apply(grads, trainable_variables=trainable_variables)
                return
            # Keras' update is then a replica-context cond around the inner optimizer,
            # whose `iterations` (ONLY_FIRST_REPLICA) TensorFlow updates through
            # merge_call, which it refuses in a cond: fail here, naming the way out.
            raise ValueError(
                f"{type(self).__name__} cannot update on {context.num_replicas_in_sync} "
                "replicas without merge_call (TensorFlow's path for XLA-compiled steps on "
                "GPUs): Keras' loss-scale update is a replica-context tf.cond, in which "
                "TensorFlow cannot update the inner optimizer's `iterations`. Keras' own "
                "LossScaleOptimizer fails there too. Compile with jit_compile=False.")

        def _handle_cross_replica(distribution, grads, trainable_variables):
            finite_per_replica = distribution.extended.call_for_each_replica(
                self.check_finite, args=(grads,))
            # The gradients are each replica's partial gradients (Keras 3 sums them
            # later, inside the inner optimizer): every replica must be finite.
            finite = _finite_everywhere(distribution, finite_per_replica)

            def apply_fn():
                distribution.extended.call_for_each_replica(
                    self._stateful_handle_finite_grads, args=(grads, trainable_variables))

            # As in Keras: this cond must be built in cross-replica context, because
            # the inner optimizer's apply calls merge_call.
            keras.ops.cond(finite, apply_fn, self._stateful_handle_non_finite_grads)

        tf.distribute.get_replica_context().merge_call(
            _handle_cross_replica, args=(grads, trainable_variables))


def _finite_everywhere(distribution, finite):
    """In cross-replica context: whether the per-replica flag `finite` holds on every
    replica of every worker.

    `experimental_local_results` holds this worker's replicas only. On one worker (every
    replica local: MirroredStrategy) their AND is the answer, with no collective. On a
    MultiWorkerMirroredStrategy of 2+ workers, one small all-reduce (float32: GPU
    collectives take no int32) adds up the non-finite flags, so every worker takes the same
    branch; else a worker that skips leaves the others waiting in the gradient all-reduce.
    Every worker issues it, before the branch, in the same order.
    """
    local = distribution.experimental_local_results(finite)
    if distribution.num_replicas_in_sync == len(local):
        return tf.reduce_all(tf.stack(local))
    # Each local replica's 1.0 if non-finite (any order: it is a sum); no replica threads,
    # which call_for_each_replica would start inside merge_call.
    non_finite = distribution.experimental_distribute_values_from_function(
        lambda value_context: 1.0 - tf.cast(
            local[value_context.replica_id_in_sync_group % len(local)], tf.float32))
    return tf.equal(distribution.reduce(tf.distribute.ReduceOp.SUM, non_finite, axis=None), 0.0)
