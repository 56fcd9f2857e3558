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
# # 08 · Preemption and resume: a fit interrupted mid-cycle, resumed exactly
#
# **The question** (none of the [four questions](../questions.md) asks it; every long
# accumulating run meets it): *my job was preempted in the middle of an epoch, in the
# middle of an accumulation cycle. I had `keras.callbacks.BackupAndRestore(save_freq=N)`
# and restarted the job. Does it go on as if nothing had happened?*
#
# **The short answer.** Not with Keras 3's callback: it writes the epoch *and* the batch of
# its backup but restores only the epoch, so the interrupted epoch starts again from its
# first batch with the weights of the backup, and the batches already in those weights are
# trained twice (22 updates where the uninterrupted run makes 16). `distgrad.BackupAndRestore`
# takes Keras' arguments, and, with a model whose `fit` hands it the data
# (`distgrad.ResumableFitModel`), restores the model, the optimizer (slots, `iterations`,
# the accumulators and `micro_steps` of an `AccumulatingOptimizer`, a loss scale), the
# epoch, its metrics and the position in the data: the resumed `fit` reads the
# batches the backup already holds and drops them. It needs the data in the same order
# when the job starts again, and refuses, at `fit` start, data whose order cannot repeat.
# A custom loop checkpoints the same state itself: model, optimizer, `GradientAccumulator`
# and a count of micro-batches (a distributed iterator cannot be checkpointed), under
# `PreemptionCheckpointHandler` on several workers (deep dive).

# %%
import distgrad_course

strategy = distgrad_course.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
assert R >= 2, "the fix and the deep dives compare R >= 2 replicas with one device"

from distgrad_course.lab.display import show_code, show_environment, show_table

show_environment(distgrad_course.environment_report(strategy))

# %%
import json
import os
import textwrap

import tensorflow as tf

tf.get_logger().setLevel("ERROR")  # fresh models and tf.functions per experiment, on purpose

# %% [markdown]
# ## 1 · The fix
#
# The job below is what a training script does every time it starts: build the model,
# compile, `fit` with `BackupAndRestore`. The first start is preempted after micro-batch
# 11, in epoch 1 and inside an accumulation cycle of `K = 3`; its last backup, after
# micro-batch 10, holds one micro-batch of that cycle. The second start is the restarted
# job. Two things differ from Keras' callback: `BackupAndRestore`'s import, and the model's
# class, `ResumableFitModel`, whose `fit` hands the callback `fit`'s data and arguments
# (Keras hands callbacks neither: section 3).

# %% tags=["fix"]
# A fit that resumes where its last backup was taken: mid-epoch, mid-accumulation-cycle.
# Back up every 2 batches; after a preemption, run the same script again.
import gc
import tempfile

import keras
import numpy as np
import tensorflow as tf

from distgrad import AccumulatingOptimizer, BackupAndRestore, ResumableFitModel

# Two or more replicas: your GPUs, or two logical CPUs on a machine without GPUs.
cpu = tf.config.list_physical_devices("CPU")[0]
if not (tf.config.list_physical_devices("GPU") or tf.config.get_logical_device_configuration(cpu)):
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.experimental.enable_tensor_float_32_execution(False)  # exact float32 for the check
devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
strategy = tf.distribute.MirroredStrategy(devices)

K, BATCH, EPOCHS = 3, 8, 2  # micro-batches per update; global micro-batch; 8 batches an epoch
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = x @ rng.normal(size=(4, 1)).astype("float32")
# The same order every time the job starts: no shuffle, or one with a seed that does not
# reshuffle (BackupAndRestore refuses other orders at fit start).
dataset = (tf.data.Dataset.from_tensor_slices((x, y))
           .shuffle(64, seed=1, reshuffle_each_iteration=False).batch(BATCH))
backup_dir = tempfile.mkdtemp()  # in a real job: storage that outlives the machine

def make_model():  # ResumableFitModel: its fit hands BackupAndRestore fit's arguments
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return ResumableFitModel(inputs, keras.layers.Dense(1)(hidden))

class Preemption(keras.callbacks.Callback):  # stands in for losing the machine
    def on_train_batch_end(self, batch, logs=None):
        if self.model.optimizer.total_micro_steps == 11:  # mid-epoch 1, mid-cycle
            raise KeyboardInterrupt("preempted after 11 micro-batches")

def job(*extra_callbacks):  # what the job script runs, every time it starts
    with strategy.scope():
        model = make_model()
        model.compile(AccumulatingOptimizer(keras.optimizers.Adam(0.05), K), loss="mse")
    model.fit(dataset, epochs=EPOCHS, shuffle=False, verbose=0,  # shuffle in the pipeline
              callbacks=[BackupAndRestore(backup_dir, save_freq=2), *extra_callbacks])
    return model

try:
    job(Preemption())  # dies after micro-batch 11; the last backup holds 10, 1 into a cycle
except KeyboardInterrupt:
    pass
gc.collect()  # free the stopped fit's data iterator now (after the except: its traceback
# held it); freed minutes later, it can stall (Performance page, tf.data iterators)
model = job()  # the restart reads and drops epoch 1's first 2 batches, then goes on mid-cycle
print("updates:", model.optimizer.iterations.numpy(),
      "micro-batches:", model.optimizer.total_micro_steps.numpy())

