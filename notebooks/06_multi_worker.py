# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · Accumulating gradients on several workers
#
# **The question** (none of the [four questions](../questions.md) asks it; it is
# [Q2](../questions.md#q2) on more machines): *my loop accumulates gradients under
# `MirroredStrategy`. On several machines, with `MultiWorkerMirroredStrategy`, does the
# same loop still equal one big-batch step, and does `model.fit`?*
#
# **The short answer.** Yes, with lesson 02's loop. A *worker* is one process, usually one
# per machine; it reads the cluster and its index from the `TF_CONFIG` environment
# variable, and creates the strategy before any other TensorFlow work. The micro-steps run
# in *replica context* (the function `strategy.run` calls once per replica, each device of
# each worker, on that replica's data): each replica adds its gradients to buffers of its
# own, with no communication. Once per update, `apply_gradients` sums them over every
# replica of every worker, one all-reduce across the processes. Stock Keras 3 `model.fit`
# fails on several workers; `distgrad.MultiWorkerFit` makes it train.

# %%
import distgrad
import distgrad_course

strategy = distgrad_course.make_strategy(1)  # this process only starts the workers and checks them

import os
import tempfile

import tensorflow as tf

from distgrad_course.lab import workers
from distgrad_course.lab.compare import check_close
from distgrad_course.lab.display import show_code, show_environment, show_table
from distgrad_course.lab.local_cluster import run_workers

tf.get_logger().setLevel("ERROR")  # section 1 creates a second strategy here, on purpose
show_environment(distgrad_course.environment_report(strategy))
WORKERS = 2

# %% [markdown]
# ## 1 · The fix
#
# The program every worker runs: save it as `worker.py` and start it on each machine with
# the same cluster and its own index (worker 0 is the *chief*):
#
# ```bash
# export TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]},
#                    "task": {"type": "worker", "index": 0}}'   # index 1 on host1
# python worker.py
# ```
#
# Without `TF_CONFIG` it is a cluster of one worker: so it runs below, in this notebook.

# %% tags=["fix"]
# worker.py: a worker of a MultiWorkerMirroredStrategy cluster (without TF_CONFIG: a cluster
# of one), accumulating gradients. It trains on its own devices: all its GPUs, else its CPU
# as one device (the two logical CPUs of the other lessons are for MirroredStrategy).
import keras
import numpy as np
import tensorflow as tf

tf.config.experimental.enable_tensor_float_32_execution(False)  # exact float32 for the check
# The program's first TensorFlow work: reads TF_CONFIG, starts this worker's server.
strategy = tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=60))  # a dead peer fails the all-reduce instead of hanging it

MICRO, K, EPOCHS = 8, 4, 2  # MICRO: a micro-batch of all workers together; K per update
rng = np.random.default_rng(0)
x = rng.normal(size=(80, 4)).astype("float32")  # 10 micro-batches an epoch:
y = rng.normal(size=(80, 2)).astype("float32")  # 2 updates of K = 4, and 2 left over
options = tf.data.Options()  # DATA: each worker takes its part of every micro-batch
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = (tf.data.Dataset.from_tensor_slices((x, y)).with_options(options)
           .batch(MICRO, drop_remainder=True))  # a partial last micro-batch is dropped
dist_dataset = strategy.experimental_distribute_dataset(dataset)

def make_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(2)])

keras.utils.set_random_seed(0)
with strategy.scope():  # mirrored variables: one copy per replica of every worker
    model, optimizer = make_model(), keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    buffers = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,  # replica-local sums
                           synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=tf.VariableAggregation.SUM)
               for v in model.trainable_variables]

@tf.function
def accumulate(batch):  # replica context: each replica adds to its own buffers, no messages
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(keras.losses.mean_squared_error(y, model(x, training=True)))
        for buffer, gradient in zip(buffers, tape.gradient(loss, model.trainable_variables)):
            buffer.assign_add(gradient)  # the gradient of a sum: apply() divides
    strategy.run(step, args=batch)

@tf.function
def apply(examples):  # the update's one sync: apply_gradients' SUM over all workers' replicas
    def step():
        mean = [buffer.read_value() / examples for buffer in buffers]
        optimizer.apply_gradients(zip(mean, model.trainable_variables))
        for buffer in buffers:
            buffer.assign(tf.zeros_like(buffer))
    strategy.run(step)

for _epoch in range(EPOCHS):
    for step, batch in enumerate(dist_dataset, start=1):
        accumulate(batch)
        if step % K == 0:
            apply(tf.constant(K * MICRO, tf.float32))
    if step % K:  # the epoch's leftover micro-batches (here 2): one smaller update,
        apply(tf.constant(step % K * MICRO, tf.float32))  # the mean of their examples

