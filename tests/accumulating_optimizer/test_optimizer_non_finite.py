"""`AccumulatingOptimizer(non_finite=...)`: a NaN gradient in float32 is never silent.
"raise" (the default) fails naming the update and the micro-step that ends its cycle,
applies nothing after the updates before it and keeps the accumulators for inspection;
"skip" drops the cycle on every replica and counts it in `skipped_updates`, which a
checkpoint saves. Without a strategy and on 1 and 2 replicas. Loss scaling, the callback
and the no-merge-call path have their own specs.
"""

import numpy as np
import pytest
import tensorflow as tf
from non_finite_cases import MICRO, UPDATES, K, compiled, nan_data

import distgrad_course
from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.compare import OPTIMIZERS, check_close, mirrored_copies_agree, weights_of
from distgrad_course.lab.recipes import fit_run


@pytest.fixture(params=[0, 1, 2], ids=["no_strategy", "R1", "R2"])
def any_strategy(request):
    return distgrad_course.make_strategy(request.param) if request.param else None


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
