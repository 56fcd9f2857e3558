"""The custom-loop accumulation recipe: k micro-batches, `GradientAccumulator`, one apply.

`plan_micro_batches` splits an update's global batch; `update_loss` scales a micro-batch
loss for accumulation (and reproduces the two wrong scalings); `AccumulatedTrainer`
feeds the k micro-batches of a big batch to `GradientAccumulator`; `train_accumulated`
trains and records weights, losses and all-reduce counts.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from distgrad.accumulator import GradientAccumulator
from distgrad_course.lab.args import positive_int
from distgrad_course.lab.compare import mirrored_copies_agree, weights_of
from distgrad_course.lab.data import per_example_squared_error, tiny_model
from distgrad_course.lab.graph import CollectiveCount, count_collectives

LOSS_SCALINGS = ("update", "micro_batch", "per_replica_mean")


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
    """How one update's global batch splits: `accumulation_steps` micro-batches of
    `global_micro_batch` examples, `per_replica_micro_batch` on each replica."""

    global_batch: int
    accumulation_steps: int
    replicas: int

    @property
    def global_micro_batch(self) -> int:
        return self.global_batch // self.accumulation_steps

    @property
    def per_replica_micro_batch(self) -> int:
        return self.global_micro_batch // self.replicas


def plan_micro_batches(global_batch: int, accumulation_steps: int, replicas: int) -> MicroBatchPlan:
    """Validate and describe the split of `global_batch` into k micro-batches on R replicas.

    Raises ValueError for k < 1, a batch not divisible into k micro-batches, or a
    micro-batch not divisible across the replicas.
    """
    positive_int("accumulation_steps", accumulation_steps)
    if global_batch % accumulation_steps:
        raise ValueError(
            f"global batch {global_batch} is not divisible into {accumulation_steps} "
            "equal micro-batches; choose a batch that is a multiple of accumulation_steps.")
    micro = global_batch // accumulation_steps
    if micro % replicas:
        raise ValueError(
            f"micro-batch of {micro} examples is not divisible across {replicas} replicas; "
            f"make global_batch a multiple of accumulation_steps * replicas "
            f"({accumulation_steps * replicas}).")
    return MicroBatchPlan(global_batch, accumulation_steps, replicas)


def update_loss(per_example_loss, plan: MicroBatchPlan, loss_scaling: str = "update"):
    """One replica's micro-batch loss, scaled for accumulation.

    "update": sum / (per_replica_micro_batch * replicas * k) -- correct: the sum over k
    micro-steps (accumulator) and R replicas (optimizer) is the big batch's mean.
    "micro_batch": sum / global micro batch (right for small-batch training, k times
    too large when accumulated). "per_replica_mean": mean over this replica's
    micro-batch (R * k times too large when accumulated).
    """
    if loss_scaling == "update":
        return tf.nn.compute_average_loss(per_example_loss, global_batch_size=plan.global_batch)
    if loss_scaling == "micro_batch":
        return tf.nn.compute_average_loss(per_example_loss,
                                          global_batch_size=plan.global_micro_batch)
    if loss_scaling == "per_replica_mean":
        return tf.reduce_mean(per_example_loss)
    raise ValueError(f"loss_scaling must be one of {LOSS_SCALINGS}, got {loss_scaling!r}.")


def full_batch_loss(model, x, y, loss_fn=per_example_squared_error) -> float:
    """Mean loss of `model` on the whole `(x, y)` (eager, for curves)."""
    return float(tf.reduce_mean(loss_fn(tf.constant(y), model(tf.constant(x), training=False))))


@dataclasses.dataclass
class AccumulatedRun:
    """What `train_accumulated` produced.

    `weights_per_update[i]`: weights after update i+1 (`final` is the last);
    `losses[i]`: full-batch loss before update i (`losses[-1]` after the last);
    `reported_losses[i]`: the sum over micro-steps and replicas of the scaled
    micro-batch losses of update i (== `losses[i]` with "update" scaling);
    `accumulate` / `apply`: collective counts of the two traced functions;
    `all_reduces_per_update`: k * accumulate + applies_per_update * apply.
    """

    initial: list
    final: list
    weights_per_update: list
    losses: list
    reported_losses: list
    iterations: int
    micro_steps_left: int
    accumulate: CollectiveCount
    apply: CollectiveCount
    all_reduces_per_update: int
    copies_agree: bool
    trainer: AccumulatedTrainer


class AccumulatedTrainer:
    """A model, optimizer and `GradientAccumulator` under `strategy.scope()`, fed the
    k micro-batches of the big batch `(x, y)`.

    Micro-batch j is `x[j*g:(j+1)*g]` with g = global micro batch; MirroredStrategy's
    distributed dataset gives replica r the r-th contiguous slice of it, so the k*R
    slices of one update are exactly the big batch. `accumulate_step(j)` adds
    micro-batch j; `apply_step()` applies; `update()` does k of the first and one of
    the second. With `apply_every_micro_step=True` it is naive small-batch training
    (loss scaled by the micro batch, one optimizer step per micro-batch).
    """

    def __init__(self, strategy, optimizer_factory, x, y, accumulation_steps: int,
                 model_factory=tiny_model, loss_fn=per_example_squared_error,
                 loss_scaling: str = "update", apply_every_micro_step: bool = False):
        self.strategy = strategy
        self.plan = plan_micro_batches(len(x), accumulation_steps, strategy.num_replicas_in_sync)
        if apply_every_micro_step:
            loss_scaling = "micro_batch"
        update_loss(tf.zeros([1]), self.plan, loss_scaling)  # validate the name early
        self.loss_scaling = loss_scaling
        self.apply_every_micro_step = apply_every_micro_step
        self.x, self.y, self.loss_fn = x, y, loss_fn
        with strategy.scope():
            self.model = model_factory()
            self.optimizer = optimizer_factory()
            self.accumulator = GradientAccumulator(self.model.trainable_variables)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(self.plan.global_micro_batch)
        self.micro_batches = list(strategy.experimental_distribute_dataset(dataset))
        model, accumulator, plan = self.model, self.accumulator, self.plan

        def replica_accumulate(xb, yb):
            with tf.GradientTape() as tape:
                per_example = loss_fn(yb, model(xb, training=True))
                loss = update_loss(per_example, plan, loss_scaling)
            accumulator.add(tape.gradient(loss, model.trainable_variables))
            return loss

        @tf.function
        def accumulate_function(batch):
            per_replica_loss = strategy.run(replica_accumulate, args=batch)
            # Reporting only: the losses go to the host, no gradient moves.
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_loss, axis=None)

        self.accumulate_function = accumulate_function
        self.apply_step = accumulator.make_apply_step(self.optimizer)

    def accumulate_step(self, j: int) -> float:
        return float(self.accumulate_function(self.micro_batches[j]))

    def update(self) -> float:
        """One update (k micro-steps, then apply); returns the summed reported loss."""
        reported = 0.0
        for j in range(self.plan.accumulation_steps):
            reported += self.accumulate_step(j)
            if self.apply_every_micro_step:
                self.apply_step()
        if not self.apply_every_micro_step:
            self.apply_step()
        return reported

    def checkpoint(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer,
                                   accumulator=self.accumulator)

    def collectives(self) -> tuple[CollectiveCount, CollectiveCount]:
        replicas = self.strategy.num_replicas_in_sync
        return (count_collectives(self.accumulate_function, self.micro_batches[0],
                                  replicas=replicas),
                count_collectives(self.apply_step.function, replicas=replicas))


def train_accumulated(strategy, optimizer_factory, x, y, accumulation_steps: int,
                      updates: int = 1, model_factory=tiny_model,
                      loss_fn=per_example_squared_error, loss_scaling: str = "update",
                      apply_every_micro_step: bool = False) -> AccumulatedRun:
    """Train a fresh `model_factory()` for `updates` updates of k accumulated micro-batches.

    Each update's k micro-batches together are exactly the big batch `(x, y)`, so with
    the default "update" loss scaling the weights equal `big_batch_reference(...,
    steps=updates)` up to float rounding. Raises ValueError for `updates < 1` and for
    the bad splits `plan_micro_batches` rejects.
    """
    positive_int("updates", updates)
    trainer = AccumulatedTrainer(strategy, optimizer_factory, x, y, accumulation_steps,
                                 model_factory, loss_fn, loss_scaling, apply_every_micro_step)
    initial = weights_of(trainer.model)
    losses, reported, history = [full_batch_loss(trainer.model, x, y, loss_fn)], [], []
    for _ in range(updates):
        reported.append(trainer.update())
        history.append(weights_of(trainer.model))
        losses.append(full_batch_loss(trainer.model, x, y, loss_fn))
    accumulate, apply = trainer.collectives()
    applies = accumulation_steps if apply_every_micro_step else 1
    return AccumulatedRun(
        initial=initial,
        final=history[-1],
        weights_per_update=history,
        losses=losses,
        reported_losses=reported,
        iterations=int(trainer.optimizer.iterations.numpy()),
        micro_steps_left=trainer.accumulator.micro_steps,
        accumulate=accumulate,
        apply=apply,
        all_reduces_per_update=accumulation_steps * accumulate.all_reduces
        + applies * apply.all_reduces,
        copies_agree=mirrored_copies_agree(trainer.model.trainable_variables),
        trainer=trainer,
    )
