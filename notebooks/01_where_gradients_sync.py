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
# **The question** ([TensorFlow forum, TF 2.x](../questions.md#q1)). The custom-training-loop
# tutorial calls `optimizer.apply_gradients` *inside* the per-replica `train_step`, and
# only reduces the losses explicitly. So where are the gradients summed — does
# `strategy.run` do it? And could that explain unstable losses?
#
# **Short answer.** `strategy.run` syncs nothing. The sum happens *inside*
# `apply_gradients`: Keras' TensorFlow optimizer calls `ReplicaContext.all_reduce(SUM)`
# on the gradients from each replica (Keras ≥ 3.5: before keras-team/keras#19969, Keras 3
# [summed nothing](../versions.md#below-the-bounds)); `MirroredStrategy` carries that out
# with a `merge_call` (every replica pauses, one `batch_reduce_to` runs in cross-replica
# context), and a second `merge_call` writes the same update into every mirrored copy.
# Because it is a SUM, each replica's loss must be divided by the **global** batch size
# — otherwise the step is R times too large. And because Keras 3 clips *before* that
# sum, `clipnorm` under a strategy clips each replica's part of the gradient.
#
# Every statement below is executed and asserted, on the replicas this notebook finds
# (logical CPU devices, or your GPUs: the code does not change).

# %%
import distgrad

strategy = distgrad.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
assert R >= 2, "this lesson is about several replicas: set DISTGRAD_REPLICAS >= 2"

from distgrad.lab.display import show_code, show_environment, show_table

show_environment(distgrad.environment_report(strategy))

# %%
import textwrap

import keras
import numpy as np
import tensorflow as tf

from distgrad.lab.compare import OPTIMIZERS, check_close, mirrored_copies_agree, weight_diff, weights_of
from distgrad.lab.data import regression_data, tiny_model
from distgrad.lab.graph import count_collectives
from distgrad.lab.recipes import big_batch_reference, run_steps
from distgrad.lab.spy import record_sync_path, summarize_path

# Every experiment below builds fresh tf.functions on purpose; silence the retracing notes.
tf.get_logger().setLevel("ERROR")
GLOBAL_BATCH = 8 * R
x, y = regression_data(GLOBAL_BATCH)
sgd = OPTIMIZERS["sgd"]  # keras.optimizers.SGD(0.1)

# %% [markdown]
# ## 1 · The tutorial's loop, written out
#
# The tutorial's `train_step` runs on every replica: forward pass, **per-example** loss,
# `tf.nn.compute_average_loss(..., global_batch_size=GLOBAL_BATCH)` (sum of this
# replica's losses divided by the *global* batch), gradients, `apply_gradients`. Its
# `distributed_train_step` calls it through `strategy.run` and reduces the returned
# losses with `strategy.reduce(SUM, ...)`. Here the model and optimizer are arguments,
# so that we can rerun the same step on fresh variables later.

# %%
with strategy.scope():  # mirrored variables: one copy per replica
    model = tiny_model()
    optimizer = sgd()
    optimizer.build(model.trainable_variables)  # its variables now, not inside a trace


def train_step(model, optimizer, x, y):
    """The tutorial's replica step: runs once per replica, in replica context."""
    with tf.GradientTape() as tape:
        predictions = model(x, training=True)
        per_example_loss = keras.losses.mean_squared_error(y, predictions)  # shape (B / R,)
        loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss


@tf.function
def distributed_train_step(batch):
    per_replica_losses = strategy.run(train_step, args=(model, optimizer, *batch))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)


dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
batch = next(iter(strategy.experimental_distribute_dataset(dataset)))  # replica r: r-th slice
for step in range(3):
    distributed_train_step(batch)

one_device = big_batch_reference(sgd, x, y, steps=3)  # plain steps on the whole batch
diff = check_close(weights_of(model), one_device)  # rtol = atol = 1e-6
print(f"{R} replicas vs 1 device after 3 SGD steps: max abs diff {diff.max_abs:.1e}")
assert mirrored_copies_agree(model.trainable_variables)  # every copy holds the same value
assert int(optimizer.iterations.numpy()) == 3  # one optimizer step per call, not per replica

