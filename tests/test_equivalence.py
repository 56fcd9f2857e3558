import keras
import numpy as np
import pytest

from distgrad_course.lab.compare import (
    check_close,
    check_not_close,
    update_ratio,
    weight_diff,
    weights_of,
)
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.recipes import big_batch_reference


def test_same_seed_builds_identical_models():
    a, b = weights_of(tiny_model(seed=3)), weights_of(tiny_model(seed=3))
    assert weight_diff(a, b).max_abs == 0.0
    assert weight_diff(a, weights_of(tiny_model(seed=4))).max_abs > 0.0


def test_check_close_passes_within_and_fails_outside_tolerance():
    w = [np.ones((2, 2), np.float32)]
    check_close([w[0] * (1 + 5e-7)], w)
    with pytest.raises(AssertionError, match="weights differ: max abs diff"):
        check_close([w[0] * (1 + 1e-5)], w)
    with pytest.raises(AssertionError, match="unexpectedly agree"):
        check_not_close(w, w)


def test_weight_diff_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        weight_diff([np.zeros(2)], [np.zeros(3)])


def test_update_ratio_recovers_a_scale_factor():
    reference = [np.arange(1.0, 7.0).reshape(2, 3)]
    assert update_ratio([3 * reference[0]], reference) == pytest.approx(3.0)


def test_big_batch_reference_is_deterministic_and_moves_weights():
    x, y = regression_data(16)
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    first, second = big_batch_reference(sgd, x, y), big_batch_reference(sgd, x, y)
    assert weight_diff(first, second).max_abs == 0.0
    assert weight_diff(first, weights_of(tiny_model())).max_abs > 1e-3
