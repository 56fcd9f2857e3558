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
# # 01 · Where `strategy.run` syncs your gradients
#
# **The question** ([TensorFlow forum, TF 2.x](../questions.md#q1)). The custom-training
# tutorial calls `optimizer.apply_gradients` *inside* the per-replica `train_step` and reduces
# only the losses. Where are the gradients summed: does `strategy.run` do it? Could that explain
# unstable losses?
#
# **Short answer.** The tutorial's code is right as written: section 1 runs it (its
# `compute_loss` divides by the global batch) and it equals one device. `strategy.run(train_step)`
# runs `train_step` once per replica and sums nothing. Such code is in **replica context**: one
# copy per device, each on its own slice of the batch. Code that runs once for all replicas
# (your loop, `strategy.reduce`) is in **cross-replica context**. The sum happens in
# `optimizer.apply_gradients`: called in replica context, it adds up the gradients of all
# replicas (an *all-reduce* with SUM) and writes one update into every replica's copy of the
# weights. So each replica divides its loss by the **global** batch size; dividing by its own
# slice makes every SGD or momentum step R times too large (R replicas). Adam divides by the
# gradient's own scale: there the same mistake only shrinks its ε by R (section 2). On
# **Keras 3.0–3.4** `apply_gradients` sums nothing across replicas: each copy moves by its own
# replica's gradient (keras-team/keras#19969, fixed in 3.5;
# [versions](../versions.md#below-the-bounds)). Other causes: the
# [checklist](#unstable-only-on-several-gpus-a-checklist).

# %%
import tensorflow as tf

import distgrad
import distgrad_course
from distgrad_course.lab.display import show_code, show_environment, show_table

strategy = distgrad_course.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
assert R >= 2, "this lesson is about several replicas: set DISTGRAD_REPLICAS >= 2"
tf.get_logger().setLevel("ERROR")  # no INFO lines; the cells below retrace on purpose
show_environment(distgrad_course.environment_report(strategy))

# %% [markdown]
# ## 1 · The fix
#
# The tutorial's loop, whole, ready to paste into a file: each replica divides its loss by
# `GLOBAL_BATCH`; `apply_gradients` inside `train_step` sums the gradients; the epoch's leftover
# examples are dropped.

# %% tags=["fix"]
import keras
import numpy as np
import tensorflow as tf

# Two or more replicas: your GPUs, or two logical CPUs on a machine without GPUs.
cpu = tf.config.list_physical_devices("CPU")[0]
no_gpu = not tf.config.list_physical_devices("GPU")
if no_gpu and not tf.config.get_logical_device_configuration(cpu):
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.experimental.enable_tensor_float_32_execution(False)  # exact float32 for the check
devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
strategy = tf.distribute.MirroredStrategy(devices)

GLOBAL_BATCH = 8 * strategy.num_replicas_in_sync  # one step's examples, all replicas together
rng = np.random.default_rng(0)
x = rng.normal(size=(2 * GLOBAL_BATCH + 5, 4)).astype("float32")  # 2 batches, 5 left over
y = x @ rng.normal(size=(4, 1)).astype("float32")
# The 5 leftover examples are dropped: every step holds GLOBAL_BATCH examples, the number the
# loss is divided by. (Shuffle in real training, so that other examples are left out each epoch.)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
dist_dataset = strategy.experimental_distribute_dataset(dataset)  # replica r: the r-th slice

def make_model():  # one input, one output, like the tutorial; seeded for the check below
    init = keras.initializers.GlorotUniform
    return keras.Sequential([keras.Input((4,)),
                             keras.layers.Dense(8, "tanh", kernel_initializer=init(seed=0)),
                             keras.layers.Dense(1, kernel_initializer=init(seed=1))])

with strategy.scope():  # mirrored variables: one copy per replica
    model = make_model()
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)

def train_step(x, y):  # replica context: runs once per replica, on that replica's slice
    with tf.GradientTape() as tape:
        per_example_loss = keras.losses.mean_squared_error(y, model(x, training=True))
        # Divide by the GLOBAL batch: apply_gradients below SUMs the replicas' gradients.
        loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))  # all-reduce, update
    return loss

@tf.function
def distributed_train_step(batch):
    per_replica_losses = strategy.run(train_step, args=batch)
    return strategy.reduce("SUM", per_replica_losses, axis=None)  # reporting only

for epoch in range(2):
    for batch in dist_dataset:
        loss = distributed_train_step(batch)
    print(f"epoch {epoch}: loss {float(loss):.4f}")

# %% [markdown]
# **Check**: one device, no strategy, the same batches and the plain mean loss give the same
# weights:

# %% tags=["check"]
# One device, no strategy: the same initial weights, the same batches, each batch's mean loss.
reference, reference_optimizer = make_model(), keras.optimizers.SGD(0.1)
for _epoch in range(2):
    for x_batch, y_batch in dataset:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y_batch, reference(x_batch)))
        grads = tape.gradient(loss, reference.trainable_variables)
        reference_optimizer.apply_gradients(zip(grads, reference.trainable_variables))
for w, w_reference in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(w, w_reference, rtol=1e-6, atol=1e-6)

# %% [markdown]
# ## 2 · Why it works
#
# ### Where the sum happens
#
# We trace the fix's step again with spies on the functions between `apply_gradients` and the
# variable write (`distgrad_course.lab.spy`), recording the context each ran in. Tracing runs no step.

# %%
from distgrad_course.lab.graph import count_collectives
from distgrad_course.lab.spy import record_sync_path, summarize_path

R = strategy.num_replicas_in_sync  # the fix's strategy: every cell below uses it
fresh_step = tf.function(distributed_train_step.python_function)
_, events = record_sync_path(fresh_step.get_concrete_function, batch)
path = summarize_path(events)
show_table(["function (first-call order)", "context", "calls"],
           [(f"`{function}`", context, n) for function, context, n in path])
calls = {(function, context): n for function, context, n in path}
assert calls[("BaseOptimizer.apply_gradients", "replica")] == R  # once per replica
assert calls[("ReplicaContext.all_reduce", "replica")] == R  # asks for the SUM: the sync
assert calls[("StrategyExtendedV2.batch_reduce_to", "cross-replica")] == 1  # one reduction
assert calls[("TFOptimizer._distributed_tf_update_step", "cross-replica")] == 1  # one update

# %% [markdown]
# `apply_gradients` asks for `ReplicaContext.all_reduce(SUM)` (Keras ≥ 3.5). `MirroredStrategy`
# answers with a `merge_call`: every replica stops, and one function runs once, in cross-replica
# context, where one `batch_reduce_to` sums all gradients. A second `merge_call` writes the
# update into every copy:
#
# <div class="diagram" data-diagram="call-path">
#
# [The call path of `apply_gradients`](../call-path.md#call-path)
#
# </div>

# %% [markdown]
# ### Deep dive · The call path in full
#
# Three `merge_call`s per replica and step (the all-reduce, the update, and
# `iterations.assign_add`), the update of each variable written into each copy, and the
# optimizer's clipping *before* the all-reduce (section 3 shows what that does). After the fix's
# two epochs every copy holds the same value, and the optimizer counted one step per call of
# `distributed_train_step`, not one per replica.

# %%
order = [function for function, _, _ in path]
assert calls[("ReplicaContext.merge_call", "replica")] == 3 * R
assert calls[("SGD.update_step", "cross-replica")] == len(model.trainable_variables) * R
assert order.index("BaseOptimizer._clip_gradients") < order.index("ReplicaContext.all_reduce")
assert order.index("ReplicaContext.all_reduce") < order.index(
    "TFOptimizer._distributed_tf_update_step")

from distgrad_course.lab.compare import mirrored_copies_agree

assert mirrored_copies_agree(model.trainable_variables)  # every copy holds the same value
steps_run, iterations = 2 * len(list(dataset)), int(optimizer.iterations.numpy())
print(f"the fix ran {steps_run} steps (2 epochs): optimizer.iterations = {iterations}")
assert iterations == steps_run

# %% [markdown]
# ### `strategy.run` itself synchronizes nothing
#
# The fix's traced step holds one all-reduce (the gradients, packed into one). The same replica
# step without `apply_gradients` holds none, and changes no weight:

# %%
def gradients_only(x, y):  # the fix's train_step without apply_gradients
    with tf.GradientTape() as tape:
        per_example_loss = keras.losses.mean_squared_error(y, model(x, training=True))
        loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
    return tape.gradient(loss, model.trainable_variables)

no_apply_step = tf.function(lambda batch: strategy.run(gradients_only, args=batch))
before = model.get_weights()
no_apply_step(batch)
full_step, no_apply = (count_collectives(f, batch, replicas=R)
                       for f in (distributed_train_step, no_apply_step))
print(f"all-reduces per step: train_step {full_step.all_reduces} ({full_step.op_types}), "
      f"gradients_only {no_apply.all_reduces}")
assert full_step.all_reduces == 1 and no_apply.all_reduces == 0
assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))