# %% [markdown]
# The same loop with a stateful optimizer (momentum), an adaptive one (Adam) and
# decoupled weight decay (AdamW) gives the one-device weights too. `run_steps`
# (`distgrad.lab.recipes`) is the loop above on fresh variables: model and optimizer
# under the scope, `distributed_train_step`, three steps.

# %%
rows = []
for name, make in OPTIMIZERS.items():
    run = run_steps(strategy, make, x, y, train_step, steps=3)
    rows.append((name, f"{check_close(run.final, big_batch_reference(make, x, y, steps=3)).max_abs:.1e}",
                 run.iterations))
    assert run.copies_agree and run.iterations == 3
show_table(["optimizer", f"max abs diff, {R} replicas vs 1 device", "optimizer.iterations"], rows)

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
# trace a fresh copy of `distributed_train_step` (tracing runs nothing).

# %%
fresh_step = tf.function(distributed_train_step.python_function)
_, events = record_sync_path(fresh_step.get_concrete_function, batch)
path = summarize_path(events)
show_table(["function (first-call order)", "context", "calls"],
           [(f"`{function}`", context, calls) for function, context, calls in path])

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
assert calls[("SGD.update_step", "cross-replica")] == len(model.trainable_variables) * R
# the optimizer clips before it sums (section 5 measures what that does)
assert order.index("BaseOptimizer._clip_gradients") < order.index("ReplicaContext.all_reduce")
assert order.index("ReplicaContext.all_reduce") < order.index("TFOptimizer._distributed_tf_update_step")

# %% [markdown]
# Read top to bottom, this is the journey of a gradient: computed per replica, clipped
# (if asked) per replica, summed by `ReplicaContext.all_reduce` *inside*
# `apply_gradients` — which `MirroredStrategy` implements as a `merge_call` into
# cross-replica context, where one `batch_reduce_to` reduces every replica's gradients
# at once — then written once into every mirrored copy by a second `merge_call`:
#
# <div class="diagram" data-diagram="call-path">
#
# [The call path of `apply_gradients`](../call-path.md#call-path)
#
# </div>
#
# ## 3 · `strategy.run` itself synchronizes nothing
#
# Count the collective ops in the traced graph. `distributed_train_step` has one
# all-reduce (one `CollectiveReduceV2` per replica: the gradients are packed into one
# reduction). The same replica step without `apply_gradients` has none, and changes no
# weight.

# %%
def gradients_only(model, optimizer, x, y):
    """`train_step` without apply_gradients."""
    with tf.GradientTape() as tape:
        per_example_loss = keras.losses.mean_squared_error(y, model(x, training=True))
        loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
    tape.gradient(loss, model.trainable_variables)
    return loss


full_step = count_collectives(distributed_train_step, batch, replicas=R)
no_apply = run_steps(strategy, sgd, x, y, gradients_only)
no_apply_ops = count_collectives(no_apply.step_function, no_apply.batch, replicas=R)
show_table(["replica function", "collective ops in the graph", "all-reduces per step"],
           [("`train_step`", full_step.op_types, full_step.all_reduces),
            ("`gradients_only`", no_apply_ops.op_types or "none", no_apply_ops.all_reduces)])
assert full_step.all_reduces == 1
assert no_apply_ops.all_reduces == 0
assert weight_diff(no_apply.final, no_apply.initial).max_abs == 0.0

# %% [markdown]
# ## 4 · The loss must be scaled by the global batch
#
# The all-reduce is a **SUM**. If each replica averages its loss over its own
# `GLOBAL_BATCH / R` examples, the sum of R such gradients is R times the full-batch
# mean gradient. With SGD the update is then exactly R times too large: as if the
# learning rate were multiplied by R — a classic source of "unstable losses".
# (`per_replica_mean.reproduce` runs the same replica step with `tf.reduce_mean` in place
# of `compute_average_loss`.)

# %%
from distgrad.pitfalls import per_replica_mean

