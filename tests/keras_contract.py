"""What the Keras optimizer-contract tests share: scripted `apply_gradients` calls, as in
Keras' own `optimizers/optimizer_test.py` and `backend/tensorflow/optimizer_distribute_test.py`,
run on one device or inside `strategy.run`, and the references they are compared with."""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

from distgrad.optimizer import AccumulatingOptimizer

# The optimizers Keras' tests sweep (test_gradient_accumulation_with_weigth_decay,
# test_pickleable_optimizers).
KERAS_SWEEP = ("adam", "sgd", "adamw", "adagrad", "rmsprop", "adadelta", "adamax", "lion",
               "nadam", "ftrl", "adafactor")


def scope(strategy):
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def replicas(strategy) -> int:
    return 1 if strategy is None else strategy.num_replicas_in_sync


def variable(values, **attributes):
    """A float32 `keras.Variable`; `attributes` are set on it (`constraint`,
    `overwrite_with_gradient`), as Keras' tests do."""
    created = keras.Variable(np.asarray(values, "float32"))
    for name, value in attributes.items():
        setattr(created, name, value)
    return created


def wrapped(inner, accumulation_steps=1, **kwargs):
    return AccumulatingOptimizer(inner, accumulation_steps=accumulation_steps, **kwargs)


def apply_calls(strategy, optimizer, variables, calls):
    """Apply each of `calls` (one gradient per variable: an array or None) in one
    `apply_gradients`; inside `strategy.run` when a strategy is given. Returns the
    variables' values after each call.

    The gradient tensors are made inside the replica function, so every replica has its
    own, as in a training step, and the inner optimizer's SUM all-reduce adds R of them.
    (A tensor captured from outside `strategy.run` is not summed by eager MirroredStrategy;
    Keras' optimizer_distribute_test.test_ema passes only because of that.)
    """
    after = []
    for grads in calls:
        def step(grads=grads):
            optimizer.apply_gradients(
                [(None if g is None else tf.constant(g, dtype=v.dtype), v)
                 for g, v in zip(grads, variables)])
        if strategy is None:
            step()
        else:
            strategy.run(step)
        after.append([np.array(v.numpy()) for v in variables])
    return after


def repeated(calls, k):
    """Each call k times: k micro-batches with the same gradient make one update with it."""
    return [grads for grads in calls for _ in range(k)]


def means(calls, k):
    """The mean gradient of each group of k calls: what one big-batch update sees."""
    return [[np.mean([c[i] for c in calls[start:start + k]], axis=0)
             for i in range(len(calls[0]))] for start in range(0, len(calls), k)]


def random_calls(count, shape=(2, 2), seed=0, variables=1):
    rng = np.random.RandomState(seed)
    return [[rng.randn(*shape).astype("float32") for _ in range(variables)]
            for _ in range(count)]


def counters(optimizer):
    """(iterations, total_micro_steps, micro_steps) as Python ints."""
    return (int(optimizer.iterations.numpy()), int(optimizer.total_micro_steps.numpy()),
            int(np.asarray(optimizer.micro_steps.numpy())))