# %% tags=["check"]
# One device, never interrupted: one Adam step per K * BATCH examples, in the same order
# (the cycle that straddles the epoch's end is one big batch here too).
one_device = make_model()
one_device.compile(keras.optimizers.Adam(0.05), loss="mse")
xs, ys = (np.concatenate(part) for part in zip(*dataset.repeat(EPOCHS).as_numpy_iterator()))
n = len(xs) // (K * BATCH) * K * BATCH  # 5 updates; the last micro-batch is a cycle not done
one_device.fit(xs[:n], ys[:n], batch_size=K * BATCH, shuffle=False, verbose=0)
for got, want in zip(model.get_weights(), one_device.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
assert model.optimizer.iterations.numpy() == one_device.optimizer.iterations.numpy() == 5
print(f"{strategy.num_replicas_in_sync} replicas, preempted and resumed: equal to one device")

# %% [markdown]
# ## 2 · Why it works
#
# The same kind of job, with plain Adam (no accumulation), interrupted after 7 batches
# of 16, with a backup every 3 batches: once with Keras 3's callback, once with distgrad's.
# A recorder notes, for each batch of the restarted `fit`, whether a train step ran on it
# (the optimizer's step count went up) or not (`distgrad_course.lab.backup.timeline`;
# `distgrad_course.pitfalls.backup_replays_epoch` runs both):

# %%
import matplotlib.pyplot as plt

from distgrad_course.lab import backup
from distgrad_course.pitfalls import backup_replays_epoch

work = tempfile.mkdtemp()
replay = backup_replays_epoch.reproduce(strategy, cut=7, save_freq=3, directory=work)
runs = {"keras": replay.keras, "distgrad": replay.distgrad}
show_table(["callback", "batches the restart trained", "read and dropped", "updates",
            "uninterrupted"], [
    (name, f"{t.resumed_trained[0]}–{t.resumed_trained[-1]}",
     f"{t.resumed_read[0]}–{t.resumed_read[-1]}" if t.resumed_read else "none",
     t.updates, t.expected_updates) for name, t in runs.items()])
assert replay.keras.first == list(range(7)) and replay.keras.backups == [3, 6]
assert replay.keras.resumed_trained == list(range(16)) and replay.keras.updates == 22
assert replay.trained_twice == list(range(6))  # in the backup's weights, trained again
assert replay.distgrad.resumed_read == list(range(6))  # the backup holds batches 0-5
assert replay.distgrad.resumed_trained == list(range(6, 16))  # batch 6: lost, trained again
assert replay.distgrad.updates == replay.distgrad.expected_updates == 16
backup.plot_timelines(list(runs.values()))
plt.show()

# %% [markdown]
# Keras 3's callback writes the batch of its backup but restores only the epoch (deep dive
# below). distgrad's callback keeps the count of batches the backup holds (6 here). Keras'
# TensorFlow trainer calls `model.train_function(iterator)` once per step
# (`keras/src/backend/tensorflow/trainer.py`); the callback wraps it at `fit` start. In the
# interrupted epoch, on each batch the backup holds, the wrapper reads the batch from the
# iterator and drops it, so the data position, the step count of the epoch and every
# callback's batch numbers are those of the uninterrupted run. After the last of them,
# Keras' own train function runs:

# %%
show_code(BackupAndRestore._train)

# %% [markdown]
# ## 3 · The packaged form
#
# `distgrad.BackupAndRestore(backup_dir, save_freq="epoch" | n, double_checkpoint=False,
# delete_checkpoint=True, handle_sigterm=True, run_id=None)` takes Keras' arguments, and on
# `SIGTERM` backs up and exits with status 42 (deep dive). Each backup writes
# `ckpt-<n>.weights.h5` (`model.save_weights`: model and optimizer variables), then commits
# it with Keras' `training_metadata.json`, which names it and adds the position in the data
# and the run's identity (deep dives below). It copies into a project as one file,
# `src/distgrad/backup_and_restore.py` (`tests/test_copy_alone.py` backs up a `fit` with the
# file copied alone).
#
# Keras hands a callback the model and `params` (epochs, steps, verbosity), not `fit`'s
# data. `ResumableFitModel`'s `fit` hands the callback its arguments (for a subclassed
# model: `class M(distgrad.ResumableFit, keras.Model)`, first in the bases; or call
# `callback.set_fit_arguments(x, y, batch_size=..., shuffle=..., steps_per_epoch=...)`
# before `fit`). With them it checks at `fit` start, the first time too, that the data can
# come in the same order at every start: with a backup every n batches, data that cannot is
# refused before the first step. Keras' default `fit(x, y)` shuffles arrays anew every epoch:

# %%
model = backup.build(strategy, "adam")  # a ResumableFit model
x, y = backup.examples()
try:
    model.fit(x, y, batch_size=8, verbose=0,
              callbacks=[BackupAndRestore(os.path.join(work, "refused"), save_freq=3)])
    raise AssertionError("fit(shuffle=True) was not refused")
except ValueError as error:
    refused = str(error)
print(textwrap.fill(refused[:300] + " ...", 96))
assert refused.startswith("BackupAndRestore(save_freq=3) resumes mid-epoch by skipping")
assert "fit(shuffle=True) shuffles the arrays anew in every epoch" in refused
assert "reshuffle_each_iteration=False" in refused
assert model.optimizer.iterations.numpy() == 0  # refused before the first step

# %% [markdown]
# The same `fit` of a plain `keras.Model` is not refused: the callback cannot see the data.
# It warns once per `fit`, and skips what needs the data:

# %%
import warnings

plain, callback = backup.build(strategy, "adam", resumable=False), BackupAndRestore(
    os.path.join(work, "plain"), save_freq=3)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plain.fit(x, y, batch_size=8, verbose=0, callbacks=[callback])
warned = [str(w.message) for w in caught if "fit's arguments" in str(w.message)]
print(textwrap.fill(warned[0], 96))
assert len(warned) == 1 and sorted(callback.params) == ["epochs", "steps", "verbose"]
assert plain.optimizer.iterations.numpy() == backup.BATCHES  # trained, shuffled

# %% [markdown]
# <div class="admonition warning">
# <p class="admonition-title">Limits</p>
#
# * **The same data in the same order**, the same batch size and `steps_per_epoch`: a
#   backup taken with another number of batches per epoch is refused. A shuffle without a
#   seed, or one that reshuffles each iteration, is refused with `save_freq=n` and warned
#   about with `save_freq="epoch"`; a Python generator's order cannot be checked: warned
#   about. Without `fit`'s arguments the order is not checked (above).
# * **Under a strategy, a resume reads the batches its backup holds, and drops them**: up to
#   an epoch's reads before the first new step (section 2). TensorFlow 2.21 cannot
#   checkpoint the iterator of a distributed dataset (the custom-loop deep dive shows the
#   error). With no strategy (one device) the iterator's state is saved with each backup and
#   restored instead: none is read again
#   (`tests/backup_and_restore/test_backup_iterator.py`).
# * **Random layers**: a `Dropout` layer's seed generator state is not among the weights
#   `save_weights` writes, so the restart draws other masks
#   (`tests/backup_and_restore/test_backup_and_restore.py::test_a_seeded_dropout_layer_does_not_resume_exactly`).
#   Other callbacks' state (`ReduceLROnPlateau`, `EarlyStopping`) is not in the backup.
# * **Several workers** need one directory all of them read (a shared file system or a
#   bucket, not each host's disk: refused by name,
#   `tests/backup_and_restore/test_backup_sigterm.py::test_two_workers_stopped_resume_exactly_on_one_and_refuse_workers_on_their_own_dirs`).
#   Only the chief writes there.
# * **Another number of workers or replicas at the restart** resumes exactly with the same
#   global batch (the same test: 2 workers stopped, resumed on 1 process); with another
#   global batch, or one unknown without `fit`'s arguments, it is refused, naming both
#   (deep dive below; `tests/backup_and_restore/test_backup_identity.py`).
# * **Object stores** (gs://, s3://), where a rename is a copy then a delete: each backup is
#   committed by writing one small object last, so a kill at any moment leaves a whole
#   backup (`tests/backup_and_restore/test_backup_commit.py` kills at every file operation
#   of a backup, on 1 and 2 workers; deep dive below).
# * **After a `SIGKILL` or a crash, the batches since the last backup are lost** and
#   trained again: choose `save_freq` by what a backup costs (deep dive below) against
#   what a lost batch costs. A `SIGTERM` loses none.
#
# </div>

# %% [markdown]
# ## Deep dive · What Keras' callback writes, and what it reads
#
# Keras 3's callback (`keras/src/callbacks/backup_and_restore.py`) saves the batch but its
# `_load_model` only sets `model._initial_epoch`. Its own metadata, after a first fit like
# section 2's:

# %%
import keras

with_keras = os.path.join(work, "metadata")
try:
    backup.one_fit(strategy, with_keras, kind="adam", callback="keras", save_freq=3,
                   stop=backup.Interrupt(7))
except backup.Preempted:
    pass
with open(os.path.join(with_keras, "training_metadata.json")) as file:
    written = json.load(file)
print(written)
assert written == {"epoch": 0, "batch": 5}  # batch 5: the 6th, the last in the backup
show_code(keras.callbacks.BackupAndRestore._load_model)

# %% [markdown]
# ## Deep dive · A worker killed mid-cycle, the cluster restarted
#
# Two worker processes (`MultiWorkerMirroredStrategy`, one replica each, lesson 06's
# `MultiWorkerFitModel`) fit the same job. Worker 1 sends itself `SIGKILL` after batch 10,
# mid-cycle: no exception, no callback, nothing runs after it. Worker 0 waits in its next
# all-reduce and fails within its collective timeout. Then the whole cluster starts again
# with the same `backup_dir`, as a cluster manager would restart it:

# %%
import time

from distgrad_course.lab.local_cluster import run_workers

shared = os.path.join(work, "cluster")
started = time.monotonic()
first = run_workers("distgrad_course.lab.backup:fit_on_worker", 2, timeout=240, backup_dir=shared,
                    save_freq=3, collective_timeout=15, kill_after=10)
failed_after = time.monotonic() - started
left_behind = sorted(os.listdir(shared))  # the chief's files only
with open(os.path.join(shared, "training_metadata.json")) as file:
    at_restart = json.load(file)
second = run_workers("distgrad_course.lab.backup:fit_on_worker", 2, timeout=240, backup_dir=shared,
                     save_freq=3, collective_timeout=15)
uninterrupted = backup.one_fit(strategy, os.path.join(work, "reference"))
show_table(["run", "worker 0", "worker 1"], [
    ("first start", first[0].error["type"], f"exit status {first[1].returncode} (SIGKILL)"),
    ("restart", f"{second[0].value['updates']} updates", f"{second[1].value['updates']} updates"),
])
print(f"the first start ended after {failed_after:.0f} s; the backup it left holds epoch "
      f"{at_restart['epoch']}, batch {at_restart['batches_done']} done")
assert first[1].returncode == -9 and first[0].error["type"] in {"UnavailableError",
                                                                "DeadlineExceededError"}
assert (at_restart["epoch"], at_restart["batches_done"]) == (1, 1)  # 9 batches = 8 + 1
assert left_behind == ["ckpt-3.weights.h5", "training_metadata.json"]  # backups 3, 6, 9
for worker in second:
    resumed = backup.FitResult(**worker.check().value)
    assert resumed.updates == uninterrupted.updates == 5
    for got, want in zip(resumed.weights, uninterrupted.weights):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
print(f"both workers after the restart equal the uninterrupted run on {R} local replicas")

# %% [markdown]
# ## Deep dive · Custom loops: `tf.train.Checkpoint` and `PreemptionCheckpointHandler`
#
# A custom loop checkpoints what `fit`'s backup holds: the model, the optimizer, the
# `GradientAccumulator` (lesson 02; a checkpoint saves the SUM of its replica-local buffers
# and gives each replica SUM / R back, so the next update is unchanged) and the position in
# the data. The data iterator itself cannot go into the checkpoint when it is distributed,
# on TensorFlow 2.21:

# %%
from distgrad_course.lab import preemption
from distgrad_course.lab.child import run_child

iterators = run_child("distgrad_course.lab.preemption:iterator_checkpointability", {"replicas": R}).value
show_table(["iterator", "tf.train.Checkpoint(iterator=...)"], [
    (name, "accepted" if error is None else f"{error['type']}: not trackable")
    for name, error in iterators.items()])
for name in ("experimental_distribute_dataset", "distribute_datasets_from_function"):
    assert iterators[name]["type"] == "ValueError"
    assert "was expecting iterator to be a trackable object" in iterators[name]["message"]
    assert "DistributedIterator" in iterators[name]["message"]
assert iterators["plain_tf_data"] is None

# %% [markdown]
# So the loop keeps its data position as a variable in the checkpoint, and a restarted job
# builds its pipeline with `.skip(position)` (or checkpoints a plain `tf.data` iterator of
# global batches and splits each over the replicas itself). The loop of lesson 02, with
# the fix's model and strategy, stopped after micro-batch 4 and started again:

# %%
# A custom loop that resumes mid-cycle: the model, the optimizer, the GradientAccumulator
# and the data position (micro-batches done) in one tf.train.Checkpoint; the restarted
# pipeline skips the micro-batches the checkpoint holds.
from distgrad import GradientAccumulator

MICRO, STEPS = 8, 12  # global micro-batch; micro-batches in all: 4 updates of K = 3
rng = np.random.default_rng(1)
loop_x = rng.normal(size=(MICRO * STEPS, 4)).astype("float32")
loop_y = loop_x.sum(axis=1, keepdims=True)
checkpoint_dir = tempfile.mkdtemp()

def loop_job(stop_after=None):  # what the job runs every time it starts
    with strategy.scope():
        model, optimizer = make_model(), keras.optimizers.Adam(0.05)
        accumulator = GradientAccumulator(model.trainable_variables)
        position = tf.Variable(0, dtype=tf.int64, trainable=False)  # micro-batches done
    apply_step = accumulator.make_apply_step(optimizer)  # builds the optimizer's slots
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                     accumulator=accumulator, position=position)
    manager = tf.train.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=2)
    checkpoint.restore(manager.latest_checkpoint)  # the first time: nothing to restore
    restored = (int(position.numpy()), accumulator.micro_steps, int(optimizer.iterations.numpy()))
    pipeline = tf.data.Dataset.from_tensor_slices((loop_x, loop_y)).batch(MICRO)
    pipeline = pipeline.skip(int(position.numpy()))  # a distributed iterator cannot be saved

    @tf.function
    def accumulate(batch):
        def step(x, y):
            with tf.GradientTape() as tape:  # divided by the update's examples: K * MICRO
                loss = tf.reduce_sum(tf.square(model(x, training=True) - y)) / (K * MICRO)
            accumulator.add(tape.gradient(loss, model.trainable_variables))
        strategy.run(step, args=batch)

    for batch in strategy.experimental_distribute_dataset(pipeline):
        accumulate(batch)
        if accumulator.micro_steps == K:
            apply_step()
        position.assign_add(1)
        manager.save()  # here after every micro-batch; as often as a lost one costs
        if position.numpy() == stop_after:
            break  # the preemption: nothing after this line runs
    return model, restored, (int(position.numpy()), int(optimizer.iterations.numpy()))

