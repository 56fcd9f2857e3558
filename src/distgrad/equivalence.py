"""Tiny deterministic models and data, and the weight comparison every proof ends with.

Equivalence is the course's core proof: two training recipes that should compute the
same update (2 replicas vs 1 device, k accumulated micro-batches vs one big batch) are
run from identical initial weights on identical data, and their weights compared.
Models here are deliberately small and free of randomness at train time (no dropout,
no BatchNorm), and initializers are seeded, so two builds give bit-identical weights.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

# float32 tolerances used by every equivalence check (see DEVELOPERS.md: never loosen).
FLOAT32_RTOL = 1e-6
FLOAT32_ATOL = 1e-6


# The optimizers every equivalence sweep runs: plain, stateful (momentum), adaptive
# (Adam: bias correction counts updates), and decoupled weight decay.
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}
OPTIMIZERS_WITH_WEIGHT_DECAY = {
    **OPTIMIZERS,
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
}


def regression_data(examples: int = 32, features: int = 4, outputs: int = 1, seed: int = 0):
    """`(x, y)` float32 arrays of a noisy linear target: shapes (examples, features/outputs)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, features)).astype("float32")
    w = rng.normal(size=(features, outputs)).astype("float32")
    y = (x @ w + 0.1 * rng.normal(size=(examples, outputs))).astype("float32")
    return x, y


def tiny_model(features: int = 4, hidden: int = 8, outputs: int = 1, seed: int = 0,
               dtype_policy=None) -> keras.Model:
    """A 2-layer MLP with seeded initializers: same `seed`, same initial weights.

    Create it under `strategy.scope()` to get mirrored variables.
    """
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


def weights_of(model_or_variables) -> list[np.ndarray]:
    """The current values of a model's weights (or of a list of variables) as numpy."""
    variables = getattr(model_or_variables, "weights", model_or_variables)
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


@dataclasses.dataclass(frozen=True)
class WeightDiff:
    """How far two weight lists are apart: largest absolute and relative difference."""

    max_abs: float
    max_rel: float

    def within(self, rtol: float = FLOAT32_RTOL, atol: float = FLOAT32_ATOL) -> bool:
        return self.max_abs == 0.0 or self.max_rel <= rtol or self.max_abs <= atol


def weight_diff(actual, expected) -> WeightDiff:
    """Compare two weight lists elementwise; raises ValueError if shapes differ."""
    actual, expected = list(actual), list(expected)
    if len(actual) != len(expected):
        raise ValueError(f"{len(actual)} weights vs {len(expected)} weights.")
    max_abs = max_rel = 0.0
    for a, e in zip(actual, expected):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        if a.shape != e.shape:
            raise ValueError(f"weight shapes differ: {a.shape} vs {e.shape}.")
        diff = np.abs(a - e)
        max_abs = max(max_abs, float(diff.max(initial=0.0)))
        max_rel = max(max_rel, float((diff / np.maximum(np.abs(e), 1e-30)).max(initial=0.0)))
    return WeightDiff(max_abs, max_rel)


def check_close(actual, expected, rtol: float = FLOAT32_RTOL, atol: float = FLOAT32_ATOL,
                what: str = "weights") -> WeightDiff:
    """Assert two weight lists agree like `np.allclose(actual, expected, rtol, atol)`.

    Returns the `WeightDiff` (so lessons can print it); raises AssertionError naming
    `what` and the largest differences otherwise.
    """
    diff = weight_diff(actual, expected)
    for a, e in zip(actual, expected):
        if not np.allclose(a, e, rtol=rtol, atol=atol):
            raise AssertionError(
                f"{what} differ: max abs diff {diff.max_abs:.3e}, max rel diff "
                f"{diff.max_rel:.3e} (rtol={rtol}, atol={atol})."
            )
    return diff


def check_not_close(actual, expected, rtol: float = FLOAT32_RTOL, atol: float = FLOAT32_ATOL,
                    what: str = "weights") -> WeightDiff:
    """Assert two weight lists are *not* allclose: a pitfall must produce a real difference."""
    diff = weight_diff(actual, expected)
    if all(np.allclose(a, e, rtol=rtol, atol=atol) for a, e in zip(actual, expected)):
        raise AssertionError(f"{what} unexpectedly agree (max abs diff {diff.max_abs:.3e}).")
    return diff


def updates(after, before) -> list[np.ndarray]:
    """The change each weight went through: `after - before`, elementwise."""
    return [np.asarray(a) - np.asarray(b) for a, b in zip(after, before)]


def update_ratio(update, reference_update) -> float:
    """The scalar r with update == r * reference_update (least squares over all weights).

    Used to show an update that is exactly R times too large.
    """
    u = np.concatenate([np.ravel(x) for x in update]).astype(np.float64)
    r = np.concatenate([np.ravel(x) for x in reference_update]).astype(np.float64)
    return float(u @ r / (r @ r))


def big_batch_reference(optimizer_factory, x, y, steps: int = 1, model_factory=tiny_model,
                        loss_fn=per_example_squared_error) -> list[np.ndarray]:
    """Weights after `steps` plain steps on the whole `(x, y)` batch, one device, no strategy.

    `optimizer_factory()` returns a fresh Keras optimizer. This is the reference every
    distributed or accumulated recipe must match.
    """
    with tf.distribute.get_strategy().scope():
        model = model_factory()
        optimizer = optimizer_factory()
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(yb, model(xb, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(steps):
        step(tf.constant(x), tf.constant(y))
    return weights_of(model)
