"""Loss scaling on TensorFlow's no-merge-call path, simulated on CPUs: Keras' own
`LossScaleOptimizer` fails at its first step with a trace-time `merge_call` error (no
hang, nothing run), and `AllReplicasFiniteLossScaleOptimizer` fails at its first step
too, naming the fix (`jit_compile=False`), and leaves the global policy float32.
"""

import keras
import pytest

from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
from distgrad_course.lab.child import run_child
from distgrad_course.lab.mixed import mixed_precision_fit, overflow_data
from distgrad_course.lab.xla_path import no_merge_call_strategy


def test_keras_loss_scale_optimizer_fails_at_its_first_step_without_merge_call_no_hang():
    # TF 2.21 / Keras 3.15.1: with merge_call gone, LossScaleOptimizer._common_apply puts
    # the inner update in a replica-context cond, and the inner optimizer's `iterations`
    # (ONLY_FIRST_REPLICA) needs a merge_call there: a trace-time RuntimeError, before
    # any replica could skip alone and leave the other waiting in an all-reduce.
    record = run_child("distgrad_course.lab.xla_path:stock_loss_scale_overflow_on_one_replica",
                       {"replicas": 2}, timeout=240).value
    assert record["error"]["type"] == "RuntimeError"
    assert "`merge_call` called while defining a new graph" in record["error"]["message"]
    assert "LossScaleOptimizer._common_apply" in record["error"]["message"]
    assert record["loss_scales"] == [1024.0, 1024.0]  # nothing ran
    assert all(record["weights_finite"])


@pytest.mark.usefixtures("collect_garbage")
def test_the_all_replicas_finite_wrapper_fails_at_the_first_step_naming_the_fix():
    x, y = overflow_data(2, 8, replicas=2)
    with pytest.raises(ValueError, match="jit_compile=False.*without merge_call"):
        mixed_precision_fit(no_merge_call_strategy(2), x, y, 8, accumulation_steps=None,
                            wrapper=AllReplicasFiniteLossScaleOptimizer)
    assert keras.mixed_precision.global_policy().name == "float32"
