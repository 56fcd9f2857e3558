"""An incomplete cycle's `flush` and `discard` (what `AccumulationCallback` calls at an
epoch's end) on hand-computed values: `flush` applies the mean of the micro-batches seen,
dividing by the micro-steps seen on one device and on two replicas; `discard` drops them,
and a `flush` with nothing pending applies nothing.
"""

import keras
import numpy as np
import tensorflow as tf
from call_by_call import _counters, _replica_shares_call, _sgd_wrapper

from distgrad.optimizer import AccumulatingOptimizer


def test_flush_applies_the_mean_of_the_micro_batches_seen_and_discard_drops_them():
    variable, optimizer = _sgd_wrapper(3)
    optimizer.apply([tf.constant([1.0, 2.0])], [variable])
    optimizer.apply([tf.constant([3.0, 0.0])], [variable])
    optimizer.flush()  # mean of 2 micro-batches [2, 1]: v - 0.5 * [2, 1]
    np.testing.assert_array_equal(variable.numpy(), [0.0, 1.5])
    assert _counters(optimizer) == (1, 2, 0)
    optimizer.apply([tf.constant([4.0, 4.0])], [variable])  # a new cycle starts
    np.testing.assert_array_equal(optimizer.accumulators[0].numpy(), [4.0, 4.0])
    optimizer.discard()
    np.testing.assert_array_equal(optimizer.accumulators[0].numpy(), [0.0, 0.0])
    assert _counters(optimizer) == (1, 3, 0)
    optimizer.flush()  # nothing pending
    np.testing.assert_array_equal(variable.numpy(), [0.0, 1.5])


def test_flush_on_two_replicas_divides_by_the_micro_steps_seen(strategy2):
    with strategy2.scope():
        variable = keras.Variable([1.0])
        optimizer = AccumulatingOptimizer(keras.optimizers.SGD(0.1), 3)
        optimizer.build([variable])

    call = _replica_shares_call(strategy2, optimizer, variable)

    call(tf.constant([1.0]))  # shares 1 and 2: sum 3
    call(tf.constant([3.0]))  # shares 3 and 6: sum 12 over both micro-steps
    optimizer.flush()  # mean over 2 micro-steps: 6; v = 1 - 0.1 * 6
    np.testing.assert_allclose(variable.numpy(), [0.4], rtol=1e-6)
    assert _counters(optimizer) == (1, 2, 0)
