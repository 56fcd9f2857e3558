"""`AccumulatingOptimizer`: gradient accumulation as a Keras 3 optimizer wrapper.

`model.compile(optimizer=AccumulatingOptimizer(keras.optimizers.Adam(1e-3), steps=4))`
makes every `steps` calls of `apply_gradients` one update of the wrapped ("inner")
optimizer with the *mean* of the `steps` micro-batch gradients. It works in
`model.fit` under `MirroredStrategy`, without a strategy, and in custom loops
(`optimizer.apply_gradients` inside `strategy.run`).

Why a wrapper, and why this shape
---------------------------------
"Apply every k-th step" needs a data-dependent branch, and the branch contains the
inner optimizer's sync points: `TFOptimizer._backend_update_step` all-reduces the
gradients (`ReplicaContext.all_reduce` -> `merge_call`) and writes the mirrored
variables through another `merge_call` (`keras/src/backend/tensorflow/optimizer.py`).
Under `MirroredStrategy` a `merge_call` issued inside a `tf.cond` traced in *replica*
context raises `RuntimeError: merge_call called while defining a new graph or a
tf.function` (`tensorflow/python/distribute/mirrored_run.py`, `_MirroredReplicaContext.
_merge_call`: the cond branch is a separate graph, the merge function runs in the
main thread). That is what the hand-patched `apply_gradients` of
`distgrad.pitfalls.cond_merge_call` hits, and what Keras' own
`gradient_accumulation_steps` hits in `model.fit` (the `ops.cond` in
`BaseOptimizer._backend_apply_gradients`; keras-team/keras#20582).

The wrapper uses the shape of Keras' `LossScaleOptimizer._tf_apply`
(`keras/src/optimizers/loss_scale_optimizer.py`), whose comment reads: "We must call
this cond() in a cross-replica context. DistributionStrategy does not support having
a cond in a replica context with a branch that calls `merge_call`, and
self._optimizer.apply_gradients calls `merge_call`." So `apply`

1. adds this replica's gradients to *replica-local* float32 accumulators (ON_READ
   variables, SUM aggregation): no communication at all;
2. `merge_call`s once into cross-replica context, counts the micro-step there and
   evaluates "is an update due?" *there*, and `tf.cond`s in cross-replica context;
3. the true branch goes back to the replicas with
   `distribution.extended.call_for_each_replica(...)`, where the inner optimizer's
   ordinary `apply` runs on `accumulated / steps`: its one SUM all-reduce is the only
   gradient communication of the whole cycle.

Strategies that can run without `merge_call` (`tf.__internal__.distribute.
strategy_supports_no_merge_call()`: no strategy at all, or MirroredStrategy /
MultiWorkerMirroredStrategy inside an XLA-compiled function on GPUs) take a plain
`tf.cond` in replica context instead: every replica evaluates the same predicate.

Invariants
----------
* After `n * steps` calls the model equals `n` updates of the inner optimizer with
  the mean gradient of each group of `steps` micro-batches. With Keras' loss
  scaling (per-replica loss / number of replicas) that is exactly `n` steps on
  batches `steps` times larger.
* `iterations` is the inner optimizer's counter: it counts *updates*, so learning
  rate schedules, Adam's bias correction and EMA see updates. `micro_steps` counts
  `apply` calls.
* One gradient all-reduce per update (none on the accumulate-only micro-steps).
  When clipping is configured, one more (see below).
* Clipping and weight decay act on the accumulated, summed gradient: the wrapper
  takes `clipnorm` / `global_clipnorm` / `clipvalue` off the inner optimizer (which
  would clip each replica's partial gradient before its all-reduce, lesson 01's
  pitfall) and clips the all-reduced mean itself; the inner optimizer's weight decay
  runs once per inner `apply`, i.e. once per update.
* All state is checkpointable: `micro_steps` and the accumulators are optimizer
  variables (`model.save` / `keras.models.load_model`, `tf.train.Checkpoint`).
  A checkpoint holds the accumulators' sum over replicas, so it does not depend on
  the replica count.

Mixed precision (lesson 04): under `mixed_float16`, `model.compile` wraps this
optimizer in a `LossScaleOptimizer`, whose `_tf_apply` checks finiteness and calls
our `apply` with unscaled gradients through `call_for_each_replica` -- the same shape
as ours, so the two nest (`loss_scale_factor` and `scale_loss` are the inner
optimizer's). Each micro-batch is unscaled with *its own* loss scale before it is
added, so a scale change inside a cycle is harmless, and the accumulators are float32
whatever the variables' dtype.

Non-finite gradients never reach the weights:

* A micro-batch the loss-scale optimizer sees as non-finite is skipped before it
  reaches the accumulators: not added, not counted in `micro_steps`, `iterations`
  unchanged, loss scale halved. The cycle still waits for `steps` good micro-batches.
* But Keras' `LossScaleOptimizer._tf_apply` takes `finite` from replica 0 only
  (its comment assumes all-reduced gradients; in Keras 3 they are per-replica
  partial gradients, `distgrad.pitfalls.lso_first_replica_finite`), so an overflow
  on another replica is passed on. Therefore, when an update is due, this optimizer
  checks every replica's accumulators (in cross-replica context: reading the
  per-replica values, no collective; on the no-merge-call path one MIN all-reduce of
  a flag). If any is non-finite the cycle is dropped: no update, accumulators reset,
  `iterations` unchanged (`micro_steps` has counted the cycle's micro-batches). The
  loss scale is not lowered: the loss-scale optimizer never learned of the overflow.

Not covered: `model.compile(steps_per_execution > 1)` under MirroredStrategy fails
in Keras itself on TF 2.21 / Keras 3.15.1 (`InvalidArgumentError: You must feed a
value for placeholder tensor`, with or without this wrapper; cf. keras-team/keras#19246).
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf
from keras.src import backend
from keras.src.saving import serialization_lib

from distgrad.equivalence import tiny_model, weights_of
from distgrad.sync import make_replica_step

CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")


def _unused_learning_rate():
    # The wrapper has no learning rate of its own (`learning_rate` reads and writes
    # the inner optimizer's). A callable keeps BaseOptimizer from creating a variable.
    return 0.0


def _describe(strategy) -> str:
    if strategy is None:
        return "no strategy"
    name = type(strategy).__name__
    if name == "_DefaultDistributionStrategy":
        return "no strategy (the default strategy)"
    return f"{name} with {strategy.num_replicas_in_sync} replica(s)"


def _check_inner(optimizer) -> None:
    if isinstance(optimizer, keras.optimizers.Optimizer):
        if getattr(optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                "The inner optimizer has gradient_accumulation_steps="
                f"{optimizer.gradient_accumulation_steps}; AccumulatingOptimizer does the "
                "accumulation. Create the inner optimizer without "
                "gradient_accumulation_steps and pass steps= to AccumulatingOptimizer."
            )
        return
    if isinstance(optimizer, str):
        raise TypeError(
            f"AccumulatingOptimizer wraps an optimizer instance, got the string "
            f"{optimizer!r}. Pass keras.optimizers.get({optimizer!r}) (or e.g. "
            "keras.optimizers.Adam(1e-3))."
        )
    module = type(optimizer).__module__
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        hint = ("tf.compat.v1 optimizers (tf.compat.v1.train.*) are TF1 optimizers, not "
                "Keras 3 optimizers")
    elif module.startswith(("tf_keras", "keras.optimizers.legacy")) or ".optimizer_v2" in module:
        hint = "legacy tf-keras optimizers are not Keras 3 optimizers"
    else:
        hint = f"{type(optimizer).__name__} (from {module}) is not a Keras 3 optimizer"
    raise TypeError(
        f"AccumulatingOptimizer needs a Keras 3 optimizer (a keras.optimizers.Optimizer); "
        f"{hint}. Use the Keras 3 equivalent, e.g. keras.optimizers.SGD / Adam / AdamW."
    )


@keras.saving.register_keras_serializable(package="distgrad")
class AccumulatingOptimizer(keras.optimizers.Optimizer):
    """Accumulate `steps` micro-batch gradients, then make one update of `optimizer`.

    Args:
        optimizer: the Keras 3 optimizer that makes the updates (the "inner"
            optimizer). Its `clipnorm` / `global_clipnorm` / `clipvalue` move to the
            wrapper, which applies them to the all-reduced accumulated gradient.
        steps: micro-batches per update (`1` applies every call).
        name: optimizer name.

    Create it, like the model, under the `strategy.scope()` it will train in.

    Raises:
        ValueError: `steps` is not an integer >= 1; the inner optimizer has its own
            `gradient_accumulation_steps`; base-optimizer arguments (clipping, weight
            decay, EMA, ...) are passed to the wrapper instead of the inner optimizer.
        TypeError: `optimizer` is not a Keras 3 optimizer (a string, a
            `tf.compat.v1` optimizer, a legacy tf-keras optimizer).
        RuntimeError: (at `build` / `apply`) the wrapper, the inner optimizer and the
            call are not all under the same distribution strategy; see `apply`.
    """

    def __init__(self, optimizer, steps, name=None, **kwargs):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                "steps must be an integer >= 1 (the number of micro-batches per update), "
                f"got {steps!r}."
            )
        _check_inner(optimizer)
        if kwargs:
            raise ValueError(
                f"AccumulatingOptimizer does not take {sorted(kwargs)}: set them on the "
                "inner optimizer (clipping is then applied by the wrapper to the "
                "accumulated, all-reduced gradient; weight decay once per update)."
            )
        super().__init__(learning_rate=_unused_learning_rate, name=name)
        self.inner_optimizer = optimizer
        self.steps = steps
        self._built_under = None
        # Move clipping from the inner optimizer to the wrapper: Keras clips in
        # `_backend_apply_gradients` *before* the all-reduce, i.e. each replica's
        # partial gradient (distgrad.pitfalls.clip_before_sync). The wrapper clips the
        # all-reduced mean with the same BaseOptimizer._clip_gradients code instead.
        for option in CLIP_OPTIONS:
            setattr(self, option, getattr(optimizer, option))
            setattr(optimizer, option, None)

    # -- the inner optimizer's view of time and learning rate ---------------------

    @property
    def iterations(self):
        """Number of updates made (the inner optimizer's `iterations`)."""
        return self.inner_optimizer.iterations

    @property
    def micro_steps(self):
        """Number of `apply` calls (micro-batches) so far, a variable."""
        return self._iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        if "inner_optimizer" not in self.__dict__:
            return  # BaseOptimizer.__init__ sets it before the inner optimizer exists
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def loss_scale_factor(self):
        inner = self.__dict__.get("inner_optimizer")
        return None if inner is None else inner.loss_scale_factor

    @loss_scale_factor.setter
    def loss_scale_factor(self, value):
        # A LossScaleOptimizer wrapping us sets this to None to stop double scaling;
        # the factor that would apply is the inner optimizer's.
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:
            inner.loss_scale_factor = value

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    @property
    def variables(self):
        return self._variables[:] + self.inner_optimizer.variables

    @property
    def accumulators(self):
        """The replica-local float32 gradient sums, one per trainable variable."""
        return list(self._accumulators)

    # -- build ---------------------------------------------------------------------

    def build(self, var_list):
        """Create `micro_steps`' companions: one ON_READ float32 accumulator per variable.

        Also builds the inner optimizer (unless already built). Must run under the
        strategy the wrapper and inner optimizer were created under.
        """
        if self.built:
            return
        strategy = tf.distribute.get_strategy()
        for who, created_under in (("AccumulatingOptimizer", self._distribution_strategy),
                                   ("its inner optimizer",
                                    getattr(self.inner_optimizer, "_distribution_strategy",
                                            strategy))):
            if created_under is not strategy:
                raise RuntimeError(
                    f"{who} was created under {_describe(created_under)} but is being "
                    f"built under {_describe(strategy)}. Its step counters would not be "
                    "mirrored variables, and the update count would be wrong. Create the "
                    "model, the inner optimizer and the AccumulatingOptimizer inside the "
                    "same `with strategy.scope():` block."
                )
        super().build(var_list)
        accumulators = []
        with backend.name_scope(self.name, caller=self):
            for variable in var_list:
                name = getattr(variable, "path", variable.name).replace("/", "_")
                accumulator = backend.Variable(
                    initializer="zeros",
                    shape=variable.shape,
                    dtype="float32",
                    trainable=False,
                    autocast=False,
                    # ON_READ + SUM: each replica adds to its own copy without
                    # communicating; reading in cross-replica context (checkpoints,
                    # .numpy()) gives the sum over replicas.
                    synchronization="on_read",
                    aggregation="sum",
                    name=f"{name.replace(':', '_')}_accumulated_gradient",
                )
                self._track_variable(accumulator)
                accumulators.append(accumulator)
        self._accumulators = accumulators
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self._built_under = strategy

    # -- apply ---------------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        """Accumulate `grads`; on every `steps`-th call, update the inner optimizer.

        Call in replica context: inside `strategy.run` (model.fit does this), or
        without any strategy. `grads` are this replica's gradients (Keras' loss is
        already divided by the number of replicas); `None` gradients are skipped.
        Sparse (`IndexedSlices`) gradients are densified into the accumulators.

        Raises:
            ValueError: called in cross-replica context (under `strategy.scope()` but
                outside `strategy.run`).
            RuntimeError: called under a different strategy than the one the wrapper
                was built under (e.g. outside `strategy.run`/`strategy.scope()` after
                building under a MirroredStrategy).
        """
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing gradients without variables the optimizer must be "
                    "built: call optimizer.build(model.trainable_variables) first."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with backend.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        self._check_context()
        self._check_variables_are_known(trainable_variables)
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            raise ValueError("No gradients provided for any variable.")
        variables = [v for _, v in pairs]
        with backend.name_scope(self.name, caller=self):
            # 1. Replica-local accumulation: no communication.
            for grad, variable in pairs:
                if isinstance(grad, tf.IndexedSlices):
                    grad = tf.convert_to_tensor(grad)
                self.assign_add(self._accumulator_of(variable), tf.cast(grad, tf.float32))

            if tf.__internal__.distribute.strategy_supports_no_merge_call():
                # No strategy, or a strategy whose all-reduce and variable updates work
                # without merge_call: every replica takes the same branch.
                self._iterations.assign_add(1)
                tf.cond(self.apply_is_due(),
                        lambda: self._finish_cycle_in_replica_context(variables),
                        lambda: None)
            else:
                tf.distribute.get_replica_context().merge_call(
                    self._cross_replica_step, args=(variables,))

    def apply_is_due(self):
        """Boolean tensor: the micro-step just counted completes an accumulation cycle.

        Evaluated after `micro_steps` was incremented, in cross-replica context under
        merge_call strategies (or in replica context without one).
        """
        return tf.equal(tf.math.floormod(self._iterations.value, self.steps), 0)

    def _cross_replica_step(self, distribution, variables):
        # Cross-replica context: runs once for all replicas, so the counter is
        # incremented once and the predicate is one value.
        self._iterations.assign_add(1)

        def apply_on_replicas():
            distribution.extended.call_for_each_replica(
                self._apply_accumulated, args=(variables,))

        def drop_on_replicas():
            distribution.extended.call_for_each_replica(
                self._reset_accumulators, args=(variables,))

        def finish_cycle():
            # Every replica's accumulators, not replica 0's: Keras' LossScaleOptimizer
            # checks replica 0 only, so an overflow elsewhere can be in here.
            finite_per_replica = distribution.extended.call_for_each_replica(
                self._local_accumulators_finite, args=(variables,))
            finite = tf.reduce_all(tf.stack(
                distribution.experimental_local_results(finite_per_replica)))
            tf.cond(finite, apply_on_replicas, drop_on_replicas)

        # As in LossScaleOptimizer._tf_apply: this cond must be in cross-replica
        # context. A cond in replica context whose branch calls merge_call (the inner
        # optimizer's all-reduce and variable updates do) is not supported by
        # MirroredStrategy; from here, call_for_each_replica starts fresh replica
        # threads inside the branch graph, where merge_call works again.
        tf.cond(self.apply_is_due(), finish_cycle, lambda: None)

    def _local_accumulators_finite(self, variables):
        """Replica context: whether this replica's accumulators are all finite."""
        return tf.reduce_all(tf.stack([
            tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(self._accumulator_of(v))))
            for v in variables]))

    def _finish_cycle_in_replica_context(self, variables):
        # No-merge-call path: every replica runs this branch, so a collective is fine.
        finite = self._local_accumulators_finite(variables)
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            finite = context.all_reduce(
                tf.distribute.ReduceOp.MIN, tf.cast(finite, tf.float32)) > 0
        tf.cond(finite, lambda: self._apply_accumulated(variables),
                lambda: self._reset_accumulators(variables))

    def _reset_accumulators(self, variables):
        for accumulator in [self._accumulator_of(v) for v in variables]:
            self.assign(accumulator, tf.zeros(accumulator.shape, accumulator.dtype))

    def _apply_accumulated(self, variables):
        """Replica context: one inner update with the accumulated mean, then reset.

        This is where the cycle's gradient all-reduce happens (inside the inner
        optimizer's `apply`), plus one more when clipping is configured.
        """
        accumulators = [self._accumulator_of(v) for v in variables]
        # This replica's share of the mean gradient; the inner optimizer's SUM
        # all-reduce turns the shares into the mean over all micro-batches and replicas.
        grads = [tf.cast(tf.convert_to_tensor(a) / self.steps, v.dtype)
                 for a, v in zip(accumulators, variables)]
        if self._clipping_configured():
            grads = self._clip_across_replicas(grads)
        self.inner_optimizer.apply(grads, variables)
        self._reset_accumulators(variables)

    def _clipping_configured(self) -> bool:
        return any(getattr(self, option) for option in CLIP_OPTIONS)

    def _clip_across_replicas(self, local_grads):
        # Clipping is not linear, so it needs the summed gradient: one extra
        # all-reduce. The inner optimizer will SUM again; to make that SUM equal the
        # clipped total exactly, replica 0 passes it and the others pass zeros.
        context = tf.distribute.get_replica_context()
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, local_grads)
        clipped = self._clip_gradients(summed)
        replica_id = context.replica_id_in_sync_group
        static_id = tf.get_static_value(replica_id)
        if static_id is not None:
            return clipped if int(static_id) == 0 else [tf.zeros_like(c) for c in clipped]
        is_first = tf.equal(replica_id, 0)
        return [tf.where(is_first, c, tf.zeros_like(c)) for c in clipped]

    def _accumulator_of(self, variable):
        return self._accumulators[self._get_variable_index(variable)]

    def _check_context(self):
        strategy = tf.distribute.get_strategy()
        if strategy is not self._built_under:
            raise RuntimeError(
                f"AccumulatingOptimizer was built under {_describe(self._built_under)} "
                f"but apply_gradients is called under {_describe(strategy)}. Call it "
                "inside strategy.run(...) of the strategy it was built under (model.fit "
                "does this for you). To train under another strategy, create a new "
                "model and optimizer inside that strategy's scope()."
            )
        if tf.distribute.in_cross_replica_context():
            raise ValueError(
                "AccumulatingOptimizer.apply_gradients must be called in replica context: "
                "inside strategy.run(step_fn, ...) (or through model.fit), not directly "
                "under strategy.scope()."
            )

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError("AccumulatingOptimizer is stateful; stateless_apply is not supported.")

    # -- serialization -----------------------------------------------------------

    def get_config(self):
        inner = serialization_lib.serialize_keras_object(self.inner_optimizer)
        # Give the clipping back to the inner optimizer's config: from_config moves it
        # to the wrapper again, so a round trip reproduces this object.
        inner["config"].update({option: getattr(self, option) for option in CLIP_OPTIONS})
        return {"name": self.name, "optimizer": inner, "steps": self.steps}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = serialization_lib.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


