"""Pitfall: "accumulate" by always applying `accumulated * mask` (mask 0 or 1).

The question's second attempt (../shared/questions/003, "the more complicated path")
removes the `tf.cond` of `cond_merge_call`: every call adds the gradients into an
accumulator and calls the original `apply_gradients` with `accumulated * apply`
(apply = 1 on every n-th call, else 0), then resets with `accumulated * keep`. It
runs under MirroredStrategy, because the sync points are no longer inside control
flow. But it is not accumulation:

* the optimizer still makes an update on *every* micro-step, with a zero gradient
  on k-1 of every k. For plain SGD a zero gradient is a no-op, so SGD matches big
  batch training. Momentum keeps moving the weights (`velocity = momentum *
  velocity`), Adam decays both moments (`m *= beta_1`, `v *= beta_2`) and still
  steps along `m / sqrt(v)`, decoupled weight decay (`AdamW`, `SGD(weight_decay=)`)
  shrinks the weights every micro-step;
* `optimizer.iterations` counts micro-steps, so Adam's bias correction and every
  learning-rate schedule run k times too fast;
* the all-reduce inside `apply_gradients` runs every micro-step: k all-reduces per
  update instead of 1.

The patch itself is `QuestionMaskPatch` (`distgrad_course.pitfalls.question_mask_patch`: the
question's code, plus a call counter; lesson 04 runs it under mixed precision).
`patch_with_mask` feeds it gradients divided by k so that, where it works, it averages
the micro-batches like one big batch.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.args import positive_int
from distgrad_course.lab.compare import OPTIMIZERS, WeightDiff, weight_diff, weights_of
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.graph import AllReducePlacement, fit_step_placement
from distgrad_course.lab.recipes import fit_run
from distgrad_course.pitfalls.question_mask_patch import QuestionMaskPatch

# -- the mask trick -------------------------------------------------------------------


def check_steps(n) -> int:
    """`n` if it is an integer >= 1 (a bool is not); ValueError otherwise."""
    positive_int("n", n)
    return n


def patch_with_mask(optimizer, steps: int, trainable_variables) -> QuestionMaskPatch:
    """Replace `optimizer.apply_gradients` by the mask patch; returns the patch.

    Gradients are divided by `steps` before they reach the question's patch, so an
    applied accumulation is the mean over the micro-batches. Call under the strategy
    scope, after the model is built (the question did the same). ValueError unless
    `steps` is an integer >= 1.
    """
    patch = QuestionMaskPatch(check_steps(steps), optimizer.apply_gradients,
                              trainable_variables)

    def apply_gradients(grads_and_vars, *args, **kwargs):
        averaged = [(g / steps, v) for g, v in grads_and_vars]
        return patch.apply_gradients(averaged, *args, **kwargs)

    optimizer.apply_gradients = apply_gradients
    return patch


def _installer(steps: int):
    """`prepare` for `fit_run`: build the optimizer, then `patch_with_mask` it."""

    def install(model, optimizer):
        optimizer.build(model.trainable_variables)
        patch_with_mask(optimizer, steps, model.trainable_variables)

    return install


@dataclasses.dataclass(frozen=True)
class MaskTrickRecord:
    """The mask trick vs big-batch training, and `AccumulatingOptimizer` vs the same.

    `reference_updates` is n (big-batch steps); the mask trick's optimizer made
    `mask_iterations` (= n * steps) updates; `*_placement` say where the all-reduces of
    one fit step are.
    """

    optimizer: str
    replicas: int
    steps: int
    reference_updates: int
    mask_vs_big_batch: WeightDiff
    mask_iterations: int
    accumulating_vs_big_batch: WeightDiff
    accumulating_iterations: int
    mask_placement: AllReducePlacement
    accumulating_placement: AllReducePlacement


def reproduce(strategy, optimizer: str = "adam", steps: int = 4, updates: int = 3,
              micro_batch: int = 4) -> MaskTrickRecord:
    """`updates * steps` micro-batches of `micro_batch` through `model.fit`, three ways.

    The reference is one device (no strategy) on batches of `steps * micro_batch`.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}.")
    factory = OPTIMIZERS[optimizer]
    x, y = regression_data(micro_batch * steps * updates)
    reference = fit_run(None, factory, x, y, micro_batch * steps)
    masked = fit_run(strategy, factory, x, y, micro_batch, prepare=_installer(steps))
    accumulated = fit_run(strategy, lambda: AccumulatingOptimizer(factory(), steps),
                          x, y, micro_batch)
    return MaskTrickRecord(
        optimizer=optimizer,
        replicas=strategy.num_replicas_in_sync,
        steps=steps,
        reference_updates=reference.updates,
        mask_vs_big_batch=weight_diff(masked.final, reference.final),
        mask_iterations=masked.updates,
        accumulating_vs_big_batch=weight_diff(accumulated.final, reference.final),
        accumulating_iterations=accumulated.updates,
        mask_placement=fit_step_placement(masked.model, x, y, micro_batch),
        accumulating_placement=fit_step_placement(accumulated.model, x, y, micro_batch),
    )


