"""Lesson 02, sections 1-2: the question's loop and the posted answer on current TF."""

import pytest

from distgrad.pitfalls import outside_strategy_run

MERGE_CALL_ON_NONE = "'NoneType' object has no attribute 'merge_call'"


def test_summing_and_applying_per_replica_gradients_outside_strategy_run_fails(strategy2):
    record = outside_strategy_run.reproduce(strategy2)
    assert record.gradient_type == "PerReplica"
    assert record.sum_error.type == "TypeError"
    assert record.sum_error.contains("unsupported operand type(s) for +: 'PerReplica' and 'PerReplica'")
    # outside the scope: the default replica context's all_reduce rejects PerReplica
    assert record.apply_outside_scope_error.type == "ValueError"
    assert record.apply_outside_scope_error.contains(
        "Type PerReplica is not supported as a gradient source or gradient target")
    # under the scope, eager or traced: cross-replica context, no replica context to merge from
    assert record.apply_in_scope_error.type == "AttributeError"
    assert record.apply_in_scope_error.contains(MERGE_CALL_ON_NONE)
    assert record.apply_in_traced_function_error.type == "AttributeError"
    assert record.apply_in_traced_function_error.contains(MERGE_CALL_ON_NONE)


def test_with_one_replica_gradients_are_plain_tensors_but_cross_replica_apply_still_fails(strategy1):
    record = outside_strategy_run.reproduce(strategy1)
    assert record.gradient_type != "PerReplica"
    assert record.sum_error is None
    assert record.apply_outside_scope_error is None
    assert record.apply_in_scope_error.contains(MERGE_CALL_ON_NONE)


def test_posted_answer_uses_a_removed_api_and_its_update_is_r_times_too_large(strategy2):
    record = outside_strategy_run.reproduce_posted_answer(strategy2, accumulation_steps=2)
    assert record.run_v2_error.type == "AttributeError"
    assert record.run_v2_error.contains("object has no attribute 'experimental_run_v2'")
    assert record.accumulator_type == "MirroredVariable"
    assert record.apply_in_scope_error.type == "AttributeError"
    assert record.apply_in_scope_error.contains(MERGE_CALL_ON_NONE)
    # per-replica mean losses summed over replicas, divided by k: R x the mean gradient
    assert record.gradient_ratio == pytest.approx(2.0, rel=1e-6)
    assert record.update_ratio_per_replica_mean == pytest.approx(2.0, rel=1e-6)
    # scaled by the global micro batch instead, the same code computes the right update
    assert record.update_ratio_global_micro_batch == pytest.approx(1.0, rel=1e-6)


def test_posted_answer_on_one_replica_is_right_by_luck(strategy1):
    record = outside_strategy_run.reproduce_posted_answer(strategy1, accumulation_steps=2)
    assert record.gradient_ratio == pytest.approx(1.0, rel=1e-6)
    assert record.update_ratio_per_replica_mean == pytest.approx(1.0, rel=1e-6)
