"""Keras' optimizer contract (keras/src/optimizers/optimizer_test.py), on AccumulatingOptimizer.

Each test names the Keras test it ports. With accumulation_steps=1 the wrapper behaves as
its inner optimizer; with k > 1 as Keras' built-in `gradient_accumulation_steps` on one
device, which equals big-batch training there, except where the built-in counts
micro-steps: EMA, learning-rate schedules and constraints act once per *update* here
(those tests say why). Two-replica ports of optimizer_distribute_test.py are in
test_keras_optimizer_contract_distributed.py (with the config round trips). The last
section holds behaviours the wrapper once lacked, each fixed in src/distgrad/optimizer.py
(the fix named in each test's docstring).
"""

import os
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras_contract import (
    KERAS_SWEEP,
    apply_calls,
    counters,
    means,
    random_calls,
    repeated,
    replicas,
    scope,
    variable,
    wrapped,
)

from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.compare import check_close, check_not_close, mirrored_copies_agree

ONES = np.ones((2, 2), "float32")
V0 = [[1.0, 2.0], [3.0, 4.0]]


@pytest.fixture(params=["one_device", "R2"])
def where(request):
    """No strategy, or the 2-replica MirroredStrategy."""
    return request.getfixturevalue("strategy2") if request.param == "R2" else None


