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
# # 06 · The same proofs on `MultiWorkerMirroredStrategy`
#
# When one machine is not enough, `tf.distribute.MultiWorkerMirroredStrategy` (MWMS) runs
# one process per machine (a *worker*); each reads the cluster it belongs to from the
# `TF_CONFIG` environment variable, and the gradients are all-reduced across processes
# with collective ops. Do the proofs of lessons 01–03 still hold? This lesson checks on a
# **real multi-process run**: two worker processes on this machine, each with its own
# `TF_CONFIG`, talking over localhost. And does `model.fit` work there (section 6)?
#
# The worker function is below, written out. Because a worker is a process of its own, it
# lives in a module the workers can import (`distgrad/lab/workers.py`), and the lesson
# shows its source. `distgrad.lab.multiworker.run_workers(target, num_workers)` starts the
# processes (free ports picked at run time), calls `target(task_index, num_workers,
# **options)` in each, collects their results (one `ChildResult` per worker, in task
# order), and kills every process it started when it returns or times out.

# %%
import distgrad

# This notebook's own process only starts workers and checks their results; each
# worker creates its own strategy. The report says where this process runs.
strategy = distgrad.make_strategy(1)

import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402

from IPython.display import Code  # noqa: E402

from distgrad.lab.compare import OPTIMIZERS, check_close, weight_diff, weights_of  # noqa: E402
from distgrad.lab.data import regression_data, tiny_model  # noqa: E402
from distgrad.lab.display import show_code, show_environment, show_table  # noqa: E402
from distgrad.lab.multiworker import (free_ports, run_workers, tf_config, visible_gpus,  # noqa: E402
                                     worker_devices)
from distgrad.lab.recipes import big_batch_reference, fit_run  # noqa: E402
from distgrad.lab import workers  # noqa: E402

show_environment(distgrad.environment_report(strategy))
WORKERS = 2

# %% [markdown]
# ## 1 · One worker, written out
#
# Every worker runs the same function. It is lesson 01's custom loop with three changes:
#
# * **The strategy comes first.** `MultiWorkerMirroredStrategy()` reads `TF_CONFIG` and
#   configures the runtime's collective ops, which TensorFlow allows only before its
#   runtime has started (checked below). A `CommunicationOptions(timeout_seconds=...)`
#   bounds every collective (section 5).
# * **Each worker feeds its own shard.** `distribute_datasets_from_function` calls
#   `dataset_fn` once per worker with an `InputContext`: which input pipeline this is, how
#   many there are, and the per-replica batch size. Together the shards are the global
#   batch that one device would see.
# * **The replica step is unchanged**: loss divided by the *global* batch,
#   `apply_gradients` inside `strategy.run`. Its SUM all-reduce now spans every replica
#   of every worker.

# %%
show_code(workers.train_on_worker)

# %% [markdown]
# The order matters: a worker that runs one eager op before creating the strategy gets

# %%
(late,) = run_workers("distgrad.lab.workers:strategy_after_runtime_start", 1, timeout=120)
print(late.value["error"])
assert late.value["error"] == {"type": "RuntimeError",
                               "message": "Collective ops must be configured at program startup"}

# %% [markdown]
# ### Its `TF_CONFIG`
#
# `TF_CONFIG` is JSON: the `cluster` (every worker's address, the same list for all) and
# this process' `task` (its type and index; worker 0 is the *chief*). For two workers on
# this machine, on two free ports:

