"""`GradientAccumulator` on TensorFlow's no-merge-call path, simulated on CPUs (conftest's
`no_merge_call`): a custom loop equals big-batch training and moves the gradients once per
update (a micro-step all-reduces only the lab's reported loss); `non_finite="skip"` on two
replicas fails at the first apply, naming the fix, before any update; and without any
strategy (no merge call either) a NaN raises and changes no weight.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from no_merge_call_cases import PARAMETERS, K

from distgrad.accumulator import GradientAccumulator
from distgrad_course.lab.accumulation import AccumulatedTrainer, train_accumulated
from distgrad_course.lab.compare import OPTIMIZERS, check_close
from distgrad_course.lab.data import regression_data
from distgrad_course.lab.graph import all_reduce_sizes
from distgrad_course.lab.recipes import big_batch_reference
from distgrad_course.lab.xla_path import no_merge_call_strategy


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_gradient_accumulator_equals_big_batch_without_merge_call(no_merge_call, name):
    x, y = regression_data(8)
    run = train_accumulated(no_merge_call, OPTIMIZERS[name], x, y, K, updates=2)
    check_close(run.final, big_batch_reference(OPTIMIZERS[name], x, y, steps=2))
    assert run.iterations == 2 and run.copies_agree


def test_gradient_accumulator_moves_gradients_once_per_update_without_merge_call():
    x, y = regression_data(8)
    trainer = AccumulatedTrainer(no_merge_call_strategy(2), OPTIMIZERS["sgd"], x, y, K)
    trainer.update()
    # The one collective of a micro-step is the lab's reported loss: a scalar, no gradient.
    assert all_reduce_sizes(trainer.accumulate_function, trainer.micro_batches[0],
                            replicas=2) == [1]
    assert all_reduce_sizes(trainer.apply_step.function, replicas=2) == [PARAMETERS, 1]


def test_skip_without_merge_call_on_two_replicas_fails_at_the_first_apply_naming_the_fix():
    x, y = regression_data(8)
    trainer = AccumulatedTrainer(no_merge_call_strategy(2), OPTIMIZERS["sgd"], x, y, K)
    trainer.accumulator.non_finite = "skip"
    trainer.accumulate_step(0)
    with pytest.raises(ValueError, match=r"AccumulatingOptimizer\(optimizer, accumulation_steps"
                                         r"=1, non_finite='skip'\).*jit_compile=False"):
        trainer.apply_step()
    assert int(trainer.optimizer.iterations.numpy()) == 0


def test_a_plain_gradient_accumulator_without_any_strategy_raises_on_nan():
    variable = tf.Variable([1.0])
    accumulator = GradientAccumulator([variable])
    accumulator.add([tf.constant([np.nan])])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"at update\] \[1\]"):
        accumulator.make_apply_step(keras.optimizers.SGD(0.1))()
    assert float(variable.numpy()[0]) == 1.0