# -- counters ----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_iterations_count_updates_and_total_micro_steps_count_calls(where, k):
    """Ports test_iterations_counter (k=1) and the counters of test_gradient_accumulation
    (k=3): the built-in's `iterations` is `_iterations // k`, its `_iterations` the calls;
    here `iterations` and `total_micro_steps`."""
    with scope(where):
        v = variable(V0)
        optimizer = wrapped(keras.optimizers.Adam(1.0), k)
    assert optimizer.iterations.numpy() == optimizer.total_micro_steps.numpy() == 0
    for n in range(1, 5):
        apply_calls(where, optimizer, [v], [[ONES]])
        assert counters(optimizer) == (n // k, n, n % k)


def test_accumulation_walkthrough_equals_keras_built_in_call_by_call():
    """Ports test_gradient_accumulation: SGD(1.0), k=3, gradient ones, Keras' hand values
    for the weights and the accumulated gradient after each call, and the built-in's."""
    v, builtin_v = variable(V0), variable(V0)
    optimizer = wrapped(keras.optimizers.SGD(1.0), 3)
    builtin = keras.optimizers.SGD(1.0, gradient_accumulation_steps=3)
    expected = [  # (weights, accumulated gradient) after calls 1..4, from Keras' test
        (V0, [[1.0, 1.0], [1.0, 1.0]]),
        (V0, [[2.0, 2.0], [2.0, 2.0]]),
        ([[0.0, 1.0], [2.0, 3.0]], [[0.0, 0.0], [0.0, 0.0]]),
        ([[0.0, 1.0], [2.0, 3.0]], [[1.0, 1.0], [1.0, 1.0]]),
    ]
    for weights, accumulated in expected:
        apply_calls(None, optimizer, [v], [[ONES]])
        apply_calls(None, builtin, [builtin_v], [[ONES]])
        check_close([v.numpy(), optimizer.accumulators[0].numpy()], [weights, accumulated])
        check_close([v.numpy(), optimizer.accumulators[0].numpy()],
                    [builtin_v.numpy(), builtin._accumulated_gradients[0].numpy()])


# -- None and empty gradients -----------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_no_gradient_raises_and_none_gradients_are_left_out(where, k):
    """Ports test_empty_gradients (its warning: test_none_gradients_warn_like_keras, below)."""
    with scope(where):
        v, v2 = variable([[3.0, 4.0], [5.0, 6.0]]), variable([[3.0, 4.0], [5.0, 6.0]])
        first, optimizer = (wrapped(keras.optimizers.SGD(1.0), k) for _ in range(2))
    with pytest.raises(ValueError, match="No gradients provided for any variable"):
        apply_calls(where, first, [v], [[None]])
    after = apply_calls(where, optimizer, [v, v2], [[None, ONES]] * k)[-1]
    check_close(after, [[[3.0, 4.0], [5.0, 6.0]],
                        np.subtract([[3.0, 4.0], [5.0, 6.0]], replicas(where))])
    assert counters(optimizer)[:2] == (1, k)
    optimizer.apply([], [])  # no gradients at all: a no-op, as in BaseOptimizer.apply
    assert counters(optimizer)[:2] == (1, k)


def test_keras_and_tf_variables_mixed_with_a_missing_gradient_still_update():
    """Ports test_mixed_with_tf_variables: a keras.Variable and a tf.Variable, then a call
    where the tf.Variable has no gradient: `iterations` counts both updates."""
    v, tf_v = variable(V0), tf.Variable(V0)
    optimizer = wrapped(keras.optimizers.Adam(1.0), 1)
    optimizer.apply_gradients([(tf.constant(ONES), v), (tf.constant(ONES), tf_v)])
    assert int(optimizer.iterations.numpy()) == 1
    optimizer.apply_gradients([(tf.constant(ONES), v), (None, tf_v)])
    assert int(optimizer.iterations.numpy()) == 2


# -- clipping ----------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["clipnorm", "clipvalue", "global_clipnorm"])
def test_clip_arguments_move_from_the_inner_optimizer_to_the_wrapper(option):
    """Ports test_clip_args. The wrapper clips (the accumulated, all-reduced gradient), so
    the inner optimizer must not clip again; its "only one of" check runs in its own
    constructor."""
    optimizer = wrapped(keras.optimizers.SGD(1.0, **{option: 0.1}), 2)
    assert getattr(optimizer, option) == 0.1
    assert getattr(optimizer.inner_optimizer, option) is None


@pytest.mark.parametrize("option, grad, expected", [
    ("clipnorm", [100.0, 100.0], [2**0.5 / 2, 2**0.5 / 2]),
    ("clipvalue", [100.0, 100.0], [1.0, 1.0]),
    ("global_clipnorm", [50.0, 100.0], np.array([50.0, 100.0]) / np.linalg.norm([50.0, 100.0])),
])
def test_clip_gradients_gives_keras_hand_values(where, option, grad, expected):
    """Ports test_clip_norm, test_clip_value, test_global_clip_norm (and the distribute
    test_clip_norm / test_clip_value, under the strategy's scope)."""
    with scope(where):
        optimizer = wrapped(keras.optimizers.SGD(**{option: 1}), 2)
        clipped = optimizer._clip_gradients([tf.constant(grad, tf.float32)])
    check_close([clipped[0].numpy()], [expected])


@pytest.mark.parametrize("option", ["clipnorm", "clipvalue", "global_clipnorm"])
def test_clipping_with_accumulation_equals_keras_built_in(option):
    """Ports the clip tests onto k=2: the built-in clips the mean of the k gradients
    (base_optimizer._backend_apply_gradients); so does the wrapper, on one device equal to
    clipping the big-batch gradient."""
    calls = random_calls(6, seed=1)
    v, builtin_v, big_v = variable(V0), variable(V0), variable(V0)
    apply_calls(None, wrapped(keras.optimizers.SGD(0.1, **{option: 0.5}), 2), [v], calls)
    apply_calls(None, keras.optimizers.SGD(0.1, gradient_accumulation_steps=2, **{option: 0.5}),
                [builtin_v], calls)
    apply_calls(None, keras.optimizers.SGD(0.1, **{option: 0.5}), [big_v], means(calls, 2))
    check_close([v.numpy()], [builtin_v.numpy()])
    check_close([v.numpy()], [big_v.numpy()])
    unclipped = variable(V0)
    apply_calls(None, keras.optimizers.SGD(0.1), [unclipped], means(calls, 2))
    check_not_close([v.numpy()], [unclipped.numpy()])  # the clipping was active


# -- EMA ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_ema_walkthrough_gives_keras_hand_values_per_update(k):
    """Ports test_ema: SGD(1.0), ema_momentum=0.9, ema_overwrite_frequency=3. With k=2 each
    gradient comes twice: the same values after each update."""
    v = variable([[3.0, 4.0], [5.0, 6.0]])
    optimizer = wrapped(keras.optimizers.SGD(1.0, use_ema=True, ema_momentum=0.9,
                                             ema_overwrite_frequency=3), k)
    expected = [  # (weights, moving average) after updates 1..3, from Keras' test
        ([[2.0, 3.0], [4.0, 5.0]], [[2.0, 3.0], [4.0, 5.0]]),
        ([[1.0, 2.0], [3.0, 4.0]], [[1.9, 2.9], [3.9, 4.9]]),
        ([[1.71, 2.71], [3.71, 4.71]], [[1.71, 2.71], [3.71, 4.71]]),  # overwritten
    ]

    def average():
        return optimizer.inner_optimizer._model_variables_moving_average[0].numpy()

    for weights, moving_average in expected:
        apply_calls(None, optimizer, [v], repeated([[ONES]], k))
        check_close([v.numpy(), average()], [weights, moving_average])


def test_ema_counts_updates_where_keras_built_in_counts_micro_steps():
    """Intentional difference (ports test_ema onto k=2). The built-in updates the moving
    average on every call, outside its accumulation cond
    (base_optimizer._backend_apply_gradients), so k times per update; the wrapper once per
    update, as big-batch training does."""
    calls = random_calls(6, seed=2)
    ema = {"use_ema": True, "ema_momentum": 0.9}
    runs = {}
    for name, optimizer, script in [
            ("wrapper", wrapped(keras.optimizers.SGD(0.1, **ema), 2), calls),
            ("big_batch", keras.optimizers.SGD(0.1, **ema), means(calls, 2)),
            ("builtin", keras.optimizers.SGD(0.1, gradient_accumulation_steps=2, **ema), calls)]:
        v = variable(V0)
        apply_calls(None, optimizer, [v], script)
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        runs[name] = [v.numpy(), inner._model_variables_moving_average[0].numpy()]
    check_close(runs["wrapper"], runs["big_batch"])
    check_close(runs["builtin"][:1], runs["big_batch"][:1])  # same weights ...
    check_not_close(runs["builtin"][1:], runs["big_batch"][1:])  # ... other average


def _fit_ema(strategy, k, rows, batch_size):
    with scope(strategy):
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(
            2, kernel_initializer="ones", use_bias=False)])
        optimizer = wrapped(keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9), k)
        model.compile(loss="mse", optimizer=optimizer)
    model.fit(np.ones((rows, 1), "float32"), np.zeros((rows, 2), "float32"),
              batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model, optimizer


@pytest.mark.parametrize("k", [1, 2])
def test_ema_with_model_fit_gives_keras_values(k):
    """Ports test_ema_with_model_fit: one update per epoch (k micro-batches of the same
    example), and fit's `finalize_variable_values` writes the average into the model."""
    model, optimizer = _fit_ema(None, k, rows=k, batch_size=1)
    average = optimizer.inner_optimizer._model_variables_moving_average[0].numpy()
    check_close([average, model.trainable_variables[0].numpy()], [[[0.891, 0.891]]] * 2)
    assert int(optimizer.iterations.numpy()) == 2


# -- constraints -------------------------------------------------------------------------


def test_constraints_are_applied(where):
    """Ports test_constraints_are_applied (k=1)."""
    with scope(where):
        v = variable(np.random.RandomState(0).random_sample((2, 2)) - 1.0,
                     constraint=keras.constraints.NonNeg())
        optimizer = wrapped(keras.optimizers.SGD(0.0001), 1)
    after = apply_calls(where, optimizer, [v], [[np.zeros((2, 2), "float32")]])[-1]
    assert after[0].min() == 0.0


def test_constraints_apply_with_the_update_not_on_accumulate_only_calls():
    """Intentional difference (ports test_constraints_are_applied onto k=2). The built-in
    applies constraints on every call (BaseOptimizer.apply does so after
    `_backend_apply_gradients` whether or not it updated), so a weight can move in the
    middle of a cycle; the wrapper leaves the weights alone until the update, so all k
    micro-batches are differentiated at the same weights, as in one big batch."""
    start = [[-1.0, 0.5], [-2.0, 3.0]]
    zeros = [[np.zeros((2, 2), "float32")]] * 2
    v, builtin_v = (variable(start, constraint=keras.constraints.NonNeg()) for _ in range(2))
    after = apply_calls(None, wrapped(keras.optimizers.SGD(0.0001), 2), [v], zeros)
    builtin_after = apply_calls(
        None, keras.optimizers.SGD(0.0001, gradient_accumulation_steps=2), [builtin_v], zeros)
    projected = [[0.0, 0.5], [0.0, 3.0]]
    check_close([after[0][0], after[1][0]], [start, projected])
    check_close([builtin_after[0][0], builtin_after[1][0]], [projected, projected])


# -- loss scaling, learning rates --------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_static_loss_scaling(where, k):
    """Ports test_static_loss_scaling: gradients 1024 times too large, loss_scale_factor
    1024 on the inner optimizer; `scale_loss` and `loss_scale_factor` read through. On R
    replicas the all-reduce adds R gradients."""
    with scope(where):
        v = variable(V0)
        optimizer = wrapped(keras.optimizers.SGD(1.0, loss_scale_factor=1024.0), k)
    scaled = np.float32(1024.0) * np.asarray(V0, "float32")
    after = apply_calls(where, optimizer, [v], [[scaled]] * k)
    check_close(after[-1], [np.asarray(V0) * (1 - replicas(where))])
    assert optimizer.scale_loss(1.0) == 1024.0
    assert optimizer.loss_scale_factor == 1024.0


@pytest.mark.parametrize("k", [1, 2])
def test_callable_learning_rate(where, k):
    """Ports test_callable_learning_rate."""
    with scope(where):
        v = variable(V0)
        optimizer = wrapped(keras.optimizers.SGD(learning_rate=lambda: 0.1), k)
    assert int(optimizer.iterations.numpy()) == 0
    after = apply_calls(where, optimizer, [v], [[ONES]] * k)
    check_close(after[-1], [np.asarray(V0) - 0.1 * replicas(where)])
    assert int(optimizer.iterations.numpy()) == 1


def test_setting_the_learning_rate_to_a_schedule_untracks_the_inner_variable():
    """Ports test_setting_lr_to_callable_untracks_lr_var: the wrapper's learning_rate is
    the inner optimizer's, so its variables lose the learning-rate variable too."""
    optimizer = wrapped(keras.optimizers.Adam(learning_rate=0.001), 2)
    before = len(optimizer.variables)
    optimizer.learning_rate = keras.optimizers.schedules.PolynomialDecay(0.001, 4)
    assert len(optimizer.variables) == before - 1
    assert len(optimizer.inner_optimizer.variables) == 1


def test_learning_rate_schedule_counts_updates_where_keras_built_in_counts_micro_steps():
    """Intentional difference. Keras documents that with gradient_accumulation_steps
    "learning rate schedules will look at 'real' iterations value (optimizer steps)", i.e.
    micro-steps; the wrapper's schedule reads the inner `iterations` (updates), as in
    big-batch training."""
    def schedule():  # 0.1 for updates 0 and 1, then 0.01
        return keras.optimizers.schedules.PiecewiseConstantDecay([1], [0.1, 0.01])

    calls = random_calls(4, seed=3)
    v, builtin_v, big_v = variable(V0), variable(V0), variable(V0)
    apply_calls(None, wrapped(keras.optimizers.SGD(schedule()), 2), [v], calls)
    apply_calls(None, keras.optimizers.SGD(schedule(), gradient_accumulation_steps=2),
                [builtin_v], calls)
    apply_calls(None, keras.optimizers.SGD(schedule()), [big_v], means(calls, 2))
    check_close([v.numpy()], [big_v.numpy()])
    check_not_close([builtin_v.numpy()], [big_v.numpy()])


# -- overwrite_with_gradient (float8 training's scales and amax histories) ---------------


def test_overwrite_with_gradient(where):
    """Ports test_overwrite_with_gradient (k=1): `v` takes its gradient as its value, `v2`
    is updated normally. (The gradient is not all-reduced: each replica assigns its own,
    as the plain optimizer does.)"""
    with scope(where):
        v, v2 = variable(V0, overwrite_with_gradient=True), variable(V0)
        optimizer = wrapped(keras.optimizers.SGD(1.0), 1)
    after = apply_calls(where, optimizer, [v, v2], [[ONES, ONES]])[-1]
    check_close(after, [ONES, np.asarray(V0) - replicas(where)])


# -- every optimizer Keras sweeps --------------------------------------------------------


@pytest.mark.parametrize("name", KERAS_SWEEP)
def test_accumulation_with_weight_decay_equals_mean_gradient_steps(name):
    """Ports test_gradient_accumulation_with_weigth_decay: k=3 micro-steps with weight
    decay 0.05 equal one step on their mean gradient, and the built-in."""
    def make(**extra):
        return keras.optimizers.get({"class_name": name,
                                     "config": {"weight_decay": 0.05, **extra}})

    calls = random_calls(12, shape=(2, 1), seed=4)
    v, builtin_v, big_v = (variable([[0.9], [0.5]]) for _ in range(3))
    apply_calls(None, wrapped(make(), 3), [v], calls)
    apply_calls(None, make(gradient_accumulation_steps=3), [builtin_v], calls)
    apply_calls(None, make(), [big_v], means(calls, 3))
    check_close([v.numpy()], [big_v.numpy()])
    check_close([v.numpy()], [builtin_v.numpy()])


@pytest.mark.parametrize("name", KERAS_SWEEP)
def test_pickled_wrapper_keeps_its_config(name):
    """Ports test_pickleable_optimizers (like Keras, pickling keeps the config, not the
    optimizer's variables)."""
    optimizer = wrapped(keras.optimizers.get(name), 3)
    reloaded = pickle.loads(pickle.dumps(optimizer))
    assert isinstance(reloaded, AccumulatingOptimizer)
    assert reloaded.get_config() == optimizer.get_config()


# -- state -------------------------------------------------------------------------------


def test_set_weights_needs_a_built_optimizer():
    """Ports the first half of test_set_weights (the round trip:
    test_set_weights_round_trip_sets_the_inner_state_too, below)."""
    with pytest.raises(ValueError, match="You are calling"):
        wrapped(keras.optimizers.Adam(), 2).set_weights([np.zeros(())])


def test_own_variables_round_trip_restores_the_wrapper_and_the_inner_state():
    """The `variables` round trip `model.save` uses (save_own_variables /
    load_own_variables), mid-cycle: counters, accumulators and Adam's moments."""
    x, y = variable(V0), variable(V0)
    source = wrapped(keras.optimizers.Adam(), 2)
    apply_calls(None, source, [x], random_calls(3, seed=5))
    store = {}
    source.save_own_variables(store)
    target = wrapped(keras.optimizers.Adam(), 2)
    target.build([y])
    target.load_own_variables(store)
    check_close([t.numpy() for t in target.variables], [s.numpy() for s in source.variables])
    assert counters(target) == (1, 3, 1)


@pytest.mark.parametrize("k", [1, 2])
def test_tf_train_checkpoint_restores_predictions_and_the_cycle(tmp_path, k):
    """Ports test_tf_checkpointing, saved after one train_on_batch call: for k=2 in the
    middle of a cycle. Training on after the restore repeats the same update (the
    accumulated micro-batch was restored with the weights)."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    optimizer = wrapped(keras.optimizers.Adam(), k)
    model.compile(optimizer, "mse")
    x, y = np.random.RandomState(6).random_sample((2, 1, 2))

    def predict():
        return [model.predict(x, verbose=0)]

    model.train_on_batch(x, y)
    reference = predict()
    checkpoint = tf.train.Checkpoint(model, optimizer=optimizer)
    saved = checkpoint.save(os.fspath(tmp_path / "tf_ckpt"))
    model.train_on_batch(x, y)  # for k=2: completes the first update
    trained_on = predict()
    check_not_close(trained_on, reference)
    checkpoint.restore(saved)
    check_close(predict(), reference)
    assert counters(optimizer) == (1 // k, 1, 1 % k)
    model.train_on_batch(x, y)
    check_close(predict(), trained_on)


# -- behaviours once missing, fixed -----------------------------------------------------

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
    `inner_update.clip_across_replicas`). Fix: leave them out of it."""
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
