"""Hand-computed values, call by call (the style of Keras' `optimizer_test.py`).

Each public class on numbers small enough to check on paper: weights, counters and
buffers after call 1, 2, 3. The equivalence sweeps elsewhere compare against big-batch
training; these pin the arithmetic itself.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from distgrad.accumulator import GradientAccumulator
from distgrad.optimizer import AccumulatingOptimizer
from distgrad.train_step import MicroBatchingModel


def _counters(optimizer):
    return (int(optimizer.iterations.numpy()), int(optimizer.total_micro_steps.numpy()),
            int(optimizer.micro_steps.numpy()))


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


def _replica_shares_call(strategy, optimizer, variable):
    """`call(g)`: one `optimizer.apply` in which replica r passes gradient (r + 1) * g."""
    @tf.function
    def call(g):
        def replica_fn():
            r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            optimizer.apply([(r + 1.0) * g], [variable])
        strategy.run(replica_fn)

    return call


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


def test_micro_batching_fit_call_by_call():
    # loss = mean((w x)^2) over x = 1..4; dloss/dw = 2 w mean(x^2) = 15 w. With k = 2
    # slices: (2 w (1 + 4) / 2 + 2 w (9 + 16) / 2) / 2 = 15 w, the same.
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(inputs)
    model = MicroBatchingModel(inputs, outputs, accumulation_steps=2)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.array([[1.0], [2.0], [3.0], [4.0]], "float32")
    history = model.fit(x, np.zeros_like(x), batch_size=4, epochs=2, shuffle=False, verbose=0)
    # step 1: w = 1 - 0.1 * 15 = -0.5; step 2: w = -0.5 - 0.1 * 15 * -0.5 = 0.25
    np.testing.assert_allclose(model.get_weights()[0], [[0.25]], rtol=1e-6)
    np.testing.assert_allclose(history.history["loss"], [7.5, 1.875], rtol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 2


# -- non-finite gradients and epoch ends ---------------------------------------------------


def _sgd_wrapper(k, **kwargs):
    variable = keras.Variable([1.0, 2.0])
    optimizer = AccumulatingOptimizer(keras.optimizers.SGD(0.5), accumulation_steps=k, **kwargs)
    optimizer.build([variable])
    return variable, optimizer


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


def test_micro_batching_skip_call_by_call():
    # Two steps on x = 1..4: the first has a NaN target and is skipped, the second is the
    # step of test_micro_batching_fit_call_by_call: w = 1 - 0.1 * 15 * 1 = -0.5.
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(inputs)
    model = MicroBatchingModel(inputs, outputs, accumulation_steps=2, non_finite="skip")
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.array([[1.0], [2.0], [3.0], [4.0]] * 2, "float32")
    y = np.zeros_like(x)
    y[0] = np.nan
    history = model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    np.testing.assert_allclose(model.get_weights()[0], [[-0.5]], rtol=1e-6)
    assert history.history["skipped_updates"] == [1]
    assert int(model.optimizer.iterations.numpy()) == 1
