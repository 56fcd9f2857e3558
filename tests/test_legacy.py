"""distgrad.legacy: run a snippet under tf-keras (Keras 2) in a fresh Python."""

import pytest

from distgrad import legacy
from distgrad.legacy import LegacyRunError, run_legacy


@pytest.fixture(scope="module")
def two_replica_child():
    return run_legacy(
        """
        import os
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(
            tf.keras.optimizers.legacy.SGD(0.1))
        report(
            env=os.environ.get("TF_USE_LEGACY_KERAS"),
            model_module=tf.keras.Model.__module__,
            lso_class=type(optimizer).__name__,
            initial_scale=float(optimizer.loss_scale.numpy()),
            in_sync=strategy.num_replicas_in_sync,
            not_a_number=float("nan"),
            numpy_values=np.arange(3, dtype=np.float32),
        )
        report(later="overwrites nothing else")
        """,
        replicas=2,
    )


def test_child_runs_tf_keras_2_with_the_legacy_switch_set(two_replica_child):
    assert two_replica_child["env"] == "1"
    assert two_replica_child["model_module"].startswith("tf_keras")
    assert two_replica_child.tf_keras.startswith("2.")
    assert two_replica_child.tensorflow.split(".")[:2] == two_replica_child.tf_keras.split(".")[:2]


def test_child_has_a_mirrored_strategy_over_the_requested_replicas(two_replica_child):
    assert two_replica_child.replicas == 2
    assert two_replica_child["in_sync"] == 2


def test_reported_values_come_back_as_json(two_replica_child):
    assert two_replica_child["lso_class"] == "LossScaleOptimizer"
    assert two_replica_child["initial_scale"] == 2.0**15
    assert two_replica_child["numpy_values"] == [0.0, 1.0, 2.0]
    assert two_replica_child["not_a_number"] == "nan"
    assert two_replica_child["later"] == "overwrites nothing else"


def test_a_failing_snippet_raises_with_the_child_stderr_tail():
    with pytest.raises(LegacyRunError, match="exited with status 1") as info:
        run_legacy("raise ValueError('marker-4711 from the child')")
    assert "marker-4711 from the child" in str(info.value)


def test_a_snippet_that_never_reports_is_an_error():
    with pytest.raises(LegacyRunError, match="without reporting"):
        run_legacy("import os; os._exit(0)")


def test_a_slow_snippet_is_stopped_at_the_timeout():
    with pytest.raises(LegacyRunError, match="longer than 1 s"):
        run_legacy("import time; time.sleep(60)", timeout=1)


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"snippet": b"report()"}, TypeError, "Python source text"),
    ({"snippet": "report()", "replicas": 0}, ValueError, "replicas must be an integer >= 1"),
    ({"snippet": "report()", "timeout": 0}, ValueError, "timeout must be a positive"),
])
def test_bad_arguments_are_refused_before_starting_a_child(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        run_legacy(**kwargs)


def test_missing_tf_keras_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(legacy, "legacy_keras_available", lambda: False)
    with pytest.raises(LegacyRunError, match="pip install tf-keras"):
        run_legacy("report()")
