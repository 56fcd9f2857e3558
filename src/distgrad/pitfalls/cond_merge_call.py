"""Pitfall: a sync point inside `tf.cond` in replica context.

The question (../shared/questions/003, "the happy path") patches `apply_gradients` to
accumulate and calls the original inside `tf.cond(step % n == 0, ...)`. Under
`MirroredStrategy` the traced step raises

    RuntimeError: `merge_call` called while defining a new graph or a tf.function. ...

Why: the original `apply_gradients` contains sync points. In Keras 3
`TFOptimizer._backend_update_step` (`keras/src/backend/tensorflow/optimizer.py`)
all-reduces with `ReplicaContext.all_reduce`, which under MirroredStrategy is a
`merge_call`. MirroredStrategy runs each replica's function in its own thread and
executes a merge function in the main thread, on the graph the step is traced in.
A `tf.cond` branch is a separate graph, so `_MirroredReplicaContext._merge_call`
(`tensorflow/python/distribute/mirrored_run.py`, case 3 of its comment) refuses it.

`tf.__internal__.distribute.strategy_supports_no_merge_call()` says when there is no
merge_call at all: without a strategy, and for MirroredStrategy /
MultiWorkerMirroredStrategy only inside XLA-compiled functions on all-GPU devices
(`MirroredExtended._use_merge_call`, `CollectiveAllReduceExtended._use_merge_call`).
There the all-reduce is launched from the replica itself and a cond around it is
fine as long as every replica takes the same branch. On CPUs, MultiWorkerMirrored is a
merge_call strategy too, and fails the same way (`reproduce_under_multiworker`).

Keras 3's own `gradient_accumulation_steps` has the same shape (an `ops.cond` in
`BaseOptimizer._backend_apply_gradients` whose true branch calls
`_backend_update_step`), so `model.fit` with it raises the same error under
MirroredStrategy: keras-team/keras#20582 (open). `reproduce_builtin` runs it.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from distgrad.lab.child import run_child
from distgrad.lab.compare import WeightDiff, weight_diff, weights_of
from distgrad.lab.data import regression_data, tiny_model
from distgrad.lab.recipes import make_replica_step
from distgrad.pitfalls import CapturedError

MERGE_CALL_ERROR = "`merge_call` called while defining a new graph or a tf.function."


class SeedCondPatch:
    """The question's `_GradientAccumulationPatch` with `tf.cond` ("the happy path").

    Every call adds the gradients into `accu_gradients`, counts the step, and inside
    `tf.cond(step % n == 0, ...)` calls the original `apply_gradients` with the
    accumulated gradients, then zeroes them. Kept as the question wrote it (it applies
    the *sum* of the n gradients); only the Keras 3 names differ.
    """

    def __init__(self, n: int, orig_apply_gradients, trainable_variables):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}.")
        self.n = tf.constant(n, dtype=tf.int64)
        self.accu_gradients = [
            tf.Variable(tf.zeros(v.shape, dtype=v.dtype), trainable=False)
            for v in trainable_variables
        ]
        self._current_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._orig_apply_gradients = orig_apply_gradients

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        trainable_variables = [var for (_, var) in grads_and_vars]
        for i, (grad, _) in enumerate(grads_and_vars):
            self.accu_gradients[i].assign_add(grad)
        tf.cond(
            self._can_apply_on_next_step(),
            true_fn=lambda: self.apply_accu_gradients(trainable_variables, *args, **kwargs),
            false_fn=lambda: None,
        )

    def apply_accu_gradients(self, trainable_variables, *args, **kwargs):
        accumulated = [tf.convert_to_tensor(g) for g in self.accu_gradients]
        self._orig_apply_gradients(zip(accumulated, trainable_variables), *args, **kwargs)
        for i in range(len(self.accu_gradients)):
            self.accu_gradients[i].assign(tf.zeros_like(trainable_variables[i]))

    def _can_apply_on_next_step(self):
        self._current_step.assign_add(1)
        return tf.equal(tf.math.mod(self._current_step, self.n), 0)


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
    """What the tf.cond patch did under one strategy in a traced custom loop.

    `error` is None when it ran; then `updates` is the inner optimizer's iteration
    count after `micro_steps` calls.
    """

    strategy: str
    replicas: int
    supports_no_merge_call: bool
    micro_steps: int
    error: CapturedError | None
    updates: int | None


def reproduce(strategy=None, n: int = 2, micro_steps: int = 4, micro_batch: int = 4,
              learning_rate: float = 0.1) -> CondPatchRecord:
    """Run the seed's tf.cond patch in a `tf.function` custom loop under `strategy`.

    `strategy=None` runs without a strategy (the default strategy). Each micro-step
    is `strategy.run(replica_step)` on a global batch of `micro_batch` examples.
    """
    strategy = strategy or tf.distribute.get_strategy()
    x, y = regression_data(micro_batch * micro_steps)
    with strategy.scope():
        model = tiny_model()
        optimizer = keras.optimizers.SGD(learning_rate)
        optimizer.build(model.trainable_variables)
        patch = SeedCondPatch(n, optimizer.apply_gradients, model.trainable_variables)
        optimizer.apply_gradients = patch.apply_gradients
    replica_step = make_replica_step(micro_batch)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(micro_batch)

    @tf.function
    def distributed_step(batch):
        return strategy.run(replica_step, args=(model, optimizer, *batch))

    error = None
    try:
        for batch in strategy.experimental_distribute_dataset(dataset):
            distributed_step(batch)
    except RuntimeError as err:
        error = CapturedError.of(err)
    return CondPatchRecord(
        strategy=type(strategy).__name__,
        replicas=strategy.num_replicas_in_sync,
        supports_no_merge_call=supports_no_merge_call(strategy),
        micro_steps=micro_steps,
        error=error,
        updates=None if error else int(optimizer.iterations.numpy()),
    )


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
    `TF_CONFIG`: one worker with its local devices (one CPU here). Raises `ChildError`
    (a RuntimeError) if the child fails, TimeoutError past `timeout` seconds.
    """
    record = run_child("distgrad.pitfalls.cond_merge_call:reproduce_in_fresh_multiworker",
                       env={"TF_CONFIG": None}, timeout=timeout).value
    error = None if record["error"] is None else CapturedError(**record["error"])
    return MultiWorkerRecord(record["replicas"], record["supports_no_merge_call"], error,
                             record["updates"])
