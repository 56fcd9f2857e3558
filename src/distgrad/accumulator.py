"""`GradientAccumulator`: accumulate k micro-batches per replica, sync once per update.

The shape is OpenNMT-tf's trainer: one `tf.function` *accumulates* (forward,
backward, add the gradients to replica-local buffers, no communication), another
*applies* (one `optimizer.apply_gradients` inside `strategy.run`, whose SUM
all-reduce is the only sync of the update), and plain Python decides when to call
the second. Nothing in the traced code branches on the micro-step, so no
synchronization point ever sits inside traced control flow.

Where the state lives, and why:

* Each accumulator is a `tf.Variable(synchronization=ON_READ, aggregation=SUM)`
  created under `strategy.scope()`: MirroredStrategy makes it a
  `SyncOnReadVariable` (tensorflow/python/distribute/values.py) with one
  independent copy per replica. In replica context `assign_add` and reads touch
  only the local copy, so accumulating costs zero collectives. Read in
  cross-replica context it is reduced (SUM): the gradient the all-reduce would
  produce. A checkpoint saves that SUM and restores it as SUM / R on every replica
  (`values_util.get_on_read_restore_ops`): the per-replica split changes, the sum
  the next update applies does not. (OpenNMT-tf's accumulator,
  `opennmt/optimizers/utils.py`, uses `aggregation=NONE`; with 2+ replicas such a
  variable can be neither read in cross-replica context nor saved: "Could not
  convert from `tf.VariableAggregation` ... NONE to`tf.distribute.ReduceOp`".)
* Accumulators are float32 (float64 for float64 variables) whatever the variable
  dtype: summing k float16/bfloat16 gradients in their own dtype loses the small
  ones. `gradients()` casts back to each variable's dtype.
* The micro-step counter is `ON_READ` with `ONLY_FIRST_REPLICA`: every replica
  counts locally (no merge_call, unlike an ON_WRITE variable updated in replica
  context), a checkpoint saves replica 0's count and restores it everywhere.

Loss scaling: the optimizer SUMs over replicas and the accumulator sums over
micro-steps, so each micro-batch loss is divided by the global batch of the whole
*update*, `micro_batch_per_replica * replicas * k` (`update_loss`): the sum of all
k * R gradients is then exactly the mean gradient of the big batch.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from distgrad.collectives import CollectiveCount, count_collectives
from distgrad.equivalence import per_example_squared_error, tiny_model, weights_of
from distgrad.sync import mirrored_copies_agree

LOSS_SCALINGS = ("update", "micro_batch", "per_replica_mean")


class _Untracked:
    """Holds the model's variables without making them checkpoint dependencies."""

    def __init__(self, values):
        self.values = list(values)


def _distributed_strategy_of(variable):
    """The strategy that owns `variable` (a Keras or tf variable), or None."""
    inner = variable.value if isinstance(variable, keras.Variable) else variable
    if isinstance(inner, tf.distribute.DistributedValues):
        return inner.distribute_strategy
    return None


def _accumulator_dtype(dtype: tf.DType) -> tf.DType:
    if not dtype.is_floating:
        raise TypeError(f"cannot accumulate gradients of a {dtype.name} variable.")
    return tf.float64 if dtype == tf.float64 else tf.float32


