"""Lesson 04's fix: distgrad.AccumulatingOptimizer under mixed_float16 in model.fit.

AllReplicasFiniteLossScaleOptimizer(AccumulatingOptimizer(inner)): the wrapper unscales
each micro-batch with its own loss scale before it is accumulated (float32), and skips a
micro-batch that overflowed on any replica, halving the scale. Keras' own wrapper (the
one compile adds) checks replica 0 only: AccumulatingOptimizer refuses it at the first
step, naming the fix.
"""

import functools

import keras
import pytest

from distgrad.lab import mixed
from distgrad.lab.compare import OPTIMIZERS, check_close, check_not_close
from distgrad.lab.mixed import mixed_precision_fit, overflow_data
from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
from distgrad.pitfalls import loss_scale_patch as lsp

MIXED = {"rtol": mixed.MIXED_PRECISION_RTOL, "atol": mixed.MIXED_PRECISION_ATOL}
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


@pytest.mark.usefixtures("collect_garbage")
@pytest.mark.parametrize("explicit", [False, True], ids=["compile_wraps", "explicit"])
def test_keras_own_wrapper_is_refused_at_the_first_step_naming_the_fix(strategy1, explicit):
    # One replica too: the same code must run on one device and on eight.
    x, y, micro_batch = data(strategy1)
    with pytest.raises(ValueError, match=r"overflow check from replica 0 only") as err:
        mixed_precision_fit(strategy1, x, y, micro_batch,
                            initial_scale=None if not explicit else C,
                            wrapper=keras.mixed_precision.LossScaleOptimizer if explicit else None)
    assert "AllReplicasFiniteLossScaleOptimizer(distgrad.AccumulatingOptimizer(" in str(err.value)


# On R replicas lesson 04's deep dive "four optimizers" makes these runs (once per suite).


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_accumulated_mixed_precision_equals_big_batch_mixed_precision(strategy1, name):
    x, y, micro_batch = data(strategy1)
    accumulated = mixed_precision_fit(strategy1, x, y, micro_batch, 2, OPTIMIZERS[name])
    big_batch = mixed_precision_fit(strategy1, x, y, 2 * micro_batch, None, OPTIMIZERS[name])
    check_close(accumulated.final_weights, big_batch.final_weights, **MIXED)
    check_not_close(accumulated.final_weights, accumulated.initial_weights, **MIXED)
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
    check_close(fixed.final_weights, reference, **MIXED)
    # the question's patch sums scaled gradients and divides by the *latest* scale
    check_not_close(patched.final_weights, reference, **MIXED)


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
