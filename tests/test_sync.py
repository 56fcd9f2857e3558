"""Lesson 01's facts: where gradients sync, loss scaling, reporting, clipping."""

import keras
import pytest
import tensorflow as tf

from distgrad.lab.compare import OPTIMIZERS, check_close
from distgrad.lab.data import regression_data, tiny_model
from distgrad.lab.recipes import (
    big_batch_reference,
    make_replica_step,
    replica_loss,
    run_steps,
    untraced_sgd_step,
)
from distgrad.lab.spy import record_sync_path, summarize_path
from distgrad.pitfalls import (
    clip_before_sync,
    double_sum,
    last_batch_scaling,
    loss_object_scaling,
    per_replica_mean,
    regularization_scaling,
)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_two_replicas_with_global_batch_scaling_equal_one_device(strategy2, name):
    x, y = regression_data(16)
    reference = big_batch_reference(OPTIMIZERS[name], x, y, steps=3)
    run = run_steps(strategy2, OPTIMIZERS[name], x, y, make_replica_step(16), steps=3)
    check_close(run.final, reference)
    assert run.iterations == 3
    assert run.copies_agree


def test_apply_gradients_all_reduces_in_replica_context_and_updates_in_cross_replica(strategy2):
    distributed_step, batch = untraced_sgd_step(strategy2)
    _, events = record_sync_path(distributed_step.get_concrete_function, batch)
    path = {(fn, ctx): n for fn, ctx, n in summarize_path(events)}
    assert path[("BaseOptimizer.apply_gradients", "replica")] == 2
    assert path[("ReplicaContext.all_reduce", "replica")] == 2
    assert path[("StrategyExtendedV2.batch_reduce_to", "cross-replica")] == 1
    assert path[("ReplicaContext.merge_call", "replica")] == 3 * 2  # reduce, update, iterations
    assert path[("TFOptimizer._distributed_tf_update_step", "cross-replica")] == 1
    # 4 variables x 2 device copies, all written from the one cross-replica call
    assert path[("SGD.update_step", "cross-replica")] == 8
    order = [fn for fn, _, _ in summarize_path(events)]
    assert order.index("BaseOptimizer._clip_gradients") < order.index("ReplicaContext.all_reduce")
    assert order.index("ReplicaContext.all_reduce") < order.index(
        "TFOptimizer._distributed_tf_update_step")


def test_per_replica_mean_makes_the_sgd_update_r_times_too_large(strategy2):
    record = per_replica_mean.reproduce(strategy2)
    assert record.ratio == pytest.approx(2.0, rel=1e-6)
    assert record.global_scaling_ratio == pytest.approx(1.0, rel=1e-6)
    # strategy.reduce(SUM) of per-replica means reports R times the true mean loss
    assert record.reported_loss_per_replica_mean == pytest.approx(
        2 * record.reported_loss_global, rel=1e-6)


def test_reported_sum_of_globally_scaled_losses_is_the_full_batch_mean(strategy2):
    x, y = regression_data(16)
    run = run_steps(strategy2, lambda: keras.optimizers.SGD(0.1), x, y, make_replica_step(16))
    model = tiny_model()
    full_batch_loss = float(tf.reduce_mean(tf.square(model(x) - y)))
    assert run.reported_losses[0] == pytest.approx(full_batch_loss, rel=1e-6)


def test_reporting_reduce_does_not_change_the_update(strategy2):
    x, y = regression_data(16)
    step = make_replica_step(16)
    reported = run_steps(strategy2, lambda: keras.optimizers.SGD(0.1), x, y, step)
    with strategy2.scope():
        model, optimizer = tiny_model(), keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    batch = next(iter(strategy2.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(16))))
    tf.function(lambda b: strategy2.run(step, args=(model, optimizer, *b)))(batch)
    check_close([v.numpy() for v in model.weights], reported.final, rtol=0, atol=0)


def test_self_all_reduce_then_apply_gradients_sums_twice(strategy2):
    record = double_sum.reproduce(strategy2)
    assert record.ratio == pytest.approx(2.0, rel=1e-6)
    assert record.all_reduces == 2
    assert record.aggregate_flag_error.type == "TypeError"
    assert record.aggregate_flag_error.contains(
        "unexpected keyword argument 'experimental_aggregate_gradients'")


