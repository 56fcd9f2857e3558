"""`AccumulatingOptimizer` on hand-computed values, call by call (the style of Keras'
`optimizer_test.py`): weights, counters and accumulators after call 1, 2, 3, with SGD on
one device and with momentum on two replicas; then the non-finite policies call by call:
"skip" drops a NaN cycle, "raise" keeps it for inspection until `discard`. The
equivalence specs compare against big-batch training; these pin the arithmetic itself.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from call_by_call import _counters, _replica_shares_call, _sgd_wrapper

from distgrad.optimizer import AccumulatingOptimizer


def test_accumulating_optimizer_sgd_call_by_call_without_a_strategy():
    variable = keras.Variable([1.0, 2.0])
    optimizer = AccumulatingOptimizer(keras.optimizers.SGD(0.5), accumulation_steps=2)
    optimizer.build([variable])

    optimizer.apply([tf.constant([1.0, 2.0])], [variable])  # call 1: accumulate only
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(optimizer.accumulators[0].numpy(), [1.0, 2.0])
    assert _counters(optimizer) == (0, 1, 1)

    optimizer.apply([tf.constant([3.0, 0.0])], [variable])  # call 2: mean [2, 1], lr 0.5
    np.testing.assert_array_equal(variable.numpy(), [0.0, 1.5])
    np.testing.assert_array_equal(optimizer.accumulators[0].numpy(), [0.0, 0.0])
    assert _counters(optimizer) == (1, 2, 0)

    optimizer.apply([tf.constant([4.0, 4.0])], [variable])  # call 3: next cycle
    np.testing.assert_array_equal(variable.numpy(), [0.0, 1.5])
    np.testing.assert_array_equal(optimizer.accumulators[0].numpy(), [4.0, 4.0])
    assert _counters(optimizer) == (1, 3, 1)


def test_accumulating_optimizer_momentum_on_two_replicas_call_by_call(strategy2):
    # Replica r passes gradient (r + 1) * g: its share of the summed gradient 3 * g.
    with strategy2.scope():
        variable = keras.Variable([1.0])
        optimizer = AccumulatingOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), 2)
        optimizer.build([variable])

    call = _replica_shares_call(strategy2, optimizer, variable)

    call(tf.constant([1.0]))  # replicas hold 1 and 2
    assert float(variable.numpy()[0]) == 1.0
    assert float(optimizer.accumulators[0].numpy()[0]) == 3.0  # cross-replica read: SUM
    call(tf.constant([3.0]))  # sums 3 + 9 = 12, mean over k=2: 6; velocity -0.6
    np.testing.assert_allclose(variable.numpy(), [0.4], rtol=1e-6)
    assert _counters(optimizer) == (1, 2, 0)
    call(tf.constant([0.0]))
    call(tf.constant([0.0]))  # zero gradient: velocity 0.5 * -0.6 = -0.3
    np.testing.assert_allclose(variable.numpy(), [0.1], rtol=1e-5)
    assert _counters(optimizer) == (2, 4, 0)


# -- non-finite gradients -----------------------------------------------------------------


def test_skip_drops_a_nan_cycle_call_by_call():
    variable, optimizer = _sgd_wrapper(2, non_finite="skip")
    optimizer.apply([tf.constant([1.0, 2.0])], [variable])
    optimizer.apply([tf.constant([np.nan, 0.0])], [variable])  # cycle 1 ends non-finite
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(optimizer.accumulators[0].numpy(), [0.0, 0.0])
    assert _counters(optimizer) == (0, 2, 0) and int(optimizer.skipped_updates.numpy()) == 1
    optimizer.apply([tf.constant([1.0, 1.0])], [variable])
    optimizer.apply([tf.constant([3.0, 1.0])], [variable])  # mean [2, 1], lr 0.5
    np.testing.assert_array_equal(variable.numpy(), [0.0, 1.5])
    assert _counters(optimizer) == (1, 4, 0) and int(optimizer.skipped_updates.numpy()) == 1


def test_raise_keeps_the_cycle_for_inspection_until_discard():
    variable, optimizer = _sgd_wrapper(2)
    optimizer.apply([tf.constant([1.0, 2.0])], [variable])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"cycle of update\W+1\W+(b\W)?ending at micro-step\W+2\W"):
        optimizer.apply([tf.constant([np.inf, 0.0])], [variable])
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(optimizer.accumulators[0].numpy(), [np.inf, 2.0])
    assert _counters(optimizer) == (0, 2, 0) and int(optimizer.skipped_updates.numpy()) == 0
    optimizer.discard()
    np.testing.assert_array_equal(optimizer.accumulators[0].numpy(), [0.0, 0.0])
    optimizer.apply([tf.constant([1.0, 1.0])], [variable])
    optimizer.apply([tf.constant([3.0, 1.0])], [variable])
    np.testing.assert_array_equal(variable.numpy(), [0.0, 1.5])
