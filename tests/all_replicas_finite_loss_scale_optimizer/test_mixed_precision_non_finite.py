"""`AllReplicasFiniteLossScaleOptimizer` and the non-finite policy: under loss scaling an
overflow is the loss scale's business, not the accumulating optimizer's. One on replica 1
only skips that micro-batch, not the cycle (no update skipped, `skipped_micro_batches`
logged and warned about), halves the scale once and leaves the weights finite.
"""

import numpy as np
import pytest
from non_finite_cases import K, compiled

from distgrad.callbacks import AccumulationCallback
from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.compare import OPTIMIZERS, weights_of
from distgrad_course.lab.mixed import (
    CONTROLLED_INITIAL_SCALE,
    mixed_precision_policy,
    overflow_data,
)


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
