"""Lesson 04's fix: distgrad.AccumulatingOptimizer under mixed_float16 in model.fit.

AllReplicasFiniteLossScaleOptimizer(AccumulatingOptimizer(inner)): the wrapper unscales
each micro-batch with its own loss scale before it is accumulated (float32), and skips a
micro-batch that overflowed on any replica, halving the scale. Keras' own wrapper (the
one compile adds) checks replica 0 only and counts no skip: AccumulatingOptimizer refuses
it in `build`, before any weight moves, with the fix first.
"""

import contextlib
import functools
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
from distgrad.optimizer import STOCK_WRAPPER_MESSAGE, AccumulatingOptimizer
from distgrad_course.lab import mixed
from distgrad_course.lab.compare import OPTIMIZERS, check_not_close, weights_of
from distgrad_course.lab.data import tiny_model
from distgrad_course.lab.mixed import (
    check_float16_apart,
    check_float16_close,
    mixed_precision_fit,
    overflow_data,
)
from distgrad_course.pitfalls import loss_scale_patch as lsp

# Each replica sums 8 examples in float16 in the big batch (2 micro-batches of 4 per replica).
BIG_BATCH_PER_REPLICA = 8
C = mixed.CONTROLLED_INITIAL_SCALE


@pytest.fixture(autouse=True)
def float32_policy_afterwards():
    yield
    assert keras.mixed_precision.global_policy().name == "float32"
    keras.mixed_precision.set_global_policy("float32")


def data(strategy, micro_batches=8, overflow_step=None, overflow_replicas=None):
    replicas = strategy.num_replicas_in_sync
    micro_batch = 4 * replicas
    x, y = overflow_data(micro_batches, micro_batch, overflow_step, replicas,
                             overflow_replicas)
    return x, y, micro_batch


def under_keras_own_wrapper(strategy, explicit, make_model=tiny_model, **wrapper_kwargs):
    """A model compiled with an AccumulatingOptimizer (k = 2) in Keras' own
    LossScaleOptimizer: the one `compile` adds, or one the user adds (`explicit`)."""
    with mixed.mixed_precision_policy(), (strategy.scope() if strategy else
                                          contextlib.nullcontext()):
        model = make_model()
        optimizer = AccumulatingOptimizer(keras.optimizers.SGD(0.1), 2)
        if explicit:
            optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer, **wrapper_kwargs)
        model.compile(optimizer=optimizer, loss="mse")
    return model