loop_job(stop_after=4)  # stopped with 1 update done, 1 micro-batch of the next accumulated
looped, restored, final = loop_job()  # the restart
print("restored (micro-batches, micro_steps, updates):", restored, "final:", final)

# %%
reference = make_model()  # one device: one Adam step per K * MICRO examples
reference_optimizer = keras.optimizers.Adam(0.05)
for i in range(0, MICRO * STEPS, K * MICRO):
    xb, yb = loop_x[i:i + K * MICRO], loop_y[i:i + K * MICRO]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(reference(xb) - yb))
    grads = tape.gradient(loss, reference.trainable_variables)
    reference_optimizer.apply_gradients(zip(grads, reference.trainable_variables))
for got, want in zip(looped.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
assert restored == (4, 1, 1) and final == (12, 4)
print("custom loop, stopped mid-cycle and restarted: equal to one device")

# %% [markdown]
# `tests/test_preemption.py` runs the same loop stopped and restarted in two fresh
# processes. On several workers, `tf.distribute.experimental.PreemptionCheckpointHandler`
# adds the preemption: it restores the latest checkpoint when it is created, catches
# `SIGTERM`, and has every worker save at the same count of its `run` calls, one per
# micro-batch here, then exit. A `SIGKILL` leaves no time to save: the loop also saves
# every 2 micro-batches with a `tf.train.CheckpointManager` (the chief into the checkpoint
# directory, the others into scratch ones), and the cluster manager
# (`preemption.run_cluster_with_restarts`) kills the rest of the cluster and starts it
# again. The worker program, with the lab's progress records:

# %%
show_code(preemption.preemptible_worker)

# %% [markdown]
# The handler saves every worker at the same `run` count, so the workers must stay within
# one micro-batch of each other: the loss summed over the workers (`strategy.reduce`, one
# scalar all-reduce per micro-batch) does that. Without it, a micro-batch that only
# accumulates has no collective, one worker runs ahead to the next update, and the
# preemption save fails both. Three runs of two workers, k = 3, 12 micro-batches:

# %%
cluster_reference = preemption.uninterrupted_cluster()["weights"]
# In a process of its own: the pipeline's shuffle seeds depend on TensorFlow's global seed,
# which the fix cell set here (keras.utils.set_random_seed) and the workers do not.
one_device_reference = [np.asarray(w) for w in run_child(
    "distgrad_course.lab.preemption:reference_weights").value]
faults = {kind: preemption.preemption_experiment(kind, uninterrupted=cluster_reference,
                                                 reference=one_device_reference)
          for kind in ("SIGTERM", "SIGKILL", "SIGTERM_without_sync")}
term, kill, unsynced = faults["SIGTERM"], faults["SIGKILL"], faults["SIGTERM_without_sync"]
show_table(["fault", "exit statuses", "restored at micro-batch", "micro_steps", "max |diff|"], [
    ("SIGTERM to worker 1", term["attempts"][0]["returncodes"], term["resumed"]["micro_batches"],
     term["resumed"]["accumulator_micro_steps"], f"{term['max_abs_diff_vs_uninterrupted']:.1e}"),
    ("SIGKILL to the chief", kill["attempts"][0]["returncodes"], kill["resumed"]["micro_batches"],
     kill["resumed"]["accumulator_micro_steps"], f"{kill['max_abs_diff_vs_uninterrupted']:.1e}"),
    ("SIGTERM, no per-micro-batch sync", unsynced["attempts"][0]["returncodes"], "nothing saved",
     "—", "—"),
])
assert term["attempts"][0]["returncodes"] == [42, 42]  # both saved, then the exit_fn
saved = term["exits"][0]["micro_batches"]
assert term["exits"][1]["micro_batches"] == saved and saved % 3 != 0  # mid-cycle, both alike
for record in term["exits"]:  # what each worker's checkpoint holds
    assert (record["optimizer_iterations"], record["accumulator_micro_steps"]) == (
        saved // 3, saved % 3)
assert term["resumed"]["micro_batches"] == saved and term["resumed"]["total_run_calls"] == saved
assert kill["attempts"][0]["returncodes"] == [-9, -9] and kill["exits"] == [None, None]
assert kill["attempts"][0]["killed_by_launcher"] == [1]  # the manager ends the survivor
assert kill["resumed"]["micro_batches"] == max(kill["periodic_saves"]) == 4  # the last save
assert kill["resumed"]["accumulator_micro_steps"] == 1  # mid-cycle
for run in (term, kill):
    assert run["final"]["optimizer_iterations"] == 4 and run["final"]["micro_batches"] == 12
    assert run["max_abs_diff_vs_uninterrupted"] <= 1e-6
    assert run["max_abs_diff_vs_one_device"] <= 1e-6
assert unsynced["latest_checkpoint_at_end"] is None
assert any("Shape mismatch in the collective instance" in (e or {}).get("message", "")
           for e in unsynced["worker_errors"][0])
print("SIGTERM and SIGKILL mid-cycle: resumed equal to the uninterrupted run and one device")

# %% [markdown]
# ## Deep dive · tf-keras: the right count, the wrong batches
#
# tf-keras' `BackupAndRestore(save_freq=n)` (Keras 2, run here in a child process with
# `TF_USE_LEGACY_KERAS=1`) does restore the step: `WorkerTrainingState.
# maybe_load_initial_counters_from_ckpt` returns the batch after the backup's, and `fit`
# starts the epoch's step count there. But `DataHandler.enumerate_epochs` makes a fresh
# iterator, and each step takes its next batch: the resumed steps train the epoch's
# *first* batches. To see which batch a step trains, batch k holds x = k + 1 and each SGD
# step adds its batch's x to a single weight w (`distgrad_course.lab.resumed_batches`). Interrupted
# after batch 6 of 16, backups every 3 batches:

# %%
from distgrad_course.lab.tf_keras_runner import run_tf_keras

legacy = {data: run_tf_keras("distgrad_course.lab.resumed_batches:trained_batches", replicas=R,
                           data=data).value for data in ("arrays", "dataset")}
keras3 = run_child("distgrad_course.lab.resumed_batches:trained_batches",  # Keras 3, its own process
                   {"replicas": R, "data": "arrays"}).value
show_table(["Keras", "data", "batches the restart trained", "updates", "w (uninterrupted 72)"], [
    (runs["keras"], data, str(runs["resumed"]["batches"]), runs["resumed"]["updates"],
     runs["resumed"]["w"]) for data, runs in [*legacy.items(), ("arrays", keras3)]])
assert legacy["arrays"]["resumed"]["batches"] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
assert legacy["dataset"]["resumed"]["batches"] == [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]
assert all(runs["resumed"]["updates"] == 16 and runs["resumed"]["w"] == 60.0
           for runs in legacy.values())  # the right count; batches 6 and 7 never trained
assert keras3["resumed"]["updates"] == 22 and keras3["resumed"]["w"] == 93.0

# %% [markdown]
# With arrays, one iterator serves all epochs, so the shift carries into epoch 1; with a
# dataset, epoch 1 starts over right. Either way batches 0 and 1 are trained twice and 6
# and 7 of the interrupted epoch never: the update count hides it. The
# [upstream page](../upstream.md#backup-and-restore-replays-epoch) reproduces both.

# %% [markdown]
# ## Deep dive · What a mid-cycle backup costs
#
# A backup in the middle of a cycle must hold the micro-batches accumulated so far:
# `AccumulatingOptimizer` keeps them in float32 replica-local variables, one copy per
# replica on the devices, and `save_weights` writes their sum over the replicas, one float32
# copy of the trainable weights. Measured in the backup file, mid-cycle and at a boundary:

# %%
import h5py

probe = backup.build(strategy)
with strategy.scope():
    probe.optimizer.build(probe.trainable_variables)
params = sum(int(np.prod(w.shape)) for w in probe.trainable_weights)
accumulators = [i for i, v in enumerate(probe.optimizer.variables)
                if v.path.endswith("_accumulated_gradient")]
copies = {len(strategy.experimental_local_results(probe.optimizer.variables[i].value))
          for i in accumulators}

def accumulators_in_backup(cut):  # (bytes, any nonzero) after a fit stopped after `cut`
    directory = os.path.join(work, f"bytes-{cut}")
    try:
        backup.one_fit(strategy, directory, save_freq=1, stop=backup.Interrupt(cut))
    except backup.Preempted:
        pass
    with open(os.path.join(directory, "training_metadata.json")) as file:
        weights = json.load(file)["weights"]  # the file the backup's manifest names
    with h5py.File(os.path.join(directory, weights)) as file:
        stored = [file[f"optimizer/vars/{i}"] for i in accumulators]
        return (sum(d.size * d.dtype.itemsize for d in stored),
                any(np.any(np.asarray(d) != 0) for d in stored))

mid_cycle, boundary = accumulators_in_backup(4), accumulators_in_backup(3)  # K = 3
show_table(["backup after", "accumulator bytes in the file", "an open cycle"], [
    ("micro-batch 4 (mid-cycle)", mid_cycle[0], mid_cycle[1]),
    ("micro-batch 3 (a cycle boundary)", boundary[0], boundary[1])])
assert mid_cycle == (4 * params, True) and boundary == (4 * params, False)
assert copies == {R}  # every accumulator: one copy per replica
print(f"{params} trainable weights; each accumulator has {R} copies on the devices")

# %% [markdown]
# So the file holds 4 bytes per trainable weight for the accumulators, at a boundary too
# (zeros then): they are optimizer variables, written at every backup. Backing up only at
# cycle boundaries saves nothing on disk; it costs up to k − 1 micro-batches trained again
# after a preemption. On the devices, each replica holds its own float32 copy.

# %% [markdown]
# ## Deep dive · A kill while the backup is written
#
# A process can die while it writes, and on object storage (gs://, s3://) a rename is a
# copy followed by a delete: only the write of one object is atomic. So each backup writes
# its weights under a new name, `ckpt-<n>.weights.h5`, then commits them by writing one
# small object that names them, `training_metadata.json` (as `.tmp`, then renamed: atomic on
# a local disk, one object copied in a bucket); only then is the previous backup's file
# deleted. A restart reads that manifest and the file it names only: killed before the
# commit, it finds the previous backup whole, after it the new one
# (`tests/backup_and_restore/test_backup_commit.py` kills the process at every file
# operation of a backup, on emulated object storage, on 1 and 2 workers). Here, the state a
# kill just before the second backup's commit leaves, and the restart that reads it:

# %%
between = os.path.join(work, "between")
callback, rename = BackupAndRestore(between, save_freq=3), tf.io.gfile.rename
calls = []

def rename_then_die(*args, **kwargs):
    calls.append(args)
    if len(calls) == 2:  # the second backup's commit: its manifest renamed over the first's
        raise backup.Preempted("killed before the commit")
    return rename(*args, **kwargs)

model = backup.build(strategy)
tf.io.gfile.rename = rename_then_die
try:
    model.fit(backup.dataset(), epochs=2, shuffle=False, verbose=0, callbacks=[callback])
except backup.Preempted:
    pass
finally:
    tf.io.gfile.rename = rename
backup.free_stopped_fit()  # its data iterator, now (gc.collect(), as in the fix)
print(sorted(os.listdir(between)))
assert sorted(os.listdir(between)) == ["ckpt-1.weights.h5", "ckpt-2.weights.h5",
                                       "training_metadata.json", "training_metadata.json.tmp"]
with open(os.path.join(between, "training_metadata.json")) as file:
    assert json.load(file)["weights"] == "ckpt-1.weights.h5"  # not committed: the first
resumed = backup.one_fit(strategy, between)
assert resumed.updates == uninterrupted.updates and resumed.micro_steps == 16
for got, want in zip(resumed.weights, uninterrupted.weights):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
print("resumed from the backup of batch 3: equal to the uninterrupted run")

# %% [markdown]
# ## Deep dive · A `SIGTERM`: finish the batch, back up, exit 42
#
# Spot VMs and schedulers (SLURM, Kubernetes) send `SIGTERM` some seconds before they kill
# the process. `BackupAndRestore` handles it unless `handle_sigterm=False`: the batch then
# running is finished and backed up, whatever `save_freq` says, and the process exits with
# status `PREEMPTED_EXIT_CODE`, 42 (the code `tf.distribute`'s own preemption handling
# restarts on). A job script requeues on it: in SLURM, `[ $? -eq 42 ] && scontrol requeue
# $SLURM_JOB_ID`. A handler installed before `fit` is called too, and is back in place
# after it. Here the process signals itself after batch 5 of the default
# `save_freq="epoch"`, which alone would lose the epoch; Python runs the handler during
# batch 6, whose end is backed up:

# %%
import signal

from distgrad import PREEMPTED_EXIT_CODE

handler_before = signal.getsignal(signal.SIGTERM)
sigterm_dir = os.path.join(work, "sigterm")
try:
    backup.one_fit(strategy, sigterm_dir, save_freq="epoch", stop=backup.TermSelf(5))
    raise AssertionError("the SIGTERM did not end the fit")
except SystemExit as exited:  # a script exits here; the notebook's kernel catches it
    status = exited.code
with open(os.path.join(sigterm_dir, "training_metadata.json")) as file:
    at_sigterm = json.load(file)
print(f"exit status {status}; backup of epoch {at_sigterm['epoch']}, "
      f"{at_sigterm['batches_done']} batches done")
assert status == PREEMPTED_EXIT_CODE == 42
assert (at_sigterm["epoch"], at_sigterm["batches_done"]) == (0, 6)
assert signal.getsignal(signal.SIGTERM) is handler_before
backup.assert_same_run(backup.one_fit(strategy, sigterm_dir, save_freq="epoch"),
                       uninterrupted)
print("resumed after batch 6: equal to the uninterrupted run")

# %% [markdown]
# On several workers, every worker must back up after the same batch: the backup is a
# collective. Each step all-reduces, so no worker is more than one batch ahead of another:
# the worker that got the signal picks the batch after the one it finished and publishes it
# in the coordination service's key-value store, as `PreemptionCheckpointHandler` does;
# every worker's watcher thread acknowledges it before that batch can end. Between signals
# the handler costs a look at a flag per batch (`benchmarks/sigterm_cost.py`).
# `tests/backup_and_restore/test_backup_sigterm.py` signals one worker of two: both back up
# after the same batch, both exit with 42, and the restarted cluster equals the
# uninterrupted run.

# %% [markdown]
# ## Deep dive · A restart on fewer replicas or workers
#
# A spot cluster may come back smaller. Every backup records the global batch, the replicas
# and the workers. `save_weights` writes a replica-local sum (an accumulator) as its SUM
# over the replicas, and a restore gives each of the R replicas SUM / R
# (`on_read_assign_cross_replica` in `tensorflow/python/distribute/values_util.py`), so with
# the same global batch the next update all-reduces the same totals. Backed up after 7
# batches on R replicas (mid-cycle: k = 3), the job restarts on one replica: first with
# half the global batch, then with the same:

# %%
one_replica = tf.distribute.MirroredStrategy(devices[:1])
smaller = os.path.join(work, "smaller")
try:
    backup.one_fit(strategy, smaller, save_freq=1, stop=backup.Interrupt(7))
except backup.Preempted:
    pass
half = backup.dataset(2 * backup.BATCHES, backup.GLOBAL_BATCH // 2)
try:
    backup.one_fit(one_replica, smaller, save_freq=1, data=half)
    raise AssertionError("another global batch was not refused")
except ValueError as error:
    print(textwrap.fill(str(error)[:560] + " ...", 96))
    assert f"replicas: {R} (recorded) vs 1 now, and the global batch is 8 (recorded) vs 4" \
        in str(error)
with open(os.path.join(smaller, "training_metadata.json")) as file:
    assert json.load(file)["batches_done"] == 7  # the refused restart left it as it was
backup.assert_same_run(backup.one_fit(one_replica, smaller, save_freq=1), uninterrupted)
print(f"stopped on {R} replicas, resumed on 1 with the same global batch: equal")

# %% [markdown]
# The same holds for workers: `tests/backup_and_restore/test_backup_sigterm.py::
# test_two_workers_stopped_resume_exactly_on_one_and_refuse_workers_on_their_own_dirs` stops
# two workers with a `SIGTERM` and resumes them exactly in one process on one replica.

# %% [markdown]
# ## Takeaways
#
# * Keras 3's `BackupAndRestore(save_freq=n)` restarts the interrupted epoch from its first
#   batch with the backup's weights: batches trained twice, updates made twice.
# * An exact resume restores the model, the optimizer (accumulators, `micro_steps`, loss
#   scale), the epoch and the position in the data: `distgrad.BackupAndRestore`, with a
#   `ResumableFitModel` (or the `ResumableFit` mixin) to hand it `fit`'s data.
# * The data must come in the same order at every start: no unseeded shuffle, no reshuffle
#   per iteration; the callback refuses them at `fit` start.
# * On several workers, the chief's backup is the one every worker restores, and a dead
#   peer fails the survivors within the collective timeout: restart the whole cluster.
# * A `SIGTERM` loses nothing: the callback finishes the batch, every worker backs it up,
#   and the process exits with 42, the status to requeue on.
# * In a custom loop, checkpoint the `GradientAccumulator` and a micro-batch count, and
#   `skip` that many batches when the pipeline is rebuilt: TensorFlow 2.21 cannot
#   checkpoint a distributed iterator. Under `PreemptionCheckpointHandler`, one all-reduce
#   per micro-batch keeps the workers in step, so that all of them save.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 1 · A backup every batch
#
# With `save_freq=1` a backup follows every batch. Run section 2's experiment with
# `save_freq=1` for both callbacks: how many updates does Keras' callback make now, and
# which batches does the restart train?

# %% [markdown]
# #### Answer
#
# The backup after batch 7 holds batches 0–6; Keras' callback restarts epoch 0 from batch 0
# and trains all 16 batches again: 7 + 16 = 23 updates. distgrad's reads and drops 0–6 and
# trains 7–15: 16 updates, nothing trained twice or lost.

# %%
every = {name: backup.timeline(strategy, tempfile.mkdtemp(), name, cut=7, save_freq=1,
                               kind="adam") for name in ("keras", "distgrad")}
print({name: (t.updates, t.resumed_trained[0]) for name, t in every.items()})
assert every["keras"].updates == 23 and every["keras"].resumed_trained == list(range(16))
assert every["distgrad"].updates == 16 and every["distgrad"].resumed_read == list(range(7))

# %% [markdown]
# ### Exercise 2 · A seeded shuffle that reshuffles
#
# `dataset.shuffle(64, seed=1)` has a seed. Is it accepted with `save_freq=3`? Predict, then
# try it with the fix's callback on `backup.dataset().unbatch().shuffle(64, seed=1).batch(8)`.

# %% [markdown]
# #### Answer
#
# Refused: `reshuffle_each_iteration` defaults to True, so each epoch's iterator draws a new
# order, and a new process starts that sequence over: resumed in epoch 1 it would read
# epoch 0's order. `reshuffle_each_iteration=False` (the fix's pipeline) is accepted, as is
# `.shuffle(..., seed=...).repeat()` with `fit(steps_per_epoch=...)`, one iterator for all
# epochs.

# %%
model = backup.build(strategy, "adam")
try:
    model.fit(backup.dataset().unbatch().shuffle(64, seed=1).batch(8), epochs=2, verbose=0,
              shuffle=False, callbacks=[BackupAndRestore(tempfile.mkdtemp(), save_freq=3)])
    raise AssertionError("a reshuffling dataset was not refused")
except ValueError as error:
    print(textwrap.fill(str(error)[:200] + " ...", 96))
    assert "with reshuffle_each_iteration=True" in str(error)
backup.free_stopped_fit()

# %% [markdown]
# ## Further reading
#
# * Keras `keras/src/callbacks/backup_and_restore.py`; the
#   [upstream page](../upstream.md#backup-and-restore-replays-epoch) has a stock-only
#   reproduction, Keras 3's and tf-keras' numbers, and a sketch of the upstream fix.
# * TensorFlow tutorial *Multi-worker training with Keras* (fault tolerance with
#   `BackupAndRestore`); `tf.distribute.experimental.PreemptionCheckpointHandler`
#   (`tensorflow/python/distribute/failure_handling/failure_handling.py`);
#   tensorflow/tensorflow#24408 (no checkpointable state for the multi-device iterator).
# * The [API reference](../api.md): `distgrad.BackupAndRestore` (object stores, `SIGTERM`,
#   another worker count), `ResumableFitModel`, `AccumulatingOptimizer`,
#   `GradientAccumulator`, `MultiWorkerFitModel`.
