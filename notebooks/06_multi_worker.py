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
# one process per machine (a *worker*) and all-reduces across them with collective ops.
# Does everything lessons 01–03 proved still hold? Here we check it on a **real
# multi-process run**: two worker processes on this machine, each with its own
# `TF_CONFIG`, talking over localhost — not a simulation.
#
# `distgrad.lab.multiworker.run_workers(target, num_workers)` starts the workers (free
# ports picked at run time), calls `target(task_index, num_workers, **options)` in each,
# collects their results (one `ChildResult` per worker, in task order), and kills every
# process it started when it returns or times out. The worker functions live in
# `distgrad/lab/workers.py`.

# %%
import distgrad

# This notebook's own process only launches workers and checks their results; each
# worker creates its own strategy. We still call make_strategy so the lesson prints
# where it runs, like every lesson.
strategy = distgrad.make_strategy(1)
distgrad.environment_report(strategy)

# %%
import tempfile

from distgrad.lab.compare import check_close, weights_of
from distgrad.lab.data import tiny_model
from distgrad.lab.multiworker import run_workers

EXPERIMENTS = "distgrad.lab.workers"
WORKERS = 2

# %% [markdown]
# ## 1 · Where the sync happens on MWMS
#
# Each worker trains the tiny model of lesson 01 on its half of the global batch with the
# plain lesson-01 `train_step` (`apply_gradients` inside `strategy.run`). We compare each
# worker's weights after 3 Adam steps with one device on the whole batch, and count the
# collective ops in the traced step.

# %%
results = run_workers(f"{EXPERIMENTS}:sync_and_equivalence", WORKERS, timeout=240,
                      optimizer="adam", steps=3)
for task_index, r in enumerate(results):
    print(f"worker {task_index}: ok={r.ok} {r.seconds:.1f}s", r.value)

# %%
for r in results:
    assert r.ok, r.stderr_tail
    v = r.value
    assert v["replicas"] == WORKERS and len(v["local_devices"]) == 1  # one CPU replica per worker
    assert v["collective_op_types"] == {"CollectiveReduceV2": 1}  # one all-reduce per step
    assert v["iterations"] == 3
    assert v["max_abs_diff_vs_one_device"] <= 1e-6  # float32 equivalence with one device

# %% [markdown]
# The sync point is the same as in lesson 01 — the optimizer's SUM all-reduce — but
# here it is a `CollectiveReduceV2` that crosses process boundaries.
#
# ### "MWMS has no merge_call" — not on CPUs, and not without XLA
#
# TensorFlow has a *no-merge-call* path (`tf.__internal__.distribute.strategy_supports_no_merge_call()`):
# optimizers then all-reduce and update directly in replica context, and sync points inside
# `tf.cond` become possible. But in the installed source
# (`collective_all_reduce_strategy.py`, `_use_merge_call`) MWMS takes it **only when the
# step is XLA-compiled and every device is a GPU**. On CPU workers, as here, it still uses
# `merge_call`:

# %%
assert all(r.value["supports_no_merge_call"] is False for r in results)

# %% [markdown]
# So lesson 03's `tf.cond` error is not a MirroredStrategy quirk — it happens on MWMS too:

# %%
cond = run_workers(f"{EXPERIMENTS}:cond_around_apply", WORKERS, timeout=240)
for task_index, r in enumerate(cond):
    print(f"worker {task_index}:", r.value["error"]["type"], "—",
          r.value["error"]["message"].splitlines()[-1][:160], "...")
    assert r.value["error"]["type"] == "RuntimeError"
    assert "`merge_call` called while defining a new graph" in r.value["error"]["message"]

# %% [markdown]
# Where the no-merge-call path *is* taken (XLA on GPUs), a sync point in a `tf.cond` traces,
# but every worker must then take the **same branch** on the same step: a collective that
# only some workers enter waits for peers that never come — until the collective timeout.
# Deciding the branch from a value all workers agree on (a step counter, not a per-worker
# loss) is what the accumulating optimizer of lesson 03 does.
#
# ### Accumulation on two workers
#
# Lessons 02 and 03 on MWMS: k = 2 micro-batches per update, each worker feeding its
# slice of each micro-batch. `GradientAccumulator` accumulates with no communication and
# all-reduces once in its apply function; `AccumulatingOptimizer`'s only all-reduce sits
# inside its update branch (traced once, run once per k micro-steps). After 2 updates of
# Adam both equal one device on the big batches.

