"""The data and models the `non_finite` specs share (a helper module, no tests): a float32
regression set with one NaN target placed in the last replica's shard of one batch, and a
compiled `tiny_model`. Used by the non-finite specs of AccumulatingOptimizer,
GradientAccumulator, MicroBatching, AccumulationCallback and the loss-scale wrapper.
"""

import numpy as np
import tensorflow as tf

from distgrad_course.lab.data import regression_data, tiny_model

K, MICRO, UPDATES = 2, 4, 3


def replicas_of(strategy):
    return 1 if strategy is None else strategy.num_replicas_in_sync


def nan_data(strategy, micro_batch_index=2, batch=MICRO, examples=MICRO * K * UPDATES):
    """regression data with one NaN target, in the last replica's shard of one batch."""
    x, y = regression_data(examples)
    replicas = replicas_of(strategy)
    y[micro_batch_index * batch + (replicas - 1) * (batch // replicas)] = np.nan
    return x, y


def compiled(strategy, optimizer_factory, model_factory=tiny_model):
    with (strategy or tf.distribute.get_strategy()).scope():
        model = model_factory()
        model.compile(optimizer=optimizer_factory(), loss="mse")
    return model