# %% tags=["check"]
# One device, no strategy: fit takes one big-batch step per update (K * MICRO examples; the
# leftover micro-batches are its smaller last batch). The same seed: the same initial weights.
keras.utils.set_random_seed(0)
one_device = make_model()
one_device.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
one_device.fit(x, y, batch_size=K * MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
for got, want in zip(model.get_weights(), one_device.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
print(f"{int(optimizer.iterations.numpy())} updates on {strategy.num_replicas_in_sync} replica(s):"
      " equal to one device, big batches")

# %% [markdown]
# ### The same file on two workers
#
# The fix cell, exactly as it ran, written to a file and started on two worker processes
# of this machine: `run_workers` gives each its `TF_CONFIG` (two free ports on localhost),
# runs the file in each (`distgrad_course.lab.workers.run_script`, below) and returns the weights.

# %%
# The run above had no TF_CONFIG: a cluster of one worker, this process.
assert "TF_CONFIG" not in os.environ and not strategy.cluster_resolver.cluster_spec().as_dict()
path = os.path.join(tempfile.mkdtemp(prefix="distgrad-worker-"), "worker.py")
with open(path, "w") as file:  # the fix cell as it ran: IPython keeps each cell run in `In`
    file.write(next(cell for cell in reversed(In) if cell.startswith("# worker.py")))  # noqa: F821
runs = run_workers("distgrad_course.lab.workers:run_script", WORKERS, timeout=240, path=path)
assert all(r.ok for r in runs), [r.stderr_tail for r in runs]
diffs = [check_close(r.value["weights"], one_device.get_weights()).max_abs for r in runs]
show_table(["worker", "task", "replicas", "updates", "max abs diff vs 1 device"],
           [(i, "/".join(map(str, r.value["task"])), r.value["replicas"], r.value["updates"],
             f"{d:.1e}") for i, (r, d) in enumerate(zip(runs, diffs))])
for index, r in enumerate(runs):
    assert r.value["task"] == ["worker", index] and r.value["updates"] == 6
    assert r.value["replicas"] == WORKERS * len(r.value["local_devices"])

# %%
show_code(workers.run_script)

# %% [markdown]
# ## 2 · Why it works
#
# ```mermaid
# flowchart LR
#     w0["worker 0, the chief<br/>its part of each micro-batch<br/>gradients += its own buffers"]
#     w1["worker 1<br/>its part of each micro-batch<br/>gradients += its own buffers"]
#     w0 <-- "once per update: apply_gradients<br/>CollectiveReduceV2 SUM over gRPC" --> w1
# ```
#
# * **The strategy comes first**: it configures the collective ops, which TensorFlow allows
#   only before its runtime starts ([deep dive](#deep-dive-tf_config-and-a-strategy-created-too-late)).
# * **Each worker feeds its part** (sharded by `DATA`) of each micro-batch.
# * **The buffers are replica-local** (`ON_READ`), and hold gradients of *sums*: divided
#   by the update's examples, their sum over replicas and micro-steps is the big batch's
#   mean gradient, also for the smaller last update.
# * **One gradient sync per update**, in `apply_gradients` (the fix above has no other).
#   distgrad's two accumulators add one all-reduce of a single float per update on several
#   workers: they check that every replica's gradients are finite before applying, and a
#   worker sees only its own replicas' flags; summed over workers, every worker decides
#   alike (the [Recipes](../recipes.md#keras3-mixed-workers) test overflows one worker's
#   micro-batch: both skip it).
#   Counted in their traced functions (`AccumulatingOptimizer`'s all-reduces sit in the
#   branch of its micro-step that updates, run once every k):

# %%
rows = []
for recipe in ("GradientAccumulator", "AccumulatingOptimizer"):
    runs = run_workers("distgrad_course.lab.workers:accumulated_equivalence", WORKERS, timeout=240,
                       recipe="accumulator" if recipe == "GradientAccumulator" else "optimizer",
                       optimizer="adam", accumulation_steps=2, updates=2)
    for index, r in enumerate(runs):
        assert r.ok, r.stderr_tail
        v = r.value
        counts = (v["all_reduce_ops_per_micro_step_function"],
                  v["all_reduce_ops_per_apply_function"])
        rows.append((recipe, index, v["iterations"], *counts,
                     f"{v['max_abs_diff_vs_one_device']:.1e}"))
        assert v["iterations"] == 2 and v["max_abs_diff_vs_one_device"] <= 1e-6
        # the gradients' all-reduce and the finiteness flags' (one float), once per update
        assert counts == ((0, 2) if recipe == "GradientAccumulator" else (2, 0))
show_table(["class", "worker", "updates", "all-reduces: micro-step function",
            "apply function", "max abs diff vs 1 device"], rows)

# %% [markdown]
# ## 3 · The packaged form
#
# `distgrad.GradientAccumulator` is the loop above (lesson 02); with `model.fit`,
# `distgrad.AccumulatingOptimizer` (lesson 03) or `distgrad.MicroBatching` (lesson 05).
# Stock Keras 3 `fit` fails on several workers before its first step
# ([keras-team/keras#20585](https://github.com/keras-team/keras/issues/20585), deep dive
# below): use a `distgrad.MultiWorkerFit` model (`MultiWorkerFitModel` if functional) on a
# dataset of global batches (`drop_remainder=True`) sharded by `DATA`.

# %% [markdown]
# ### Deep dive · The `fit` worker, written out
#
# A worker is a process, which imports its program: this cell writes it into a module in a
# temporary directory (`%%writefile`), and `run_workers(..., env={"PYTHONPATH": ...})`
# starts two workers on it. One run trains four models in turn: stock Keras 3 first, then
# three with distgrad's fix.

# %%
import sys

fit_dir = tempfile.mkdtemp(prefix="distgrad-fit-")
sys.path.insert(0, fit_dir)  # this process imports the worker's module to check it
worker_env = {"PYTHONPATH": os.pathsep.join(filter(None, [fit_dir, os.environ.get("PYTHONPATH")]))}

# %%
# %%writefile {fit_dir}/fit_worker.py
"""Lesson 06's fit worker: `model.fit` on MultiWorkerMirroredStrategy, one model per variant."""

GLOBAL_BATCH = 16  # examples per update, all workers together


def fit_on_worker(task_index, num_workers, variants, checkpoint_dir):
    import tempfile
    import traceback

    import tensorflow as tf

    # First, before other TensorFlow work: reads TF_CONFIG, starts this worker's server.
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=60))  # a lost peer fails the all-reduce instead of hanging
    tf.config.experimental.enable_tensor_float_32_execution(False)  # exact float32 on GPUs

    import keras

    from distgrad import AccumulatingOptimizer, MicroBatching, MultiWorkerFit, MultiWorkerFitModel
    from distgrad_course.lab.data import regression_data, tiny_model

    keras.config.disable_traceback_filtering()  # keep Keras' own frames in tracebacks

    class MultiWorkerMicroBatching(MultiWorkerFit, MicroBatching, keras.Model):
        """`fit` on several workers, k micro-batches inside each step."""

    def dataset(batch_size):  # global batches; DATA: each worker gets its part of each
        x, y = regression_data(2 * GLOBAL_BATCH)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA)
        return (tf.data.Dataset.from_tensor_slices((x, y))
                .batch(batch_size, drop_remainder=True).with_options(options))

    resolver = strategy.cluster_resolver
    results = {"task": [resolver.task_type, resolver.task_id]}
    for index, variant in enumerate(variants):
        with strategy.scope():  # mirrored variables: one copy per replica of every worker
            layers, optimizer = tiny_model(), keras.optimizers.Adam(0.01)
            batch_size = GLOBAL_BATCH
            if variant == "keras.Model":  # stock Keras 3
                model = keras.Model(layers.inputs, layers.outputs)
            elif "MicroBatching" in variant:  # k = 2 micro-batches inside each step
                model = MultiWorkerMicroBatching(layers.inputs, layers.outputs,
                                                 accumulation_steps=2)
            else:
                model = MultiWorkerFitModel(layers.inputs, layers.outputs)
            if "AccumulatingOptimizer" in variant:  # k = 2 steps of half a batch
                optimizer = AccumulatingOptimizer(optimizer, accumulation_steps=2)
                batch_size = GLOBAL_BATCH // 2
            model.compile(optimizer=optimizer, loss="mse")
        # Every worker saves (the same callbacks everywhere); only the chief (task 0)
        # writes into checkpoint_dir, the others into a throwaway directory.
        directory = checkpoint_dir if task_index == 0 else tempfile.mkdtemp()
        path = f"{directory}/model{index}.weights.h5"
        try:
            history = model.fit(dataset(batch_size), epochs=1, verbose=0, callbacks=[
                keras.callbacks.ModelCheckpoint(path, save_weights_only=True)])
        except ValueError as err:
            frames = traceback.extract_tb(err.__traceback__)
            results[variant] = {"error": {"type": type(err).__name__, "message": str(err)},
                                "where": [(f.filename, f.name) for f in frames]}
            continue
        results[variant] = {"loss": history.history["loss"],
                            "updates": int(optimizer.iterations.numpy()),
                            "weights": [w.numpy() for w in model.weights],
                            "checkpoint": path if task_index == 0 else None}
    return results

