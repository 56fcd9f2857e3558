"""In-step micro-batching for `model.fit`: k micro-batches, one update, one all-reduce.

It imports only TensorFlow, Keras and the standard library: copy this one file (its end is
generated from `non_finite.py`). How it matches Keras' train_step: docs/design.md, "MicroBatching".
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf
from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext  # XLA or not

# The public names (the API page documents them); the other functions serve them.
__all__ = ["MicroBatching", "MicroBatchingModel", "check_micro_batches", "with_micro_batches"]

# The oldest versions the version matrix passes (docs/versions.md). Older Keras fails here:
# < 3.5 does not sum gradients over replicas (keras-team/keras#19969), < 3.4 has no
# compute_loss(training=).
NEEDED = {"tensorflow": (2, 16), "keras": (3, 10)}
if any(tuple(map(int, m.__version__.split(".")[:2])) < NEEDED[m.__name__] for m in (tf, keras)):
    raise ImportError(f"distgrad.train_step needs TensorFlow >= 2.16 and Keras >= 3.10, found "
                      f"TensorFlow {tf.__version__} and Keras {keras.__version__}: "
                      "pip install -U 'tensorflow>=2.16' 'keras>=3.10'")

def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")


def check_micro_batches(global_batch_size: int, accumulation_steps: int, replicas: int = 1) -> int:
    """The micro-batch size (per replica) for a global batch split over replicas and slices.

    Pure function: `global_batch_size / replicas / accumulation_steps`.

    Raises:
        ValueError: an argument below 1, or a global batch that is not a multiple of
            `accumulation_steps * replicas`; the message names batch sizes that work.
    """
    _check_count("global_batch_size", global_batch_size)
    _check_count("accumulation_steps", accumulation_steps)
    _check_count("replicas", replicas)
    unit = accumulation_steps * replicas
    if global_batch_size % unit:
        below, above = global_batch_size // unit * unit, (global_batch_size // unit + 1) * unit
        suggestion = f"{below} or {above}" if below else f"{above}"
        raise ValueError(
            f"Use a batch_size that is a multiple of accumulation_steps x replicas = {unit} "
            f"(e.g. {suggestion}) and drop a smaller last batch (tf.data: .batch(batch_size, "
            f"drop_remainder=True)): a global batch of {global_batch_size} examples cannot be "
            f"split into {replicas} replica(s) x accumulation_steps={accumulation_steps} equal "
            "micro-batches.")
    return global_batch_size // unit


def _ragged_message(accumulation_steps: int, replicas: int) -> str:
    unit = accumulation_steps * replicas
    return (
        "MicroBatching: batch with .batch(batch_size, drop_remainder=True) (or make the number "
        f"of examples a multiple of batch_size), with a batch_size a multiple of {unit}: the "
        f"per-replica batch is not divisible by accumulation_steps={accumulation_steps} "
        f"({replicas} replica(s)), and every batch must hold a multiple of accumulation_steps "
        f"x replicas = {unit} examples.")


def _xla_dynamic_batch_message(accumulation_steps: int, replicas: int) -> str:
    return (
        "Batch with .batch(batch_size, drop_remainder=True) or make the number of examples a "
        "multiple of batch_size (a multiple of accumulation_steps x replicas = "
        f"{accumulation_steps * replicas}), or compile with jit_compile=False: MicroBatching "
        "with jit_compile=True needs a static batch dimension, since XLA compiles the check "
        "of a smaller last batch out and would silently truncate it.")


_STEPS_PER_EXECUTION_MESSAGE = (
    "Compile with steps_per_execution=1 (the micro-batches already run k per step): "
    "MicroBatching with steps_per_execution > 1 cannot run on several replicas, where "
    "TensorFlow does not feed the step's all-reduce its key (stock Keras, plain Adam too). "
    "https://github.com/keras-team/keras/issues/19246")
_JIT_COMPILE_MESSAGE = (
    "Compile with jit_compile=False (what Keras' default, \"auto\", picks under "
    "tf.distribute): MicroBatching with jit_compile=True cannot run on several replicas that "
    "are not all GPUs, as one XLA cluster cannot reach the other device's variables (stock "
    "Keras, plain Adam too). https://github.com/keras-team/keras/issues/19005")


def _leading_dimension(structure):
    """(static size or None, dynamic size tensor) of the first non-None leaf."""
    leaf = next(t for t in tf.nest.flatten(structure) if t is not None)
    return leaf.shape[0], tf.shape(leaf)[0]


def _slice(structure, start, size):
    return tf.nest.map_structure(
        lambda t: None if t is None else t[start:start + size], structure)


class MicroBatching:
    """Mixin for `keras.Model`: `train_step` runs k micro-batches, then applies once.

    Put it before `keras.Model` in the bases. Each per-replica batch is split into k
    slices; their gradients are summed in the step and applied once, so `fit`'s steps,
    callbacks, schedules and `iterations` count updates, and the result equals plain
    `fit` on the whole batch (Keras' default loss reduction; limits: docs/design.md).

    Args:
        accumulation_steps: k, the micro-batches each per-replica batch is split into
            (default 1: Keras' own `train_step`). Settable between `fit` calls.
        non_finite: a step whose summed gradients are NaN/Inf on any replica. "raise"
            (default): `tf.errors.InvalidArgumentError` before anything changes. "skip":
            no update, counted in `skipped_updates`. Under a `LossScaleOptimizer` (which
            skips and halves its scale), or an optimizer with its own `non_finite`
            (`AccumulatingOptimizer`), the optimizer decides.

    State:
        Keras' own, and `skipped_updates` (a mirrored int64 `tf.Variable`, saved by
        `tf.train.Checkpoint(model=...)`, not a model weight): steps skipped as
        non-finite. `fit`'s logs show it whenever steps can be skipped, and a `fit` that
        skipped some ends with a `UserWarning`.

    Example:

    ```python
    class MyModel(MicroBatching, keras.Model):
        ...

    model = MicroBatchingModel(inputs, outputs, accumulation_steps=4)  # functional
    model = with_micro_batches(existing_model, 4)  # same layers, shared weights
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64)  # one update per batch, 4 micro-batches per replica
    ```

    Raises (from `fit`):
        ValueError: a batch that does not split into k equal micro-batches per replica
            (at trace time for a static batch, always under `jit_compile=True`); a bad
            `non_finite`; (first step) "raise" under XLA, "skip" on 2+ replicas without
            merge_call; (start of `fit`, 2+ replicas) `steps_per_execution > 1`, or
            `jit_compile=True` on devices that are not all GPUs.
        tf.errors.InvalidArgumentError: (run time) a batch of unknown size that does not
            split; a non-finite step under "raise".
    """

    def __init__(self, *args, accumulation_steps: int = 1, non_finite: str = "raise",
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.accumulation_steps = accumulation_steps
        check_policy(non_finite)
        self.non_finite = non_finite
        # A tf.Variable, not a Keras one, so that it is not one of the model's weights.
        self.skipped_updates = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="skipped_updates",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    @property
    def accumulation_steps(self) -> int:
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        _check_count("accumulation_steps", value)
        self._accumulation_steps = value
        # A traced train function has k baked in as a constant: retrace.
        self.train_function = None

    def get_config(self):
        # Saved with the model, so `keras.models.load_model` restores k.
        return {**super().get_config(), "accumulation_steps": self.accumulation_steps}

    def train_step(self, data):
        k = self.accumulation_steps
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        static_batch, batch = _leading_dimension(x)
        if static_batch is not None:
            micro = check_micro_batches(static_batch * replicas, k, replicas)
        elif self.jit_compile:
            # XLA compiles tf.debugging assertions out (tf2xla's Assert kernel is a
            # no-op): a ragged batch would be silently truncated to k * (n // k).
            raise ValueError(_xla_dynamic_batch_message(k, replicas))
        else:
            with tf.control_dependencies([tf.debugging.assert_equal(
                    tf.math.floormod(batch, k), 0, message=_ragged_message(k, replicas))]):
                micro = batch // k

        trainable = self.trainable_variables
        if not trainable:
            # Keras' own train_step warns so, at the same stack level.
            warnings.warn("The model does not have any trainable weights.", stacklevel=1)
        unconnected = set()  # positions of variables the loss does not depend on

        def body(i, accumulated):
            start = i * micro
            xs, ys, ws = _slice((x, y, sample_weight), start, micro)
            with tf.GradientTape() as tape:
                y_pred = self(xs, training=True)
                loss = self.compute_loss(x=xs, y=ys, y_pred=y_pred, sample_weight=ws,
                                         training=True)
                # Keras' train_step: the tracker records the loss before the 1/R
                # distribution scaling (unscale_loss_for_distribution), weighted by
                # the number of examples; here once per micro-batch.
                self._loss_tracker.update_state(
                    loss * tf.cast(replicas, loss.dtype),
                    sample_weight=tf.shape(next(t for t in tf.nest.flatten(xs)
                                                if t is not None))[0])
                scaled = self.optimizer.scale_loss(loss / tf.cast(k, loss.dtype))
            gradients = tape.gradient(scaled, trainable)
            self.compute_metrics(xs, ys, y_pred, sample_weight=ws)
            summed = []
            for position, (acc, grad) in enumerate(zip(accumulated, gradients)):
                if grad is None:
                    unconnected.add(position)
                    summed.append(acc)
                else:
                    # New tensors, returned as loop variables: `acc += grad` would
                    # rebind a local name and leave `accumulated` as it was.
                    summed.append(acc + tf.convert_to_tensor(grad))
            return i + 1, summed

        accumulators = [tf.zeros(v.shape, dtype=v.dtype) for v in trainable]
        # An explicit while_loop: Keras traces train_step under autograph's
        # do_not_convert, so a Python `for i in tf.range(k)` would not become a loop.
        _, summed = tf.while_loop(
            lambda i, _: i < k, body, [tf.constant(0), accumulators],
            # Iteration i+1's forward pass does not depend on iteration i, so the
            # default (10) may run several micro-batches at once and keep their
            # activations alive together: the memory this class exists to save.
            parallel_iterations=1,
            name="micro_batches",
        )
        if trainable:
            gradients = [None if p in unconnected else g for p, g in enumerate(summed)]
            self._apply_summed(gradients, trainable)
        logs = self.get_metrics_result()
        if (counter := self._skip_counter()) is not None:
            logs["skipped_updates"] = tf.convert_to_tensor(counter)
        return logs

    def _skip_counter(self):
        """The variable that counts this model's skipped steps, or None if none can be."""
        counted_by_optimizer = getattr(self.optimizer, "skipped_steps", None)
        if counted_by_optimizer is not None:  # distgrad's AllReplicasFiniteLossScaleOptimizer
            return counted_by_optimizer
        if (self.non_finite == "skip"
                or isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)):
            return self.skipped_updates
        return None

    def _apply_summed(self, gradients, trainable):
        # The only sync: the optimizer's SUM all-reduce (with clipping, one more before it).
        optimizer = self.optimizer
        if clips_each_replica(optimizer):
            gradients = summed_on_replica_0(gradients)

        def apply(grads):
            optimizer.apply_gradients(zip(grads, trainable))

        if (getattr(optimizer, "skipped_steps", None) is not None
                or getattr(optimizer, "non_finite", None) is not None):
            apply(gradients)  # it checks every replica and counts its skips itself
            return
        # Keras' LossScaleOptimizer skips and halves its scale, but reads replica 0
        # only: poisoned gradients make it see an overflow on any replica.
        lso = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        policy = LOSS_SCALE if lso else self.non_finite
        apply_unless_non_finite(apply, gradients, policy, lambda: [
            "MicroBatching: NaN/Inf summed gradients on some replica at update",
            optimizer.iterations + 1, "(optimizer.iterations + 1); nothing was applied."],
            lambda: self.skipped_updates.assign_add(1))

    def make_train_function(self, force=False):
        """Keras' (at the start of `fit`), after refusing what no replica count > 1 runs."""
        strategy = self.distribute_strategy
        if strategy.num_replicas_in_sync > 1 and not self.run_eagerly:
            if self.steps_per_execution > 1:
                raise ValueError(_STEPS_PER_EXECUTION_MESSAGE)
            if self.jit_compile and not all(
                    tf.DeviceSpec.from_string(d).device_type == "GPU"
                    for d in strategy.extended.worker_devices):
                raise ValueError(_JIT_COMPILE_MESSAGE)
        return super().make_train_function(force)

    def fit(self, *args, **kwargs):
        """Keras' `fit`, then a `UserWarning` if steps were skipped as non-finite."""
        before = int(self.skipped_updates.numpy())
        history = super().fit(*args, **kwargs)
        skipped = int(self.skipped_updates.numpy())
        # (An optimizer that counts its own skips warns itself, at the end of fit.)
        if skipped > before and self._skip_counter() is self.skipped_updates:
            halved = (", and the LossScaleOptimizer halved its scale each time"
                      if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer) else "")
            warnings.warn(
                f"MicroBatching: {skipped - before} step(s) skipped in this fit ({skipped} in "
                f"all, `model.skipped_updates`, also in fit's logs): their summed gradients "
                f"were NaN/Inf on some replica{halved}.", stacklevel=2)
        return history


