"""Which batches a `fit` resumed by `BackupAndRestore(save_freq=N)` trains, in either Keras.

`trained_batches(replicas, ...)` runs one tiny `fit` three times under a `MirroredStrategy`
of `replicas` replicas: uninterrupted; interrupted (an exception raised from
`on_train_batch_end` after `cut` batches, counted across epochs) with `BackupAndRestore`
in a temporary directory; and again with a fresh model and the same callback, as a
restarted job would. Batch k of an epoch holds x = k + 1 (one example per replica), the
model is a zero-initialized `Dense(1, use_bias=False)` with "mae" loss against targets far
above it and SGD(1.0): every step adds its batch's x to w, so the increase of w in a step
names the batch it trained (`Recorder`).

Either Keras: in a `distgrad_course.lab.tf_keras_runner.run_tf_keras` child
(`TF_USE_LEGACY_KERAS=1`) it uses tf-keras and `tf_keras_strategy`; in any other process Keras 3 and
`distgrad_course.make_strategy` (call it before other TensorFlow work there, as make_strategy
says). Measured (TF 2.21, 2 replicas, the defaults): tf-keras resumes at step 6 of
epoch 0 but trains batches 0, 1 there (16 updates, w 60 instead of 72); Keras 3 replays
the whole interrupted epoch (22 updates, w 93).
"""

from __future__ import annotations

import gc
import os
import tempfile

import numpy as np

DATA = ("arrays", "dataset")
TARGET = 1e6  # every prediction w * x stays below it: each step's gradient is -mean(x)


class Crash(Exception):
    """Raised from `on_train_batch_end`: stands for the job being stopped."""


def _keras_and_strategy(replicas: int):
    """(keras module, its name and version, strategy) for this process."""
    if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
        from distgrad_course.lab.tf_keras_runner import tf_keras_strategy

        strategy = tf_keras_strategy(replicas)  # before other TensorFlow work
        import tf_keras as keras

        return keras, f"tf_keras {keras.__version__}", strategy
    from distgrad_course import make_strategy

    strategy = make_strategy(replicas)
    import keras

    return keras, f"keras {keras.__version__}", strategy


def trained_batches(replicas: int = 2, save_freq: int = 3, cut: int = 6, epochs: int = 2,
                    batches: int = 8, data: str = "arrays") -> dict:
    """The batches each of three `fit` runs trained, its updates and final w (see module).

    `data` is "arrays" (numpy arrays, `batch_size`) or "dataset" (a batched `tf.data`
    pipeline), in a fixed order (`shuffle=False`). A step's id is the x of its batch minus 1.

    Returns `{"keras": "tf_keras 2.21.0" | "keras 3.15.1", "uninterrupted": run,
    "first": run, "resumed": run}`, each run `{"batches": [id per step], "reported":
    [[epoch, batch] per step, as fit's callbacks were told], "updates":
    optimizer.iterations, "w": final w}`; "first" stops after `cut` steps.
    """
    if data not in DATA:
        raise ValueError(f"data must be one of {DATA}, got {data!r}.")
    keras, name, strategy = _keras_and_strategy(replicas)
    import tensorflow as tf

    global_batch = replicas  # one example per replica
    x = np.repeat(np.arange(1, batches + 1, dtype="float32"), global_batch)[:, None]
    y = np.full_like(x, TARGET)

    class Recorder(keras.callbacks.Callback):
        """Per step: the batch trained (increase of w, minus 1) and fit's epoch, batch."""

        def __init__(self):
            super().__init__()
            self.batches, self.reported, self.epoch, self.before = [], [], None, None

        def _w(self):
            return float(np.asarray(self.model.get_weights()[0]).reshape(-1)[0])

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            self.before = self._w()

        def on_train_batch_end(self, batch, logs=None):
            self.batches.append(round(self._w() - self.before - 1))
            self.reported.append([self.epoch, int(batch)])

    class CrashAfter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == cut:
                raise Crash(f"stopped after {cut} batches")

    def run(callbacks):
        with strategy.scope():
            dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
            model = keras.Sequential([keras.Input((1,)), dense])
            model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mae")
        if data == "arrays":
            inputs = {"x": x, "y": y, "batch_size": global_batch, "shuffle": False}
        else:
            pipeline = tf.data.Dataset.from_tensor_slices((x, y))
            # shuffle=False: Keras 3 warns that fit's default shuffle=True is ignored
            inputs = {"x": pipeline.batch(global_batch), "shuffle": False}
        recorder = Recorder()
        try:
            model.fit(**inputs, epochs=epochs, verbose=0, callbacks=[recorder, *callbacks])
        except Crash:
            pass
        gc.collect()  # free the stopped fit's iterator now (tests/conftest.py says why)
        return {"batches": recorder.batches, "reported": recorder.reported,
                "updates": int(np.asarray(model.optimizer.iterations)),
                "w": float(np.asarray(dense.get_weights()[0]).reshape(-1)[0])}

    result = {"keras": name, "uninterrupted": run([])}
    with tempfile.TemporaryDirectory() as backup_dir:
        result["first"] = run([keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq),
                               CrashAfter()])
        result["resumed"] = run([keras.callbacks.BackupAndRestore(backup_dir,
                                                                  save_freq=save_freq)])
    return result
