"""`AccumulatingOptimizer` on TensorFlow's no-merge-call path (XLA on GPUs), simulated on
CPUs (`distgrad_course.lab.xla_path`, conftest's `no_merge_call`: a CPU MirroredStrategy
whose `_use_merge_call()` is False, TensorFlow's own test fixture): `fit` and a custom loop
equal big-batch training, with one gradient all-reduce per update and a one-element
finiteness flag, both only where a cycle ends; a NaN on replica 1 only drops the cycle on
every replica ("skip") or names its update and applies nothing ("raise"). Under real XLA,
on one device, "skip" equals big-batch training and "raise" fails at the first step naming
the fix. What the simulation cannot show (XLA compilation of a multi-device step, NCCL,
GPU memory) is in docs/guides/gpu.md.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf
from no_merge_call_cases import MICRO, PARAMETERS, UPDATES, K

from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.compare import OPTIMIZERS, check_close, mirrored_copies_agree, weights_of
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.graph import fit_step_all_reduce_sizes, fit_step_placement
from distgrad_course.lab.recipes import custom_loop_run, fit_run
from distgrad_course.lab.xla_path import no_merge_call_strategy


def data(updates=UPDATES):
    return regression_data(MICRO * K * updates)


@functools.cache
def big_batch(name):
    x, y = data()
    return fit_run(None, OPTIMIZERS[name], x, y, MICRO * K).final


def accumulating(factory, **kwargs):
    return lambda: AccumulatingOptimizer(factory(), K, **kwargs)


def with_nan_on_last_replica(x, y, micro_batch_index, replicas):
    """`y` with NaN in the last replica's shard of micro-batch `micro_batch_index` (0-based)."""
    y = y.copy()
    y[micro_batch_index * MICRO + (replicas - 1) * (MICRO // replicas)] = np.nan
    return x, y


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_accumulating_optimizer_in_fit_equals_big_batch_without_merge_call(no_merge_call, name):
    x, y = data()
    run = fit_run(no_merge_call, accumulating(OPTIMIZERS[name]), x, y, MICRO)
    check_close(run.final, big_batch(name))
    assert (run.updates, run.total_micro_steps) == (UPDATES, UPDATES * K)
    assert mirrored_copies_agree(run.model.trainable_variables)


def test_accumulating_optimizer_in_a_custom_loop_equals_big_batch_without_merge_call(
        no_merge_call):
    x, y = data()
    run = custom_loop_run(no_merge_call, accumulating(OPTIMIZERS["adam"]), x, y, MICRO)
    check_close(run.final, big_batch("adam"))
    assert run.updates == UPDATES


def test_one_gradient_all_reduce_per_update_and_one_element_for_the_finiteness_flags():
    x, y = data()
    run = fit_run(no_merge_call_strategy(2), accumulating(OPTIMIZERS["sgd"]), x, y, MICRO)
    placement = fit_step_placement(run.model, x, y, MICRO)
    assert (placement.every_call, placement.conditional) == (0, 2)  # only when a cycle ends
    assert fit_step_all_reduce_sizes(run.model, x, y, MICRO) == [PARAMETERS, 1]
    plain = fit_run(no_merge_call_strategy(2), OPTIMIZERS["sgd"], x, y, MICRO)
    assert fit_step_all_reduce_sizes(plain.model, x, y, MICRO) == [PARAMETERS]
    one = fit_run(no_merge_call_strategy(1), accumulating(OPTIMIZERS["sgd"]), x, y, MICRO)
    assert fit_step_all_reduce_sizes(one.model, x, y, MICRO) == [PARAMETERS]  # no flag


def test_a_nan_on_replica_1_only_drops_the_cycle_on_every_replica():
    x, y = with_nan_on_last_replica(*data(), micro_batch_index=2, replicas=2)
    run = fit_run(no_merge_call_strategy(2), accumulating(OPTIMIZERS["momentum"],
                                                          non_finite="skip"), x, y, MICRO)
    kept = np.r_[0:2 * MICRO, 4 * MICRO:6 * MICRO]  # cycles 1 and 3
    check_close(run.final, fit_run(None, OPTIMIZERS["momentum"], x[kept], y[kept],
                                   MICRO * K).final)
    assert (run.updates, int(run.optimizer.skipped_updates.numpy())) == (UPDATES - 1, 1)
    assert mirrored_copies_agree(run.model.trainable_variables)


@pytest.mark.usefixtures("collect_garbage")
def test_raise_names_the_update_of_a_nan_on_replica_1_only_and_applies_nothing():
    strategy = no_merge_call_strategy(2)
    x, y = with_nan_on_last_replica(*data(), micro_batch_index=2, replicas=2)
    with strategy.scope():
        model = tiny_model()
        model.compile(optimizer=accumulating(OPTIMIZERS["adam"])(), loss="mse")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"cycle of update\] \[2\] \[ending at micro-step\] \[4\]"):
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    first_cycle = fit_run(None, OPTIMIZERS["adam"], x[:MICRO * K], y[:MICRO * K], MICRO * K)
    check_close(weights_of(model), first_cycle.final)  # the first update, nothing after
    assert int(model.optimizer.iterations.numpy()) == 1
    assert mirrored_copies_agree(model.trainable_variables)


# -- real XLA: one device only ------------------------------------------------------------


def xla_fit(optimizer, x, y, batch_size):
    model = tiny_model()
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


def test_under_xla_on_one_device_skip_equals_big_batch_and_drops_a_nan_cycle():
    # Without a strategy there is no merge_call either: the same branch, XLA-compiled.
    x, y = data()
    model = xla_fit(accumulating(OPTIMIZERS["adam"], non_finite="skip")(), x, y, MICRO)
    check_close(weights_of(model), big_batch("adam"))
    x, y = with_nan_on_last_replica(x, y, micro_batch_index=2, replicas=1)
    model = xla_fit(accumulating(OPTIMIZERS["adam"], non_finite="skip")(), x, y, MICRO)
    assert int(model.optimizer.skipped_updates.numpy()) == 1
    assert all(np.all(np.isfinite(w)) for w in weights_of(model))


@pytest.mark.usefixtures("collect_garbage")
def test_under_xla_raise_fails_at_the_first_step_naming_the_fix():
    x, y = data()
    with pytest.raises(ValueError, match=r"non_finite='skip'.*jit_compile=False.*"
                                         r"cannot raise in an XLA-compiled step"):
        xla_fit(accumulating(OPTIMIZERS["sgd"])(), x, y, MICRO)