# %% [markdown]
# ### Divide the loss by the global batch
#
# The all-reduce is a **SUM**. A mean over a replica's own `GLOBAL_BATCH / R` examples weighs
# each example R times more than the full-batch mean, so the sum is R times the full-batch mean
# gradient. `per_replica_mean.reproduce` runs one SGD step with each loss below against one
# big-batch step on one device (`sgd_update_ratio`):

# %%
from distgrad_course.lab.recipes import replica_loss, sgd_update_ratio
from distgrad_course.pitfalls import per_replica_mean

show_code(replica_loss)

# %%
show_code(sgd_update_ratio)

# %%
mean_record = per_replica_mean.reproduce(strategy, examples=GLOBAL_BATCH)
print(f"SGD update vs one device: per-replica mean x{mean_record.ratio:.6f}, "
      f"global batch x{mean_record.global_scaling_ratio:.6f}")
assert abs(mean_record.ratio - R) < 1e-6 * R  # the update is R times the one-device update
assert abs(mean_record.global_scaling_ratio - 1) < 1e-6  # compute_average_loss gets it right

# %% [markdown]
# Momentum's first step is SGD's, R times too large
# ([deep dive](#deep-dive-momentum-adam-and-adamw-give-the-one-device-weights-too)). Adam
# divides the gradient's running mean by its root mean square plus ε, so R times every
# gradient is one device's Adam with ε / R: the step keeps its size. Three Adam steps:

# %%
from distgrad_course.lab.compare import OPTIMIZERS, check_close, update_ratio, updates, weights_of
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.recipes import big_batch_reference, make_replica_step, run_steps

lab_x, lab_y = regression_data(GLOBAL_BATCH)  # the data per_replica_mean.reproduce used
mean_step = make_replica_step(GLOBAL_BATCH, "per_replica_mean")  # the mistake
adam = run_steps(strategy, OPTIMIZERS["adam"], lab_x, lab_y, mean_step, steps=3)  # Adam(0.01)
adam_eps_over_r = big_batch_reference(lambda: keras.optimizers.Adam(0.01, epsilon=1e-7 / R),
                                      lab_x, lab_y, steps=3)
adam_diff = check_close(adam.final, adam_eps_over_r)  # rtol = atol = 1e-6
print(f"vs one device's Adam(0.01, epsilon=1e-7 / R): max abs diff {adam_diff.max_abs:.1e}")
assert OPTIMIZERS["adam"]().epsilon == 1e-7  # Keras' default

# %% [markdown]
# ### Unstable only on several GPUs? A checklist
#
# Causes one device does not have; each pitfall gives symptom, cause, fix and its lesson.
#
# | cause | check | pitfall |
# |---|---|---|
# | each replica's loss is its own slice's mean | `strategy.reduce(SUM, losses)` is one device's mean loss, not R times it | [per-replica mean](../pitfalls.md#per-replica-mean) |
# | a Keras 3 loss object (already ÷ R) divided again | the loss object as is, or `reduction=None` + `compute_average_loss`, not both | [loss object](../pitfalls.md#loss-object-scaling) |
# | a weight penalty added on every replica | it goes through `tf.nn.scale_regularization_loss` | [regularization](../pitfalls.md#regularization-scaling) |
# | a smaller last batch divided by `GLOBAL_BATCH` | `drop_remainder=True`, or divide by the examples counted | [last batch](../pitfalls.md#last-batch-scaling) |
# | gradients all-reduced by hand, then by `apply_gradients` | one all-reduce in the traced step (`distgrad_course.lab.graph.count_collectives`) | [double sum](../pitfalls.md#double-sum) |
# | `clipnorm` or `global_clipnorm` in the optimizer | none there; `distgrad.clip_by_global_norm_across_replicas` | [clipping](../pitfalls.md#clip-before-sync) |
# | `BatchNormalization` | `synchronized=True` | [BatchNorm](../pitfalls.md#batchnorm-statistics) |
# | `mixed_float16`: Keras' loss-scale wrapper reads replica 0 only | `distgrad.AllReplicasFiniteLossScaleOptimizer` | [loss scale](../pitfalls.md#lso-first-replica-finite) |
# | Keras 3.0–3.4 | `keras.__version__` ≥ 3.5 | [versions](../versions.md#below-the-bounds) |

# %% [markdown]
# ### Deep dive · What `strategy.reduce(SUM, per_replica_losses)` does and doesn't do
#
# It only **reports**: it moves the scalar losses to the host. With global-batch scaling each
# replica's loss is its share of the full-batch mean, so their SUM *is* the full-batch mean
# loss. With per-replica means the same SUM reports R times the loss. Dropping the reduce
# changes no weight.
#
# This deep dive and the next ones run the fix's replica step on the lab's small model and data
# (`tiny_model`, `regression_data`) through `distgrad_course.lab.recipes.run_steps` (a fresh model and
# optimizer under the scope, `strategy.run` per step), so the step takes them as arguments:

