"""Pitfall: a sync point inside `tf.cond` in replica context.

The question (../shared/questions/003, "the happy path") patches `apply_gradients` to
accumulate and calls the original inside `tf.cond(step % n == 0, ...)`.
`QuestionCondPatch` is that code as posted. In Keras 3 it fails before any
distribution question arises: it passes `args, kwargs` to the original as two
positional arguments (TypeError), and it reads the `grads_and_vars` zip twice, so it
accumulates nothing. `CallsFixedCondPatch` fixes both; under `MirroredStrategy` the
traced step then raises the question's error

    RuntimeError: `merge_call` called while defining a new graph or a tf.function. ...

Why: the original `apply_gradients` contains sync points. In Keras 3
`TFOptimizer._backend_update_step` (`keras/src/backend/tensorflow/optimizer.py`)
all-reduces with `ReplicaContext.all_reduce`, which under MirroredStrategy is a
`merge_call`. MirroredStrategy runs each replica's function in its own thread and
executes a merge function in the main thread, on the graph the step is traced in.
A `tf.cond` branch is a separate graph, so `_MirroredReplicaContext._merge_call`
(`tensorflow/python/distribute/mirrored_run.py`, case 3 of its comment) refuses it.
`CrossReplicaCondPatch` is the minimal fix: the same cond, taken in cross-replica
context (`merge_call`), the original called back on the replicas with
`call_for_each_replica`, as Keras' `LossScaleOptimizer._tf_apply` does.

`tf.__internal__.distribute.strategy_supports_no_merge_call()` says when there is no
merge_call at all: without a strategy, and for MirroredStrategy /
MultiWorkerMirroredStrategy only inside XLA-compiled functions on all-GPU devices
(`MirroredExtended._use_merge_call`, `CollectiveAllReduceExtended._use_merge_call`).
Outside XLA, MultiWorkerMirrored is a merge_call strategy too, and fails the same way
(`reproduce_under_multiworker`).

Keras 3's own `gradient_accumulation_steps` has the same shape (an `ops.cond` in
`BaseOptimizer._backend_apply_gradients` whose true branch calls
`_backend_update_step`), so `model.fit` with it raises the same error under
MirroredStrategy: keras-team/keras#20582 (open). `reproduce_builtin` runs it.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from distgrad.lab.child import run_child
from distgrad.lab.compare import WeightDiff, weight_diff, weights_of
from distgrad.lab.data import regression_data, tiny_model
from distgrad.lab.graph import AllReducePlacement, all_reduce_placement, fit_step_placement
from distgrad.lab.recipes import make_replica_step
from distgrad.pitfalls import CapturedError

MERGE_CALL_ERROR = "`merge_call` called while defining a new graph or a tf.function."


class QuestionCondPatch:
    """The question's `_GradientAccumulationPatch` with `tf.cond` ("the happy path"), as posted.

    Renamed, otherwise verbatim, bugs included: `apply_gradients` reads the
    `grads_and_vars` zip twice (the second read is empty: nothing is accumulated), and
    `true_fn` passes `args, kwargs` as two positional arguments instead of `*args,
    **kwargs` (Keras 3's `apply_gradients(grads_and_vars)` raises TypeError). Install it
    as the question's `get_patched_optimizer` does: `optimizer.apply_gradients =
    patch.apply_gradients`.
    """

    def __init__(
        self,
        n: int,
        orig_apply_gradients,
        trainable_variables
    ):
        self.n = tf.constant(n, dtype=tf.int64)
        policy = tf.keras.mixed_precision.global_policy()
        self.variable_dtype = policy.variable_dtype
        self.accu_gradients = [
            tf.Variable(
                tf.zeros(g.shape, dtype=g.dtype),
            ) for g in trainable_variables
        ]

        self._current_step = tf.Variable(0, dtype=tf.int64)
        self._orig_apply_gradients = orig_apply_gradients

    def apply_gradients(self, grads_and_vars, *args, **kwargs):

        trainable_variables = [var for (_, var) in grads_and_vars]
        gradients = [grad for (grad, _) in grads_and_vars]

        # Always accumulate gradients
        for i, grad in enumerate(gradients):
            self.accu_gradients[i].assign_add(grad)

        tf.cond(
            self._can_apply_on_next_step(),
            true_fn=lambda: self.apply_accu_gradients(trainable_variables, args, kwargs),
            false_fn=lambda: None
        )

    def apply_accu_gradients(self, trainable_variables, *args, **kwargs):

        # Call the original apply_gradients() function
        self._orig_apply_gradients(zip(self.accu_gradients, trainable_variables), *args, **kwargs)

        # Reset all accumulated gradients to zero
        for i in range(len(self.accu_gradients)):
            self.accu_gradients[i].assign(tf.zeros_like(trainable_variables[i]))

    def _can_apply_on_next_step(self):
        """
        :return: True if gradients should be applied; False otherwise.
        """
        # Increment (always do this first)
        self._current_step.assign_add(1)
        count_mod_steps = tf.math.mod(self._current_step, self.n)
        return tf.equal(count_mod_steps, 0)


class CallsFixedCondPatch(QuestionCondPatch):
    """`QuestionCondPatch` with its two Python bugs fixed, and nothing else changed:
    `grads_and_vars` is read into a list once, and `true_fn` passes `*args, **kwargs`.
    Under MirroredStrategy it then raises the question's merge_call RuntimeError."""

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)  # fix 1: a zip can be read only once
        trainable_variables = [var for (_, var) in grads_and_vars]
        gradients = [grad for (grad, _) in grads_and_vars]
        for i, grad in enumerate(gradients):
            self.accu_gradients[i].assign_add(grad)
        tf.cond(
            self._can_apply_on_next_step(),
            # fix 2: unpack, instead of passing the tuple and the dict as two arguments
            true_fn=lambda: self.apply_accu_gradients(trainable_variables, *args, **kwargs),
            false_fn=lambda: None
        )


class CrossReplicaCondPatch(CallsFixedCondPatch):
    """The minimal fix of the question's patch: the same `tf.cond`, in cross-replica context.

    Accumulate in replica context (each replica adds to its own copy of the
    accumulators), then `merge_call` once; there count the step and cond, and in the
    taken branch go back to the replicas with `call_for_each_replica` to run the
    original `apply_gradients` (whose own `merge_call`s then happen in fresh replica
    threads of the branch graph): the shape of Keras' `LossScaleOptimizer._tf_apply`.
    Like the question's, it applies the *sum* of the n accumulated gradients.
    """

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        trainable_variables = [var for (_, var) in grads_and_vars]
        for i, (grad, _) in enumerate(grads_and_vars):
            self.accu_gradients[i].assign_add(grad)  # replica-local: no communication

        def cross_replica_step(distribution):
            def apply_on_replicas():
                distribution.extended.call_for_each_replica(
                    self.apply_accu_gradients, args=(trainable_variables, *args),
                    kwargs=kwargs)

            tf.cond(self._can_apply_on_next_step(), apply_on_replicas, lambda: None)

        tf.distribute.get_replica_context().merge_call(cross_replica_step)


def supports_no_merge_call(strategy) -> bool:
    """`strategy_supports_no_merge_call()` as seen in replica context of a traced step."""

    @tf.function
    def probe():
        return strategy.run(
            lambda: tf.constant(tf.__internal__.distribute.strategy_supports_no_merge_call()))

    with strategy.scope():
        values = strategy.experimental_local_results(probe())
    return bool(values[0])


@dataclasses.dataclass(frozen=True)
class CondPatchRecord:
    """What a tf.cond patch did under one strategy.

    `error` is the TypeError or RuntimeError training raised, or None; then `updates`
    is the optimizer's iteration count after `micro_steps` calls, `weight_change` the
    largest |w_final - w_initial|, `final` the weights and `placement` where the
    all-reduces of one traced step are (all None after an error).
    """

    strategy: str
    replicas: int
    supports_no_merge_call: bool
    micro_steps: int
    error: CapturedError | None
    updates: int | None
    weight_change: float | None
    final: list | None
    placement: AllReducePlacement | None


def patched_run(strategy, patch_class, optimizer_factory, x, y, micro_batch: int, n: int,
                fit: bool = False, loss_batch: int | None = None) -> CondPatchRecord:
    """Train `tiny_model` with `optimizer_factory()` patched by `patch_class(n, ...)`.

    The patch is installed as the question's `get_patched_optimizer` does, under the
    strategy scope, after the model and the optimizer are built. `fit=False`: a
    `tf.function` custom loop, one `strategy.run(replica_step)` per micro-batch of
    `micro_batch` examples, each replica's loss summed and divided by `loss_batch`
    (default `micro_batch`; pass k * micro_batch to make the k-step sum the big batch's
    mean). `fit=True`: `model.fit(x, y, batch_size=micro_batch, shuffle=False)` (Keras'
    mean loss per micro-batch). `strategy=None` runs without a strategy.
    """
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        model = tiny_model()
        optimizer = optimizer_factory()
        optimizer.build(model.trainable_variables)
        patch = patch_class(n, optimizer.apply_gradients, model.trainable_variables)
        optimizer.apply_gradients = patch.apply_gradients
        if fit:
            model.compile(optimizer=optimizer, loss="mse")
    initial = weights_of(model)
    error = placement = None
    try:
        if fit:
            model.fit(x, y, batch_size=micro_batch, epochs=1, shuffle=False, verbose=0)
            placement = fit_step_placement(model, x, y, micro_batch)
        else:
            replica_step = make_replica_step(loss_batch or micro_batch)
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(micro_batch)

            @tf.function
            def distributed_step(batch):
                return strategy.run(replica_step, args=(model, optimizer, *batch))

            for batch in strategy.experimental_distribute_dataset(dataset):
                distributed_step(batch)
            placement = all_reduce_placement(distributed_step, batch,
                                             replicas=strategy.num_replicas_in_sync)
    except (TypeError, RuntimeError) as err:
        error = CapturedError.of(err)
    final = None if error else weights_of(model)
    return CondPatchRecord(
        strategy=type(strategy).__name__,
        replicas=strategy.num_replicas_in_sync,
        supports_no_merge_call=supports_no_merge_call(strategy),
        micro_steps=len(x) // micro_batch,
        error=error,
        updates=None if error else int(optimizer.iterations.numpy()),
        weight_change=None if error else max(
            float(np.max(np.abs(a - b))) for a, b in zip(final, initial)),
        final=final,
        placement=placement,
    )


def reproduce(strategy=None, patch_class=CallsFixedCondPatch, n: int = 2,
              micro_steps: int = 4, micro_batch: int = 4,
              learning_rate: float = 0.1) -> CondPatchRecord:
    """`patched_run` of `patch_class` with SGD in a `tf.function` custom loop.

    The default patch is the question's with its two Python bugs fixed, which raises
    the question's merge_call RuntimeError under MirroredStrategy; pass
    `QuestionCondPatch` for the code as posted. `strategy=None`: no strategy.
    """
    x, y = regression_data(micro_batch * micro_steps)
    return patched_run(strategy, patch_class, lambda: keras.optimizers.SGD(learning_rate),
                       x, y, micro_batch, n)


@dataclasses.dataclass(frozen=True)
class BuiltinRecord:
    """Keras' `gradient_accumulation_steps` in `model.fit` under one strategy."""

    tensorflow: str
    keras: str
    strategy: str
    replicas: int
    steps: int
    error: CapturedError | None
    updates: int | None
    micro_steps: int | None
    vs_big_batch: WeightDiff | None


def reproduce_builtin(strategy=None, steps: int = 4, updates: int = 2, micro_batch: int = 4,
                      learning_rate: float = 0.1) -> BuiltinRecord:
    """`model.fit` with `SGD(learning_rate, gradient_accumulation_steps=steps)`.

    On success `vs_big_batch` compares with plain SGD fit on batches `steps` times
    larger, without a strategy (the built-in is correct where it runs).
    """
    strategy = strategy or tf.distribute.get_strategy()
    x, y = regression_data(micro_batch * steps * updates)
    with strategy.scope():
        model = tiny_model()
        optimizer = keras.optimizers.SGD(learning_rate, gradient_accumulation_steps=steps)
        model.compile(optimizer=optimizer, loss="mse")
    error = None
    try:
        model.fit(x, y, batch_size=micro_batch, epochs=1, shuffle=False, verbose=0)
    except RuntimeError as err:
        error = CapturedError.of(err)
    diff = None
    if error is None:
        with tf.distribute.get_strategy().scope():
            reference = tiny_model()
            reference.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
        reference.fit(x, y, batch_size=micro_batch * steps, epochs=1, shuffle=False, verbose=0)
        diff = weight_diff(weights_of(model), weights_of(reference))
    return BuiltinRecord(
        tensorflow=tf.__version__,
        keras=keras.__version__,
        strategy=type(strategy).__name__,
        replicas=strategy.num_replicas_in_sync,
        steps=steps,
        error=error,
        updates=None if error else int(keras.ops.convert_to_numpy(optimizer.iterations)),
        micro_steps=None if error else int(optimizer._iterations.numpy()),
        vs_big_batch=diff,
    )


def reproduce_in_fresh_multiworker() -> CondPatchRecord:
    """In a fresh process: `reproduce` under a `MultiWorkerMirroredStrategy` created
    first (it configures the runtime's collective ops). Run by
    `reproduce_under_multiworker`."""
    return reproduce(tf.distribute.MultiWorkerMirroredStrategy())


@dataclasses.dataclass(frozen=True)
class MultiWorkerRecord:
    replicas: int
    supports_no_merge_call: bool
    error: CapturedError | None
    updates: int | None


def reproduce_under_multiworker(timeout: float = 180) -> MultiWorkerRecord:
    """`reproduce` under a single-worker `MultiWorkerMirroredStrategy`, in a fresh process.

    A fresh process (`distgrad.lab.child`) because MultiWorkerMirroredStrategy
    configures the TensorFlow runtime's collective ops at construction. No
    `TF_CONFIG`: one worker with its local devices. Raises `ChildError`
    (a RuntimeError) if the child fails, TimeoutError past `timeout` seconds.
    """
    record = run_child("distgrad.pitfalls.cond_merge_call:reproduce_in_fresh_multiworker",
                       env={"TF_CONFIG": None}, timeout=timeout).value
    error = None if record["error"] is None else CapturedError(**record["error"])
    return MultiWorkerRecord(record["replicas"], record["supports_no_merge_call"], error,
                             record["updates"])
