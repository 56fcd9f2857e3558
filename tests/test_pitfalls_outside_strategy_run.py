"""Lesson 02, sections 1-2: the question's loop and the posted answer on current TF.

Lesson 02 runs and asserts both on R replicas (once per suite); here, one replica."""

import pytest

from distgrad_course.pitfalls import outside_strategy_run

MERGE_CALL_ON_NONE = "'NoneType' object has no attribute 'merge_call'"


def test_with_one_replica_gradients_are_plain_tensors_but_cross_replica_apply_still_fails(
        strategy1):
    record = outside_strategy_run.reproduce(strategy1)
    assert record.gradient_type != "PerReplica"
    assert record.sum_error is None
    assert record.apply_outside_scope_error is None
    assert record.apply_in_scope_error.contains(MERGE_CALL_ON_NONE)


def test_posted_answer_on_one_replica_is_right_by_luck(strategy1):
    record = outside_strategy_run.reproduce_posted_answer(strategy1, accumulation_steps=2)
    assert record.gradient_ratio == pytest.approx(1.0, rel=1e-6)
    assert record.update_ratio_per_replica_mean == pytest.approx(1.0, rel=1e-6)
