"""Pitfall: `for g, _g in zip(grads, new_grads): g += _g` accumulates nothing.

Question 004 accumulates micro-batch gradients inside a `tf.while_loop` body with

    for g, _g in zip(grad, _grad):
        g += _g
    return [i + step, grad]

and the returned `grad` is the list it started with. This is Python, not TensorFlow:
`tf.Tensor` has no `__iadd__`, so `g += _g` means `g = g + _g`, which binds the *loop
variable name* `g` to a new tensor and leaves the list untouched. (A NumPy array does
have an in-place `__iadd__`, which is why the line looks right to NumPy users.) In a
`tf.while_loop` only what the body *returns* becomes the next iteration's value, so the
sum has to be built as new tensors and returned: `grad = [g + _g for ...]`. A
`tf.Variable` is the other way out: `assign_add` changes state, and
`tf.Variable.__iadd__` refuses `+=` with a RuntimeError instead of rebinding; a Keras 3
`keras.Variable` has no `__iadd__` at all and is silently rebound to a tensor.

`reproduce()` shows it with numbers, `reproduce_in_fit()` shows what it does to
training (each step applies the first micro-batch's gradient only), and
`audit_seed_solution()` checks the question's posted "final solution" against the
installed TensorFlow / Keras 3.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import keras
import numpy as np
import tensorflow as tf

from distgrad.lab.compare import WeightDiff, update_ratio, updates, weight_diff, weights_of
from distgrad.lab.data import regression_data, tiny_model
from distgrad.lab.recipes import big_batch_reference
from distgrad.pitfalls import CapturedError

# --- numbers --------------------------------------------------------------------------


def _initial():
    return [tf.constant([1.0, 2.0]), tf.constant(10.0)]


def _increment(i):
    """Iteration i (0-based) adds [i+1, i+1] and 10 * (i+1)."""
    scale = tf.cast(i + 1, tf.float32)
    return [scale * tf.ones([2]), 10.0 * scale]


def _to_lists(tensors):
    return [np.asarray(t).tolist() for t in tensors]


@dataclasses.dataclass(frozen=True)
class CompoundAssignmentRecord:
    """Each field: the accumulator's value after `iterations` iterations (as lists).

    `expected` is initial + sum of increments. `compound_in_while_loop` is the
    question's body (`g += _g`, return the list); `returned_in_while_loop` returns
    `[g + _g ...]`; `variable_assign_add` accumulates into `tf.Variable`s with
    `assign_add` inside the body; `eager_python_loop` is the question's body run
    eagerly in a plain Python loop; `numpy_in_place` the same with NumPy arrays.
    """

    iterations: int
    initial: list
    expected: list
    compound_in_while_loop: list
    returned_in_while_loop: list
    variable_assign_add: list
    eager_python_loop: list
    numpy_in_place: list
    tensor_has_iadd: bool
    ndarray_has_iadd: bool
    tf_variable_iadd_error: CapturedError
    keras_variable_rebound_to: str
    keras_variable_value_after: float


def reproduce(iterations: int = 3) -> CompoundAssignmentRecord:
    """Run the four accumulation patterns for `iterations` iterations and record them."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}.")

    def compound_body(i, grad):
        _grad = _increment(i)
        for g, _g in zip(grad, _grad):
            g += _g  # rebinds the name `g`; `grad` still holds the old tensors
        return i + 1, grad

    def returned_body(i, grad):
        _grad = _increment(i)
        grad = [g + _g for g, _g in zip(grad, _grad)]
        return i + 1, grad

    def run(body):
        @tf.function
        def loop():
            _, grad = tf.while_loop(lambda i, _: i < iterations, body,
                                    [tf.constant(0), _initial()], parallel_iterations=1)
            return grad
        return _to_lists(loop())

    accumulators = [tf.Variable(t) for t in _initial()]

    @tf.function
    def variable_loop():
        def body(i):
            for acc, _g in zip(accumulators, _increment(i)):
                acc.assign_add(_g)  # a state change: survives the iteration
            return (i + 1,)
        tf.while_loop(lambda i: i < iterations, body, [tf.constant(0)])

    variable_loop()

    eager = _initial()
    for i in range(iterations):
        for g, _g in zip(eager, _increment(i)):
            g += _g

    arrays = [np.asarray(t).copy() for t in _initial()]
    for i in range(iterations):
        for g, _g in zip(arrays, _increment(i)):
            g += np.asarray(_g)  # ndarray.__iadd__: in place

    try:
        variable = tf.Variable(1.0)
        variable += 1.0
        iadd_error = None
    except RuntimeError as err:
        iadd_error = CapturedError.of(err)
    keras_variable = keras.Variable(1.0)
    rebound = keras_variable
    rebound += 1.0

    expected = _initial()
    for i in range(iterations):
        expected = [g + _g for g, _g in zip(expected, _increment(i))]
    return CompoundAssignmentRecord(
        iterations=iterations,
        initial=_to_lists(_initial()),
        expected=_to_lists(expected),
        compound_in_while_loop=run(compound_body),
        returned_in_while_loop=run(returned_body),
        variable_assign_add=_to_lists([v.numpy() for v in accumulators]),
        eager_python_loop=_to_lists(eager),
        numpy_in_place=[a.tolist() for a in arrays],
        tensor_has_iadd=hasattr(tf.Tensor, "__iadd__"),
        ndarray_has_iadd=hasattr(np.ndarray, "__iadd__"),
        tf_variable_iadd_error=iadd_error,
        keras_variable_rebound_to=type(rebound).__name__,
        keras_variable_value_after=float(keras_variable.numpy()),
    )


