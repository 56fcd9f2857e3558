"""AccumulatingOptimizer: k micro-batches through model.fit == one big-batch step."""

import functools
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import distgrad_course
from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.compare import (
    OPTIMIZERS,
    check_close,
    check_not_close,
    mirrored_copies_agree,
    weights_of,
)
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.graph import count_collectives, fit_step_placement
from distgrad_course.lab.recipes import custom_loop_run, fit_run, make_replica_step

STEPS, MICRO_BATCH, UPDATES = 4, 4, 3


@pytest.fixture(params=[0, 1, 2], ids=["no_strategy", "R1", "R2"])
def any_strategy(request):
    return distgrad_course.make_strategy(request.param) if request.param else None


def data(steps=STEPS, updates=UPDATES):
    return regression_data(MICRO_BATCH * steps * updates)


@functools.cache
def big_batch(name, steps=STEPS, updates=UPDATES):
    """One device, no strategy, batches of steps * MICRO_BATCH: the reference."""
    x, y = data(steps, updates)
    return fit_run(None, OPTIMIZERS[name], x, y, MICRO_BATCH * steps).final


def accumulated_fit(strategy, factory, steps=STEPS, updates=UPDATES):
    x, y = data(steps, updates)
    return fit_run(strategy, lambda: AccumulatingOptimizer(factory(), steps), x, y, MICRO_BATCH)


# -- equivalence ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_accumulated_fit_equals_big_batch_fit(any_strategy, name):
    run = accumulated_fit(any_strategy, OPTIMIZERS[name])
    check_close(run.final, big_batch(name))
    assert run.updates == UPDATES
    assert run.total_micro_steps == UPDATES * STEPS
    assert mirrored_copies_agree(run.model.trainable_variables)


@pytest.mark.parametrize("steps", [1, 3])
def test_adam_accumulated_equals_big_batch_for_other_step_counts_on_two_replicas(
        strategy2, steps):
    run = accumulated_fit(strategy2, OPTIMIZERS["adam"], steps=steps)
    check_close(run.final, big_batch("adam", steps=steps))
    assert (run.updates, run.total_micro_steps) == (UPDATES, UPDATES * steps)


def test_custom_loop_apply_gradients_inside_strategy_run_equals_big_batch(strategy2):
    x, y = data()
    run = custom_loop_run(strategy2, lambda: AccumulatingOptimizer(OPTIMIZERS["adam"](), STEPS),
                          x, y, MICRO_BATCH)
    check_close(run.final, big_batch("adam"))
    assert (run.updates, run.total_micro_steps) == (UPDATES, UPDATES * STEPS)


def test_learning_rate_schedule_sees_updates_not_micro_steps(strategy2):
    x, y = data()

    def sgd_with_schedule():  # 0.1 for the first update, then 0.01
        return keras.optimizers.SGD(
            keras.optimizers.schedules.PiecewiseConstantDecay([1], [0.1, 0.01]))

    reference = fit_run(None, sgd_with_schedule, x, y, MICRO_BATCH * STEPS)
    run = fit_run(strategy2, lambda: AccumulatingOptimizer(sgd_with_schedule(), STEPS),
                  x, y, MICRO_BATCH)
    check_close(run.final, reference.final)
    check_not_close(run.final, big_batch("sgd"))  # the schedule did change the updates
    assert float(run.optimizer.learning_rate) == pytest.approx(0.01)


def test_accumulators_are_replica_local_float32_on_read_sums(strategy2):
    x, y = data()
    # 6 micro-steps with steps=4: one update, then 2 micro-batches accumulated
    run = fit_run(strategy2, lambda: AccumulatingOptimizer(OPTIMIZERS["sgd"](), STEPS),
                  x[:6 * MICRO_BATCH], y[:6 * MICRO_BATCH], MICRO_BATCH)
    assert (run.updates, run.total_micro_steps) == (1, 6)
    for accumulator in run.optimizer.accumulators:
        local = accumulator.value
        assert isinstance(local, tf.distribute.DistributedValues)
        assert local.synchronization == tf.VariableSynchronization.ON_READ
        assert local.aggregation == tf.VariableAggregation.SUM
        assert accumulator.dtype == "float32"
        copies = [np.asarray(c) for c in local.values]
        assert not np.array_equal(copies[0], copies[1])  # each replica its own partial sum
        np.testing.assert_allclose(accumulator.numpy(), copies[0] + copies[1], rtol=1e-6)


# -- communication ----------------------------------------------------------------------


def test_fit_step_has_one_all_reduce_and_only_inside_the_update_branch(strategy2):
    x, y = data()
    plain = fit_run(strategy2, OPTIMIZERS["adam"], x, y, MICRO_BATCH)
    accumulated = accumulated_fit(strategy2, OPTIMIZERS["adam"])
    plain_placement = fit_step_placement(plain.model, x, y, MICRO_BATCH)
    placement = fit_step_placement(accumulated.model, x, y, MICRO_BATCH)
    assert (plain_placement.every_call, plain_placement.conditional) == (1, 0)
    assert (placement.every_call, placement.conditional) == (0, 1)
    assert placement.per_update(STEPS) == 1
    assert plain_placement.per_update(STEPS) == STEPS


