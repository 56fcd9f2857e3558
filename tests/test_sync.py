"""Lesson 01's facts: where gradients sync, loss scaling, reporting, clipping.

Lesson 01 runs and asserts each pitfall's reproduction on R replicas (per-replica mean,
double sum, regularization, the last batch, the loss object, clipping before the sum):
each runs once per suite. Here: the equivalence sweep, the sync path, one replica."""

import keras
import pytest
import tensorflow as tf

from distgrad_course.lab.compare import OPTIMIZERS, check_close
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.recipes import (
    big_batch_reference,
    make_replica_step,
    replica_loss,
    run_steps,
    untraced_sgd_step,
)
from distgrad_course.lab.spy import record_sync_path, summarize_path
from distgrad_course.pitfalls import clip_before_sync, loss_object_scaling


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


def test_keras3_loss_object_is_a_plain_mean_on_one_replica(strategy1):
    record = loss_object_scaling.reproduce(strategy1)
    assert record.loss_object == (1.0,) and record.loss_object_cross_replica_in_scope == 1.0


