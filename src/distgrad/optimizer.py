"""`AccumulatingOptimizer`: gradient accumulation as a Keras 3 optimizer wrapper.

Copy this file with `non_finite.py` (the non-finite policy it shares): it imports only
TensorFlow, Keras and `distgrad.non_finite`, or, copied into a project, `non_finite`.
Design notes: docs/design.md, "AccumulatingOptimizer".
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref

import keras
import tensorflow as tf
from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext  # XLA or not
from tensorflow.python.ops.control_flow_v2_func_graphs import CondBranchFuncGraph

try:
    from distgrad.non_finite import (
        CLIP_OPTIONS,
        all_finite,
        check_can_raise,
        check_policy,
        finite_everywhere,
        finite_on_all_replicas,
    )
except ImportError:  # copied into a project: non_finite.py beside this file
    from non_finite import (
        CLIP_OPTIONS,
        all_finite,
        check_can_raise,
        check_policy,
        finite_everywhere,
        finite_on_all_replicas,
    )

# The oldest `make matrix` passes (docs/versions.md); Keras < 3.10: no Variable(synchronization=).
NEEDED = {"tensorflow": (2, 16), "keras": (3, 10)}
if any(tuple(map(int, m.__version__.split(".")[:2])) < NEEDED[m.__name__] for m in (tf, keras)):
    raise ImportError(f"distgrad.optimizer needs TensorFlow >= 2.16 and Keras >= 3.10, found "
                      f"TensorFlow {tf.__version__} and Keras {keras.__version__}: "
                      "pip install -U 'tensorflow>=2.16' 'keras>=3.10'")

_NOTHING, _APPLIED, _SKIPPED = 0, 1, 2  # what a call did to the cycle (no-merge-call path)


def _unused_learning_rate():  # a callable: BaseOptimizer creates no variable for it;
    return 0.0  # `learning_rate` reads and writes the inner optimizer's


def _describe(strategy) -> str:
    if strategy is None or type(strategy).__name__ == "_DefaultDistributionStrategy":
        return "no strategy" + ("" if strategy is None else " (the default strategy)")
    return f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replica(s)"


def _check_arguments(inner_optimizer, accumulation_steps, non_finite, kwargs) -> None:
    if (isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int)
            or accumulation_steps < 1):
        raise ValueError("accumulation_steps must be an integer >= 1 (the micro-batches per "
                         f"update), got {accumulation_steps!r}.")
    check_policy(non_finite)
    if kwargs:
        raise ValueError(f"AccumulatingOptimizer does not take {sorted(kwargs)}: set them on the "
                         "inner optimizer (the wrapper then clips the all-reduced gradient).")
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        kind = type(inner_optimizer)
        fix = (f"keras.optimizers.get({inner_optimizer!r})" if isinstance(inner_optimizer, str)
               else "e.g. keras.optimizers.SGD / Adam / AdamW")
        raise TypeError(f"Pass {fix}: AccumulatingOptimizer wraps a Keras 3 optimizer, got "
                        f"{kind.__name__} from {kind.__module__} (not tf.compat.v1 optimizers; "
                        "tf-keras ones go in distgrad.tf_keras.AccumulatingOptimizer).")
    if steps := getattr(inner_optimizer, "gradient_accumulation_steps", None):
        raise ValueError("Create the inner optimizer without gradient_accumulation_steps (it "
                         f"has {steps}): AccumulatingOptimizer(accumulation_steps=) accumulates.")


# Keras' own LossScaleOptimizer around it on 2+ replicas, refused in `build`.
STOCK_WRAPPER_MESSAGE = (
    "Under mixed_float16 on {replicas} replicas, hand model.compile the loss-scale wrapper "
    "yourself: model.compile(optimizer=distgrad.AllReplicasFiniteLossScaleOptimizer("
    "distgrad.AccumulatingOptimizer(inner, accumulation_steps)), ...) (a custom loop wraps "
    "it the same way). Keras' own LossScaleOptimizer around it (compile adds one) checks "
    "replica 0's gradients only: distgrad lesson 04 "
    "(notebooks/04_loss_scale_optimizer_pitfall.py).")
# Keras' wrapper on one replica, when it cannot be found to read its loss scale.
UNFOUND_WRAPPER_MESSAGE = (
    "Under mixed_float16, hand model.compile the loss-scale wrapper yourself: "
    "model.compile(optimizer=distgrad.AllReplicasFiniteLossScaleOptimizer("
    "distgrad.AccumulatingOptimizer(inner, accumulation_steps)), ...). Keras' "
    "LossScaleOptimizers found around this AccumulatingOptimizer: {found}, or it was built "
    "before one wrapped it; so it could not count the micro-batches a wrapper skips.")
# Steps Keras traces that cannot run on several replicas (see `_unrunnable_step`).
STEPS_PER_EXECUTION_MESSAGE = (
    "Compile with steps_per_execution=1 (accumulation already cuts the all-reduces per "
    "example k-fold): AccumulatingOptimizer's step, traced in a tf.cond branch as "
    "steps_per_execution > 1 builds it, cannot run on {replicas} replicas, where TensorFlow "
    "does not feed its all-reduce its key (stock Keras, plain Adam too). "
    "https://github.com/keras-team/keras/issues/19246")
JIT_COMPILE_MESSAGE = (
    "Compile with jit_compile=False (what Keras' default, \"auto\", picks under "
    "tf.distribute): AccumulatingOptimizer's XLA-compiled step cannot run on {replicas} "
    "replicas that are not all GPUs, as one XLA cluster cannot reach the other device's "
    "variables (stock Keras, plain Adam too). https://github.com/keras-team/keras/issues/19005")

def _called_from_a_cond_branch() -> bool:
    """True if the function being traced is called, directly or through its callers, from
    a `tf.cond` branch (docs/design.md)."""
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    graph = getattr(graph, "outer_graph", None)
    while graph is not None:
        if isinstance(graph, CondBranchFuncGraph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _unrunnable_step(replicas: int) -> str | None:
    """The message for a step traced here that cannot run on `replicas` replicas, or None
    (stock Keras failures, caught at trace time; XLA on GPUs is left alone)."""
    if replicas < 2:
        return None
    if _called_from_a_cond_branch():
        return STEPS_PER_EXECUTION_MESSAGE.format(replicas=replicas)
    if (GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
            and not tf.__internal__.distribute.strategy_supports_no_merge_call()):
        return JIT_COMPILE_MESSAGE.format(replicas=replicas)
    return None


def _loss_scale_optimizers_around(optimizer) -> list:
    """Keras' LossScaleOptimizers whose inner optimizer is `optimizer`, found among its
    referrers (directly, or through an instance's `__dict__`): docs/design.md."""
    referrers = gc.get_referrers(optimizer)
    dicts = [r for r in referrers if isinstance(r, dict)]
    found = []
    for candidate in referrers + (gc.get_referrers(*dicts) if dicts else []):
        if (isinstance(candidate, keras.optimizers.LossScaleOptimizer)
                and vars(candidate).get("inner_optimizer") is optimizer
                and not any(candidate is f for f in found)):
            found.append(candidate)
    return found


def _overwritten(variable) -> bool:  # float8 scales and amax histories: assigned, not stepped
    return getattr(variable, "overwrite_with_gradient", False)


@keras.saving.register_keras_serializable(package="distgrad")
class AccumulatingOptimizer(keras.optimizers.Optimizer):
    """Accumulate `accumulation_steps` micro-batch gradients, then update `inner_optimizer`.

    Every k-th call of `apply_gradients` updates the inner optimizer with the mean of the
    k accumulated gradients, in `fit` and custom loops, with or without a strategy: `n * k`
    calls equal `n` big-batch updates, with one gradient all-reduce per update. Create it
    under the scope the model trains in.

    Args:
        inner_optimizer: the Keras 3 optimizer that updates. Its clipping options move to
            the wrapper, which clips the all-reduced gradient (Keras: each replica's part).
        accumulation_steps: k, the micro-batches per update (`1` updates every call).
        non_finite: a cycle with NaN/Inf gradients on any replica. "raise" (default): the
            call ending it fails with `tf.errors.InvalidArgumentError`, nothing applied.
            "skip": no update, accumulators zeroed, counted in `skipped_updates`. Under a
            loss-scale wrapper the cycle is always skipped and counted.
        name: optimizer name.

    State (optimizer variables, saved by `model.save` and `tf.train.Checkpoint`):
        accumulators: replica-local (ON_READ, SUM) float32 gradient sums (float64 for
            float64 variables); a checkpoint holds their sum over replicas.
        micro_steps: micro-batches of the current cycle, `0 <= n < k`.
        total_micro_steps: micro-batches accumulated, never reset.
        skipped_updates: cycles dropped as non-finite; a `fit` that dropped some ends with
            a `UserWarning`.
        skipped_micro_batches: inside Keras' own `LossScaleOptimizer` on one replica only:
            the micro-batches it skipped (warned of at the end of `fit`).
        iterations: the inner optimizer's: updates (schedules, Adam and EMA count those).

    Example:

    ```python
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=AccumulatingOptimizer(keras.optimizers.Adam(1e-3),
                                                      accumulation_steps=4), loss="mse")
    model.fit(dataset, epochs=3)  # one update every 4 batches
    ```

    Under `mixed_float16`, compile `AllReplicasFiniteLossScaleOptimizer(
    AccumulatingOptimizer(inner, k))`. An incomplete cycle carries on into the next epoch;
    `flush()` applies it now and `discard()` drops it (see `AccumulationCallback`).

    Raises:
        ValueError: bad `accumulation_steps` / `non_finite`; an inner optimizer that
            accumulates itself; clipping, weight decay, EMA... given to the wrapper;
            (`build`) Keras' own `LossScaleOptimizer` around it on 2+ replicas; (first
            step) "raise" under XLA; on 2+ replicas, `steps_per_execution > 1`, and
            `jit_compile=True` on devices that are not all GPUs.
        TypeError: `inner_optimizer` is not a Keras 3 optimizer.
        RuntimeError: (`build` / `apply`) not all under the same distribution strategy.
        tf.errors.InvalidArgumentError: (run time) a non-finite cycle under "raise".
    """

    # Set to True by a loss-scale wrapper that skips a step unless *every* replica's
    # gradients are finite (distgrad's AllReplicasFiniteLossScaleOptimizer does).
    overflow_checked_on_every_replica = False

    def __init__(self, inner_optimizer, accumulation_steps, non_finite="raise", name=None,
                 **kwargs):
        _check_arguments(inner_optimizer, accumulation_steps, non_finite, kwargs)
        super().__init__(learning_rate=_unused_learning_rate, name=name)
        self.inner_optimizer = inner_optimizer
        self.accumulation_steps = accumulation_steps
        self.non_finite = non_finite
        self._built_under, self._under_loss_scaling = None, False
        self._skips_reported = None  # `skipped_updates` when the step was traced / last fit
        self.micro_steps = self.skipped_updates = None  # variables, created by `build`
        # Inside Keras' own wrapper on one replica (see `_check_loss_scale_wrapper`).
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
        self._check_loss_scale_wrapper()  # every call: the wrapper builds its inner one too
        if self.built:
            return
        strategy = tf.distribute.get_strategy()
        inner_strategy = getattr(self.inner_optimizer, "_distribution_strategy", strategy)
        for who, created_under in (("AccumulatingOptimizer", self._distribution_strategy),
                                   ("its inner optimizer", inner_strategy)):
            if created_under is not strategy:
                raise RuntimeError(
                    "Create the model, the inner optimizer and the AccumulatingOptimizer inside "
                    f"the same `with strategy.scope():` block: {who} was created under "
                    f"{_describe(created_under)} but is built under {_describe(strategy)}.")
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
                self.skipped_micro_batches = self.add_variable(
                    (), initializer="zeros", dtype=self._iterations.dtype,
                    aggregation="only_first_replica", name="skipped_micro_batches")
                # The wrapper's scale as the last micro-batch left it: each skip halves it.
                self._next_loss_scale = self.add_variable(
                    (), initializer=keras.initializers.Constant(
                        self._stock_wrapper().initial_scale),
                    dtype="float32", aggregation="only_first_replica", name="next_loss_scale")
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
        self._check_context()
        self._check_step()
        self._check_loss_scale_wrapper()
        self._check_variables_are_known(trainable_variables)
        if self._stock_wrapper is not None:
            if self._micro_skips_reported is None:  # the first trace: a restored count is old
                with tf.init_scope():
                    self._micro_skips_reported = int(
                        keras.ops.convert_to_numpy(self.skipped_micro_batches))
            self._count_stock_wrapper_skips()
        if self._skips_reported is None:  # the first trace: a restored count is not news
            self._skips_reported = self._skipped_now()
        # BaseOptimizer's filter: ValueError if no gradient at all, Keras' warning if some.
        grads, variables = self._filter_empty_gradients(grads, trainable_variables)
        with keras.name_scope(self.name, caller=self):
            for grad, variable in zip(grads, variables):  # replica-local: no communication
                accumulator = self._accumulator_of(variable)  # IndexedSlices: densified
                grad = tf.cast(tf.convert_to_tensor(grad), accumulator.dtype)
                if _overwritten(variable):  # as Keras' built-in: a big batch's amax is the max
                    self.assign(accumulator, tf.maximum(accumulator, grad))
                else:
                    self.assign_add(accumulator, grad)
            self._end_cycle(variables)

    def flush(self):
        """Apply the incomplete cycle, if any, as the mean of its `micro_steps` micro-batches
        (non-finite policy included). Outside `strategy.run`: eagerly or atop a tf.function."""
        if (strategy := self._strategy_outside_run("flush")) is not None:
            (tf.function(strategy.run) if tf.executing_eagerly() else strategy.run)(
                lambda: self._end_cycle(self._trainable_variables, flush=True))

    def discard(self):
        """Drop the incomplete cycle (not a skipped update). Call it as `flush`."""
        if self._strategy_outside_run("discard") is not None:
            self._reset_accumulators(self._trainable_variables)
            self.micro_steps.assign(0)

    def _strategy_outside_run(self, what):
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            raise ValueError(f"AccumulatingOptimizer.{what}() must be called outside "
                             "strategy.run (in cross-replica context), e.g. eagerly.")
        return self._built_under if self.built else None

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
        grads = [tf.cast(g if _overwritten(v) else g / tf.cast(divisor, g.dtype), v.dtype)
                 for g, v in zip(grads, variables)]
        overwritten = [_overwritten(v) for v in variables]
        context = tf.distribute.get_replica_context()
        if any(overwritten) and context is not None and context.num_replicas_in_sync > 1:
            grads = [tf.reduce_max(context.all_gather(g[None], axis=0), axis=0) if o else g
                     for g, o in zip(grads, overwritten)]  # ReduceOp has no MAX: gather
        rest = [i for i, o in enumerate(overwritten) if not o]  # Keras clips those only
        if rest and any(getattr(self, option) for option in CLIP_OPTIONS):
            for i, clipped in zip(rest, self._clip_across_replicas([grads[i] for i in rest])):
                grads[i] = clipped
        inner = self.inner_optimizer
        if not tf.__internal__.distribute.strategy_supports_no_merge_call():
            inner.apply(grads, variables)
        else:  # BaseOptimizer.apply without its `iterations` increment (docs/design.md)
            grads, variables = inner._overwrite_variables_directly_with_gradients(
                grads, variables)
            if grads:
                if inner.loss_scale_factor is not None:
                    grads = [g / inner.loss_scale_factor for g in grads]
                inner._backend_apply_gradients(grads, variables)
                for variable in variables:
                    if variable.constraint is not None:
                        variable.assign(variable.constraint(variable))
        self._reset_accumulators(self._trainable_variables)

    def _clip_across_replicas(self, local_grads):
        # Clip the summed gradient on replica 0, zeros elsewhere: the inner update SUMs again.
        context = tf.distribute.get_replica_context()
        clipped = self._clip_gradients(context.all_reduce(tf.distribute.ReduceOp.SUM, local_grads))
        is_first = tf.equal(context.replica_id_in_sync_group, 0)
        return [tf.where(is_first, c, tf.zeros_like(c)) for c in clipped]

    def _accumulator_of(self, variable):
        return self._accumulators[self._get_variable_index(variable)]

    def _check_context(self):
        if tf.distribute.get_strategy() is not self._built_under:
            raise RuntimeError(
                "Call apply_gradients inside strategy.run(...) of the strategy it was built "
                "under (model.fit does), or create a new model and optimizer inside the other "
                f"strategy's scope(): AccumulatingOptimizer was built under "
                f"{_describe(self._built_under)} but apply_gradients is called under "
                f"{_describe(tf.distribute.get_strategy())}.")
        if tf.distribute.in_cross_replica_context():
            raise ValueError("Call apply_gradients inside strategy.run(step_fn, ...) (or through "
                             "model.fit): AccumulatingOptimizer.apply_gradients must be called "
                             "in replica context, not directly under strategy.scope().")

    def _check_step(self):
        if message := _unrunnable_step(tf.distribute.get_strategy().num_replicas_in_sync):
            raise ValueError(message)

    def _check_loss_scale_wrapper(self):
        # In `build` (before any weight moves), and in `apply` (docs/design.md).
        if not self._under_loss_scaling or self.overflow_checked_on_every_replica:
            return
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            raise ValueError(STOCK_WRAPPER_MESSAGE.format(replicas=replicas))
        if self._stock_wrapper is None:
            wrappers = _loss_scale_optimizers_around(self)
            if len(wrappers) != 1:  # one left over from an earlier compile, not collected?
                gc.collect()
                wrappers = _loss_scale_optimizers_around(self)
            if len(wrappers) != 1 or self.built:  # built alone: no counter for its skips
                raise ValueError(UNFOUND_WRAPPER_MESSAGE.format(found=len(wrappers)))
            self._stock_wrapper = weakref.ref(wrappers[0])  # no checkpoint dependency

    def _count_stock_wrapper_skips(self, end_of_fit=False):
        # Each skip halves the wrapper's scale: the halvings since the last call count them.
        wrapper = self._stock_wrapper()
        scale = tf.convert_to_tensor(wrapper.dynamic_scale)
        skipped = tf.math.log(self._next_loss_scale / scale) / math.log(2.0)
        self.skipped_micro_batches.assign_add(tf.cast(tf.round(skipped), tf.int64))
        if not end_of_fit:  # then this call's own step: doubles the scale after enough
            scale = tf.where(tf.equal(wrapper.step_counter, wrapper.dynamic_growth_steps - 1),
                             2.0 * scale, scale)
        self._next_loss_scale.assign(scale)

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
            self._warn_of_stock_wrapper_skips()
        skipped, before = self._skipped_now(), self._skips_reported
        if before is not None and skipped > before:
            warnings.warn(
                f"AccumulatingOptimizer: {skipped - before} update(s) skipped in this fit "
                f"({skipped} in all, `optimizer.skipped_updates`): their cycle's gradients "
                "were NaN/Inf on some replica, and nothing was applied.", stacklevel=2)
        self._skips_reported = skipped

    def _warn_of_stock_wrapper_skips(self):
        self._count_stock_wrapper_skips(end_of_fit=True)  # the skips after the last call
        skipped = int(keras.ops.convert_to_numpy(self.skipped_micro_batches))
        before = self._micro_skips_reported or 0
        if skipped > before:
            scale = float(self._stock_wrapper().dynamic_scale.numpy())
            warnings.warn(
                f"AccumulatingOptimizer: {skipped - before} micro-batch(es) skipped in this fit "
                f"({skipped} in all, `skipped_micro_batches`): their gradients overflowed, "
                f"and Keras' LossScaleOptimizer halved its scale each time (now {scale:g}). A "
                "few are expected while the scale comes down from its initial value.",
                stacklevel=3)
        self._micro_skips_reported = skipped

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