# %%
import textwrap


def lab_step(model, optimizer, x, y):
    """The fix's train_step, its model and optimizer passed in."""
    with tf.GradientTape() as tape:
        per_example_loss = keras.losses.mean_squared_error(y, model(x, training=True))
        loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss


sgd = OPTIMIZERS["sgd"]  # keras.optimizers.SGD(0.1)

# %%
full_batch_loss = float(tf.reduce_mean(keras.losses.mean_squared_error(lab_y, tiny_model()(lab_x))))
print(f"full-batch loss {full_batch_loss:.6f}")
print(f"reported, global scaling      {mean_record.reported_loss_global:.6f}")
print(f"reported, per-replica mean    {mean_record.reported_loss_per_replica_mean:.6f}")
assert abs(mean_record.reported_loss_global - full_batch_loss) < 1e-6 * full_batch_loss
assert abs(mean_record.reported_loss_per_replica_mean - R * full_batch_loss) < (
    1e-5 * full_batch_loss)
assert abs(mean_record.reported_loss_per_replica_mean - R * mean_record.reported_loss_global) < (
    1e-6 * R * mean_record.reported_loss_global)

with strategy.scope():
    quiet_model, quiet_optimizer = tiny_model(), sgd()
    quiet_optimizer.build(quiet_model.trainable_variables)
lab_batch = next(iter(strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((lab_x, lab_y)).batch(GLOBAL_BATCH))))
tf.function(lambda b: strategy.run(lab_step, args=(quiet_model, quiet_optimizer, *b)))(lab_batch)
reported = run_steps(strategy, sgd, lab_x, lab_y, lab_step)
unreported = check_close(weights_of(quiet_model), reported.final, rtol=0, atol=0)
print(f"without the reduce vs with it: max abs diff {unreported.max_abs}")  # bit for bit

# %% [markdown]
# ### Deep dive · Momentum, Adam and AdamW give the one-device weights too
#
# The same replica step with a stateful optimizer (momentum), an adaptive one (Adam) and
# decoupled weight decay (AdamW), three steps each, against three big-batch steps on one device:

# %%
rows = []
for name, make in OPTIMIZERS.items():
    run = run_steps(strategy, make, lab_x, lab_y, lab_step, steps=3)
    diff = check_close(run.final, big_batch_reference(make, lab_x, lab_y, steps=3))  # 1e-6
    rows.append((name, f"{diff.max_abs:.1e}", run.iterations))
    assert run.copies_agree and run.iterations == 3
show_table(["optimizer", f"max abs diff, {R} replicas vs 1 device", "optimizer.iterations"], rows)

# %% [markdown]
# With the per-replica mean instead, the first update against one device's: R times with
# momentum (its first step is SGD's), the same size with Adam.

# %%
ratios = {}
for name in ("sgd", "momentum", "adam"):
    run = run_steps(strategy, OPTIMIZERS[name], lab_x, lab_y, mean_step)
    one_device = big_batch_reference(OPTIMIZERS[name], lab_x, lab_y)
    ratios[name] = update_ratio(updates(run.final, run.initial), updates(one_device, run.initial))
print("per-replica mean, first update vs one device:",
      ", ".join(f"{name} x{ratio:.6f}" for name, ratio in ratios.items()))
assert abs(ratios["sgd"] - R) < 1e-6 * R and abs(ratios["momentum"] - R) < 1e-6 * R
assert abs(ratios["adam"] - 1) < 1e-3  # only epsilon tells R * g from g

# %% [markdown]
# ### Deep dive · A Keras 3 loss object is already divided by R
#
# The tutorial builds its per-example loss with `reduction=NONE` and divides it with
# `compute_average_loss`. Call a Keras 3 loss object with its default reduction instead and it
# returns the mean **divided by the replica count**: `Loss.__call__` ends in `reduce_values`,
# which calls `scale_loss_for_distribution` (`keras/src/losses/loss.py`), that is
# `value * 1 / tf.distribute.get_strategy().num_replicas_in_sync`. On a batch whose every
# squared error is 1:

# %%
from distgrad_course.pitfalls import loss_object_scaling

