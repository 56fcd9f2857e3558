"""`AccumulatingOptimizer`: gradient accumulation as a Keras 3 optimizer wrapper.

    model.compile(optimizer=AccumulatingOptimizer(keras.optimizers.Adam(1e-3),
                                                  accumulation_steps=4), loss=...)

This file imports only TensorFlow and Keras: copy it into a project and use it alone.

Why the shape: "update every k-th call" needs a branch around the inner optimizer's
sync points (`merge_call`), which MirroredStrategy refuses inside a replica-context
`tf.cond` (keras-team/keras#20582); so the branch is taken in cross-replica context,
as in Keras' `LossScaleOptimizer._tf_apply` (see `_cross_replica_step`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")


def _unused_learning_rate():
    # The wrapper has no learning rate of its own (`learning_rate` reads and writes
    # the inner optimizer's). A callable keeps BaseOptimizer from creating a variable.
    return 0.0


def _describe(strategy) -> str:
    if strategy is None:
        return "no strategy"
    if type(strategy).__name__ == "_DefaultDistributionStrategy":
        return "no strategy (the default strategy)"
    return f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replica(s)"


def _accumulator_dtype(dtype) -> str:
    # Summing k float16/bfloat16 gradients in their own dtype loses the small ones.
    return "float64" if keras.backend.standardize_dtype(dtype) == "float64" else "float32"


def _check_inner(inner_optimizer) -> None:
    if isinstance(inner_optimizer, keras.optimizers.Optimizer):
        if getattr(inner_optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                "The inner optimizer has gradient_accumulation_steps="
                f"{inner_optimizer.gradient_accumulation_steps}; AccumulatingOptimizer does "
                "the accumulation. Create the inner optimizer without it and pass "
                "accumulation_steps= to AccumulatingOptimizer.")
        return
    if isinstance(inner_optimizer, str):
        raise TypeError(
            f"AccumulatingOptimizer wraps an optimizer instance, got the string "
            f"{inner_optimizer!r}. Pass keras.optimizers.get({inner_optimizer!r}).")
    module = type(inner_optimizer).__module__
    if isinstance(inner_optimizer, tf.compat.v1.train.Optimizer):
        hint = "tf.compat.v1 optimizers (tf.compat.v1.train.*) are TF1 optimizers"
    elif module.startswith(("tf_keras", "keras.optimizers.legacy")) or ".optimizer_v2" in module:
        hint = "legacy tf-keras optimizers are not Keras 3 optimizers"
    else:
        hint = f"{type(inner_optimizer).__name__} (from {module}) is not one"
    raise TypeError(
        f"AccumulatingOptimizer needs a Keras 3 optimizer (a keras.optimizers.Optimizer); "
        f"{hint}. Use the Keras 3 equivalent, e.g. keras.optimizers.SGD / Adam / AdamW.")


@keras.saving.register_keras_serializable(package="distgrad")
class AccumulatingOptimizer(keras.optimizers.Optimizer):
    """Accumulate `accumulation_steps` micro-batch gradients, then update `inner_optimizer`.

    Every `accumulation_steps`-th call of `apply_gradients` makes one update of the inner
    optimizer with the *mean* of the accumulated micro-batch gradients. Works in
    `model.fit` under `MirroredStrategy`, without a strategy, and in custom loops
    (`optimizer.apply_gradients` inside `strategy.run`). Create it, like the model and
    the inner optimizer, under the `strategy.scope()` it will train in.

    Args:
        inner_optimizer: the Keras 3 optimizer that makes the updates. Its `clipnorm`,
            `global_clipnorm` and `clipvalue` move to the wrapper, which applies them to
            the all-reduced accumulated gradient (Keras clips each replica's partial
            gradient before the all-reduce).
        accumulation_steps: k, the micro-batches per update (`1` updates every call).
        name: optimizer name.

    State (all optimizer variables: saved by `model.save` and `tf.train.Checkpoint`):
        total_micro_steps: micro-batches accumulated since creation (never reset);
            `micro_steps`, its value modulo k, counts those of the current cycle. A
            micro-batch a `LossScaleOptimizer` skips as non-finite is not counted.
        accumulators: one replica-local (ON_READ, SUM) float32 sum per trainable
            variable (float64 for float64 variables). A checkpoint holds their sum over
            replicas, so it does not depend on the replica count.
        iterations: the inner optimizer's counter: *updates*, so learning-rate
            schedules, Adam's bias correction and EMA count updates.

    Invariants:
        * After `n * k` calls the model equals `n` inner updates with the mean gradient
          of each group of k micro-batches: with Keras' loss scaling (per-replica loss
          / replicas) exactly `n` steps on batches k times larger.
        * One gradient all-reduce per update, none on accumulate-only calls (one more
          when clipping is configured). Weight decay runs once per update.
        * Non-finite gradients never reach the weights. When an update is due, every
          replica's accumulators are checked (Keras' `LossScaleOptimizer` checks replica
          0 only); if any is non-finite the cycle is dropped: no update, accumulators
          reset, `iterations` unchanged (the cycle's micro-steps stay counted).

    Raises:
        ValueError: `accumulation_steps` is not an integer >= 1; the inner optimizer has
            its own `gradient_accumulation_steps`; base-optimizer arguments (clipping,
            weight decay, EMA, ...) are given to the wrapper instead of the inner one.
        TypeError: `inner_optimizer` is not a Keras 3 optimizer (a string, a
            `tf.compat.v1` optimizer, a legacy tf-keras optimizer).
        RuntimeError: (at `build` / `apply`) the wrapper, the inner optimizer and the
            call are not all under the same distribution strategy.
    """

    def __init__(self, inner_optimizer, accumulation_steps, name=None, **kwargs):
        if (isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int)
                or accumulation_steps < 1):
            raise ValueError(
                "accumulation_steps must be an integer >= 1 (the number of micro-batches "
                f"per update), got {accumulation_steps!r}.")
        _check_inner(inner_optimizer)
        if kwargs:
            raise ValueError(
                f"AccumulatingOptimizer does not take {sorted(kwargs)}: set them on the "
                "inner optimizer (clipping is then applied by the wrapper to the "
                "accumulated, all-reduced gradient; weight decay once per update).")
        super().__init__(learning_rate=_unused_learning_rate, name=name)
        self.inner_optimizer = inner_optimizer
        self.accumulation_steps = accumulation_steps
        self._built_under = None
        for option in CLIP_OPTIONS:
            setattr(self, option, getattr(inner_optimizer, option))
            setattr(inner_optimizer, option, None)

    @property
    def iterations(self):
        """Number of updates made (the inner optimizer's `iterations`)."""
        return self.inner_optimizer.iterations

    @property
    def total_micro_steps(self):
        """Micro-batches accumulated since creation, a variable (never reset)."""
        # BaseOptimizer's own `iterations` variable, reused: it already exists,
        # is checkpointed, and is updated with ONLY_FIRST_REPLICA aggregation.
        return self._iterations

    @property
    def micro_steps(self):
        """Micro-batches accumulated in the current cycle, `0 <= n < k` (a tensor)."""
        return tf.math.floormod(self._iterations.value, self.accumulation_steps)

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
        """The replica-local gradient sums, one per trainable variable."""
        return list(self._accumulators)

    def build(self, var_list):
        """Create one accumulator per variable and build the inner optimizer.

        Must run under the strategy the wrapper and the inner optimizer were created
        under (RuntimeError otherwise).
        """
        if self.built:
            return
        strategy = tf.distribute.get_strategy()
        inner_strategy = getattr(self.inner_optimizer, "_distribution_strategy", strategy)
        for who, created_under in (("AccumulatingOptimizer", self._distribution_strategy),
                                   ("its inner optimizer", inner_strategy)):
            if created_under is not strategy:
                raise RuntimeError(
                    f"{who} was created under {_describe(created_under)} but is being "
                    f"built under {_describe(strategy)}. Its step counters would not be "
                    "mirrored variables, and the update count would be wrong. Create the "
                    "model, the inner optimizer and the AccumulatingOptimizer inside the "
                    "same `with strategy.scope():` block.")
        super().build(var_list)
        accumulators = []
        with keras.name_scope(self.name, caller=self):
            for variable in var_list:
                name = getattr(variable, "path", variable.name).replace("/", "_")
                # `add_variable` cannot set `synchronization`, hence keras.Variable and
                # the (private) `_track_variable` that `add_variable` itself uses.
                accumulator = keras.Variable(
                    initializer="zeros", shape=variable.shape,
                    dtype=_accumulator_dtype(variable.dtype), trainable=False,
                    autocast=False,
                    # ON_READ + SUM: each replica adds to its own copy without
                    # communicating; a cross-replica read (checkpoint, .numpy())
                    # gives the sum over replicas.
                    synchronization="on_read", aggregation="sum",
                    name=f"{name.replace(':', '_')}_accumulated_gradient")
                self._track_variable(accumulator)
                accumulators.append(accumulator)
        self._accumulators = accumulators
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self._built_under = strategy

    def apply(self, grads, trainable_variables=None):
        """Accumulate `grads`; on every k-th call, update the inner optimizer.

        Call in replica context: inside `strategy.run` (model.fit does this), or
        without any strategy. `grads` are this replica's gradients (Keras' loss is
        already divided by the number of replicas); `None` gradients are skipped;
        `IndexedSlices` are densified into the accumulators.

        Raises:
            ValueError: called in cross-replica context (under `strategy.scope()` but
                outside `strategy.run`), or no gradient is given for any variable.
            RuntimeError: called under another strategy than the one it was built under.
        """
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing gradients without variables the optimizer must be "
                    "built: call optimizer.build(model.trainable_variables) first.")
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        self._check_context()
        self._check_variables_are_known(trainable_variables)
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            raise ValueError("No gradients provided for any variable.")
        variables = [v for _, v in pairs]
        with keras.name_scope(self.name, caller=self):
            for grad, variable in pairs:  # replica-local: no communication
                if isinstance(grad, tf.IndexedSlices):
                    grad = tf.convert_to_tensor(grad)
                accumulator = self._accumulator_of(variable)
                self.assign_add(accumulator, tf.cast(grad, accumulator.dtype))
            if tf.__internal__.distribute.strategy_supports_no_merge_call():
                # No strategy, or all-reduce and variable updates without merge_call
                # (MirroredStrategy in an XLA function on GPUs): every replica counts
                # and takes the same branch.
                self._iterations.assign_add(1)
                tf.cond(self.apply_is_due(),
                        lambda: self._finish_cycle_in_replica_context(variables),
                        lambda: None)
            else:
                tf.distribute.get_replica_context().merge_call(
                    self._cross_replica_step, args=(variables,))

    def apply_is_due(self):
        """Boolean tensor: the micro-step just counted completes the cycle."""
        return tf.equal(self.micro_steps, 0)

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
        # Replica context. The cycle's gradient all-reduce is inside the inner `apply`.
        accumulators = [self._accumulator_of(v) for v in variables]
        # This replica's share of the mean gradient; the inner optimizer's SUM
        # all-reduce turns the shares into the mean over all micro-batches and replicas.
        grads = [tf.cast(tf.convert_to_tensor(a) / self.accumulation_steps, v.dtype)
                 for a, v in zip(accumulators, variables)]
        if any(getattr(self, option) for option in CLIP_OPTIONS):
            grads = self._clip_across_replicas(grads)
        self.inner_optimizer.apply(grads, variables)
        self._reset_accumulators(variables)

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
                "model and optimizer inside that strategy's scope().")
        if tf.distribute.in_cross_replica_context():
            raise ValueError(
                "AccumulatingOptimizer.apply_gradients must be called in replica context: "
                "inside strategy.run(step_fn, ...) (or through model.fit), not directly "
                "under strategy.scope().")

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError("AccumulatingOptimizer is stateful; stateless_apply is not supported.")

    # -- serialization -----------------------------------------------------------

    def get_config(self):
        inner = keras.saving.serialize_keras_object(self.inner_optimizer)
        # Give the clipping back to the inner optimizer's config: from_config moves it
        # to the wrapper again, so a round trip reproduces this object.
        inner["config"].update({option: getattr(self, option) for option in CLIP_OPTIONS})
        return {"name": self.name, "inner_optimizer": inner,
                "accumulation_steps": self.accumulation_steps}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        # distgrad 0.1 saved the same two values as "optimizer" and "steps".
        inner = config.pop("inner_optimizer", None) or config.pop("optimizer")
        if "steps" in config:
            config["accumulation_steps"] = config.pop("steps")
        inner = keras.saving.deserialize_keras_object(inner, custom_objects=custom_objects)
        return cls(inner, **config)
