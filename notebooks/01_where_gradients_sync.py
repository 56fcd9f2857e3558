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
# **The question** ([TensorFlow forum](../questions.md#q1)). The custom-training-loop
# tutorial calls `optimizer.apply_gradients` *inside* the per-replica `train_step`, and
# only reduces the losses explicitly. So where are the gradients summed — does
# `strategy.run` do it? And could that explain unstable losses?
#
# **Short answer.** `strategy.run` syncs nothing. The sum happens *inside*
# `apply_gradients`: Keras' TensorFlow optimizer calls `ReplicaContext.all_reduce(SUM)`
# on the gradients from each replica; `MirroredStrategy` carries that out with a
# `merge_call` (every replica pauses, one `batch_reduce_to` runs in cross-replica
# context), and a second `merge_call` writes the same update into every mirrored copy.
# Because it is a SUM, each replica's loss must be divided by the **global** batch size
# — otherwise the step is R times too large.
#
# This lesson proves each of those statements by running them, on 2 logical CPU
# replicas here (or on your GPUs: the code does not change).

# %%
import distgrad

strategy = distgrad.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
distgrad.environment_report(strategy)

# %%
import keras
import numpy as np
import tensorflow as tf
from distgrad.lab.spy import record_sync_path, summarize_path

from distgrad.lab.compare import check_close, update_ratio, updates, weight_diff, weights_of
from distgrad.lab.data import regression_data, tiny_model
from distgrad.lab.graph import count_collectives
from distgrad.lab.recipes import big_batch_reference, make_replica_step, run_steps

# Every experiment below builds fresh tf.functions on purpose; silence the retracing notes.
tf.get_logger().setLevel("ERROR")
assert R >= 2, "this lesson is about several replicas: set DISTGRAD_REPLICAS >= 2"
GLOBAL_BATCH = 8 * R
x, y = regression_data(GLOBAL_BATCH)
sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731

# %% [markdown]
# ## 1 · Reproduce the tutorial's loop, and check it is right
#
# `make_replica_step` is the tutorial's `train_step`: forward pass, per-example loss,
# `tf.nn.compute_average_loss(..., global_batch_size=GLOBAL_BATCH)`, gradients,
# `optimizer.apply_gradients`. `run_steps` wraps it in
# `tf.function(lambda batch: strategy.run(train_step, ...))` and reduces the losses with
# `strategy.reduce(SUM, ...)` exactly like the tutorial. We compare its weights with one
# device training on the whole batch.

# %%
distributed = run_steps(strategy, sgd, x, y, make_replica_step(GLOBAL_BATCH), steps=3)
one_device = big_batch_reference(sgd, x, y, steps=3)
diff = check_close(distributed.final, one_device)
print(f"{R} replicas vs 1 device after 3 SGD steps: {diff}")
assert distributed.copies_agree  # every replica's copy of every variable is identical
assert distributed.iterations == 3  # one optimizer step per call, not one per replica

# %% [markdown]
# So the replicas *are* synchronized — something summed their gradients. Let us find it.
#
# ## 2 · Look inside: the call path of `apply_gradients`
#
# `record_sync_path` spies on the functions between `apply_gradients` and the variable
# write (in the installed Keras: `keras/src/optimizers/base_optimizer.py` and
# `keras/src/backend/tensorflow/optimizer.py`; in TensorFlow:
# `tensorflow/python/distribute/distribute_lib.py`) and records the distribution
# context each call ran in. A `tf.function` runs its Python only while tracing, so we
# trace a fresh one.

# %%
with strategy.scope():
    model, optimizer = tiny_model(), sgd()
    optimizer.build(model.trainable_variables)
replica_step = make_replica_step(GLOBAL_BATCH)
batch = next(iter(strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))))


@tf.function
def distributed_step(batch):
    return strategy.run(replica_step, args=(model, optimizer, *batch))


_, events = record_sync_path(distributed_step.get_concrete_function, batch)
path = summarize_path(events)
for function, context, calls in path:
    print(f"{function:45s} {context:14s} x{calls}")