record = per_replica_mean.reproduce(strategy, examples=GLOBAL_BATCH)
print(f"SGD update vs one device: per-replica mean x{record.ratio:.6f}, "
      f"global batch x{record.global_scaling_ratio:.6f}")
assert abs(record.ratio - R) < 1e-6 * R  # the update is R times the one-device update
assert abs(record.global_scaling_ratio - 1) < 1e-6  # compute_average_loss gets it right

# %% [markdown]
# ### What `strategy.reduce(SUM, per_replica_losses)` does and doesn't do
#
# It only **reports**: it moves the scalar losses to the host. With global-batch scaling
# each replica's loss is its share of the full-batch mean, so their SUM *is* the
# full-batch mean loss. With per-replica means the same SUM reports R times the loss.
# Dropping the reduce changes no weight.

# %%
full_batch_loss = float(tf.reduce_mean(keras.losses.mean_squared_error(y, tiny_model()(x))))
print(f"full-batch loss {full_batch_loss:.6f}")
print(f"reported, global scaling      {record.reported_loss_global:.6f}")
print(f"reported, per-replica mean    {record.reported_loss_per_replica_mean:.6f}")
assert abs(record.reported_loss_global - full_batch_loss) < 1e-6 * full_batch_loss
assert abs(record.reported_loss_per_replica_mean - R * full_batch_loss) < 1e-5 * full_batch_loss
assert abs(record.reported_loss_per_replica_mean - R * record.reported_loss_global) < (
    1e-6 * R * record.reported_loss_global)

with strategy.scope():
    quiet_model, quiet_optimizer = tiny_model(), sgd()
    quiet_optimizer.build(quiet_model.trainable_variables)
tf.function(lambda b: strategy.run(train_step, args=(quiet_model, quiet_optimizer, *b)))(batch)
reported = run_steps(strategy, sgd, x, y, train_step)
unreported = check_close(weights_of(quiet_model), reported.final, rtol=0, atol=0)
print(f"without the reduce vs with it: max abs diff {unreported.max_abs}")  # bit for bit

# %% [markdown]
# ### A Keras 3 loss object is already divided by R
#
# The tutorial builds its per-example loss with `reduction=NONE` and divides it with
# `compute_average_loss`. Call a Keras 3 loss object with its default reduction instead
# and it returns the mean **divided by the replica count**: `Loss.__call__` ends in
# `reduce_values`, which calls `scale_loss_for_distribution` (`keras/src/losses/loss.py`)
# — `value * 1 / tf.distribute.get_strategy().num_replicas_in_sync`. On a batch whose
# every squared error is 1:

# %%
from distgrad.pitfalls import loss_object_scaling

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
# So inside `strategy.run` the default loss object already gives the right step for an
# evenly split batch, and the reason is the strategy *in scope*, not the replica
# context: a validation loss computed eagerly under `strategy.scope()` is reported R
# times too small. Use either the loss object as is, or `reduction=None` with
# `compute_average_loss` — dividing the loss object's value by the batch or by R again
# divides twice.
#
# ### A regularization term is added on every replica
#
# A penalty on the weights, `l2 · Σ ½‖w‖²`, is the same on every replica, so the SUM
# all-reduce applies its gradient R times. `tf.nn.scale_regularization_loss` divides it
# by `num_replicas_in_sync` (`tensorflow/python/ops/nn_impl_distribute.py`):

# %%
from distgrad.pitfalls import regularization_scaling

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
# ### The smaller last batch
#
# `Dataset.batch(GLOBAL_BATCH)` ends an epoch with a smaller batch unless
# `drop_remainder=True`, and `MirroredStrategy` splits it as evenly as it can. One SGD
# step on such a batch, its loss divided three ways: by the constant `GLOBAL_BATCH`
# (as in `train_step`); by `compute_average_loss`'s default, this replica's count × R;
# and by the examples the step really holds on all replicas, counted with one scalar
# all-reduce:

# %%
from distgrad.pitfalls import last_batch_scaling

show_code(last_batch_scaling.global_batch_size_of)

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

