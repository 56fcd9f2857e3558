"""What a step does with NaN/Inf gradients: raise or skip, decided alike on every replica.

Defined here once. `optimizer.py`, `accumulator.py`, `train_step.py` and
`mixed_precision.py` each carry a generated copy of what they use (`make copies` writes
it), so that each copies alone. It imports only TensorFlow and Keras. Why each step is
there: docs/design.md, "The non-finite policy".
"""

from __future__ import annotations

import keras
import tensorflow as tf
from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext  # XLA or not

NON_FINITE_POLICIES = ("raise", "skip")
# Not a user's choice: under a LossScaleOptimizer, it skips and halves its scale.
LOSS_SCALE = "loss_scale"
CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")


def check_policy(non_finite) -> None:
    if non_finite not in NON_FINITE_POLICIES:
        raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}.")


def check_can_raise(who: str = "non_finite='raise'") -> None:
    """Trace time: refuse "raise" in an XLA-compiled step, which compiles assertions out."""
    if GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            "Pass non_finite='skip' (and watch skipped_updates), or compile with "
            f"jit_compile=False: {who} cannot raise in an XLA-compiled step, where XLA "
            "compiles assertions out (Keras compiles with XLA on a GPU by itself).")


def all_finite(tensors):
    """A scalar bool: every element of every tensor (None skipped) is finite."""
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(t)))
                                   for t in tensors if t is not None]))


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


def finite_on_all_replicas(finite):
    """Replica context, without merge_call: `finite` on every replica (one all-reduce)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return finite
    return tf.equal(context.all_reduce(
        tf.distribute.ReduceOp.SUM, 1.0 - tf.cast(finite, tf.float32)), 0.0)


def clips_each_replica(optimizer) -> bool:
    """True for a Keras 3 optimizer (or one in a LossScaleOptimizer) that clips: Keras clips
    each replica's part before the SUM all-reduce. AccumulatingOptimizer clips the sum."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "non_finite", None) is not None:  # also inside a LossScaleOptimizer
        return False
    return (isinstance(inner, keras.optimizers.Optimizer)
            and any(getattr(inner, option, None) for option in CLIP_OPTIONS))


def summed_on_replica_0(grads):
    """Replica context: the SUM over replicas of `grads` on replica 0, zeros elsewhere."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return grads
    present = [i for i, g in enumerate(grads) if g is not None]
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                [tf.convert_to_tensor(grads[i]) for i in present])
    first = tf.equal(context.replica_id_in_sync_group, 0)
    grads = list(grads)
    for i, total in zip(present, summed):
        grads[i] = tf.where(first, total, tf.zeros_like(total))
    return grads


def poisoned(grads, finite):
    """`grads` with the first gradient all NaN unless `finite` (a scalar bool)."""
    grads = list(grads)
    i = next(i for i, g in enumerate(grads) if g is not None)
    values = grads[i].values if isinstance(grads[i], tf.IndexedSlices) else grads[i]
    values = tf.where(finite, values, tf.constant(float("nan"), values.dtype))
    grads[i] = (tf.IndexedSlices(values, grads[i].indices, grads[i].dense_shape)
                if isinstance(grads[i], tf.IndexedSlices) else values)
    return grads


def _no_output(fn, *args, **kwargs) -> None:  # a tf.cond branch: both return nothing
    fn(*args, **kwargs)


def apply_unless_non_finite(apply_fn, grads, non_finite: str, describe, on_skip) -> None:
    """Replica context: `apply_fn(grads)` unless some replica's `grads` hold NaN/Inf.

    Args:
        apply_fn: applies the gradients it is given (calls the optimizer).
        grads: this replica's gradients (None skipped).
        non_finite: "raise": `tf.errors.InvalidArgumentError` ("assertion failed: " and
            what `describe()` returns) before anything changes. "skip": `on_skip()` runs
            instead, once. `LOSS_SCALE` (`apply_fn` calls a LossScaleOptimizer):
            `on_skip()` runs, and `apply_fn` gets the first gradient NaN on every replica,
            so the optimizer skips and halves its scale.
        describe: a callable returning the assertion's strings and tensors.
        on_skip: a callable run when the update is skipped.

    Raises:
        ValueError: (trace time) a bad policy; "raise" under XLA; "skip" or `LOSS_SCALE` on
            2+ replicas without merge_call (XLA on GPUs).
    """
    if non_finite != LOSS_SCALE:
        check_policy(non_finite)
    finite = all_finite(grads)
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync
    no_merge_call = tf.__internal__.distribute.strategy_supports_no_merge_call()
    if non_finite == LOSS_SCALE:
        if replicas > 1 and no_merge_call:
            raise ValueError(
                "Compile with jit_compile=False: a LossScaleOptimizer cannot update on several "
                "replicas without merge_call (XLA on GPUs), where TensorFlow cannot update "
                "the inner optimizer's `iterations` inside its tf.cond.")
        if no_merge_call:  # one replica (no strategy, or XLA): its flag is all there is
            tf.cond(finite, lambda: None, lambda: _no_output(on_skip))
        else:
            def every_replica(distribution, flag):
                everywhere = finite_everywhere(distribution, flag)
                tf.cond(everywhere, lambda: None, lambda: _no_output(on_skip))
                return everywhere

            finite = context.merge_call(every_replica, args=(finite,))
        apply_fn(poisoned(grads, finite))
        return
    if non_finite == "raise":
        check_can_raise()
        if replicas > 1 and no_merge_call:
            finite = finite_on_all_replicas(finite)
        elif replicas > 1:
            finite = context.merge_call(finite_everywhere, args=(finite,))

        def fail():  # reads variables: ordered per replica (docs/design.md)
            with tf.control_dependencies([tf.debugging.Assert(False, describe())]):
                return tf.constant(False)

        checked = tf.cond(finite, lambda: tf.constant(True), fail)
        with tf.control_dependencies([checked]):  # gates every op apply_fn creates
            apply_fn(grads)
        return
    if no_merge_call:
        if replicas > 1:
            raise ValueError(
                "Wrap the optimizer in distgrad's AccumulatingOptimizer(optimizer, "
                "accumulation_steps=1, non_finite='skip'), or compile with jit_compile=False: "
                "without merge_call (XLA on GPUs), TensorFlow cannot update a Keras "
                "optimizer's `iterations` inside the tf.cond that skips.")
        tf.cond(finite, lambda: _no_output(apply_fn, grads), lambda: _no_output(on_skip))
        return

    def cross_replica(distribution, finite, grads):  # as LossScaleOptimizer._tf_apply
        tf.cond(finite_everywhere(distribution, finite),
                lambda: _no_output(distribution.extended.call_for_each_replica, apply_fn,
                                   args=(grads,)),
                lambda: _no_output(on_skip))

    context.merge_call(cross_replica, args=(finite, grads))