def test_custom_loop_step_counts_one_all_reduce_like_a_plain_step(strategy2):
    x, y = data()
    run = custom_loop_run(strategy2, lambda: AccumulatingOptimizer(OPTIMIZERS["sgd"](), STEPS),
                          x, y, MICRO_BATCH)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO_BATCH)
    batch = next(iter(strategy2.experimental_distribute_dataset(dataset)))
    step = tf.function(lambda b: strategy2.run(
        make_replica_step(MICRO_BATCH), args=(run.model, run.optimizer, *b)))
    with strategy2.scope():
        assert count_collectives(step, batch).all_reduces == 1


# -- clipping and weight decay act on the accumulated update ----------------------------


@pytest.mark.parametrize("option", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_clipping_acts_on_the_accumulated_all_reduced_gradient(strategy2, option):
    x, y = data()

    def clipped():
        return keras.optimizers.SGD(0.1, **{option: 0.05})

    reference = fit_run(None, clipped, x, y, MICRO_BATCH * STEPS)
    check_not_close(reference.final, big_batch("sgd"))  # clipping is active
    run = fit_run(strategy2, lambda: AccumulatingOptimizer(clipped(), STEPS), x, y, MICRO_BATCH)
    check_close(run.final, reference.final)
    assert getattr(run.optimizer, option) == 0.05
    assert getattr(run.optimizer.inner_optimizer, option) is None
    # the honest cost: one extra all-reduce per update, only when clipping is on
    placement = fit_step_placement(run.model, x, y, MICRO_BATCH)
    assert (placement.every_call, placement.conditional) == (0, 2)


@pytest.mark.parametrize("inner", [
    lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    lambda: keras.optimizers.SGD(0.01, weight_decay=0.1),
], ids=["adamw", "sgd"])
def test_weight_decay_applies_once_per_update(inner):
    # Zero gradients isolate the decoupled weight decay: w <- w * (1 - lr * wd).
    model = tiny_model()
    optimizer = AccumulatingOptimizer(inner(), accumulation_steps=3)
    variables = model.trainable_variables
    zeros = [(tf.zeros_like(v), v) for v in variables]
    before = weights_of(model)
    optimizer.apply_gradients(zeros)
    optimizer.apply_gradients(zeros)
    check_close(weights_of(model), before)
    optimizer.apply_gradients(zeros)
    check_close(weights_of(model), [w * (1 - 0.01 * 0.1) for w in before])
    assert int(optimizer.iterations.numpy()) == 1


# -- state -------------------------------------------------------------------------------


def _partial_then_rest(strategy, make, save_and_reload):
    x, y = data()
    split = 6 * MICRO_BATCH  # mid-cycle: 1 update + 2 accumulated micro-batches
    first = fit_run(strategy, make, x[:split], y[:split], MICRO_BATCH)
    model = save_and_reload(first)
    model.fit(x[split:], y[split:], batch_size=MICRO_BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def test_model_save_mid_accumulation_then_load_and_continue_equals_uninterrupted(
        strategy2, tmp_path):
    def make():
        return AccumulatingOptimizer(OPTIMIZERS["adam"](), STEPS)

    def save_and_reload(run):
        path = os.fspath(tmp_path / "mid.keras")
        run.model.save(path)
        with strategy2.scope():
            loaded = keras.models.load_model(path)
        optimizer = loaded.optimizer
        assert isinstance(optimizer, AccumulatingOptimizer)
        assert optimizer.accumulation_steps == STEPS
        assert type(optimizer.inner_optimizer) is keras.optimizers.Adam
        assert int(optimizer.iterations.numpy()) == 1
        assert int(optimizer.total_micro_steps.numpy()) == 6
        check_close([a.numpy() for a in optimizer.accumulators],
                    [a.numpy() for a in run.optimizer.accumulators])
        return loaded

    model = _partial_then_rest(strategy2, make, save_and_reload)
    check_close(weights_of(model), accumulated_fit(strategy2, OPTIMIZERS["adam"]).final)
    check_close(weights_of(model), big_batch("adam"))


def test_tf_train_checkpoint_mid_accumulation_restores_under_another_replica_count(
        strategy2, tmp_path):
    def make():
        return AccumulatingOptimizer(OPTIMIZERS["adam"](), STEPS)

    def checkpoint_and_restore_without_strategy(run):
        path = tf.train.Checkpoint(model=run.model, optimizer=run.optimizer).write(
            os.fspath(tmp_path / "mid"))
        model, optimizer = tiny_model(), make()
        model.compile(optimizer=optimizer, loss="mse")
        optimizer.build(model.trainable_variables)
        tf.train.Checkpoint(model=model, optimizer=optimizer).read(path).assert_consumed()
        assert int(optimizer.iterations.numpy()) == 1
        assert int(optimizer.total_micro_steps.numpy()) == 6
        return model

    model = _partial_then_rest(strategy2, make, checkpoint_and_restore_without_strategy)
    check_close(weights_of(model), big_batch("adam"))


def test_get_config_round_trip_restores_steps_inner_optimizer_and_clipping():
    inner = keras.optimizers.Adam(0.01, global_clipnorm=1.5)
    optimizer = AccumulatingOptimizer(inner, accumulation_steps=3, non_finite="skip")
    config = keras.saving.serialize_keras_object(optimizer)
    assert config["registered_name"] == "distgrad>AccumulatingOptimizer"
    assert set(config["config"]) == {"name", "inner_optimizer", "accumulation_steps",
                                     "non_finite"}
    restored = keras.saving.deserialize_keras_object(config)
    assert isinstance(restored, AccumulatingOptimizer)
    assert (restored.accumulation_steps, restored.non_finite) == (3, "skip")
    assert restored.global_clipnorm == 1.5 and restored.inner_optimizer.global_clipnorm is None
    assert float(restored.learning_rate.numpy()) == pytest.approx(0.01)
    assert restored.get_config() == optimizer.get_config()


def _mixed_float16_model(strategy, optimizer):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            model = tiny_model()
            model.compile(optimizer=optimizer(), loss="mse")
    finally:
        keras.mixed_precision.set_global_policy(previous)
    return model


def test_mixed_float16_compile_wraps_it_in_a_loss_scale_optimizer(strategy2):
    model = _mixed_float16_model(
        strategy2, lambda: AccumulatingOptimizer(OPTIMIZERS["adam"](), STEPS))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, AccumulatingOptimizer)


def test_loss_scale_optimizer_around_it_counts_updates_in_fit_on_two_replicas(strategy2):
    # A small initial scale keeps float16 gradients finite, so every micro-batch
    # reaches the accumulators. (Non-finite handling is lesson 04's subject.)
    model = _mixed_float16_model(strategy2, lambda: AllReplicasFiniteLossScaleOptimizer(
        AccumulatingOptimizer(OPTIMIZERS["adam"](), STEPS), initial_scale=1.0))
    x, y = data()
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False, verbose=0)
    accumulating = model.optimizer.inner_optimizer
    assert float(model.optimizer.dynamic_scale.numpy()) == 1.0  # nothing was skipped
    assert int(accumulating.total_micro_steps.numpy()) == UPDATES * STEPS
    assert int(model.optimizer.iterations.numpy()) == UPDATES
    assert all(np.isfinite(w).all() for w in weights_of(model))
    assert mirrored_copies_agree(model.trainable_variables)


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [0, -1, 2.5, True, "4"])
def test_steps_must_be_a_positive_integer(steps):
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        AccumulatingOptimizer(keras.optimizers.SGD(0.1), steps)