# %%
variants = ["keras.Model", "MultiWorkerFitModel", "MultiWorkerFitModel + AccumulatingOptimizer",
            "MultiWorkerFit + MicroBatching"]
checkpoint_dir = tempfile.mkdtemp(prefix="distgrad-fit-chief-")
results = run_workers("fit_worker:fit_on_worker", WORKERS, timeout=300, env=worker_env,
                      variants=variants, checkpoint_dir=checkpoint_dir)
for index, r in enumerate(results):
    assert r.ok, r.stderr_tail
    assert r.value["task"] == ["worker", index]  # each read its own TF_CONFIG

# %% [markdown]
# Each of the three fixed models against Keras' own `fit` on one device, batches of 16:

# %%
import fit_worker  # the module written above
import keras

from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.recipes import fit_run

x_fit, y_fit = regression_data(2 * fit_worker.GLOBAL_BATCH)
fit_reference = fit_run(None, lambda: keras.optimizers.Adam(0.01), x_fit, y_fit,
                        batch_size=fit_worker.GLOBAL_BATCH)
fixed, fit_rows = variants[1:], []
for variant in fixed:
    runs = [r.value[variant] for r in results]
    for index, run in enumerate(runs):
        diff = check_close(run["weights"], fit_reference.final)
        fit_rows.append((variant, index, run["updates"], f"{diff.max_abs:.1e}"))
        assert run["updates"] == fit_reference.updates == 2
    assert runs[0]["weights"] == runs[1]["weights"] and runs[0]["loss"] == runs[1]["loss"]

