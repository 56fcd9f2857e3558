"""Pitfall: monkey-patching `apply_gradients` for accumulation under `mixed_float16`.

The question (tensorflow/tensorflow#50454, "assign_add() not working on GPU?") patched
an optimizer's `apply_gradients` with an accumulator that always calls the original
with `accumulated * apply` (apply = 0 or 1) and resets with `accumulated * keep`
(keep = 1 - apply). Under `mixed_float16` the optimizer was a `LossScaleOptimizer`;
patching it "did nothing", and patching its `inner_optimizer` "does not work either".
`SeedAccumulationPatch` is that accumulator, line for line.

What actually happens (read from the installed source, shown by `spy_patched_fit`
and `reproduce`):

* Patching the **LossScaleOptimizer instance** *does* accumulate. In Keras 3 the
  patch sits between the train step and `LossScaleOptimizer.apply`, so it accumulates
  **scaled** float32 gradients (`TensorFlowTrainer.train_step` multiplies the loss by
  `optimizer.scale_loss`; the wrapper divides by `dynamic_scale` later, in
  `_stateful_handle_finite_grads`). The failure comes with the first overflow, which
  dynamic loss scaling *expects* (it starts at 2**15 and halves on overflow): the
  non-finite micro-batch is added into the accumulator, the reset `accumulated * keep`
  is `inf * 0 = nan`, and from then on every call hands the wrapper a non-finite
  gradient. The wrapper skips every step and halves the scale every step; the weights
  never move again. `assign(grad)` instead of `assign_add` overwrites the poison each
  step, which is why the question's "assign" run converged.
* Patching **`inner_optimizer.apply_gradients`** is dead code in Keras 3:
  `LossScaleOptimizer._stateful_handle_finite_grads` calls `inner_optimizer.apply(...)`,
  never `apply_gradients`, so the patch never runs and training is plain
  non-accumulating training. (In tf-keras the wrapper does call
  `inner_optimizer.apply_gradients`; see `legacy_reproduction`.)

Both variants also count micro-steps as optimizer iterations and let the loss scale
change inside an accumulation window. The correct composition is lesson 04's fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import threading

import keras
import numpy as np
import tensorflow as tf

from distgrad.callpath import current_context
from distgrad.lab.compare import weights_of
from distgrad.lab.data import regression_data, tiny_model
from distgrad.pitfalls import CapturedError

TARGETS = ("loss_scale_optimizer", "inner_optimizer", "none")
# A target this far from the data makes the scaled gradient of its example exceed
# float16's largest finite value (65504) at any loss scale >= 1, while the float32
# loss stays finite: an overflow caused by loss scaling, not by the forward pass.
OUTLIER_TARGET = 1.0e4
FLOAT16_MAX = 65504.0
# Mixed-precision tolerances for comparing two mixed_float16 runs that compute the
# same update in a different order (k micro-batches vs one big batch). float16 keeps
# 10 mantissa bits (machine epsilon 2**-10 ~ 9.8e-4), and every float16 op in the
# forward and backward pass rounds to that, so two orders of summation agree only to
# about that: `np.allclose(a, e, rtol=1e-2, atol=1e-3)`. The float32 checks of the
# other lessons stay at 1e-6.
MIXED_PRECISION_RTOL = 1e-2
MIXED_PRECISION_ATOL = 1e-3
# Keras' default initial loss scale. It is meant to overflow in the first steps (a
# scale that is too high costs a skipped step; one that is too low loses gradients),
# and on 1 replica it does so on this lesson's data. Controlled experiments start
# lower, so that the only overflow is the one they inject.
DEFAULT_INITIAL_SCALE = 2.0**15
CONTROLLED_INITIAL_SCALE = 2.0**10


class SeedAccumulationPatch:
    """The question's `_GradientAccumulationPatch` ("the more complicated path").

    Every call: count the step, add the gradients into `accu_gradients`, call the
    original `apply_gradients` with `accu_gradients * apply` (apply = 1 on every
    `n`-th call, else 0), then reset with `accu_gradients * keep`. `calls` counts how
    often the patched method actually ran (a variable, so it counts executions of a
    traced step, not traces). Create it where the question did: after the model is
    built, under the strategy scope (the accumulators are then `MirroredVariable`s
    that every replica updates locally).
    """

    def __init__(self, n: int, orig_apply_gradients, trainable_variables):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}.")
        self.n = tf.constant(n, dtype=tf.int64)
        policy = keras.mixed_precision.global_policy()
        self.variable_dtype = policy.variable_dtype
        self.accu_gradients = [
            tf.Variable(tf.zeros(g.shape, dtype=g.dtype), trainable=False)
            for g in trainable_variables
        ]
        self._current_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.calls = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._orig_apply_gradients = orig_apply_gradients

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        self.calls.assign_add(1)
        can_apply = self._can_apply_on_next_step()
        # 1.0 whenever we want to apply gradients; 0.0 otherwise
        apply = tf.cast(can_apply, dtype=self.variable_dtype)
        # Will be 0.0 if apply is 1.0 and vice versa
        keep = tf.cast(tf.logical_not(can_apply), dtype=self.variable_dtype)

        grads_and_vars = list(grads_and_vars)
        gradients = [grad for (grad, _) in grads_and_vars]
        trainable_variables = [var for (_, var) in grads_and_vars]

        # Accumulate gradients
        for i, grad in enumerate(gradients):
            self.accu_gradients[i].assign_add(grad)

        # Multiply each gradient with our apply-signal
        final_gradients = [grad * apply for grad in self.accu_gradients]

        result = self._orig_apply_gradients(
            zip(final_gradients, trainable_variables), *args, **kwargs)

        # This will reset our buffer whenever "keep" is 0.0
        for g in self.accu_gradients:
            g.assign(g * keep)
        return result

    def _can_apply_on_next_step(self):
        self._current_step.assign_add(1)
        count_mod_steps = tf.math.mod(self._current_step, self.n)
        return tf.equal(count_mod_steps, 0)


def patch_optimizer(optimizer, n: int, trainable_variables, target: str = "loss_scale_optimizer"):
    """Install a `SeedAccumulationPatch` the way the question did; returns the patch.

    `target="loss_scale_optimizer"` replaces `optimizer.apply_gradients` on the
    wrapper instance; `"inner_optimizer"` replaces `optimizer.inner_optimizer.
    apply_gradients`. Raises ValueError for another target and TypeError when
    `optimizer` is not a `keras.mixed_precision.LossScaleOptimizer`.
    """
    if target not in TARGETS[:2]:
        raise ValueError(f"target must be one of {TARGETS[:2]}, got {target!r}.")
    if not isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        raise TypeError(
            "patch_optimizer expects a keras.mixed_precision.LossScaleOptimizer (wrap the "
            f"optimizer first), got {type(optimizer).__name__}.")
    patched = optimizer if target == "loss_scale_optimizer" else optimizer.inner_optimizer
    patch = SeedAccumulationPatch(n, patched.apply_gradients, trainable_variables)
    patched.apply_gradients = patch.apply_gradients
    return patch


@contextlib.contextmanager
def mixed_precision_policy(name: str = "mixed_float16"):
    """Set the global Keras dtype policy for the block, and restore the previous one."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