def test_global_clipnorm_clips_partial_gradients_before_the_sum(strategy2):
    record = clip_before_sync.reproduce(strategy2, "global_clipnorm")
    # the clipped per-replica update differs by almost as much as the update itself
    assert record.optimizer_clipping_vs_one_device.max_abs > 0.5 * record.one_device_update_max_abs
    assert record.clip_after_sync_vs_one_device.within()


def test_clipnorm_clips_partial_gradients_before_the_sum(strategy2):
    record = clip_before_sync.reproduce(strategy2, "clipnorm")
    assert record.optimizer_clipping_vs_one_device.max_abs > 0.5 * record.one_device_update_max_abs


def test_clipping_agrees_on_one_replica(strategy1):
    record = clip_before_sync.reproduce(strategy1, "global_clipnorm")
    assert record.optimizer_clipping_vs_one_device.within()


def test_bad_arguments_are_rejected(strategy2):
    with pytest.raises(ValueError, match="loss_scaling must be one of"):
        replica_loss(tf.zeros([2]), 2, "mean")
    with pytest.raises(ValueError, match="apply must be one of"):
        make_replica_step(16, apply="later")
    with pytest.raises(ValueError, match="needs clip_norm"):
        make_replica_step(16, apply="clip_after_sync")
    x, y = regression_data(15)
    with pytest.raises(ValueError, match="not divisible by 2 replicas"):
        run_steps(strategy2, lambda: keras.optimizers.SGD(0.1), x, y, make_replica_step(15))
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        run_steps(strategy2, lambda: keras.optimizers.SGD(0.1), x[:14], y[:14],
                  make_replica_step(14), steps=0)


def test_keras3_loss_object_divides_its_mean_by_the_replica_count(strategy2):
    record = loss_object_scaling.reproduce(strategy2)
    assert record.reduce_mean == (1.0, 1.0)
    assert record.loss_object == (0.5, 0.5)  # mean / R inside strategy.run
    assert record.loss_object == record.compute_average_loss  # == sum / global batch
    assert record.loss_object_cross_replica_in_scope == 0.5  # the strategy in scope decides
    assert record.loss_object_without_strategy == 1.0
    assert record.reduction_none_sum == (8.0, 8.0)  # reduction=None: unscaled per example
    assert record.sgd_step_vs_one_device.within()  # so the step needs no other scaling


def test_keras3_loss_object_is_a_plain_mean_on_one_replica(strategy1):
    record = loss_object_scaling.reproduce(strategy1)
    assert record.loss_object == (1.0,) and record.loss_object_cross_replica_in_scope == 1.0


def test_unscaled_regularization_is_applied_once_per_replica(strategy2):
    record = regularization_scaling.reproduce(strategy2)
    assert record.scaled_vs_one_device.within()
    assert not record.unscaled_vs_one_device.within()
    # the excess is the penalty's SGD step, (R - 1) = 1 extra time
    assert record.excess_vs_expected.within()
    assert record.excess_ratio == pytest.approx(1.0, rel=1e-4)
    assert record.cross_replica_error.type == "RuntimeError"
    assert record.cross_replica_error.contains("cross replica context")


def test_last_batch_needs_its_real_example_count(strategy2):
    rows = {(r.examples, r.scaling): r for r in last_batch_scaling.reproduce(strategy2, 16)}
    assert rows[8, "counted"].per_replica == (4, 4) and rows[7, "counted"].per_replica == (4, 3)
    assert rows[8, "fixed"].ratio == pytest.approx(8 / 16, rel=1e-6)
    assert rows[7, "fixed"].ratio == pytest.approx(7 / 16, rel=1e-6)
    assert rows[8, "per_replica_times_r"].vs_one_device.within()
    assert not rows[7, "per_replica_times_r"].vs_one_device.within()
    assert rows[8, "counted"].vs_one_device.within() and rows[7, "counted"].vs_one_device.within()
