"""Lesson 02's question under tf-keras (Keras 2): `apply_gradients` outside `strategy.run`.

tf-keras only: imported in a `distgrad_course.lab.tf_keras_runner.run_tf_keras` child, where
`TF_USE_LEGACY_KERAS=1` makes `tf.keras` the tf-keras package;
`distgrad_course.pitfalls.outside_strategy_run.reproduce_tf_keras` runs `apply_outside_run`
there, to show the message the user quoted (OptimizerV2's cross-replica check).
"""

from __future__ import annotations

import os

if os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    raise ImportError("distgrad_course.pitfalls.tf_keras_outside_strategy_run is tf-keras code: "
                      "run it "
                      "through distgrad_course.lab.tf_keras_runner.run_tf_keras "
                      "(TF_USE_LEGACY_KERAS=1).")

import tensorflow as tf

from distgrad_course.lab.tf_keras_runner import tf_keras_strategy


def apply_outside_run(replicas: int) -> dict:
    """Per-replica gradients from `strategy.run`, applied under the scope but outside
    `strategy.run` with `tf.keras.optimizers.legacy.SGD`; the error's type and message
    (both None if it ran)."""
    strategy = tf_keras_strategy(replicas)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(4,))])
        optimizer = tf.keras.optimizers.legacy.SGD(0.1)
    x, y = tf.ones((8, 4)), tf.ones((8, 1))
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8))))

    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        return tape.gradient(loss, model.trainable_variables)

    per_replica = strategy.run(train_step, args=batch)
    try:
        with strategy.scope():
            optimizer.apply_gradients(zip(per_replica, model.trainable_variables))
    except Exception as err:  # the error is the observation
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": None}