# %% [markdown]
# ### Two workers with `MultiWorkerFit` equal one device
#
# Plain, with `AccumulatingOptimizer` (2 steps of 8 per update) and with `MicroBatching`
# (2 micro-batches in each step of 16), against Keras' `fit` on one device (the deep dive
# above compares them):

# %%
show_table(["model", "worker", "updates", "max abs diff vs 1 device"], fit_rows)

# %% [markdown]
# <div class="admonition warning">
# <p class="admonition-title">Limits</p>
#
# * **BatchNorm statistics**: each replica normalizes by its own slice ([lesson 07](07_beyond_the_basics.ipynb#deep-dive-batchnorm-statistics-are-per-forward-pass)).
# * **Dropout's randomness**: other micro-batches draw other masks
#   ([lesson 07](07_beyond_the_basics.ipynb#deep-dive-dropout-draws-other-masks-for-other-micro-batches)).
# * **A partial last batch**: the fix drops it; `MultiWorkerFit` refuses a dataset without
#   `drop_remainder=True` (exercise 3; [pitfalls](../pitfalls.md#last-batch-scaling)).
# * **`steps_per_execution > 1`** in `compile` fails under a multi-replica strategy
#   ([upstream](../upstream.md#steps-per-execution)), and so does **XLA** (`jit_compile`
#   set to `True`) on replicas that are not all GPUs
#   ([keras-team/keras#19005](https://github.com/keras-team/keras/issues/19005)).
#
# </div>

# %% [markdown]
# ## Deep dive · Stock Keras 3 `fit` fails before the first step
#
# The first model of section 3's run, plain `keras.Model` and `Adam`, on both workers:

# %%
for r in results:
    error = r.value["keras.Model"]["error"]
    assert error["type"] == "ValueError"
    assert error["message"].startswith("Attempt to convert a value (PerReplica:{")
    assert error["message"].rstrip().endswith(
        "with an unsupported type (<class 'tensorflow.python.distribute.values.PerReplica'>)"
        " to a Tensor.")
print(f"{error['type']}: {error['message'].splitlines()[0]} ... "
      f"\n    ... with an unsupported type (<class '...PerReplica'>) to a Tensor.")
assert "model0.weights.h5" not in os.listdir(checkpoint_dir)  # nothing trained or saved

# %% [markdown]
# `fit` never reached its first step. The frames between `fit` and the error, from
# the installed source:

# %%
where = results[0].value["keras.Model"]["where"]
names = [name for _, name in where]
first, last = names.index("_maybe_symbolic_build"), names.index("_make_tensor_into_per_replica")
show_table(["function", "file"], [(name, path.split("site-packages/")[-1])
                                  for path, name in where[first - 1:last + 1] + where[-1:]])
