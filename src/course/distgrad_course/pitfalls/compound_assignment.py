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
training (each step applies the first micro-batch's gradient only);
`distgrad_course.pitfalls.final_solution` audits the question's posted "final solution".
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from distgrad_course.lab.args import positive_int
from distgrad_course.lab.compare import WeightDiff, update_ratio, updates, weight_diff, weights_of
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.recipes import big_batch_reference
from distgrad_course.pitfalls import CapturedError

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


def compound_body(i, grad):
    """The question's `tf.while_loop` body: `g += _g`, then return the list."""
    _grad = _increment(i)
    for g, _g in zip(grad, _grad):
        g += _g  # rebinds the name `g`; `grad` still holds the old tensors
    return i + 1, grad


def returned_body(i, grad):
    """The accepted answer's body: build new tensors and return them."""
    _grad = _increment(i)
    grad = [g + _g for g, _g in zip(grad, _grad)]
    return i + 1, grad


def run_while_loop(body, iterations: int) -> list:
    """`body` as a `tf.while_loop` body for `iterations` iterations, from `[[1, 2], 10]`."""
    @tf.function
    def loop():
        _, grad = tf.while_loop(lambda i, _: i < iterations, body,
                                [tf.constant(0), _initial()], parallel_iterations=1)
        return grad
    return _to_lists(loop())


def reproduce(iterations: int = 3) -> CompoundAssignmentRecord:
    """Run the four accumulation patterns for `iterations` iterations and record them."""
    positive_int("iterations", iterations)

    def run(body):
        return run_while_loop(body, iterations)

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
