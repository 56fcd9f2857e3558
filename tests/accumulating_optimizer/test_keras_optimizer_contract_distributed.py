"""Keras' distributed optimizer tests (keras/src/backend/tensorflow/optimizer_distribute_test.py)
on AccumulatingOptimizer, on the 2-replica MirroredStrategy of conftest.

Each test names the Keras test it ports. Here every replica makes its own gradient
tensors (keras_contract.apply_calls), as in a training step, so the all-reduce adds R = 2
of them and the hand values are those of a doubled gradient. (Keras' test_ema hands one
tensor made outside `strategy.run` straight to the all-reduce, which eager
MirroredStrategy then does not sum: its expected values are one device's.) Beside
test_config: optimizer_test.py's naming and `get` tests, on one device.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras_contract import apply_calls, repeated, variable, wrapped

from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.compare import check_close, mirrored_copies_agree

R = 2


def test_config_round_trip_under_the_strategy(strategy2):
    """Ports test_config (Keras' run_class_serialization_test): get_config / from_config
    and serialize / deserialize reproduce the config (as JSON) and the attributes."""
    with strategy2.scope():
        optimizer = wrapped(keras.optimizers.SGD(
            learning_rate=0.5, momentum=0.06, nesterov=True, weight_decay=0.004), 3)
    config = json.dumps(optimizer.get_config())
    revived = AccumulatingOptimizer.from_config(json.loads(config))
    deserialized = keras.saving.deserialize_keras_object(
        json.loads(json.dumps(keras.saving.serialize_keras_object(optimizer))))
    for other in (revived, deserialized):
        assert json.dumps(other.get_config()) == config
        assert set(dir(other)) == set(dir(optimizer))


def test_config_round_trip_and_names():
    """Ports test_optimizer_auto_naming and test_get_method: automatic and explicit names
    survive serialization; `keras.optimizers.get` revives the wrapper from its config."""
    first, second = wrapped(keras.optimizers.SGD(), 2), wrapped(keras.optimizers.SGD(), 2)
    assert first.name.startswith("accumulating_optimizer") and first.name != second.name
    custom = wrapped(keras.optimizers.SGD(), 2, name="my_accumulator")
    for optimizer in (second, custom):
        revived = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
        assert revived.name == optimizer.name
    revived = keras.optimizers.get(keras.optimizers.serialize(custom))
    assert isinstance(revived, AccumulatingOptimizer)
    assert revived.get_config() == custom.get_config()


@pytest.mark.parametrize("k", [1, 2])
def test_single_step_on_a_tf_variable(strategy2, k):
    """Ports test_single_step (keras_sgd): SGD(0.5, momentum=0.06) on a tf.Variable; the
    gradient [1, 6, 7, 2] on both replicas is summed, as in Keras' expected values."""
    with strategy2.scope():
        optimizer = wrapped(keras.optimizers.SGD(learning_rate=0.5, momentum=0.06), k)
        v = tf.Variable([1.0, 2.0, 3.0, 4.0])
    apply_calls(strategy2, optimizer, [v], [[np.array([1.0, 6.0, 7.0, 2.0], "float32")]] * k)
    check_close([v.numpy()], [[0.0, -4.0, -4.0, 2.0]])


def test_weight_decay_with_exclusions_set_on_the_inner_optimizer(strategy2):
    """Ports test_weight_decay, the exclusions given to the inner optimizer, which applies
    the decay (`exclude_from_weight_decay` on the wrapper: test_keras_optimizer_contract.py).
    Zero gradients isolate the decay: three optimizers decay var1, none var2 and var3."""
    zeros = np.zeros((), "float32")
    with strategy2.scope():
        var1, var2, var3 = variable(2.0), keras.Variable(3.0, name="exclude"), variable(4.0)
        optimizers = [wrapped(keras.optimizers.SGD(1.0, weight_decay=0.004), 1)
                      for _ in range(3)]
    optimizers[1].inner_optimizer.exclude_from_weight_decay(var_names=["exclude"])
    optimizers[2].inner_optimizer.exclude_from_weight_decay(var_list=[var3])
    apply_calls(strategy2, optimizers[0], [var1], [[zeros]])
    apply_calls(strategy2, optimizers[1], [var1, var2], [[zeros, zeros]])
    apply_calls(strategy2, optimizers[2], [var1, var3], [[zeros, zeros]])
    check_close([var1.numpy(), var2.numpy(), var3.numpy()], [1.9760959, 3.0, 4.0])


@pytest.mark.parametrize("k", [1, 2])
def test_correctness_with_golden(strategy2, k):
    """Ports test_correctness_with_golden: SGD(nesterov=True), one step on
    arange(0.1, 1.1, 0.1), then steps on 0.01, at Keras' golden values (rounded to 4
    decimals there, hence their rtol/atol 5e-4); and exactly the plain SGD's."""
    golden = np.array([
        [0.9980, 0.9960, 0.9940, 0.9920, 0.9900, 0.9880, 0.9860, 0.9840, 0.9820, 0.9800],
        [0.9978, 0.9958, 0.9938, 0.9918, 0.9898, 0.9878, 0.9858, 0.9838, 0.9818, 0.9798],
        [0.9976, 0.9956, 0.9936, 0.9916, 0.9896, 0.9876, 0.9856, 0.9836, 0.9816, 0.9796],
        [0.9974, 0.9954, 0.9934, 0.9914, 0.9894, 0.9874, 0.9854, 0.9834, 0.9814, 0.9794],
        [0.9972, 0.9952, 0.9932, 0.9912, 0.9892, 0.9872, 0.9852, 0.9832, 0.9812, 0.9792],
    ])
    calls = [[np.arange(0.1, 1.1, 0.1, dtype="float32")]]
    calls += [[np.full((10,), 0.01, "float32")]] * 4
    with strategy2.scope():
        x, plain_x = variable(np.ones([10])), variable(np.ones([10]))
        optimizer = wrapped(keras.optimizers.SGD(nesterov=True), k)
        plain = keras.optimizers.SGD(nesterov=True)
    after = apply_calls(strategy2, optimizer, [x], repeated(calls, k))[k - 1::k]
    plain_after = apply_calls(strategy2, plain, [plain_x], calls)
    for values, plain_values, expected in zip(after, plain_after, golden):
        np.testing.assert_allclose(values[0], expected, rtol=5e-4, atol=5e-4)
        check_close(values, plain_values)


def test_stateless_apply_is_not_supported():
    """Ports test_stateless_not_supported."""
    v = variable([1.0, 2.0, 3.0, 4.0])
    optimizer = wrapped(keras.optimizers.SGD(learning_rate=0.5), 2)
    optimizer.build([v])
    with pytest.raises(ValueError, match="not supported"):
        optimizer.stateless_apply(optimizer.variables, [np.array([1.0, 6.0, 7.0, 2.0])], [v])


@pytest.mark.parametrize("k", [1, 2])
def test_ema_on_two_replicas(strategy2, k):
    """Ports test_ema: SGD(1.0), ema_momentum=0.9, overwrite every 3 updates. The summed
    gradient is 2: weights 3 -> 1 -> -1 -> -3, average 1 -> 0.8 -> 0.42, written into the
    weights at update 3; the same as the plain SGD, for k=2 once per update."""
    def sgd():
        return keras.optimizers.SGD(1.0, use_ema=True, ema_momentum=0.9,
                                    ema_overwrite_frequency=3)

    with strategy2.scope():
        v, plain_v = variable([[3.0, 4.0], [5.0, 6.0]]), variable([[3.0, 4.0], [5.0, 6.0]])
        optimizer, plain = wrapped(sgd(), k), sgd()
    ones = [[np.ones((2, 2), "float32")]]
    base = np.array([[0.0, 1.0], [2.0, 3.0]])
    expected = [(base + 1.0, base + 1.0), (base - 1.0, base + 0.8), (base + 0.42, base + 0.42)]
    for weights, average in expected:
        apply_calls(strategy2, optimizer, [v], repeated(ones, k))
        apply_calls(strategy2, plain, [plain_v], ones)
        moving_average = optimizer.inner_optimizer._model_variables_moving_average[0]
        check_close([v.numpy(), moving_average.numpy()], [weights, average])
        check_close([v.numpy(), moving_average.numpy()],
                    [plain_v.numpy(), plain._model_variables_moving_average[0].numpy()])
    assert mirrored_copies_agree([v, moving_average])


def test_ema_with_model_fit_on_two_replicas(strategy2):
    """Ports test_ema_with_model_fit onto 2 replicas and k=2: global batches of 2 rows,
    two per update, one update per epoch; the same 0.891 as on one device."""
    with strategy2.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(
            2, kernel_initializer="ones", use_bias=False)])
        optimizer = wrapped(keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9), 2)
        model.compile(loss="mse", optimizer=optimizer)
    model.fit(np.ones((4, 1), "float32"), np.zeros((4, 2), "float32"), batch_size=2,
              epochs=2, shuffle=False, verbose=0)
    average = optimizer.inner_optimizer._model_variables_moving_average[0]
    check_close([average.numpy(), model.trainable_variables[0].numpy()], [[[0.891, 0.891]]] * 2)
    assert int(optimizer.iterations.numpy()) == 2
    assert mirrored_copies_agree(model.trainable_variables)


