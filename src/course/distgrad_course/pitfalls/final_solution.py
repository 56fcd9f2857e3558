"""Pitfall: question 004's posted "final solution", on the installed TensorFlow / Keras 3.

Its `while_loop` body builds the sum correctly (`grad = [g + _g ...]`), but the code
stands on private Keras 2 imports and attributes that Keras 3 removed, calls
`super(self).fit`, and checks `isinstance(self.optimizer, <Keras 2 LossScaleOptimizer>)`.
`QuestionFinalSolutionModel` is the posted class ported only where Keras 3 forces it;
`audit_final_solution` runs each problem and trains it against big-batch training.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import keras
import numpy as np
import tensorflow as tf

from distgrad_course.lab.compare import update_ratio, updates, weights_of
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.recipes import big_batch_reference
from distgrad_course.pitfalls import CapturedError


class QuestionFinalSolutionModel(keras.Model):
    """The question's final `Model` subclass, ported only where Keras 3 forces it.

    Kept as posted: the `fit` wrapper (including the missing `return` in the
    `grad_accum_steps == 1` branch), the replica count read with
    `tf.distribute.get_strategy()` inside `fit`, the loop bound `i < batch_size`
    (global), the 1/k scaling, `compiled_loss` / `compiled_metrics`. Ported: the
    removed private imports (`lso` -> `keras.optimizers.LossScaleOptimizer`,
    `ds_context` -> `tf.distribute`, `nest` -> `tf.nest`), `get_scaled_loss` ->
    `scale_loss`, `super(self).fit` -> `super().fit` (a TypeError otherwise),
    `_HAS_AGGREGATE_GRAD` (gone) -> False. The posted code writes one micro-batch's
    forward pass, loss, gradients and metrics twice, before the loop and in its body;
    here they are written once (`micro_batch_gradients`), op for op the same.
    """

    def fit(self, *args, batch_size: int = 32, grad_accum_steps: int = 1, **kwargs):
        if grad_accum_steps == 1:
            super().fit(*args, batch_size=batch_size, **kwargs)  # posted: no `return`
        self.train_function = None
        num_workers = tf.distribute.get_strategy().num_replicas_in_sync
        if batch_size % (grad_accum_steps * num_workers) != 0:
            raise ValueError("Batch size must be divisible by grad_accum_steps and replicas.")
        self._grad_accum_ = grad_accum_steps
        self._batch_size_ = batch_size
        self._num_workers_ = num_workers
        train_step_backup = self.train_step
        self.train_step = self._train_step_
        out = super().fit(*args, batch_size=self._batch_size_, **kwargs)
        del self._grad_accum_, self._batch_size_, self._num_workers_
        self.train_step = train_step_backup
        return out

    def _train_step_(self, data):
        x, y = data[:2]
        sample_weight = data[2] if len(data) == 3 else None

        def slice_map(struct, start, stop):
            if struct is None:
                return None
            return tf.nest.map_structure(lambda t: t[start:stop], struct)

        lso = keras.optimizers.LossScaleOptimizer
        step = self._batch_size_ // self._num_workers_ // self._grad_accum_

        def micro_batch_gradients(start):  # posted twice: before the loop and in its body
            x_, y_, w_ = (slice_map(s, start, start + step) for s in (x, y, sample_weight))
            with tf.GradientTape() as tape:
                y_pred = self(x_, training=True)
                loss = self.compiled_loss(y_, y_pred, sample_weight=w_,
                                          regularization_losses=self.losses)
                if isinstance(self.optimizer, lso):
                    loss = self.optimizer.scale_loss(loss)
            gradients = tape.gradient(loss, self.trainable_variables)
            gradients = [g * (1.0 / self._grad_accum_) for g in gradients]
            self.compiled_metrics.update_state(y_, y_pred)
            return gradients

        gradients = micro_batch_gradients(0)

        def body(i, grad):
            _grad = micro_batch_gradients(i)
            grad = [g + _g for g, _g in zip(grad, _grad)]
            return [i + step, grad]

        _, gradients = tf.while_loop(lambda i, *_: i < self._batch_size_, body,
                                     [tf.constant(step), gradients], parallel_iterations=1)
        gradients = self.optimizer._clip_gradients(gradients)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {m.name: m.result() for m in self.metrics}


_REMOVED_IMPORTS = (
    "tensorflow.python.keras.mixed_precision.experimental.loss_scale_optimizer",
    "tensorflow.python.distribute.distribution_strategy_context",
)
_REMOVED_ATTRIBUTES = (
    ("optimizer", "_HAS_AGGREGATE_GRAD"),
    ("optimizer", "_aggregate_gradients"),
    ("loss_scale_optimizer", "get_scaled_loss"),
    ("loss_scale_optimizer", "get_unscaled_gradients"),
)


@dataclasses.dataclass(frozen=True)
class FinalSolutionAudit:
    """What the question's final solution meets on the installed TF / Keras 3.

    * `super_self_error`: `super(self).fit` (TypeError).
    * `import_errors`: module -> error, for the private imports it starts with.
    * `attributes_present`: "owner.name" -> whether a Keras 3 optimizer still has it.
    * `legacy_isinstance`: whether a Keras 3 `LossScaleOptimizer` is an instance of the
      `LossScaleOptimizer` in `tensorflow.python.keras` (TF's frozen Keras 2 copy, which
      still imports): False, so the posted `isinstance` check skips loss scaling.
    * `aggregate_flag_error`: `apply_gradients(..., experimental_aggregate_gradients=False)`.
    * `apply_clips_itself`: Keras 3 `apply_gradients` already calls `_clip_gradients`
      (`BaseOptimizer._backend_apply_gradients`), so the manual call is redundant (and
      private).
    * `iterations_with_k1`: optimizer steps after `fit(..., grad_accum_steps=1)` on one
      batch for one epoch (2: the missing `return` fits twice).
    * `reported_loss`, `mean_prediction`, `true_loss`: the "loss" in its history vs the
      mean of the model's predictions and the real loss (Keras 3's deprecated
      `compiled_metrics.update_state` feeds `y_pred` to every `Mean` metric, the
      loss tracker included).
    * `replicas_seen_in_fit` / `replicas_of_model` and `two_replica_update_ratio`: the
      replica count its `fit` reads outside `strategy.scope()` (1), the model's R, and
      the resulting update / correct update with SGD. The loop runs over the global
      batch G with slices of G/k rows while each replica holds G/R rows, each slice
      weighted 1/k: the extra slices are empty, and the ratio is 1/max(k, R).
    """

    super_self_error: CapturedError
    import_errors: dict
    attributes_present: dict
    legacy_isinstance: bool
    aggregate_flag_error: CapturedError
    apply_clips_itself: bool
    iterations_with_k1: int
    reported_loss: float
    mean_prediction: float
    true_loss: float
    replicas_seen_in_fit: int
    replicas_of_model: int
    two_replica_update_ratio: float


def _final_solution_model(strategy):
    with strategy.scope():
        base = tiny_model()
        model = QuestionFinalSolutionModel(base.inputs, base.outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def audit_final_solution(strategy, examples: int = 16, micro_batches: int | None = None
                        ) -> FinalSolutionAudit:
    """Run each of the final solution's problems on `strategy` (a 2+ replica Mirrored).

    `micro_batches` defaults to the replica count R (then the update ratio is 1/R).
    """
    import warnings

    from tensorflow.python.keras.mixed_precision import loss_scale_optimizer as legacy_lso

    if micro_batches is None:
        micro_batches = strategy.num_replicas_in_sync

    x, y = regression_data(examples)
    model = tiny_model()
    try:
        super(model).fit  # noqa: B018 -- the posted expression
        super_error = None
    except TypeError as err:
        super_error = CapturedError.of(err)
    import_errors = {}
    for module in _REMOVED_IMPORTS:
        try:
            importlib.import_module(module)
        except ImportError as err:
            import_errors[module] = CapturedError.of(err)
    owners = {"optimizer": keras.optimizers.SGD(0.1),
              "loss_scale_optimizer": keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())}
    present = {f"{o}.{a}": hasattr(owners[o], a) for o, a in _REMOVED_ATTRIBUTES}
    variable = tf.Variable(1.0)
    try:
        owners["optimizer"].apply_gradients([(tf.constant(0.0), variable)],
                                            experimental_aggregate_gradients=False)
        flag_error = None
    except TypeError as err:
        flag_error = CapturedError.of(err)
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    apply_clips = "_clip_gradients" in inspect.getsource(BaseOptimizer._backend_apply_gradients)

    one = tf.distribute.get_strategy()  # the default strategy: one replica
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compiled_loss / compiled_metrics deprecation
        k1 = _final_solution_model(one)
        k1.fit(x, y, batch_size=examples, epochs=1, shuffle=False, verbose=0)
        iterations = int(k1.optimizer.iterations.numpy())

        reporting = _final_solution_model(one)
        predictions = reporting.predict(x, batch_size=examples, verbose=0)
        history = reporting.fit(x, y, batch_size=examples, grad_accum_steps=micro_batches,
                                shuffle=False, verbose=0)

        distributed = _final_solution_model(strategy)
        initial = weights_of(distributed)
        seen = {}

        def record_replicas(batch, logs=None):
            seen.setdefault("n", distributed._num_workers_)

        record = keras.callbacks.LambdaCallback(on_train_batch_end=record_replicas)
        distributed.fit(x, y, batch_size=examples, grad_accum_steps=micro_batches,
                        shuffle=False, verbose=0, callbacks=[record])
    reference = big_batch_reference(lambda: keras.optimizers.SGD(0.1), x, y)
    return FinalSolutionAudit(
        super_self_error=super_error,
        import_errors=import_errors,
        attributes_present=present,
        legacy_isinstance=isinstance(
            owners["loss_scale_optimizer"], legacy_lso.LossScaleOptimizer
        ),
        aggregate_flag_error=flag_error,
        apply_clips_itself=apply_clips,
        iterations_with_k1=iterations,
        reported_loss=float(history.history["loss"][0]),
        mean_prediction=float(np.mean(predictions)),
        true_loss=float(np.mean((predictions - y) ** 2)),
        replicas_seen_in_fit=seen["n"],
        replicas_of_model=distributed.distribute_strategy.num_replicas_in_sync,
        two_replica_update_ratio=update_ratio(updates(weights_of(distributed), initial),
                                              updates(reference, initial)),
    )