# ---------------------------------------------------------------------------------
# The call spy: which methods run, where, on what.

# (module, class, method, how to find the gradients in the call's arguments)
SPIED_METHODS = (
    ("distgrad.pitfalls.loss_scale_patch", "SeedAccumulationPatch", "apply_gradients", "pairs"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer", "apply_gradients", "pairs"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer", "apply", "list"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer", "check_finite", "list"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer",
     "_stateful_handle_finite_grads", "list"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer",
     "_stateful_handle_non_finite_grads", "none"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer", "apply", "list"),
    ("keras.src.backend.tensorflow.optimizer", "TFOptimizer", "_all_reduce_sum_gradients",
     "pairs+result"),
    ("keras.src.optimizers.sgd", "SGD", "update_step", "single"),
)


@dataclasses.dataclass(frozen=True)
class SpiedCall:
    """One execution of a spied method.

    `function` is `<class of self>.<method>` (so the wrapper's and the inner
    optimizer's `apply_gradients` are told apart), `context` is "replica" or
    "cross-replica", `replica` the replica id in replica context (else None),
    `dtypes` the gradient dtypes, `scale_seen` the ratio of the gradient passed to
    the reference gradient (see `spy_patched_fit`; None where not measured).
    """

    step: int
    function: str
    context: str
    replica: int | None
    dtypes: tuple[str, ...]
    scale_seen: float | None


@dataclasses.dataclass(frozen=True)
class SpyRecord:
    """Every executed spied call of a short `model.fit`, and how to query it.

    `traced` lists the spied functions in the order the train step's Python called
    them while being traced (execution order of independent ops is not defined).
    """

    target: str
    replicas: int
    loss_scale: float
    calls: tuple[SpiedCall, ...]
    traced: tuple[str, ...]

    def of(self, function: str, step: int | None = None) -> list[SpiedCall]:
        return [c for c in self.calls
                if c.function == function and (step is None or c.step == step)]

    def count(self, function: str, step: int | None = None) -> int:
        return len(self.of(function, step))

    def table(self) -> list[tuple]:
        """`(step, function, context, calls, dtypes, scale_seen)` rows, one per
        (step, function, context) in trace order, `scale_seen` of the first call."""
        rows = {}
        for c in self.calls:
            key = (c.step, c.function, c.context)
            if key not in rows:
                rows[key] = [c.step, c.function, c.context, 0, c.dtypes, c.scale_seen]
            rows[key][3] += 1
        order = {f: i for i, f in enumerate(self.traced)}
        return [tuple(r) for _, r in sorted(rows.items(),
                                             key=lambda kv: (kv[0][0], order[kv[0][1]]))]


def _flat(values):
    return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values])