# %%
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
# (`worker_devices`). The worker function does not depend on it: `dataset_fn` batches per
# replica, whatever number of replicas a worker has. (On GPUs it turns TF32 off, as
# `make_strategy` does, so that float32 stays comparable at 1e-6.)
#
# ```mermaid
# flowchart LR
#     nb["this notebook<br/>run_workers(train_on_worker, 2)"]
#     subgraph w0["worker 0 · process · the chief"]
#         c0["TF_CONFIG<br/>cluster: 127.0.0.1:p0, 127.0.0.1:p1<br/>task: worker 0"]
#         s0["shard 0 of the global batch<br/>tape · gradients / global batch"]
#     end
#     subgraph w1["worker 1 · process"]
#         c1["TF_CONFIG<br/>same cluster<br/>task: worker 1"]
#         s1["shard 1 of the global batch<br/>tape · gradients / global batch"]
#     end
#     nb -- "starts, with TF_CONFIG" --> w0
#     nb -- "starts, with TF_CONFIG" --> w1
#     s0 <-- "apply_gradients: CollectiveReduceV2 SUM over gRPC" --> s1
#     w0 -. "result JSON" .-> nb
#     w1 -. "result JSON" .-> nb
# ```
#
# ## 2 · Run it: two workers equal one device
#
# Three Adam steps on two workers; each worker returns the `TF_CONFIG` it read, what the
# strategy made of it, the collective ops in its traced step, and its weights, which this
# process compares with one device training on the whole batch.

# %%
results = run_workers("distgrad.lab.workers:train_on_worker", WORKERS, timeout=240,
                      optimizer="adam", steps=3)
for r in results:
    assert r.ok, r.stderr_tail
x, y = regression_data(workers.GLOBAL_BATCH)
reference = big_batch_reference(OPTIMIZERS["adam"], x, y, steps=3)
diffs = [check_close(r.value["weights"], reference) for r in results]
show_table(["worker", "task (strategy)", "replicas", "local devices", "collectives per step",
            "updates", "max abs diff vs 1 device", "seconds"],
           [(index, "/".join(map(str, r.value["task"])), r.value["replicas"],
             ", ".join(d.rsplit("/", 1)[-1] for d in r.value["local_devices"]),
             r.value["collective_op_types"], r.value["iterations"], f"{diff.max_abs:.1e}",
             f"{r.seconds:.1f}")
            for index, (r, diff) in enumerate(zip(results, diffs))])
for index, r in enumerate(results):
    v = r.value
    assert v["tf_config"]["task"] == {"type": "worker", "index": index}
    assert v["tf_config"]["cluster"] == results[0].value["tf_config"]["cluster"]
    assert len(v["tf_config"]["cluster"]["worker"]) == WORKERS
    assert v["task"] == ["worker", index]  # the strategy's view of TF_CONFIG
    assert v["replicas"] == WORKERS * len(v["local_devices"])
    own_gpus = worker_devices(index, WORKERS, visible_gpus())["CUDA_VISIBLE_DEVICES"]
    assert all(f"device:{'GPU' if own_gpus else 'CPU'}:" in d for d in v["local_devices"])
    assert v["collective_op_types"] == {"CollectiveReduceV2": 1}  # one all-reduce per step
    assert v["iterations"] == 3

# %% [markdown]
# The sync point is the one of lesson 01, the optimizer's SUM all-reduce, here a
# `CollectiveReduceV2` that crosses process boundaries. The weights agree with one device
# to float32 precision on both workers.
#
# MWMS shares its `merge_call` machinery with `MirroredStrategy`, and on these workers it
# reports no "no-merge-call" support (`strategy_supports_no_merge_call()`), so a sync
# point inside a replica-context `tf.cond` fails here exactly as
# [lesson 03](03_cond_and_merge_call.ipynb) shows for both strategies:

# %%
assert all(r.value["supports_no_merge_call"] is False for r in results)

# %% [markdown]
# ## 3 · Accumulation on two workers
#
# Lessons 02 and 03 on MWMS: k = 2 micro-batches per update, each worker feeding its
# slice of each micro-batch. `GradientAccumulator` accumulates with no communication and
# all-reduces once in its apply function; `AccumulatingOptimizer`'s only all-reduce sits
# inside its update branch (traced once, run once per k micro-steps). After 2 updates of
# Adam both equal one device on the big batches.

