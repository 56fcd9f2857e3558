"""`GradientAccumulator`: accumulate k micro-batches per replica, sync once per update.

It imports only TensorFlow, Keras and the standard library: copy this one file. The
non-finite policy at its end is generated from `non_finite.py`.
Design notes: docs/design.md, "GradientAccumulator".
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf
from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext  # XLA or not

# The public names (the API page documents them); the other functions serve them.
__all__ = ["GradientAccumulator"]

# The oldest versions the version matrix passes (docs/versions.md): Keras 3 from 3.10 (< 3.5
# does not sum gradients over replicas in apply_gradients, keras-team/keras#19969), and the
# Keras 2 stack of TensorFlow 2.15 (its own Keras 2.15 is tf.keras; it has no Keras 3).
NEEDED = {"tensorflow": (2, 16), "keras": (3, 10)}
KERAS_2 = {"tensorflow": (2, 15), "keras": (2, 15)}
_FOUND = {m.__name__: tuple(map(int, m.__version__.split(".")[:2])) for m in (tf, keras)}
if _FOUND != KERAS_2 and any(_FOUND[name] < NEEDED[name] for name in NEEDED):
    raise ImportError(f"distgrad.accumulator needs TensorFlow >= 2.16 and Keras >= 3.10 (or "
                      f"TensorFlow 2.15 with its Keras 2.15), found TensorFlow {tf.__version__} "
                      f"and Keras {keras.__version__}: pip install -U 'tensorflow>=2.16' "
                      "'keras>=3.10'")
# Keras 3's classes; under Keras 2 (TensorFlow 2.15) nothing is one (isinstance(x, ()) is False).
_KERAS_3_VARIABLE = getattr(keras, "Variable", ())
_KERAS_3_LOSS_SCALE_OPTIMIZER = getattr(keras.optimizers, "LossScaleOptimizer", ())


class _Untracked:
    """Holds the model's variables without making them checkpoint dependencies."""

    def __init__(self, values):
        self.values = list(values)


def _distributed_strategy_of(variable):
    """The strategy that owns `variable` (a Keras or tf variable), or None."""
    inner = variable.value if isinstance(variable, _KERAS_3_VARIABLE) else variable
    if isinstance(inner, tf.distribute.DistributedValues):
        return inner.distribute_strategy
    return None


def _accumulator_dtype(dtype: tf.DType) -> tf.DType:
    if not dtype.is_floating:
        raise TypeError(f"Accumulate gradients of floating-point variables only: cannot "
                        f"accumulate gradients of a {dtype.name} variable.")
    return tf.float64 if dtype == tf.float64 else tf.float32


def _is_loss_scale_optimizer(optimizer) -> bool:
    """Keras 3's LossScaleOptimizer, or tf-keras' (`tf.keras` in a tf-keras process)."""
    return isinstance(optimizer, (_KERAS_3_LOSS_SCALE_OPTIMIZER,
                                  tf.keras.mixed_precision.LossScaleOptimizer))