def fit_mixed(model, x, y, batch_size):
    """`model.fit` under mixed_float16; the "skipped in this fit" warnings it gave."""
    with mixed.mixed_precision_policy(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return [str(w.message) for w in caught if "skipped in this fit" in str(w.message)]


ONE_REPLICA = ["no_strategy", "default_strategy", "R1"]


def one_replica(where, strategy1):
    return {"no_strategy": None, "default_strategy": tf.distribute.get_strategy(),
            "R1": strategy1}[where]


@pytest.mark.usefixtures("collect_garbage")
@pytest.mark.parametrize("explicit", [False, True], ids=["compile_wraps", "explicit"])
@pytest.mark.parametrize("where", ONE_REPLICA)
def test_on_one_replica_keras_own_wrapper_is_used_and_equals_the_mixed_big_batch(
        where, explicit, strategy1):
    # The default path: compile(AccumulatingOptimizer(...)) under mixed_float16. Data small
    # enough for Keras' default initial scale, 2**15, not to overflow.
    strategy = one_replica(where, strategy1)
    x, y = overflow_data(8, 4)
    x, y = x / 4, y / 4
    accumulated = under_keras_own_wrapper(strategy, explicit)
    initial = weights_of(accumulated)
    assert fit_mixed(accumulated, x, y, 4) == []
    with mixed.mixed_precision_policy(), (strategy.scope() if strategy else
                                          contextlib.nullcontext()):
        big = tiny_model()
        big.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")  # compile wraps it
    fit_mixed(big, x, y, 8)
    check_float16_close(weights_of(accumulated), weights_of(big), initial, batch=8)
    wrapper, inner = accumulated.optimizer, accumulated.optimizer.inner_optimizer
    assert type(wrapper) is keras.optimizers.LossScaleOptimizer
    assert int(inner.iterations.numpy()) == 4 and int(inner.skipped_micro_batches.numpy()) == 0


@pytest.mark.usefixtures("collect_garbage")
@pytest.mark.parametrize("where", ONE_REPLICA)
def test_on_one_replica_the_micro_batches_keras_wrapper_skips_are_counted_and_warned(
        where, strategy1):
    # Two overflowing micro-batches, and a scale that doubles after every 2 finite ones
    # (Keras' default: 2000), so that skips and growth interleave; 9 micro-batches, one of
    # them after the last update (counted at the end of fit).
    strategy = one_replica(where, strategy1)
    x, y = overflow_data(9, 4, overflow_step=3)
    y[8 * 4] = mixed.OUTLIER_TARGET  # and the ninth
    model = under_keras_own_wrapper(strategy, True, initial_scale=C, dynamic_growth_steps=2)
    told = fit_mixed(model, x, y, 4)
    wrapper, inner = model.optimizer, model.optimizer.inner_optimizer
    assert int(inner.skipped_micro_batches.numpy()) == 2
    assert int(inner.total_micro_steps.numpy()) == 7 and int(inner.iterations.numpy()) == 3
    # 7 finite micro-batches: grown after the 2nd, halved, grown after the 4th and the 6th
    # (counting resets at a skip: the 3rd finite one is the 1st after it), halved.
    assert float(wrapper.dynamic_scale.numpy()) == C * 2 / 2 * 2 * 2 / 2
    assert told == [
        "AccumulatingOptimizer: 2 micro-batch(es) skipped in this fit (2 in all, "
        "`skipped_micro_batches`): their gradients overflowed, and Keras' LossScaleOptimizer "
        f"halved its scale each time (now {C * 2:g}). A few are expected while the scale comes "
        "down from its initial value."]
    assert fit_mixed(model, x[:8], y[:8] * 0, 4) == []  # a clean fit after it: nothing new


@pytest.mark.usefixtures("collect_garbage")
@pytest.mark.parametrize("explicit", [False, True], ids=["compile_wraps", "explicit"])
def test_on_two_replicas_keras_own_wrapper_is_refused_before_any_weight_moves(
        explicit, strategy2):
    model = under_keras_own_wrapper(strategy2, explicit, initial_scale=C)
    before = weights_of(model)
    with pytest.raises(ValueError) as err:
        fit_mixed(model, *overflow_data(4, 8), 8)
    assert str(err.value) == STOCK_WRAPPER_MESSAGE.format(replicas=2)  # nothing of Keras
    assert str(err.value).startswith(
        "Under mixed_float16 on 2 replicas, hand model.compile the loss-scale wrapper "
        "yourself: model.compile(optimizer=distgrad.AllReplicasFiniteLossScaleOptimizer("
        "distgrad.AccumulatingOptimizer(inner, accumulation_steps)), ...)")
    assert not model.optimizer.inner_optimizer.built
    assert all(np.array_equal(a, b) for a, b in zip(weights_of(model), before))


def test_the_refusal_is_the_fix_and_one_reason_then_the_page():
    message = STOCK_WRAPPER_MESSAGE.format(replicas=2)
    fix, reason = re.split(r"(?<=\.) (?=[A-Z])", message)
    assert fix.startswith("Under mixed_float16 on 2 replicas, hand model.compile")
    assert reason.startswith("Keras' own LossScaleOptimizer") and "replica 0" in reason
    assert reason.endswith("lesson 04 (notebooks/04_loss_scale_optimizer_pitfall.py).")
    assert len(message.split()) <= 70


@pytest.mark.usefixtures("collect_garbage")
def test_a_custom_loop_in_keras_own_wrapper_is_refused_before_any_weight_moves(strategy2):
    with mixed.mixed_precision_policy(), strategy2.scope():
        model = tiny_model()
        optimizer = keras.mixed_precision.LossScaleOptimizer(
            AccumulatingOptimizer(keras.optimizers.SGD(0.1), 2))
    before = weights_of(model)

    @tf.function
    def step(x, y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                error = tf.cast(model(x), "float32") - y
                loss = optimizer.scale_loss(tf.reduce_mean(error * error))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy2.run(replica_step, args=(x, y))

    x, y = overflow_data(1, 8)
    with pytest.raises(ValueError) as err:  # the wrapper's first apply builds it: traced
        step(tf.constant(x), tf.constant(y))
    # after TensorFlow's "in user code:" lines, nothing of Keras' Cond.call() around it
    assert str(err.value).rstrip().endswith(STOCK_WRAPPER_MESSAGE.format(replicas=2))
    assert "Cond.call" not in str(err.value)
    assert all(np.array_equal(a, b) for a, b in zip(weights_of(model), before))


def test_keras_own_wrapper_tells_its_inner_optimizer_nothing_of_a_skip():
    # Why AccumulatingOptimizer finds the wrapper and reads the skips off its scale: if a
    # Keras release calls the inner optimizer on a skip or gives it its wrapper, this fails.
    x, y = overflow_data(4, 8, overflow_step=3)
    with mixed.mixed_precision_policy():
        model = tiny_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    wrapper, inner = model.optimizer, model.optimizer.inner_optimizer
    assert type(wrapper) is keras.optimizers.LossScaleOptimizer
    assert float(wrapper.dynamic_scale.numpy()) == 2.0**14  # micro-batch 3 skipped
    assert int(inner.iterations.numpy()) == 3  # the inner optimizer ran for the other 3
    assert not any(value is wrapper for value in vars(inner).values())


# On R replicas lesson 04's deep dive "four optimizers" makes these runs (once per suite).


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_accumulated_mixed_precision_equals_big_batch_mixed_precision(strategy1, name):
    x, y, micro_batch = data(strategy1)
    accumulated = mixed_precision_fit(strategy1, x, y, micro_batch, 2, OPTIMIZERS[name])
    big_batch = mixed_precision_fit(strategy1, x, y, 2 * micro_batch, None, OPTIMIZERS[name])
    check_float16_close(accumulated.final_weights, big_batch.final_weights,
                        accumulated.initial_weights, BIG_BATCH_PER_REPLICA)
    check_not_close(accumulated.final_weights, accumulated.initial_weights)  # it trained
    assert accumulated.iterations == (0, 1, 1, 2, 2, 3, 3, 4)  # updates, not micro-batches
    assert accumulated.total_micro_steps == tuple(range(1, 9))
    assert accumulated.accumulator_dtypes == ("float32",) * 4


def test_unscaling_each_micro_batch_survives_a_loss_scale_change_inside_a_cycle(strategy):
    # dynamic_growth_steps=1 doubles the scale after every finite micro-batch, so the
    # two micro-batches of each cycle are computed at different scales.
    x, y, micro_batch = data(strategy, micro_batches=6)
    reference = lsp.accumulated_reference(strategy, initial_scale=16)
    fixed = mixed_precision_fit(strategy, x, y, micro_batch, 2,
                                    lambda: keras.optimizers.SGD(0.2), initial_scale=16,
                                    dynamic_growth_steps=1)
    growing = functools.partial(keras.mixed_precision.LossScaleOptimizer, dynamic_growth_steps=1)
    patched = lsp.reproduce(strategy, "loss_scale_optimizer", overflow_step=None,
                            initial_scale=16, wrapper=growing)
    assert fixed.loss_scales == patched.loss_scales == tuple(16.0 * 2**k for k in range(1, 7))
    check_float16_close(fixed.final_weights, reference, fixed.initial_weights,
                        BIG_BATCH_PER_REPLICA)
    # the question's patch sums scaled gradients and divides by the *latest* scale
    check_float16_apart(patched.final_weights, reference, patched.initial_weights,
                        BIG_BATCH_PER_REPLICA)


def test_a_micro_batch_the_wrapper_sees_overflow_is_skipped_not_counted(strategy):
    # replica 0 is the one LossScaleOptimizer checks: on 1 replica, the only one.
    x, y, micro_batch = data(strategy, overflow_step=3, overflow_replicas=(0,))
    record = mixed_precision_fit(strategy, x, y, micro_batch, 2)
    assert record.loss_scales == (C, C) + (C / 2,) * 6
    assert record.total_micro_steps == (1, 2, 2, 3, 4, 5, 6, 7)  # micro-batch 3 not counted
    assert record.iterations == (0, 1, 1, 1, 2, 2, 3, 3)  # the cycle waits for 2 good ones
    assert all(record.weights_finite)


def test_all_replicas_finite_wrapper_skips_an_overflow_on_replica_1_before_accumulation(
        strategy2):
    x, y, micro_batch = data(strategy2, overflow_step=3, overflow_replicas=(1,))
    with pytest.warns(UserWarning, match=r"1 micro-batch\(es\) skipped in this fit.*now 512"):
        record = mixed_precision_fit(strategy2, x, y, micro_batch, 2,
                                     wrapper=AllReplicasFiniteLossScaleOptimizer)
    assert all(record.weights_finite)
    assert record.loss_scales == (C, C) + (C / 2,) * 6
    assert record.total_micro_steps == (1, 2, 2, 3, 4, 5, 6, 7)
    assert record.iterations == (0, 1, 1, 1, 2, 2, 3, 3)  # no cycle lost
    assert record.skipped_updates == 0


def skipped_micro_batches(record):
    """1-based micro-batches after which total_micro_steps did not advance."""
    previous = (0,) + record.total_micro_steps[:-1]
    return [t + 1 for t, (a, b) in enumerate(zip(previous, record.total_micro_steps)) if a == b]


def growing_run(strategy, wrapper=None):
    """Default initial scale, growth every 3 good micro-batches, one injected overflow
    (all replicas) at micro-batch 8: the run the lesson plots."""
    x, y, micro_batch = data(strategy, micro_batches=16, overflow_step=8)
    return mixed_precision_fit(strategy, x, y, micro_batch, 2,
                                   initial_scale=mixed.DEFAULT_INITIAL_SCALE,
                                   dynamic_growth_steps=3, wrapper=wrapper)


def test_loss_scale_trajectory_halves_exactly_at_the_skipped_micro_batches(strategy):
    record = growing_run(strategy, wrapper=AllReplicasFiniteLossScaleOptimizer)
    scales = (mixed.DEFAULT_INITIAL_SCALE,) + record.loss_scales
    halved = [t + 1 for t in range(16) if scales[t + 1] == scales[t] / 2]
    assert 8 in halved
    assert halved == skipped_micro_batches(record)
    assert all(scales[t + 1] in (scales[t] / 2, scales[t], scales[t] * 2) for t in range(16))
    assert record.iterations[-1] == record.total_micro_steps[-1] // 2
    assert all(record.weights_finite)


def test_a_natural_overflow_on_replica_1_is_skipped_and_no_cycle_is_lost(strategy2):
    # On this data, at scale 2**15 after one growth and one halving, micro-batch 7
    # overflows on replica 1 only (TF 2.21 / Keras 3.15.1, CPU): skipped, scale halved.
    safe = growing_run(strategy2, wrapper=AllReplicasFiniteLossScaleOptimizer)
    assert 7 in skipped_micro_batches(safe)
    assert safe.loss_scales[6] == safe.loss_scales[5] / 2
    assert safe.iterations[-1] == safe.total_micro_steps[-1] // 2  # every cycle applied
    assert safe.skipped_updates == 0
    assert all(safe.weights_finite)