counted = run_steps(strategy, sgd, x, y, last_batch_scaling.make_replica_step("counted", GLOBAL_BATCH))
counted_ops = count_collectives(counted.step_function, counted.batch, replicas=R)
print(f"all-reduces per step, counting the examples: {counted_ops.all_reduces}")
assert counted_ops.all_reduces == full_step.all_reduces + 1  # the count: one scalar more

# %% [markdown]
# With the constant, the last step of every epoch is smaller by `examples / GLOBAL_BATCH`;
# with the default, replicas holding fewer examples get more weight. Count the examples
# (one more, scalar, all-reduce per step) or drop the remainder.
#
# ### Can you turn the optimizer's SUM off and all-reduce yourself?
#
# In `tf.keras` (Keras 2) you could: `apply_gradients(..., experimental_aggregate_gradients=False)`.
# Keras 3 removed the flag; the TensorFlow optimizer always sums in replica context. So
# if you all-reduce the gradients yourself (say, to inspect them) and then call
# `apply_gradients`, they are summed **twice**: the update is R times too large, and the
# step pays two all-reduces.

# %%
from distgrad.pitfalls import double_sum

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
# ## 5 · Where the sync happens decides what clipping sees
#
# `BaseOptimizer._backend_apply_gradients` calls `self._clip_gradients(grads)` and *then*
# `_backend_update_step`, whose first act is the all-reduce. Under MirroredStrategy,
# `clipnorm` and `global_clipnorm` therefore clip each replica's **partial** gradient,
# and the clipped parts are summed. One device clips the full gradient.
#
# tf-keras (Keras 2, `TF_USE_LEGACY_KERAS=1`) does it the other way round, in both its
# optimizers: `tf.keras.optimizers.SGD.apply_gradients` calls `aggregate_gradients`
# before the base class clips (`tf_keras/src/optimizers/optimizer.py`), and
# `optimizers.legacy.SGD` calls `_aggregate_gradients` before `_transform_gradients`
# (`optimizer_v2.py`). We measure both in a fresh tf-keras process
# (`clip_before_sync.reproduce_legacy`: the same replica step, one clipped SGD step, R
# replicas against one device).

# %%
from distgrad.pitfalls import clip_before_sync

CLIP_NORM = 0.05
keras3 = {option: clip_before_sync.reproduce(strategy, option, CLIP_NORM, examples=GLOBAL_BATCH)
          for option in ("global_clipnorm", "clipnorm")}
legacy = clip_before_sync.reproduce_legacy(R, CLIP_NORM, examples=GLOBAL_BATCH)
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
# So Keras 3's order is a **regression** from tf-keras, not a limitation that was always
# there. TensorFlow's maintainers called clipping before aggregation "usually wrong" and
# kept optimizer clipping disabled under strategies in TF 2.2 rather than ship it
# (tensorflow/tensorflow#33929); tf-keras clips after the sum, as measured above.
#
# **The fix**, in `train_step`: clip the *summed* gradient yourself and give the
# optimizer no `clipnorm`. `distgrad.clip_by_global_norm_across_replicas` all-reduces
# once to learn the norm of the sum G, computes the clip factor `s = min(1, c / ‖G‖)`
# (identical on every replica), and returns `s · gᵣ`; the optimizer's own SUM then
# produces exactly `s · G`:

# %%
show_code(distgrad.clip_by_global_norm_across_replicas)


# %%
def clipped_train_step(model, optimizer, x, y):
    """`train_step`, clipping the sum of the replicas' gradients to CLIP_NORM."""
    with tf.GradientTape() as tape:
        per_example_loss = keras.losses.mean_squared_error(y, model(x, training=True))
        loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
    gradients = tape.gradient(loss, model.trainable_variables)
    gradients = distgrad.clip_by_global_norm_across_replicas(gradients, CLIP_NORM)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))  # SGD, no clipnorm
    return loss


