"""Lesson 03's pitfalls: a sync point inside tf.cond, and the 0/1 mask trick."""

import functools
import inspect

import keras
import pytest
import tensorflow as tf
from keras.src.optimizers import base_optimizer, loss_scale_optimizer

import distgrad
from distgrad.lab.compare import OPTIMIZERS, check_close
from distgrad.lab.data import regression_data
from distgrad.lab.recipes import fit_run
from distgrad.pitfalls import cond_merge_call, mask_trick

# -- tf.cond around apply_gradients ------------------------------------------------------


class _StarredOnly(cond_merge_call.QuestionCondPatch):
    """The posted patch with only the `*args, **kwargs` fix: the zip is still read twice."""

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        trainable_variables = [var for (_, var) in grads_and_vars]
        gradients = [grad for (grad, _) in grads_and_vars]
        for i, grad in enumerate(gradients):
            self.accu_gradients[i].assign_add(grad)
        tf.cond(self._can_apply_on_next_step(),
                true_fn=lambda: self.apply_accu_gradients(trainable_variables, *args, **kwargs),
                false_fn=lambda: None)


@pytest.mark.parametrize("replicas", [None, 2])
def test_the_question_cond_patch_as_posted_raises_type_error_in_keras3(replicas):
    strategy = replicas and distgrad.make_strategy(replicas)
    record = cond_merge_call.reproduce(strategy, cond_merge_call.QuestionCondPatch)
    assert record.error.type == "TypeError"  # `args, kwargs` passed as two arguments
    assert record.error.contains("apply_gradients() takes 2 positional arguments but 4 were given")
    assert record.updates is None


def test_the_question_cond_patch_reads_the_zip_twice_and_accumulates_nothing():
    record = cond_merge_call.reproduce(None, _StarredOnly, n=2, micro_steps=4)
    assert record.error is None and record.updates == 2  # it applies, every 2nd step...
    assert record.weight_change == 0.0  # ...the zeros it never accumulated into


def test_calls_fixed_cond_patch_raises_the_merge_call_runtime_error_under_mirrored_strategy(
        strategy):
    record = cond_merge_call.reproduce(strategy)
    assert record.error is not None and record.error.type == "RuntimeError"
    assert record.error.contains(cond_merge_call.MERGE_CALL_ERROR)
    assert record.error.contains("control flow statement which contains a synchronization point")
    assert record.supports_no_merge_call is False
    assert record.updates is None


def test_calls_fixed_cond_patch_runs_without_a_strategy_where_there_is_no_merge_call():
    record = cond_merge_call.reproduce(None, n=2, micro_steps=4)
    assert record.supports_no_merge_call is True
    assert record.error is None
    assert record.updates == 4 // 2
    assert record.weight_change > 1e-3


def test_calls_fixed_cond_patch_fails_the_same_way_under_multi_worker_mirrored():
    record = cond_merge_call.reproduce_under_multiworker()
    # one worker, its local devices: its GPUs, else its CPU
    assert record.replicas == max(1, len(tf.config.list_physical_devices("GPU")))
    assert record.supports_no_merge_call is False  # merge_call-free only under XLA on GPUs
    assert record.error.type == "RuntimeError"
    assert record.error.contains(cond_merge_call.MERGE_CALL_ERROR)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_cross_replica_cond_patch_equals_big_batch_in_a_custom_loop(strategy2, optimizer):
    k, micro_batch = 4, 4
    x, y = regression_data(micro_batch * k * 2)
    factory = OPTIMIZERS[optimizer]
    run = cond_merge_call.patched_run(strategy2, cond_merge_call.CrossReplicaCondPatch,
                                      factory, x, y, micro_batch, k, loss_batch=k * micro_batch)
    reference = fit_run(None, factory, x, y, k * micro_batch)
    assert run.error is None and run.updates == reference.updates == 2
    check_close(run.final, reference.final)


def test_cross_replica_cond_patch_in_fit_applies_the_sum_of_micro_batch_means(strategy2):
    k, micro_batch = 4, 4
    x, y = regression_data(micro_batch * k * 2)
    run = cond_merge_call.patched_run(strategy2, cond_merge_call.CrossReplicaCondPatch,
                                      lambda: keras.optimizers.SGD(0.1), x, y, micro_batch, k,
                                      fit=True)
    k_times = fit_run(None, lambda: keras.optimizers.SGD(0.1 * k), x, y, k * micro_batch)
    assert run.error is None and run.updates == 2
    check_close(run.final, k_times.final)