losses = loss_object_scaling.reproduce(strategy)
show_table(["called as", "where", "value on each replica"], [
    ("`keras.losses.MeanSquaredError()(y, p)`", "inside `strategy.run`", losses.loss_object),
    ("`tf.reduce_mean(mean_squared_error(y, p))`", "inside `strategy.run`", losses.reduce_mean),
    ("`compute_average_loss(..., global_batch_size=B)`", "inside `strategy.run`",
     losses.compute_average_loss),
    ("`MeanSquaredError()(y, p)`", "under `strategy.scope()`, cross-replica",
     losses.loss_object_cross_replica_in_scope),
    ("`MeanSquaredError()(y, p)`", "no strategy", losses.loss_object_without_strategy),
])
assert losses.reduce_mean == (1.0,) * R
assert losses.loss_object == (1.0 / R,) * R  # 0.5 on 2 replicas
assert losses.loss_object == losses.compute_average_loss  # the batch splits evenly
assert losses.loss_object_cross_replica_in_scope == 1.0 / R  # scaled under the scope too
assert losses.loss_object_without_strategy == 1.0
assert losses.reduction_none_sum == (losses.global_batch / R,) * R  # unscaled per example
# the tutorial's step with the loss object as its loss: the one-device SGD step
print(f"SGD step, loss object in train_step, vs one device: max abs diff "
      f"{losses.sgd_step_vs_one_device.max_abs:.1e}")
assert losses.sgd_step_vs_one_device.within()

# %% [markdown]
# So inside `strategy.run` the default loss object already gives the right step for an evenly
# split batch, and the reason is the strategy *in scope*, not the replica context: a validation
# loss computed eagerly under `strategy.scope()` is reported R times too small. Use either the
# loss object as is, or `reduction=None` with `compute_average_loss`: dividing the loss
# object's value by the batch or by R again divides twice.

# %% [markdown]
# ### Deep dive · A regularization term is added on every replica
#
# A penalty on the weights, `l2 · Σ ½‖w‖²`, is the same on every replica, so the SUM all-reduce
# applies its gradient R times. `tf.nn.scale_regularization_loss` divides it by
# `num_replicas_in_sync` (`tensorflow/python/ops/nn_impl_distribute.py`):

# %%
from distgrad_course.pitfalls import regularization_scaling

show_code(regularization_scaling.make_replica_step)

# %%
reg = regularization_scaling.reproduce(strategy, examples=GLOBAL_BATCH)
print(f"max abs diff vs one device: scaled penalty {reg.scaled_vs_one_device.max_abs:.1e}, "
      f"unscaled {reg.unscaled_vs_one_device.max_abs:.1e}")
print(f"unscaled excess = x{reg.excess_ratio:.6f} of -(R - 1)·lr·l2·w")
error = reg.cross_replica_error
print("under the scope:", textwrap.fill(f"{error.type}: {error.message}", 80,
                                        subsequent_indent="  "))
assert reg.scaled_vs_one_device.within()
assert not reg.unscaled_vs_one_device.within()
assert reg.excess_vs_expected.within()  # the penalty's gradient, R - 1 extra times
assert abs(reg.excess_ratio - 1) < 1e-4
assert reg.cross_replica_error.type == "RuntimeError"
assert reg.cross_replica_error.contains("cross replica context")

# %% [markdown]
# ### Deep dive · Can you turn the optimizer's SUM off and all-reduce yourself?
#
# In `tf.keras` (Keras 2) you could: `apply_gradients(..., experimental_aggregate_gradients=False)`.
# Keras 3 removed the flag; the TensorFlow optimizer always sums in replica context. So if you
# all-reduce the gradients yourself (say, to inspect them) and then call `apply_gradients`, they
# are summed **twice**: the update is R times too large, and the step pays two all-reduces.

# %%
from distgrad_course.pitfalls import double_sum

record = double_sum.reproduce(strategy, examples=GLOBAL_BATCH)
print(textwrap.fill(f"{record.aggregate_flag_error.type}: {record.aggregate_flag_error.message}",
                    90, subsequent_indent="  "))
print(f"update ratio {record.ratio:.6f}, all-reduces per step {record.all_reduces}")
assert record.aggregate_flag_error.type == "TypeError"
assert record.aggregate_flag_error.contains(
    "unexpected keyword argument 'experimental_aggregate_gradients'")
assert abs(record.ratio - R) < 1e-6 * R
assert record.all_reduces == 2

# %% [markdown]
# ## 3 · The packaged form
#
# The fix needs no class: the optimizer *is* the sync (k micro-batches per update:
# `distgrad.GradientAccumulator`, [lesson 02](02_accumulate_in_custom_loop.ipynb)). distgrad
# ships one function, for **clipping**: Keras 3's optimizer clips (`clipnorm`,
# `global_clipnorm`) each replica's part *before* its all-reduce. Call this between
# `tape.gradient` and `apply_gradients`, with an optimizer that does not clip: one more
# all-reduce gives the norm of the summed gradient G; every replica scales its part by
# `min(1, c / ‖G‖)`.