class _Spy:
    """Wraps `SPIED_METHODS` on their classes. Each call, while the train step is
    traced, adds a `tf.py_function` that records the call *when it executes*, with the
    gradient values: so the record counts executions per step, in graph mode.
    (Eager `model.fit` would be simpler, but eager collectives under MirroredStrategy
    poison the collective-key cache of later strategies in the same process.)"""

    def __init__(self, reference_flat):
        self.calls: list[SpiedCall] = []
        self.traced: list[str] = []
        self.step = 0
        self.lock = threading.Lock()
        self.reference_flat = reference_flat

    def record(self, owner, method, kind, args):
        """Record one call; returns `args` with a consumed `zip` replaced by a list."""
        grads = None
        if kind in ("pairs", "pairs+result"):
            pairs = list(args[0])
            args = (pairs,) + tuple(args[1:])
            grads = [g for g, _ in pairs]
        elif kind == "list":
            grads = list(args[0])
        elif kind == "single":
            grads = [args[0]]
        self._append(f"{type(owner).__name__}.{method}", grads, ratio=kind != "single")
        return args

    def record_result(self, owner, method, pairs):
        self._append(f"{type(owner).__name__}.{method} -> result",
                     [g for g, _ in pairs], ratio=True)

    def _append(self, function, grads, ratio):
        context = current_context()
        replica = None
        if context == "replica":
            replica = int(tf.get_static_value(
                tf.distribute.get_replica_context().replica_id_in_sync_group))
        present = [tf.convert_to_tensor(g) for g in (grads or []) if g is not None]
        dtypes = tuple(sorted({g.dtype.name for g in present}))
        if function not in self.traced:
            self.traced.append(function)

        def on_execution(*values):
            scale_seen = None
            if ratio and values:
                seen = _flat([v.numpy() for v in values])
                ref = self.reference_flat
                scale_seen = (float(seen @ ref / (ref @ ref)) if np.all(np.isfinite(seen))
                              else float("nan"))
            with self.lock:
                self.calls.append(SpiedCall(self.step, function, context, replica, dtypes,
                                            scale_seen))
            return []

        if tf.executing_eagerly():
            on_execution(*present)
        else:
            tf.py_function(on_execution, present, Tout=[])

    @contextlib.contextmanager
    def installed(self):
        originals = []
        try:
            for module_name, class_name, method, kind in SPIED_METHODS:
                cls = getattr(importlib.import_module(module_name), class_name)
                original = cls.__dict__[method]
                originals.append((cls, method, original))

                def spy(owner, *args, _original=original, _method=method, _kind=kind,
                        **kwargs):
                    args = self.record(owner, _method, _kind, args)
                    result = _original(owner, *args, **kwargs)
                    if _kind == "pairs+result":
                        self.record_result(owner, _method, result)
                    return result

                setattr(cls, method, spy)
            yield self
        finally:
            for cls, method, original in reversed(originals):
                setattr(cls, method, original)


def _local_reference_gradient(x_shard, y_shard, replicas):
    """float32 gradient of (mean squared error over one replica's shard) / replicas at
    the initial weights: what one replica contributes before the all-reduce."""
    model = tiny_model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x_shard) - y_shard)) / replicas
    return _flat([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])


def _compile_patched(strategy, target, accumulation_steps, learning_rate, run_eagerly,
                     wrapper=None, initial_scale=DEFAULT_INITIAL_SCALE):
    wrapper = wrapper or keras.mixed_precision.LossScaleOptimizer
    with strategy.scope():
        model = tiny_model()
        model.build((None, 4))
        optimizer = wrapper(keras.optimizers.SGD(learning_rate), initial_scale=initial_scale)
        patch = None
        if target != "none":
            patch = patch_optimizer(optimizer, accumulation_steps, model.trainable_variables,
                                    target)
        model.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
    return model, optimizer, patch