def test_gradient_accumulation_on_two_replicas(strategy2):
    """Ports test_gradient_accumulation (distributed): SGD(1.0), k=3, gradient
    [[1, 1], [2, 2]] per replica: weights [[-1, 0], [-1, 0]] after 3 calls.

    Intentional difference in what the accumulator reads: the built-in keeps a mirrored
    variable whose copies each hold their replica's sum (reading one gives replica 0's);
    the wrapper's accumulators are ON_READ SUM, so reading one gives the sum over
    replicas (what a checkpoint holds), each copy holding its replica's part."""
    grads = np.array([[1.0, 1.0], [2.0, 2.0]], "float32")
    with strategy2.scope():
        v = variable([[1.0, 2.0], [3.0, 4.0]])
        optimizer = wrapped(keras.optimizers.SGD(1.0), 3)
    for n, weights in [(1, [[1.0, 2.0], [3.0, 4.0]]), (2, [[1.0, 2.0], [3.0, 4.0]]),
                       (3, [[-1.0, 0.0], [-1.0, 0.0]])]:
        after = apply_calls(strategy2, optimizer, [v], [[grads]])
        check_close(after[-1], [weights])
        accumulator = optimizer.accumulators[0]
        local = (n % 3) * grads
        check_close([np.asarray(c) for c in accumulator.value.values], [local, local])
        check_close([accumulator.numpy()], [R * local])
        assert optimizer.total_micro_steps.numpy() == n
        assert optimizer.iterations.numpy() == n // 3


def test_clipping_acts_on_the_summed_gradient_not_on_each_replica(strategy2):
    """Intentional difference (ports test_clip_norm onto 2 replicas): Keras clips each
    replica's gradient before its all-reduce, so the update's norm can reach R * clipnorm;
    the wrapper clips the all-reduced gradient, as one device clips the big batch's."""
    grad = [[np.array([100.0, 100.0], "float32")]]
    with strategy2.scope():
        v, plain_v = variable([0.0, 0.0]), variable([0.0, 0.0])
        optimizer = wrapped(keras.optimizers.SGD(1.0, clipnorm=1.0), 1)
        plain = keras.optimizers.SGD(1.0, clipnorm=1.0)
    apply_calls(strategy2, optimizer, [v], grad)
    apply_calls(strategy2, plain, [plain_v], grad)
    check_close([v.numpy(), plain_v.numpy()], [[-(2**0.5) / 2] * 2, [-(2**0.5)] * 2])
