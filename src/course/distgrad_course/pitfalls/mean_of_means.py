"""Pitfall: averaging per-micro-batch (or per-replica) token means.

A tiny per-token regression over padded sequences: the gradient of the big-batch token
mean is compared with (a) k accumulated micro-batches, each normalized by its own token
count and averaged ("mean of means"), (b) the same micro-batches normalized by the
update's total token count, and (c) the same two choices across R replicas.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from distgrad.normalization import count_tokens, global_token_count, token_loss


def padded_sequences(examples: int = 8, time: int = 6, features: int = 3, seed: int = 0):
    """`(x, y, mask)`: random sequences, long ones first and short ones last, so that
    contiguous micro-batches (and replica shards) hold very different token counts."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, time, features)).astype("float32")
    y = rng.normal(size=(examples, time, 1)).astype("float32")
    lengths = np.linspace(time, 1, examples).round().astype(int)
    mask = (np.arange(time)[None, :] < lengths[:, None]).astype("float32")
    return x, y, mask


def token_model(features: int = 3, seed: int = 0) -> keras.Model:
    return keras.Sequential([
        keras.Input((None, features)),
        keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=seed)),
    ])


def _per_token_loss(model, x, y):
    return tf.reduce_mean(tf.square(model(x) - y), axis=-1)


def _grads(model, x, y, mask, normalizer):
    with tf.GradientTape() as tape:
        loss = token_loss(_per_token_loss(model, x, y), mask, normalizer)
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def _max_abs(a, b):
    return float(max(np.abs(x - y).max() for x, y in zip(a, b)))


@dataclasses.dataclass(frozen=True)
class MeanOfMeansRecord:
    """Max abs gradient difference from the big-batch token-mean gradient."""

    micro_batches: int
    token_counts: tuple
    mean_of_means_vs_big_batch: float
    global_count_vs_big_batch: float
    gradient_scale: float
    replicas: int | None = None
    per_replica_mean_vs_big_batch: float | None = None
    global_count_across_replicas_vs_big_batch: float | None = None


def reproduce(micro_batches: int = 2, strategy=None) -> MeanOfMeansRecord:
    x, y, mask = padded_sequences()
    model = token_model()
    big = _grads(model, x, y, mask, count_tokens(mask))
    parts = np.split(np.arange(len(x)), micro_batches)
    counts = tuple(float(count_tokens(mask[p])) for p in parts)
    mean_of_means = [sum(g) / micro_batches for g in zip(*[
        _grads(model, x[p], y[p], mask[p], count_tokens(mask[p])) for p in parts])]
    total = count_tokens(mask)
    global_count = [sum(g) for g in zip(*[
        _grads(model, x[p], y[p], mask[p], total) for p in parts])]
    record = dict(
        micro_batches=micro_batches, token_counts=counts,
        mean_of_means_vs_big_batch=_max_abs(mean_of_means, big),
        global_count_vs_big_batch=_max_abs(global_count, big),
        gradient_scale=float(max(np.abs(g).max() for g in big)),
    )
    if strategy is not None:
        record.update(_across_replicas(strategy, x, y, mask, big))
    return MeanOfMeansRecord(**record)


def _across_replicas(strategy, x, y, mask, big):
    with strategy.scope():
        model = token_model()
    replicas = strategy.num_replicas_in_sync
    dataset = tf.data.Dataset.from_tensor_slices((x, y, mask)).batch(len(x))
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    def replica_fn(xb, yb, mb, use_global_count):
        normalizer = global_token_count(mb) if use_global_count else count_tokens(mb)
        with tf.GradientTape() as tape:
            loss = token_loss(_per_token_loss(model, xb, yb), mb, normalizer)
        grads = tape.gradient(loss, model.trainable_variables)
        # SUM across replicas, like the optimizer; per-replica means are then averaged
        scale = 1.0 if use_global_count else 1.0 / replicas
        return [g * scale for g in grads]

    results = {}
    for use_global_count in (False, True):
        @tf.function
        def step(batch, flag=use_global_count):
            per_replica = strategy.run(replica_fn, args=(*batch, flag))
            return [strategy.reduce(tf.distribute.ReduceOp.SUM, g, axis=None) for g in per_replica]

        results[use_global_count] = _max_abs([g.numpy() for g in step(batch)], big)
    return dict(replicas=replicas, per_replica_mean_vs_big_batch=results[False],
                global_count_across_replicas_vs_big_batch=results[True])