# %%
show_code(distgrad.clip_by_global_norm_across_replicas)

# %% [markdown]
# <div class="admonition warning">
# <p class="admonition-title">Limits</p>
#
# * **A partial last batch.** The fix drops the epoch's leftover examples
#   ([Exercise 1](#exercise-1-the-smaller-last-batch) trains on them).
# * **Clipping in the optimizer** and **BatchNorm**: the checklist's rows (clipping measured
#   in the [deep dive](#deep-dive-clipping-before-the-sync-measured)). The fix has neither.
#
# </div>

# %% [markdown]
# ### Deep dive · Clipping before the sync, measured
#
# `BaseOptimizer._backend_apply_gradients` calls `self._clip_gradients(grads)` and *then*
# `_backend_update_step`, whose first act is the all-reduce. tf-keras (Keras 2,
# `TF_USE_LEGACY_KERAS=1`) does it the other way round, in both its optimizers:
# `tf.keras.optimizers.SGD.apply_gradients` calls `aggregate_gradients` before the base class
# clips (`tf_keras/src/optimizers/optimizer.py`), and `optimizers.legacy.SGD` calls
# `_aggregate_gradients` before `_transform_gradients` (`optimizer_v2.py`). We measure both in a
# fresh tf-keras process (`clip_before_sync.reproduce_tf_keras`: the same replica step, one
# clipped SGD step, R replicas against one device).

# %%
from distgrad_course.pitfalls import clip_before_sync

CLIP_NORM = 0.05
keras3 = {option: clip_before_sync.reproduce(strategy, option, CLIP_NORM, examples=GLOBAL_BATCH)
          for option in ("global_clipnorm", "clipnorm")}
legacy = clip_before_sync.reproduce_tf_keras(R, CLIP_NORM, examples=GLOBAL_BATCH)
rows = [(f"Keras {keras.__version__} `SGD({option})`", "before",
         f"{r.optimizer_clipping_vs_one_device.max_abs:.1e}", f"{r.one_device_update_max_abs:.1e}")
        for option, r in keras3.items()]
rows += [(f"tf-keras {legacy.tf_keras} `{name}({option})`", "after",
          f"{legacy.max_abs[name, option]:.1e}", f"{legacy.update_max_abs[name, option]:.1e}")
         for name, option in legacy.max_abs]
show_table(["optimizer", "clips the all-reduce's", f"max abs diff, {R} replicas vs 1 device",
            "1-device update"], rows)
print(f"tf-keras gradient norms: full {legacy.full_gradient_norm:.2f}, per replica "
      f"{', '.join(f'{n:.2f}' for n in legacy.per_replica_gradient_norms)} (clip at {CLIP_NORM})")

# %%
for r in keras3.values():  # Keras 3: the clipped update differs by most of its own size
    assert r.optimizer_clipping_vs_one_device.max_abs > 0.5 * r.one_device_update_max_abs
# `reproduce` also clips the all-reduced sum instead (the fix below): one device's step
assert keras3["global_clipnorm"].clip_after_sync_vs_one_device.within()
assert legacy.replicas == R and legacy.tf_keras.startswith("2.")
assert set(legacy.max_abs) == {(name, option) for name in ("SGD", "legacy.SGD")
                               for option in ("global_clipnorm", "clipnorm")}
for name, option in legacy.max_abs:  # tf-keras: replicas == one device
    assert legacy.within(name, option), (name, option, legacy.max_abs[name, option])
    assert legacy.update_max_abs[name, option] > 1e3 * legacy.max_abs[name, option]
# every gradient, full and partial, is above the threshold: every run really clipped
assert min(legacy.full_gradient_norm, *legacy.per_replica_gradient_norms) > CLIP_NORM

# %% [markdown]
# So Keras 3's order is a **regression** from tf-keras, not a limitation that was always there.
# TensorFlow's maintainers called clipping before aggregation "usually wrong" and kept optimizer
# clipping disabled under strategies in TF 2.2 rather than ship it (tensorflow/tensorflow#33929);
# tf-keras clips after the sum, as measured above.
#
# The fix's `train_step` with `clip_by_global_norm_across_replicas`, and an optimizer without
# `clipnorm`: one step on the fix's first global batch is one device's
# `SGD(global_clipnorm=CLIP_NORM)` step.

