"""`AccumulatingOptimizer`: gradient accumulation as a Keras 3 optimizer wrapper.

    model.compile(optimizer=AccumulatingOptimizer(keras.optimizers.Adam(1e-3),
                                                  accumulation_steps=4), loss=...)

This file imports only TensorFlow and Keras: copy it into a project and use it alone.
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

# The oldest `make matrix` passes (docs/versions.md); Keras < 3.10: no Variable(synchronization=).
NEEDED = {"tensorflow": (2, 16), "keras": (3, 10)}
if any(tuple(map(int, m.__version__.split(".")[:2])) < NEEDED[m.__name__] for m in (tf, keras)):
    raise ImportError(f"distgrad.optimizer needs TensorFlow >= 2.16 and Keras >= 3.10, found "
                      f"TensorFlow {tf.__version__} and Keras {keras.__version__}: "
                      "pip install -U 'tensorflow>=2.16' 'keras>=3.10'")

CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")
NON_FINITE_POLICIES = ("raise", "skip")
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
        raise ValueError("accumulation_steps must be an integer >= 1 (the number of "
                         f"micro-batches per update), got {accumulation_steps!r}.")
    if non_finite not in NON_FINITE_POLICIES:
        raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}.")
    if kwargs:
        raise ValueError(f"AccumulatingOptimizer does not take {sorted(kwargs)}: set them on the "
                         "inner optimizer (the wrapper then clips the all-reduced gradient).")
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        kind = type(inner_optimizer)
        fix = (f"keras.optimizers.get({inner_optimizer!r})" if isinstance(inner_optimizer, str)
               else "e.g. keras.optimizers.SGD / Adam / AdamW")
        raise TypeError(f"AccumulatingOptimizer wraps a Keras 3 optimizer, got {kind.__name__} "
                        f"from {kind.__module__} (not tf.compat.v1 optimizers; tf-keras ones go "
                        f"in distgrad.tf_keras.AccumulatingOptimizer). Pass {fix}.")
    if steps := getattr(inner_optimizer, "gradient_accumulation_steps", None):
        raise ValueError(f"The inner optimizer has gradient_accumulation_steps={steps}: create "
                         "it without; AccumulatingOptimizer(accumulation_steps=) accumulates.")


# Keras' own LossScaleOptimizer is refused (see `_check_loss_scale_wrapper`): fix first.
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
    "AccumulatingOptimizer: this step is traced inside a tf.function called from a tf.cond "
    "branch, on {replicas} replicas: what Keras' model.compile(steps_per_execution > 1) "
    "builds. TensorFlow does not feed such a function the call-time key of its gradient "
    "all-reduce, so the first step would fail with \"InvalidArgumentError: You must feed "
    "a value for placeholder tensor\" (stock Keras, plain Adam too: "
    "https://github.com/keras-team/keras/issues/19246; the cause: distgrad's upstream page, "
    "'steps-per-execution'). Compile with steps_per_execution=1: accumulation already cuts "
    "the all-reduces per example k-fold.")
JIT_COMPILE_MESSAGE = (
    "AccumulatingOptimizer: this step is XLA-compiled (model.compile(jit_compile=True)) on "
    "{replicas} replicas that are not all GPUs. Keras compiles the whole step, both "
    "replicas included, into one XLA cluster, which cannot reach the other device's "
    "variables (\"Trying to access resource ... located in device CPU:1 from device "
    "CPU:0\"; stock Keras, plain Adam too: https://github.com/keras-team/keras/issues/19005). "
    "Compile with jit_compile=False (what Keras' default, \"auto\", picks under "
    "tf.distribute).")
# distgrad 0.1's keywords, and the ones that replaced them.
RENAMED_ARGUMENTS = {"optimizer": "inner_optimizer", "steps": "accumulation_steps"}


def _called_from_a_cond_branch() -> bool:
    """True if the function being traced (control-flow graphs climbed) is called, directly
    or through its callers, from a `tf.cond` branch: cond_v2 does not pass on a collective's
    call-time captures (while_v2 does), so its all-reduce key would never be fed."""
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
    """The message for a step traced here that cannot run on `replicas` replicas, or None.

    Both are stock Keras failures (plain Adam fails the same way), caught at trace time so
    that the error names the cause. XLA on GPUs takes TensorFlow's no-merge-call path,
    which the CPU tests cannot run: it is left alone."""
    if replicas < 2:
        return None
    if _called_from_a_cond_branch():
        return STEPS_PER_EXECUTION_MESSAGE.format(replicas=replicas)
    if (GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
            and not tf.__internal__.distribute.strategy_supports_no_merge_call()):
        return JIT_COMPILE_MESSAGE.format(replicas=replicas)
    return None


def _loss_scale_optimizers_around(optimizer) -> list:
    """Keras' LossScaleOptimizers whose inner optimizer is `optimizer`. Keras' wrapper gives
    its inner optimizer no reference to itself (it only sets `loss_scale_factor = None`), so
    it is looked up among the objects that refer to the inner one: an instance refers to its
    attributes directly, or through its `__dict__`."""
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

    Every k-th call of `apply_gradients` updates the inner optimizer with the *mean* of the
    k accumulated gradients: in `fit` and custom loops, under `MirroredStrategy`, without a
    strategy or `merge_call` (XLA). Create it under the scope the model trains in.

    Args:
        inner_optimizer: the Keras 3 optimizer that updates. Its clipping options move to
            the wrapper, which clips the all-reduced gradient (Keras: each replica's part).
        accumulation_steps: k, the micro-batches per update (`1` updates every call).
        non_finite: a cycle with NaN/Inf gradients on any replica (float32, no loss
            scaling). "raise" (default): the call ending it fails with
            `tf.errors.InvalidArgumentError` naming the update and micro-step, nothing
            applied, accumulators kept. "skip": no update, accumulators zeroed, counted in
            `skipped_updates`. Under a `LossScaleOptimizer` it is always skipped and
            counted: overflows are the loss scale's business.
        name: optimizer name.

    Mixed precision (`mixed_float16`): compile it inside distgrad's
    `AllReplicasFiniteLossScaleOptimizer(AccumulatingOptimizer(inner, k))`, which unscales
    each micro-batch before it is accumulated and skips (and counts, in its
    `skipped_steps`) a micro-batch that overflowed on *any* replica, halving the scale;
    the cycle then waits for k finite micro-batches, so no cycle is lost. Keras' own
    wrapper (the one `compile` adds) is right on one replica, the only one it checks, and
    is used there: the micro-batches it skips are counted in `skipped_micro_batches` (read
    off its loss scale, which halves at each skip) and warned of at the end of `fit`. On
    2+ replicas it checks replica 0 only: it is refused in `build`, before the first step,
    with the fix as the first sentence. Refused rather than repaired there: an overflow
    must lower the wrapper's scale, which only the wrapper can do.

    State (optimizer variables, saved by `model.save` and `tf.train.Checkpoint`):
        total_micro_steps: micro-batches accumulated, never reset (a `LossScaleOptimizer`
            skip is not one). micro_steps: those of the current cycle, `0 <= n < k`.
        skipped_updates: cycles dropped as non-finite. A `fit` that dropped some ends
            with a `UserWarning` (Keras calls `finalize_variable_values` then).
        skipped_micro_batches: only inside Keras' own `LossScaleOptimizer` (one replica):
            the micro-batches it skipped; also warned of at the end of `fit`.
        accumulators: replica-local (ON_READ, SUM) float32 sums (float64 for float64
            variables); a checkpoint holds their sum over replicas.
        iterations: the inner optimizer's: updates (schedules, Adam, EMA count those).

    Invariants: `n * k` calls equal `n` inner updates with the mean gradient of each k
    micro-batches (with Keras' loss scaling, `n` steps on k-times larger batches). One
    gradient all-reduce per update, none on other calls (one more with clipping; one of one
    element without merge_call on 2+ replicas, or on 2+ workers: every replica's finiteness
    flag). An
    incomplete cycle carries on into the next epoch; `flush()` applies it now, `discard()`
    drops it (`distgrad.callbacks.AccumulationCallback`).

    Raises:
        ValueError: bad `accumulation_steps` / `non_finite`; an inner optimizer with its own
            accumulation; clipping, weight decay, EMA... given to the wrapper; (`build`,
            before the first step) Keras' own `LossScaleOptimizer` around it (the one
            `compile` adds under `mixed_float16`) on 2+ replicas: pass
            `AllReplicasFiniteLossScaleOptimizer(this)` to `compile`; (first step)
            "raise" in an XLA-compiled step, which cannot raise; on 2+ replicas,
            `compile(steps_per_execution > 1)`, and
            `jit_compile=True` on devices that are not all GPUs, which stock Keras
            cannot run there either (the message names the fix).
        TypeError: `inner_optimizer` is not a Keras 3 optimizer; distgrad 0.1's keywords
            `optimizer=` / `steps=` (the message names the new ones).
        RuntimeError: (`build` / `apply`) not all under the same distribution strategy.
        tf.errors.InvalidArgumentError: (run time) a non-finite cycle under "raise".
    """

    # Set to True by a loss-scale wrapper that skips a step unless *every* replica's
    # gradients are finite (distgrad's AllReplicasFiniteLossScaleOptimizer does).
    overflow_checked_on_every_replica = False

    def __new__(cls, *args, **kwargs):
        # Before Python's "missing 2 required positional arguments" for distgrad 0.1 code.
        if renamed := [f"{old}= is now {new}=" for old, new in RENAMED_ARGUMENTS.items()
                       if old in kwargs]:
            raise TypeError(f"AccumulatingOptimizer: {'; '.join(renamed)} (distgrad 0.2): "
                            "AccumulatingOptimizer(inner_optimizer, accumulation_steps).")
        return super().__new__(cls)

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
        """Micro-batches seen, never reset: BaseOptimizer's own `iterations` variable
        (checkpointed, ONLY_FIRST_REPLICA)."""
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
        """The inner optimizer's (None until `__init__` sets `inner_optimizer`); assigning
        it goes through `__setattr__`."""
        return getattr(self.__dict__.get("inner_optimizer"), "loss_scale_factor", None)

    def __setattr__(self, name, value):
        # A wrapping LossScaleOptimizer sets `loss_scale_factor = None`: see `non_finite`.
        # Not a property setter: Keras skips `self.x = v` when `self.x is v` already.
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
        """Create accumulators and counters (under the strategy everything was created in).

        Keras' own `LossScaleOptimizer` around it is refused here on 2+ replicas (found,
        to count its skips, on one): `fit` builds the optimizer before its first step,
        and so does the wrapper's first `apply`."""
        self._check_loss_scale_wrapper()  # every call: the wrapper builds its inner one too
        if self.built:
            return
        strategy = tf.distribute.get_strategy()
        inner_strategy = getattr(self.inner_optimizer, "_distribution_strategy", strategy)
        for who, created_under in (("AccumulatingOptimizer", self._distribution_strategy),
                                   ("its inner optimizer", inner_strategy)):
            if created_under is not strategy:
                raise RuntimeError(
                    f"{who} was created under {_describe(created_under)} but is built under "
                    f"{_describe(strategy)}: its counters would not be mirrored and would count "
                    "wrong. Create the model, the inner optimizer and the AccumulatingOptimizer "
                    "inside the same `with strategy.scope():` block.")
        super().build(var_list)
        self._accumulators = []
        with keras.name_scope(self.name, caller=self):
            for variable in var_list:
                name = getattr(variable, "path", variable.name).replace("/", "_")
                # float32: k float16 gradients summed in float16 lose the small ones. ON_READ
                # + SUM: each replica adds to its own copy without communicating; a cross-
                # replica read is the sum. (`add_variable` cannot set `synchronization`.)
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
                # The wrapper's loss scale after the last micro-batch that reached this
                # optimizer, as it stays unless the wrapper skips some: each skip halves it.
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
        """Accumulate this replica's `grads` (`None` skipped, `IndexedSlices` densified);
        on every k-th call, update. Replica context (inside `strategy.run`, as `fit` does,
        or without a strategy): ValueError in cross-replica context or without any
        gradient, RuntimeError under another strategy than the one it was built under."""
        if not (grads := list(grads)):
            return
        if trainable_variables is None and not self.built:
            raise ValueError("When passing gradients without variables the optimizer must be "
                             "built: call optimizer.build(model.trainable_variables) first.")
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
        # From merge_call (cross-replica context) it runs once for all replicas: one count,
        # one predicate. Without merge_call (`distribution=None`) every replica runs it.
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
            # Every replica's accumulators, not replica 0's: Keras' LossScaleOptimizer
            # checks replica 0 only, so an overflow elsewhere can be in here.
            finite = self._all_replicas_finite(on_replicas(self._local_accumulators_finite,
                                                           variables), distribution)

            def apply_cycle():
                on_replicas(self._apply_accumulated, variables, divisor)
                return tf.constant(_APPLIED, tf.int64)

            def drop_cycle():
                if not self._raise_non_finite():
                    on_replicas(self._reset_accumulators, self._trainable_variables)
                return tf.constant(_SKIPPED, tf.int64)

            return tf.cond(finite, apply_cycle, drop_cycle)

        # As in LossScaleOptimizer._tf_apply, this cond is in cross-replica context (keras#20582):
        # MirroredStrategy refuses a replica-context cond whose branch calls merge_call (the
        # inner update does); call_for_each_replica starts fresh replica threads inside the
        # branch, where merge_call works again. Without merge_call the branches may hold a
        # collective but no ONLY_FIRST_REPLICA update: counters are updated after the cond.
        outcome = tf.cond(due, finish_cycle, lambda: tf.constant(_NOTHING, tf.int64))
        self.skipped_updates.assign_add(tf.cast(tf.equal(outcome, _SKIPPED), tf.int64))
        if distribution is None:  # `_apply_accumulated` left this increment out
            self.iterations.assign_add(tf.cast(tf.equal(outcome, _APPLIED), tf.int64))
        if flush:
            self.micro_steps.assign(0)

    @staticmethod
    def _all_replicas_finite(finite, distribution):
        if distribution is not None:  # cross-replica context: every worker's flags
            return _finite_everywhere(distribution, finite)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite  # else no cross-replica context to read the flags in: all-reduce
        return tf.equal(context.all_reduce(
            tf.distribute.ReduceOp.SUM, 1.0 - tf.cast(finite, tf.float32)), 0.0)

    def _raise_non_finite(self):
        # In a non-finite cycle's branch: True (and a failing assertion) unless skipped.
        if self.non_finite == "skip" or self._under_loss_scaling:
            return False
        if GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            raise ValueError(
                "AccumulatingOptimizer(non_finite='raise') cannot raise in an XLA-compiled step "
                "(XLA compiles assertions out; Keras compiles with XLA on a GPU by itself): pass "
                "non_finite='skip' and watch skipped_updates, or compile with jit_compile=False.")
        tf.debugging.Assert(False, [
            "AccumulatingOptimizer: NaN/Inf gradients on some replica in the cycle of update",
            self.iterations + 1, "ending at micro-step", self._iterations.value,
            "(total_micro_steps); nothing applied. non_finite='skip' would drop and count it."])
        return True

    def _local_accumulators_finite(self, variables):
        return tf.reduce_all(tf.stack([
            tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(self._accumulator_of(v))))
            for v in variables]))

    def _reset_accumulators(self, variables):
        for accumulator in [self._accumulator_of(v) for v in variables]:
            self.assign(accumulator, tf.zeros(accumulator.shape, accumulator.dtype))

    def _apply_accumulated(self, variables, divisor):
        # Replica context. This replica's share of the mean gradient: the inner update's SUM
        # all-reduce makes it the mean over micro-batches and replicas (overwritten: the max).
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
        else:  # BaseOptimizer.apply without its `_iterations.assign_add(1)`, a merge_call
            # refused in this cond; `_cross_replica_step` counts the update after it.
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
        # Clipping is not linear: it needs the summed gradient (one more all-reduce). The
        # inner optimizer SUMs again, so replica 0 passes the clipped total, the others 0.
        context = tf.distribute.get_replica_context()
        clipped = self._clip_gradients(context.all_reduce(tf.distribute.ReduceOp.SUM, local_grads))
        is_first = tf.equal(context.replica_id_in_sync_group, 0)
        return [tf.where(is_first, c, tf.zeros_like(c)) for c in clipped]

    def _accumulator_of(self, variable):
        return self._accumulators[self._get_variable_index(variable)]

    def _check_context(self):
        if tf.distribute.get_strategy() is not self._built_under:
            raise RuntimeError(
                f"AccumulatingOptimizer was built under {_describe(self._built_under)} but "
                f"apply_gradients is called under {_describe(tf.distribute.get_strategy())}. "
                "Call it inside strategy.run(...) of that strategy (model.fit does), or create "
                "a new model and optimizer inside the other strategy's scope().")
        if tf.distribute.in_cross_replica_context():
            raise ValueError("AccumulatingOptimizer.apply_gradients must be called in replica "
                             "context: inside strategy.run(step_fn, ...) (or through "
                             "model.fit), not directly under strategy.scope().")

    def _check_step(self):
        if message := _unrunnable_step(tf.distribute.get_strategy().num_replicas_in_sync):
            raise ValueError(message)

    def _check_loss_scale_wrapper(self):
        # In `build`: before any weight moves, and outside Keras' traced `Cond.call()`. Again
        # in `apply`, for a wrapper that would never build its inner optimizer.
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
        # Keras' wrapper calls `apply` for finite micro-batches only, after unscaling them
        # and before its growth step; a skip halves its scale. So the scale now, against the
        # scale the last call left it at, counts the skips in between: exactly (powers of 2).
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
        # distgrad 0.1 saved the same two values as "optimizer" and "steps".
        inner = config.pop("inner_optimizer", None) or config.pop("optimizer")
        if "steps" in config:
            config["accumulation_steps"] = config.pop("steps")
        inner = keras.saving.deserialize_keras_object(inner, custom_objects=custom_objects)
        return cls(inner, **config)


def _finite_everywhere(distribution, finite):
    """In cross-replica context: whether the per-replica flag `finite` holds on every
    replica of every worker.

    `experimental_local_results` holds this worker's replicas only. On one worker (every
    replica local: MirroredStrategy) their AND is the answer, with no collective. On a
    MultiWorkerMirroredStrategy of 2+ workers, one small all-reduce (float32: GPU
    collectives take no int32) adds up the non-finite flags, so every worker takes the same
    branch; else a worker that skips leaves the others waiting in the gradient all-reduce.
    Every worker issues it, before the branch, in the same order.
    """
    local = distribution.experimental_local_results(finite)
    if distribution.num_replicas_in_sync == len(local):
        return tf.reduce_all(tf.stack(local))
    # Each local replica's 1.0 if non-finite (any order: it is a sum); no replica threads,
    # which call_for_each_replica would start inside merge_call.
    non_finite = distribution.experimental_distribute_values_from_function(
        lambda value_context: 1.0 - tf.cast(
            local[value_context.replica_id_in_sync_group % len(local)], tf.float32))
    return tf.equal(distribution.reduce(tf.distribute.ReduceOp.SUM, non_finite, axis=None), 0.0)
