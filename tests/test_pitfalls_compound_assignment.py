"""Question 004's pitfall: `g += _g` in a tf.while_loop body, and the posted final solution."""

import pytest

from distgrad.pitfalls import compound_assignment, final_solution


def expected_after(iterations):
    added = iterations * (iterations + 1) / 2  # iteration i adds (i + 1)
    return [[1.0 + added, 2.0 + added], 10.0 + 10.0 * added]


@pytest.fixture(scope="module")
def record():
    return compound_assignment.reproduce(iterations=3)


def test_compound_assignment_in_a_while_loop_body_leaves_the_gradients_unchanged(record):
    assert record.initial == [[1.0, 2.0], 10.0]
    assert record.expected == expected_after(3) == [[7.0, 8.0], 70.0]
    assert record.compound_in_while_loop == record.initial


def test_returning_new_tensors_as_loop_variables_accumulates(record):
    assert record.returned_in_while_loop == expected_after(3)


def test_variable_assign_add_in_the_body_accumulates_without_loop_variables(record):
    assert record.variable_assign_add == expected_after(3)


def test_it_is_python_name_rebinding_not_a_graph_effect(record):
    assert record.eager_python_loop == record.initial  # same no-op without any graph
    assert not record.tensor_has_iadd  # so `g += _g` means `g = g + _g`
    assert record.ndarray_has_iadd and record.numpy_in_place == expected_after(3)


def test_variables_refuse_or_silently_rebind_compound_assignment(record):
    assert record.tf_variable_iadd_error.type == "RuntimeError"
    assert record.tf_variable_iadd_error.contains(
        "`variable += value` with `tf.Variable`s is not supported. "
        "Use `variable.assign_add(value)`")
    # a Keras 3 Variable has no __iadd__: the name now holds a tensor, the variable is unchanged
    assert record.keras_variable_rebound_to == "EagerTensor"
    assert record.keras_variable_value_after == 1.0


def test_reproduce_rejects_zero_iterations():
    with pytest.raises(ValueError, match="iterations must be an integer >= 1"):
        compound_assignment.reproduce(0)


def test_in_fit_the_broken_loop_trains_on_the_first_micro_batch_only():
    result = compound_assignment.reproduce_in_fit(micro_batches=4)
    assert result.vs_first_micro_batch.within()
    assert not result.vs_full_batch.within()
    # the accepted fix without the (commented-out) 1/k: k times the mean gradient
    assert result.returned_ratio == pytest.approx(4.0, rel=1e-6)


def test_reproduce_in_fit_needs_equal_micro_batches():
    with pytest.raises(ValueError, match="must be divisible by micro_batches=3"):
        compound_assignment.reproduce_in_fit(micro_batches=3, examples=16)


@pytest.fixture(scope="module")
def audit(strategy2):
    return final_solution.audit_final_solution(strategy2)


def test_posted_final_solution_super_self_is_a_type_error(audit):
    assert audit.super_self_error.type == "TypeError"
    assert audit.super_self_error.contains("super() argument 1 must be a type")


def test_posted_final_solution_private_imports_are_gone(audit):
    errors = audit.import_errors
    assert set(errors) == {
        "tensorflow.python.keras.mixed_precision.experimental.loss_scale_optimizer",
        "tensorflow.python.distribute.distribution_strategy_context",
    }
    assert all(e.type == "ModuleNotFoundError" for e in errors.values())


def test_posted_final_solution_private_optimizer_apis_are_gone(audit):
    assert audit.attributes_present == {
        "optimizer._HAS_AGGREGATE_GRAD": False,
        "optimizer._aggregate_gradients": False,
        "loss_scale_optimizer.get_scaled_loss": False,
        "loss_scale_optimizer.get_unscaled_gradients": False,
    }
    assert not audit.legacy_isinstance  # the surviving tf.python.keras LSO is another class
    assert audit.aggregate_flag_error.type == "TypeError"
    assert audit.aggregate_flag_error.contains(
        "unexpected keyword argument 'experimental_aggregate_gradients'")
    assert audit.apply_clips_itself


def test_posted_final_solution_without_return_fits_twice(audit):
    assert audit.iterations_with_k1 == 2  # one batch, one epoch: two optimizer steps


def test_posted_final_solution_reports_the_mean_prediction_as_loss_on_keras_3(audit):
    assert audit.reported_loss == pytest.approx(audit.mean_prediction, rel=1e-6)
    assert audit.reported_loss != pytest.approx(audit.true_loss, rel=0.01)


def test_posted_final_solution_reads_one_replica_outside_the_scope_and_steps_1_over_r(audit):
    assert (audit.replicas_seen_in_fit, audit.replicas_of_model) == (1, 2)
    assert audit.two_replica_update_ratio == pytest.approx(0.5, rel=1e-6)
