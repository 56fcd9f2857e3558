"""distgrad.tf_keras.AccumulatingOptimizer: `model.fit` accumulation for tf-keras (Keras 2).

Every tf-keras observation comes from one child process per scenario group
(`tests/tf_keras_children.py`, run by `distgrad_course.lab.tf_keras_runner.run_tf_keras`),
asserted here.
"""

import os

import keras
import numpy as np
import pytest

from distgrad_course.lab.compare import check_close, check_not_close
from distgrad_course.lab.data import regression_data
from distgrad_course.lab.tf_keras_runner import run_tf_keras

TESTS_ON_PATH = {"PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}  # tests/
REPLICAS, MICRO_BATCH, K, UPDATES = 2, 8, 3, 2
INNER = ("momentum", "adam", "legacy momentum", "legacy adam")


@pytest.fixture(scope="module")
def fits():
    x, y = regression_data(MICRO_BATCH * K * UPDATES)
    return run_tf_keras("tf_keras_children:fit_equivalence", REPLICAS, env=TESTS_ON_PATH,
                      x=x.tolist(), y=y.tolist(), micro_batch=MICRO_BATCH,
                      accumulation_steps=K)


def test_the_child_ran_tf_keras_on_two_replicas(fits):
    assert fits.replicas == REPLICAS and fits.tf_keras.startswith("2.")
    assert {fits[name]["optimizer"] for name in INNER} == {"AccumulatingOptimizer"}


@pytest.mark.parametrize("name", INNER)
def test_fit_with_k_micro_batches_on_two_replicas_equals_one_big_batch_step(fits, name):
    run = fits[name]
    check_close(run["accumulated"], run["big_batch"], what=name)  # rtol = atol = 1e-6
    assert run["big_batch_updates"] == UPDATES


@pytest.mark.parametrize("name", INNER)
def test_iterations_count_updates_and_total_micro_steps_count_micro_batches(fits, name):
    rows = fits[name]["rows"]
    assert [r["iterations"] for r in rows] == [(t + 1) // K for t in range(K * UPDATES)]
    assert [r["updates"] for r in rows] == [r["iterations"] for r in rows]  # inner optimizer
    assert [r["micro_steps"] for r in rows] == [(t + 1) % K for t in range(K * UPDATES)]
    assert [r["total_micro_steps"] for r in rows] == list(range(1, K * UPDATES + 1))
    assert {r["skipped_updates"] for r in rows} == {0}


def test_accumulators_are_float32(fits):
    assert set(fits["adam"]["accumulator_dtypes"]) == {"float32"}


def test_the_inner_optimizer_clips_the_all_reduced_mean_once_per_update(fits):
    run = fits["clipped sgd"]
    check_close(run["accumulated"], run["big_batch"])
    check_not_close(run["big_batch"], run["unclipped_big_batch"])  # clipping was active


def test_without_a_strategy_it_accumulates_on_one_device(fits):
    run = fits["adam, no strategy"]
    check_close(run["accumulated"], run["big_batch"])
    assert run["rows"][-1]["iterations"] == UPDATES


@pytest.mark.skipif(keras.__version__.startswith("2."),
                    reason="TensorFlow 2.15: no Keras 3 process (tests/test_version_checks.py)")
def test_importing_it_under_keras_3_fails_naming_the_legacy_switch():
    import tensorflow as tf

    assert not tf.keras.Model.__module__.startswith("tf_keras")  # this process: Keras 3
    with pytest.raises(ImportError, match="Set the environment variable TF_USE_LEGACY_KERAS=1 "
                                          "before TensorFlow is imported"):
        import distgrad.tf_keras
    with pytest.raises(ImportError, match="use distgrad.AccumulatingOptimizer"):
        import distgrad.tf_keras.optimizer  # noqa: F401


@pytest.fixture(scope="module")
def state_and_errors():
    x, y = regression_data(MICRO_BATCH * K * UPDATES)
    bad_x = x.copy()
    bad_x[(K + 1) * MICRO_BATCH + MICRO_BATCH // 2] = np.nan  # cycle 2, replica 1 only
    return run_tf_keras("tf_keras_children:state_and_errors", REPLICAS, env=TESTS_ON_PATH,
                      x=x.tolist(), y=y.tolist(), bad_x=bad_x.tolist(), micro_batch=MICRO_BATCH,
                      accumulation_steps=K, stop_after=K + 1)


def test_a_checkpoint_taken_mid_cycle_restores_the_cycle(state_and_errors):
    record = state_and_errors["checkpoint"]
    saved = record["saved"]
    assert (saved["micro_steps"], saved["iterations"], saved["updates"]) == (1, 1, 1)
    check_close(record["lazily_final"], record["uninterrupted"])  # restored before built
    for how in ("restored", "loaded"):  # tf.train.Checkpoint; model.save + load_model
        state = record[how]
        assert (state["micro_steps"], state["iterations"], state["updates"]) == (1, 1, 1)
        for copy in state["accumulator_copies"]:  # the saved SUM, / R on every replica
            np.testing.assert_allclose(copy, np.asarray(saved["accumulator"]) / REPLICAS,
                                       rtol=1e-6)
        check_close(record[f"{how}_final"], record["uninterrupted"], what=how)
    assert record["loaded_class"] == "AccumulatingOptimizer"


def test_a_non_finite_cycle_raises_by_default_and_applies_nothing(state_and_errors):
    record = state_and_errors["non_finite"]
    raised = record["raise"]
    assert raised["error"]["type"] == "InvalidArgumentError"
    assert "NaN/Inf gradients on some replica in the cycle of update" in raised["error"][
        "message"]
    assert len(raised["rows"]) == 2 * K - 1 and raised["rows"][-1]["iterations"] == 1
    check_close(raised["weights"], record["big_batch_first_cycle"])  # cycle 2 not applied
    assert raised["accumulators_finite"] is False  # kept, for inspection


def test_skip_drops_a_non_finite_cycle_and_counts_it(state_and_errors):
    record = state_and_errors["non_finite"]
    skipped = record["skip"]
    assert skipped["error"] is None
    assert [r["skipped_updates"] for r in skipped["rows"]] == [0] * (2 * K - 1) + [1]
    assert [r["iterations"] for r in skipped["rows"]][K - 1:] == [1] * (K + 1)
    assert skipped["accumulators_finite"] and skipped["micro_steps"] == 0
    check_close(skipped["weights"], record["big_batch_first_cycle"])


def test_the_config_round_trips_alone_and_inside_a_loss_scale_optimizer(state_and_errors):
    config = state_and_errors["config"]
    assert config["alone"] == ["tf_keras.src.optimizers.legacy.gradient_descent", 3, "skip",
                               pytest.approx(0.9)]  # momentum, a float32 hyperparameter
    assert config["wrapped"] == ["LossScaleOptimizerV3", "AccumulatingOptimizer", 2, "Adam"]


@pytest.mark.parametrize("case, error, fragment", [
    ("accumulation_steps=0", "ValueError", "accumulation_steps must be an integer >= 1"),
    ("accumulation_steps=True", "ValueError", "accumulation_steps must be an integer >= 1"),
    ("non_finite='warn'", "ValueError", "non_finite must be one of ('raise', 'skip')"),
    ("clipnorm on the wrapper", "ValueError", "set them on the inner optimizer"),
    ("a string", "TypeError", "wraps a tf-keras optimizer instance"),
    ("a LossScaleOptimizer inside", "TypeError", "LossScaleOptimizer(AccumulatingOptimizer("),
    ("the Keras 3 class", "TypeError", "distgrad.tf_keras.AccumulatingOptimizer"),
    ("created outside the scope", "RuntimeError",
     "was created under no strategy but is built under MirroredStrategy with 2 replica(s)"),
    ("apply_gradients under the scope", "RuntimeError", "must be called in replica context"),
    ("skip_gradients_aggregation", "ValueError", "without skip_gradients_aggregation"),
    ("2 replicas without merge_call", "ValueError", "compile with jit_compile=False"),
])
def test_bad_input_gets_a_clear_error(state_and_errors, case, error, fragment):
    if case == "the Keras 3 class" and state_and_errors.tensorflow.startswith("2.15."):
        error = "ImportError"  # TensorFlow 2.15 has no Keras 3: distgrad says what to use
    raised = state_and_errors["bad_input"][case]
    assert raised is not None, f"{case}: nothing raised"
    assert raised["type"] == error, raised
    assert fragment in raised["message"], raised["message"]


def test_one_gradient_all_reduce_per_update_inside_the_cond_branch(fits):
    # the tiny model's 4 variables, all-reduced once, in the branch that applies the cycle
    traces = fits["adam"]["all_reduces"]
    assert traces and all(calls == [{"values": 4, "in_cond": True}] for calls in traces)