# -- what one masked (zero-gradient) micro-step does ---------------------------------


@dataclasses.dataclass(frozen=True)
class ZeroGradientStepRecord:
    """One `apply_gradients` with all-zero gradients, after one real step.

    `weight_change_max_abs` is how far the weights moved; `vs_prediction` compares
    the weights after the step with the optimizer's update rule evaluated by hand
    (numpy, float64) on a zero gradient; for Adam-type optimizers `moments_vs_decay`
    compares the moments after the step with `beta_1 * m` and `beta_2 * v` from before
    (else None).
    """

    optimizer: str
    iterations_before: int
    iterations_after: int
    weight_change_max_abs: float
    vs_prediction: WeightDiff
    moments_vs_decay: WeightDiff | None


def _predict_zero_gradient_step(optimizer, weights, iterations):
    """The weights after a zero-gradient step by the Keras update rules (numpy)."""
    lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    wd = optimizer.weight_decay or 0.0
    predicted = []
    for i, w in enumerate(weights):
        w = w.astype(np.float64) * (1.0 - wd * lr)  # TFOptimizer._apply_weight_decay
        if isinstance(optimizer, keras.optimizers.Adam):  # AdamW is an Adam
            m = np.asarray(optimizer._momentums[i].numpy(), np.float64) * optimizer.beta_1
            v = np.asarray(optimizer._velocities[i].numpy(), np.float64) * optimizer.beta_2
            t = iterations + 1
            alpha = lr * np.sqrt(1 - optimizer.beta_2 ** t) / (1 - optimizer.beta_1 ** t)
            w = w - alpha * m / (np.sqrt(v) + optimizer.epsilon)
        elif isinstance(optimizer, keras.optimizers.SGD) and optimizer.momentum:
            if optimizer.nesterov:
                raise ValueError("the prediction covers SGD momentum without nesterov.")
            w = w + optimizer.momentum * np.asarray(optimizer.momentums[i].numpy(), np.float64)
        elif not isinstance(optimizer, keras.optimizers.SGD):
            raise ValueError(f"no zero-gradient prediction for {type(optimizer).__name__}.")
        predicted.append(w)
    return predicted


def _moments(optimizer):
    return [v.numpy() for v in optimizer._momentums] + [v.numpy() for v in optimizer._velocities]


def _factory(optimizer):
    if callable(optimizer):
        return optimizer, type(optimizer()).__name__
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}.")
    return OPTIMIZERS[optimizer], optimizer


def zero_gradient_step(optimizer="adam", examples: int = 16) -> ZeroGradientStepRecord:
    """What the mask trick's masked micro-step does to weights and optimizer state.

    `optimizer` is a name in `OPTIMIZERS` or a factory (SGD with or without momentum
    or weight decay, Adam, AdamW).

    One device, no strategy: one real step on `(x, y)` (so moments are non-zero), then
    `apply_gradients` with zeros, exactly what `accumulated * 0` hands the optimizer.
    """
    factory, name = _factory(optimizer)
    x, y = regression_data(examples)
    model, opt = tiny_model(), factory()
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    before = weights_of(variables)
    iterations_before = int(opt.iterations.numpy())
    predicted = _predict_zero_gradient_step(opt, before, iterations_before)
    adam = isinstance(opt, keras.optimizers.Adam)
    if adam:
        n = len(variables)
        moments = _moments(opt)
        decayed = ([m * opt.beta_1 for m in moments[:n]] + [v * opt.beta_2 for v in moments[n:]])
    opt.apply_gradients([(tf.zeros_like(v), v) for v in variables])
    after = weights_of(variables)
    return ZeroGradientStepRecord(
        optimizer=name,
        iterations_before=iterations_before,
        iterations_after=int(opt.iterations.numpy()),
        weight_change_max_abs=float(max(np.abs(a - b).max() for a, b in zip(after, before))),
        vs_prediction=weight_diff(after, predicted),
        moments_vs_decay=weight_diff(_moments(opt), decayed) if adam else None,
    )
