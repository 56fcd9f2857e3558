"""`GradientAccumulator`: accumulate k micro-batches per replica, sync once per update.

The shape is OpenNMT-tf's trainer: one `tf.function` *accumulates* (forward,
backward, add the gradients to replica-local buffers, no communication), another
*applies* (one `optimizer.apply_gradients` inside `strategy.run`, whose SUM
all-reduce is the only sync of the update), and plain Python decides when to call
the second. Nothing traced branches on the micro-step, so no synchronization point
ever sits inside traced control flow.

This file imports only TensorFlow and Keras: copy it into a project and use it alone.

Loss scaling: the optimizer SUMs over replicas and the accumulator sums over
micro-steps, so divide each micro-batch loss by the global batch of the whole
*update*: `tf.nn.compute_average_loss(per_example_loss,
global_batch_size=micro_batch_per_replica * replicas * k)`. The sum of all k * R
gradients is then exactly the mean gradient of the big batch.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf
from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext  # XLA or not

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

NON_FINITE_POLICIES = ("raise", "skip")
# Not a user's choice: under a LossScaleOptimizer, it skips and halves its scale.
LOSS_SCALE = "loss_scale"


CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")


def _clips_each_replica(optimizer) -> bool:
    """True for a Keras 3 optimizer (or one inside a LossScaleOptimizer) with clipping:
    Keras clips each replica's part *before* its SUM all-reduce (distgrad lesson 01), not
    the sum one device would clip. distgrad's AccumulatingOptimizer clips the sum itself."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "non_finite", None) is not None:  # also inside a LossScaleOptimizer
        return False
    return (isinstance(inner, keras.optimizers.Optimizer)
            and any(getattr(inner, option, None) for option in CLIP_OPTIONS))


def _summed_on_replica_0(grads):
    """Replica context: the SUM over replicas of `grads` on replica 0, zeros on the others
    (one all-reduce). The optimizer's per-replica clipping then clips the whole gradient,
    and its own SUM all-reduce gives every replica that clipped sum."""
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
        raise TypeError(f"cannot accumulate gradients of a {dtype.name} variable.")
    return tf.float64 if dtype == tf.float64 else tf.float32


def _no_output(fn, *args, **kwargs) -> None:  # a tf.cond branch: both return nothing
    fn(*args, **kwargs)


def _poisoned(grads, finite):
    """`grads` with the first gradient all NaN unless `finite` (a scalar bool)."""
    grads = list(grads)
    i = next(i for i, g in enumerate(grads) if g is not None)
    values = grads[i].values if isinstance(grads[i], tf.IndexedSlices) else grads[i]
    values = tf.where(finite, values, tf.constant(float("nan"), values.dtype))
    grads[i] = (tf.IndexedSlices(values, grads[i].indices, grads[i].dense_shape)
                if isinstance(grads[i], tf.IndexedSlices) else values)
    return grads