@keras.saving.register_keras_serializable(package="distgrad")
class MicroBatchingModel(MicroBatching, keras.Model):
    """`keras.Model` with in-step micro-batching; accepts functional arguments.

    `MicroBatchingModel(inputs, outputs, accumulation_steps=4)` builds a functional model
    (Keras injects `Functional` for subclasses called with inputs/outputs). `model.save`
    keeps `accumulation_steps`; a subclass of the mixin registers itself
    (`keras.saving.register_keras_serializable`) like any custom model.
    """


def with_micro_batches(model: keras.Model, accumulation_steps: int,
                       non_finite: str = "raise") -> MicroBatchingModel:
    """A `MicroBatchingModel` over the layers of a built functional/Sequential `model`.

    The new model shares `model`'s layers and weights (same order of
    `trainable_variables`). Build it under the strategy scope the weights were
    created in. Subclassed models have no symbolic inputs: use the mixin instead.
    `non_finite` is `MicroBatching`'s.

    Raises ValueError if `model` has no symbolic inputs/outputs.
    """
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if not inputs or not outputs:
        raise ValueError(
            "Build the model with keras.Input, or subclass `class MyModel(MicroBatching, "
            f"keras.Model)`: {type(model).__name__} has no symbolic inputs/outputs (a "
            "subclassed or unbuilt model).")
    return MicroBatchingModel(inputs, outputs, accumulation_steps=accumulation_steps,
                              non_finite=non_finite)


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
