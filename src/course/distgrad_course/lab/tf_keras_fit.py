"""tf-keras training recipes for `distgrad.tf_keras`, run in a `run_tf_keras` child.

tf-keras only: imported in a child that `distgrad_course.lab.tf_keras_runner.run_tf_keras`
starts, where `TF_USE_LEGACY_KERAS=1` makes `tf.keras` the tf-keras package. The incidentals of the
tf-keras tests (`tests/test_tf_keras_*.py`) and of the tf-keras programs lessons 02–04
write: the tiny model, a `model.fit` under a strategy and the one-device big-batch
`fit` it is compared with, a callback reading the counters after every batch, and the
weights as lists. Data come from the parent (`distgrad_course.lab.data.regression_data`,
`distgrad_course.lab.mixed.overflow_data`). The optimizer, with or without
`distgrad.tf_keras.AccumulatingOptimizer`, is the caller's: this module does not import
it, so a child may use a copied file of it instead.
"""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

# tf-keras, or TensorFlow <= 2.15's own Keras 2 (a run_tf_keras child without the switch).
if not tf.keras.Model.__module__.startswith(("tf_keras.", "keras.src.engine.")):
    raise ImportError("distgrad_course.lab.tf_keras_fit is tf-keras code: run it through "
                      "distgrad_course.lab.tf_keras_runner.run_tf_keras (TF_USE_LEGACY_KERAS=1).")

keras = tf.keras  # tf-keras here (the child's tf_keras_strategy checks it)


# `distgrad_course.lab.compare.OPTIMIZERS` in tf-keras: today's optimizers and the era's
# OptimizerV2 (`tf.keras.optimizers.legacy`), plain-stateful (momentum) and adaptive (Adam).
OPTIMIZERS = {
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "legacy momentum": lambda: keras.optimizers.legacy.SGD(0.1, momentum=0.9),
    "legacy adam": lambda: keras.optimizers.legacy.Adam(0.01),
}


def tiny_model(seed: int = 0, mixed: bool = False):
    """The tf-keras twin of `distgrad_course.lab.data.tiny_model`: 4 -> Dense(8, tanh) -> 1,
    seeded; `mixed=True` adds a float32 output layer (losses in float32)."""
    init = keras.initializers.GlorotUniform
    layers = [keras.layers.Dense(8, activation="tanh", kernel_initializer=init(seed=seed),
                                 input_shape=(4,)),
              keras.layers.Dense(1, kernel_initializer=init(seed=seed + 1))]
    if mixed:
        layers.append(keras.layers.Activation("linear", dtype="float32"))
    return keras.Sequential(layers)


@contextlib.contextmanager
def policy(name: str):
    """The global tf-keras dtype policy `name` for the block ("float32", "mixed_float16");
    the previous one is restored after it."""
    with contextlib.ExitStack() as restore:
        restore.callback(keras.mixed_precision.set_global_policy,
                         keras.mixed_precision.global_policy())
        keras.mixed_precision.set_global_policy(name)
        yield


def weights(model) -> list:
    """The model's weights as nested lists (JSON for the parent)."""
    return [w.tolist() for w in model.get_weights()]


def _read(variable):
    return None if variable is None else int(variable.numpy())


class Counters(keras.callbacks.Callback):
    """After every batch: the loss scale (None without one) and the optimizer's counters.

    `rows` holds one dict per batch: `loss_scale`, `iterations` (`model.optimizer`'s),
    `updates` (the innermost optimizer's `iterations`), `micro_steps`,
    `total_micro_steps`, `skipped_updates` (None where the optimizer has none) and
    `weights_finite`.
    """

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        outer = self.model.optimizer
        innermost = outer
        while hasattr(innermost, "inner_optimizer"):
            innermost = innermost.inner_optimizer
        accumulating = next((o for o in (outer, getattr(outer, "inner_optimizer", None))
                             if hasattr(o, "total_micro_steps")), None)
        scale = getattr(outer, "loss_scale", None)
        self.rows.append({
            "loss_scale": None if scale is None else float(scale.numpy()),
            "iterations": _read(outer.iterations), "updates": _read(innermost.iterations),
            **{name: _read(getattr(accumulating, name, None))
               for name in ("micro_steps", "total_micro_steps", "skipped_updates")},
            "weights_finite": all(bool(np.all(np.isfinite(w)))
                                  for w in self.model.get_weights())})


def fit(strategy, make_model, make_optimizer, x, y, batch_size: int, epochs: int = 1):
    """Build and compile `make_model()` with `make_optimizer()` (loss "mse") under
    `strategy`'s scope and `model.fit` it, batches in order; returns `(model, rows)`,
    the `Counters` rows. The optimizer is created after the model, under the scope."""
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=make_optimizer(), loss="mse")
    counters = Counters()
    model.fit(np.asarray(x, np.float32), np.asarray(y, np.float32), batch_size=batch_size,
              epochs=epochs, shuffle=False, verbose=0, callbacks=[counters])
    return model, counters.rows


def big_batch_fit(make_model, make_optimizer, x, y, batch_size: int, epochs: int = 1):
    """The reference: `fit` on one device, without a strategy (see `fit`)."""
    return fit(tf.distribute.get_strategy(), make_model, make_optimizer, x, y, batch_size,
               epochs)