def spy_patched_fit(strategy, target: str, accumulation_steps: int = 2,
                    micro_batch_per_replica: int = 4) -> SpyRecord:
    """Run `accumulation_steps` micro-batches of `model.fit` under `mixed_float16` with
    the question's patch on `target`, and record every executed spied call.

    To make "which gradient does this method receive" a single number, every replica
    and every micro-batch gets the *same* examples, and the learning rate is 0 (the
    weights never change). `scale_seen` is then the least-squares ratio of the passed
    gradient to one replica's float32 unscaled contribution `g`: about `loss_scale` for
    scaled partial gradients, 1 for unscaled ones, `k * loss_scale` for k accumulated
    scaled ones, `replicas` after the SUM all-reduce, 0 for the zeroed "don't apply"
    calls. The data are small enough that no micro-batch overflows.
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}.")
    replicas = strategy.num_replicas_in_sync
    x, y = regression_data(micro_batch_per_replica)
    reference = _local_reference_gradient(x, y, replicas)
    xs = np.tile(x, (replicas * accumulation_steps, 1))
    ys = np.tile(y, (replicas * accumulation_steps, 1))
    spy = _Spy(reference)

    class StepCounter(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            spy.step = batch + 1

    with mixed_precision_policy("mixed_float16"), spy.installed():
        model, optimizer, _ = _compile_patched(strategy, target, accumulation_steps, 0.0,
                                               run_eagerly=False)
        model.fit(xs, ys, batch_size=replicas * micro_batch_per_replica, epochs=1,
                  shuffle=False, verbose=0, callbacks=[StepCounter()])
    scale = float(optimizer.dynamic_scale.numpy())
    if scale != DEFAULT_INITIAL_SCALE:
        raise AssertionError(f"a spied micro-batch overflowed (loss scale now {scale}); "
                             "the ratios assume none does.")
    return SpyRecord(target, replicas, scale, tuple(spy.calls), tuple(spy.traced))


# ---------------------------------------------------------------------------------
# The outcome: graph-mode model.fit, step by step.


@dataclasses.dataclass(frozen=True)
class PatchedFitRecord:
    """What `model.fit` did to the weights, micro-batch by micro-batch.

    `loss_scales[t]`, `iterations[t]` and `weight_changes[t]` (max |Δw| over all
    weights) are read after micro-batch t+1. `patch_calls` is how often the patched
    `apply_gradients` ran (None without a patch), `accumulators_finite` whether every
    replica's accumulator copy is finite at the end (None without a patch).
    """

    target: str
    replicas: int
    accumulation_steps: int
    overflow_step: int | None
    patch_calls: int | None
    loss_scales: tuple[float, ...]
    iterations: tuple[int, ...]
    weight_changes: tuple[float, ...]
    accumulators_finite: bool | None
    weights_finite: bool
    initial_weights: list
    final_weights: list


def overflow_data(micro_batches: int, global_batch: int, overflow_step: int | None = None,
                  replicas: int = 1, overflow_replicas=None, seed: int = 0):
    """`(x, y)` for `micro_batches` micro-batches of `global_batch` examples.

    With `overflow_step` (1-based), one example in the shard of each replica in
    `overflow_replicas` (default: all) of that micro-batch gets the target
    `OUTLIER_TARGET`, so its scaled gradient overflows float16. Model.fit's
    distributed dataset gives replica r the r-th contiguous slice of each global batch.
    """
    if global_batch % replicas:
        raise ValueError(f"global_batch {global_batch} is not divisible by {replicas} replicas.")
    if overflow_step is not None and not 1 <= overflow_step <= micro_batches:
        raise ValueError(f"overflow_step must be in 1..{micro_batches}, got {overflow_step}.")
    x, y = regression_data(micro_batches * global_batch, seed=seed)
    if overflow_step is not None:
        shard = global_batch // replicas
        chosen = range(replicas) if overflow_replicas is None else overflow_replicas
        for r in chosen:
            if not 0 <= r < replicas:
                raise ValueError(f"replica {r} out of range for {replicas} replicas.")
            y[(overflow_step - 1) * global_batch + r * shard] = OUTLIER_TARGET
    return x, y


class _Trajectory(keras.callbacks.Callback):
    def __init__(self, optimizer):
        super().__init__()
        self.optimizer_ = optimizer
        self.scales, self.iterations, self.changes = [], [], []
        self.previous = None

    def on_train_begin(self, logs=None):
        self.previous = weights_of(self.model)

    def on_train_batch_end(self, batch, logs=None):
        now = weights_of(self.model)
        with np.errstate(invalid="ignore"):  # inf - inf once weights are non-finite
            self.changes.append(max(float(np.max(np.abs(a.astype(np.float64) - b)))
                                    for a, b in zip(now, self.previous)))
        self.previous = now
        self.scales.append(float(self.optimizer_.dynamic_scale.numpy()))
        self.iterations.append(int(self.optimizer_.iterations.numpy()))


def reproduce(strategy, target: str = "loss_scale_optimizer", micro_batches: int = 6,
              accumulation_steps: int = 2, overflow_step: int | None = 1,
              micro_batch_per_replica: int = 4, learning_rate: float = 0.1,
              overflow_replicas=None, wrapper=None,
              initial_scale: float = CONTROLLED_INITIAL_SCALE) -> PatchedFitRecord:
    """Graph-mode `model.fit` under `mixed_float16` with the question's patch on `target`
    ("none": the stock wrapper, no patch, no accumulation); one micro-batch per step,
    shuffle off. `overflow_step` puts an overflowing example into the shard of every
    replica in `overflow_replicas` (default: all) of that micro-batch (None: no
    overflow). `wrapper` is the loss-scale optimizer class (default Keras' own),
    `initial_scale` its initial loss scale."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}.")
    replicas = strategy.num_replicas_in_sync
    global_batch = replicas * micro_batch_per_replica
    x, y = overflow_data(micro_batches, global_batch, overflow_step, replicas,
                         overflow_replicas)
    with mixed_precision_policy("mixed_float16"):
        model, optimizer, patch = _compile_patched(strategy, target, accumulation_steps,
                                                   learning_rate, run_eagerly=False,
                                                   wrapper=wrapper,
                                                   initial_scale=initial_scale)
        initial = weights_of(model)
        trajectory = _Trajectory(optimizer)
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[trajectory])
    final = weights_of(model)
    accumulators_finite = None
    if patch is not None:
        accumulators_finite = all(
            np.all(np.isfinite(np.asarray(copy)))
            for v in patch.accu_gradients for copy in strategy.experimental_local_results(v))
    return PatchedFitRecord(
        target=target, replicas=replicas, accumulation_steps=accumulation_steps,
        overflow_step=overflow_step,
        patch_calls=None if patch is None else int(patch.calls.numpy()),
        loss_scales=tuple(trajectory.scales), iterations=tuple(trajectory.iterations),
        weight_changes=tuple(trajectory.changes),
        accumulators_finite=accumulators_finite,
        weights_finite=all(np.all(np.isfinite(w)) for w in final),
        initial_weights=initial, final_weights=final,
    )


