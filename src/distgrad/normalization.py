"""Normalizing a token-level loss when micro-batches (or replicas) hold unequal counts.

With padding or variable-length sequences, each micro-batch holds a different number of
real tokens. The big-batch loss is `sum(loss * mask) / total_tokens`. Averaging
per-micro-batch means (`sum_i / count_i`, then mean over i) weights a token in a short
micro-batch more than one in a long micro-batch — the bug several training libraries
shipped in 2024. The fix: divide every micro-batch's masked *sum* by the token count of
the whole update — all micro-batches, all replicas — known before the first micro-step.
"""

from __future__ import annotations

import tensorflow as tf


def count_tokens(mask) -> tf.Tensor:
    """Number of real (mask != 0) tokens, float32."""
    return tf.reduce_sum(tf.cast(mask, tf.float32))


def global_token_count(local_mask) -> tf.Tensor:
    """Tokens across all replicas: this replica's count, SUM-all-reduced.

    Call in replica context (inside `strategy.run`); outside a strategy it is the local
    count. One scalar all-reduce: cheap, and it must be the same on every replica.
    """
    local = count_tokens(local_mask)
    context = tf.distribute.get_replica_context()
    if context is None:
        raise RuntimeError("global_token_count must be called inside strategy.run.")
    return context.all_reduce(tf.distribute.ReduceOp.SUM, local)


def token_loss(per_token_loss, mask, normalizer) -> tf.Tensor:
    """`sum(per_token_loss * mask) / normalizer`.

    Pass the token count of the whole update (all micro-batches, all replicas) as
    `normalizer`; the gradients of the micro-batches then *sum* to the big-batch gradient.
    Raises ValueError (eagerly) for a normalizer that is not positive.
    """
    normalizer = tf.cast(normalizer, tf.float32)
    if tf.executing_eagerly() and float(normalizer) <= 0:
        raise ValueError(f"normalizer must be > 0 (a token count), got {float(normalizer)}.")
    mask = tf.cast(mask, per_token_loss.dtype)
    return tf.reduce_sum(per_token_loss * mask) / tf.cast(normalizer, per_token_loss.dtype)
