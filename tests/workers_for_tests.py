"""Child targets used only by tests: of the runners themselves (`distgrad_course.lab.child`,
`distgrad_course.lab.local_cluster`, `distgrad_course.lab.tf_keras_runner`) and of what needs a
fresh runtime.
Children find this module through `PYTHONPATH` (see `TESTS_ON_PATH` in the tests);
TensorFlow is imported only where a target needs it, so the other children start in a
fraction of a second."""

import dataclasses
import os
import resource
import time


def sleep_forever(task_index, num_workers, pid_file):
    with open(pid_file, "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(1)


@dataclasses.dataclass(frozen=True)
class Pair:
    name: str
    value: float


def plain_values(**kwargs):
    """Values of every kind `to_json` converts, and the kwargs it was called with."""
    import numpy as np

    return {"kwargs": kwargs, "array": np.arange(3, dtype=np.float32),
            "scalar": np.float64(0.5), "flag": np.bool_(True), "nan": float("nan"),
            "infinities": [float("inf"), float("-inf")], "pair": Pair("a", 1.5),
            "env": os.environ.get("DISTGRAD_TEST_VARIABLE")}


def peak_rss_kib():
    """This process' lifetime peak RSS (`ru_maxrss`, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def numpy_global_draw():
    """A draw from NumPy's global generator, which a new process seeds from the OS."""
    import numpy as np

    return float(np.random.random())


def raise_marker(marker, replicas=None):
    raise ValueError(marker)


def exit_without_result(code=0, replicas=None):
    os._exit(code)


def sleep_for(seconds=60, replicas=None):
    time.sleep(seconds)


def tf_keras_probe(replicas):
    """Under tf-keras: what the child's `tf.keras` and strategy are."""
    from distgrad_course.lab.tf_keras_runner import tf_keras_strategy

    strategy = tf_keras_strategy(replicas)
    import numpy as np
    import tensorflow as tf

    optimizer = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.legacy.SGD(0.1))
    return {"env": os.environ.get("TF_USE_LEGACY_KERAS"),
            "model_module": tf.keras.Model.__module__,
            "lso_class": type(optimizer).__name__,
            "initial_scale": optimizer.loss_scale,
            "in_sync": strategy.num_replicas_in_sync,
            "not_a_number": float("nan"),
            "numpy_values": np.arange(3, dtype=np.float32)}


def strategy_after_runtime_init():
    """`make_strategy(2)` after TensorFlow's runtime started with one CPU device."""
    import tensorflow as tf

    tf.constant(1.0) + 1.0  # initializes the runtime with one CPU device
    from distgrad_course.devices import make_strategy

    make_strategy(2)


def replicas_in_sync():
    """`make_strategy()`'s replica count (it reads DISTGRAD_REPLICAS)."""
    from distgrad_course.devices import make_strategy

    return make_strategy().num_replicas_in_sync


# ------------------------------------------------ model.fit on a 2-worker MWMS cluster

FIT_EXAMPLES, FIT_GLOBAL_BATCH = 32, 16


def _fit_dataset(strategy, data: str, global_batch: int):
    """The input of one `fit` (see `fit_on_mwms`): NumPy arrays, a tf.data.Dataset of
    global batches (auto-sharding DATA or OFF; "ragged": no drop_remainder) or
    `distribute_datasets_from_function`'s dataset ("function", "uneven_function")."""
    import tensorflow as tf

    from distgrad_course.lab.data import regression_data

    x, y = regression_data(FIT_EXAMPLES)
    if data == "arrays":
        return (x, y)
    if data in ("function", "uneven_function"):
        def dataset_fn(context):
            shard = (tf.data.Dataset.from_tensor_slices((x, y))
                     .shard(context.num_input_pipelines, context.input_pipeline_id))
            if data == "uneven_function" and context.input_pipeline_id:
                shard = shard.take(1)  # this worker's input runs out after one example
            return shard.batch(context.get_per_replica_batch_size(global_batch),
                               drop_remainder=True)
        return strategy.distribute_datasets_from_function(dataset_fn)
    policy, drop = {"DATA": ("DATA", True), "OFF": ("OFF", True),
                    "ragged": ("DATA", False)}[data]
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy)
    return (tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=drop)
            .with_options(options))