def _apply_unless_non_finite(apply_fn, grads, non_finite: str, describe, on_skip) -> None:
    """Replica context: `apply_fn(grads)` unless some replica's `grads` hold NaN/Inf.

    Every replica decides alike: from merge_call's cross-replica view of every replica's
    flag (plus one small all-reduce across workers when replicas are on several workers),
    or (without merge_call) from one all-reduce of it. `non_finite="raise"`: the
    step fails with `tf.errors.InvalidArgumentError` ("assertion failed: " + the strings
    and tensors `describe()` returns) before anything changes. `"skip"`: `on_skip()`
    runs instead, once (in cross-replica context when there is one). `LOSS_SCALE`
    (`apply_fn` calls a LossScaleOptimizer): `on_skip()` runs as for "skip", and
    `apply_fn` is called with the first gradient NaN on *every* replica, so that the
    optimizer skips the step and halves its scale: Keras' own reads replica 0 only.

    Raises:
        ValueError: (trace time) "raise" in an XLA-compiled step (XLA compiles assertions
            out); "skip" on 2+ replicas without merge_call (XLA on GPUs), where TensorFlow
            cannot update a Keras optimizer inside a `tf.cond` (its ONLY_FIRST_REPLICA
            `iterations` needs merge_call).
    """
    if non_finite not in (*NON_FINITE_POLICIES, LOSS_SCALE):
        raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}.")
    finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(g)))
                                     for g in grads if g is not None]))
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync
    no_merge_call = tf.__internal__.distribute.strategy_supports_no_merge_call()
    if non_finite == LOSS_SCALE:
        if replicas > 1 and no_merge_call:
            raise ValueError(
                "A LossScaleOptimizer cannot update on several replicas without merge_call "
                "(TensorFlow's path for XLA-compiled steps on GPUs): its update is a "
                "replica-context tf.cond, in which TensorFlow cannot update the inner "
                "optimizer's `iterations`. Compile with jit_compile=False.")
        if no_merge_call:  # one replica (no strategy, or XLA): its flag is all there is
            tf.cond(finite, lambda: None, lambda: _no_output(on_skip))
        else:  # every replica's flag, read where all are visible
            def every_replica(distribution, flag):
                everywhere = _finite_everywhere(distribution, flag)
                tf.cond(everywhere, lambda: None, lambda: _no_output(on_skip))
                return everywhere

            finite = context.merge_call(every_replica, args=(finite,))
        apply_fn(_poisoned(grads, finite))
        return
    if non_finite == "raise":
        if GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            raise ValueError(
                "non_finite='raise' cannot raise in an XLA-compiled step (XLA compiles "
                "assertions out; Keras compiles with XLA on a GPU by itself): pass "
                "non_finite='skip', or compile with jit_compile=False.")
        if replicas > 1 and no_merge_call:
            finite = tf.equal(context.all_reduce(
                tf.distribute.ReduceOp.SUM, 1.0 - tf.cast(finite, tf.float32)), 0.0)
        elif replicas > 1:
            finite = context.merge_call(_finite_everywhere, args=(finite,))
        def fail():
            # `describe()` reads variables in here: that makes this cond a resource op for
            # automatic control dependencies, ordered per replica. A bare Assert (stateful,
            # no resource) is chained after the previous replica's in tracing order, and
            # with collectives in replica context (no merge_call) that deadlocked the step.
            with tf.control_dependencies([tf.debugging.Assert(False, describe())]):
                return tf.constant(False)

        checked = tf.cond(finite, lambda: tf.constant(True), fail)
        # The check gates every op `apply_fn` creates, merge_call's included (its
        # cross-replica function runs under the replica threads' control dependencies).
        with tf.control_dependencies([checked]):
            apply_fn(grads)
        return
    if no_merge_call:
        if replicas > 1:
            raise ValueError(
                "non_finite='skip' on several replicas without merge_call (TensorFlow's path "
                "for XLA-compiled steps on GPUs) needs the optimizer update inside a tf.cond, "
                "where TensorFlow cannot update a Keras optimizer's `iterations`. Wrap the "
                "optimizer: distgrad's AccumulatingOptimizer(optimizer, accumulation_steps=1, "
                "non_finite='skip') skips there; or compile with jit_compile=False.")
        tf.cond(finite, lambda: _no_output(apply_fn, grads), lambda: _no_output(on_skip))
        return

    def cross_replica(distribution, finite, grads):
        # As in Keras' LossScaleOptimizer._tf_apply: a cond whose branch updates a
        # MirroredStrategy optimizer (merge_call) must be taken in cross-replica context.
        tf.cond(_finite_everywhere(distribution, finite),
                lambda: _no_output(distribution.extended.call_for_each_replica, apply_fn,
                                   args=(grads,)),
                lambda: _no_output(on_skip))

    context.merge_call(cross_replica, args=(finite, grads))


def _is_loss_scale_optimizer(optimizer) -> bool:
    """Keras 3's LossScaleOptimizer, or tf-keras' (`tf.keras` in a tf-keras process)."""
    return isinstance(optimizer, (_KERAS_3_LOSS_SCALE_OPTIMIZER,
                                  tf.keras.mixed_precision.LossScaleOptimizer))