assert names[first - 1] == "fit" and "_reduce_to" in names[first:last]

# %% [markdown]
# <div class="admonition bug">
# <p class="admonition-title">Cause</p>
#
# `TensorFlowTrainer.fit` first builds the model from one batch. In
# `_maybe_symbolic_build` (`keras/src/backend/tensorflow/trainer.py`), when that batch is
# distributed, Keras calls `strategy.reduce("MEAN", batch, axis=None)` on the whole
# `(x, y)` structure, only to learn its shapes (checked below in the installed source).
# On two workers `CollectiveAllReduceExtended._reduce_to` sends that structure to the
# collective all-reduce, whose `_make_tensor_into_per_replica`
# (`tensorflow/python/distribute/cross_device_ops.py`) calls `convert_to_tensor` on a
# tuple of `PerReplica` values: the error above. This is
# [keras-team/keras#20585](https://github.com/keras-team/keras/issues/20585), with
# TensorFlow's own tutorial.
#
# Past the build waits a second failure. `reduce_per_replica`, which reduces what each
# step returns, has a branch for a multi-worker MWMS: `strategy.reduce("MEAN", value,
# axis=0)`, and a loss is a scalar, with no axis 0.
#
# </div>

# %%
import inspect
import textwrap

from IPython.display import Code
from keras.src.backend.tensorflow import trainer as keras_trainer

build_source = inspect.getsource(keras_trainer.TensorFlowTrainer._maybe_symbolic_build)
reduce_mean = 'data_batch = self.distribute_strategy.reduce(\n                        "MEAN",'
assert reduce_mean in build_source
reduce_source = inspect.getsource(keras_trainer.reduce_per_replica)
start = reduce_source.rindex("\n", 0, reduce_source.index("if _collective_all_reduce_multi"))
branch = textwrap.dedent("\n".join(reduce_source[start + 1:].splitlines()[:7]))
assert branch.endswith('return strategy.reduce("MEAN", v, axis=0)')
Code("# keras/src/backend/tensorflow/trainer.py, reduce_per_replica._reduce\n" + branch,
     language="python")

# %% [markdown]
# `Strategy.reduce` is one method for every strategy (`StrategyBase.reduce`), so the same
# call fails in this notebook, on the default strategy:

# %%
default_strategy = tf.distribute.get_strategy()
assert type(default_strategy).reduce is tf.distribute.MultiWorkerMirroredStrategy.reduce
try:
    default_strategy.reduce("MEAN", tf.constant(2.5), axis=0)  # a scalar, like Keras' loss
    raise AssertionError("a scalar was reduced along axis 0")
except ValueError as err:
    print(textwrap.shorten(str(err).strip().splitlines()[-1], 96))
    assert "Invalid reduction dimension 0 for input with 0 dimensions" in str(err)
# With a leading axis of length 1 the same call is the mean over the replicas:
assert float(default_strategy.reduce("MEAN", tf.constant([2.5]), axis=0)) == 2.5

# %% [markdown]
# That is tensorflow/tensorflow#72388's error (*Invalid reduction dimension 0 for input
# with 0 dimensions*). The [upstream page](../upstream.md#multi-worker-fit) has a stock
# reproduction of the first failure.
#
# <div class="admonition success">
# <p class="admonition-title">Fix</p>
#
# `distgrad.MultiWorkerFit`, in `distgrad/multi_worker.py`, a file that imports only
# TensorFlow and Keras. Its two repairs, as they are in that file: build from this
# worker's first per-replica batch (shapes are all the build needs: no communication),
# and give every value a step returns a leading axis of length 1, so Keras' `axis=0`
# reduce is the mean over all replicas.
#
# </div>

# %%
show_code(distgrad.MultiWorkerFit._maybe_symbolic_build)

# %%
show_code(distgrad.MultiWorkerFit._reducible)

# %% [markdown]
# ## Deep dive · `TF_CONFIG`, and a strategy created too late
#
# `TF_CONFIG` is JSON: the `cluster` (every worker's address, the same list for all) and
# this process' `task` (its type and index). For two workers on this machine, on two free
# ports:

# %%
import json

from distgrad_course.lab.local_cluster import free_ports, tf_config, visible_gpus, worker_devices

ports = free_ports(WORKERS)
configs = [{"cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
            "task": {"type": "worker", "index": index}} for index in range(WORKERS)]
