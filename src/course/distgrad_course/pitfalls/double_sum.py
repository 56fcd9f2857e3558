"""Pitfall: all-reducing gradients yourself and then calling `apply_gradients`.

Keras 3 removed tf.keras' `experimental_aggregate_gradients=False`: the TensorFlow
optimizer always SUMs gradients in replica context. Gradients you already summed are
summed again, so the update is R times too large (and the step pays two all-reduces).
"""

from __future__ import annotations

import dataclasses

from distgrad_course.lab.data import regression_data
from distgrad_course.lab.graph import count_collectives
from distgrad_course.lab.recipes import make_replica_step, sgd_update_ratio
from distgrad_course.pitfalls import CapturedError


@dataclasses.dataclass(frozen=True)
class DoubleSumRecord:
    """`ratio`: the update over one device's (R with SGD); `all_reduces` in the traced
    step; `aggregate_flag_error`: what tf.keras' way out raises in Keras 3."""

    replicas: int
    ratio: float
    all_reduces: int
    aggregate_flag_error: CapturedError


def reproduce(strategy, learning_rate: float = 0.1, examples: int = 16) -> DoubleSumRecord:
    """One SGD step on `examples` examples whose replica step SUM-all-reduces its
    gradients itself and then calls `apply_gradients`, against one big-batch step on one
    device; then `apply_gradients(..., experimental_aggregate_gradients=False)`.
    """
    x, y = regression_data(examples)
    run, ratio = sgd_update_ratio(
        strategy, x, y, make_replica_step(len(x), apply="all_reduce_then_optimizer"),
        learning_rate)
    try:
        grads_and_vars = [(v * 0.0, v) for v in run.model.trainable_variables]
        run.optimizer.apply_gradients(grads_and_vars, experimental_aggregate_gradients=False)
        error = None
    except TypeError as err:
        error = CapturedError.of(err)
    with strategy.scope():
        collectives = count_collectives(run.step_function, run.batch)
    return DoubleSumRecord(
        replicas=strategy.num_replicas_in_sync,
        ratio=ratio,
        all_reduces=collectives.all_reduces,
        aggregate_flag_error=error,
    )
