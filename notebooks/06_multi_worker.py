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
# `TF_CONFIG`, talking over localhost.
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
import tempfile  # noqa: E402
import textwrap  # noqa: E402

from IPython.display import Code  # noqa: E402

from distgrad.lab.compare import OPTIMIZERS, check_close, weight_diff, weights_of  # noqa: E402
from distgrad.lab.data import regression_data, tiny_model  # noqa: E402
from distgrad.lab.display import show_code, show_environment, show_table  # noqa: E402
from distgrad.lab.multiworker import free_ports, run_workers, tf_config  # noqa: E402
from distgrad.lab.recipes import big_batch_reference  # noqa: E402
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
# `run_workers` sets this variable in each worker's environment, and
# `CUDA_VISIBLE_DEVICES=""`: the two workers share one machine, so each is given the CPU
# only and has one replica. The worker function does not depend on it: `dataset_fn`
# batches per replica, whatever number of replicas a worker has.
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
assert dead.returncode == 3
assert survivor.value["error"]["type"] in {"UnavailableError", "DeadlineExceededError"}
assert survivor.value["seconds"] < 15.0  # bounded: a clear error, never a hang

# %% [markdown]
# ## Takeaways
#
# * A worker is a process; `TF_CONFIG` tells it the cluster and its own index, and
#   `MultiWorkerMirroredStrategy()` must be created before any other TensorFlow work.
# * On MWMS the optimizer's SUM all-reduce is still the one sync point per step: two
#   workers, each feeding its shard through `distribute_datasets_from_function`, train
#   exactly like one device on the whole batch; so do `GradientAccumulator` and
#   `AccumulatingOptimizer`, with one all-reduce per update. (Shown in custom loops;
#   `model.fit` on MWMS adds Keras' dataset auto-sharding, not covered here.)
# * MWMS uses `merge_call` like `MirroredStrategy`: lesson 03's rule about sync points
#   inside `tf.cond` holds here too.
# * Every worker saves; only the chief writes the real checkpoint.
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
#
# ## Further reading
#
# * TensorFlow tutorials *Multi-worker training with Keras* and *Custom training loop with
#   MultiWorkerMirroredStrategy*; `tf.distribute.InputContext`.
# * `tf.distribute.experimental.CommunicationOptions` (timeouts, NCCL/RING).
# * Installed source: `tensorflow/python/distribute/collective_all_reduce_strategy.py`
#   (`_use_merge_call`, `_check_health`).
