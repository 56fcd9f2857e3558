"""`GradientAccumulator(non_finite=...)` in a custom loop, with a NaN in the last replica's
shard of one micro-batch, on 1 and 2 replicas: "raise" (the default) fails naming the
update, changes no weight and no `iterations`, and keeps the cycle in the buffers; "skip"
drops the update, zeroes the buffers and `micro_steps`, counts it in `skipped_updates` and
warns.
"""

import numpy as np
import pytest
import tensorflow as tf
from non_finite_cases import MICRO, K, nan_data

from distgrad_course.lab.accumulation import AccumulatedTrainer
from distgrad_course.lab.compare import OPTIMIZERS, check_close, weights_of


def accumulator_trainer(strategy, non_finite):
    x, y = nan_data(strategy, micro_batch_index=1, batch=MICRO * 2, examples=MICRO * 2 * K)
    trainer = AccumulatedTrainer(strategy, OPTIMIZERS["adam"], x, y, K)
    trainer.accumulator.non_finite = non_finite  # before the first apply traces
    return trainer


def test_gradient_accumulator_raises_by_default_and_changes_nothing(strategy):
    trainer = accumulator_trainer(strategy, "raise")
    initial = weights_of(trainer.model)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"at update\] \[1\]"):
        trainer.update()
    check_close(weights_of(trainer.model), initial, rtol=0, atol=0)
    assert int(trainer.optimizer.iterations.numpy()) == 0
    assert trainer.accumulator.micro_steps == K  # the buffers keep the cycle


def test_gradient_accumulator_skip_resets_counts_and_warns(strategy):
    trainer = accumulator_trainer(strategy, "skip")
    initial = weights_of(trainer.model)
    with pytest.warns(UserWarning, match=r"update skipped.*\(1 skipped so far"):
        trainer.update()
    check_close(weights_of(trainer.model), initial, rtol=0, atol=0)
    assert int(trainer.accumulator.skipped_updates.numpy()) == 1
    assert (int(trainer.optimizer.iterations.numpy()), trainer.accumulator.micro_steps) == (0, 0)
    assert all(np.all(b.numpy() == 0) for b in trainer.accumulator.accumulated)