def test_keras_builtin_gradient_accumulation_fails_in_fit_under_mirrored_strategy(strategy2):
    # keras-team/keras#20582. When this test fails, Keras fixed it: update lesson 03.
    record = cond_merge_call.reproduce_builtin(strategy2, steps=4)
    assert (record.tensorflow, record.keras) == (tf.__version__, keras.__version__)
    assert record.error is not None and record.error.type == "RuntimeError"
    assert record.error.contains("Exception encountered when calling Cond.call()")
    assert record.error.contains(cond_merge_call.MERGE_CALL_ERROR)


def test_keras_builtin_gradient_accumulation_is_correct_without_a_strategy():
    record = cond_merge_call.reproduce_builtin(None, steps=4, updates=2)
    assert record.error is None
    assert (record.updates, record.micro_steps) == (2, 8)
    assert record.vs_big_batch.within()


def test_the_builtin_accumulation_branch_is_an_ops_cond_around_the_update_step():
    source = inspect.getsource(base_optimizer.BaseOptimizer._backend_apply_gradients)
    assert "ops.cond(" in source and "is_update_step" in source
    assert source.index("ops.cond(") > source.index("self._backend_update_step(")


def test_loss_scale_optimizer_documents_the_cross_replica_cond_pattern():
    source = inspect.getsource(loss_scale_optimizer.LossScaleOptimizer._tf_apply)
    comment = " ".join(line.strip().lstrip("# ") for line in source.splitlines())
    assert "We must call this cond() in a cross-replica context." in comment
    assert "merge_call(" in source and "call_for_each_replica(" in source


# -- the 0/1 mask trick -------------------------------------------------------------------


STEPS, UPDATES = 4, 3


@functools.cache
def masked(optimizer, replicas=2):
    return mask_trick.reproduce(distgrad.make_strategy(replicas), optimizer, steps=STEPS,
                                updates=UPDATES)


@pytest.mark.parametrize("replicas", [1, 2])
def test_mask_trick_matches_big_batch_for_plain_sgd(replicas):
    record = masked("sgd", replicas)
    assert record.mask_vs_big_batch.within()
    assert record.mask_iterations == UPDATES * STEPS  # but it counts micro-steps
    assert record.reference_updates == UPDATES


@pytest.mark.parametrize("optimizer", ["momentum", "adam", "adamw"])
def test_mask_trick_drifts_from_big_batch_for_stateful_optimizers(optimizer):
    record = masked(optimizer)
    assert not record.mask_vs_big_batch.within()
    assert record.mask_vs_big_batch.max_abs > 1e-3
    assert record.mask_iterations == UPDATES * STEPS
    # the same micro-batches through AccumulatingOptimizer: big batch, n updates
    assert record.accumulating_vs_big_batch.within()
    assert record.accumulating_iterations == record.reference_updates == UPDATES


def test_mask_trick_pays_k_all_reduces_per_update_and_the_wrapper_one():
    record = masked("adam")
    assert (record.mask_placement.every_call, record.mask_placement.conditional) == (1, 0)
    assert record.mask_placement.per_update(STEPS) == STEPS
    assert (record.accumulating_placement.every_call,
            record.accumulating_placement.conditional) == (0, 1)
    assert record.accumulating_placement.per_update(STEPS) == 1


def test_a_zero_gradient_step_is_a_no_op_only_for_plain_sgd():
    record = mask_trick.zero_gradient_step("sgd")
    assert record.weight_change_max_abs == 0.0
    assert (record.iterations_before, record.iterations_after) == (1, 2)


@pytest.mark.parametrize("optimizer", ["momentum", "adam", "adamw"])
def test_a_zero_gradient_step_moves_the_weights_by_the_update_rule(optimizer):
    record = mask_trick.zero_gradient_step(optimizer)
    assert record.weight_change_max_abs > 1e-3
    assert record.vs_prediction.within()  # momentum / decayed Adam moments / weight decay
    assert (record.iterations_before, record.iterations_after) == (1, 2)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_a_zero_gradient_step_decays_adam_moments_by_beta(optimizer):
    record = mask_trick.zero_gradient_step(optimizer)
    assert record.moments_vs_decay.within()


def test_a_zero_gradient_step_applies_decoupled_weight_decay():
    record = mask_trick.zero_gradient_step(lambda: keras.optimizers.SGD(0.1, weight_decay=0.1))
    assert record.weight_change_max_abs > 1e-3
    assert record.vs_prediction.within()  # w * (1 - lr * wd)


def test_mask_trick_rejects_an_unknown_optimizer_name():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        mask_trick.reproduce(distgrad.make_strategy(1), "rmsprop")
