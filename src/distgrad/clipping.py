"""Clip the gradient the optimizer will *sum*, not each replica's part of it.

Keras 3 optimizers clip (`clipnorm`, `global_clipnorm`, `clipvalue`) in
`BaseOptimizer._clip_gradients`, *before* the SUM all-reduce inside
`TFOptimizer._backend_update_step`: under a strategy each replica's partial gradient is
clipped (cf. tensorflow/tensorflow#33929). This file imports only TensorFlow.
"""

from __future__ import annotations

import tensorflow as tf


def clip_by_global_norm_across_replicas(local_grads, clip_norm: float):
    """Scale this replica's gradients so that their *sum over replicas* is clipped.

    Each replica holds a partial gradient g_r; the optimizer will sum them. Clipping
    the sum G = sum_r g_r to norm `clip_norm` means multiplying G by
    s = min(1, clip_norm / ||G||). Because s is the same on every replica, passing
    s * g_r to `apply_gradients` makes the optimizer's SUM produce exactly s * G.
    Computing ||G|| costs one extra all-reduce. Call in replica context, with an
    optimizer that does not clip by itself. `None` gradients are passed through;
    `IndexedSlices` are densified for the norm.

    Raises:
        ValueError: `clip_norm` is not > 0.
        RuntimeError: called outside replica context (not inside `strategy.run`).
    """
    if clip_norm <= 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm}.")
    context = tf.distribute.get_replica_context()
    if context is None:
        raise RuntimeError(
            "clip_by_global_norm_across_replicas must be called in replica context, "
            "i.e. inside strategy.run.")
    present = [tf.convert_to_tensor(g) for g in local_grads if g is not None]
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, present)
    global_norm = tf.linalg.global_norm(summed)
    scale = tf.minimum(1.0, clip_norm / tf.maximum(global_norm, 1e-12))
    return [None if g is None else g * tf.cast(scale, g.dtype) for g in local_grads]
