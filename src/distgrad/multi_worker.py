"""`model.fit` on several workers: `MultiWorkerMirroredStrategy` with Keras 3.

    class MyModel(MultiWorkerFit, keras.Model): ...          # subclassed models
    model = MultiWorkerFitModel(inputs, outputs)              # functional
    class Both(MultiWorkerFit, MicroBatching, keras.Model): ... # with distgrad's micro-batches

This file imports only TensorFlow, Keras and the standard library: copy it into a
project and use it alone.

Stock Keras 3 `fit` / `evaluate` fail on a multi-worker `MultiWorkerMirroredStrategy`
(keras-team/keras#20585, tensorflow/tensorflow#72388), in two places of
`keras/src/backend/tensorflow/trainer.py`:

* `_maybe_symbolic_build` reads one distributed batch and calls
  `strategy.reduce("MEAN", batch, axis=None)` on the whole `(x, y)` structure.
  `Strategy.reduce` takes one value, not a structure; on one worker the structure passes
  through untouched, on several it goes to the collective all-reduce, which tries to
  convert it to a tensor: `ValueError: Attempt to convert a value (PerReplica:...) with
  an unsupported type`. The build needs only shapes and dtypes: `MultiWorkerFit` hands
  Keras this worker's first replica's batch instead, with no communication.
* `reduce_per_replica` reduces every value a step returns with
  `strategy.reduce("MEAN", value, axis=0)` on a multi-worker MWMS (on other strategies
  it averages the replicas' values), and a scalar loss has no axis 0: `ValueError:
  Invalid reduction dimension 0 for input with 0 dimensions`. `MultiWorkerFit` gives
  every value its step returns a leading axis of length 1, so that this reduce is the
  mean over all replicas of all workers, in the value's own shape.

Gradients and updates are untouched: the optimizer's all-reduce in `apply_gradients`
already spans every worker.
"""

from __future__ import annotations

import contextlib
import inspect

import keras
import tensorflow as tf

NEEDED = {"tensorflow": (2, 16), "keras": (3, 10)}
if any(tuple(map(int, m.__version__.split(".")[:2])) < NEEDED[m.__name__] for m in (tf, keras)):
    raise ImportError(f"distgrad.multi_worker needs TensorFlow >= 2.16 and Keras >= 3.10, found "
                      f"TensorFlow {tf.__version__} and Keras {keras.__version__}: "
                      "pip install -U 'tensorflow>=2.16' 'keras>=3.10'")

_SHARDING = tf.data.experimental.AutoShardPolicy
SUPPORTED_SHARDING = (_SHARDING.AUTO, _SHARDING.DATA, _SHARDING.FILE)
_UNEQUAL_BATCHES = (
    "MultiWorkerFit: the replicas got batches of different sizes (a smaller last batch split "
    "unequally, or a worker whose input ran out first and got an empty batch), so each would "
    "weigh its examples differently from one device. Give every worker the same number of full "
    "batches: .batch(..., drop_remainder=True), and as many examples per worker in dataset_fn. "
    "This replica's batch, all replicas':")


def is_multi_worker(strategy) -> bool:
    """True on a `MultiWorkerMirroredStrategy` whose cluster has 2+ workers: exactly when
    Keras' `reduce_per_replica` takes its multi-worker branch (the same test)."""
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


def _batch_dimensions(element_spec) -> set:
    """The leading dimension of every batched `tf.TensorSpec` in `element_spec`."""
    specs = tf.nest.flatten(element_spec, expand_composites=True)
    return {spec.shape[0] for spec in specs
            if isinstance(spec, tf.TensorSpec) and spec.shape.rank}