class GradientAccumulator(tf.Module):
    """Replica-local gradient buffers for a list of variables, plus a micro-step counter.

    Create it under `strategy.scope()` (the same strategy that created the
    variables). Then, per micro-batch, inside `strategy.run`:
    `accumulator.add(tape.gradient(loss, variables))`; once per update, call the
    function returned by `make_apply_step(optimizer)` (or, inside your own
    `strategy.run`, `accumulator.apply_gradients(optimizer)`).

    Contract:
      * `add(grads)`: replica context only; `len(grads) == len(variables)`; a `None`
        gradient is skipped (its position is kept); `tf.IndexedSlices` are summed
        into the dense buffer (`unsorted_segment_sum`: `SyncOnReadVariable` has no
        `scatter_add`, it raises NotImplementedError). No collectives.
      * `gradients()`: in replica context this replica's sums, cast to each
        variable's dtype; in cross-replica context their SUM over replicas. A position
        that was `None` in every traced `add` is returned as `None` (so the optimizer
        skips it, as it would in one big step).
      * `reset()`: zeros the buffers and the counter (either context).
      * `micro_steps`: micro-batches added since the last reset (eager read).
      * all state is tracked by `tf.train.Checkpoint(accumulator=...)`.

    Raises:
      ValueError: no variables; variables owned by another strategy than the one in
        scope; distributed variables but no strategy scope (created outside
        `strategy.scope()`); non-distributed variables inside a strategy scope.
      TypeError: a non-floating variable.
    """

    def __init__(self, variables, name: str = "gradient_accumulator"):
        super().__init__(name=name)
        variables = list(variables)
        if not variables:
            raise ValueError("GradientAccumulator needs at least one variable.")
        strategy = tf.distribute.get_strategy()
        in_scope = tf.distribute.has_strategy()
        for variable in variables:
            owner = _distributed_strategy_of(variable)
            if owner is not None and not in_scope:
                raise ValueError(
                    f"variable {variable.name!r} is distributed by a {type(owner).__name__}, "
                    "but the GradientAccumulator is being created outside its scope: its "
                    "buffers would be ordinary variables on one device. Create it under "
                    "`with strategy.scope():` (the scope the model was built in)."
                )
            if owner is not None and owner is not strategy:
                raise ValueError(
                    f"variable {variable.name!r} belongs to another strategy than the one "
                    "in scope. Create the GradientAccumulator under the scope of the "
                    "strategy that built the model."
                )
            if owner is None and in_scope:
                raise ValueError(
                    f"variable {variable.name!r} is not distributed, but a "
                    f"{type(strategy).__name__} scope is active: the model was built outside "
                    "`strategy.scope()`. Build the model (and the optimizer) under the "
                    "same scope as the GradientAccumulator."
                )
        self._model_variables = _Untracked(variables)
        self._strategy = strategy
        with strategy.scope():
            self.accumulated = [
                tf.Variable(
                    tf.zeros(v.shape, _accumulator_dtype(tf.as_dtype(v.dtype))),
                    trainable=False,
                    name=f"accumulated_{i}",
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                )
                for i, v in enumerate(variables)
            ]
            self.micro_step_counter = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="micro_steps",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
        # Which positions ever received a gradient: a trace-time (Python) fact, the
        # same for every trace of a given model. Before any `add` has been traced
        # (e.g. a checkpoint restored and applied first) every position counts.
        self._received = [False] * len(variables)
        self._traced_add = False

    @property
    def model_variables(self) -> list:
        return list(self._model_variables.values)

    @property
    def strategy(self) -> tf.distribute.Strategy:
        return self._strategy

    @property
    def micro_steps(self) -> int:
        """Micro-batches accumulated since the last reset (read eagerly, replica 0)."""
        return int(self.micro_step_counter.numpy())

    def _require_replica_context(self, what: str) -> None:
        if tf.distribute.in_cross_replica_context():
            raise RuntimeError(
                f"GradientAccumulator.{what} must run in replica context: call it inside "
                "`strategy.run(...)`. In cross-replica context the gradients are "
                "PerReplica values and the optimizer cannot all-reduce them."
            )

    def add(self, grads) -> None:
        """Add one micro-batch's gradients to this replica's buffers (replica context)."""
        self._require_replica_context("add")
        grads = list(grads)
        if len(grads) != len(self.accumulated):
            raise ValueError(
                f"add() got {len(grads)} gradients for {len(self.accumulated)} variables; "
                "pass one gradient (or None) per variable, in the order the accumulator "
                "was created with (e.g. tape.gradient(loss, model.trainable_variables))."
            )
        self._traced_add = True
        for i, (buffer, grad) in enumerate(zip(self.accumulated, grads)):
            if grad is None:
                continue
            self._received[i] = True
            if isinstance(grad, tf.IndexedSlices):
                dense = tf.math.unsorted_segment_sum(
                    tf.cast(grad.values, buffer.dtype), grad.indices,
                    num_segments=buffer.shape[0])
            else:
                dense = tf.cast(grad, buffer.dtype)
            if not dense.shape.is_compatible_with(buffer.shape):
                raise ValueError(
                    f"gradient {i} has shape {dense.shape}, its variable {buffer.shape}.")
            buffer.assign_add(dense)
        self.micro_step_counter.assign_add(1)

    def gradients(self) -> list:
        """The accumulated gradients, in variable order and dtype (see class doc)."""
        out = []
        for i, (buffer, variable) in enumerate(zip(self.accumulated, self.model_variables)):
            if self._traced_add and not self._received[i]:
                out.append(None)
            else:
                # read_value() (an Identity op) rather than convert_to_tensor: the bare
                # read has no device in the traced graph, and the one-replica all-reduce
                # routes by the tensor's device ("destinations can not be empty").
                out.append(tf.cast(buffer.read_value(), variable.dtype))
        return out

    def reset(self) -> None:
        """Zero every buffer and the counter (replica or cross-replica context)."""
        for buffer in self.accumulated:
            buffer.assign(tf.zeros_like(buffer))
        self.micro_step_counter.assign(0)

    def apply_gradients(self, optimizer) -> None:
        """Replica context: apply this replica's sums with `optimizer`, then reset.

        `optimizer.apply_gradients` all-reduces (SUM) the local sums: the one sync of
        the update. Reads come before the reset (automatic control dependencies order
        stateful ops on the same variable in program order).
        """
        self._require_replica_context("apply_gradients")
        check = tf.debugging.assert_positive(
            self.micro_step_counter,
            message="GradientAccumulator: apply with zero accumulated micro-steps")
        # Gate everything this replica creates (reads, all-reduce, the optimizer's
        # `iterations` increment, the reset) on the check: an Assert alone would fail
        # the call but let independent stateful ops run.
        with tf.control_dependencies([check]):
            optimizer.apply_gradients(zip(self.gradients(), self.model_variables))
            self.reset()

    def make_apply_step(self, optimizer):
        """A Python callable that applies once per call: `apply_step()`.

        It builds `optimizer` for the variables under the strategy scope first, so
        the traced function creates no variables (on TF 2.21 / Keras 3.15 letting Adam
        or momentum create slots inside it fails under MirroredStrategy; see
        `distgrad.pitfalls.lazy_slot_creation`). `apply_step.function` is the
        `tf.function` (for `count_collectives`).

        Raises ValueError (at call time) when no micro-step was accumulated, and when
        the optimizer was created outside the accumulator's strategy scope.
        """
        owner = getattr(optimizer, "_distribution_strategy", self._strategy)
        if owner is not self._strategy:
            raise ValueError(
                "the optimizer was created outside the strategy scope of the "
                "GradientAccumulator; create it under `with strategy.scope():`.")
        if not optimizer.built:
            with self._strategy.scope():
                optimizer.build(self.model_variables)
        strategy = self._strategy

        @tf.function
        def apply_function():
            strategy.run(self.apply_gradients, args=(optimizer,))

        def apply_step():
            if tf.executing_eagerly() and self.micro_steps == 0:
                raise ValueError(
                    "apply with zero accumulated micro-steps: call accumulator.add(...) "
                    "inside strategy.run at least once since the last apply/reset.")
            apply_function()

        apply_step.function = apply_function
        return apply_step


# --- micro-batching -----------------------------------------------------------------


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
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) \
            or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an integer >= 1, got {accumulation_steps!r}.")
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
    if updates < 1:
        raise ValueError(f"updates must be >= 1, got {updates}.")
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


# --- a model with an Embedding (sparse gradients) ---------------------------------


def token_data(examples: int = 16, vocab: int = 6, length: int = 5, seed: int = 0):
    """`(tokens, y)`: int32 token ids (examples, length), with repeats, and float32 targets."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(examples, length)).astype("int32")
    y = rng.normal(size=(examples, 1)).astype("float32")
    return tokens, y


def embedding_model(vocab: int = 6, length: int = 5, dim: int = 3, seed: int = 0) -> keras.Model:
    """Embedding -> mean over tokens -> Dense(1); its embedding gradient is IndexedSlices."""
    return keras.Sequential([
        keras.Input((length,), dtype="int32"),
        keras.layers.Embedding(vocab, dim, embeddings_initializer=keras.initializers.RandomUniform(
            -0.5, 0.5, seed=seed)),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1)),
    ])


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