# What run_workers puts into each worker's environment:
assert [json.loads(tf_config(ports, index)) for index in range(WORKERS)] == configs
Code("\n".join(f"# worker {index}\n"
               f"TF_CONFIG='{{\"cluster\": {json.dumps(config['cluster'])},\n"
               f"           \"task\": {json.dumps(config['task'])}}}'"
               for index, config in enumerate(configs)), language="bash")

# %% [markdown]
# `run_workers` sets this variable in each worker's environment, and the worker's
# `CUDA_VISIBLE_DEVICES`: the workers share one machine, and no two may share a GPU, so
# with a GPU per worker each sees its own, and otherwise each sees the CPU only
# (`worker_devices`). A worker that runs one eager op before creating the strategy gets:

# %%
(late,) = run_workers("distgrad_course.lab.workers:strategy_after_runtime_start", 1, timeout=120)
print(late.value["error"])
assert late.value["error"] == {"type": "RuntimeError",
                               "message": "Collective ops must be configured at program startup"}

# %% [markdown]
# Without `TF_CONFIG` the strategy has no cluster to configure, and TensorFlow only logs a
# warning when the runtime has started (`_initialize_local` in
# `tensorflow/python/distribute/collective_all_reduce_strategy.py`): that is why section 1
# could run the fix in this notebook's process.
#
# `distgrad_course.lab.workers.train_on_worker`, the replica step of lesson 01 with no
# accumulation, reports what each worker read and traced: its `TF_CONFIG`, the strategy's
# view of it, the collective ops of one step. Its input comes from
# `distribute_datasets_from_function`, which calls `dataset_fn` once per worker with an
# `InputContext` (which input pipeline this is, how many there are, the per-replica batch
# size): the other way to give each worker its shard. Three Adam steps:

# %%
from distgrad_course.lab.compare import OPTIMIZERS
from distgrad_course.lab.recipes import big_batch_reference

show_code(workers.train_on_worker)

# %%
results_tow = run_workers("distgrad_course.lab.workers:train_on_worker", WORKERS, timeout=240,
                          optimizer="adam", steps=3)
for r in results_tow:
    assert r.ok, r.stderr_tail
x16, y16 = regression_data(workers.GLOBAL_BATCH)
reference = big_batch_reference(OPTIMIZERS["adam"], x16, y16, steps=3)
diffs = [check_close(r.value["weights"], reference) for r in results_tow]
show_table(["worker", "task (strategy)", "replicas", "local devices", "collectives per step",
            "updates", "max abs diff vs 1 device", "seconds"],
           [(index, "/".join(map(str, r.value["task"])), r.value["replicas"],
             ", ".join(d.rsplit("/", 1)[-1] for d in r.value["local_devices"]),
             r.value["collective_op_types"], r.value["iterations"], f"{diff.max_abs:.1e}",
             f"{r.seconds:.1f}")
            for index, (r, diff) in enumerate(zip(results_tow, diffs))])
for index, r in enumerate(results_tow):
    v = r.value
    assert v["tf_config"]["task"] == {"type": "worker", "index": index}
    assert v["tf_config"]["cluster"] == results_tow[0].value["tf_config"]["cluster"]
    assert len(v["tf_config"]["cluster"]["worker"]) == WORKERS
    assert v["task"] == ["worker", index]  # the strategy's view of TF_CONFIG
    assert v["replicas"] == WORKERS * len(v["local_devices"])
    own_gpus = worker_devices(index, WORKERS, visible_gpus())["CUDA_VISIBLE_DEVICES"]
    assert all(f"device:{'GPU' if own_gpus else 'CPU'}:" in d for d in v["local_devices"])
    assert v["collective_op_types"] == {"CollectiveReduceV2": 1}  # one all-reduce per step
    assert v["iterations"] == 3

# %% [markdown]
# The sync point is the one of lesson 01, the optimizer's SUM all-reduce, here a
# `CollectiveReduceV2` that crosses process boundaries. MWMS shares its `merge_call`
# machinery with `MirroredStrategy`, and on these workers it reports no "no-merge-call"
# support (`strategy_supports_no_merge_call()`), so a sync point inside a replica-context
# `tf.cond` fails here exactly as [lesson 03](03_cond_and_merge_call.ipynb) shows for both
# strategies:

# %%
assert all(r.value["supports_no_merge_call"] is False for r in results_tow)

# %% [markdown]
# ## Deep dive · Checkpoints come from the chief
#
# Saving is collective (every worker must call it), but only the chief (task 0) should
# write to the real checkpoint directory; the others write to throwaway directories.
# This notebook's process then restores the chief's checkpoint into a fresh model on one
# device: it holds exactly the one-device weights.

