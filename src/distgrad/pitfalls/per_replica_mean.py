"""Pitfall: averaging the loss per replica instead of over the global batch.

The optimizer SUMs gradients across replicas, so with `reduce_mean` per replica the
applied gradient is R times the full-batch gradient: with SGD the first update is
exactly R times too large (one real cause of "unstable losses" under MirroredStrategy).
"""

from __future__ import annotations

import dataclasses

import keras

from distgrad.lab.compare import update_ratio, updates
from distgrad.lab.data import regression_data
from distgrad.lab.recipes import big_batch_reference, make_replica_step, run_steps


@dataclasses.dataclass(frozen=True)
class PerReplicaMeanRecord:
    """`ratio`: per-replica-mean update / one-device update (== replicas with SGD)."""

    replicas: int
    ratio: float
    global_scaling_ratio: float
    reported_loss_per_replica_mean: float
    reported_loss_global: float


def reproduce(strategy, learning_rate: float = 0.1, examples: int = 16) -> PerReplicaMeanRecord:
    x, y = regression_data(examples)
    optimizer = lambda: keras.optimizers.SGD(learning_rate)  # noqa: E731
    reference = big_batch_reference(optimizer, x, y)
    runs = {
        scaling: run_steps(strategy, optimizer, x, y, make_replica_step(len(x), scaling))
        for scaling in ("per_replica_mean", "global")
    }
    reference_update = updates(reference, runs["global"].initial)
    return PerReplicaMeanRecord(
        replicas=strategy.num_replicas_in_sync,
        ratio=update_ratio(updates(runs["per_replica_mean"].final, runs["per_replica_mean"].initial),
                           reference_update),
        global_scaling_ratio=update_ratio(updates(runs["global"].final, runs["global"].initial),
                                          reference_update),
        reported_loss_per_replica_mean=runs["per_replica_mean"].reported_losses[0],
        reported_loss_global=runs["global"].reported_losses[0],
    )