def check_multi_worker_input(data, num_replicas: int, argument: str = "x") -> None:
    """Raise unless `data` is input that `fit` on MWMS can split into equal batches.

    Accepted: a `tf.data.Dataset` batched with a static global batch size divisible by
    `num_replicas` (`.batch(global_batch_size, drop_remainder=True)`) and sharded by
    TensorFlow (`AutoShardPolicy` AUTO, DATA or FILE); or a distributed dataset
    (`strategy.distribute_datasets_from_function(...)`), whose batch sizes are known
    only at run time (the step checks them). With unequal batches each replica's mean
    loss would weigh its examples differently from one device's mean over the global
    batch.

    Raises:
        TypeError: `data` is neither (arrays, generators, `PyDataset`...).
        ValueError: a batch of unknown (dynamic) size, a global batch not divisible by
            `num_replicas`, or auto-sharding OFF / HINT (every worker would read the
            same examples). Each message names the fix.
    """
    fix = (f"batch a tf.data.Dataset with the global batch size, a multiple of "
           f"{num_replicas} replicas: .batch(global_batch_size, drop_remainder=True)")
    if isinstance(data, tf.distribute.DistributedDataset):
        return  # its element_spec has no static batch size on several workers
    if not isinstance(data, tf.data.Dataset):
        raise TypeError(
            f"MultiWorkerFit: on a multi-worker MultiWorkerMirroredStrategy, `{argument}` must "
            f"be a tf.data.Dataset or a distributed dataset, got {type(data).__name__}. "
            f"Fix: tf.data.Dataset.from_tensor_slices((x, y)), then {fix}; or "
            "strategy.distribute_datasets_from_function(dataset_fn).")
    policy = data.options().experimental_distribute.auto_shard_policy
    if policy not in SUPPORTED_SHARDING:
        raise ValueError(
            f"MultiWorkerFit: `{argument}` has AutoShardPolicy.{policy.name}, so TensorFlow "
            "does not split it between the workers and every worker reads the same "
            "examples. Fix: set options.experimental_distribute.auto_shard_policy = "
            "tf.data.experimental.AutoShardPolicy.DATA (or AUTO, FILE), or shard it "
            "yourself in strategy.distribute_datasets_from_function(dataset_fn).")
    sizes = _batch_dimensions(data.element_spec)
    if None in sizes:
        raise ValueError(
            f"MultiWorkerFit: the batches of `{argument}` have no static size, so a smaller "
            f"last batch would be split unequally between the replicas. Fix: {fix}.")
    if any(size % num_replicas for size in sizes):
        raise ValueError(
            f"MultiWorkerFit: the global batch of `{argument}`, {sorted(sizes)} examples, does "
            f"not split into {num_replicas} equal per-replica batches. Fix: {fix}.")


