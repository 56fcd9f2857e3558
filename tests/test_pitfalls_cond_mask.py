"""Lesson 03's pitfalls: a sync point inside tf.cond, and the 0/1 mask trick.

The question's code as posted, its two Python bugs and the minimal cross-replica fix are
written and asserted in lesson 03 itself (it runs under nbmake), and so are the runs it
makes on R replicas (Keras' built-in accumulation, the mask trick for each optimizer, a
zero-gradient step): each reproduction runs once per suite. Here: the reduced
`CondPatch`, the mask trick on one replica, and the installed sources."""

import inspect

import pytest
import tensorflow as tf
from keras.src.optimizers import base_optimizer, loss_scale_optimizer

import distgrad_course
from distgrad_course.lab.display import statements
from distgrad_course.pitfalls import cond_merge_call, mask_trick

# -- tf.cond around apply_gradients ------------------------------------------------------


def test_a_cond_patch_raises_the_merge_call_runtime_error_under_mirrored_strategy(strategy):
    record = cond_merge_call.reproduce(strategy)
    assert record.error is not None and record.error.type == "RuntimeError"
    assert record.error.contains(cond_merge_call.MERGE_CALL_ERROR)
    assert record.error.contains("control flow statement which contains a synchronization point")
    assert record.supports_no_merge_call is False
    assert record.updates is None


def test_a_cond_patch_runs_without_a_strategy_where_there_is_no_merge_call():
    record = cond_merge_call.reproduce(None, n=2, micro_steps=4)
    assert record.supports_no_merge_call is True
    assert record.error is None
    assert record.updates == 4 // 2
    assert record.weight_change > 1e-3


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


def test_mask_trick_matches_big_batch_for_plain_sgd_on_one_replica():
    record = mask_trick.reproduce(distgrad_course.make_strategy(1), "sgd", steps=STEPS,
                                  updates=UPDATES)
    assert record.mask_vs_big_batch.within()
    assert record.mask_iterations == UPDATES * STEPS  # but it counts micro-steps
    assert record.reference_updates == UPDATES


def test_mask_trick_rejects_an_unknown_optimizer_name():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        mask_trick.reproduce(distgrad_course.make_strategy(1), "rmsprop")


# -- comparing two copies of the question's code (lesson 03 compares its class with
# QuestionMaskPatch) ----------------------------------------------------------------------


def _posted(self, n):
    """Docstring."""
    self.n = tf.constant(
        n,
        dtype=tf.int64,  # a comment
    )


def _compact(self, n):
    self.n = tf.constant(n, dtype=tf.int64)


def _changed(self, n):
    self.n = tf.constant(n, dtype=tf.int32)


def test_statements_compare_what_code_does_not_its_layout_comments_or_docstring():
    assert statements(_posted) == statements(_compact)
    assert statements(_posted) != statements(_changed)
    assert len(statements(mask_trick.QuestionMaskPatch._can_apply_on_next_step)) == 3