# %%
calls = {(function, context): n for function, context, n in path}
order = [function for function, _, _ in path]
# apply_gradients runs once per replica, in replica context...
assert calls[("BaseOptimizer.apply_gradients", "replica")] == R
# ...where the TF backend asks for the SUM of the gradients: the sync point
assert calls[("ReplicaContext.all_reduce", "replica")] == R
# MirroredStrategy does it through merge_call: one batch_reduce_to, cross-replica context
assert calls[("StrategyExtendedV2.batch_reduce_to", "cross-replica")] == 1
# three merge_calls per replica: the all-reduce, the update, iterations.assign_add
assert calls[("ReplicaContext.merge_call", "replica")] == 3 * R
# the second merge_call runs the update once, in cross-replica context, writing every copy
assert calls[("TFOptimizer._distributed_tf_update_step", "cross-replica")] == 1
n_variables = len(model.trainable_variables)
assert calls[("SGD.update_step", "cross-replica")] == n_variables * R
# clipping happens before the sum (section 5 shows why that matters)
assert order.index("BaseOptimizer._clip_gradients") < order.index("ReplicaContext.all_reduce")

# %% [markdown]
# Read top to bottom, this is the journey of a gradient: computed per replica, clipped
# (if asked) per replica, summed by `ReplicaContext.all_reduce` *inside*
# `apply_gradients` — which `MirroredStrategy` implements as a `merge_call` into
# cross-replica context, where one `batch_reduce_to` reduces every replica's gradients
# at once — then written once into every mirrored copy by a second `merge_call`. The
# [call-path diagram](../call-path.md) draws it.
#
# ## 3 · `strategy.run` itself synchronizes nothing
#
# Count the collective ops in the traced graph. The full step has one all-reduce (one
# `CollectiveReduceV2` per replica: the gradients are packed into one reduction). A
# replica function that computes the same gradients but does not apply them has none.

# %%
with strategy.scope():
    full_step = count_collectives(distributed.step_function, distributed.batch)
gradients_only = run_steps(strategy, sgd, x, y, make_replica_step(GLOBAL_BATCH, apply="none"))
with strategy.scope():
    no_apply = count_collectives(gradients_only.step_function, gradients_only.batch)
print("full step:", full_step.op_types, "->", full_step.all_reduces, "all-reduce")
print("gradients only:", no_apply.op_types, "->", no_apply.all_reduces, "all-reduces")
assert full_step.all_reduces == 1
assert no_apply.all_reduces == 0
assert weight_diff(gradients_only.final, gradients_only.initial).max_abs == 0.0

# %% [markdown]
# ## 4 · The loss must be scaled by the global batch
#
# The all-reduce is a **SUM**. If each replica averages its loss over its own
# `GLOBAL_BATCH / R` examples, the sum of R such gradients is R times the full-batch
# mean gradient. With SGD the update is then exactly R times too large: as if the
# learning rate were multiplied by R — a classic source of "unstable losses".

# %%
from distgrad.pitfalls import per_replica_mean

record = per_replica_mean.reproduce(strategy)
print(record)
assert abs(record.ratio - R) < 1e-6 * R  # the update is R times the one-device update
assert abs(record.global_scaling_ratio - 1) < 1e-6  # compute_average_loss gets it right

# %% [markdown]
# ### What `strategy.reduce(SUM, per_replica_losses)` does and doesn't do
#
# It only **reports**: it moves the scalar losses to the host. With global-batch scaling
# each replica's loss is its share of the full-batch mean, so their SUM *is* the
# full-batch mean loss. With per-replica means the same SUM reports R times the loss
# (MEAN would have been the right reduction then — but the gradients are still wrong).
# Dropping the reduce changes no weight.

# %%
initial_model = tiny_model()  # same seed: the initial weights of every run
full_batch_loss = float(tf.reduce_mean(tf.square(initial_model(x) - y)))
print(f"full-batch loss {full_batch_loss:.6f}; reported (global scaling) "
      f"{record.reported_loss_global:.6f}; reported (per-replica mean) "
      f"{record.reported_loss_per_replica_mean:.6f}")
assert abs(record.reported_loss_global - full_batch_loss) < 1e-6 * full_batch_loss
assert abs(record.reported_loss_per_replica_mean - R * full_batch_loss) < 1e-5 * full_batch_loss

with strategy.scope():
    unreported_model, unreported_optimizer = tiny_model(), sgd()
    unreported_optimizer.build(unreported_model.trainable_variables)
tf.function(lambda b: strategy.run(replica_step, args=(unreported_model, unreported_optimizer, *b)))(batch)
one_step = run_steps(strategy, sgd, x, y, make_replica_step(GLOBAL_BATCH))
check_close(weights_of(unreported_model), one_step.final, rtol=0, atol=0)

# %% [markdown]
# ### Can you turn the optimizer's SUM off and all-reduce yourself?
#
# In `tf.keras` (Keras 2) you could: `apply_gradients(..., experimental_aggregate_gradients=False)`.
# Keras 3 removed the flag; the TensorFlow optimizer always sums in replica context. So
# if you all-reduce the gradients yourself (say, to inspect or clip them) and then call
# `apply_gradients`, they are summed **twice**: the update is R times too large, and the
# step pays two all-reduces.