class MultiWorkerFit:
    """Mixin for `keras.Model`: `fit` and `evaluate` on a multi-worker MWMS.

    Put it first in the bases: `class M(MultiWorkerFit, keras.Model)`, or
    `class M(MultiWorkerFit, MicroBatching, keras.Model)` with distgrad's micro-batching.
    Create and compile the model under `strategy.scope()` on every worker, as usual.

    Args: none of its own; all go to the next class (`keras.Model`).

    State: none. It overrides Keras' `_maybe_symbolic_build` (private: tested against the
    installed Keras), and wraps `train_step`, `test_step`, `fit` and `evaluate`.

    Invariants:
        * Anywhere but on a multi-worker `MultiWorkerMirroredStrategy` (no strategy,
          `MirroredStrategy`, one worker) it is Keras' own `fit`, unchanged.
        * On one: the model is built from this worker's first per-replica batch; every
          step first checks, with one all-reduce of 2 numbers, that all replicas hold
          batches of one size; every value a step returns gets a leading axis of length
          1, which Keras' reduce (`strategy.reduce("MEAN", value, axis=0)`) averages
          over all replicas, so `fit`'s logs and `History` are the same on every
          worker. Gradients and updates are Keras' (the optimizer's all-reduce): each
          step equals one step of one device on the global batch.

    Example:

    ```python
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # TF_CONFIG names the workers
    with strategy.scope():
        model = MultiWorkerFitModel(inputs, outputs)  # MultiWorkerFit + keras.Model
        model.compile(optimizer="adam", loss="mse")
    # A static global batch that splits equally (check_multi_worker_input refuses others):
    model.fit(dataset.batch(GLOBAL_BATCH, drop_remainder=True), epochs=3)
    ```

    Raises (from `fit` / `evaluate` on a multi-worker MWMS):
        TypeError, ValueError: (before anything runs) input that would not be split into
            equal per-replica batches (`check_multi_worker_input`), for `x` and
            `validation_data`; (first step) `jit_compile=True`.
        tf.errors.InvalidArgumentError: (run time, before the step changes anything)
            replicas holding batches of different sizes, e.g. a worker whose input of
            `distribute_datasets_from_function` ran out first.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self.distribute_strategy
        if iterator is not None and self._distribute_strategy is not None \
                and is_multi_worker(strategy):
            # Keras reduces the whole (x, y) structure across workers here, which
            # Strategy.reduce cannot do; building needs only shapes and dtypes. The
            # iterator is last: Keras 3.10 yields (step, it), 3.15 (first, last, it).
            for *_, batches in iterator:
                data_batch = tf.nest.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0], next(batches))
                break
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def train_step(self, data):
        with self._equal_batches(data):
            logs = super().train_step(data)
        return self._reducible(logs)

    def test_step(self, data):
        with self._equal_batches(data):
            logs = super().test_step(data)
        return self._reducible(logs)

    def _equal_batches(self, data):
        """A context in which every op waits for the check that every replica of every
        worker holds a batch of one size (nothing to wait for on other strategies)."""
        context = tf.distribute.get_replica_context()
        if not is_multi_worker(tf.distribute.get_strategy()):
            return contextlib.nullcontext()
        if self.jit_compile:
            raise ValueError(
                "MultiWorkerFit runs with jit_compile=False only (Keras' default under "
                "tf.distribute): its check that all replicas hold equal batches is an "
                "assertion, which XLA compiles out. Compile with jit_compile=False.")
        leaf = next(t for t in tf.nest.flatten(data) if t is not None)
        size = tf.cast(tf.shape(leaf)[0], tf.float32)
        # Sizes n_r are all equal iff R * sum(n_r^2) == sum(n_r)^2; one 2-element all-reduce.
        total, squares = context.all_reduce(tf.distribute.ReduceOp.SUM, [size, size * size])
        replicas = tf.cast(context.num_replicas_in_sync, tf.float32)
        equal = tf.debugging.Assert(tf.equal(total * total, squares * replicas), [
            _UNEQUAL_BATCHES, size, total])
        # Gates every op of the step, the optimizer's (in merge_call) and its counter's too.
        return tf.control_dependencies([equal])

    def _reducible(self, logs):
        if not is_multi_worker(tf.distribute.get_strategy()):
            return logs
        # Keras' reduce_per_replica: strategy.reduce("MEAN", value, axis=0) here.
        return tf.nest.map_structure(lambda v: tf.expand_dims(tf.convert_to_tensor(v), 0), logs)

    def _check_input(self, method, args, kwargs, names):
        strategy = self.distribute_strategy
        if not is_multi_worker(strategy):
            return
        # Keras' own signature: a mixin after this one (MicroBatching) takes (*args, **kwargs).
        bound = inspect.signature(method).bind(self, *args, **kwargs).arguments
        for name in names:
            if bound.get(name) is not None:
                check_multi_worker_input(bound[name], strategy.num_replicas_in_sync, name)

    def fit(self, *args, **kwargs):
        self._check_input(keras.Model.fit, args, kwargs, ("x", "validation_data"))
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        self._check_input(keras.Model.evaluate, args, kwargs, ("x",))
        return super().evaluate(*args, **kwargs)


@keras.saving.register_keras_serializable(package="distgrad")
class MultiWorkerFitModel(MultiWorkerFit, keras.Model):
    """`keras.Model` whose `fit` works on a multi-worker MWMS; accepts functional
    arguments: `MultiWorkerFitModel(inputs, outputs)` (see `MultiWorkerFit`)."""
