"""Pitfall: a sync point inside `tf.cond` in replica context.

The question (../shared/questions/003, "the happy path") patches `apply_gradients` to
accumulate and calls the original inside `tf.cond(step % n == 0, ...)`. Lesson 03
writes that code as posted, fixes its two Python bugs (in Keras 3 it passes `args,
kwargs` to the original as two positional arguments, a TypeError, and reads the
`grads_and_vars` zip twice, so it accumulates nothing), and asserts each step.
`CondPatch` is that fixed patch reduced to its defect, for the tests and for the
multi-worker child process: under `MirroredStrategy` the traced step raises the
question's error

    RuntimeError: `merge_call` called while defining a new graph or a tf.function. ...

Why: the original `apply_gradients` contains sync points. In Keras 3
`TFOptimizer._backend_update_step` (`keras/src/backend/tensorflow/optimizer.py`)
all-reduces with `ReplicaContext.all_reduce`, which under MirroredStrategy is a
`merge_call`. MirroredStrategy runs each replica's function in its own thread and
executes a merge function in the main thread, on the graph the step is traced in.
A `tf.cond` branch is a separate graph, so `_MirroredReplicaContext._merge_call`
(`tensorflow/python/distribute/mirrored_run.py`, case 3 of its comment) refuses it.
The minimal fix (lesson 03's `CrossReplicaCondPatch`) takes the same cond in
cross-replica context (`merge_call`) and calls the original back on the replicas with
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

from distgrad_course.lab.child import run_child
from distgrad_course.lab.compare import WeightDiff, weight_diff, weights_of
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.graph import AllReducePlacement, all_reduce_placement, fit_step_placement
from distgrad_course.lab.recipes import custom_loop_run, fit_run
from distgrad_course.pitfalls import CapturedError

MERGE_CALL_ERROR = "`merge_call` called while defining a new graph or a tf.function."


class CondPatch:
    """The question's patch with its Python bugs fixed, reduced to what fails: add the
    gradients to accumulators, then call the original `apply_gradients` inside
    `tf.cond(step % n == 0, ...)`, traced in replica context.

    Installed as the question's `get_patched_optimizer` does: `optimizer.apply_gradients
    = CondPatch(n, optimizer.apply_gradients, trainable_variables).apply_gradients`,
    under the strategy scope. It applies the *sum* of the n gradients, as the question's.
    """

    def __init__(self, n: int, orig_apply_gradients, trainable_variables):
        self.n = n
        self.orig_apply_gradients = orig_apply_gradients
        self.step = tf.Variable(0, dtype=tf.int64)
        self.sums = [tf.Variable(tf.zeros(v.shape, dtype=v.dtype)) for v in trainable_variables]

    def apply_gradients(self, grads_and_vars):
        gradients, variables = zip(*grads_and_vars)
        for total, gradient in zip(self.sums, gradients):
            total.assign_add(gradient)
        self.step.assign_add(1)
        tf.cond(tf.equal(self.step % self.n, 0), lambda: self._apply(variables), lambda: None)

    def _apply(self, variables):
        self.orig_apply_gradients(zip(self.sums, variables))  # all-reduce: a merge_call
        for total in self.sums:
            total.assign(tf.zeros_like(total))


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
    `tf.function` custom loop (`custom_loop_run`), one `strategy.run(replica_step)` per
    micro-batch of `micro_batch` examples, each replica's loss summed and divided by
    `loss_batch` (default `micro_batch`; pass k * micro_batch to make the k-step sum the
    big batch's mean). `fit=True`: `model.fit(x, y, batch_size=micro_batch,
    shuffle=False)` (`fit_run`: Keras' mean loss per micro-batch). `strategy=None` runs
    without a strategy.
    """
    strategy = strategy or tf.distribute.get_strategy()

    def install(model, optimizer):
        optimizer.build(model.trainable_variables)
        patch = patch_class(n, optimizer.apply_gradients, model.trainable_variables)
        optimizer.apply_gradients = patch.apply_gradients

    run = error = placement = None
    try:
        if fit:
            run = fit_run(strategy, optimizer_factory, x, y, micro_batch, prepare=install)
            placement = fit_step_placement(run.model, x, y, micro_batch)
        else:
            run = custom_loop_run(strategy, optimizer_factory, x, y, micro_batch,
                                  loss_batch=loss_batch, prepare=install)
            placement = all_reduce_placement(run.step_function, run.batch,
                                             replicas=strategy.num_replicas_in_sync)
    except (TypeError, RuntimeError) as err:
        error = CapturedError.of(err)
    return CondPatchRecord(
        strategy=type(strategy).__name__,
        replicas=strategy.num_replicas_in_sync,
        supports_no_merge_call=supports_no_merge_call(strategy),
        micro_steps=len(x) // micro_batch,
        error=error,
        updates=None if error else run.updates,
        weight_change=None if error else max(
            float(np.max(np.abs(a - b))) for a, b in zip(run.final, run.initial)),
        final=None if error else run.final,
        placement=placement,
    )


def reproduce(strategy=None, patch_class=CondPatch, n: int = 2,
              micro_steps: int = 4, micro_batch: int = 4,
              learning_rate: float = 0.1) -> CondPatchRecord:
    """`patched_run` of `patch_class` with SGD in a `tf.function` custom loop.

    The default, `CondPatch`, raises the question's merge_call RuntimeError under
    MirroredStrategy; lesson 03 passes the question's code as posted and its fixes.
    `strategy=None`: no strategy.
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

    A fresh process (`distgrad_course.lab.child`) because MultiWorkerMirroredStrategy
    configures the TensorFlow runtime's collective ops at construction. No
    `TF_CONFIG`: one worker with its local devices. Raises `ChildError`
    (a RuntimeError) if the child fails, TimeoutError past `timeout` seconds.
    """
    record = run_child("distgrad_course.pitfalls.cond_merge_call:reproduce_in_fresh_multiworker",
                       env={"TF_CONFIG": None}, timeout=timeout).value
    error = None if record["error"] is None else CapturedError(**record["error"])
    return MultiWorkerRecord(record["replicas"], record["supports_no_merge_call"], error,
                             record["updates"])
