"""`AccumulatingOptimizer`: gradient accumulation as a Keras 3 optimizer wrapper.

    model.compile(optimizer=AccumulatingOptimizer(keras.optimizers.Adam(1e-3),
                                                  accumulation_steps=4), loss=...)

This file imports only TensorFlow and Keras: copy it into a project and use it alone.

Why the shape: "update every k-th call" needs a branch around the inner optimizer's sync
points (`merge_call`), which MirroredStrategy refuses inside a replica-context `tf.cond`
(keras-team/keras#20582); so the branch is taken in cross-replica context, as in Keras'
`LossScaleOptimizer._tf_apply` (`_cross_replica_step`). Without `merge_call` (no strategy;
XLA on GPUs) it is a replica-context `tf.cond` (`_end_cycle_in_replica_context`).
"""

from __future__ import annotations

import keras
import tensorflow as tf
# The test MirroredExtended._use_merge_call makes too: is the step being XLA-compiled?
from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext

CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")
NON_FINITE_POLICIES = ("raise", "skip")
_NOTHING, _APPLIED, _SKIPPED = 0, 1, 2  # what a call did to the cycle (no-merge-call path)


def _unused_learning_rate():  # a callable: BaseOptimizer creates no variable for it
    return 0.0  # (`learning_rate` reads and writes the inner optimizer's)


def _describe(strategy) -> str:
    if strategy is None or type(strategy).__name__ == "_DefaultDistributionStrategy":
        return "no strategy" + ("" if strategy is None else " (the default strategy)")
    return f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replica(s)"


def _accumulator_dtype(dtype) -> str:
    # Summing k float16/bfloat16 gradients in their own dtype loses the small ones.
    return "float64" if keras.backend.standardize_dtype(dtype) == "float64" else "float32"


