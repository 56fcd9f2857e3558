"""distgrad_course.lab.tf_keras_runner: run a function of a real module under tf-keras
(Keras 2), in a child."""

import importlib.metadata
import os

import pytest

from distgrad_course.lab import tf_keras_runner
from distgrad_course.lab.child import ChildError, run_child
from distgrad_course.lab.tf_keras_runner import run_tf_keras

TESTS_ON_PATH = {"PYTHONPATH": os.path.dirname(__file__)}


@pytest.fixture(scope="module")
def two_replica_child():
    return run_tf_keras("workers_for_tests:tf_keras_probe", replicas=2, env=TESTS_ON_PATH)


def test_child_runs_tf_keras_2_with_the_legacy_switch_set(two_replica_child):
    assert two_replica_child["env"] == "1"
    assert two_replica_child["model_module"].startswith("tf_keras")
    assert two_replica_child.tf_keras.startswith("2.")
    assert two_replica_child.tensorflow.split(".")[:2] == two_replica_child.tf_keras.split(".")[:2]


def test_child_has_a_mirrored_strategy_over_the_requested_replicas(two_replica_child):
    assert two_replica_child.replicas == 2
    assert two_replica_child["in_sync"] == 2


def test_returned_values_come_back_as_json(two_replica_child):
    assert two_replica_child["lso_class"] == "LossScaleOptimizer"
    assert two_replica_child["initial_scale"] == 2.0**15
    assert two_replica_child["numpy_values"] == [0.0, 1.0, 2.0]
    assert two_replica_child["not_a_number"] == "nan"
    assert two_replica_child.seconds > 0


def test_a_failing_function_raises_with_its_error_and_the_child_stderr_tail():
    with pytest.raises(ChildError, match="exited with status 1 after raising ValueError") as info:
        run_tf_keras("workers_for_tests:raise_marker", env=TESTS_ON_PATH,
                   marker="marker-4711 from the child")
    message = str(info.value)
    assert message.startswith("workers_for_tests:raise_marker under tf-keras")
    assert "marker-4711 from the child" in message.split("stderr tail:")[0]
    assert "Traceback" in message.split("stderr tail:")[1]  # the child's traceback


def test_a_function_that_exits_without_returning_is_an_error():
    with pytest.raises(ChildError, match="exited with status 0 without a result"):
        run_tf_keras("workers_for_tests:exit_without_result", env=TESTS_ON_PATH)


def test_a_slow_function_is_stopped_at_the_timeout():
    with pytest.raises(TimeoutError, match="longer than 1 s and was killed"):
        run_tf_keras("workers_for_tests:sleep_for", timeout=1, env=TESTS_ON_PATH)


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"target": b"m:f"}, TypeError, "target must be a 'package.module:function' string"),
    ({"target": "no_colon"}, ValueError, "target must look like 'package.module:function'"),
    ({"target": "m:f", "replicas": 0}, ValueError, "replicas must be an integer >= 1"),
    ({"target": "m:f", "replicas": True}, ValueError, "replicas must be an integer >= 1"),
    ({"target": "m:f", "timeout": 0}, ValueError, "timeout must be a positive"),
])
def test_bad_arguments_are_refused_before_starting_a_child(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        run_tf_keras(**kwargs)


def test_missing_tf_keras_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(tf_keras_runner, "tf_keras_available", lambda: False)
    with pytest.raises(ImportError, match="pip install tf-keras"):
        run_tf_keras("workers_for_tests:tf_keras_probe")


@pytest.mark.skipif(importlib.metadata.version("keras").startswith("2."),
                    reason="TensorFlow 2.15: tf.keras is Keras 2 without the switch")
def test_tf_keras_strategy_refuses_to_run_without_the_legacy_switch():
    result = run_child("distgrad_course.lab.tf_keras_runner:tf_keras_strategy", {"replicas": 1},
                       env={"TF_USE_LEGACY_KERAS": None}, check=False)
    assert not result.ok
    assert result.error["type"] == "RuntimeError"
    assert "TF_USE_LEGACY_KERAS=1 must be set" in result.error["message"]
