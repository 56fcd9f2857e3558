"""The training recipes lessons and tests compare, weight for weight.

* `big_batch_reference`: plain steps on the whole batch, one device: the reference.
* `make_replica_step` + `run_steps`: a custom loop, `strategy.run(replica_step)` per step;
  `untraced_sgd_step`: one such step, not yet traced, for spies.
* `fit_run` / `custom_loop_run`: `model.fit` and a per-batch custom loop with any
  optimizer (e.g. `AccumulatingOptimizer`).

Keras 3 optimizers all-reduce (SUM) the gradients inside `apply_gradients`
(`TFOptimizer._backend_update_step`), so each replica's loss is divided by the
*global* batch size; "per_replica_mean" and "all_reduce_then_optimizer" are the
pitfalls of lesson 01 (R times too large updates).
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from distgrad.clipping import clip_by_global_norm_across_replicas
from distgrad_course.lab.args import positive_int
from distgrad_course.lab.compare import mirrored_copies_agree, weights_of
from distgrad_course.lab.data import per_example_squared_error, regression_data, tiny_model

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


def run_steps(strategy, optimizer_factory, x, y, replica_step, steps: int = 1,
              model_factory=tiny_model) -> RunResult:
    """Train a fresh `model_factory()` for `steps` steps on the global batch `(x, y)`.

    The whole of `x` is one global batch; `strategy.experimental_distribute_dataset`
    hands replica r the r-th contiguous slice. Variables are created under
    `strategy.scope()`; the optimizer is built there too, before tracing.
    """
    positive_int("steps", steps)
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


def untraced_sgd_step(strategy, examples: int = 16):
    """`(distributed_step, batch)`: a `tf.function` not traced yet, which runs
    `make_replica_step(examples)` through `strategy.run` on a fresh `tiny_model` with a
    built `SGD(0.1)`, and one distributed batch of `regression_data(examples)`.

    Tracing it, `distributed_step.get_concrete_function(batch)`, runs the Python of one
    SGD step (what a spy sees) and updates nothing.
    """
    x, y = regression_data(examples)
    with strategy.scope():
        model, optimizer = tiny_model(), keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    step = make_replica_step(examples)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(examples))))

    @tf.function
    def distributed_step(batch):
        return strategy.run(step, args=(model, optimizer, *batch))

    return distributed_step, batch


def big_batch_reference(optimizer_factory, x, y, steps: int = 1, model_factory=tiny_model,
                        loss_fn=per_example_squared_error) -> list[np.ndarray]:
    """Weights after `steps` plain steps on the whole `(x, y)` batch, one device, no strategy.

    `optimizer_factory()` returns a fresh Keras optimizer. This is the reference every
    distributed or accumulated recipe must match.
    """
    with tf.distribute.get_strategy().scope():
        model = model_factory()
        optimizer = optimizer_factory()
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(yb, model(xb, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(steps):
        step(tf.constant(x), tf.constant(y))
    return weights_of(model)


def dense_gradient_reference(optimizer_factory, x, y, steps: int = 1, model_factory=tiny_model,
                             loss_fn=per_example_squared_error) -> list[np.ndarray]:
    """`big_batch_reference`, but every `tf.IndexedSlices` gradient densified first.

    The like-for-like reference for an accumulator (which always hands the optimizer
    dense gradients) when Keras' optimizer arithmetic differs between sparse and dense
    gradients (Adam with repeated embedding rows).
    """
    model, optimizer = model_factory(), optimizer_factory()
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(yb, model(xb, training=True)))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(steps):
        step(tf.constant(x), tf.constant(y))
    return weights_of(model)


@dataclasses.dataclass
class TrainingRun:
    """Weights before/after a training recipe, and the optimizer's counters.

    `updates` is `optimizer.iterations` (updates made); `total_micro_steps` the
    micro-batches an `AccumulatingOptimizer` accumulated (`updates` for other optimizers).
    A custom loop also returns its `step_function` (the `tf.function` that ran) and the
    last distributed `batch` it ran on, for graph inspection.
    """

    initial: list
    final: list
    updates: int
    total_micro_steps: int
    model: object
    optimizer: object
    step_function: object = None
    batch: object = None


def _counters(optimizer) -> tuple[int, int]:
    updates = int(np.asarray(keras.ops.convert_to_numpy(optimizer.iterations)))
    total = getattr(optimizer, "total_micro_steps", None)
    return updates, updates if total is None else int(keras.ops.convert_to_numpy(total))


def fit_run(strategy, optimizer_factory, x, y, batch_size: int, epochs: int = 1,
            model_factory=tiny_model, loss="mse", prepare=None,
            jit_compile="auto") -> TrainingRun:
    """`model.fit(x, y, batch_size, shuffle=False)` of a fresh model under `strategy`.

    `strategy=None` trains without a strategy. The model and `optimizer_factory()` are
    created inside `strategy.scope()`, as Keras requires; there `prepare(model,
    optimizer)`, if given, runs before `compile` (e.g. to patch the optimizer). Seeded
    initializers and no shuffling make two runs comparable weight for weight.
    `jit_compile` is `compile`'s.
    """
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        model = model_factory()
        optimizer = optimizer_factory()
        if prepare is not None:
            prepare(model, optimizer)
        model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    initial = weights_of(model)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    updates, total_micro_steps = _counters(model.optimizer)
    return TrainingRun(initial, weights_of(model), updates, total_micro_steps, model,
                       model.optimizer)


def custom_loop_run(strategy, optimizer_factory, x, y, batch_size: int,
                    model_factory=tiny_model, loss_batch: int | None = None,
                    prepare=None) -> TrainingRun:
    """A `tf.function` custom loop: one `strategy.run(replica_step)` per batch of `x`.

    `replica_step` is `make_replica_step(loss_batch or batch_size)`: per-example loss
    summed and divided by `loss_batch` (default: the global batch), then
    `optimizer.apply_gradients` in replica context. `strategy=None` trains without a
    strategy. Under `strategy.scope()` the model is created and the optimizer built,
    then `prepare(model, optimizer)` runs if given (e.g. to patch the optimizer).
    """
    strategy = strategy or tf.distribute.get_strategy()
    if len(x) % batch_size:
        raise ValueError(f"{len(x)} examples are not a whole number of batches of {batch_size}.")
    with strategy.scope():
        model = model_factory()
        optimizer = optimizer_factory()
        optimizer.build(model.trainable_variables)
        if prepare is not None:
            prepare(model, optimizer)
    initial = weights_of(model)
    replica_step = make_replica_step(loss_batch or batch_size)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)

    @tf.function
    def distributed_step(batch):
        return strategy.run(replica_step, args=(model, optimizer, *batch))

    for batch in strategy.experimental_distribute_dataset(dataset):
        distributed_step(batch)
    updates, total_micro_steps = _counters(optimizer)
    return TrainingRun(initial, weights_of(model), updates, total_micro_steps, model, optimizer,
                       step_function=distributed_step, batch=batch)


def sgd_update_ratio(strategy, x, y, replica_step, learning_rate: float = 0.1):
    """`(run, r)`: one SGD step of `replica_step` on the global batch `(x, y)` under
    `strategy`, and r with its update == r * one big-batch step's update on one device."""
    from distgrad_course.lab.compare import update_ratio, updates

    def sgd():
        return keras.optimizers.SGD(learning_rate)

    run = run_steps(strategy, sgd, x, y, replica_step)
    reference = big_batch_reference(sgd, x, y)
    return run, update_ratio(updates(run.final, run.initial), updates(reference, run.initial))