def accumulated_reference(strategy, micro_batches: int = 6, accumulation_steps: int = 2,
                          micro_batch_per_replica: int = 4, learning_rate: float = 0.1,
                          initial_scale: float = CONTROLLED_INITIAL_SCALE):
    """What the question's patch means to compute, under `mixed_float16`: the stock
    wrapper on batches `accumulation_steps` times larger with the learning rate times
    `accumulation_steps` (the patch *sums* micro-batch gradients, each of which is a
    mean). Returns the final weights. No overflow."""
    replicas = strategy.num_replicas_in_sync
    global_batch = replicas * micro_batch_per_replica
    x, y = overflow_data(micro_batches, global_batch, None, replicas)
    # The gradient sum over replicas does not depend on which replica holds which
    # example, so consecutive micro-batches simply become one big batch.
    with mixed_precision_policy("mixed_float16"):
        model, _, _ = _compile_patched(strategy, "none", accumulation_steps,
                                       learning_rate * accumulation_steps, run_eagerly=False,
                                       initial_scale=initial_scale)
        model.fit(x, y, batch_size=global_batch * accumulation_steps, epochs=1,
                  shuffle=False, verbose=0)
    return weights_of(model)


# ---------------------------------------------------------------------------------
# The original: tf-keras (Keras 2), the question's own train_step, in a subprocess.

GENERATIONS = ("legacy", "v3")

