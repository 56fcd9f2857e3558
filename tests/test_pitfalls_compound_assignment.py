"""Question 004's pitfall: `g += _g` in a tf.while_loop body, and the posted final solution.

Lesson 05 runs and asserts both reproductions as the question poses them (three loop
iterations; the posted final solution on R replicas): each runs once per suite. Here:
another iteration count against the closed form, and bad arguments."""

import pytest

from distgrad_course.pitfalls import compound_assignment


def expected_after(iterations):
    added = iterations * (iterations + 1) / 2  # iteration i adds (i + 1)
    return [[1.0 + added, 2.0 + added], 10.0 + 10.0 * added]


def test_five_iterations_accumulate_only_when_the_tensors_are_returned():
    record = compound_assignment.reproduce(iterations=5)
    assert record.initial == [[1.0, 2.0], 10.0]
    assert record.expected == expected_after(5) == [[16.0, 17.0], 160.0]
    assert record.compound_in_while_loop == record.initial
    assert record.returned_in_while_loop == record.variable_assign_add == expected_after(5)


def test_reproduce_rejects_zero_iterations():
    with pytest.raises(ValueError, match="iterations must be an integer >= 1"):
        compound_assignment.reproduce(0)


@pytest.mark.usefixtures("collect_garbage")
def test_reproduce_in_fit_needs_equal_micro_batches():
    with pytest.raises(ValueError, match="must be divisible by micro_batches=3"):
        compound_assignment.reproduce_in_fit(micro_batches=3, examples=16)
