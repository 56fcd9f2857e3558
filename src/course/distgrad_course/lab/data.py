"""Tiny deterministic models and data for equivalence proofs.

Models are deliberately small and free of randomness at train time (no dropout, no
BatchNorm), and initializers are seeded, so two builds give bit-identical weights.
Create a model under `strategy.scope()` to get mirrored variables.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf


def regression_data(examples: int = 32, features: int = 4, outputs: int = 1, seed: int = 0):
    """`(x, y)` float32 arrays of a noisy linear target: shapes (examples, features/outputs)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, features)).astype("float32")
    w = rng.normal(size=(features, outputs)).astype("float32")
    y = (x @ w + 0.1 * rng.normal(size=(examples, outputs))).astype("float32")
    return x, y


def tiny_model(features: int = 4, hidden: int = 8, outputs: int = 1, seed: int = 0,
               dtype_policy=None) -> keras.Model:
    """A 2-layer tanh MLP with seeded initializers: same `seed`, same initial weights."""
    init = keras.initializers.GlorotUniform
    layers = [
        keras.Input((features,)),
        keras.layers.Dense(hidden, activation="tanh", kernel_initializer=init(seed=seed),
                           bias_initializer="zeros", dtype=dtype_policy),
        keras.layers.Dense(outputs, kernel_initializer=init(seed=seed + 1),
                           bias_initializer="zeros", dtype=dtype_policy),
    ]
    if dtype_policy is not None:
        # Mixed precision: keep the output in float32 so losses are computed in float32.
        layers.append(keras.layers.Activation("linear", dtype="float32"))
    return keras.Sequential(layers)


def per_example_squared_error(y_true, y_pred):
    """Per-example mean squared error, shape (batch,): the loss before any reduction."""
    return tf.reduce_mean(tf.square(tf.cast(y_pred, tf.float32) - y_true), axis=-1)


def token_data(examples: int = 16, vocab: int = 6, length: int = 5, seed: int = 0):
    """`(tokens, y)`: int32 token ids (examples, length), with repeats, and float32 targets."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(examples, length)).astype("int32")
    y = rng.normal(size=(examples, 1)).astype("float32")
    return tokens, y


def embedding_model(vocab: int = 6, length: int = 5, dim: int = 3, seed: int = 0) -> keras.Model:
    """Embedding -> mean over tokens -> Dense(1); its embedding gradient is IndexedSlices."""
    return keras.Sequential([
        keras.Input((length,), dtype="int32"),
        keras.layers.Embedding(vocab, dim, embeddings_initializer=keras.initializers.RandomUniform(
            -0.5, 0.5, seed=seed)),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1)),
    ])


def classifier_model(accumulation_steps: int | None = None) -> keras.Model:
    """4 features -> Dense(16, sigmoid) -> 3-way softmax, seeded; a `MicroBatchingModel`
    with `accumulation_steps` micro-batches when given, else a plain `keras.Model`."""
    from distgrad.train_step import MicroBatchingModel

    inputs = keras.Input((4,))
    h = keras.layers.Dense(16, activation="sigmoid",
                           kernel_initializer=keras.initializers.GlorotUniform(seed=0))(inputs)
    outputs = keras.layers.Dense(3, activation="softmax",
                                 kernel_initializer=keras.initializers.GlorotUniform(seed=1))(h)
    if accumulation_steps is None:
        return keras.Model(inputs, outputs)
    return MicroBatchingModel(inputs, outputs, accumulation_steps=accumulation_steps)