class GradientAccumulator(tf.Module):
    """Replica-local gradient buffers for a list of variables, plus a micro-step counter.

    Create it under `strategy.scope()` (the strategy that created the variables).
    Per micro-batch, inside `strategy.run`: `accumulator.add(tape.gradient(loss,
    variables))`. Once per update, call the function `make_apply_step(optimizer)`
    returns (or, inside your own `strategy.run`, `accumulator.apply_gradients(optimizer)`).

    Args:
        variables: the variables gradients are accumulated for (usually
            `model.trainable_variables`), all created under the strategy in scope.
        name: module name.
        non_finite: what `apply_gradients` does when the sums are NaN/Inf on any replica.
            "raise" (default): `tf.errors.InvalidArgumentError` naming the update, before
            anything changes (the buffers keep the sums; `reset()` zeroes them). "skip":
            no update, buffers zeroed, counted in `skipped_updates` (and `make_apply_step`
            warns). An optimizer that handles non-finite gradients itself decides instead:
            a `LossScaleOptimizer` (Keras 3's or tf-keras') skips the update and halves
            its scale, and it sees an overflow on *any* replica: Keras 3's own reads
            replica 0 only, so the accumulator gives every replica a NaN gradient then;
            the skip is counted in `skipped_updates` (and `make_apply_step` warns). Like
            one big-batch step under a loss scale, an overflow in any micro-batch skips
            the whole update. An optimizer with a `non_finite` policy of its own
            (distgrad's `AccumulatingOptimizer`) decides alone.

    State (tracked by `tf.train.Checkpoint(accumulator=...)`):
        accumulated: one `tf.Variable(synchronization=ON_READ, aggregation=SUM)` per
            variable, float32 (float64 for float64 variables) whatever the variable
            dtype. MirroredStrategy makes it a `SyncOnReadVariable` with one copy per
            replica: `assign_add` in replica context touches the local copy only (no
            collective); a cross-replica read is the SUM over replicas. A checkpoint
            saves that SUM and restores SUM / R on every replica
            (`values_util.get_on_read_restore_ops`), so the next update is unchanged.
            (`aggregation=NONE`, as in OpenNMT-tf, cannot be read in cross-replica
            context nor saved with 2+ replicas.)
        micro_step_counter: `ON_READ` / `ONLY_FIRST_REPLICA` int64: every replica counts
            locally (no merge_call); a checkpoint saves replica 0's count.
        micro_steps: (property) micro-batches accumulated in the current cycle, read
            eagerly; `reset` and every apply set it to 0.
        skipped_updates: mirrored int64, updates skipped as non-finite ("skip", or
            under a `LossScaleOptimizer`).

    Epoch ends: the loop decides. An incomplete cycle stays in the buffers until the next
    apply; `reset()` discards it, and an apply applies the sums as they are (with the loss
    divided by the global batch of a whole update, a partial cycle of n micro-batches
    gives n/k of their mean gradient: scale the loss by the micro-batches applied).

    Contract:
        * `add(grads)`: replica context only; one gradient (or `None`, skipped) per
          variable; `tf.IndexedSlices` are summed into the dense buffer
          (`unsorted_segment_sum`: `SyncOnReadVariable` has no `scatter_add`).
        * `gradients()`: in replica context this replica's sums, cast to each
          variable's dtype; in cross-replica context their SUM over replicas. A
          position that was `None` in every traced `add` is `None` (so the optimizer
          skips it, as it would in one big step).
        * `reset()`: zeros the buffers and the counter (either context).

    Raises:
        ValueError: no variables; variables owned by another strategy than the one in
            scope; distributed variables but no strategy scope; non-distributed
            variables inside a strategy scope; a wrong number or shape of gradients; a
            bad `non_finite`; (first apply) "raise" in an XLA-compiled step, "skip" on 2+
            replicas without merge_call (XLA on GPUs): the message names the fix.
        TypeError: a non-floating variable.
        RuntimeError: `add` / `apply_gradients` called in cross-replica context.
        tf.errors.InvalidArgumentError: (run time) non-finite sums under "raise".
    """

    def __init__(self, variables, name: str = "gradient_accumulator",
                 non_finite: str = "raise"):
        if not isinstance(name, str):
            raise TypeError(
                f"GradientAccumulator(variables, name=...) takes no accumulation count (got "
                f"{name!r} as `name`): your loop decides when to apply. Call `add(grads)` "
                "every micro-batch and the apply step every k-th (see make_apply_step).")
        super().__init__(name=name)
        variables = list(variables)
        if not variables:
            raise ValueError("GradientAccumulator needs at least one variable.")
        if non_finite not in NON_FINITE_POLICIES:
            raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got "
                             f"{non_finite!r}.")
        self.non_finite = non_finite
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
            self.skipped_updates = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="skipped_updates",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
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
        the update (without merge_call on 2+ replicas, "raise" adds one all-reduce of
        one element: the finiteness flags). Reads come before the reset (automatic
        control dependencies order stateful ops on the same variable in program order).
        Non-finite sums: see `non_finite`.
        """
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

        # Gate everything this replica creates (reads, all-reduce, the optimizer's
        # `iterations` increment, the reset) on the check: an Assert alone would fail
        # the call but let independent stateful ops run.
        with tf.control_dependencies([check]):
            grads = self.gradients()
            if _clips_each_replica(optimizer):  # one more all-reduce: the sum is clipped
                grads = _summed_on_replica_0(grads)
            if _is_loss_scale_optimizer(optimizer):
                # It skips and halves its scale itself; poisoned gradients make it see an
                # overflow on any replica, and `skipped_updates` counts it.
                policy, on_skip = LOSS_SCALE, lambda: self.skipped_updates.assign_add(1)
            elif getattr(optimizer, "non_finite", None) is not None:
                apply_and_reset(grads)  # its own policy (AccumulatingOptimizer)
                return
            else:
                policy, on_skip = self.non_finite, skip
            _apply_unless_non_finite(apply_and_reset, grads, policy, lambda: [
                "GradientAccumulator: NaN/Inf accumulated gradients on some replica at update",
                optimizer.iterations + 1,
                "(optimizer.iterations + 1); nothing applied, the buffers keep their sums."],
                on_skip)

    def make_apply_step(self, optimizer):
        """A Python callable that applies once per call: `apply_step()`.

        It builds `optimizer` for the variables under the strategy scope first, so
        the traced function creates no variables (on TF 2.21 / Keras 3.15 letting Adam
        or momentum create slots inside it fails under MirroredStrategy; see
        `distgrad.pitfalls.lazy_slot_creation`). `apply_step.function` is the
        `tf.function` (for `count_collectives`).

        Raises ValueError (at call time) when no micro-step was accumulated, and when
        the optimizer was created outside the accumulator's strategy scope. Warns
        (`UserWarning`) when a call skipped a non-finite update.
        """
        owner = getattr(optimizer, "_distribution_strategy", self._strategy)
        if owner is not self._strategy:
            raise ValueError(
                "the optimizer was created outside the strategy scope of the "
                "GradientAccumulator; create it under `with strategy.scope():`.")
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
                    "apply with zero accumulated micro-steps: call accumulator.add(...) "
                    "inside strategy.run at least once since the last apply/reset.")
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
