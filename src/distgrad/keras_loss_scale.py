"""Keras' own `LossScaleOptimizer` around an `AccumulatingOptimizer`.

On 2+ replicas it is refused in `build` (it checks replica 0's gradients only): compile
`AllReplicasFiniteLossScaleOptimizer(AccumulatingOptimizer(inner, k))` instead. On one
replica it is correct, and `AccumulatingOptimizer` counts the micro-batches it skips
(`skipped_micro_batches`) and warns of them at the end of `fit`. Keras' wrapper gives its
inner optimizer no reference to itself: it is found among the inner one's referrers
(`gc.get_referrers`). Copied with `optimizer.py`; it imports only TensorFlow and Keras.
Design notes: docs/design.md, "Keras' own `LossScaleOptimizer` around
`AccumulatingOptimizer`".
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref

import keras
import tensorflow as tf

# Keras' own LossScaleOptimizer around it on 2+ replicas, refused in `build`.
STOCK_WRAPPER_MESSAGE = (
    "Under mixed_float16 on {replicas} replicas, hand model.compile the loss-scale wrapper "
    "yourself: model.compile(optimizer=distgrad.AllReplicasFiniteLossScaleOptimizer("
    "distgrad.AccumulatingOptimizer(inner, accumulation_steps)), ...) (a custom loop wraps "
    "it the same way). Keras' own LossScaleOptimizer around it (compile adds one) checks "
    "replica 0's gradients only: distgrad lesson 04 "
    "(notebooks/04_loss_scale_optimizer_pitfall.py).")
# Keras' wrapper on one replica, when it cannot be found to read its loss scale.
UNFOUND_WRAPPER_MESSAGE = (
    "Under mixed_float16, hand model.compile the loss-scale wrapper yourself: "
    "model.compile(optimizer=distgrad.AllReplicasFiniteLossScaleOptimizer("
    "distgrad.AccumulatingOptimizer(inner, accumulation_steps)), ...). Keras' "
    "LossScaleOptimizers found around this AccumulatingOptimizer: {found}, or it was built "
    "before one wrapped it; so it could not count the micro-batches a wrapper skips.")


def loss_scale_optimizers_around(optimizer) -> list:
    """Keras' LossScaleOptimizers whose inner optimizer is `optimizer`, found among its
    referrers (directly, or through an instance's `__dict__`)."""
    referrers = gc.get_referrers(optimizer)
    dicts = [r for r in referrers if isinstance(r, dict)]
    found = []
    for candidate in referrers + (gc.get_referrers(*dicts) if dicts else []):
        if (isinstance(candidate, keras.optimizers.LossScaleOptimizer)
                and vars(candidate).get("inner_optimizer") is optimizer
                and not any(candidate is f for f in found)):
            found.append(candidate)
    return found


def check_loss_scale_wrapper(optimizer) -> None:
    """Refuse Keras' own wrapper around `optimizer` on 2+ replicas; on one, find it (once).

    Called in `build` (before any weight moves) and in `apply`."""
    if not optimizer._under_loss_scaling or optimizer.overflow_checked_on_every_replica:
        return
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1:
        raise ValueError(STOCK_WRAPPER_MESSAGE.format(replicas=replicas))
    if optimizer._stock_wrapper is None:
        wrappers = loss_scale_optimizers_around(optimizer)
        if len(wrappers) != 1:  # one left over from an earlier compile, not collected?
            gc.collect()
            wrappers = loss_scale_optimizers_around(optimizer)
        if len(wrappers) != 1 or optimizer.built:  # built alone: no counter for its skips
            raise ValueError(UNFOUND_WRAPPER_MESSAGE.format(found=len(wrappers)))
        optimizer._stock_wrapper = weakref.ref(wrappers[0])  # no checkpoint dependency


def add_skip_counters(optimizer) -> None:
    """In `build`, under Keras' wrapper: `skipped_micro_batches` and the wrapper's scale as
    the last micro-batch left it (`_next_loss_scale`; each skip halves it)."""
    optimizer.skipped_micro_batches = optimizer.add_variable(
        (), initializer="zeros", dtype=optimizer._iterations.dtype,
        aggregation="only_first_replica", name="skipped_micro_batches")
    optimizer._next_loss_scale = optimizer.add_variable(
        (), initializer=keras.initializers.Constant(optimizer._stock_wrapper().initial_scale),
        dtype="float32", aggregation="only_first_replica", name="next_loss_scale")


def count_skips(optimizer, end_of_fit=False) -> None:
    """In `apply` (and at the end of `fit`): add the skips since the last call to
    `skipped_micro_batches`. Each skip halves the wrapper's scale, so the halvings count them
    exactly (powers of 2)."""
    if not end_of_fit and optimizer._micro_skips_reported is None:  # the first trace: a
        with tf.init_scope():  # restored count is old
            optimizer._micro_skips_reported = int(
                keras.ops.convert_to_numpy(optimizer.skipped_micro_batches))
    wrapper = optimizer._stock_wrapper()
    scale = tf.convert_to_tensor(wrapper.dynamic_scale)
    skipped = tf.math.log(optimizer._next_loss_scale / scale) / math.log(2.0)
    optimizer.skipped_micro_batches.assign_add(tf.cast(tf.round(skipped), tf.int64))
    if not end_of_fit:  # then this call's own step: doubles the scale after enough
        scale = tf.where(tf.equal(wrapper.step_counter, wrapper.dynamic_growth_steps - 1),
                         2.0 * scale, scale)
    optimizer._next_loss_scale.assign(scale)


def warn_of_skips(optimizer) -> None:
    """At the end of `fit`: a `UserWarning` if micro-batches were skipped since the last."""
    count_skips(optimizer, end_of_fit=True)  # the skips after the last call
    skipped = int(keras.ops.convert_to_numpy(optimizer.skipped_micro_batches))
    before = optimizer._micro_skips_reported or 0
    if skipped > before:
        scale = float(optimizer._stock_wrapper().dynamic_scale.numpy())
        warnings.warn(
            f"AccumulatingOptimizer: {skipped - before} micro-batch(es) skipped in this fit "
            f"({skipped} in all, `skipped_micro_batches`): their gradients overflowed, "
            f"and Keras' LossScaleOptimizer halved its scale each time (now {scale:g}). A "
            "few are expected while the scale comes down from its initial value.",
            stacklevel=3)
    optimizer._micro_skips_reported = skipped
