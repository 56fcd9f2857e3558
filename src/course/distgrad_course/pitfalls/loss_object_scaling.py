"""Pitfall: a Keras 3 loss object divides its mean by the replica count.

`keras.losses.Loss.__call__` with the default `reduction="sum_over_batch_size"` ends in
`reduce_values`, which calls `scale_loss_for_distribution` (`keras/src/losses/loss.py`):
`value * (1 / tf.distribute.get_strategy().num_replicas_in_sync)`. Inside
`strategy.run` a replica's mean of B/R examples becomes sum / B, the same number as
`tf.nn.compute_average_loss(per_example, global_batch_size=B)` when the batch splits
evenly; it is not `tf.reduce_mean`. The scaling depends on the strategy *in scope*, not
on the context: under `strategy.scope()` in cross-replica context (an eager validation
loss, say) the loss object also returns mean / R. `reduction=None` returns the
per-example losses unscaled (the tutorial's recipe, with `compute_average_loss`).
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from distgrad_course.lab.compare import WeightDiff, weight_diff
from distgrad_course.lab.data import regression_data
from distgrad_course.lab.recipes import big_batch_reference, run_steps


@dataclasses.dataclass(frozen=True)
class LossObjectRecord:
    """Loss values on a batch whose every squared error is 1 (so the mean is 1).

    Per replica (inside `strategy.run`): `loss_object` (`keras.losses.MeanSquaredError()`),
    `reduce_mean` (of the per-example losses), `compute_average_loss` (global batch),
    `reduction_none_sum` (sum of `MeanSquaredError(reduction=None)`, i.e. B/R). And the
    loss object called eagerly under `strategy.scope()` / with no strategy.
    `sgd_step_vs_one_device`: one SGD step of the tutorial's replica step with the loss
    object as its loss (regression data), against one big-batch step on one device.
    """

    replicas: int
    global_batch: int
    loss_object: tuple
    reduce_mean: tuple
    compute_average_loss: tuple
    reduction_none_sum: tuple
    loss_object_cross_replica_in_scope: float
    loss_object_without_strategy: float
    sgd_step_vs_one_device: WeightDiff


def reproduce(strategy, examples_per_replica: int = 8) -> LossObjectRecord:
    replicas = strategy.num_replicas_in_sync
    global_batch = examples_per_replica * replicas
    y_true = np.zeros((global_batch, 1), "float32")
    y_pred = np.ones((global_batch, 1), "float32")
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((y_true, y_pred)).batch(global_batch))))
    mse = keras.losses.MeanSquaredError()

    def replica_losses(yt, yp):
        per_example = keras.losses.mean_squared_error(yt, yp)
        return (mse(yt, yp), tf.reduce_mean(per_example),
                tf.nn.compute_average_loss(per_example, global_batch_size=global_batch),
                tf.reduce_sum(keras.losses.MeanSquaredError(reduction=None)(yt, yp)))

    per_replica = tf.function(lambda b: strategy.run(replica_losses, args=b))(batch)
    local = [tuple(float(v) for v in strategy.experimental_local_results(value))
             for value in per_replica]
    with strategy.scope():
        in_scope = float(mse(y_true, y_pred))
    without = float(mse(y_true, y_pred))  # call `reproduce` outside any strategy scope

    def replica_step(model, optimizer, x, y):
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True))  # no compute_average_loss
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    x, y = regression_data(global_batch)

    def sgd():
        return keras.optimizers.SGD(0.1)

    step = run_steps(strategy, sgd, x, y, replica_step)
    return LossObjectRecord(replicas, global_batch, *local,
                            loss_object_cross_replica_in_scope=in_scope,
                            loss_object_without_strategy=without,
                            sgd_step_vs_one_device=weight_diff(step.final,
                                                               big_batch_reference(sgd, x, y)))