# %%
with strategy.scope():
    clipped_model, clipped_optimizer = make_model(), keras.optimizers.SGD(0.1)  # no clipnorm
    clipped_optimizer.build(clipped_model.trainable_variables)


def clipped_train_step(x, y):
    with tf.GradientTape() as tape:
        per_example_loss = keras.losses.mean_squared_error(y, clipped_model(x, training=True))
        loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
    gradients = tape.gradient(loss, clipped_model.trainable_variables)
    gradients = distgrad.clip_by_global_norm_across_replicas(gradients, CLIP_NORM)  # the line
    clipped_optimizer.apply_gradients(zip(gradients, clipped_model.trainable_variables))


clipped_step = tf.function(lambda batch: strategy.run(clipped_train_step, args=batch))
clipped_step(next(iter(dist_dataset)))


def clipping_sgd():
    return keras.optimizers.SGD(0.1, global_clipnorm=CLIP_NORM)


one_device = big_batch_reference(clipping_sgd, *next(iter(dataset)), model_factory=make_model)
fixed = check_close(weights_of(clipped_model), one_device)  # rtol = atol = 1e-6
print(f"clip the sum, {R} replicas vs one device: max abs diff {fixed.max_abs:.1e}")

# %% [markdown]
# That step did clip (one device's SGD update has norm `0.1 · CLIP_NORM` exactly), and clipping
# the sum costs one all-reduce more per step:

# %%
update = [w - w0 for w, w0 in zip(one_device, make_model().get_weights())]
print(f"one-device update norm {float(tf.linalg.global_norm(update)):.6f}")
assert abs(float(tf.linalg.global_norm(update)) - 0.1 * CLIP_NORM) < 1e-6  # it clipped
clipped_ops = count_collectives(clipped_step, next(iter(dist_dataset)), replicas=R)
print(f"all-reduces per step: {clipped_ops.all_reduces} (train_step: {full_step.all_reduces})")
assert clipped_ops.all_reduces == full_step.all_reduces + 1  # the price: one more all-reduce

# %% [markdown]
# ## Takeaways
#
# * `strategy.run` runs your function once per replica, in replica context; it syncs nothing.
# * `optimizer.apply_gradients` syncs: an all-reduce SUM of the gradients, then one update
#   written into every copy.
# * So divide each replica's loss by the **global** batch; `strategy.reduce` only reports.
# * Keras 3 clips each replica's part: clip the sum yourself.
#
# ## Exercises
#
# ### Exercise 1 · The smaller last batch
#
# Remove `drop_remainder=True` from the fix: each epoch then ends with 5 examples. Compared with
# one device's step on them, what does that last step do (a) with
# `global_batch_size=GLOBAL_BATCH`, (b) with the default, `global_batch_size=None`? (c) How would
# you make it exact?

# %% [markdown]
# #### Answer
#
# (a) The loss is divided by `GLOBAL_BATCH` although the step holds fewer examples: with SGD the
# update is `examples / GLOBAL_BATCH` of one device's. (b) The default divides by this replica's
# count × R (`tensorflow/python/ops/nn_impl_distribute.py`): right when the batch splits evenly;
# otherwise replicas holding fewer examples weigh more, and the weights differ. (c) Divide by
# the examples the step really holds on all replicas, counted with one scalar all-reduce:

# %%
from distgrad_course.pitfalls import last_batch_scaling

show_code(last_batch_scaling.global_batch_size_of)

# %% [markdown]
# One SGD step on a last batch of `GLOBAL_BATCH / 2` examples (splits evenly) and of one fewer
# (does not), the loss divided each of the three ways: by the constant `GLOBAL_BATCH`
# ("fixed"), by the default ("per_replica_times_r"), and by the count ("counted"):

# %%
rows = last_batch_scaling.reproduce(strategy, GLOBAL_BATCH)
show_table(["examples", "per replica", "divided by", "update vs 1 device", "max abs diff"],
           [(r.examples, r.per_replica, r.scaling, f"x{r.ratio:.4f}",
             f"{r.vs_one_device.max_abs:.1e}") for r in rows])