class GradientAccumulator(tf.Module):
    """Replica-local gradient buffers for a list of variables, and a micro-step counter.

    Your loop decides when to apply: per micro-batch, inside `strategy.run`, call
    `add(tape.gradient(loss, variables))`; once per update call the function
    `make_apply_step(optimizer)` returns. Divide each micro-batch loss by the global batch
    of the whole update (`micro_batch_per_replica * replicas * k`): the k * R summed
    gradients are then the big batch's mean gradient.

    Args:
        variables: the variables to accumulate gradients for (usually
            `model.trainable_variables`), created under the strategy in scope.
        name: module name.
        non_finite: what an apply does when the sums are NaN/Inf on any replica. "raise"
            (default): `tf.errors.InvalidArgumentError` before anything changes (the
            buffers keep their sums). "skip": no update, buffers zeroed, counted in
            `skipped_updates`, and `make_apply_step` warns. Under a `LossScaleOptimizer`
            the update is skipped on every replica, its scale halved and the skip counted;
            an optimizer with its own `non_finite` (`AccumulatingOptimizer`) decides alone.

    State (saved by `tf.train.Checkpoint(accumulator=...)`):
        accumulated: one replica-local (ON_READ, SUM) float32 buffer per variable (float64
            for float64 variables); a checkpoint holds their sum over replicas.
        micro_step_counter: micro-batches added since the last apply or reset
            (`micro_steps` reads it eagerly).
        skipped_updates: updates skipped as non-finite.

    Example:

    ```python
    with strategy.scope():
        model, optimizer = make_model(), keras.optimizers.Adam()
        accumulator = GradientAccumulator(model.trainable_variables)
    apply_step = accumulator.make_apply_step(optimizer)

    @tf.function
    def accumulate(x, y):
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(y, model(x)),
                                                  global_batch_size=GLOBAL_BATCH * k)
            accumulator.add(tape.gradient(loss, model.trainable_variables))
        strategy.run(step, args=(x, y))

    for i, (x, y) in enumerate(dataset):
        accumulate(x, y)
        if (i + 1) % k == 0:
            apply_step()
    ```

    Raises:
        ValueError: no variables, or variables of another strategy than the one in scope;
            a wrong number or shape of gradients; a bad `non_finite`; (first apply) "raise"
            under XLA, "skip" on 2+ replicas without merge_call.
        TypeError: a non-floating variable.
        RuntimeError: `add` / `apply_gradients` outside `strategy.run`.
        tf.errors.InvalidArgumentError: (run time) non-finite sums under "raise".
    """

    def __init__(self, variables, name: str = "gradient_accumulator",
                 non_finite: str = "raise"):
        if not isinstance(name, str):
            raise TypeError(
                "Call `add(grads)` every micro-batch and the apply step every k-th (see "
                f"make_apply_step): GradientAccumulator(variables, name=...) takes no "
                f"accumulation count (got {name!r} as `name`), your loop decides when to apply.")
        super().__init__(name=name)
        variables = list(variables)
        if not variables:
            raise ValueError("Pass at least one variable (e.g. model.trainable_variables) to "
                             "GradientAccumulator.")
        check_policy(non_finite)
        self.non_finite = non_finite
        strategy = tf.distribute.get_strategy()
        in_scope = tf.distribute.has_strategy()
        for variable in variables:
            owner = _distributed_strategy_of(variable)
            if owner is not None and not in_scope:
                raise ValueError(
                    "Create the GradientAccumulator under `with strategy.scope():` (the scope "
                    f"the model was built in): variable {variable.name!r} is distributed by a "
                    f"{type(owner).__name__}, and this accumulator is created outside its scope.")
            if owner is not None and owner is not strategy:
                raise ValueError(
                    "Create the GradientAccumulator under the scope of the strategy that built "
                    f"the model: variable {variable.name!r} belongs to another strategy than "
                    "the one in scope.")
            if owner is None and in_scope:
                raise ValueError(
                    "Build the model (and the optimizer) under the same scope as the "
                    f"GradientAccumulator: variable {variable.name!r} is not distributed, but a "
                    f"{type(strategy).__name__} scope is active (the model was built outside "
                    "`strategy.scope()`).")
        self._model_variables = _Untracked(variables)
        self._strategy = strategy
        with strategy.scope():
            self.accumulated = [
                tf.Variable(
                    tf.zeros(v.shape, _accumulator_dtype(tf.as_dtype(v.dtype))),
                    trainable=False, name=f"accumulated_{i}",
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.SUM)
                for i, v in enumerate(variables)
            ]
            self.micro_step_counter = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="micro_steps",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.skipped_updates = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="skipped_updates",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # Which positions ever received a gradient (a trace-time fact); before any traced
        # `add` (e.g. a restored checkpoint applied first) every position counts.
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
                f"Call GradientAccumulator.{what} inside `strategy.run(...)`: it must run in "
                "replica context, where each replica has its own gradients.")

    def add(self, grads) -> None:
        """Replica context: add one micro-batch's gradients (one per variable, `None`
        skipped, `IndexedSlices` densified) to this replica's buffers. No communication."""
        self._require_replica_context("add")
        grads = list(grads)
        if len(grads) != len(self.accumulated):
            raise ValueError(
                "Pass one gradient (or None) per variable, in the order the accumulator was "
                "created with (e.g. tape.gradient(loss, model.trainable_variables)): add() "
                f"got {len(grads)} gradients for {len(self.accumulated)} variables.")
        self._traced_add = True
        for i, (buffer, grad) in enumerate(zip(self.accumulated, grads)):
            if grad is None:
                continue
            self._received[i] = True
            if isinstance(grad, tf.IndexedSlices):  # ON_READ variables have no scatter_add
                dense = tf.math.unsorted_segment_sum(
                    tf.cast(grad.values, buffer.dtype), grad.indices,
                    num_segments=buffer.shape[0])
            else:
                dense = tf.cast(grad, buffer.dtype)
            if not dense.shape.is_compatible_with(buffer.shape):
                raise ValueError(f"Pass gradients shaped as their variables: gradient {i} has "
                                 f"shape {dense.shape}, its variable {buffer.shape}.")
            buffer.assign_add(dense)
        self.micro_step_counter.assign_add(1)

    def gradients(self) -> list:
        """The sums in each variable's dtype: this replica's in replica context, their SUM
        in cross-replica context; `None` where every traced `add` had `None`."""
        out = []
        for i, (buffer, variable) in enumerate(zip(self.accumulated, self.model_variables)):
            if self._traced_add and not self._received[i]:
                out.append(None)
            else:  # read_value(): a device for the one-replica all-reduce (docs/design.md)
                out.append(tf.cast(buffer.read_value(), variable.dtype))
        return out

    def reset(self) -> None:
        """Zero every buffer and the counter (replica or cross-replica context)."""
        for buffer in self.accumulated:
            buffer.assign(tf.zeros_like(buffer))
        self.micro_step_counter.assign(0)

    def apply_gradients(self, optimizer) -> None:
        """Replica context: apply this replica's sums with `optimizer`, then reset. The
        optimizer's SUM all-reduce is the update's one sync (and, for "raise" on 2+
        replicas without merge_call, one of the finiteness flags)."""
        self._require_replica_context("apply_gradients")
        check = tf.debugging.assert_positive(
            self.micro_step_counter,
            message="GradientAccumulator: apply with zero accumulated micro-steps")

        def apply_and_reset(grads):
            optimizer.apply_gradients(zip(grads, self.model_variables))
            self.reset()

        def skip():
            self.reset()
            self.skipped_updates.assign_add(1)

        with tf.control_dependencies([check]):  # gates every op below, not only the Assert
            grads = self.gradients()
            if clips_each_replica(optimizer):  # one more all-reduce:
                grads = summed_on_replica_0(grads)  # the sum is clipped
            if _is_loss_scale_optimizer(optimizer):
                policy, on_skip = (LOSS_SCALE,
                                   lambda: self.skipped_updates.assign_add(1))
            elif getattr(optimizer, "non_finite", None) is not None:
                apply_and_reset(grads)  # its own policy (AccumulatingOptimizer)
                return
            else:
                policy, on_skip = self.non_finite, skip
            apply_unless_non_finite(apply_and_reset, grads, policy, lambda: [
                "GradientAccumulator: NaN/Inf accumulated gradients on some replica at update",
                optimizer.iterations + 1,
                "(optimizer.iterations + 1); nothing applied, the buffers keep their sums."],
                on_skip)

    def make_apply_step(self, optimizer):
        """`apply_step()`, which applies once per call (`apply_step.function` is its
        `tf.function`), after building `optimizer` under the strategy scope. ValueError:
        nothing accumulated, or an optimizer created outside the strategy scope; a call
        that skipped a non-finite update warns (`UserWarning`)."""
        owner = getattr(optimizer, "_distribution_strategy", self._strategy)
        if owner is not self._strategy:
            raise ValueError(
                "Create the optimizer under `with strategy.scope():`: the optimizer was "
                "created outside the strategy scope of the GradientAccumulator.")
        if not getattr(optimizer, "built", getattr(optimizer, "_built", False)):  # tf-keras: _built
            with self._strategy.scope():
                if hasattr(optimizer, "build"):
                    optimizer.build(self.model_variables)
                else:  # tf-keras' OptimizerV2 (tf.keras.optimizers.legacy): slots, hypers
                    optimizer._create_all_weights(self.model_variables)
        strategy = self._strategy

        @tf.function
        def apply_function():
            strategy.run(self.apply_gradients, args=(optimizer,))

        def apply_step():
            if tf.executing_eagerly() and self.micro_steps == 0:
                raise ValueError(
                    "Call accumulator.add(...) inside strategy.run at least once since the "
                    "last apply/reset: apply with zero accumulated micro-steps.")
            skipped = int(self.skipped_updates.numpy())
            apply_function()
            if int(self.skipped_updates.numpy()) > skipped:
                halved = (" (the LossScaleOptimizer halved its scale)"
                          if _is_loss_scale_optimizer(optimizer) else "")
                warnings.warn(f"GradientAccumulator: update skipped, its gradients were NaN/Inf "
                              f"on some replica{halved} ({skipped + 1} skipped so far, "
                              "`accumulator.skipped_updates`).", stacklevel=2)

        apply_step.function = apply_function
        return apply_step