# %%
for recipe in ("accumulator", "optimizer"):
    runs = run_workers(f"{EXPERIMENTS}:accumulated_equivalence", WORKERS, timeout=240,
                       recipe=recipe, optimizer="adam", accumulation_steps=2, updates=2)
    for task_index, r in enumerate(runs):
        assert r.ok, r.stderr_tail
        print(f"worker {task_index}:", r.value)
        assert r.value["iterations"] == 2 and r.value["max_abs_diff_vs_one_device"] <= 1e-6
        if recipe == "accumulator":
            assert r.value["all_reduce_ops_per_micro_step_function"] == 0
            assert r.value["all_reduce_ops_per_apply_function"] == 1
        else:
            assert r.value["all_reduce_ops_per_micro_step_function"] == 1

# %% [markdown]
# ## 2 · Checkpoints come from the chief
#
# Saving is collective (every worker must call it), but only the chief (task 0) should
# write to the real checkpoint directory; the others write to throwaway directories.
# This notebook's process then restores the chief's checkpoint into a fresh model on one
# device — it holds exactly the one-device weights.

# %%
import keras
import tensorflow as tf

from distgrad.lab.data import regression_data
from distgrad.lab.recipes import big_batch_reference

checkpoint_dir = tempfile.mkdtemp(prefix="distgrad-chief-")
chief, other = run_workers(f"{EXPERIMENTS}:checkpoint_from_chief", WORKERS, timeout=240,
                           directory=checkpoint_dir, steps=2)
assert chief.ok and other.ok and chief.value["is_chief"] and other.value["path"] is None
restored, restored_optimizer = tiny_model(), keras.optimizers.SGD(0.1)
restored_optimizer.build(restored.trainable_variables)
tf.train.Checkpoint(model=restored, optimizer=restored_optimizer).restore(chief.value["path"]).assert_consumed()
x, y = regression_data(16)
print(check_close(weights_of(restored),
                           big_batch_reference(lambda: keras.optimizers.SGD(0.1), x, y, steps=2)))
assert int(restored_optimizer.iterations.numpy()) == 2

# %% [markdown]
# ## 3 · When a worker dies
#
# Worker 1 crashes (`os._exit`) after its first step. Worker 0's next all-reduce has no
# peer. Without a bound it could wait forever; `make_worker_strategy(timeout_seconds=...)`
# passes `tf.distribute.experimental.CommunicationOptions(timeout_seconds=...)`, so the
# collective fails within that time (here the lost connection is noticed even sooner).

# %%
survivor, dead = run_workers(f"{EXPERIMENTS}:dead_worker", WORKERS, timeout=120,
                             collective_timeout=10.0)
print("dead worker exit code:", dead.returncode)
print(f"survivor: {survivor.value['error']['type']} after {survivor.value['seconds']:.2f}s")
print(survivor.value["error"]["message"].strip().splitlines()[-1][:300])
assert dead.returncode == 3
assert survivor.value["error"]["type"] in {"UnavailableError", "DeadlineExceededError"}
assert survivor.value["seconds"] < 15.0  # bounded: a clear error, never a hang

# %% [markdown]
# ## Takeaways
#
# * On MWMS the optimizer's SUM all-reduce is still the one sync point per step; 2 workers
#   train exactly like one device on the whole batch — with `GradientAccumulator` and
#   `AccumulatingOptimizer` too, with one all-reduce per update. (Shown in custom loops,
#   each worker feeding its own slice; `model.fit` on MWMS adds Keras' dataset
#   auto-sharding, not covered here.)
# * MWMS uses `merge_call` unless the step is XLA-compiled on GPUs, so sync points inside
#   `tf.cond` fail the same way as on MirroredStrategy; where they trace, all workers must
#   take the same branch.
# * Every worker saves; only the chief writes the real checkpoint.
# * Set a collective timeout: a dead worker then produces an error, not a hang.
#
# ## Further reading
#
# * TensorFlow tutorial *Multi-worker training with Keras* and *Custom training loop with MWMS*.
# * `tf.distribute.experimental.CommunicationOptions` (timeouts, NCCL/RING).
# * Installed source: `tensorflow/python/distribute/collective_all_reduce_strategy.py`
#   (`_use_merge_call`, `_check_health`).
