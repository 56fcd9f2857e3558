"""Pitfall: clipping each micro-batch's gradient, and schedules that count micro-steps.

Clipping by global norm is not linear: clip(g1) + clip(g2) != clip(g1 + g2). A loop that
clips every micro-batch gradient before accumulating (what `SGD(global_clipnorm=...)`
does when it is applied every micro-step, e.g. the 0/1 mask trick) computes a different
update than one big-batch step. `AccumulatingOptimizer` clips the accumulated, summed
gradient, and a learning-rate schedule on its inner optimizer is evaluated at the inner
`iterations`, i.e. it counts updates, not micro-steps (lesson 03 shows the mask trick,
whose `iterations` counts micro-steps).
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.compare import WeightDiff, weight_diff, weights_of
from distgrad_course.lab.data import per_example_squared_error, regression_data, tiny_model
from distgrad_course.lab.recipes import fit_run

MICRO_BATCH = 4
STEPS = 4


def _clip_each_micro_batch(x, y, clip_norm: float, learning_rate: float):
    """One update from STEPS micro-batches, each gradient clipped before it is summed."""
    model = tiny_model()
    optimizer = keras.optimizers.SGD(learning_rate)
    optimizer.build(model.trainable_variables)
    total = None
    for part in np.split(np.arange(len(x)), len(x) // MICRO_BATCH):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example_squared_error(y[part], model(x[part])))
        grads, _ = tf.clip_by_global_norm(tape.gradient(loss, model.trainable_variables),
                                          clip_norm)
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    optimizer.apply_gradients(zip([g / STEPS for g in total], model.trainable_variables))
    return weights_of(model)


@dataclasses.dataclass(frozen=True)
class ClipScheduleRecord:
    clip_each_micro_batch_vs_big_batch: WeightDiff
    accumulating_optimizer_clip_vs_big_batch: WeightDiff
    big_batch_update_max_abs: float
    schedule_accumulating_vs_big_batch: WeightDiff
    schedule_vs_constant_learning_rate: WeightDiff
    updates: int
    micro_steps: int


def reproduce(strategy=None, clip_norm: float = 0.05, learning_rate: float = 0.1):
    """Clipping and a schedule, one update of STEPS micro-batches (clipping) and two
    updates (schedule: lr 0.1 at update 0, 0.01 from update 1 on), vs big-batch `fit`."""
    x, y = regression_data(MICRO_BATCH * STEPS)
    clipped = lambda: keras.optimizers.SGD(learning_rate, global_clipnorm=clip_norm)  # noqa: E731
    big = fit_run(None, clipped, x, y, len(x))
    accumulated = fit_run(strategy, lambda: AccumulatingOptimizer(clipped(), STEPS), x, y,
                          MICRO_BATCH)

    def scheduled():
        return keras.optimizers.SGD(
            keras.optimizers.schedules.PiecewiseConstantDecay([0], [0.1, 0.01]))

    x2, y2 = regression_data(2 * MICRO_BATCH * STEPS)
    big_schedule = fit_run(None, scheduled, x2, y2, MICRO_BATCH * STEPS)
    acc_schedule = fit_run(strategy, lambda: AccumulatingOptimizer(scheduled(), STEPS), x2, y2,
                           MICRO_BATCH)
    constant = fit_run(strategy, lambda: AccumulatingOptimizer(keras.optimizers.SGD(0.1), STEPS),
                       x2, y2, MICRO_BATCH)
    return ClipScheduleRecord(
        clip_each_micro_batch_vs_big_batch=weight_diff(
            _clip_each_micro_batch(x, y, clip_norm, learning_rate), big.final),
        accumulating_optimizer_clip_vs_big_batch=weight_diff(accumulated.final, big.final),
        big_batch_update_max_abs=float(max(np.abs(a - b).max()
                                           for a, b in zip(big.final, big.initial))),
        schedule_accumulating_vs_big_batch=weight_diff(acc_schedule.final, big_schedule.final),
        schedule_vs_constant_learning_rate=weight_diff(acc_schedule.final, constant.final),
        updates=acc_schedule.updates,
        micro_steps=acc_schedule.total_micro_steps,
    )
