"""`MicroBatching(non_finite=...)` (`with_micro_batches`) in `model.fit`, on 1 and 2 replicas:
a NaN in one step's micro-batches raises by default, naming the update, after the steps
before it; with "skip" that step is dropped and counted (in `fit`'s logs and in
`skipped_updates`, a counter that is no model weight), and the weights equal `fit`
without that step.
"""

import pytest
import tensorflow as tf
from non_finite_cases import compiled, nan_data

from distgrad.train_step import with_micro_batches
from distgrad_course.lab.compare import OPTIMIZERS, check_close, weights_of
from distgrad_course.lab.data import tiny_model
from distgrad_course.lab.recipes import fit_run


@pytest.mark.usefixtures("collect_garbage")
def test_micro_batching_raises_by_default_naming_the_update(strategy):
    x, y = nan_data(strategy, micro_batch_index=1, batch=16, examples=32)
    model = compiled(strategy, OPTIMIZERS["sgd"], lambda: with_micro_batches(tiny_model(), 4))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"at update\] \[2\]"):
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1


def test_micro_batching_skip_logs_the_count_and_equals_fit_without_that_step(strategy):
    x, y = nan_data(strategy, micro_batch_index=0, batch=16, examples=32)
    model = compiled(strategy, OPTIMIZERS["adam"],
                     lambda: with_micro_batches(tiny_model(), 4, non_finite="skip"))
    history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    check_close(weights_of(model), fit_run(None, OPTIMIZERS["adam"], x[16:], y[16:], 16).final)
    assert history.history["skipped_updates"] == [1]
    assert int(model.skipped_updates.numpy()) == 1
    assert len(model.weights) == len(tiny_model().weights)  # the counter is no weight
