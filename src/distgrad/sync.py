"""Where gradients are summed across replicas, and how to step with that in mind.

Inside `strategy.run`, a Keras 3 optimizer's `apply_gradients` runs in *replica
context*. The TensorFlow backend (`keras/src/backend/tensorflow/optimizer.py`,
`TFOptimizer._backend_update_step`) first calls `_all_reduce_sum_gradients`, which is
`ReplicaContext.all_reduce(SUM, grads)`: that is the sync point. (MirroredStrategy
implements it with a `merge_call`: every replica pauses and one `batch_reduce_to` runs
in cross-replica context.) It then calls `maybe_merge_call` ->
`ReplicaContext.merge_call`, which runs `_distributed_tf_update_step` once in
cross-replica context, where `extended.update(var, update_step, ...)` writes the same
update into every mirrored copy. `strategy.run` only launches the replicas; it
synchronizes nothing itself.

Consequences this module gives code for:

* the all-reduce is a SUM, so each replica's loss must be divided by the *global*
  batch size (`tf.nn.compute_average_loss`), not averaged per replica;
* Keras 3 has no switch to skip that SUM (`experimental_aggregate_gradients` is gone),
  so gradients you all-reduce yourself must not be passed to `apply_gradients`
  again, or they are summed twice;
* `clipnorm` / `global_clipnorm` clip *before* the SUM, i.e. each replica's partial
  gradient; `clip_by_global_norm_across_replicas` clips the summed gradient instead.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from distgrad.equivalence import per_example_squared_error, tiny_model, weights_of

LOSS_SCALINGS = ("global", "per_replica_mean")
APPLY_MODES = ("optimizer", "none", "all_reduce_then_optimizer", "clip_after_sync")


def replica_loss(per_example_loss, global_batch_size: int, loss_scaling: str = "global"):
    """Reduce a replica's per-example losses to the scalar it differentiates.

    "global": sum / global batch size (what `tf.nn.compute_average_loss` does): the
    SUM all-reduce of the gradients then yields the full-batch mean gradient.
    "per_replica_mean": mean over this replica's examples only; after the SUM
    all-reduce the gradient is R times the full-batch one.
    """
    if loss_scaling == "global":
        return tf.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)
    if loss_scaling == "per_replica_mean":
        return tf.reduce_mean(per_example_loss)
    raise ValueError(f"loss_scaling must be one of {LOSS_SCALINGS}, got {loss_scaling!r}.")


def all_reduce_sum(values):
    """SUM-all-reduce a list of tensors across replicas (call in replica context)."""
    context = tf.distribute.get_replica_context()
    if context is None:
        raise RuntimeError(
            "all_reduce_sum must be called in replica context, i.e. inside strategy.run."
        )
    return context.all_reduce(tf.distribute.ReduceOp.SUM, list(values))


def clip_by_global_norm_across_replicas(local_grads, clip_norm: float):
    """Scale this replica's gradients so that their *sum over replicas* is clipped.

    Each replica holds a partial gradient g_r; the optimizer will sum them. Clipping
    the sum G = sum_r g_r to norm `clip_norm` means multiplying G by
    s = min(1, clip_norm / ||G||). Because s is the same on every replica, passing
    s * g_r to `apply_gradients` makes the optimizer's SUM produce exactly s * G.
    Computing ||G|| costs one extra all-reduce. Call in replica context, with an
    optimizer that does not clip by itself. `None` gradients are passed through.
    """
    if clip_norm <= 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm}.")
    present = [g for g in local_grads if g is not None]
    if any(isinstance(g, tf.IndexedSlices) for g in present):
        present = [tf.convert_to_tensor(g) for g in present]
    summed = all_reduce_sum(present)
    global_norm = tf.linalg.global_norm(summed)
    scale = tf.minimum(1.0, clip_norm / tf.maximum(global_norm, 1e-12))
    return [None if g is None else g * tf.cast(scale, g.dtype) for g in local_grads]


def make_replica_step(global_batch_size: int, loss_scaling: str = "global",
                      apply: str = "optimizer", clip_norm: float | None = None,
                      loss_fn=per_example_squared_error):
    """The per-replica function of a custom loop, `fn(model, optimizer, x, y) -> loss`.

    `apply` chooses what happens to the gradients:
      * "optimizer": `optimizer.apply_gradients` (its SUM all-reduce is the sync);
      * "none": compute gradients only, update nothing;
      * "all_reduce_then_optimizer": all-reduce yourself, then `apply_gradients`
        (a pitfall: the optimizer sums again, the update is R times too large);
      * "clip_after_sync": `clip_by_global_norm_across_replicas(grads, clip_norm)`
        then `apply_gradients` (use with an optimizer without `clipnorm`).
    """
    if apply not in APPLY_MODES:
        raise ValueError(f"apply must be one of {APPLY_MODES}, got {apply!r}.")
    if apply == "clip_after_sync" and clip_norm is None:
        raise ValueError("apply='clip_after_sync' needs clip_norm.")
    replica_loss(tf.zeros([1]), 1, loss_scaling)  # validate the name early

    def replica_step(model, optimizer, x, y):
        with tf.GradientTape() as tape:
            per_example = loss_fn(y, model(x, training=True))
            loss = replica_loss(per_example, global_batch_size, loss_scaling)
        grads = tape.gradient(loss, model.trainable_variables)
        if apply == "none":
            return loss
        if apply == "all_reduce_then_optimizer":
            grads = all_reduce_sum(grads)
        elif apply == "clip_after_sync":
            grads = clip_by_global_norm_across_replicas(grads, clip_norm)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return replica_step


@dataclasses.dataclass
class RunResult:
    """What a distributed run produced.

    `initial` / `final` are weight lists; `reported_losses` what
    `strategy.reduce(SUM, per_replica_losses)` returned each step; `step_function`
    the `tf.function` that ran (for op counting) and `batch` one distributed batch.
    """

    initial: list
    final: list
    reported_losses: list
    iterations: int
    copies_agree: bool
    step_function: object
    batch: object
    model: object = None
    optimizer: object = None


def mirrored_copies_agree(variables) -> bool:
    """True when every per-device copy of every mirrored variable holds the same value."""
    for variable in variables:
        inner = getattr(variable, "value", variable)
        copies = getattr(inner, "values", (inner,))
        first = np.asarray(copies[0])
        if any(not np.array_equal(first, np.asarray(c)) for c in copies[1:]):
            return False
    return True


def run_steps(strategy, optimizer_factory, x, y, replica_step, steps: int = 1,
              model_factory=tiny_model) -> RunResult:
    """Train a fresh `model_factory()` for `steps` steps on the global batch `(x, y)`.

    The whole of `x` is one global batch; `strategy.experimental_distribute_dataset`
    hands replica r the r-th contiguous slice. Variables are created under
    `strategy.scope()`; the optimizer is built there too, before tracing.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}.")
    if len(x) % strategy.num_replicas_in_sync:
        raise ValueError(
            f"global batch {len(x)} is not divisible by {strategy.num_replicas_in_sync} replicas."
        )
    with strategy.scope():
        model = model_factory()
        optimizer = optimizer_factory()
        optimizer.build(model.trainable_variables)
    initial = weights_of(model)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x)).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def distributed_step(batch):
        per_replica_losses = strategy.run(replica_step, args=(model, optimizer, *batch))
        # Reporting only: this reduce moves losses, not gradients.
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    batch = None
    losses = []
    for _ in range(steps):
        batch = next(iterator)
        losses.append(float(distributed_step(batch)))
    return RunResult(
        initial=initial,
        final=weights_of(model),
        reported_losses=losses,
        iterations=int(optimizer.iterations.numpy()),
        copies_agree=mirrored_copies_agree(model.trainable_variables),
        step_function=distributed_step,
        batch=batch,
        model=model,
        optimizer=optimizer,
    )