def fit_on_mwms(task_index, num_workers, runs, checkpoint_dir=None, collective_timeout=60.0):
    """Train one fresh tiny model per entry of `runs` with `model.fit` on this worker.

    An entry: `model` "stock" (`keras.Sequential`), "fixed" (`MultiWorkerFitModel`),
    "build_fix_only" (`MultiWorkerFit` without its log reshaping); `accumulation` "none",
    "optimizer" (`AccumulatingOptimizer`, k=2: global micro-batches of 8) or
    "micro_batching" (k=2 inside each step of 16); `optimizer` a name of
    `distgrad_course.lab.compare.OPTIMIZERS`; `data` "DATA", "function", "OFF", "ragged",
    "arrays" or "uneven_function" (worker 1 has no full batch); `jit_compile`;
    `validate` also passes the data as `validation_data`; `checkpoint` adds a
    ModelCheckpoint, into `checkpoint_dir` on the chief and a throwaway directory on the
    others. Returns per run the weights, `iterations` and the error (type, message) or
    the history and (chief) the checkpoint path; plus the first example each
    worker reads under auto-sharding DATA and OFF.
    """
    import tempfile

    from distgrad_course.lab.local_cluster import make_worker_strategy

    strategy = make_worker_strategy(collective_timeout)
    import keras
    import tensorflow as tf

    from distgrad.multi_worker import MultiWorkerFit, MultiWorkerFitModel
    from distgrad.optimizer import AccumulatingOptimizer
    from distgrad.train_step import MicroBatching
    from distgrad_course.lab.compare import OPTIMIZERS
    from distgrad_course.lab.data import tiny_model

    class MicroBatchingOnWorkers(MultiWorkerFit, MicroBatching, keras.Model):
        pass

    class BuildFixOnly(MultiWorkerFit, keras.Model):
        def _reducible(self, logs):
            return logs

    def one(model="fixed", accumulation="none", optimizer="adam", data="DATA",
            validate=False, checkpoint=False, jit_compile=False):
        accumulating = accumulation == "optimizer"
        global_batch = FIT_GLOBAL_BATCH // 2 if accumulating else FIT_GLOBAL_BATCH
        inputs = _fit_dataset(strategy, data, global_batch)
        with strategy.scope():
            layers = tiny_model()
            if model == "stock":
                net = layers
            elif accumulation == "micro_batching":
                net = MicroBatchingOnWorkers(layers.inputs, layers.outputs, accumulation_steps=2)
            else:
                net = (BuildFixOnly if model == "build_fix_only" else MultiWorkerFitModel)(
                    layers.inputs, layers.outputs)
            opt = OPTIMIZERS[optimizer]()
            net.compile(optimizer=AccumulatingOptimizer(opt, 2) if accumulating else opt,
                        loss="mse", jit_compile=jit_compile)
        callbacks, saved = [], None
        if checkpoint:
            target = checkpoint_dir if task_index == 0 else tempfile.mkdtemp()
            saved = f"{target}/weights.weights.h5"
            callbacks.append(keras.callbacks.ModelCheckpoint(saved, save_weights_only=True))
        arrays = data == "arrays"
        try:
            history = net.fit(*(inputs if arrays else (inputs,)), verbose=0,
                              batch_size=global_batch if arrays else None, shuffle=False,
                              validation_data=inputs if validate else None, callbacks=callbacks)
        except (TypeError, ValueError, tf.errors.InvalidArgumentError) as err:
            return {"error": {"type": type(err).__name__, "message": str(err)},
                    "iterations": int(opt.iterations.numpy()),
                    "weights": [w.numpy() for w in net.weights]}
        return {"error": None, "weights": [w.numpy() for w in net.weights],
                "history": history.history, "iterations": int(opt.iterations.numpy()),
                "checkpoint": saved if task_index == 0 else None}

    def first_example(policy):
        batches = iter(strategy.experimental_distribute_dataset(
            _fit_dataset(strategy, policy, FIT_GLOBAL_BATCH)))
        x, _ = next(batches)
        return strategy.experimental_local_results(x)[0][0].numpy()

    return {"runs": [one(**run) for run in runs],
            "first_example": {policy: first_example(policy) for policy in ("DATA", "OFF")},
            "replicas": strategy.num_replicas_in_sync}