# -- the recipes lesson 03 and its tests compare ----------------------------------


@dataclasses.dataclass
class TrainingRun:
    """Weights before/after a training recipe, and the optimizer's counters.

    `updates` is `optimizer.iterations` (updates made); `micro_steps` is the number of
    `apply_gradients` calls for an `AccumulatingOptimizer` (else equal to `updates`).
    """

    initial: list
    final: list
    updates: int
    micro_steps: int
    model: object
    optimizer: object


def _counters(optimizer) -> tuple[int, int]:
    updates = int(np.asarray(keras.ops.convert_to_numpy(optimizer.iterations)))
    micro = optimizer.micro_steps if isinstance(optimizer, AccumulatingOptimizer) else None
    return updates, updates if micro is None else int(micro.numpy())


def fit_run(strategy, optimizer_factory, x, y, batch_size: int, epochs: int = 1,
            model_factory=tiny_model, loss="mse") -> TrainingRun:
    """`model.fit(x, y, batch_size, shuffle=False)` of a fresh model under `strategy`.

    `strategy=None` trains without a strategy. The model and `optimizer_factory()` are
    created inside `strategy.scope()`, as Keras requires. Seeded initializers and no
    shuffling make two runs comparable weight for weight.
    """
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        model = model_factory()
        optimizer = optimizer_factory()
        model.compile(optimizer=optimizer, loss=loss)
    initial = weights_of(model)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    updates, micro_steps = _counters(model.optimizer)
    return TrainingRun(initial, weights_of(model), updates, micro_steps, model, model.optimizer)


def custom_loop_run(strategy, optimizer_factory, x, y, batch_size: int,
                    model_factory=tiny_model) -> TrainingRun:
    """A `tf.function` custom loop: one `strategy.run(replica_step)` per batch of `x`.

    `replica_step` is `distgrad.sync.make_replica_step(batch_size)`: per-example loss
    over the global batch, then `optimizer.apply_gradients` in replica context.
    """
    strategy = strategy or tf.distribute.get_strategy()
    if len(x) % batch_size:
        raise ValueError(f"{len(x)} examples are not a whole number of batches of {batch_size}.")
    with strategy.scope():
        model = model_factory()
        optimizer = optimizer_factory()
        optimizer.build(model.trainable_variables)
    initial = weights_of(model)
    replica_step = make_replica_step(batch_size)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)

    @tf.function
    def distributed_step(batch):
        return strategy.run(replica_step, args=(model, optimizer, *batch))

    for batch in strategy.experimental_distribute_dataset(dataset):
        distributed_step(batch)
    updates, micro_steps = _counters(optimizer)
    return TrainingRun(initial, weights_of(model), updates, micro_steps, model, optimizer)