# ---- generated from non_finite.py: LOSS_SCALE, apply_unless_non_finite, check_policy,
#   clips_each_replica, summed_on_replica_0
# Copied here so that this file copies alone: edit non_finite.py, then run `make copies`.

NON_FINITE_POLICIES = ("raise", "skip")
# Not a user's choice: under a LossScaleOptimizer, it skips and halves its scale.
LOSS_SCALE = "loss_scale"
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


def clips_each_replica(optimizer) -> bool:
    """True for a Keras 3 optimizer (or one in a LossScaleOptimizer) that clips: Keras clips
    each replica's part before the SUM all-reduce. AccumulatingOptimizer clips the sum."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "non_finite", None) is not None:  # also inside a LossScaleOptimizer
        return False
    return (isinstance(inner, keras.optimizers.Optimizer)
            and any(getattr(inner, option, None) for option in CLIP_OPTIONS))


def summed_on_replica_0(grads):
    """Replica context: the SUM over replicas of `grads` on replica 0, zeros elsewhere."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return grads
    present = [i for i, g in enumerate(grads) if g is not None]
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                [tf.convert_to_tensor(grads[i]) for i in present])
    first = tf.equal(context.replica_id_in_sync_group, 0)
    grads = list(grads)
    for i, total in zip(present, summed):
        grads[i] = tf.where(first, total, tf.zeros_like(total))
    return grads


