"""Pitfall: a regularization term added to every replica's loss is applied R times.

The optimizer SUMs the replicas' gradients. The data loss is divided by the global
batch (`tf.nn.compute_average_loss`), so its R parts add up to one mean; a penalty on
the weights (`l2 * sum(l2_loss(w))`) is the same on every replica, so its gradient is
summed R times. `tf.nn.scale_regularization_loss` divides it by
`num_replicas_in_sync` (`tensorflow/python/ops/nn_impl_distribute.py`); it refuses to
run in cross-replica context.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from distgrad_course.lab.compare import WeightDiff, update_ratio, updates, weight_diff, weights_of
from distgrad_course.lab.data import per_example_squared_error, regression_data, tiny_model
from distgrad_course.lab.recipes import run_steps
from distgrad_course.pitfalls import CapturedError


def l2_penalty(model, l2: float):
    """`l2 * sum(tf.nn.l2_loss(w))` over the trainable weights; its gradient is `l2 * w`."""
    return l2 * tf.add_n([tf.nn.l2_loss(w) for w in model.trainable_variables])


def make_replica_step(global_batch_size: int, l2: float, scale_regularization: bool):
    """The tutorial's replica step with an L2 penalty, scaled or not."""
    def replica_step(model, optimizer, x, y):
        with tf.GradientTape() as tape:
            per_example = per_example_squared_error(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
            penalty = l2_penalty(model, l2)
            if scale_regularization:
                penalty = tf.nn.scale_regularization_loss(penalty)
            loss += penalty
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss
    return replica_step


@dataclasses.dataclass(frozen=True)
class RegularizationRecord:
    """One SGD step against one device on `mean loss + penalty`.

    `excess_vs_expected`: (unscaled update - one-device update) against the
    prediction -(R - 1) * learning_rate * l2 * w (the penalty's gradient applied R - 1
    extra times); `excess_ratio`: the least-squares multiple of that prediction.
    `cross_replica_error`: what `scale_regularization_loss` raises under the scope (None:
    nothing).
    """

    replicas: int
    scaled_vs_one_device: WeightDiff
    unscaled_vs_one_device: WeightDiff
    excess_vs_expected: WeightDiff
    excess_ratio: float
    cross_replica_error: CapturedError | None


def reproduce(strategy, l2: float = 0.01, learning_rate: float = 0.1,
              examples: int = 16) -> RegularizationRecord:
    """One SGD step on `examples` examples of `mean loss + l2 penalty` on `strategy`'s
    replicas, with the penalty scaled by `scale_regularization_loss` and without, each
    against the same step on one device.
    """
    x, y = regression_data(examples)
    replicas = strategy.num_replicas_in_sync

    def sgd():
        return keras.optimizers.SGD(learning_rate)

    model, optimizer = tiny_model(), sgd()
    initial = weights_of(model)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(per_example_squared_error(y, model(x))) + l2_penalty(model, l2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                  model.trainable_variables))
    one_device = weights_of(model)
    scaled, unscaled = (run_steps(strategy, sgd, x, y, make_replica_step(len(x), l2, scale))
                        for scale in (True, False))
    excess = updates(unscaled.final, one_device)
    expected = [-(replicas - 1) * learning_rate * l2 * w for w in initial]
    try:
        with strategy.scope():
            tf.nn.scale_regularization_loss(tf.constant(1.0))
        error = None
    except RuntimeError as err:
        error = CapturedError.of(err)
    return RegularizationRecord(
        replicas=replicas,
        scaled_vs_one_device=weight_diff(scaled.final, one_device),
        unscaled_vs_one_device=weight_diff(unscaled.final, one_device),
        excess_vs_expected=weight_diff(excess, expected),
        excess_ratio=update_ratio(excess, expected) if replicas > 1 else float("nan"),
        cross_replica_error=error,
    )