def _check_arguments(inner_optimizer, accumulation_steps, non_finite, kwargs) -> None:
    if (isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int)
            or accumulation_steps < 1):
        raise ValueError("accumulation_steps must be an integer >= 1 (the number of "
                         f"micro-batches per update), got {accumulation_steps!r}.")
    if non_finite not in NON_FINITE_POLICIES:
        raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}.")
    if kwargs:
        raise ValueError(f"AccumulatingOptimizer does not take {sorted(kwargs)}: set them on "
                         "the inner optimizer (clipping is then applied by the wrapper to the "
                         "accumulated, all-reduced gradient; weight decay once per update).")
    if isinstance(inner_optimizer, keras.optimizers.Optimizer):
        if getattr(inner_optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                "The inner optimizer has gradient_accumulation_steps="
                f"{inner_optimizer.gradient_accumulation_steps}; AccumulatingOptimizer does the "
                "accumulation. Create the inner optimizer without it and pass "
                "accumulation_steps= to AccumulatingOptimizer.")
        return
    if isinstance(inner_optimizer, str):
        raise TypeError(f"AccumulatingOptimizer wraps an optimizer instance, got the string "
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

    Every k-th call of `apply_gradients` makes one update of the inner optimizer with
    the *mean* of the k accumulated micro-batch gradients. Works in `model.fit` and in
    custom loops (`apply_gradients` inside `strategy.run`), under `MirroredStrategy`,
    without a strategy, and on TensorFlow's no-merge-call path (XLA). Create it, the
    model and the inner optimizer under the `strategy.scope()` they train in.

    Args:
        inner_optimizer: the Keras 3 optimizer that makes the updates. Its `clipnorm`,
            `global_clipnorm` and `clipvalue` move to the wrapper, which applies them to
            the all-reduced accumulated gradient (Keras clips each replica's part).
        accumulation_steps: k, the micro-batches per update (`1` updates every call).
        non_finite: a cycle whose gradients are NaN/Inf on any replica, in float32
            without loss scaling. "raise" (default): the call that ends it fails with
            `tf.errors.InvalidArgumentError` naming the update and micro-step; nothing
            is applied, the accumulators keep their sums. "skip": the cycle is dropped
            (accumulators zeroed, no update) and counted in `skipped_updates`. Under a
            `LossScaleOptimizer` it is always skipped and counted: an overflow is the
            loss scale's business (Keras' wrapper checks replica 0 only, so an
            overflow on another replica reaches the accumulators).
        name: optimizer name.

    State (optimizer variables: saved by `model.save` and `tf.train.Checkpoint`):
        total_micro_steps: micro-batches accumulated since creation, never reset (one
            a `LossScaleOptimizer` skipped is not counted).
        micro_steps: micro-batches of the current cycle, `0 <= n < k`; an update,
            `flush()` and `discard()` set it to 0.
        skipped_updates: cycles dropped as non-finite.
        accumulators: one replica-local (ON_READ, SUM) float32 sum per trainable
            variable (float64 for float64 ones); a checkpoint holds their sum over
            replicas, so it does not depend on the replica count.
        iterations: the inner optimizer's counter: *updates*, which learning-rate
            schedules, Adam's bias correction and EMA count.

    Invariants:
        * After `n * k` calls the model equals `n` inner updates with the mean gradient
          of each k micro-batches: with Keras' loss scaling, `n` steps on k-times
          larger batches. Weight decay runs once per update.
        * One gradient all-reduce per update, none on the other calls (one more with
          clipping; on the no-merge-call path with 2+ replicas one more of a single
          element: the finiteness flags).
        * Non-finite gradients never reach the weights: every replica's accumulators
          are checked when a cycle ends.
        * An incomplete cycle carries on: at the end of an epoch (of `fit` or of a
          custom loop) the next micro-batches complete it. `flush()` applies it now,
          `discard()` drops it (in `fit`: `distgrad.callbacks.AccumulationCallback`).

    Raises:
        ValueError: `accumulation_steps` not an integer >= 1; `non_finite` not "raise"
            or "skip"; an inner optimizer with `gradient_accumulation_steps`;
            base-optimizer arguments (clipping, weight decay, EMA, ...) given to the
            wrapper; (first step) `non_finite="raise"` in an XLA-compiled step.
        TypeError: `inner_optimizer` is not a Keras 3 optimizer (a string, a
            `tf.compat.v1` optimizer, a legacy tf-keras optimizer).
        RuntimeError: (`build` / `apply`) the wrapper, the inner optimizer and the
            call are not all under the same distribution strategy.
        tf.errors.InvalidArgumentError: (run time) a non-finite cycle under "raise".
    """

    def __init__(self, inner_optimizer, accumulation_steps, non_finite="raise", name=None,
                 **kwargs):
        _check_arguments(inner_optimizer, accumulation_steps, non_finite, kwargs)
        super().__init__(learning_rate=_unused_learning_rate, name=name)
        self.inner_optimizer = inner_optimizer
        self.accumulation_steps = accumulation_steps
        self.non_finite = non_finite
        self._built_under = None
        self._under_loss_scaling = False
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
        """Micro-batches accumulated in the current cycle, `0 <= n < k` (a variable)."""
        return self._micro_steps

    @property
    def skipped_updates(self):
        """Cycles dropped because their gradients were non-finite (a variable)."""
        return self._skipped_updates

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
        # Keras' LossScaleOptimizer sets this to None when it wraps us, to stop double
        # scaling: the factor is the inner optimizer's, and non-finite cycles are from
        # then on the loss scale's business (see `non_finite`).
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:
            inner.loss_scale_factor = value
            self._under_loss_scaling = value is None

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
        """Create the accumulators and counters, build the inner optimizer (RuntimeError
        unless under the strategy the wrapper and the inner optimizer were created under)."""
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
                    # communicating; a cross-replica read gives the sum over replicas.
                    synchronization="on_read", aggregation="sum",
                    name=f"{name.replace(':', '_')}_accumulated_gradient")
                self._track_variable(accumulator)
                accumulators.append(accumulator)
            self._micro_steps, self._skipped_updates = (
                self.add_variable((), initializer="zeros", dtype=self._iterations.dtype,
                                  aggregation="only_first_replica", name=counter)
                for counter in ("micro_steps", "skipped_updates"))
        self._accumulators = accumulators
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self._built_under = strategy

    def apply(self, grads, trainable_variables=None):
        """Accumulate `grads`; on every k-th call, update the inner optimizer.

        Replica context: inside `strategy.run` (as in `model.fit`) or without a
        strategy. `grads` are this replica's gradients (Keras divides the loss by the
        replica count); `None` gradients are skipped, `IndexedSlices` densified.

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
                self._end_cycle_in_replica_context(variables)  # no strategy, or XLA on GPUs
            else:
                tf.distribute.get_replica_context().merge_call(
                    self._cross_replica_step, args=(variables,))

    def apply_is_due(self):
        """Boolean tensor: the micro-step just counted completes the cycle."""
        return tf.equal(self._micro_steps, 0)

    def flush(self):
        """Apply the incomplete cycle now, as the mean of its `micro_steps` micro-batches.

        Nothing happens when `micro_steps` is 0; the non-finite policy applies. Call it
        outside `strategy.run`: eagerly (e.g. in `on_epoch_end`) or at the top level of
        a `tf.function` (ValueError otherwise).
        """
        strategy = self._strategy_outside_run("flush")

        def flush_on_replica():
            variables = self._trainable_variables
            if tf.__internal__.distribute.strategy_supports_no_merge_call():
                self._end_cycle_in_replica_context(variables, flush=True)
            else:
                tf.distribute.get_replica_context().merge_call(
                    self._cross_replica_step, args=(variables, True))
            self._micro_steps.assign(0)

        if strategy is not None:
            run = tf.function(strategy.run) if tf.executing_eagerly() else strategy.run
            run(flush_on_replica)

    def discard(self):
        """Drop the incomplete cycle: zero the accumulators and `micro_steps` (not
        counted in `skipped_updates`). Call it outside `strategy.run`, like `flush`."""
        if self._strategy_outside_run("discard") is not None:
            for accumulator in self._accumulators:
                accumulator.assign(tf.zeros(accumulator.shape, accumulator.dtype))
            self._micro_steps.assign(0)

    def _strategy_outside_run(self, what):
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            raise ValueError(f"AccumulatingOptimizer.{what}() must be called outside "
                             "strategy.run (in cross-replica context), e.g. eagerly.")
        return self._built_under if self.built else None

    def _cycle_end(self, flush):
        """(due, divisor): this call ends a cycle, of `divisor` micro-batches."""
        if flush:  # the incomplete cycle, if there is one
            return tf.greater(self._micro_steps, 0), tf.identity(self._micro_steps.value)
        self._iterations.assign_add(1)
        self._micro_steps.assign(tf.math.floormod(self._micro_steps + 1,
                                                  self.accumulation_steps))
        return self.apply_is_due(), self.accumulation_steps

    def _cross_replica_step(self, distribution, variables, flush=False):
        # Cross-replica context: runs once for all replicas, so the counters are
        # incremented once and the predicate is one value.
        due, divisor = self._cycle_end(flush)

        def apply_on_replicas():
            distribution.extended.call_for_each_replica(
                self._apply_accumulated, args=(variables, divisor))

        def drop_on_replicas():
            if not self._raise_non_finite():
                distribution.extended.call_for_each_replica(
                    self._reset_accumulators, args=(variables,))
                self._skipped_updates.assign_add(1)

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
        tf.cond(due, finish_cycle, lambda: None)

    def _end_cycle_in_replica_context(self, variables, flush=False):
        # No merge_call: every replica takes the same branches, so a collective may be
        # inside them. A merge_call may not, and TensorFlow updates ONLY_FIRST_REPLICA
        # variables (all counters) through one: they are updated after the cond.
        due, divisor = self._cycle_end(flush)

        def finish_cycle():
            finite = self._local_accumulators_finite(variables)
            context = tf.distribute.get_replica_context()
            if context is not None and context.num_replicas_in_sync > 1:
                # No cross-replica context to read the other replicas' flags in.
                finite = tf.equal(context.all_reduce(
                    tf.distribute.ReduceOp.SUM, 1.0 - tf.cast(finite, tf.float32)), 0.0)

            def apply_cycle():
                self._apply_accumulated(variables, divisor)
                return tf.constant(_APPLIED, tf.int64)

            def drop_cycle():
                if not self._raise_non_finite():
                    self._reset_accumulators(variables)
                return tf.constant(_SKIPPED, tf.int64)

            return tf.cond(finite, apply_cycle, drop_cycle)

        outcome = tf.cond(due, finish_cycle, lambda: tf.constant(_NOTHING, tf.int64))
        for counter, value in ((self.inner_optimizer._iterations, _APPLIED),
                               (self._skipped_updates, _SKIPPED)):
            counter.assign_add(tf.cast(tf.equal(outcome, value), counter.dtype))

    def _raise_non_finite(self):
        """In the branch of a non-finite cycle: under "raise" (no loss scaling) add the
        failing assertion and return True, else return False (the cycle is skipped)."""
        if self.non_finite == "skip" or self._under_loss_scaling:
            return False
        if GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            raise ValueError(
                "AccumulatingOptimizer(non_finite='raise') cannot raise in an XLA-compiled "
                "step: XLA compiles tf.debugging assertions out (Keras turns XLA on by "
                "itself on a GPU without a strategy: jit_compile='auto'). Pass "
                "non_finite='skip' and watch skipped_updates (AccumulationCallback puts "
                "it in fit's logs), or compile with jit_compile=False.")
        tf.debugging.Assert(False, [
            "AccumulatingOptimizer: non-finite (NaN/Inf) gradients on some replica in the "
            "cycle of update", self.iterations + 1, "which ends at micro-step",
            self._iterations.value, "(total_micro_steps). Nothing was applied; the "
            "accumulators keep their sums (discard() zeroes them). non_finite='skip' "
            "drops such a cycle and counts it in skipped_updates."])
        return True

    def _local_accumulators_finite(self, variables):
        return tf.reduce_all(tf.stack([
            tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(self._accumulator_of(v))))
            for v in variables]))

    def _reset_accumulators(self, variables):
        for accumulator in [self._accumulator_of(v) for v in variables]:
            self.assign(accumulator, tf.zeros(accumulator.shape, accumulator.dtype))

    def _apply_accumulated(self, variables, divisor):
        # Replica context. The cycle's gradient all-reduce is inside the inner update.
        accumulators = [self._accumulator_of(v) for v in variables]
        # This replica's share of the mean gradient; the inner optimizer's SUM
        # all-reduce turns the shares into the mean over all micro-batches and replicas.
        grads = [tf.cast(tf.convert_to_tensor(a) / tf.cast(divisor, a.dtype), v.dtype)
                 for a, v in zip(accumulators, variables)]
        if any(getattr(self, option) for option in CLIP_OPTIONS):
            grads = self._clip_across_replicas(grads)
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._inner_update_without_counter(grads, variables)
        else:
            self.inner_optimizer.apply(grads, variables)
        self._reset_accumulators(variables)

    def _inner_update_without_counter(self, grads, variables):
        # BaseOptimizer.apply (keras/src/optimizers/base_optimizer.py) but its last line,
        # `self._iterations.assign_add(1)`: a merge_call, refused in this replica-context
        # cond; `_end_cycle_in_replica_context` increments it after the cond.
        inner = self.inner_optimizer
        grads, variables = inner._overwrite_variables_directly_with_gradients(grads, variables)
        if grads:
            if inner.loss_scale_factor is not None:
                grads = [g / inner.loss_scale_factor for g in grads]
            inner._backend_apply_gradients(grads, variables)
            for variable in variables:
                if variable.constraint is not None:
                    variable.assign(variable.constraint(variable))

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

    def get_config(self):
        inner = keras.saving.serialize_keras_object(self.inner_optimizer)
        # Give the clipping back to the inner optimizer's config: from_config moves it
        # to the wrapper again, so a round trip reproduces this object.
        inner["config"].update({option: getattr(self, option) for option in CLIP_OPTIONS})
        return {"name": self.name, "inner_optimizer": inner,
                "accumulation_steps": self.accumulation_steps, "non_finite": self.non_finite}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        # distgrad 0.1 saved the same two values as "optimizer" and "steps".
        inner = config.pop("inner_optimizer", None) or config.pop("optimizer")
        if "steps" in config:
            config["accumulation_steps"] = config.pop("steps")
        inner = keras.saving.deserialize_keras_object(inner, custom_objects=custom_objects)
        return cls(inner, **config)
