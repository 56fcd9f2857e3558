"""TensorFlow's no-merge-call path (XLA on GPUs), simulated on CPUs (distgrad_course.lab.xla_path).

Everything here runs on `no_merge_call_strategy`: a CPU MirroredStrategy whose
`_use_merge_call()` is False, TensorFlow's own test fixture. What the simulation cannot
show (XLA compilation of a multi-device step, NCCL, GPU memory) is in docs/guides/gpu.md.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from distgrad.accumulator import GradientAccumulator
from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
from distgrad.optimizer import AccumulatingOptimizer
from distgrad.train_step import with_micro_batches
from distgrad_course.lab.accumulation import AccumulatedTrainer, train_accumulated
from distgrad_course.lab.child import run_child
from distgrad_course.lab.compare import OPTIMIZERS, check_close, mirrored_copies_agree, weights_of
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.graph import (
    all_reduce_sizes,
    fit_step_all_reduce_sizes,
    fit_step_placement,
)
from distgrad_course.lab.mixed import mixed_precision_fit, overflow_data
from distgrad_course.lab.recipes import big_batch_reference, custom_loop_run, fit_run
from distgrad_course.lab.xla_path import no_merge_call_strategy, takes_no_merge_call_path

K, MICRO, UPDATES = 2, 4, 3  # MICRO: the global micro-batch
PARAMETERS = 4 * 8 + 8 + 8 * 1 + 1  # tiny_model's weights: one packed gradient all-reduce


@pytest.fixture(params=[1, 2], ids=["R1", "R2"])
def no_merge_call(request):
    return no_merge_call_strategy(request.param)


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


def test_the_simulated_strategy_takes_the_no_merge_call_path_and_the_stock_one_does_not(
        strategy2):
    assert takes_no_merge_call_path(no_merge_call_strategy(2))
    assert not takes_no_merge_call_path(strategy2)


# -- AccumulatingOptimizer ---------------------------------------------------------------


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


# -- GradientAccumulator and MicroBatching -------------------------------------------------


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_gradient_accumulator_equals_big_batch_without_merge_call(no_merge_call, name):
    x, y = regression_data(8)
    run = train_accumulated(no_merge_call, OPTIMIZERS[name], x, y, K, updates=2)
    check_close(run.final, big_batch_reference(OPTIMIZERS[name], x, y, steps=2))
    assert run.iterations == 2 and run.copies_agree


def test_gradient_accumulator_moves_gradients_once_per_update_without_merge_call():
    x, y = regression_data(8)
    trainer = AccumulatedTrainer(no_merge_call_strategy(2), OPTIMIZERS["sgd"], x, y, K)
    trainer.update()
    # The one collective of a micro-step is the lab's reported loss: a scalar, no gradient.
    assert all_reduce_sizes(trainer.accumulate_function, trainer.micro_batches[0],
                            replicas=2) == [1]
    assert all_reduce_sizes(trainer.apply_step.function, replicas=2) == [PARAMETERS, 1]


def test_skip_without_merge_call_on_two_replicas_fails_at_the_first_apply_naming_the_fix():
    x, y = regression_data(8)
    trainer = AccumulatedTrainer(no_merge_call_strategy(2), OPTIMIZERS["sgd"], x, y, K)
    trainer.accumulator.non_finite = "skip"
    trainer.accumulate_step(0)
    with pytest.raises(ValueError, match=r"AccumulatingOptimizer\(optimizer, accumulation_steps"
                                         r"=1, non_finite='skip'\).*jit_compile=False"):
        trainer.apply_step()
    assert int(trainer.optimizer.iterations.numpy()) == 0


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


# -- loss scaling ---------------------------------------------------------------------------


def test_keras_loss_scale_optimizer_fails_at_its_first_step_without_merge_call_no_hang():
    # TF 2.21 / Keras 3.15.1: with merge_call gone, LossScaleOptimizer._common_apply puts
    # the inner update in a replica-context cond, and the inner optimizer's `iterations`
    # (ONLY_FIRST_REPLICA) needs a merge_call there: a trace-time RuntimeError, before
    # any replica could skip alone and leave the other waiting in an all-reduce.
    record = run_child("distgrad_course.lab.xla_path:stock_loss_scale_overflow_on_one_replica",
                       {"replicas": 2}, timeout=240).value
    assert record["error"]["type"] == "RuntimeError"
    assert "`merge_call` called while defining a new graph" in record["error"]["message"]
    assert "LossScaleOptimizer._common_apply" in record["error"]["message"]
    assert record["loss_scales"] == [1024.0, 1024.0]  # nothing ran
    assert all(record["weights_finite"])


@pytest.mark.usefixtures("collect_garbage")
def test_the_all_replicas_finite_wrapper_fails_at_the_first_step_naming_the_fix():
    x, y = overflow_data(2, 8, replicas=2)
    with pytest.raises(ValueError, match="jit_compile=False.*without merge_call"):
        mixed_precision_fit(no_merge_call_strategy(2), x, y, 8, accumulation_steps=None,
                            wrapper=AllReplicasFiniteLossScaleOptimizer)
    assert keras.mixed_precision.global_policy().name == "float32"


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


def test_xla_cannot_compile_a_two_replica_step_on_cpus_for_any_optimizer():
    # Why the path is simulated: XLA compiles for one device, and a MirroredStrategy step
    # reads variables on two (TF 2.21, CPU). Keras' own Adam, no distgrad involved.
    error = run_child("distgrad_course.lab.xla_path:xla_step_on_two_cpu_replicas",
                      timeout=240).value["error"]
    assert error["type"] == "InvalidArgumentError"
    assert "Trying to access resource" in error["message"]
    assert "from device /job:localhost/replica:0/task:0/device:CPU:0" in error["message"]


def test_a_plain_gradient_accumulator_without_any_strategy_raises_on_nan():
    variable = tf.Variable([1.0])
    accumulator = GradientAccumulator([variable])
    accumulator.add([tf.constant([np.nan])])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"at update\] \[1\]"):
        accumulator.make_apply_step(keras.optimizers.SGD(0.1))()
    assert float(variable.numpy()[0]) == 1.0