# %%
rows = []
for recipe in ("accumulator", "optimizer"):
    runs = run_workers("distgrad.lab.workers:accumulated_equivalence", WORKERS, timeout=240,
                       recipe=recipe, optimizer="adam", accumulation_steps=2, updates=2)
    for index, r in enumerate(runs):
        assert r.ok, r.stderr_tail
        v = r.value
        rows.append((recipe, index, v["iterations"], v["all_reduce_ops_per_micro_step_function"],
                     v["all_reduce_ops_per_apply_function"], f"{v['max_abs_diff_vs_one_device']:.1e}"))
        assert v["iterations"] == 2 and v["max_abs_diff_vs_one_device"] <= 1e-6
        if recipe == "accumulator":
            assert v["all_reduce_ops_per_micro_step_function"] == 0
            assert v["all_reduce_ops_per_apply_function"] == 1
        else:
            assert v["all_reduce_ops_per_micro_step_function"] == 1
show_table(["recipe", "worker", "updates", "all-reduces: micro-step function",
            "apply function", "max abs diff vs 1 device"], rows)

# %% [markdown]
# ## 4 · Checkpoints come from the chief
#
# Saving is collective (every worker must call it), but only the chief (task 0) should
# write to the real checkpoint directory; the others write to throwaway directories.
# This notebook's process then restores the chief's checkpoint into a fresh model on one
# device: it holds exactly the one-device weights.

# %%
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

checkpoint_dir = tempfile.mkdtemp(prefix="distgrad-chief-")
chief, other = run_workers("distgrad.lab.workers:checkpoint_from_chief", WORKERS, timeout=240,
                           directory=checkpoint_dir, steps=2)
assert chief.ok and other.ok and chief.value["is_chief"] and other.value["path"] is None
assert chief.value["path"].startswith(os.path.join(checkpoint_dir, "ckpt"))
assert any(name.startswith("ckpt") for name in os.listdir(checkpoint_dir))
restored, restored_optimizer = tiny_model(), keras.optimizers.SGD(0.1)
restored_optimizer.build(restored.trainable_variables)
tf.train.Checkpoint(model=restored, optimizer=restored_optimizer).restore(
    chief.value["path"]).assert_consumed()
restored_diff = check_close(weights_of(restored), big_batch_reference(
    lambda: keras.optimizers.SGD(0.1), x, y, steps=2))
print(f"chief's checkpoint, restored on one device: updates "
      f"{int(restored_optimizer.iterations.numpy())}, max abs diff vs 1 device "
      f"{restored_diff.max_abs:.1e}")
assert int(restored_optimizer.iterations.numpy()) == 2

# %% [markdown]
# ## 5 · When a worker dies
#
# Worker 1 crashes (`os._exit`) after its first step. Worker 0's next all-reduce has no
# peer. Without a bound it could wait forever; `make_worker_strategy(timeout_seconds=...)`
# passes `tf.distribute.experimental.CommunicationOptions(timeout_seconds=...)`, as the
# worker function above does, so the collective fails within that time (the lost
# connection may be noticed even sooner).

# %%
survivor, dead = run_workers("distgrad.lab.workers:dead_worker", WORKERS, timeout=120,
                             collective_timeout=10.0)
reason = [line.strip() for line in survivor.value["error"]["message"].splitlines()
          if line.strip() and not line.strip().startswith(("File", '"'))]  # not the traceback
print("dead worker exit code:", dead.returncode)
print(f"survivor: {survivor.value['error']['type']} after {survivor.value['seconds']:.2f} s")
print("\n".join(textwrap.shorten(line, 96) for line in reason[:2]))
assert dead.returncode == 3 and not dead.reported and dead.value is None
assert survivor.value["error"]["type"] in {"UnavailableError", "DeadlineExceededError"}
assert survivor.value["seconds"] < 15.0  # bounded: a clear error, never a hang

