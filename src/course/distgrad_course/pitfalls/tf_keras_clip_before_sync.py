"""Lesson 01's clipping under tf-keras (Keras 2): the optimizer clips *after* the all-reduce.

tf-keras only: imported in a `distgrad_course.lab.tf_keras_runner.run_tf_keras` child, where
`TF_USE_LEGACY_KERAS=1` makes `tf.keras` the tf-keras package;
`distgrad_course.pitfalls.clip_before_sync.reproduce_tf_keras` runs `clip_on_replicas` there.

Both tf-keras optimizers sum first and clip second: `tf.keras.optimizers.SGD`
(`tf_keras/src/optimizers/optimizer.py`: `apply_gradients` calls `aggregate_gradients`,
then the base class' `apply_gradients` calls `_clip_gradients`) and
`tf.keras.optimizers.legacy.SGD` (`optimizer_v2.py`: `_aggregate_gradients`, then
`_transform_gradients`). `clip_on_replicas` measures it: one clipped SGD step of the
tutorial's replica step on R replicas against the same step on one device.
"""

from __future__ import annotations

import os

if os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    raise ImportError("distgrad_course.pitfalls.tf_keras_clip_before_sync is tf-keras code: run "
                      "it through distgrad_course.lab.tf_keras_runner.run_tf_keras "
                      "(TF_USE_LEGACY_KERAS=1).")

import numpy as np
import tensorflow as tf

from distgrad_course.lab.tf_keras_runner import tf_keras_strategy

OPTIMIZERS = {"SGD": lambda **kw: tf.keras.optimizers.SGD(**kw),
              "legacy.SGD": lambda **kw: tf.keras.optimizers.legacy.SGD(**kw)}


def _data(examples: int, seed: int = 0):
    """The numbers of `distgrad_course.lab.data.regression_data` (which imports Keras 3)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 4)).astype("float32")
    w = rng.normal(size=(4, 1)).astype("float32")
    return x, (x @ w + 0.1 * rng.normal(size=(examples, 1))).astype("float32")


def _model():
    init = tf.keras.initializers.GlorotUniform
    return tf.keras.Sequential([
        tf.keras.layers.Dense(8, activation="tanh", kernel_initializer=init(seed=0),
                              input_shape=(4,)),
        tf.keras.layers.Dense(1, kernel_initializer=init(seed=1))])


def _per_example_loss(y, predictions):
    return tf.reduce_mean(tf.square(predictions - y), axis=-1)


def _one_device_step(make_optimizer, initial, x, y):
    model, optimizer = _model(), make_optimizer()
    model.set_weights(initial)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(_per_example_loss(y, model(x, training=True)))
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return model.get_weights(), float(tf.linalg.global_norm(gradients))


def _replicas_step(strategy, make_optimizer, initial, x, y):
    with strategy.scope():
        model, optimizer = _model(), make_optimizer()
    model.set_weights(initial)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x)))))

    def train_step(xb, yb):  # the tutorial's replica step
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(_per_example_loss(yb, model(xb, training=True)),
                                              global_batch_size=len(x))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return tf.linalg.global_norm(gradients)  # this replica's partial gradient

    norms = tf.function(lambda b: strategy.run(train_step, args=b))(batch)
    return model.get_weights(), [float(n) for n in strategy.experimental_local_results(norms)]


def clip_on_replicas(replicas: int, clip_norm: float = 0.05, learning_rate: float = 0.1,
                     examples: int = 16) -> dict:
    """One SGD step with `global_clipnorm` / `clipnorm` = `clip_norm`, R replicas vs one
    device, for both tf-keras SGDs.

    Returns `{optimizer: {option: {"max_abs": replicas-vs-one-device weight difference,
    "update_max_abs": the one-device update}}}` and, under "gradient_norms", the norm
    of the full gradient and of each replica's partial gradient (all above
    `clip_norm`, so clipping is active in every run).
    """
    strategy = tf_keras_strategy(replicas)
    x, y = _data(examples)
    initial = _model().get_weights()
    results, norms = {}, {}
    for name, make in OPTIMIZERS.items():
        results[name] = {}
        for option in ("global_clipnorm", "clipnorm"):
            def make_optimizer(make=make, option=option):
                return make(learning_rate=learning_rate, **{option: clip_norm})

            one, full_norm = _one_device_step(make_optimizer, initial, x, y)
            distributed, partial_norms = _replicas_step(strategy, make_optimizer, initial, x, y)
            results[name][option] = {
                "max_abs": max(float(np.abs(a - b).max()) for a, b in zip(distributed, one)),
                "update_max_abs": max(float(np.abs(a - b).max()) for a, b in zip(one, initial)),
            }
            norms = {"full": full_norm, "per_replica": partial_norms}
    return {"clip_norm": clip_norm, "results": results, "gradient_norms": norms}
