"""Pitfall: the last, smaller batch of an epoch divided by the full global batch size.

`tf.data.Dataset.batch(GLOBAL_BATCH)` without `drop_remainder` ends with a smaller
batch, and MirroredStrategy splits it as evenly as it can (7 examples on 2 replicas:
4 and 3). Three ways to divide a replica's summed loss, for one SGD step on that batch:

* "fixed": `compute_average_loss(..., global_batch_size=GLOBAL_BATCH)`: every gradient
  shrinks by `examples / GLOBAL_BATCH` (the tutorial's constant);
* "per_replica_times_r": `compute_average_loss(per_example)`, whose default is this
  replica's count * R (`nn_impl_distribute.py`): right when the batch splits evenly,
  wrong weights per replica otherwise (4 * 2 and 3 * 2 for 7 examples);
* "counted": divide by the examples this step holds on all replicas,
  `global_batch_size_of(per_example)` (one more, scalar, all-reduce): right in every
  case.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from distgrad_course.lab.compare import WeightDiff, update_ratio, updates, weight_diff, weights_of
from distgrad_course.lab.data import per_example_squared_error, regression_data, tiny_model
from distgrad_course.lab.recipes import big_batch_reference

SCALINGS = ("fixed", "per_replica_times_r", "counted")


def global_batch_size_of(per_example_loss):
    """The examples of this step on all replicas (int32): this replica's count,
    SUM-all-reduced.

    Call in replica context (inside `strategy.run`). Raises RuntimeError otherwise.
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        raise RuntimeError("global_batch_size_of must be called inside strategy.run.")
    # A float32 count goes through the same collective all-reduce as the gradients (an
    # int32 one is gathered onto one device with AddN under MirroredStrategy).
    local = tf.cast(tf.shape(per_example_loss)[0], tf.float32)
    return tf.cast(context.all_reduce(tf.distribute.ReduceOp.SUM, local), tf.int32)


def make_replica_step(scaling: str, global_batch_size: int):
    """The tutorial's replica step, its loss divided the `scaling` way."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}.")

    def replica_step(model, optimizer, x, y):
        with tf.GradientTape() as tape:
            per_example = per_example_squared_error(y, model(x, training=True))
            if scaling == "fixed":
                divisor = global_batch_size
            elif scaling == "counted":
                divisor = global_batch_size_of(per_example)
            else:
                divisor = None  # compute_average_loss' default: local count * R
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=divisor)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    return replica_step


def one_step(strategy, replica_step, x, y, learning_rate: float = 0.1):
    """Weights `(initial, final)` after one SGD step of `replica_step` on the batch `(x, y)`,
    whatever its size (the distributed dataset splits it), and the per-replica counts."""
    with strategy.scope():
        model, optimizer = tiny_model(), keras.optimizers.SGD(learning_rate)
        optimizer.build(model.trainable_variables)
    initial = weights_of(model)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x)))))
    counts = [int(t.shape[0]) for t in strategy.experimental_local_results(batch[0])]
    tf.function(lambda b: strategy.run(replica_step, args=(model, optimizer, *b)))(batch)
    return initial, weights_of(model), counts


@dataclasses.dataclass(frozen=True)
class LastBatchRow:
    """One last batch and one scaling: the SGD update as a multiple of one device's
    (`ratio`, least squares) and the weights against one device (`vs_one_device`)."""

    examples: int
    per_replica: tuple
    scaling: str
    ratio: float
    vs_one_device: WeightDiff


def reproduce(strategy, global_batch_size: int | None = None,
              learning_rate: float = 0.1) -> list[LastBatchRow]:
    """Rows for a last batch of `global_batch_size / 2` examples (splits evenly) and of
    one fewer (does not), each with every scaling. `global_batch_size` defaults to
    8 * R and must be a multiple of 2 * R."""
    replicas = strategy.num_replicas_in_sync
    global_batch_size = global_batch_size or 8 * replicas
    if global_batch_size % (2 * replicas):
        raise ValueError(f"global_batch_size must be a multiple of {2 * replicas}.")
    rows = []
    for examples in (global_batch_size // 2, global_batch_size // 2 - 1):
        x, y = regression_data(examples)
        reference = big_batch_reference(lambda: keras.optimizers.SGD(learning_rate), x, y)
        for scaling in SCALINGS:
            initial, final, counts = one_step(
                strategy, make_replica_step(scaling, global_batch_size), x, y, learning_rate)
            rows.append(LastBatchRow(
                examples, tuple(counts), scaling,
                update_ratio(updates(final, initial), updates(reference, initial)),
                weight_diff(final, reference)))
    return rows