# %%
chief_dir = tempfile.mkdtemp(prefix="distgrad-chief-")
chief, other = run_workers("distgrad_course.lab.workers:checkpoint_from_chief", WORKERS, timeout=240,
                           directory=chief_dir, steps=2)
assert chief.ok and other.ok and chief.value["is_chief"] and other.value["path"] is None
assert chief.value["path"].startswith(os.path.join(chief_dir, "ckpt"))
assert any(name.startswith("ckpt") for name in os.listdir(chief_dir))
restored, restored_optimizer = tiny_model(), keras.optimizers.SGD(0.1)
restored_optimizer.build(restored.trainable_variables)
tf.train.Checkpoint(model=restored, optimizer=restored_optimizer).restore(
    chief.value["path"]).assert_consumed()
from distgrad_course.lab.compare import weights_of

restored_diff = check_close(weights_of(restored), big_batch_reference(
    lambda: keras.optimizers.SGD(0.1), x16, y16, steps=2))
print(f"chief's checkpoint, restored on one device: updates "
      f"{int(restored_optimizer.iterations.numpy())}, max abs diff vs 1 device "
      f"{restored_diff.max_abs:.1e}")
assert int(restored_optimizer.iterations.numpy()) == 2

# %% [markdown]
# `fit` saves the same way: in section 3's run every worker ran the same
# `ModelCheckpoint`, but only the chief's path is `checkpoint_dir`; restored on one device,
# the chief's file holds the one-device weights:

# %%
chief_file = results[0].value["MultiWorkerFitModel"]["checkpoint"]
assert all(r.value[v]["checkpoint"] is None for r in results[1:] for v in fixed)
assert sorted(os.listdir(checkpoint_dir)) == [f"model{i}.weights.h5" for i in (1, 2, 3)]
restored = tiny_model()
restored.load_weights(chief_file)
restored_diff = check_close(weights_of(restored), fit_reference.final)
print(f"chief's {os.path.basename(chief_file)}, restored on one device: max abs diff vs "
      f"1 device {restored_diff.max_abs:.1e}")

# %% [markdown]
# ## Deep dive · When a worker dies
#
# Worker 1 crashes (`os._exit`) after its first step. Worker 0's next all-reduce has no
# peer. Without a bound it could wait forever; `make_worker_strategy(timeout_seconds=...)`
# passes `tf.distribute.experimental.CommunicationOptions(timeout_seconds=...)`, as the fix
# does, so the collective fails within that time (the lost connection may be noticed even
# sooner).

# %%
survivor, dead = run_workers("distgrad_course.lab.workers:dead_worker", WORKERS, timeout=120,
                             collective_timeout=10.0)
reason = [line.strip() for line in survivor.value["error"]["message"].splitlines()
          if line.strip() and not line.strip().startswith(("File", '"'))
          and '.py", line ' not in line]  # the reason, not the traceback
print("dead worker exit code:", dead.returncode)
print(f"survivor: {survivor.value['error']['type']} after {survivor.value['seconds']:.2f} s")
print("\n".join(textwrap.shorten(line, 96) for line in reason[:2]))
assert dead.returncode == 3 and not dead.reported and dead.value is None
assert survivor.value["error"]["type"] in {"UnavailableError", "DeadlineExceededError"}
assert survivor.value["seconds"] < 15.0  # bounded: a clear error, never a hang

# %% [markdown]
# ## Takeaways
#
# * A worker's first TensorFlow work is `MultiWorkerMirroredStrategy()`, which reads
#   `TF_CONFIG`; without it, the program is a cluster of one.
# * Lesson 02's loop carries over: replica-local buffers, one all-reduce per update across
#   all workers; leftover micro-batches make one smaller update.
# * `model.fit` on several workers needs `distgrad.MultiWorkerFit`.
# * Only the chief writes the real checkpoint; a collective timeout turns a dead worker
#   into an error.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 1 · Forget the leftover
#
# Delete the last two lines of the fix, the update of the leftover micro-batches. How many
# updates does a worker make now, and does it still equal one device's `fit`? Predict, then
# run it as a cluster of one worker.

# %% [markdown]
# #### Answer
#
# Four updates instead of six (two per epoch), and the weights are no longer `fit`'s, which
# also steps on each epoch's last 16 examples.

# %%
with open(path) as file:
    lines = file.read().splitlines(keepends=True)
assert lines[-2].startswith("    if step % K:  # the epoch's leftover micro-batches")
no_leftover = os.path.join(os.path.dirname(path), "no_leftover.py")
with open(no_leftover, "w") as file:
    file.write("".join(lines[:-2]))  # without the last two lines