# --- what it does to training -----------------------------------------------------------


class QuestionGradAccumModel(keras.Model):
    """The question's first `GradAccumModel.train_step`, in Keras 3 spelling.

    Unchanged logic: the first micro-batch outside the loop, the rest in a
    `tf.while_loop` whose body does `g += _g` (or, with `returned=True`, the accepted
    fix `grad = [g + _g ...]`), no division by the number of micro-batches. Only the
    removed `compiled_loss` is spelled `compute_loss`. Set `micro_batch_size` before
    `fit`.
    """

    micro_batch_size = None
    returned = False

    def train_step(self, data):
        x, y = data
        step = self.micro_batch_size
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x[:step], y=y[:step], y_pred=self(x[:step], training=True))
        gradients = tape.gradient(loss, self.trainable_variables)

        def body(i, grad):
            with tf.GradientTape() as tape:
                y_pred = self(x[i:i + step], training=True)
                loss = self.compute_loss(x=x[i:i + step], y=y[i:i + step], y_pred=y_pred)
            _grad = tape.gradient(loss, self.trainable_variables)
            if self.returned:
                grad = [g + _g for g, _g in zip(grad, _grad)]
            else:
                for g, _g in zip(grad, _grad):
                    g += _g
            return [i + step, grad]

        _, gradients = tf.while_loop(lambda i, *_: i < tf.shape(x)[0], body,
                                     [tf.constant(step), gradients], parallel_iterations=1)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return self.get_metrics_result()  # Keras 3 needs a non-empty logs dict


@dataclasses.dataclass(frozen=True)
class InFitRecord:
    """One SGD step of the question's model on one batch of `examples`.

    `vs_first_micro_batch` / `vs_full_batch`: weight differences of the `g += _g` model
    to one step on the first micro-batch alone / on the whole batch.
    `returned_ratio`: update of the `[g + _g ...]` fix / full-batch update (k: the
    sum of k micro-batch means, the division the question commented out).
    """

    micro_batches: int
    vs_first_micro_batch: WeightDiff
    vs_full_batch: WeightDiff
    returned_ratio: float