_LEGACY_SNIPPET = '''
import json
keras = tf.keras
config = json.loads({config!r})
x_all = np.array(config["x"], np.float32)
scenarios = config["scenarios"]
n = config["accumulation_steps"]
global_batch = config["global_batch"]
learning_rate = config["learning_rate"]
trace_notes = []


class _GradientAccumulationPatch:
    """The question's patch, verbatim but for the `calls` counter and trace notes."""

    def __init__(self, n, orig_apply_gradients, trainable_variables):
        self.n = tf.constant(n, dtype=tf.int64)
        policy = tf.keras.mixed_precision.global_policy()
        self.variable_dtype = policy.variable_dtype
        self.accu_gradients = [
            tf.Variable(tf.zeros(g.shape, dtype=g.dtype)) for g in trainable_variables]
        self._current_step = tf.Variable(0, dtype=tf.int64)
        self.calls = tf.Variable(0, dtype=tf.int64)
        self._orig_apply_gradients = orig_apply_gradients
        self.return_result = False

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        trace_notes.append(dict(
            context="cross-replica" if tf.distribute.in_cross_replica_context() else "replica",
            args=[repr(a) for a in args], kwargs=sorted(kwargs)))
        self.calls.assign_add(1)
        can_apply = self._can_apply_on_next_step()
        apply = tf.cast(can_apply, dtype=self.variable_dtype)
        keep = tf.cast(tf.logical_not(can_apply), dtype=self.variable_dtype)
        grads_and_vars = list(grads_and_vars)
        gradients = [grad for (grad, _) in grads_and_vars]
        trainable_variables = [var for (_, var) in grads_and_vars]
        for i, grad in enumerate(gradients):
            self.accu_gradients[i].assign_add(grad)
        final_gradients = [grad * apply for grad in self.accu_gradients]
        result = self._orig_apply_gradients(
            zip(final_gradients, trainable_variables), *args, **kwargs)
        for g in self.accu_gradients:
            g.assign(g * keep)
        if self.return_result:  # not in the question: it returns None
            return result

    def _can_apply_on_next_step(self):
        self._current_step.assign_add(1)
        count_mod_steps = tf.math.mod(self._current_step, self.n)
        return tf.equal(count_mod_steps, 0)


class SeedModel(keras.Model):
    """The question's train_step: get_scaled_loss / get_unscaled_gradients by hand."""

    def __init__(self):
        super().__init__()
        init = keras.initializers.GlorotUniform
        self.hidden = keras.layers.Dense(8, activation="tanh", kernel_initializer=init(seed=0))
        self.out = keras.layers.Dense(1, kernel_initializer=init(seed=1))
        self.to_float32 = keras.layers.Activation("linear", dtype="float32")

    def call(self, x):
        return self.to_float32(self.out(self.hidden(x)))

    def train_step(self, data):
        x, y_true = data
        with tf.GradientTape() as tape:
            model_loss = self.compiled_loss(y_true, self(x, training=True))
            is_mixed_precision = isinstance(
                self.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
            if is_mixed_precision:
                loss = self.optimizer.get_scaled_loss(model_loss)
            else:
                loss = model_loss
        gradients = tape.gradient(loss, self.trainable_variables)
        if is_mixed_precision:
            gradients = self.optimizer.get_unscaled_gradients(gradients)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {{"loss": model_loss}}


def weights(model):
    return [w.numpy() for w in model.weights]


class Trajectory(keras.callbacks.Callback):
    def __init__(self, optimizer):
        super().__init__()
        self.optimizer_ = optimizer
        self.scales, self.iterations, self.changes = [], [], []

    def on_train_begin(self, logs=None):
        self.previous = weights(self.model)

    def on_train_batch_end(self, batch, logs=None):
        now = weights(self.model)
        self.changes.append(max(float(np.max(np.abs(a - b))) for a, b in zip(now, self.previous)))
        self.previous = now
        self.scales.append(float(self.optimizer_.loss_scale.numpy()))
        self.iterations.append(int(self.optimizer_.iterations.numpy()))


keras.mixed_precision.set_global_policy("mixed_float16")
results = []
for scenario in scenarios:
    del trace_notes[:]
    y_all = np.array(scenario["y"], np.float32)
    with strategy.scope():
        model = SeedModel()
        model.build((None, x_all.shape[1]))
        if scenario["generation"] == "legacy":
            inner = keras.optimizers.legacy.SGD(scenario["learning_rate"])
        else:
            inner = keras.optimizers.SGD(scenario["learning_rate"])
        optimizer = keras.mixed_precision.LossScaleOptimizer(
            inner, initial_scale=config["initial_scale"])
        patch = None
        if scenario["target"] == "loss_scale_optimizer":
            patch = _GradientAccumulationPatch(n, optimizer.apply_gradients,
                                               model.trainable_variables)
            optimizer.apply_gradients = patch.apply_gradients
        elif scenario["target"] == "inner_optimizer":
            patch = _GradientAccumulationPatch(n, optimizer.inner_optimizer.apply_gradients,
                                               model.trainable_variables)
            optimizer.inner_optimizer.apply_gradients = patch.apply_gradients
        if patch is not None:
            patch.return_result = scenario["patch_returns_result"]
        model.compile(optimizer=optimizer, loss="mse")
    initial = weights(model)
    trajectory = Trajectory(optimizer)
    error = None
    try:
        model.fit(x_all[:len(y_all)], y_all, batch_size=scenario["batch_size"], epochs=1,
                  shuffle=False, verbose=0, callbacks=[trajectory])
    except Exception as exc:  # the pitfall may be an exception: report it
        error = dict(type=type(exc).__name__, message=str(exc))
    final = weights(model)
    results.append(dict(
        name=scenario["name"], error=error,
        lso_class=type(optimizer).__name__,
        inner_class=type(optimizer.inner_optimizer).__module__ + "." +
                    type(optimizer.inner_optimizer).__name__,
        patch_calls=None if patch is None else int(patch.calls.numpy()),
        accumulators_finite=None if patch is None else bool(all(
            np.all(np.isfinite(c.numpy())) for v in patch.accu_gradients
            for c in strategy.experimental_local_results(v))),
        loss_scales=trajectory.scales, iterations=trajectory.iterations,
        weight_changes=trajectory.changes,
        weights_finite=bool(all(np.all(np.isfinite(w)) for w in final)),
        initial_weights=initial, final_weights=final,
        patch_traces=list(trace_notes),
    ))
keras.mixed_precision.set_global_policy("float32")
report(results=results)
'''


