"""A NaN gradient in float32 is never silent: the `non_finite` policy ("raise" or "skip").

The same vocabulary for `AccumulatingOptimizer`, `GradientAccumulator` and
`MicroBatching`; under a `LossScaleOptimizer` a non-finite cycle is the loss scale's
business and is skipped (and counted). The no-merge-call path is in test_no_merge_call.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import distgrad_course
from distgrad.accumulator import GradientAccumulator
from distgrad.callbacks import AccumulationCallback
from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
from distgrad.optimizer import AccumulatingOptimizer
from distgrad.train_step import MicroBatching, with_micro_batches
from distgrad_course.lab.accumulation import AccumulatedTrainer
from distgrad_course.lab.compare import OPTIMIZERS, check_close, mirrored_copies_agree, weights_of
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.mixed import (
    CONTROLLED_INITIAL_SCALE,
    mixed_precision_policy,
    overflow_data,
)
from distgrad_course.lab.recipes import fit_run

K, MICRO, UPDATES = 2, 4, 3


@pytest.fixture(params=[0, 1, 2], ids=["no_strategy", "R1", "R2"])
def any_strategy(request):
    return distgrad_course.make_strategy(request.param) if request.param else None


def replicas_of(strategy):
    return 1 if strategy is None else strategy.num_replicas_in_sync


def nan_data(strategy, micro_batch_index=2, batch=MICRO, examples=MICRO * K * UPDATES):
    """regression data with one NaN target, in the last replica's shard of one batch."""
    x, y = regression_data(examples)
    replicas = replicas_of(strategy)
    y[micro_batch_index * batch + (replicas - 1) * (batch // replicas)] = np.nan
    return x, y


def compiled(strategy, optimizer_factory, model_factory=tiny_model):
    with (strategy or tf.distribute.get_strategy()).scope():
        model = model_factory()
        model.compile(optimizer=optimizer_factory(), loss="mse")
    return model


# -- AccumulatingOptimizer ---------------------------------------------------------------


@pytest.mark.usefixtures("collect_garbage")
def test_accumulating_optimizer_raises_by_default_naming_update_and_micro_step(any_strategy):
    x, y = nan_data(any_strategy)
    model = compiled(any_strategy, lambda: AccumulatingOptimizer(OPTIMIZERS["adam"](), K))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"cycle of update\] \[2\] \[ending at micro-step\] \[4\]"):
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    first = fit_run(None, OPTIMIZERS["adam"], x[:MICRO * K], y[:MICRO * K], MICRO * K)
    check_close(weights_of(model), first.final)  # nothing applied after update 1
    optimizer = model.optimizer
    assert (int(optimizer.iterations.numpy()), int(optimizer.skipped_updates.numpy())) == (1, 0)
    assert not all(np.all(np.isfinite(a.numpy())) for a in optimizer.accumulators)  # kept


def test_accumulating_optimizer_skip_drops_the_cycle_and_counts_it(any_strategy):
    x, y = nan_data(any_strategy)
    run = fit_run(any_strategy, lambda: AccumulatingOptimizer(
        OPTIMIZERS["momentum"](), K, non_finite="skip"), x, y, MICRO)
    kept = np.r_[0:2 * MICRO, 4 * MICRO:6 * MICRO]  # cycles 1 and 3
    check_close(run.final, fit_run(None, OPTIMIZERS["momentum"], x[kept], y[kept],
                                   MICRO * K).final)
    optimizer = run.optimizer
    assert (run.updates, run.total_micro_steps) == (UPDATES - 1, UPDATES * K)
    assert (int(optimizer.skipped_updates.numpy()), int(optimizer.micro_steps.numpy())) == (1, 0)
    assert mirrored_copies_agree(run.model.trainable_variables)


def test_skipped_updates_is_saved_by_a_checkpoint(tmp_path, strategy2):
    x, y = nan_data(strategy2)
    run = fit_run(strategy2, lambda: AccumulatingOptimizer(OPTIMIZERS["sgd"](), K,
                                                           non_finite="skip"), x, y, MICRO)
    path = tf.train.Checkpoint(optimizer=run.optimizer).save(str(tmp_path / "ckpt"))
    restored = compiled(strategy2, lambda: AccumulatingOptimizer(OPTIMIZERS["sgd"](), K,
                                                                 non_finite="skip"))
    with strategy2.scope():
        restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(optimizer=restored.optimizer).restore(path).expect_partial()
    assert int(restored.optimizer.skipped_updates.numpy()) == 1


def test_the_callback_puts_skipped_updates_in_fit_logs_and_the_optimizer_warns(strategy2):
    x, y = nan_data(strategy2)
    model = compiled(strategy2, lambda: AccumulatingOptimizer(OPTIMIZERS["sgd"](), K,
                                                              non_finite="skip"))
    with pytest.warns(UserWarning, match=r"2 update\(s\) skipped in this fit \(2 in all"):
        history = model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0,
                            callbacks=[AccumulationCallback()])
    assert history.history["skipped_updates"] == [1, 2]
    with pytest.warns(UserWarning, match=r"1 update\(s\) skipped in this fit \(3 in all"):
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)  # no callback


