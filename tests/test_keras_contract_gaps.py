"""Keras optimizer behaviours AccumulatingOptimizer once lacked, each now fixed in
src/distgrad/optimizer.py (the fix named in each test's docstring): these tests keep them.

Ported, like test_keras_optimizer_contract.py, from keras/src/optimizers/optimizer_test.py
and keras/src/backend/tensorflow/optimizer_distribute_test.py; the reference is the plain
inner optimizer (k=1), Keras' built-in `gradient_accumulation_steps` on one device (k > 1),
or big-batch training.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras_contract import apply_calls, scope, variable, wrapped

from distgrad_course.lab.compare import check_close, mirrored_copies_agree

ONES = np.ones((2, 2), "float32")
V0 = [[1.0, 2.0], [3.0, 4.0]]


@pytest.fixture(params=["one_device", "R2"])
def where(request):
    return request.getfixturevalue("strategy2") if request.param == "R2" else None


def test_none_gradients_warn_like_keras():
    """Ports the warning of test_empty_gradients / test_mixed_with_tf_variables: Keras
    warns "Gradients do not exist for variables [...]" (often a forgotten `loss`); the
    wrapper drops the None pairs before its inner optimizer could see them, silently.
    Fix: `apply` filters with `self._filter_empty_gradients` (BaseOptimizer's)."""
    v, v2 = variable(V0), variable(V0)
    optimizer = wrapped(keras.optimizers.SGD(1.0), 1)
    with pytest.warns(UserWarning, match="Gradients do not exist for variables"):
        optimizer.apply_gradients([(None, v), (tf.constant(ONES), v2)])


def test_set_weights_round_trip_sets_the_inner_state_too():
    """Ports test_set_weights: `set_weights(other.variables)` must give every variable
    of `other`. BaseOptimizer.set_weights zips `self._variables` (the wrapper's own) with
    the list, so the inner optimizer's (Adam's moments, its iterations) are skipped.
    Fix: AccumulatingOptimizer.set_weights over `self.variables`."""
    x = variable(V0)
    source = wrapped(keras.optimizers.Adam(), 2)
    apply_calls(None, source, [x], [[np.asarray(V0, "float32")]] * 3)
    target = wrapped(keras.optimizers.Adam(), 2)
    target.build([x])
    target.set_weights(source.variables)
    check_close([t.numpy() for t in target.variables], [s.numpy() for s in source.variables])


def test_exclude_from_weight_decay_on_the_wrapper_reaches_the_inner_optimizer(strategy2):
    """Ports test_weight_decay: `optimizer.exclude_from_weight_decay(...)` on the compiled
    optimizer (what a user holds) sets the wrapper's own, unused, exclusions; the inner
    optimizer decays the excluded variables. Fix: forward it to the inner optimizer."""
    zeros = np.zeros((), "float32")
    with strategy2.scope():
        var1, var2, var3 = variable(2.0), keras.Variable(3.0, name="exclude"), variable(4.0)
        by_name, by_variable = (wrapped(keras.optimizers.SGD(1.0, weight_decay=0.004), 1)
                                for _ in range(2))
    by_name.exclude_from_weight_decay(var_names=["exclude"])
    by_variable.exclude_from_weight_decay(var_list=[var3])
    apply_calls(strategy2, by_name, [var1, var2], [[zeros, zeros]])
    apply_calls(strategy2, by_variable, [var1, var3], [[zeros, zeros]])
    check_close([var1.numpy(), var2.numpy(), var3.numpy()], [2.0 * 0.996**2, 3.0, 4.0])


def test_an_overwritten_variable_takes_each_update_s_gradient_not_their_running_sum():
    """Ports test_overwrite_with_gradient over two updates (k=1, no strategy). Without
    merge_call `_apply_accumulated` rebinds `variables` to the list
    `_overwrite_variables_directly_with_gradients` returns, without the overwritten
    variables, then resets only those accumulators: the overwritten variable's keeps
    growing (5, then 5 + 7). Fix: reset the accumulators of the unfiltered list."""
    v, v2 = variable([1.0, 1.0], overwrite_with_gradient=True), variable([1.0, 1.0])
    optimizer = wrapped(keras.optimizers.SGD(1.0), 1)
    after = apply_calls(None, optimizer, [v, v2],
                        [[np.full(2, 5.0, "float32")] * 2, [np.full(2, 7.0, "float32")] * 2])
    check_close(after[-1], [[7.0, 7.0], [-11.0, -11.0]])


def test_overwrite_with_gradient_with_accumulation_takes_the_cycle_s_maximum():
    """Ports test_overwrite_with_gradient_with_gradient_accumulation: with k=2 the
    built-in gives an overwritten variable the elementwise *maximum* of the cycle's
    gradients (float8 amax histories are maxima: the big batch's amax is the largest of
    its micro-batches'); the wrapper gives their mean (1.5 instead of 2). Fix: accumulate
    `overwrite_with_gradient` variables with `maximum`, not divided by k, and unclipped."""
    v, v2 = variable(V0, overwrite_with_gradient=True), variable(V0)
    optimizer = wrapped(keras.optimizers.SGD(1.0), 2)
    expected = [  # (v, v2) after calls 1..3, from Keras' test
        (V0, V0),
        ([[2.0, 2.0], [2.0, 2.0]], [[-0.5, 0.5], [1.5, 2.5]]),
        ([[2.0, 2.0], [2.0, 2.0]], [[-0.5, 0.5], [1.5, 2.5]]),
    ]
    for grad, values in zip([ONES, 2 * ONES, ONES], expected):
        check_close(apply_calls(None, optimizer, [v, v2], [[grad, grad]])[-1], values)


def test_overwritten_variables_are_not_clipped(where):
    """Ports test_overwrite_with_gradient with clipping on: Keras takes the overwritten
    variables out before clipping (BaseOptimizer.apply); the wrapper clips them with the
    rest (v = 0.5 instead of 1; on 2 replicas replica 1 even gets 0, the zeros of
    `_clip_across_replicas`). Fix: leave them out of `_clip_across_replicas`."""
    with scope(where):
        v, v2 = variable(V0, overwrite_with_gradient=True), variable(V0)
        optimizer = wrapped(keras.optimizers.SGD(1.0, clipvalue=0.5), 1)
    after = apply_calls(where, optimizer, [v, v2], [[ONES, ONES]])[-1]
    check_close(after, [ONES, np.asarray(V0) - 0.5])
    assert mirrored_copies_agree([v, v2])


def test_overwritten_variables_take_the_maximum_over_replicas_too(strategy2):
    """Beyond Keras (whose plain optimizer leaves each replica's copy at its own value):
    on R replicas big-batch training gives an amax the maximum over all R * k
    micro-batches, the same on every copy. Replica r sends 1 + r + call: after the update
    every copy holds 3. Fix: in `_apply_accumulated`, all-reduce the maxima (ReduceOp.MAX)
    before the inner update (one more all-reduce, only with such variables)."""
    with strategy2.scope():
        v, v2 = variable(V0, overwrite_with_gradient=True), variable(V0)
        optimizer = wrapped(keras.optimizers.SGD(1.0), 2)

    def step(call):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        grad = (1.0 + tf.cast(replica, tf.float32) + call) * tf.ones((2, 2))
        optimizer.apply_gradients([(grad, v), (grad, v2)])

    for call in (0.0, 1.0):
        strategy2.run(step, args=(call,))
    assert mirrored_copies_agree([v, v2])
    check_close([v.numpy()], [3 * ONES])


def _float8_fit(optimizer, batch_size):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.quantize("float8")  # adds scales and amax histories: overwrite_with_gradient
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.RandomState(0)
    x, y = rng.randn(8, 4).astype("float32"), rng.randn(8, 3).astype("float32")
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return [w.numpy() for w in model.trainable_variables]


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize` method")
def test_float8_training_in_fit_equals_the_inner_optimizer():
    """`overwrite_with_gradient` as float8 training uses it (Dense.quantize("float8")), k=1:
    the same weights, scales and amax histories as the plain optimizer. Fails by the
    accumulator reset above."""
    check_close(_float8_fit(wrapped(keras.optimizers.Adam(0.01), 1), 2),
                _float8_fit(keras.optimizers.Adam(0.01), 2))


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize` method")
def test_float8_training_with_accumulation_equals_keras_built_in():
    """k=2 float8 training in fit equals the built-in's (which keeps the cycle's maximum).
    Fails by the mean-instead-of-maximum accumulation above."""
    check_close(_float8_fit(wrapped(keras.optimizers.Adam(0.01), 2), 2),
                _float8_fit(keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), 2))


@pytest.mark.filterwarnings("ignore:Gradients do not exist for variables")
def test_a_gradient_missing_at_the_update_does_not_leak_into_the_next_cycle():
    """A variable with a gradient on the first micro-step of a cycle but None on the one
    that completes it is not updated (as with the built-in), but the wrapper keeps its
    accumulator, so the next cycle's update of it adds a stale gradient (a -> -0.5, not
    0). The built-in zeroes every accumulator at each update. Fix: `_apply_accumulated`
    (and the skip branch) zero all accumulators, not only this call's variables'."""
    calls = [[ONES, ONES], [None, ONES], [ONES, ONES], [ONES, ONES]]
    a, b, builtin_a, builtin_b = (variable(V0) for _ in range(4))
    optimizer = wrapped(keras.optimizers.SGD(1.0), 2)
    builtin = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    after = apply_calls(None, optimizer, [a, b], calls)
    builtin_after = apply_calls(None, builtin, [builtin_a, builtin_b], calls)
    check_close([after[1][0], after[3][0]], [builtin_after[1][0], builtin_after[3][0]])
    check_close([np.asarray(V0) - 1.0], [after[3][0]])
    check_close([acc.numpy() for acc in optimizer.accumulators], [np.zeros((2, 2))] * 2)
