"""tf-keras (Keras 2) custom loops under MirroredStrategy: `distgrad.GradientAccumulator`
and `distgrad.tf_keras.AccumulatingOptimizer`, each equal to one big-batch step per update.

One tf-keras child (`tests/tf_keras_children.py:custom_loops`) runs both.
"""

import os

import pytest

from distgrad_course.lab.compare import check_close
from distgrad_course.lab.data import regression_data
from distgrad_course.lab.tf_keras_runner import run_tf_keras

TESTS_ON_PATH = {"PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}  # tests/
REPLICAS, MICRO_BATCH, K, UPDATES = 2, 8, 4, 2


@pytest.fixture(scope="module")
def loops():
    x, y = regression_data(MICRO_BATCH * K * UPDATES)
    return run_tf_keras("tf_keras_children:custom_loops", REPLICAS, env=TESTS_ON_PATH,
                      x=x.tolist(), y=y.tolist(), micro_batch=MICRO_BATCH,
                      accumulation_steps=K, updates=UPDATES)


@pytest.mark.parametrize("name", ["adam", "legacy momentum"])
def test_gradient_accumulator_in_a_tf_keras_custom_loop_equals_big_batch(loops, name):
    assert loops.replicas == REPLICAS and loops.tf_keras.startswith("2.")
    check_close(loops[name]["gradient_accumulator"], loops[name]["big_batch"], what=name)
    assert loops[name]["iterations"][0] == UPDATES


@pytest.mark.parametrize("name", ["adam", "legacy momentum"])
def test_accumulating_optimizer_in_a_tf_keras_custom_loop_equals_big_batch(loops, name):
    check_close(loops[name]["accumulating_optimizer"], loops[name]["big_batch"], what=name)
    assert loops[name]["iterations"][1] == UPDATES