@dataclasses.dataclass(frozen=True)
class LegacyScenario:
    """One tf-keras `model.fit` to run: optimizer generation ("legacy" = the question's
    era `OptimizerV2`, wrapped by `LossScaleOptimizer`; "v3" = tf-keras' newer
    optimizer, wrapped by `LossScaleOptimizerV3`), patch target, and overflow."""

    name: str
    generation: str = "legacy"
    target: str = "loss_scale_optimizer"
    overflow_step: int | None = None
    overflow_replicas: tuple[int, ...] | None = None
    accumulate_in_batch: bool = False  # True: one step on batches k times larger, lr * k
    patch_returns_result: bool = False  # True: the patch returns what the original returned


@dataclasses.dataclass(frozen=True)
class LegacyRecord:
    """What one scenario did under tf-keras (fields as in `PatchedFitRecord`); `error`
    is the exception `model.fit` raised, if any; `patch_traces` what the patched
    `apply_gradients` received while being traced (context, extra args, kwarg names)."""

    name: str
    error: CapturedError | None
    lso_class: str
    inner_class: str
    patch_calls: int | None
    loss_scales: tuple[float, ...]
    iterations: tuple[int, ...]
    weight_changes: tuple[float, ...]
    accumulators_finite: bool | None
    weights_finite: bool
    initial_weights: list
    final_weights: list
    patch_traces: tuple[dict, ...]


@dataclasses.dataclass(frozen=True)
class LegacyReproduction:
    tensorflow: str
    tf_keras: str
    replicas: int
    seconds: float
    records: dict[str, LegacyRecord]

    def __getitem__(self, name: str) -> LegacyRecord:
        return self.records[name]


DEFAULT_LEGACY_SCENARIOS = (
    LegacyScenario("stock, overflow at 3", target="none", overflow_step=3),
    LegacyScenario("patch on LSO", target="loss_scale_optimizer"),
    LegacyScenario("patch on LSO, overflow at 3", target="loss_scale_optimizer", overflow_step=3),
    LegacyScenario("patch on inner", target="inner_optimizer"),
    LegacyScenario("patch on inner, overflow at 3", target="inner_optimizer", overflow_step=3),
    LegacyScenario("patch on inner, returning the result", target="inner_optimizer",
                   overflow_step=3, patch_returns_result=True),
    LegacyScenario("big batch", target="none", accumulate_in_batch=True),
    LegacyScenario("v3: patch on LSO, overflow at 3", generation="v3",
                   target="loss_scale_optimizer", overflow_step=3),
    LegacyScenario("v3: patch on inner", generation="v3", target="inner_optimizer"),
    LegacyScenario("v3: patch on inner, overflow at 3", generation="v3",
                   target="inner_optimizer", overflow_step=3),
    LegacyScenario("stock, overflow on replica 1 only", target="none", overflow_step=3,
                   overflow_replicas=(1,)),
)


def _nan_aware(values):
    return [np.asarray(v, dtype=np.float64) if not isinstance(v, str) else float(v)
            for v in values]


def legacy_reproduction(scenarios=DEFAULT_LEGACY_SCENARIOS, replicas: int = 2,
                        micro_batches: int = 6, accumulation_steps: int = 2,
                        micro_batch_per_replica: int = 4, learning_rate: float = 0.1,
                        initial_scale: float = CONTROLLED_INITIAL_SCALE,
                        timeout: float = 300) -> LegacyReproduction:
    """Run the question's train_step and patches under tf-keras 2.x, in one subprocess
    (see `distgrad.legacy.run_legacy`), on the same data layout as `reproduce`."""
    from distgrad.legacy import run_legacy

    global_batch = replicas * micro_batch_per_replica
    x, _ = overflow_data(micro_batches, global_batch, None, replicas)
    payload = []
    for s in scenarios:
        if s.generation not in GENERATIONS:
            raise ValueError(f"generation must be one of {GENERATIONS}, got {s.generation!r}.")
        if s.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {s.target!r}.")
        _, y = overflow_data(micro_batches, global_batch, s.overflow_step, replicas,
                             s.overflow_replicas)
        big = s.accumulate_in_batch
        payload.append({
            "name": s.name, "generation": s.generation, "target": s.target, "y": y.tolist(),
            "patch_returns_result": s.patch_returns_result,
            "batch_size": global_batch * (accumulation_steps if big else 1),
            "learning_rate": learning_rate * (accumulation_steps if big else 1)})
    import json

    config = json.dumps({"x": x.tolist(), "scenarios": payload, "global_batch": global_batch,
                             "accumulation_steps": accumulation_steps,
                             "learning_rate": learning_rate, "initial_scale": initial_scale})
    result = run_legacy(_LEGACY_SNIPPET.format(config=config), replicas=replicas,
                        timeout=timeout)
    records = {}
    for r in result["results"]:
        records[r["name"]] = LegacyRecord(
            name=r["name"], error=None if r["error"] is None else CapturedError(**r["error"]),
            lso_class=r["lso_class"], inner_class=r["inner_class"],
            patch_calls=r["patch_calls"], loss_scales=tuple(r["loss_scales"]),
            iterations=tuple(r["iterations"]),
            weight_changes=tuple(float(c) for c in r["weight_changes"]),
            accumulators_finite=r["accumulators_finite"], weights_finite=r["weights_finite"],
            initial_weights=_nan_aware(r["initial_weights"]),
            final_weights=_nan_aware(r["final_weights"]),
            patch_traces=tuple(r["patch_traces"]))
    return LegacyReproduction(result.tensorflow, result.tf_keras, result.replicas,
                              result.seconds, records)