by = {(r.examples, r.scaling): r for r in rows}
even, uneven = GLOBAL_BATCH // 2, GLOBAL_BATCH // 2 - 1
assert by[even, "counted"].per_replica == (even // R,) * R  # splits evenly
assert by[uneven, "counted"].per_replica == (even // R,) * (R - 1) + (even // R - 1,)  # does not
for examples in (even, uneven):  # the constant shrinks the step by examples / GLOBAL_BATCH
    assert abs(by[examples, "fixed"].ratio - examples / GLOBAL_BATCH) < 1e-6
    assert by[examples, "counted"].vs_one_device.within()
assert by[even, "per_replica_times_r"].vs_one_device.within()
assert not by[uneven, "per_replica_times_r"].vs_one_device.within()  # wrong weights

counted = run_steps(strategy, sgd, lab_x, lab_y,
                    last_batch_scaling.make_replica_step("counted", GLOBAL_BATCH))
counted_ops = count_collectives(counted.step_function, counted.batch, replicas=R)
print(f"all-reduces per step, counting the examples: {counted_ops.all_reduces}")
assert counted_ops.all_reduces == full_step.all_reduces + 1  # the count: one scalar more

# %% [markdown]
# Count the examples (one more, scalar, all-reduce per step) or drop the remainder, as the fix
# does.

# %% [markdown]
# ### Exercise 2 · Which Keras 3 reductions are divided by R?
#
# Read `reduce_values` in `keras/src/losses/loss.py`. On a batch whose every squared error is 1,
# what does `keras.losses.MeanSquaredError(reduction=...)` return on each replica inside
# `strategy.run`, for `"sum"` and for `"mean_with_sample_weight"`?

# %% [markdown]
# #### Answer
#
# `reduce_values` calls `scale_loss_for_distribution` only for `"sum_over_batch_size"`,
# `"mean"` and `"mean_with_sample_weight"`. `"sum"` is not divided by R: each replica returns the
# sum over its own `GLOBAL_BATCH / R` examples. `None` returns the per-example losses.

# %%
def loss_on_each_replica(reduction):
    loss_object = keras.losses.MeanSquaredError(reduction=reduction)
    values = strategy.run(lambda yt: loss_object(tf.zeros_like(yt), tf.ones_like(yt)),
                          args=(batch[1],))
    return [float(v.numpy()) for v in strategy.experimental_local_results(values)]


for reduction in ("sum", "mean_with_sample_weight", "sum_over_batch_size"):
    print(f"{reduction:>24} -> {loss_on_each_replica(reduction)}")
np.testing.assert_allclose(loss_on_each_replica("sum"), [GLOBAL_BATCH / R] * R, rtol=1e-6)
np.testing.assert_allclose(loss_on_each_replica("mean_with_sample_weight"), [1 / R] * R, rtol=1e-6)
np.testing.assert_allclose(loss_on_each_replica("sum_over_batch_size"), [1 / R] * R, rtol=1e-6)

# %% [markdown]
# ### Exercise 3 · A clip norm between the parts and the whole
#
# The clipping deep dive printed the gradient's norm and each replica's part's. Set
# `global_clipnorm` between the largest part and the whole: does Keras 3 under the strategy
# still differ from one device? And at 100, above every norm?

# %% [markdown]
# #### Answer
#
# Between the two, one device clips (the full norm is above `clip_norm`) and no replica does
# (every part is below it): Keras 3 applies the unclipped sum, a larger step than one device's.
# At 100 nobody clips, and the two agree: the difference comes from clipping alone.

# %%
between = (max(legacy.per_replica_gradient_norms) + legacy.full_gradient_norm) / 2
assert max(legacy.per_replica_gradient_norms) < between < legacy.full_gradient_norm
for clip_norm in (between, 100.0):
    result = clip_before_sync.reproduce(strategy, "global_clipnorm", clip_norm,
                                        examples=GLOBAL_BATCH)
    print(f"clip at {clip_norm:.2f}: Keras 3 optimizer clipping vs one device, max abs diff "
          f"{result.optimizer_clipping_vs_one_device.max_abs:.1e}")
    assert result.optimizer_clipping_vs_one_device.within() == (clip_norm == 100.0)
    assert result.clip_after_sync_vs_one_device.within()  # clipping the sum: always right

# %% [markdown]
# ## Further reading
#
# * TensorFlow guide, *Custom training with tf.distribute.Strategy* (the question's tutorial).
# * API docs: `tf.distribute.ReplicaContext` (`merge_call`, `all_reduce`),
#   `tf.nn.compute_average_loss`, `tf.nn.scale_regularization_loss`.
# * tensorflow/tensorflow#33929: clipping before or after aggregation.
# * keras-team/keras#19969 (relanded as #20051): Keras 3 sums the replicas' gradients from 3.5.
# * Installed source: `keras/src/backend/tensorflow/optimizer.py` (`_backend_update_step`),
#   `keras/src/losses/loss.py` (`scale_loss_for_distribution`),
#   `tensorflow/python/distribute/mirrored_run.py` (`_MirroredReplicaContext._merge_call`).
