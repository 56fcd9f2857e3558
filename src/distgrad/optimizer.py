"""`AccumulatingOptimizer`: gradient accumulation as a Keras 3 optimizer wrapper.

Copy this file with `non_finite.py` (the non-finite policy it shares), `optimizer_checks.py`
(what it refuses), `inner_update.py` (the update a cycle makes) and `keras_loss_scale.py`
(Keras' own `LossScaleOptimizer` around it): it imports only TensorFlow, Keras and
`distgrad.<those>`, or, copied into a project, `<those>`.
Design notes: docs/design.md, "AccumulatingOptimizer".
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

try:
    from distgrad import inner_update, keras_loss_scale, optimizer_checks
    from distgrad.inner_update import overwritten
    from distgrad.non_finite import (
        CLIP_OPTIONS,
        all_finite,
        check_can_raise,
        finite_everywhere,
        finite_on_all_replicas,
    )
except ImportError:  # copied into a project: those files beside this one
    import inner_update
    import keras_loss_scale
    import optimizer_checks
    from inner_update import overwritten
    from non_finite import (
        CLIP_OPTIONS,
        all_finite,
        check_can_raise,
        finite_everywhere,
        finite_on_all_replicas,
    )

# The oldest `make matrix` passes (docs/versions.md); Keras < 3.10: no Variable(synchronization=).
NEEDED = {"tensorflow": (2, 16), "keras": (3, 10)}
if any(tuple(map(int, m.__version__.split(".")[:2])) < NEEDED[m.__name__] for m in (tf, keras)):
    raise ImportError(f"distgrad.optimizer needs TensorFlow >= 2.16 and Keras >= 3.10, found "
                      f"TensorFlow {tf.__version__} and Keras {keras.__version__}: "
                      "pip install -U 'tensorflow>=2.16' 'keras>=3.10'")

STOCK_WRAPPER_MESSAGE = keras_loss_scale.STOCK_WRAPPER_MESSAGE  # lesson 04 reads it here
UNFOUND_WRAPPER_MESSAGE = keras_loss_scale.UNFOUND_WRAPPER_MESSAGE
_NOTHING, _APPLIED, _SKIPPED = 0, 1, 2  # what a call did to the cycle (no-merge-call path)


def _unused_learning_rate():  # a callable: BaseOptimizer creates no variable for it;
    return 0.0  # `learning_rate` reads and writes the inner optimizer's


@keras.saving.register_keras_serializable(package="distgrad")
class AccumulatingOptimizer(keras.optimizers.Optimizer):
    """Accumulate `accumulation_steps` micro-batch gradients, then update `inner_optimizer`.

    Every k-th call of `apply_gradients` updates the inner optimizer with the mean of the
    k accumulated gradients, in `fit` and custom loops, with or without a strategy: `n * k`
    calls equal `n` big-batch updates. Create it under the scope the model trains in; under
    `mixed_float16`, compile `AllReplicasFiniteLossScaleOptimizer(AccumulatingOptimizer(
    inner, k))`. An incomplete cycle carries on into the next epoch; `flush()` applies it
    and `discard()` drops it (see `AccumulationCallback`). Design: docs/design.md.

    Args:
        inner_optimizer: the Keras 3 optimizer that updates. Its clipping options move to
            the wrapper, which clips the all-reduced gradient (Keras: each replica's part).
        accumulation_steps: k, the micro-batches per update (`1` updates every call).
        non_finite: a cycle with NaN/Inf gradients on any replica. "raise" (default): the
            call ending it fails with `tf.errors.InvalidArgumentError`, nothing applied.
            "skip": no update, counted in `skipped_updates` (a loss-scale wrapper: always).
        name: optimizer name.

    State (saved by `model.save` and `tf.train.Checkpoint`): `accumulators`, `micro_steps`
    (`0 <= n < k`), `total_micro_steps`, `skipped_updates` and, inside Keras' own
    `LossScaleOptimizer` on one replica, `skipped_micro_batches` (both warned of at the end
    of `fit`); `iterations` is the inner optimizer's (updates).

    Raises:
        ValueError: bad arguments, or a step it cannot run (`distgrad.optimizer_checks`);
            Keras' own `LossScaleOptimizer` around it on 2+ replicas; "raise" under XLA.
        TypeError: `inner_optimizer` is not a Keras 3 optimizer.
        RuntimeError: (`build` / `apply`) not all under the same distribution strategy.
        tf.errors.InvalidArgumentError: (run time) a non-finite cycle under "raise".
    """

    # True inside a loss-scale wrapper that checks every replica (AllReplicasFinite...).
    overflow_checked_on_every_replica = False

    def __init__(self, inner_optimizer, accumulation_steps, non_finite="raise", name=None,
                 **kwargs):
        optimizer_checks.check_arguments(inner_optimizer, accumulation_steps, non_finite, kwargs)
        super().__init__(learning_rate=_unused_learning_rate, name=name)
        self.inner_optimizer = inner_optimizer
        self.accumulation_steps = accumulation_steps
        self.non_finite = non_finite
        self._built_under, self._under_loss_scaling = None, False
        self._skips_reported = None  # `skipped_updates` when the step was traced / last fit
        self.micro_steps = self.skipped_updates = None  # variables, created by `build`
        # Inside Keras' own wrapper on one replica (see keras_loss_scale.py).
        self._stock_wrapper = self.skipped_micro_batches = self._next_loss_scale = None
        self._micro_skips_reported = None  # `skipped_micro_batches` at the first trace / fit
        for option in CLIP_OPTIONS:
            setattr(self, option, getattr(inner_optimizer, option))
            setattr(inner_optimizer, option, None)

    @property
    def iterations(self):
        """Updates made: the inner optimizer's counter."""
        return self.inner_optimizer.iterations

    @property
    def total_micro_steps(self):
        """Micro-batches seen, never reset: BaseOptimizer's own `iterations` variable."""
        return self._iterations

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate; setting it sets the inner optimizer's."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        if "inner_optimizer" in self.__dict__:  # BaseOptimizer.__init__ sets it earlier
            self.inner_optimizer.learning_rate = learning_rate

    @property
    def loss_scale_factor(self):
        """The inner optimizer's; assigning it goes through `__setattr__`."""
        return getattr(self.__dict__.get("inner_optimizer"), "loss_scale_factor", None)

    def __setattr__(self, name, value):
        # A wrapping LossScaleOptimizer sets `loss_scale_factor = None` (docs/design.md).
        if name != "loss_scale_factor":
            super().__setattr__(name, value)
        elif "inner_optimizer" in self.__dict__:  # (BaseOptimizer.__init__ sets it first)
            self.inner_optimizer.loss_scale_factor = value
            self._under_loss_scaling = value is None
            self.overflow_checked_on_every_replica = False  # until the new wrapper says so

    @property
    def variables(self):
        """The wrapper's variables, then the inner optimizer's."""
        return self._variables[:] + self.inner_optimizer.variables

    @property
    def accumulators(self):
        """The replica-local gradient sums, one per trainable variable."""
        return list(self._accumulators)

    def build(self, var_list):
        """Create accumulators and counters, under the strategy everything was created in
        (and refuse Keras' own `LossScaleOptimizer` around it on 2+ replicas)."""
        # Every call: Keras' wrapper builds its inner one too.
        keras_loss_scale.check_loss_scale_wrapper(self)
        if self.built:
            return
        strategy = tf.distribute.get_strategy()
        optimizer_checks.check_built_under(self, strategy)
        super().build(var_list)
        self._accumulators = []
        with keras.name_scope(self.name, caller=self):
            for variable in var_list:
                name = getattr(variable, "path", variable.name).replace("/", "_")
                # float32, ON_READ + SUM: docs/design.md (`add_variable` has no synchronization)
                dtype = ("float64" if keras.backend.standardize_dtype(variable.dtype)
                         == "float64" else "float32")
                accumulator = keras.Variable(
                    initializer="zeros", shape=variable.shape, dtype=dtype, trainable=False,
                    autocast=False, synchronization="on_read", aggregation="sum",
                    name=f"{name.replace(':', '_')}_accumulated_gradient")
                self._track_variable(accumulator)
                self._accumulators.append(accumulator)
            self.micro_steps = self.add_variable(
                (), initializer="zeros", dtype=self._iterations.dtype,
                aggregation="only_first_replica", name="micro_steps")
            self.skipped_updates = self.add_variable(
                (), initializer="zeros", dtype=self._iterations.dtype,
                aggregation="only_first_replica", name="skipped_updates")
            if self._stock_wrapper is not None:
                keras_loss_scale.add_skip_counters(self)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self._built_under = strategy
        if not tf.executing_eagerly():  # created in a trace (no strategy): 0, not readable yet
            self._skips_reported = self._micro_skips_reported = 0

    def apply(self, grads, trainable_variables=None):
        """Replica context: accumulate this replica's `grads` (`None` skipped, `IndexedSlices`
        densified); on every k-th call, update."""
        if not (grads := list(grads)):
            return
        if trainable_variables is None and not self.built:
            raise ValueError("Call optimizer.build(model.trainable_variables) first: gradients "
                             "without variables need a built optimizer.")
        trainable_variables = list(trainable_variables or self._trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        optimizer_checks.check_step(self._built_under)
        keras_loss_scale.check_loss_scale_wrapper(self)
        self._check_variables_are_known(trainable_variables)
        if self._stock_wrapper is not None:
            keras_loss_scale.count_skips(self)
        if self._skips_reported is None:  # the first trace: a restored count is not news
            self._skips_reported = self._skipped_now()
        # BaseOptimizer's filter: ValueError if no gradient at all, Keras' warning if some.
        grads, variables = self._filter_empty_gradients(grads, trainable_variables)
        with keras.name_scope(self.name, caller=self):
            for grad, variable in zip(grads, variables):  # replica-local: no communication
                accumulator = self._accumulator_of(variable)  # IndexedSlices: densified
                grad = tf.cast(tf.convert_to_tensor(grad), accumulator.dtype)
                if overwritten(variable):  # as Keras' built-in: a big batch's amax is the max
                    self.assign(accumulator, tf.maximum(accumulator, grad))
                else:
                    self.assign_add(accumulator, grad)
            self._end_cycle(variables)

    def flush(self):
        """Apply the incomplete cycle, if any, as the mean of its `micro_steps` micro-batches
        (non-finite policy included). Outside `strategy.run`: eagerly or atop a tf.function."""
        optimizer_checks.check_outside_run("flush")
        if self.built:
            run = self._built_under.run
            (tf.function(run) if tf.executing_eagerly() else run)(
                lambda: self._end_cycle(self._trainable_variables, flush=True))

    def discard(self):
        """Drop the incomplete cycle (not a skipped update). Call it as `flush`."""
        optimizer_checks.check_outside_run("discard")
        if self.built:
            self._reset_accumulators(self._trainable_variables)
            self.micro_steps.assign(0)

    def _end_cycle(self, variables, flush=False):
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._cross_replica_step(None, variables, flush)  # no strategy, or XLA on GPUs
        else:
            tf.distribute.get_replica_context().merge_call(
                self._cross_replica_step, args=(variables, flush))

    def _cross_replica_step(self, distribution, variables, flush=False):
        # Once for all replicas from merge_call; on every replica without (distribution=None).
        if flush:  # the incomplete cycle, if there is one; micro_steps is zeroed at the end
            due, divisor = tf.greater(self.micro_steps, 0), tf.identity(self.micro_steps.value)
        else:
            self._iterations.assign_add(1)
            self.micro_steps.assign(tf.math.floormod(self.micro_steps + 1,
                                                      self.accumulation_steps))
            due, divisor = tf.equal(self.micro_steps, 0), self.accumulation_steps

        def on_replicas(fn, *args):
            return fn(*args) if distribution is None else (
                distribution.extended.call_for_each_replica(fn, args=args))

        def finish_cycle():
            # Every replica's accumulators: Keras' LossScaleOptimizer checks replica 0 only.
            local = on_replicas(lambda: all_finite([self._accumulator_of(v) for v in variables]))
            finite = (finite_on_all_replicas(local) if distribution is None
                      else finite_everywhere(distribution, local))

            def apply_cycle():
                on_replicas(self._apply_accumulated, variables, divisor)
                return tf.constant(_APPLIED, tf.int64)

            def drop_cycle():
                if not self._raise_non_finite():
                    on_replicas(self._reset_accumulators, self._trainable_variables)
                return tf.constant(_SKIPPED, tf.int64)

            return tf.cond(finite, apply_cycle, drop_cycle)

        # In cross-replica context, as LossScaleOptimizer._tf_apply (docs/design.md).
        outcome = tf.cond(due, finish_cycle, lambda: tf.constant(_NOTHING, tf.int64))
        self.skipped_updates.assign_add(tf.cast(tf.equal(outcome, _SKIPPED), tf.int64))
        if distribution is None:  # `_apply_accumulated` left this increment out
            self.iterations.assign_add(tf.cast(tf.equal(outcome, _APPLIED), tf.int64))
        if flush:
            self.micro_steps.assign(0)

    def _raise_non_finite(self):
        # In a non-finite cycle's branch: True (and a failing assertion) unless skipped.
        if self.non_finite == "skip" or self._under_loss_scaling:
            return False
        check_can_raise("AccumulatingOptimizer(non_finite='raise')")
        tf.debugging.Assert(False, [
            "AccumulatingOptimizer: NaN/Inf gradients on some replica in the cycle of update",
            self.iterations + 1, "ending at micro-step", self._iterations.value,
            "(total_micro_steps); nothing applied. non_finite='skip' would drop and count it."])
        return True

    def _reset_accumulators(self, variables):
        for accumulator in [self._accumulator_of(v) for v in variables]:
            self.assign(accumulator, tf.zeros(accumulator.shape, accumulator.dtype))

    def _apply_accumulated(self, variables, divisor):
        # Replica context: this replica's share of the mean gradient (overwritten: the max).
        grads = [tf.convert_to_tensor(self._accumulator_of(v)) for v in variables]
        inner_update.apply_to_inner(self, [
            tf.cast(g if overwritten(v) else g / tf.cast(divisor, g.dtype), v.dtype)
            for g, v in zip(grads, variables)], variables)
        self._reset_accumulators(self._trainable_variables)

    def _accumulator_of(self, variable):
        return self._accumulators[self._get_variable_index(variable)]

    def set_weights(self, weights):  # `variables`: the wrapper's, then the inner optimizer's
        weights, own = list(weights), len(self._variables)
        super().set_weights(weights[:own])
        self.inner_optimizer.set_weights(weights[own:])

    def exclude_from_weight_decay(self, var_list=None, var_names=None):  # the inner one decays
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def finalize_variable_values(self, var_list):
        """Keras calls it at the end of every `fit` (TensorFlowTrainer.fit): the inner
        optimizer's (EMA), then a `UserWarning` if cycles were dropped since the last call."""
        self.inner_optimizer.finalize_variable_values(var_list)
        if self.skipped_updates is None:
            return
        if self._stock_wrapper is not None:
            keras_loss_scale.warn_of_skips(self)
        skipped, before = self._skipped_now(), self._skips_reported
        if before is not None and skipped > before:
            warnings.warn(
                f"AccumulatingOptimizer: {skipped - before} update(s) skipped in this fit "
                f"({skipped} in all, `optimizer.skipped_updates`): their cycle's gradients "
                "were NaN/Inf on some replica, and nothing was applied.", stacklevel=2)
        self._skips_reported = skipped

    def _skipped_now(self) -> int:
        with tf.init_scope():  # eager, also while a step is being traced
            return int(keras.ops.convert_to_numpy(self.skipped_updates))

    def get_config(self):
        inner = keras.saving.serialize_keras_object(self.inner_optimizer)
        # The clipping goes back to the inner config; from_config moves it here again.
        inner["config"].update({option: getattr(self, option) for option in CLIP_OPTIONS})
        return {"name": self.name, "inner_optimizer": inner, "non_finite": self.non_finite,
                "accumulation_steps": self.accumulation_steps}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        return cls(inner, **config)

