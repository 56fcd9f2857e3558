"""The question's accumulation patch without `tf.cond` ("the more complicated path").

Question 003 (tensorflow/tensorflow#50454) installs it on an optimizer instance:
`optimizer.apply_gradients = QuestionMaskPatch(n, optimizer.apply_gradients,
trainable_variables).apply_gradients`. Written once, for both Keras generations: it
imports only TensorFlow, so `tf.keras` is Keras 3 where `mask_trick` and
`loss_scale_patch` run it, and tf-keras (the Keras the question ran) in the child
process where `tf_keras_loss_scale` runs it (`TF_USE_LEGACY_KERAS=1`).
"""

from __future__ import annotations

import tensorflow as tf


class QuestionMaskPatch:
    """The question's `_GradientAccumulationPatch`, second version: its statements as
    posted, plus one addition, marked: `calls` counts how often the patched method ran
    (a variable, so it counts executions of a traced step, not traces). Its `__init__`
    and `_can_apply_on_next_step` are those of the question's first version (lesson 03
    writes that one and asserts it).

    Every call: count the step, add the gradients into `accu_gradients`, call the
    original `apply_gradients` with `accu_gradients * apply` (apply = 1 on every `n`-th
    call, else 0), then reset with `accu_gradients * keep`. Like the question's, it
    returns None and validates nothing (`mask_trick.check_steps` does, for the
    installers). Create it where the question did: after the model is built, under the
    strategy scope (the accumulators are then `MirroredVariable`s with aggregation NONE,
    which every replica updates locally).
    """

    def __init__(self, n: int, orig_apply_gradients, trainable_variables):
        self.n = tf.constant(n, dtype=tf.int64)
        policy = tf.keras.mixed_precision.global_policy()
        self.variable_dtype = policy.variable_dtype
        self.accu_gradients = [
            tf.Variable(tf.zeros(g.shape, dtype=g.dtype)) for g in trainable_variables]
        self._current_step = tf.Variable(0, dtype=tf.int64)
        self.calls = tf.Variable(0, dtype=tf.int64)  # not in the question
        self._orig_apply_gradients = orig_apply_gradients

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        self.calls.assign_add(1)  # not in the question

        can_apply = self._can_apply_on_next_step()
        # 1.0 whenever we want to apply gradients; 0.0 otherwise
        apply = tf.cast(can_apply, dtype=self.variable_dtype)
        # Will be 0.0 if apply is 1.0 and vice versa
        keep = tf.cast(tf.logical_not(can_apply), dtype=self.variable_dtype)

        grads_and_vars = list(grads_and_vars)
        gradients = [grad for (grad, _) in grads_and_vars]
        trainable_variables = [var for (_, var) in grads_and_vars]

        # Accumulate gradients
        for i, grad in enumerate(gradients):
            self.accu_gradients[i].assign_add(grad)

        # Multiply each gradient with our apply-signal
        final_gradients = [grad * apply for grad in self.accu_gradients]

        self._orig_apply_gradients(zip(final_gradients, trainable_variables), *args, **kwargs)

        # This will reset our buffer whenever "keep" is 0.0
        for g in self.accu_gradients:
            g.assign(g * keep)

    def _can_apply_on_next_step(self):
        """
        :return: True if gradients should be applied; False otherwise.
        """
        # Increment (always do this first)
        self._current_step.assign_add(1)
        count_mod_steps = tf.math.mod(self._current_step, self.n)
        return tf.equal(count_mod_steps, 0)