clipped = run_steps(strategy, sgd, x, y, clipped_train_step)
clipping_sgd = lambda: keras.optimizers.SGD(0.1, global_clipnorm=CLIP_NORM)
fixed = check_close(clipped.final, big_batch_reference(clipping_sgd, x, y))
clipped_ops = count_collectives(clipped.step_function, clipped.batch, replicas=R)
print(f"clip after the sum vs one device SGD(global_clipnorm={CLIP_NORM}): "
      f"max abs diff {fixed.max_abs:.1e}")
print(f"all-reduces per step: {clipped_ops.all_reduces} (train_step: {full_step.all_reduces})")
assert clipped_ops.all_reduces == full_step.all_reduces + 1  # the price: one more all-reduce

# %% [markdown]
# ## Takeaways
#
# * `strategy.run` launches your function once per replica and synchronizes nothing.
# * `optimizer.apply_gradients` is the sync point: an all-reduce **SUM** requested from
#   replica context (carried out through `merge_call`), then a second `merge_call` into
#   cross-replica context, where one update is written into every copy.
# * Because it sums, divide each replica's loss by the **global** batch
#   (`tf.nn.compute_average_loss`). A per-replica mean makes every step R times too large;
#   `strategy.reduce` on the losses is reporting only.
# * A Keras 3 loss object with its default reduction is already divided by R whenever a
#   strategy is in scope; regularization terms need `tf.nn.scale_regularization_loss`; the
#   last, smaller batch needs its real example count.
# * Keras 3 always sums inside the optimizer: don't all-reduce before `apply_gradients`.
# * Keras 3 clips per replica, before the sum (tf-keras clipped after it): clip the summed
#   gradient yourself.
#
# ## Exercises
#
# 1. In `train_step` (section 1), replace `global_batch_size=GLOBAL_BATCH` by
#    `global_batch_size=GLOBAL_BATCH // R`, and run that cell again. Which assertion fails,
#    and by what factor are the weights' updates off? (Section 4 has the answer.)
# 2. Which Keras 3 reductions does `scale_loss_for_distribution` touch? Read
#    `reduce_values` in `keras/src/losses/loss.py`, predict what the cell below prints for
#    `reduction="sum"` and `"mean_with_sample_weight"`, and run it.
# 3. The last cell clips at 100, above every gradient norm (the tf-keras run in section 5
#    printed norms of a few units). Predict whether Keras 3's optimizer clipping still
#    differs from one device, run it, then try `EXERCISE_CLIP_NORM = 1.0`.

# %%
EXERCISE_REDUCTION = "sum"  # try "mean_with_sample_weight", "sum_over_batch_size", None
loss_object = keras.losses.MeanSquaredError(reduction=EXERCISE_REDUCTION)
values = strategy.run(lambda yt: loss_object(tf.zeros_like(yt), tf.ones_like(yt)),
                      args=(batch[1],))
print(EXERCISE_REDUCTION, "->", [np.round(v.numpy(), 4).tolist()
                                 for v in strategy.experimental_local_results(values)])

# %%
EXERCISE_CLIP_NORM = 100.0  # above every gradient norm: nothing is clipped
exercise = clip_before_sync.reproduce(strategy, "global_clipnorm", EXERCISE_CLIP_NORM,
                                      examples=GLOBAL_BATCH)
print(f"clip at {EXERCISE_CLIP_NORM}: Keras 3 optimizer clipping vs one device, max abs diff "
      f"{exercise.optimizer_clipping_vs_one_device.max_abs:.1e}")

# %% [markdown]
# ## Further reading
#
# * TensorFlow guide, *Custom training with tf.distribute.Strategy* (the tutorial quoted
#   in the question).
# * `tf.distribute.ReplicaContext.merge_call` and `all_reduce`, `tf.nn.compute_average_loss`,
#   `tf.nn.scale_regularization_loss` API docs.
# * tensorflow/tensorflow#33929 — clipping under distribution strategies, before or after
#   aggregation.
# * Installed source: `keras/src/backend/tensorflow/optimizer.py`
#   (`_backend_update_step`, `_all_reduce_sum_gradients`), `keras/src/losses/loss.py`
#   (`scale_loss_for_distribution`), `tensorflow/python/distribute/mirrored_run.py`
#   (`_MirroredReplicaContext._merge_call`).
