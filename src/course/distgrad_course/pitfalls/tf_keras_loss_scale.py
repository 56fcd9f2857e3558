"""Lesson 04 under tf-keras (Keras 2): the question's own train_step and patch.

tf-keras only: this module is imported in a
`distgrad_course.lab.tf_keras_runner.run_tf_keras` child, where `TF_USE_LEGACY_KERAS=1`
makes `tf.keras` the tf-keras package;
`distgrad_course.pitfalls.loss_scale_patch.tf_keras_reproduction` runs `run_scenarios` there.
`GradientAccumulationPatch` is the question's patch (tensorflow/tensorflow#50454,
`question_mask_patch.QuestionMaskPatch`, the class Keras 3 runs too) under tf-keras, as
the user ran it. `QuestionModel.train_step` is the question's (`get_scaled_loss` /
`get_unscaled_gradients` by hand), with the era's `OptimizerV2` or tf-keras' newer
optimizer inside `tf.keras.mixed_precision.LossScaleOptimizer`.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

# tf-keras, or TensorFlow <= 2.15's own Keras 2 (a run_tf_keras child without the switch).
if not tf.keras.Model.__module__.startswith(("tf_keras.", "keras.src.engine.")):
    raise ImportError("distgrad_course.pitfalls.tf_keras_loss_scale is tf-keras code: run it "
                      "through distgrad_course.lab.tf_keras_runner.run_tf_keras "
                      "(TF_USE_LEGACY_KERAS=1).")

from distgrad_course.lab.tf_keras_runner import tf_keras_strategy
from distgrad_course.pitfalls.question_mask_patch import QuestionMaskPatch

keras = tf.keras  # tf-keras here (checked by tf_keras_strategy)


class GradientAccumulationPatch(QuestionMaskPatch):
    """The question's patch (`QuestionMaskPatch`, with its call counter) under tf-keras,
    plus two additions: `traces` records what each traced call received (context,
    extra args, kwarg names), and `return_result=True` returns what the original
    returned (the question returns None)."""

    def __init__(self, n, orig_apply_gradients, trainable_variables):
        super().__init__(n, self._call_original, trainable_variables)
        self._original, self._result = orig_apply_gradients, None
        self.traces = []
        self.return_result = False

    def _call_original(self, *args, **kwargs):
        self._result = self._original(*args, **kwargs)
        return self._result

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        self.traces.append({
            "context": "cross-replica" if tf.distribute.in_cross_replica_context() else "replica",
            "args": [repr(a) for a in args], "kwargs": sorted(kwargs)})
        super().apply_gradients(grads_and_vars, *args, **kwargs)
        if self.return_result:
            return self._result


class QuestionModel(keras.Model):
    """The question's train_step: get_scaled_loss / get_unscaled_gradients by hand."""

    def __init__(self):
        super().__init__()
        init = keras.initializers.GlorotUniform
        self.hidden = keras.layers.Dense(8, activation="tanh", kernel_initializer=init(seed=0))
        self.out = keras.layers.Dense(1, kernel_initializer=init(seed=1))
        self.to_float32 = keras.layers.Activation("linear", dtype="float32")

    def call(self, x):
        return self.to_float32(self.out(self.hidden(x)))

    def train_step(self, data):
        x, y_true = data
        with tf.GradientTape() as tape:
            model_loss = self.compiled_loss(y_true, self(x, training=True))
            is_mixed_precision = isinstance(
                self.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
            if is_mixed_precision:
                loss = self.optimizer.get_scaled_loss(model_loss)
            else:
                loss = model_loss
        gradients = tape.gradient(loss, self.trainable_variables)
        if is_mixed_precision:
            gradients = self.optimizer.get_unscaled_gradients(gradients)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {"loss": model_loss}


def _weights(model):
    return [w.numpy() for w in model.weights]


class _Trajectory(keras.callbacks.Callback):
    def __init__(self, optimizer):
        super().__init__()
        self.optimizer_ = optimizer
        self.scales, self.iterations, self.changes = [], [], []

    def on_train_begin(self, logs=None):
        self.previous = _weights(self.model)

    def on_train_batch_end(self, batch, logs=None):
        now = _weights(self.model)
        self.changes.append(max(float(np.max(np.abs(a - b))) for a, b in zip(now, self.previous)))
        self.previous = now
        self.scales.append(float(self.optimizer_.loss_scale.numpy()))
        self.iterations.append(int(self.optimizer_.iterations.numpy()))


def _one_scenario(strategy, x_all, scenario, n, initial_scale) -> dict:
    y_all = np.array(scenario["y"], np.float32)
    with strategy.scope():
        model = QuestionModel()
        model.build((None, x_all.shape[1]))
        if scenario["generation"] == "legacy":
            inner = keras.optimizers.legacy.SGD(scenario["learning_rate"])
        else:
            inner = keras.optimizers.SGD(scenario["learning_rate"])
        optimizer = keras.mixed_precision.LossScaleOptimizer(inner, initial_scale=initial_scale)
        patch = None
        if scenario["target"] == "loss_scale_optimizer":
            patch = GradientAccumulationPatch(n, optimizer.apply_gradients,
                                              model.trainable_variables)
            optimizer.apply_gradients = patch.apply_gradients
        elif scenario["target"] == "inner_optimizer":
            patch = GradientAccumulationPatch(n, optimizer.inner_optimizer.apply_gradients,
                                              model.trainable_variables)
            optimizer.inner_optimizer.apply_gradients = patch.apply_gradients
        if patch is not None:
            patch.return_result = scenario["patch_returns_result"]
        model.compile(optimizer=optimizer, loss="mse")
    initial = _weights(model)
    trajectory = _Trajectory(optimizer)
    error = None
    try:
        model.fit(x_all[:len(y_all)], y_all, batch_size=scenario["batch_size"], epochs=1,
                  shuffle=False, verbose=0, callbacks=[trajectory])
    except Exception as exc:  # the pitfall may be an exception: report it
        error = {"type": type(exc).__name__, "message": str(exc)}
    final = _weights(model)
    inner_class = type(optimizer.inner_optimizer)
    return {
        "name": scenario["name"], "error": error, "lso_class": type(optimizer).__name__,
        "inner_class": f"{inner_class.__module__}.{inner_class.__name__}",
        "patch_calls": None if patch is None else int(patch.calls.numpy()),
        "accumulators_finite": None if patch is None else bool(all(
            np.all(np.isfinite(c.numpy())) for v in patch.accu_gradients
            for c in strategy.experimental_local_results(v))),
        "loss_scales": trajectory.scales, "iterations": trajectory.iterations,
        "weight_changes": trajectory.changes,
        "weights_finite": bool(all(np.all(np.isfinite(w)) for w in final)),
        "initial_weights": initial, "final_weights": final,
        "patch_traces": [] if patch is None else patch.traces}


def run_scenarios(replicas: int, x, scenarios, accumulation_steps: int,
                  initial_scale: float) -> list[dict]:
    """Fit a fresh `QuestionModel` under `mixed_float16` per scenario; one dict each.

    A scenario is a dict: `name`, `generation` ("legacy": `OptimizerV2` SGD; "v3":
    tf-keras' newer SGD), `target` ("loss_scale_optimizer", "inner_optimizer" or
    "none"), `y`, `batch_size`, `learning_rate`, `patch_returns_result`. `x` is shared.
    """
    strategy = tf_keras_strategy(replicas)
    x_all = np.array(x, np.float32)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return [_one_scenario(strategy, x_all, s, accumulation_steps, initial_scale)
                for s in scenarios]
    finally:
        keras.mixed_precision.set_global_policy("float32")
