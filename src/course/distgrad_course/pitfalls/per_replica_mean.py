"""Pitfall: averaging the loss per replica instead of over the global batch.

The optimizer SUMs gradients across replicas, so with `reduce_mean` per replica the
applied gradient is R times the full-batch gradient: with SGD the first update is
exactly R times too large (one real cause of "unstable losses" under MirroredStrategy).
"""

from __future__ import annotations

import dataclasses

from distgrad_course.lab.data import regression_data
from distgrad_course.lab.recipes import make_replica_step, sgd_update_ratio


@dataclasses.dataclass(frozen=True)
class PerReplicaMeanRecord:
    """`ratio`: per-replica-mean update / one-device update (== replicas with SGD)."""

    replicas: int
    ratio: float
    global_scaling_ratio: float
    reported_loss_per_replica_mean: float
    reported_loss_global: float


def reproduce(strategy, learning_rate: float = 0.1, examples: int = 16) -> PerReplicaMeanRecord:
    """One SGD step on `examples` examples with each replica's loss a `reduce_mean` of its
    own examples, and one with the loss divided by the global batch, each against one
    big-batch step on one device; with the loss `strategy.reduce(SUM)` reports for each.
    """
    x, y = regression_data(examples)
    (mean_run, mean_ratio), (global_run, global_ratio) = (
        sgd_update_ratio(strategy, x, y, make_replica_step(len(x), scaling), learning_rate)
        for scaling in ("per_replica_mean", "global"))
    return PerReplicaMeanRecord(
        replicas=strategy.num_replicas_in_sync,
        ratio=mean_ratio,
        global_scaling_ratio=global_ratio,
        reported_loss_per_replica_mean=mean_run.reported_losses[0],
        reported_loss_global=global_run.reported_losses[0],
    )
