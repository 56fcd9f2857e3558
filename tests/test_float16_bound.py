"""The float16 bound every mixed_float16 comparison uses (distgrad_course.lab.mixed).

Two float16 computations of the same value in different orders (another kernel, another
summation order, oneDNN's AVX512-FP16 kernels, tensor cores, XLA) agree only up to
float16 rounding. The checks compare at a bound derived from float16's unit roundoff and
the chain of roundings, so that they hold on any CPU or GPU and still catch a real error.
"""

import numpy as np
import pytest

from distgrad_course.lab.mixed import (
    FLOAT16_UNIT_ROUNDOFF,
    check_float16_apart,
    check_float16_close,
    float16_rtol,
    step_roundings,
)


def test_the_unit_roundoff_is_half_of_float16s_machine_epsilon():
    assert FLOAT16_UNIT_ROUNDOFF == np.finfo(np.float16).eps / 2 == 2.0**-11


def test_the_bound_is_twice_gamma_n():
    u = 2.0**-11
    assert float16_rtol(1) == 2 * u / (1 - u)
    assert float16_rtol(61) == pytest.approx(0.0614, abs=5e-5)  # lesson 04's fix cell
    for bad in (0, 2048):
        with pytest.raises(ValueError, match="roundings must be between 1 and 2047"):
            float16_rtol(bad)


def test_the_roundings_of_the_course_models_counted_by_hand():
    # tiny_model 4 -> 8 -> 1: forward (4 + 2) + (8 + 2), loss gradient 2, back through the
    # output layer and tanh 1 + 2, and the batch sum of the kernel gradient.
    assert step_roundings(4) == 16 + 2 + 3 + 4 == 25
    assert step_roundings(32, widths=(4, 16, 1)) == 24 + 2 + 3 + 32 == 61


@pytest.mark.parametrize("terms", [8, 64, 512])
def test_two_float16_summation_orders_stay_within_the_bound(terms):
    # Every partial sum rounded to float16: the worst case the bound counts.
    values = np.random.default_rng(terms).normal(size=terms).astype(np.float16)

    def float16_sum(xs):
        total = np.float16(0)
        for x in xs:
            total = np.float16(total + x)
        return float(total)

    forward, backward = float16_sum(values), float16_sum(values[::-1])
    magnitude = float(np.abs(values.astype(np.float64)).sum())
    assert forward != backward  # the orders really round differently
    assert abs(forward - backward) <= float16_rtol(terms) * magnitude


def updates(scale, size=(4, 3)):
    rng = np.random.default_rng(0)
    initial = [rng.normal(size=size).astype(np.float32)]
    step = rng.normal(size=size).astype(np.float32) * 0.1
    return initial, [initial[0] + scale * step]


def test_a_rounding_sized_difference_passes_and_a_real_one_fails():
    initial, expected = updates(1.0)
    _, rounded = updates(1.0 + 1e-3)  # 0.1 % off: float16 rounding can do that
    _, wrong = updates(1.1)  # 10 % off: a wrong divisor, a lost micro-batch
    check_float16_close(rounded, expected, initial, batch=8)
    check_float16_apart(wrong, expected, initial, batch=8)
    with pytest.raises(AssertionError, match="differ by more than float16 rounding"):
        check_float16_close(wrong, expected, initial, batch=8)
    with pytest.raises(AssertionError, match="agree within float16 rounding"):
        check_float16_apart(rounded, expected, initial, batch=8)


def test_the_bound_follows_the_model_widths_it_is_given():
    # Lesson 04's fix model (4 -> 16 -> 1) rounds 61 times at 32 examples a replica, the
    # default tiny model (4 -> 8 -> 1) 53: a step 5.7 % longer (5.4 % of the change) is
    # rounding for the first only (bounds 6.1 % and 5.3 %).
    assert step_roundings(32, widths=(4, 16, 1)) == 61 and step_roundings(32) == 53
    initial, expected = updates(1.0)
    _, off = updates(1.057)
    check_float16_close(off, expected, initial, batch=32, widths=(4, 16, 1))
    check_float16_apart(off, expected, initial, batch=32)
