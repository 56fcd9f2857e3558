"""Pitfall: BatchNorm statistics are per micro-batch and per replica.

In training mode `BatchNormalization` normalizes with the mean and variance of the
batch *it sees*. On R replicas each sees B/R examples; with k accumulated micro-batches
each forward pass sees B/k. Both change the function being differentiated, so no
gradient bookkeeping can make them equal to the big batch. Across replicas,
`BatchNormalization(synchronized=True)` all-reduces the statistics and recovers the
big-batch step; across *sequential* micro-batches nothing can, because the statistics
of later micro-batches don't exist yet when the first one runs. `LayerNormalization`
normalizes each example by itself: accumulating it is exact (`accumulated_layer_norm`).
"""

from __future__ import annotations

import dataclasses
import functools

import keras
import numpy as np
import tensorflow as tf

from distgrad_course.lab.compare import WeightDiff, weight_diff, weights_of
from distgrad_course.lab.data import per_example_squared_error, regression_data
from distgrad_course.lab.recipes import big_batch_reference, make_replica_step, run_steps


def batchnorm_model(features: int = 4, hidden: int = 8, synchronized: bool = False, seed: int = 0):
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(hidden, kernel_initializer=init(seed=seed)),
        keras.layers.BatchNormalization(synchronized=synchronized),
        keras.layers.Activation("tanh"),
        keras.layers.Dense(1, kernel_initializer=init(seed=seed + 1)),
    ])


def layernorm_model(features: int = 4, hidden: int = 8, seed: int = 0):
    """`batchnorm_model` with `LayerNormalization` in place of `BatchNormalization`."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(hidden, kernel_initializer=init(seed=seed)),
        keras.layers.LayerNormalization(),
        keras.layers.Activation("tanh"),
        keras.layers.Dense(1, kernel_initializer=init(seed=seed + 1)),
    ])


def accumulated_on_one_device(x, y, micro_batches: int, learning_rate: float = 0.1,
                              model_factory=batchnorm_model):
    """The model after one SGD update from `micro_batches` accumulated micro-batches."""
    model = model_factory()
    optimizer = keras.optimizers.SGD(learning_rate)
    optimizer.build(model.trainable_variables)
    total = None
    for part in np.split(np.arange(len(x)), micro_batches):
        with tf.GradientTape() as tape:
            per_example = per_example_squared_error(y[part], model(x[part], training=True))
            loss = tf.reduce_sum(per_example) / len(x)  # normalized by the whole update
        grads = tape.gradient(loss, model.trainable_variables)
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    optimizer.apply_gradients(zip(total, model.trainable_variables))
    return model


@dataclasses.dataclass(frozen=True)
class BatchNormRecord:
    """Trainable-weight differences from one device on the full batch, after one SGD step.

    `accumulated_layer_norm`: the same accumulation with `LayerNormalization`, against
    its own big-batch step.
    """

    replicas: int
    replicas_plain_bn: WeightDiff
    replicas_synchronized_bn: WeightDiff
    accumulated_micro_batches: WeightDiff
    one_device_update_max_abs: float
    accumulated_layer_norm: WeightDiff


def reproduce(strategy, micro_batches: int = 2, examples: int = 16,
              learning_rate: float = 0.1) -> BatchNormRecord:
    """One SGD step of `batchnorm_model` on `examples` examples: on `strategy`'s replicas
    (plain and synchronized BatchNorm) and accumulated over `micro_batches` on one device,
    each against one big-batch step on one device; the same accumulation of
    `layernorm_model` against its own big-batch step.
    """
    x, y = regression_data(examples)

    def sgd():
        return keras.optimizers.SGD(learning_rate)

    trainable_positions = [i for i, w in enumerate(batchnorm_model().weights) if w.trainable]

    def trainable(weights):
        # run_steps and big_batch_reference return all weights (BN moving stats too)
        return [weights[i] for i in trainable_positions]

    reference = trainable(big_batch_reference(sgd, x, y, model_factory=batchnorm_model))
    step = make_replica_step(examples)
    plain = run_steps(strategy, sgd, x, y, step, model_factory=batchnorm_model)
    synced_factory = functools.partial(batchnorm_model, synchronized=True)
    synced = run_steps(strategy, sgd, x, y, step, model_factory=synced_factory)
    accumulated = accumulated_on_one_device(x, y, micro_batches, learning_rate)
    initial = trainable(weights_of(batchnorm_model()))
    layer_norm = accumulated_on_one_device(x, y, micro_batches, learning_rate, layernorm_model)
    return BatchNormRecord(
        replicas=strategy.num_replicas_in_sync,
        replicas_plain_bn=weight_diff(trainable(plain.final), reference),
        replicas_synchronized_bn=weight_diff(trainable(synced.final), reference),
        accumulated_micro_batches=weight_diff(
            [v.numpy() for v in accumulated.trainable_weights], reference),
        one_device_update_max_abs=float(
            max(np.abs(a - b).max() for a, b in zip(reference, initial))),
        accumulated_layer_norm=weight_diff(
            weights_of(layer_norm), big_batch_reference(sgd, x, y, model_factory=layernorm_model)),
    )
