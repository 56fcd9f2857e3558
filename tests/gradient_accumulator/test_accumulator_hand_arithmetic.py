"""`GradientAccumulator` on hand-computed values, call by call: `micro_steps` after each
`add`, the summed buffers, the weights after the apply step hands the optimizer the sum
and the buffers and counters it resets; with `non_finite="skip"`, a NaN update skipped
(weights kept, buffers zeroed, counted, warned about) and the next one applied.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from distgrad.accumulator import GradientAccumulator


def test_gradient_accumulator_call_by_call():
    variable = tf.Variable([1.0, 2.0])
    accumulator = GradientAccumulator([variable])
    optimizer = keras.optimizers.SGD(0.5)
    apply_step = accumulator.make_apply_step(optimizer)

    accumulator.add([tf.constant([1.0, 2.0])])
    assert accumulator.micro_steps == 1
    accumulator.add([tf.constant([3.0, 0.0])])
    assert accumulator.micro_steps == 2
    np.testing.assert_array_equal(accumulator.gradients()[0].numpy(), [4.0, 2.0])

    apply_step()  # the optimizer gets the sum [4, 2]: v - 0.5 * [4, 2]
    np.testing.assert_array_equal(variable.numpy(), [-1.0, 1.0])
    assert (accumulator.micro_steps, int(optimizer.iterations.numpy())) == (0, 1)
    np.testing.assert_array_equal(accumulator.gradients()[0].numpy(), [0.0, 0.0])


# -- non-finite gradients -----------------------------------------------------------------


def test_gradient_accumulator_skip_call_by_call():
    variable = tf.Variable([1.0, 2.0])
    accumulator = GradientAccumulator([variable], non_finite="skip")
    apply_step = accumulator.make_apply_step(keras.optimizers.SGD(0.5))
    accumulator.add([tf.constant([1.0, np.nan])])
    with pytest.warns(UserWarning, match="update skipped"):
        apply_step()
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(accumulator.gradients()[0].numpy(), [0.0, 0.0])
    assert (accumulator.micro_steps, int(accumulator.skipped_updates.numpy())) == (0, 1)
    accumulator.add([tf.constant([2.0, 2.0])])
    apply_step()  # the sum [2, 2]: v - 0.5 * [2, 2]
    np.testing.assert_array_equal(variable.numpy(), [0.0, 1.0])