def reproduce_in_fit(micro_batches: int = 4, examples: int = 16,
                     learning_rate: float = 0.1) -> InFitRecord:
    """Fit the question's model for one step with and without the accepted fix."""
    if examples % micro_batches:
        raise ValueError(f"examples={examples} must be divisible by micro_batches={micro_batches}.")
    x, y = regression_data(examples)
    step = examples // micro_batches
    def sgd():
        return keras.optimizers.SGD(learning_rate)

    def fit(returned):
        base = tiny_model()
        model = QuestionGradAccumModel(base.inputs, base.outputs)
        model.micro_batch_size, model.returned = step, returned
        model.compile(optimizer=sgd(), loss="mse")
        model.fit(x, y, batch_size=examples, epochs=1, shuffle=False, verbose=0)
        return weights_of(model)

    initial = weights_of(tiny_model())
    full = big_batch_reference(sgd, x, y)
    first = big_batch_reference(sgd, x[:step], y[:step])
    compound = fit(returned=False)
    return InFitRecord(
        micro_batches=micro_batches,
        vs_first_micro_batch=weight_diff(compound, first),
        vs_full_batch=weight_diff(compound, full),
        returned_ratio=update_ratio(updates(fit(returned=True), initial), updates(full, initial)),
    )


# --- the question's posted "final solution", against Keras 3 ------------------------------


class SeedFinalSolutionModel(keras.Model):
    """The question's final `Model` subclass, ported only where Keras 3 forces it.

    Kept as posted: the `fit` wrapper (including the missing `return` in the
    `grad_accum_steps == 1` branch), the replica count read with
    `tf.distribute.get_strategy()` inside `fit`, the loop bound `i < batch_size`
    (global), the 1/k scaling, `compiled_loss` / `compiled_metrics`. Ported: the
    removed private imports (`lso` -> `keras.optimizers.LossScaleOptimizer`,
    `ds_context` -> `tf.distribute`, `nest` -> `tf.nest`), `get_scaled_loss` ->
    `scale_loss`, `super(self).fit` -> `super().fit` (a TypeError otherwise),
    `_HAS_AGGREGATE_GRAD` (gone) -> False.
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
        x_, y_, w_ = (slice_map(s, 0, step) for s in (x, y, sample_weight))
        with tf.GradientTape() as tape:
            y_pred = self(x_, training=True)
            loss = self.compiled_loss(y_, y_pred, sample_weight=w_,
                                      regularization_losses=self.losses)
            if isinstance(self.optimizer, lso):
                loss = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(loss, self.trainable_variables)
        gradients = [g * (1.0 / self._grad_accum_) for g in gradients]
        self.compiled_metrics.update_state(y_, y_pred)

        def body(i, grad):
            x_, y_, w_ = (slice_map(s, i, i + step) for s in (x, y, sample_weight))
            with tf.GradientTape() as tape:
                y_pred = self(x_, training=True)
                loss = self.compiled_loss(y_, y_pred, sample_weight=w_,
                                          regularization_losses=self.losses)
                if isinstance(self.optimizer, lso):
                    loss = self.optimizer.scale_loss(loss)
            _grad = tape.gradient(loss, self.trainable_variables)
            _grad = [g * (1.0 / self._grad_accum_) for g in _grad]
            grad = [g + _g for g, _g in zip(grad, _grad)]
            self.compiled_metrics.update_state(y_, y_pred)
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
class SeedAudit:
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


def _seed_model(strategy):
    with strategy.scope():
        base = tiny_model()
        model = SeedFinalSolutionModel(base.inputs, base.outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def audit_seed_solution(strategy, examples: int = 16, micro_batches: int | None = None
                        ) -> SeedAudit:
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
        k1 = _seed_model(one)
        k1.fit(x, y, batch_size=examples, epochs=1, shuffle=False, verbose=0)
        iterations = int(k1.optimizer.iterations.numpy())

        reporting = _seed_model(one)
        predictions = reporting.predict(x, batch_size=examples, verbose=0)
        history = reporting.fit(x, y, batch_size=examples, grad_accum_steps=micro_batches,
                                shuffle=False, verbose=0)

        distributed = _seed_model(strategy)
        initial = weights_of(distributed)
        seen = {}

        def record_replicas(batch, logs=None):
            seen.setdefault("n", distributed._num_workers_)

        distributed.fit(x, y, batch_size=examples, grad_accum_steps=micro_batches,
                        shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=record_replicas)])
    reference = big_batch_reference(lambda: keras.optimizers.SGD(0.1), x, y)
    return SeedAudit(
        super_self_error=super_error,
        import_errors=import_errors,
        attributes_present=present,
        legacy_isinstance=isinstance(owners["loss_scale_optimizer"], legacy_lso.LossScaleOptimizer),
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
