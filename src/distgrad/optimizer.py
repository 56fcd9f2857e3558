"""`AccumulatingOptimizer`: gradient accumulation as a Keras 3 optimizer wrapper.

It imports only TensorFlow, Keras and the standard library: copy this one file. Below the
class: what it refuses, the update a cycle makes, Keras' own `LossScaleOptimizer` around it,
and the non-finite helpers it shares with the other reference classes (generated from
`non_finite.py`). Design notes: docs/design.md, "AccumulatingOptimizer".
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

# The public names (the API page documents them); the other functions serve them.
__all__ = ["AccumulatingOptimizer"]

# The oldest `make matrix` passes (docs/versions.md); Keras < 3.10: no Variable(synchronization=).
NEEDED = {"tensorflow": (2, 16), "keras": (3, 10)}
if any(tuple(map(int, m.__version__.split(".")[:2])) < NEEDED[m.__name__] for m in (tf, keras)):
    raise ImportError(f"distgrad.optimizer needs TensorFlow >= 2.16 and Keras >= 3.10, found "
                      f"TensorFlow {tf.__version__} and Keras {keras.__version__}: "
                      "pip install -U 'tensorflow>=2.16' 'keras>=3.10'")

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

    Example:

    ```python
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=AccumulatingOptimizer(keras.optimizers.Adam(1e-3),
                                                      accumulation_steps=4), loss="mse")
    # Each update: 4 batches of 32, the mean gradient of 128 examples.
    model.fit(dataset.batch(32), epochs=3, callbacks=[AccumulationCallback("flush")])
    ```

    Raises:
        ValueError: bad arguments, or a step it cannot run (this file's section "What
            AccumulatingOptimizer refuses");
            Keras' own `LossScaleOptimizer` around it on 2+ replicas; "raise" under XLA.
        TypeError: `inner_optimizer` is not a Keras 3 optimizer.
        RuntimeError: (`build` / `apply`) not all under the same distribution strategy.
        tf.errors.InvalidArgumentError: (run time) a non-finite cycle under "raise".
    """

    # True inside a loss-scale wrapper that checks every replica (AllReplicasFinite...).
    overflow_checked_on_every_replica = False

    def __init__(self, inner_optimizer, accumulation_steps, non_finite="raise", name=None,
                 **kwargs):
        check_arguments(inner_optimizer, accumulation_steps, non_finite, kwargs)
        super().__init__(learning_rate=_unused_learning_rate, name=name)
        self.inner_optimizer = inner_optimizer
        self.accumulation_steps = accumulation_steps
        self.non_finite = non_finite
        self._built_under, self._under_loss_scaling = None, False
        self._skips_reported = None  # `skipped_updates` when the step was traced / last fit
        self.micro_steps = self.skipped_updates = None  # variables, created by `build`
        # Inside Keras' own wrapper on one replica (its section, below the class).
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
        check_loss_scale_wrapper(self)
        if self.built:
            return
        strategy = tf.distribute.get_strategy()
        check_built_under(self, strategy)
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
                add_skip_counters(self)
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
        check_step(self._built_under)
        check_loss_scale_wrapper(self)
        self._check_variables_are_known(trainable_variables)
        if self._stock_wrapper is not None:
            count_skips(self)
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
        check_outside_run("flush")
        if self.built:
            run = self._built_under.run
            (tf.function(run) if tf.executing_eagerly() else run)(
                lambda: self._end_cycle(self._trainable_variables, flush=True))

    def discard(self):
        """Drop the incomplete cycle (not a skipped update). Call it as `flush`."""
        check_outside_run("discard")
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
        apply_to_inner(self, [
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
            warn_of_skips(self)
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


# ---- What AccumulatingOptimizer refuses before it runs, each with a message naming the fix:
# bad arguments (at construction); an optimizer built or applied under another strategy
# than it was created under, or applied in cross-replica context; steps that stock Keras
# cannot run on 2+ replicas (traced in a `tf.cond` branch, as `steps_per_execution > 1`
# builds them, or XLA-compiled on devices that are not all GPUs), caught at trace time.

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


def describe(strategy) -> str:
    """A strategy as the messages name it."""
    if strategy is None or type(strategy).__name__ == "_DefaultDistributionStrategy":
        return "no strategy" + ("" if strategy is None else " (the default strategy)")
    return f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replica(s)"


def check_arguments(inner_optimizer, accumulation_steps, non_finite, kwargs) -> None:
    """`AccumulatingOptimizer.__init__`'s arguments."""
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


def check_built_under(optimizer, strategy) -> None:
    """In `build`: the wrapper and its inner optimizer were created under `strategy`."""
    inner_strategy = getattr(optimizer.inner_optimizer, "_distribution_strategy", strategy)
    for who, created_under in (("AccumulatingOptimizer", optimizer._distribution_strategy),
                               ("its inner optimizer", inner_strategy)):
        if created_under is not strategy:
            raise RuntimeError(
                "Create the model, the inner optimizer and the AccumulatingOptimizer inside "
                f"the same `with strategy.scope():` block: {who} was created under "
                f"{describe(created_under)} but is built under {describe(strategy)}.")


def check_step(built_under) -> None:
    """In `apply`: replica context of the strategy it was built under, and a step that can
    run there."""
    if tf.distribute.get_strategy() is not built_under:
        raise RuntimeError(
            "Call apply_gradients inside strategy.run(...) of the strategy it was built "
            "under (model.fit does), or create a new model and optimizer inside the other "
            f"strategy's scope(): AccumulatingOptimizer was built under "
            f"{describe(built_under)} but apply_gradients is called under "
            f"{describe(tf.distribute.get_strategy())}.")
    if tf.distribute.in_cross_replica_context():
        raise ValueError("Call apply_gradients inside strategy.run(step_fn, ...) (or through "
                         "model.fit): AccumulatingOptimizer.apply_gradients must be called "
                         "in replica context, not directly under strategy.scope().")
    if message := unrunnable_step(tf.distribute.get_strategy().num_replicas_in_sync):
        raise ValueError(message)


def check_outside_run(what: str) -> None:
    """`flush` and `discard`: outside `strategy.run`, in cross-replica context."""
    if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
        raise ValueError(f"AccumulatingOptimizer.{what}() must be called outside "
                         "strategy.run (in cross-replica context), e.g. eagerly.")


def called_from_a_cond_branch() -> bool:
    """True if the function being traced is called, directly or through its callers, from
    a `tf.cond` branch."""
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    graph = getattr(graph, "outer_graph", None)
    while graph is not None:
        if isinstance(graph, CondBranchFuncGraph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def unrunnable_step(replicas: int) -> str | None:
    """The message for a step traced here that cannot run on `replicas` replicas, or None
    (stock Keras failures, caught at trace time; XLA on GPUs is left alone)."""
    if replicas < 2:
        return None
    if called_from_a_cond_branch():
        return STEPS_PER_EXECUTION_MESSAGE.format(replicas=replicas)
    if (GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
            and not tf.__internal__.distribute.strategy_supports_no_merge_call()):
        return JIT_COMPILE_MESSAGE.format(replicas=replicas)
    return None


# ---- The update a cycle makes. Overwritten variables (float8 scales and amax histories)
# take the maximum over replicas; the rest is clipped once, as the all-reduced whole, with
# the wrapper's clipping options; then the inner optimizer applies it, without its
# `iterations` increment where TensorFlow has no `merge_call` (XLA on GPUs).

def overwritten(variable) -> bool:
    """float8 scales and amax histories: assigned, not stepped."""
    return getattr(variable, "overwrite_with_gradient", False)


def apply_to_inner(optimizer, grads, variables) -> None:
    """Replica context: `grads`, this replica's share of the mean gradient (overwritten
    variables: its maximum), updates `optimizer.inner_optimizer`."""
    flags = [overwritten(v) for v in variables]
    context = tf.distribute.get_replica_context()
    if any(flags) and context is not None and context.num_replicas_in_sync > 1:
        grads = [tf.reduce_max(context.all_gather(g[None], axis=0), axis=0) if o else g
                 for g, o in zip(grads, flags)]  # ReduceOp has no MAX: gather
    rest = [i for i, o in enumerate(flags) if not o]  # Keras clips those only
    if rest and any(getattr(optimizer, option) for option in CLIP_OPTIONS):
        for i, clipped in zip(rest, clip_across_replicas(optimizer, [grads[i] for i in rest])):
            grads[i] = clipped
    inner = optimizer.inner_optimizer
    if not tf.__internal__.distribute.strategy_supports_no_merge_call():
        inner.apply(grads, variables)
    else:  # BaseOptimizer.apply without its `iterations` increment (docs/design.md)
        grads, variables = inner._overwrite_variables_directly_with_gradients(grads, variables)
        if grads:
            if inner.loss_scale_factor is not None:
                grads = [g / inner.loss_scale_factor for g in grads]
            inner._backend_apply_gradients(grads, variables)
            for variable in variables:
                if variable.constraint is not None:
                    variable.assign(variable.constraint(variable))


def clip_across_replicas(optimizer, local_grads) -> list:
    """Clip the summed gradient on replica 0, zeros elsewhere: the inner update SUMs again."""
    context = tf.distribute.get_replica_context()
    clipped = optimizer._clip_gradients(
        context.all_reduce(tf.distribute.ReduceOp.SUM, local_grads))
    is_first = tf.equal(context.replica_id_in_sync_group, 0)
    return [tf.where(is_first, c, tf.zeros_like(c)) for c in clipped]


# ---- Keras' own LossScaleOptimizer around it. On 2+ replicas it is refused in `build` (it
# checks replica 0's gradients only): compile `AllReplicasFiniteLossScaleOptimizer(
# AccumulatingOptimizer(inner, k))` instead. On one replica it is correct, and
# `AccumulatingOptimizer` counts the micro-batches it skips (`skipped_micro_batches`) and
# warns of them at the end of `fit`. Keras' wrapper gives its inner optimizer no reference
# to itself: it is found among the inner one's referrers (`gc.get_referrers`).

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


def loss_scale_optimizers_around(optimizer) -> list:
    """Keras' LossScaleOptimizers whose inner optimizer is `optimizer`, found among its
    referrers (directly, or through an instance's `__dict__`)."""
    referrers = gc.get_referrers(optimizer)
    dicts = [r for r in referrers if isinstance(r, dict)]
    found = []
    for candidate in referrers + (gc.get_referrers(*dicts) if dicts else []):
        if (isinstance(candidate, keras.optimizers.LossScaleOptimizer)
                and vars(candidate).get("inner_optimizer") is optimizer
                and not any(candidate is f for f in found)):
            found.append(candidate)
    return found


def check_loss_scale_wrapper(optimizer) -> None:
    """Refuse Keras' own wrapper around `optimizer` on 2+ replicas; on one, find it (once).

    Called in `build` (before any weight moves) and in `apply`."""
    if not optimizer._under_loss_scaling or optimizer.overflow_checked_on_every_replica:
        return
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1:
        raise ValueError(STOCK_WRAPPER_MESSAGE.format(replicas=replicas))
    if optimizer._stock_wrapper is None:
        wrappers = loss_scale_optimizers_around(optimizer)
        if len(wrappers) != 1:  # one left over from an earlier compile, not collected?
            gc.collect()
            wrappers = loss_scale_optimizers_around(optimizer)
        if len(wrappers) != 1 or optimizer.built:  # built alone: no counter for its skips
            raise ValueError(UNFOUND_WRAPPER_MESSAGE.format(found=len(wrappers)))
        optimizer._stock_wrapper = weakref.ref(wrappers[0])  # no checkpoint dependency


def add_skip_counters(optimizer) -> None:
    """In `build`, under Keras' wrapper: `skipped_micro_batches` and the wrapper's scale as
    the last micro-batch left it (`_next_loss_scale`; each skip halves it)."""
    optimizer.skipped_micro_batches = optimizer.add_variable(
        (), initializer="zeros", dtype=optimizer._iterations.dtype,
        aggregation="only_first_replica", name="skipped_micro_batches")
    optimizer._next_loss_scale = optimizer.add_variable(
        (), initializer=keras.initializers.Constant(optimizer._stock_wrapper().initial_scale),
        dtype="float32", aggregation="only_first_replica", name="next_loss_scale")


def count_skips(optimizer, end_of_fit=False) -> None:
    """In `apply` (and at the end of `fit`): add the skips since the last call to
    `skipped_micro_batches`. Each skip halves the wrapper's scale, so the halvings count them
    exactly (powers of 2)."""
    if not end_of_fit and optimizer._micro_skips_reported is None:  # the first trace: a
        with tf.init_scope():  # restored count is old
            optimizer._micro_skips_reported = int(
                keras.ops.convert_to_numpy(optimizer.skipped_micro_batches))
    wrapper = optimizer._stock_wrapper()
    scale = tf.convert_to_tensor(wrapper.dynamic_scale)
    skipped = tf.math.log(optimizer._next_loss_scale / scale) / math.log(2.0)
    optimizer.skipped_micro_batches.assign_add(tf.cast(tf.round(skipped), tf.int64))
    if not end_of_fit:  # then this call's own step: doubles the scale after enough
        scale = tf.where(tf.equal(wrapper.step_counter, wrapper.dynamic_growth_steps - 1),
                         2.0 * scale, scale)
    optimizer._next_loss_scale.assign(scale)


def warn_of_skips(optimizer) -> None:
    """At the end of `fit`: a `UserWarning` if micro-batches were skipped since the last."""
    count_skips(optimizer, end_of_fit=True)  # the skips after the last call
    skipped = int(keras.ops.convert_to_numpy(optimizer.skipped_micro_batches))
    before = optimizer._micro_skips_reported or 0
    if skipped > before:
        scale = float(optimizer._stock_wrapper().dynamic_scale.numpy())
        warnings.warn(
            f"AccumulatingOptimizer: {skipped - before} micro-batch(es) skipped in this fit "
            f"({skipped} in all, `skipped_micro_batches`): their gradients overflowed, "
            f"and Keras' LossScaleOptimizer halved its scale each time (now {scale:g}). A "
            "few are expected while the scale comes down from its initial value.",
            stacklevel=3)
    optimizer._micro_skips_reported = skipped


# ---- generated from non_finite.py: CLIP_OPTIONS, all_finite, check_can_raise, check_policy,
#   finite_everywhere, finite_on_all_replicas
# Copied here so that this file copies alone: edit non_finite.py, then run `make copies`.

NON_FINITE_POLICIES = ("raise", "skip")
CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")


def check_policy(non_finite) -> None:
    if non_finite not in NON_FINITE_POLICIES:
        raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}.")


def check_can_raise(who: str = "non_finite='raise'") -> None:
    """Trace time: refuse "raise" in an XLA-compiled step, which compiles assertions out."""
    if GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            "Pass non_finite='skip' (and watch skipped_updates), or compile with "
            f"jit_compile=False: {who} cannot raise in an XLA-compiled step, where XLA "
            "compiles assertions out (Keras compiles with XLA on a GPU by itself).")


def all_finite(tensors):
    """A scalar bool: every element of every tensor (None skipped) is finite."""
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(t)))
                                   for t in tensors if t is not None]))


def finite_everywhere(distribution, finite):
    """Cross-replica context: whether the per-replica flag `finite` holds on every replica
    of every worker (one small all-reduce on 2+ workers, none on one)."""
    local = distribution.experimental_local_results(finite)
    if distribution.num_replicas_in_sync == len(local):
        return tf.reduce_all(tf.stack(local))
    non_finite = distribution.experimental_distribute_values_from_function(
        lambda value_context: 1.0 - tf.cast(
            local[value_context.replica_id_in_sync_group % len(local)], tf.float32))
    return tf.equal(distribution.reduce(tf.distribute.ReduceOp.SUM, non_finite, axis=None), 0.0)


def finite_on_all_replicas(finite):
    """Replica context, without merge_call: `finite` on every replica (one all-reduce)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return finite
    return tf.equal(context.all_reduce(
        tf.distribute.ReduceOp.SUM, 1.0 - tf.cast(finite, tf.float32)), 0.0)


# ---- end of the code generated from non_finite.py