def poisoned(grads, finite):
    """`grads` with the first gradient all NaN unless `finite` (a scalar bool)."""
    grads = list(grads)
    i = next(i for i, g in enumerate(grads) if g is not None)
    values = grads[i].values if isinstance(grads[i], tf.IndexedSlices) else grads[i]
    values = tf.where(finite, values, tf.constant(float("nan"), values.dtype))
    grads[i] = (tf.IndexedSlices(values, grads[i].indices, grads[i].dense_shape)
                if isinstance(grads[i], tf.IndexedSlices) else values)
    return grads


def _no_output(fn, *args, **kwargs) -> None:  # a tf.cond branch: both return nothing
    fn(*args, **kwargs)


def apply_unless_non_finite(apply_fn, grads, non_finite: str, describe, on_skip) -> None:
    """Replica context: `apply_fn(grads)` unless some replica's `grads` hold NaN/Inf.

    Args:
        apply_fn: applies the gradients it is given (calls the optimizer).
        grads: this replica's gradients (None skipped).
        non_finite: "raise": `tf.errors.InvalidArgumentError` ("assertion failed: " and
            what `describe()` returns) before anything changes. "skip": `on_skip()` runs
            instead, once. `LOSS_SCALE` (`apply_fn` calls a LossScaleOptimizer):
            `on_skip()` runs, and `apply_fn` gets the first gradient NaN on every replica,
            so the optimizer skips and halves its scale.
        describe: a callable returning the assertion's strings and tensors.
        on_skip: a callable run when the update is skipped.

    Raises:
        ValueError: (trace time) a bad policy; "raise" under XLA; "skip" or `LOSS_SCALE` on
            2+ replicas without merge_call (XLA on GPUs).
    """
    if non_finite != LOSS_SCALE:
        check_policy(non_finite)
    finite = all_finite(grads)
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync
    no_merge_call = tf.__internal__.distribute.strategy_supports_no_merge_call()
    if non_finite == LOSS_SCALE:
        if replicas > 1 and no_merge_call:
            raise ValueError(
                "Compile with jit_compile=False: a LossScaleOptimizer cannot update on several "
                "replicas without merge_call (XLA on GPUs), where TensorFlow cannot update "
                "the inner optimizer's `iterations` inside its tf.cond.")
        if no_merge_call:  # one replica (no strategy, or XLA): its flag is all there is
            tf.cond(finite, lambda: None, lambda: _no_output(on_skip))
        else:
            def every_replica(distribution, flag):
                everywhere = finite_everywhere(distribution, flag)
                tf.cond(everywhere, lambda: None, lambda: _no_output(on_skip))
                return everywhere

            finite = context.merge_call(every_replica, args=(finite,))
        apply_fn(poisoned(grads, finite))
        return
    if non_finite == "raise":
        check_can_raise()
        if replicas > 1 and no_merge_call:
            finite = finite_on_all_replicas(finite)
        elif replicas > 1:
            finite = context.merge_call(finite_everywhere, args=(finite,))

        def fail():  # reads variables: ordered per replica (docs/design.md)
            with tf.control_dependencies([tf.debugging.Assert(False, describe())]):
                return tf.constant(False)

        checked = tf.cond(finite, lambda: tf.constant(True), fail)
        with tf.control_dependencies([checked]):  # gates every op apply_fn creates
            apply_fn(grads)
        return
    if no_merge_call:
        if replicas > 1:
            raise ValueError(
                "Wrap the optimizer in distgrad's AccumulatingOptimizer(optimizer, "
                "accumulation_steps=1, non_finite='skip'), or compile with jit_compile=False: "
                "without merge_call (XLA on GPUs), TensorFlow cannot update a Keras "
                "optimizer's `iterations` inside the tf.cond that skips.")
        tf.cond(finite, lambda: _no_output(apply_fn, grads), lambda: _no_output(on_skip))
        return

    def cross_replica(distribution, finite, grads):  # as LossScaleOptimizer._tf_apply
        tf.cond(finite_everywhere(distribution, finite),
                lambda: _no_output(distribution.extended.call_for_each_replica, apply_fn,
                                   args=(grads,)),
                lambda: _no_output(on_skip))

    context.merge_call(cross_replica, args=(finite, grads))


# ---- end of the code generated from non_finite.py