# ---------------------------------------------------------------------------------
# The fix: distgrad.AccumulatingOptimizer inside the wrapper, LSO(Accumulating(inner)).


@dataclasses.dataclass(frozen=True)
class MixedFitRecord:
    """A mixed_float16 `model.fit`, micro-batch by micro-batch.

    `wrapper` / `wrapped` are the class names of `model.optimizer` and of what it
    wraps; `loss_scales[t]`, `iterations[t]` (updates), `micro_steps[t]` and
    `weights_finite[t]` are read after micro-batch t+1; `accumulator_dtypes` is None
    without accumulation.
    """

    replicas: int
    wrapper: str
    wrapped: str
    loss_scales: tuple[float, ...]
    iterations: tuple[int, ...]
    micro_steps: tuple[int, ...]
    weights_finite: tuple[bool, ...]
    accumulator_dtypes: tuple[str, ...] | None
    initial_weights: list
    final_weights: list


class _MixedTrajectory(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.scales, self.iterations, self.micro_steps, self.finite = [], [], [], []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.scales.append(float(optimizer.dynamic_scale.numpy()))
        self.iterations.append(int(optimizer.iterations.numpy()))
        inner = optimizer.inner_optimizer
        self.micro_steps.append(int(inner.micro_steps.numpy()) if hasattr(inner, "micro_steps")
                                else int(optimizer.iterations.numpy()))
        self.finite.append(all(np.all(np.isfinite(w)) for w in weights_of(self.model)))


def mixed_precision_fit(strategy, x, y, batch_size: int, accumulation_steps: int | None = 2,
                        optimizer_factory=None, wrapper=None,
                        initial_scale: float | None = CONTROLLED_INITIAL_SCALE,
                        dynamic_growth_steps: int = 2000) -> MixedFitRecord:
    """`model.fit(x, y, batch_size)` under `mixed_float16` (shuffle off, one epoch).

    The optimizer is `optimizer_factory()` (default `SGD(0.1)`), wrapped in
    `distgrad.AccumulatingOptimizer(..., accumulation_steps)` unless
    `accumulation_steps` is None. With `initial_scale=None` it is handed to
    `model.compile` as is, so Keras adds its own `LossScaleOptimizer` (default scale
    2**15); otherwise it is wrapped here in `wrapper` (default Keras'
    `LossScaleOptimizer`) with `initial_scale` and `dynamic_growth_steps`.
    """
    from distgrad.optimizer import AccumulatingOptimizer

    optimizer_factory = optimizer_factory or (lambda: keras.optimizers.SGD(0.1))
    with mixed_precision_policy("mixed_float16"):
        with strategy.scope():
            model = tiny_model()
            optimizer = optimizer_factory()
            if accumulation_steps is not None:
                optimizer = AccumulatingOptimizer(optimizer, accumulation_steps)
            if initial_scale is not None:
                wrapper_class = wrapper or keras.mixed_precision.LossScaleOptimizer
                optimizer = wrapper_class(optimizer, initial_scale=initial_scale,
                                          dynamic_growth_steps=dynamic_growth_steps)
            model.compile(optimizer=optimizer, loss="mse")
        initial = weights_of(model)
        trajectory = _MixedTrajectory()
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
                  callbacks=[trajectory])
    wrapped = model.optimizer.inner_optimizer
    dtypes = None
    if accumulation_steps is not None:
        dtypes = tuple(a.dtype for a in wrapped.accumulators)
    return MixedFitRecord(
        replicas=strategy.num_replicas_in_sync, wrapper=type(model.optimizer).__name__,
        wrapped=type(wrapped).__name__, loss_scales=tuple(trajectory.scales),
        iterations=tuple(trajectory.iterations), micro_steps=tuple(trajectory.micro_steps),
        weights_finite=tuple(trajectory.finite), accumulator_dtypes=dtypes,
        initial_weights=initial, final_weights=weights_of(model))