def test_under_loss_scaling_an_overflow_on_replica_1_skips_its_micro_batch_only(strategy2):
    x, y = overflow_data(4, 8, overflow_step=3, replicas=2, overflow_replicas=(1,))
    with mixed_precision_policy("mixed_float16"):
        model = compiled(strategy2, lambda: AllReplicasFiniteLossScaleOptimizer(
            AccumulatingOptimizer(OPTIMIZERS["sgd"](), K),
            initial_scale=CONTROLLED_INITIAL_SCALE))
        with pytest.warns(UserWarning, match=r"1 micro-batch\(es\) skipped in this fit"):
            history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0,
                                callbacks=[AccumulationCallback()])
    inner = model.optimizer.inner_optimizer
    assert (int(inner.iterations.numpy()), int(inner.skipped_updates.numpy())) == (1, 0)
    assert int(inner.micro_steps.numpy()) == 1  # 3 good micro-batches: one cycle + one
    assert history.history["skipped_micro_batches"] == [1]
    assert float(model.optimizer.dynamic_scale.numpy()) == CONTROLLED_INITIAL_SCALE / 2
    assert all(np.all(np.isfinite(w)) for w in weights_of(model))


# -- GradientAccumulator -----------------------------------------------------------------


def accumulator_trainer(strategy, non_finite):
    x, y = nan_data(strategy, micro_batch_index=1, batch=MICRO * 2, examples=MICRO * 2 * K)
    trainer = AccumulatedTrainer(strategy, OPTIMIZERS["adam"], x, y, K)
    trainer.accumulator.non_finite = non_finite  # before the first apply traces
    return trainer


def test_gradient_accumulator_raises_by_default_and_changes_nothing(strategy):
    trainer = accumulator_trainer(strategy, "raise")
    initial = weights_of(trainer.model)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"at update\] \[1\]"):
        trainer.update()
    check_close(weights_of(trainer.model), initial, rtol=0, atol=0)
    assert int(trainer.optimizer.iterations.numpy()) == 0
    assert trainer.accumulator.micro_steps == K  # the buffers keep the cycle


def test_gradient_accumulator_skip_resets_counts_and_warns(strategy):
    trainer = accumulator_trainer(strategy, "skip")
    initial = weights_of(trainer.model)
    with pytest.warns(UserWarning, match=r"update skipped.*\(1 skipped so far"):
        trainer.update()
    check_close(weights_of(trainer.model), initial, rtol=0, atol=0)
    assert int(trainer.accumulator.skipped_updates.numpy()) == 1
    assert (int(trainer.optimizer.iterations.numpy()), trainer.accumulator.micro_steps) == (0, 0)
    assert all(np.all(b.numpy() == 0) for b in trainer.accumulator.accumulated)


# -- MicroBatching -----------------------------------------------------------------------


@pytest.mark.usefixtures("collect_garbage")
def test_micro_batching_raises_by_default_naming_the_update(strategy):
    x, y = nan_data(strategy, micro_batch_index=1, batch=16, examples=32)
    model = compiled(strategy, OPTIMIZERS["sgd"], lambda: with_micro_batches(tiny_model(), 4))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"at update\] \[2\]"):
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1


def test_micro_batching_skip_logs_the_count_and_equals_fit_without_that_step(strategy):
    x, y = nan_data(strategy, micro_batch_index=0, batch=16, examples=32)
    model = compiled(strategy, OPTIMIZERS["adam"],
                     lambda: with_micro_batches(tiny_model(), 4, non_finite="skip"))
    history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    check_close(weights_of(model), fit_run(None, OPTIMIZERS["adam"], x[16:], y[16:], 16).final)
    assert history.history["skipped_updates"] == [1]
    assert int(model.skipped_updates.numpy()) == 1
    assert len(model.weights) == len(tiny_model().weights)  # the counter is no weight


# -- arguments -----------------------------------------------------------------------------


def test_an_unknown_policy_is_rejected_by_each_class():
    for make in (lambda: AccumulatingOptimizer(keras.optimizers.SGD(0.1), 2, non_finite="nan"),
                 lambda: GradientAccumulator([tf.Variable([1.0])], non_finite="nan"),
                 lambda: with_micro_batches(tiny_model(), 2, non_finite="nan")):
        with pytest.raises(ValueError, match=r"non_finite must be one of \('raise', 'skip'\)"):
            make()
    with pytest.raises(ValueError, match="incomplete_cycle must be one of"):
        AccumulationCallback("apply")
    assert issubclass(type(with_micro_batches(tiny_model(), 2)), MicroBatching)
