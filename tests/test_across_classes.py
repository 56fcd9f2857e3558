"""What holds for every reference class at once, so no one class's spec owns it: the
`non_finite` vocabulary the classes share (and `AccumulationCallback`'s `incomplete_cycle`),
and the simulated no-merge-call strategy the classes' no-merge-call specs run on: that it
takes TensorFlow's no-merge-call path, and why it is simulated (XLA cannot compile a
two-replica step on CPUs). Each class's own behaviour is in its folder.
"""

import keras
import pytest
import tensorflow as tf

from distgrad.accumulator import GradientAccumulator
from distgrad.callbacks import AccumulationCallback
from distgrad.optimizer import AccumulatingOptimizer
from distgrad.train_step import MicroBatching, with_micro_batches
from distgrad_course.lab.child import run_child
from distgrad_course.lab.data import tiny_model
from distgrad_course.lab.xla_path import no_merge_call_strategy, takes_no_merge_call_path


def test_an_unknown_policy_is_rejected_by_each_class():
    for make in (lambda: AccumulatingOptimizer(keras.optimizers.SGD(0.1), 2, non_finite="nan"),
                 lambda: GradientAccumulator([tf.Variable([1.0])], non_finite="nan"),
                 lambda: with_micro_batches(tiny_model(), 2, non_finite="nan")):
        with pytest.raises(ValueError, match=r"non_finite must be one of \('raise', 'skip'\)"):
            make()
    with pytest.raises(ValueError, match="incomplete_cycle must be one of"):
        AccumulationCallback("apply")
    assert issubclass(type(with_micro_batches(tiny_model(), 2)), MicroBatching)


def test_the_simulated_strategy_takes_the_no_merge_call_path_and_the_stock_one_does_not(
        strategy2):
    assert takes_no_merge_call_path(no_merge_call_strategy(2))
    assert not takes_no_merge_call_path(strategy2)


def test_xla_cannot_compile_a_two_replica_step_on_cpus_for_any_optimizer():
    # Why the path is simulated: XLA compiles for one device, and a MirroredStrategy step
    # reads variables on two (TF 2.21, CPU). Keras' own Adam, no distgrad involved.
    error = run_child("distgrad_course.lab.xla_path:xla_step_on_two_cpu_replicas",
                      timeout=240).value["error"]
    assert error["type"] == "InvalidArgumentError"
    assert "Trying to access resource" in error["message"]
    assert "from device /job:localhost/replica:0/task:0/device:CPU:0" in error["message"]