# %% [markdown]
# ## 6 · `model.fit` on several workers
#
# Most Keras users train with `model.fit`, and so does TensorFlow's tutorial
# *Multi-worker training with Keras*: a MWMS created from `TF_CONFIG`, the model built and
# compiled under its scope, a `tf.data.Dataset` of global batches that TensorFlow
# *auto-shards* (each worker gets its part of every batch: `AutoShardPolicy.DATA`), then
# `fit`. Here is that worker, for stock Keras 3 and for distgrad's fix, with
# chief-only checkpoints. It is written into a module by this very cell (`%%writefile`,
# into a temporary directory): a worker is a process, which imports it from there
# (`run_workers(..., env={"PYTHONPATH": ...})`); this notebook imports it too, to check
# the target before starting the workers. Its `TF_CONFIG` is section 1's: `run_workers`
# sets it.

# %%
import sys  # noqa: E402

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

    from distgrad import (AccumulatingOptimizer, MicroBatching, MultiWorkerFit,
                          MultiWorkerFitModel)
    from distgrad.lab.data import regression_data, tiny_model

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

# %% [markdown]
# One run of the two workers trains four models in turn: stock Keras 3 first, then three
# with distgrad's fix (below).

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
# ### Stock Keras 3 fails before the first step
#
# Both workers, plain `keras.Model` and `Adam`:

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
import inspect  # noqa: E402

from keras.src.backend.tensorflow import trainer as keras_trainer  # noqa: E402

build_source = inspect.getsource(keras_trainer.TensorFlowTrainer._maybe_symbolic_build)
assert 'data_batch = self.distribute_strategy.reduce(\n                        "MEAN",' in build_source
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
# `distgrad.MultiWorkerFit`, a mixin for `keras.Model` (`MultiWorkerFitModel` for
# functional models), in `distgrad/multi_worker.py`, a file that imports only TensorFlow
# and Keras. Its two repairs, as they are in that file: build from this worker's first
# per-replica batch (shapes are all the build needs: no communication), and give every
# value a step returns a leading axis of length 1, so Keras' `axis=0` reduce is the mean
# over all replicas.
#
# </div>

# %%
show_code(distgrad.MultiWorkerFit._maybe_symbolic_build)

# %%
show_code(distgrad.MultiWorkerFit._reducible)

# %% [markdown]
# On several workers, its `fit` first checks its input with
# `distgrad.check_multi_worker_input`, and refuses what would reach the replicas in
# unequal parts, naming the fix:

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
# ### Two workers with `MultiWorkerFit` equal one device
#
# The other three models of the run above: plain, with `AccumulatingOptimizer` (k = 2
# `fit` steps of 8 examples per update) and with `MicroBatching` (k = 2 micro-batches
# inside each step of 16). Each equals Keras' own `fit` on one device, batches of 16.

# %%
import fit_worker  # noqa: E402  (the module written above)

x_fit, y_fit = regression_data(2 * fit_worker.GLOBAL_BATCH)
one_device = fit_run(None, lambda: keras.optimizers.Adam(0.01), x_fit, y_fit,
                     batch_size=fit_worker.GLOBAL_BATCH)
fixed = variants[1:]
rows = []
for variant in fixed:
    runs = [r.value[variant] for r in results]
    for index, run in enumerate(runs):
        diff = check_close(run["weights"], one_device.final)
        rows.append((variant, index, run["updates"], f"{run['loss'][0]:.6f}",
                     f"{diff.max_abs:.1e}"))
        assert run["updates"] == one_device.updates == 2
    assert runs[0]["weights"] == runs[1]["weights"] and runs[0]["loss"] == runs[1]["loss"]
show_table(["model", "worker", "updates", "logged loss", "max abs diff vs 1 device"],
           rows + [("keras.Model, one device", "", one_device.updates,
                    f"{one_device.model.history.history['loss'][0]:.6f}", "")])

# %% [markdown]
# Both workers hold the same weights and log the same loss, and the weights equal one
# device's to float32 precision, with either way of accumulating.
#
# ### The chief's checkpoint
#
# Every worker ran the same `ModelCheckpoint`, but only the chief's path is
# `checkpoint_dir`; restored on one device, the chief's file holds the one-device weights:

# %%
chief_file = results[0].value["MultiWorkerFitModel"]["checkpoint"]
assert all(r.value[v]["checkpoint"] is None for r in results[1:] for v in fixed)
assert sorted(os.listdir(checkpoint_dir)) == [f"model{i}.weights.h5" for i in (1, 2, 3)]
restored = tiny_model()
restored.load_weights(chief_file)
restored_diff = check_close(weights_of(restored), one_device.final)
print(f"chief's {os.path.basename(chief_file)}, restored on one device: max abs diff vs "
      f"1 device {restored_diff.max_abs:.1e}")

# %% [markdown]
# ## Takeaways
#
# * A worker is a process; `TF_CONFIG` tells it the cluster and its own index, and
#   `MultiWorkerMirroredStrategy()` must be created before any other TensorFlow work.
# * On MWMS the optimizer's SUM all-reduce is still the one sync point per step: two
#   workers, each feeding its shard through `distribute_datasets_from_function`, train
#   exactly like one device on the whole batch; so do `GradientAccumulator` and
#   `AccumulatingOptimizer`, with one all-reduce per update.
# * Stock Keras 3 `model.fit` fails on several workers before its first step
#   (keras-team/keras#20585), and past that on its scalar logs (tensorflow/tensorflow#72388).
#   `distgrad.MultiWorkerFit` (or `MultiWorkerFitModel`) makes it train exactly like one
#   device, also with `AccumulatingOptimizer` or `MicroBatching`, from a `tf.data.Dataset`
#   of global batches (`drop_remainder=True`) that TensorFlow auto-shards by `DATA`.
# * MWMS uses `merge_call` like `MirroredStrategy`: lesson 03's rule about sync points
#   inside `tf.cond` holds here too.
# * Every worker saves, in a custom loop and in `fit` (the same `ModelCheckpoint` on every
#   worker); only the chief writes the real checkpoint.
# * Set a collective timeout: a dead worker then produces an error, not a hang.
#
# ## Exercises
#
# 1. Run the section 2 cell with `optimizer="momentum"` and with `optimizer="adamw"`
#    (the names of `distgrad.lab.compare.OPTIMIZERS`; change `reference` to match): do
#    both workers still agree with one device?
# 2. Start four workers: `run_workers("distgrad.lab.workers:train_on_worker", 4, ...)`.
#    What are `replicas` and the shard size now, and do the weights still match? Then
#    try 3 workers: which line of `train_on_worker` fails, and why (16 examples)?
# 3. In section 5, pass `collective_timeout=3.0`: how long does the survivor wait now?
# 4. In section 6's worker, give `dataset` the option `AutoShardPolicy.OFF` instead of
#    `DATA`: what does `MultiWorkerFit` say, and why would both workers otherwise train on
#    the same examples? Then feed `fit` with
#    `strategy.distribute_datasets_from_function(dataset_fn)` instead (`dataset_fn` shards
#    with `context.input_pipeline_id` and batches
#    `context.get_per_replica_batch_size(batch_size)` with `drop_remainder=True`): do the
#    weights still equal one device's?
#
# ## Further reading
#
# * TensorFlow tutorials *Multi-worker training with Keras* and *Custom training loop with
#   MultiWorkerMirroredStrategy*; `tf.distribute.InputContext`.
# * `tf.distribute.experimental.CommunicationOptions` (timeouts, NCCL/RING).
# * Installed source: `tensorflow/python/distribute/collective_all_reduce_strategy.py`
#   (`_use_merge_call`, `_check_health`, `_reduce_to`); `keras/src/backend/tensorflow/
#   trainer.py` (`_maybe_symbolic_build`, `reduce_per_replica`).
# * keras-team/keras#20585 (`fit` on MWMS in Keras 3, open), tensorflow/tensorflow#72388;
#   the stock reproduction on the [upstream page](../upstream.md#multi-worker-fit).