# %%
from distgrad.pitfalls import double_sum

record = double_sum.reproduce(strategy)
print(record.aggregate_flag_error)
print(f"update ratio {record.ratio:.6f}, all-reduces per step {record.all_reduces}")
assert record.aggregate_flag_error.type == "TypeError"
assert record.aggregate_flag_error.contains("experimental_aggregate_gradients")
assert abs(record.ratio - R) < 1e-6 * R
assert record.all_reduces == 2

# %% [markdown]
# ## 5 · Where the sync happens decides what clipping sees
#
# `BaseOptimizer._backend_apply_gradients` calls `self._clip_gradients(grads)` and *then*
# `_backend_update_step`, whose first act is the all-reduce. Under MirroredStrategy,
# `clipnorm` and `global_clipnorm` therefore clip each replica's **partial** gradient,
# and the clipped parts are summed. One device clips the full gradient. Same data, same
# optimizer, different update. TensorFlow's pre-Keras-3 optimizers refused clipping under
# a strategy for exactly this reason (tensorflow/tensorflow#33929).

# %%
from distgrad.pitfalls import clip_before_sync

clip = clip_before_sync.reproduce(strategy, "global_clipnorm", clip_norm=0.05)
print(f"one-device update (max abs):          {clip.one_device_update_max_abs:.3e}")
print(f"{R} replicas, optimizer clipping:        {clip.optimizer_clipping_vs_one_device}")
print(f"{R} replicas, clip after the sum (fix): {clip.clip_after_sync_vs_one_device}")
assert clip.optimizer_clipping_vs_one_device.max_abs > 0.5 * clip.one_device_update_max_abs
assert clip.clip_after_sync_vs_one_device.within()  # rtol = atol = 1e-6

per_variable = clip_before_sync.reproduce(strategy, "clipnorm", clip_norm=0.05)
print(f"clipnorm (per variable): {per_variable.optimizer_clipping_vs_one_device}")
assert per_variable.optimizer_clipping_vs_one_device.max_abs > 0.5 * per_variable.one_device_update_max_abs

# %% [markdown]
# **The fix**, `distgrad.clip_by_global_norm_across_replicas`: all-reduce once to learn the
# norm of the *summed* gradient, compute the clip factor `s = min(1, c / ‖G‖)` (identical
# on every replica), and pass `s · gᵣ` to an optimizer *without* `clipnorm`. Its own SUM
# then produces exactly `s · G`. The price is one extra all-reduce per step:

# %%
import inspect

print(inspect.getsource(distgrad.clip_by_global_norm_across_replicas))

# %% [markdown]
# Weight decay is not affected: `AdamW`'s decay is applied in cross-replica context to
# the (mirrored) variables, once per step. The same equivalence check as in section 1
# holds for momentum, Adam and AdamW:

# %%
for name, make in {
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
}.items():
    run = run_steps(strategy, make, x, y, make_replica_step(GLOBAL_BATCH), steps=3)
    print(f"{name:9s} {R} replicas vs 1 device:", check_close(run.final, big_batch_reference(make, x, y, steps=3)))

# %% [markdown]
# ## Takeaways
#
# * `strategy.run` launches your function once per replica and synchronizes nothing.
# * `optimizer.apply_gradients` is the sync point: an all-reduce **SUM** requested from
#   replica context (carried out through `merge_call`), then a second `merge_call` into
#   cross-replica context, where one update is written into every copy.
# * Because it sums, divide each replica's loss by the **global** batch
#   (`tf.nn.compute_average_loss`). A per-replica mean makes every step R times too large.
# * `strategy.reduce` on the losses is reporting only.
# * Keras 3 always sums inside the optimizer: don't all-reduce before `apply_gradients`.
# * `clipnorm` / `global_clipnorm` clip per-replica partial gradients under a strategy;
#   clip the summed gradient yourself when it matters.
#
# ## Further reading
#
# * TensorFlow guide, *Custom training with tf.distribute.Strategy* (the tutorial quoted in the question).
# * `tf.distribute.ReplicaContext.merge_call` and `all_reduce` API docs.
# * tensorflow/tensorflow#33929 — clipping under distribution strategies.
# * Installed source: `keras/src/backend/tensorflow/optimizer.py`
#   (`_backend_update_step`, `_all_reduce_sum_gradients`),
#   `tensorflow/python/distribute/mirrored_run.py` (`_MirroredReplicaContext._merge_call`).