(alone,) = run_workers("distgrad_course.lab.workers:run_script", 1, timeout=240, path=no_leftover)
assert alone.ok, alone.stderr_tail
from distgrad_course.lab.compare import check_not_close

missed = check_not_close(alone.value["weights"], one_device.get_weights())
print(f"updates: {alone.value['updates']}; max abs diff vs one device's fit {missed.max_abs:.1e}")
assert alone.value["updates"] == 4

# %% [markdown]
# ### Exercise 2 · Three workers
#
# Start the fix on three workers: `run_workers("distgrad_course.lab.workers:run_script", 3,
# path=path)`. A micro-batch of 8 examples does not split evenly over three replicas. Does
# every worker still equal one device?

# %% [markdown]
# #### Answer
#
# Yes. Nothing in the fix assumes equal parts: each replica sums its per-example losses,
# whatever their number, and `apply` divides the sum of all of them by the update's
# examples.

# %%
three = run_workers("distgrad_course.lab.workers:run_script", 3, timeout=240, path=path)
for r in three:
    assert r.ok, r.stderr_tail
    assert r.value["replicas"] == 3 * len(r.value["local_devices"])
    print(r.value["task"], f"max abs diff vs one device "
          f"{check_close(r.value['weights'], one_device.get_weights()).max_abs:.1e}")

# %% [markdown]
# ### Exercise 3 · Auto-sharding off
#
# In the `fit` worker, give `dataset` the option `AutoShardPolicy.OFF` instead of `DATA`.
# What does `MultiWorkerFit` say, and why would both workers otherwise train on the same
# examples?

# %% [markdown]
# #### Answer
#
# On several workers `MultiWorkerFit.fit` first checks its input with
# `distgrad.check_multi_worker_input` and refuses what would reach the replicas in unequal
# or duplicated parts, naming the fix. With sharding `OFF` TensorFlow does not split the
# dataset between the workers: every worker reads the same examples. It refuses NumPy
# arrays and batches without `drop_remainder=True` too:

# %%
def global_batches(policy="DATA", drop_remainder=True):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy)
    return (tf.data.Dataset.from_tensor_slices(regression_data(32)).batch(
        16, drop_remainder=drop_remainder).with_options(options))


refused = []
for what, data in [("NumPy arrays", regression_data(32)[0]),
                   ("auto-sharding OFF", global_batches("OFF")),
                   ("no drop_remainder", global_batches(drop_remainder=False))]:
    try:
        distgrad.check_multi_worker_input(data, num_replicas=WORKERS)
        raise AssertionError(f"{what} was accepted")
    except (TypeError, ValueError) as err:
        refused.append((what, type(err).__name__, str(err).split(". ")[0].split(": ", 1)[1]))
        assert "Fix:" in str(err)
distgrad.check_multi_worker_input(global_batches(), num_replicas=WORKERS)  # accepted
show_table(["input", "error", "says"], refused)

# %% [markdown]
# ### Exercise 4 · `TF_CONFIG` for three machines
#
# Write the `TF_CONFIG` of the third worker of a cluster on `a:2222`, `b:2222` and
# `c:2222`. What task type and index, and how many workers, will the strategy read?

# %% [markdown]
# #### Answer
#
# The same `cluster` on all three machines, and `"task": {"type": "worker", "index": 2}`.
# TensorFlow's `TFConfigClusterResolver`, which `MultiWorkerMirroredStrategy()` uses, reads
# it from the environment:

# %%
third = {"cluster": {"worker": ["a:2222", "b:2222", "c:2222"]},
         "task": {"type": "worker", "index": 2}}
os.environ["TF_CONFIG"] = json.dumps(third)
try:
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    print(resolver.task_type, resolver.task_id, resolver.cluster_spec().num_tasks("worker"))
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    assert resolver.cluster_spec().num_tasks("worker") == 3
finally:
    del os.environ["TF_CONFIG"]  # this process is no worker

# %% [markdown]
# ## Further reading
#
# * TensorFlow tutorials *Multi-worker training with Keras* and *Custom training loop with
#   MultiWorkerMirroredStrategy*; `tf.distribute.experimental.CommunicationOptions`.
# * keras-team/keras#20585 (`fit` on MWMS in Keras 3, open), tensorflow/tensorflow#72388;
#   the [upstream page](../upstream.md#multi-worker-fit).
# * The [API reference](../api.md): `GradientAccumulator`, `AccumulatingOptimizer`,
#   `MultiWorkerFit`, `check_multi_worker_input`.