def test_a_string_is_rejected_with_the_fix():
    with pytest.raises(TypeError, match=r"keras\.optimizers\.get\('adam'\)"):
        AccumulatingOptimizer("adam", 4)


def test_a_tf_compat_v1_optimizer_is_rejected():
    with pytest.raises(TypeError, match="tf.compat.v1 optimizers"):
        AccumulatingOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), 4)


def test_an_inner_optimizer_that_accumulates_itself_is_rejected():
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        AccumulatingOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), 4)


def test_clipping_passed_to_the_wrapper_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match="set them on the inner optimizer"):
        AccumulatingOptimizer(keras.optimizers.SGD(0.1), 4, clipnorm=1.0)


@pytest.mark.usefixtures("collect_garbage")
def test_created_outside_the_strategy_scope_fails_at_build_with_the_fix(strategy2):
    optimizer = AccumulatingOptimizer(keras.optimizers.SGD(0.1), 4)  # no scope
    x, y = data()
    with strategy2.scope():
        model = tiny_model()
        model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(RuntimeError, match="inside the same `with strategy.scope\\(\\):` block"):
        model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, verbose=0)


def test_apply_outside_the_strategy_it_was_built_under_fails_with_the_fix(strategy2):
    with strategy2.scope():
        model = tiny_model()
        optimizer = AccumulatingOptimizer(keras.optimizers.SGD(0.1), 4)
        optimizer.build(model.trainable_variables)
    zeros = [(tf.zeros(v.shape), v) for v in model.trainable_variables]
    with pytest.raises(RuntimeError, match=r"built under MirroredStrategy with 2 replica\(s\) "
                                           r"but apply_gradients is called under no strategy"):
        optimizer.apply_gradients(zeros)
    with strategy2.scope(), pytest.raises(ValueError, match="must be called in replica context"):
        optimizer.apply_gradients(zeros)
