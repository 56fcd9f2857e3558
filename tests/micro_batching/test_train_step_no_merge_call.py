"""`MicroBatching` on TensorFlow's no-merge-call path, simulated on CPUs (conftest's
`no_merge_call`): `fit` equals plain big-batch `fit`, with one gradient all-reduce per step
(and the one-element finiteness flag on two replicas); `non_finite="skip"` fails at the
first step naming the fix, and skips through `AccumulatingOptimizer(optimizer, 1,
non_finite="skip")`, as the fix says.
"""

import numpy as np
import pytest
from no_merge_call_cases import PARAMETERS

from distgrad.optimizer import AccumulatingOptimizer
from distgrad.train_step import with_micro_batches
from distgrad_course.lab.compare import OPTIMIZERS, check_close
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.graph import fit_step_all_reduce_sizes
from distgrad_course.lab.recipes import fit_run
from distgrad_course.lab.xla_path import no_merge_call_strategy


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_micro_batching_equals_plain_big_batch_fit_without_merge_call(no_merge_call, name):
    x, y = regression_data(32)
    run = fit_run(no_merge_call, OPTIMIZERS[name], x, y, 16,
                  model_factory=lambda: with_micro_batches(tiny_model(), 4))
    check_close(run.final, fit_run(None, OPTIMIZERS[name], x, y, 16).final)
    expected = [PARAMETERS, 1] if no_merge_call.num_replicas_in_sync == 2 else [PARAMETERS]
    assert fit_step_all_reduce_sizes(run.model, x, y, 16) == expected


@pytest.mark.usefixtures("collect_garbage")
def test_micro_batching_skips_without_merge_call_through_an_accumulating_optimizer():
    strategy = no_merge_call_strategy(2)
    x, y = regression_data(32)
    y[3] = np.nan  # step 1, replica 0
    with strategy.scope():
        model = with_micro_batches(tiny_model(), 4, non_finite="skip")
        model.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    with pytest.raises(ValueError, match=r"non_finite='skip'\).*jit_compile=False"):
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    run = fit_run(strategy, lambda: AccumulatingOptimizer(OPTIMIZERS["sgd"](), 1,
                                                          non_finite="skip"),
                  x, y, 16, model_factory=lambda: with_micro_batches(tiny_model(), 4))
    check_close(run.final, fit_run(None, OPTIMIZERS["sgd"], x[16:], y[16:], 16).final)
    assert (run.updates, int(run.optimizer.skipped_updates.numpy())) == (1, 1)
