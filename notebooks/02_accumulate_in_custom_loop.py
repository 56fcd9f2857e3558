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
# # 02 · Accumulating gradients in a custom loop under `MirroredStrategy`
#
# **The question** ([asked in Spanish, TF 2.x](../questions.md#q2)). A model grew and no
# longer fits on the GPUs with the old batch size; smaller batches make the gradient
# noisy. Can you accumulate gradients over several batches under `MirroredStrategy`? The
# user tried the obvious loop
#
# ```python
# for b in batches:
#     per_replica_gradients = strategy.run(fn=self.train_step, args=(model, data))
#     total_gradient += per_replica_gradients
# optimizer.apply_gradients(zip(total_gradient, model.trainable_variables))
# ```
#
# and TensorFlow answered that gradients must be applied inside `strategy.run`. The
# posted answer keeps a list of accumulator variables, runs `strategy.experimental_run_v2`,
# sums `experimental_local_results`, divides by the number of steps and applies.
#
# **Short answer.** Yes, and it costs *one* all-reduce per update. Keep the question's
# `strategy.run(fn=train_step, ...)`, but let `train_step` add its gradients to a
# replica-local buffer (a `SyncOnRead` variable: no communication) instead of returning
# them; divide every micro-batch loss by the global batch of the *whole update*; and
# apply once per k micro-batches with a second `strategy.run`, where the optimizer's own
# SUM all-reduce is the single sync. Below we reproduce the question and the posted
# answer, write that loop, prove that it equals one big-batch step, and then use its
# packaged form, `distgrad.GradientAccumulator`.

# %%
import distgrad

strategy = distgrad.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
assert R >= 2, "this lesson is about several replicas: set DISTGRAD_REPLICAS >= 2"

from distgrad.lab.display import show_code, show_environment, show_table

show_environment(distgrad.environment_report(strategy))

# %%
import tempfile
import textwrap
import types

import keras
import matplotlib.pyplot as plt
import numpy as np
import tensorflow as tf

from distgrad.lab.compare import (OPTIMIZERS, check_close, check_not_close, update_ratio,
                                  updates, weights_of)
from distgrad.lab.data import regression_data, tiny_model
from distgrad.lab.graph import count_collectives, graph_op_types
from distgrad.lab.recipes import big_batch_reference
from distgrad.pitfalls import lazy_slot_creation, outside_strategy_run

# Every experiment below builds fresh tf.functions on purpose; silence the retracing notes.
tf.get_logger().setLevel("ERROR")
EXAMPLES = 8 * R  # the big batch of one update: divisible by k * R for k in 1, 2, 4
x, y = regression_data(EXAMPLES)
sgd, adam = OPTIMIZERS["sgd"], OPTIMIZERS["adam"]  # SGD(0.1), Adam(0.01)


def full_batch_loss(weights):
    """Mean loss of the model with `weights` on the whole big batch."""
    model = tiny_model()
    model.set_weights(weights)
    return float(tf.reduce_mean(keras.losses.mean_squared_error(y, model(x))))

# %% [markdown]
# ## 1 · Reproduce the question's loop
#
# Called from cross-replica context (your Python loop, or a `tf.function` around
# `strategy.run`), `strategy.run` returns one **`PerReplica`** value per gradient: a
# container of R tensors, one per device. It is not a tensor: Python `+` is not defined
# on it, and `apply_gradients` needs *replica* context to all-reduce
# (`TFOptimizer._all_reduce_sum_gradients`) and to `merge_call` into the update. We run
# the loop over two micro-batches and capture each error.

# %%
record = outside_strategy_run.reproduce(strategy, examples=EXAMPLES)


def last_line(error):
    return error.message.strip().splitlines()[-1].strip()


print("strategy.run returned:", record.gradient_type)
show_table(["the question's step", "raises"], [
    ("`per_replica + per_replica`", f"{record.sum_error.type}: {last_line(record.sum_error)}"),
    ("`apply_gradients`, outside the scope",
     f"{record.apply_outside_scope_error.type}: {last_line(record.apply_outside_scope_error)}"),
    ("`apply_gradients`, under `strategy.scope()`",
     f"{record.apply_in_scope_error.type}: {last_line(record.apply_in_scope_error)}"),
    ("the same, in a `tf.function`", last_line(record.apply_in_traced_function_error)),
])

# %%
assert record.gradient_type == "PerReplica"
assert record.sum_error.type == "TypeError"
assert record.sum_error.contains("unsupported operand type(s) for +: 'PerReplica' and 'PerReplica'")
assert record.apply_outside_scope_error.type == "ValueError"
assert record.apply_outside_scope_error.contains(
    "Type PerReplica is not supported as a gradient source or gradient target")
for error in (record.apply_in_scope_error, record.apply_in_traced_function_error):
    assert error.type == "AttributeError"
    assert error.contains("'NoneType' object has no attribute 'merge_call'")

# %% [markdown]
# Keras 3's message is cryptic: under the scope there is no replica context, and
# `maybe_merge_call` (`tensorflow/python/distribute/merge_call_interim.py`) calls
# `get_replica_context().merge_call` on `None`. The message the user quoted came from
# tf.keras 2's `OptimizerV2`. `tf-keras` still ships it; run in a child process:

# %%
legacy = outside_strategy_run.reproduce_legacy(replicas=R)
print(textwrap.fill(f"{legacy.type}: {legacy.message.strip()}", 90, subsequent_indent="  "))
assert legacy.type == "RuntimeError"
assert "`apply_gradients() cannot be called in cross-replica context" in legacy.message
assert "Use `tf.distribute.Strategy.run` to enter replica context" in legacy.message

# %% [markdown]
# ## 2 · The posted answer, as far as it runs
#
# Its first line of TensorFlow no longer exists: `experimental_run_v2` was renamed
# `run` in TF 2.2 (tensorflow/tensorflow#37551) and the old name was gone by TF 2.4
# (tensorflow/tensorflow#49187). With `strategy.run` in its place the
# accumulation runs: the answer sums `experimental_local_results` (`tf.add_n` of the R
# per-device gradients, in cross-replica context) into accumulators created as plain
# `tf.Variable`s under the scope, which makes them **MirroredVariables**: at *every*
# micro-step the R gradients meet on one device and the sum is written into every copy
# of the accumulator — the communication the accumulation was supposed to save.
#
# The apply then fails under `strategy.scope()` exactly like the question's. Outside the
# scope it happens to *run* (`DistributedVariable._update` re-enters the variable's own
# strategy via `distribute_lib.enter_or_assert_strategy`), and we can look at the
# numbers. The answer says nothing about loss scaling; with a per-replica mean
# (`tf.reduce_mean` of the replica's per-example losses) the sum over replicas is R times
# the mean gradient, and the answer's `/ k` leaves it so. (A Keras 3 loss *object* is
# scaled differently: [lesson 01, section 4](01_where_gradients_sync.ipynb).)

# %%
answer = outside_strategy_run.reproduce_posted_answer(strategy, accumulation_steps=2,
                                                      examples=EXAMPLES)
show_table(["the posted answer", "on this TensorFlow"], [
    ("`strategy.experimental_run_v2`", f"{answer.run_v2_error.type}: {last_line(answer.run_v2_error)}"),
    ("its accumulators", answer.accumulator_type),
    ("apply under `strategy.scope()`", last_line(answer.apply_in_scope_error)),
    ("accumulated / k vs the true gradient", f"x{answer.gradient_ratio:.6f}"),
    ("SGD update vs one big-batch step, per-replica mean loss",
     f"x{answer.update_ratio_per_replica_mean:.6f}"),
    ("the same, loss / global micro batch", f"x{answer.update_ratio_global_micro_batch:.6f}"),
])

# %%
assert answer.run_v2_error.type == "AttributeError"
assert answer.run_v2_error.contains("object has no attribute 'experimental_run_v2'")
assert answer.accumulator_type == "MirroredVariable"
assert answer.apply_in_scope_error.type == "AttributeError"
assert answer.apply_in_scope_error.contains("'NoneType' object has no attribute 'merge_call'")
assert abs(answer.gradient_ratio - R) < 1e-6 * R
assert abs(answer.update_ratio_per_replica_mean - R) < 1e-6 * R
assert abs(answer.update_ratio_global_micro_batch - 1) < 1e-6

# %% [markdown]
# So the answer computes the right thing only if the loss is already scaled by the
# global micro batch, only outside the strategy scope, and with cross-device copies at
# every micro-step. Let us put the state in the right place instead.
#
# ## 3 · The fix: replica-local buffers, applied inside `strategy.run`
#
# Three decisions, each a few lines below:
#
# 1. **Where the sum lives.** One buffer per model variable, created under the scope as
#    `tf.Variable(synchronization=ON_READ, aggregation=SUM)`. MirroredStrategy turns it
#    into a `SyncOnReadVariable`: one independent copy per replica. `assign_add` in
#    replica context touches only the local copy — no communication; read in
#    cross-replica context, the variable is the SUM of its copies.
# 2. **What each micro-batch loss is divided by.** Two sums stand between a micro-batch
#    loss and the applied gradient: the buffers sum over k micro-steps, the optimizer
#    sums over R replicas. With B = micro batch per replica × R × k examples in the
#    update,
#
#    $$\sum_{j=1}^{k}\sum_{r=1}^{R} \nabla \frac{1}{B}\sum_{i \in (j, r)} \ell_i
#      = \nabla \frac{1}{B}\sum_{i=1}^{B} \ell_i ,$$
#
#    the big batch's mean gradient. So `compute_average_loss(..., global_batch_size=B)`,
#    with B the global batch of the whole **update**.
# 3. **Where the apply runs.** In a second `strategy.run`: each replica passes its local
#    sums to `optimizer.apply_gradients`, whose SUM all-reduce makes them the big-batch
#    gradient and writes one update into every mirrored copy. Then the buffers reset.
#    Plain Python decides when to call it; nothing traced branches on the micro-step.

# %%
def build_accumulating_loop(make_optimizer, divide_by):
    """Model, optimizer, buffers and the two tf.functions of the accumulating loop."""
    with strategy.scope():
        model = tiny_model()
        optimizer = make_optimizer()
        optimizer.build(model.trainable_variables)  # optimizer state now, not in a trace
        accumulators = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                    synchronization=tf.VariableSynchronization.ON_READ,
                                    aggregation=tf.VariableAggregation.SUM)
                        for v in model.trainable_variables]

    def train_step(model, data):  # the question's fn, run on every replica
        x, y = data
        with tf.GradientTape() as tape:
            per_example_loss = keras.losses.mean_squared_error(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=divide_by)
        gradients = tape.gradient(loss, model.trainable_variables)
        for accumulator, gradient in zip(accumulators, gradients):
            accumulator.assign_add(gradient)  # this replica's copy: no communication
        return loss

    def apply_step(model):  # every replica: its local sums; the optimizer's SUM syncs them
        local_sums = [accumulator.read_value() for accumulator in accumulators]
        optimizer.apply_gradients(zip(local_sums, model.trainable_variables))
        for accumulator in accumulators:
            accumulator.assign(tf.zeros_like(accumulator))

    @tf.function
    def accumulate(data):
        per_replica_losses = strategy.run(fn=train_step, args=(model, data))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    @tf.function
    def apply():
        strategy.run(fn=apply_step, args=(model,))

    return types.SimpleNamespace(model=model, optimizer=optimizer, accumulators=accumulators,
                                 accumulate=accumulate, apply=apply)


def micro_batches_of(x, y, k):
    """The k distributed micro-batches of one update (replica r gets the r-th slice)."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x) // k)
    return list(strategy.experimental_distribute_dataset(dataset))

# %% [markdown]
# The loop itself is the question's, with the sum moved inside `strategy.run`:

# %%
K = 4
micro_batches = micro_batches_of(x, y, K)
loop = build_accumulating_loop(sgd, divide_by=EXAMPLES)  # B: the update's global batch
for update in range(3):
    for data in micro_batches:
        loop.accumulate(data)
    loop.apply()

print(f"k={K}, R={R}, 3 updates: optimizer.iterations = {int(loop.optimizer.iterations.numpy())}")
diff = check_close(weights_of(loop.model), big_batch_reference(sgd, x, y, steps=3))
print(f"vs 3 big-batch steps on one device: max abs diff {diff.max_abs:.1e}")
assert int(loop.optimizer.iterations.numpy()) == 3

# %% [markdown]
# Look at a buffer after **one** micro-step: each replica's copy holds its own partial
# gradient, and the cross-replica read is their SUM. After all k micro-steps the summed
# buffers are the big batch's mean gradient.

# %%
probe = build_accumulating_loop(sgd, divide_by=EXAMPLES)
probe.accumulate(micro_batches[0])
buffer = probe.accumulators[0]
copies = [v.numpy() for v in buffer.values]


def first_entries(values):
    return ", ".join(f"{v:+.5f}" for v in np.ravel(values)[:4]) + ", ..."


show_table(["read", f"`{type(buffer).__name__}` ({buffer.dtype.name}), first entries"],
           [(f"replica {r} (local copy)", first_entries(c)) for r, c in enumerate(copies)]
           + [("cross-replica (SUM)", first_entries(buffer.numpy()))])
assert type(buffer).__name__ == "SyncOnReadVariable"
assert not np.allclose(copies[0], copies[1])  # different data, different partial gradients
np.testing.assert_allclose(sum(copies), buffer.numpy(), rtol=1e-6, atol=1e-7)

for data in micro_batches[1:]:
    probe.accumulate(data)
model0 = tiny_model()  # same seed: the initial weights
with tf.GradientTape() as tape:
    big_batch_loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model0(x)))
mean_gradient = tape.gradient(big_batch_loss, model0.trainable_variables)
diff = check_close([b.numpy() for b in probe.accumulators], [g.numpy() for g in mean_gradient])
print(f"summed buffers after {K} micro-steps vs big-batch mean gradient: max abs {diff.max_abs:.1e}")

# %% [markdown]
# ## 4 · Prove it: k micro-batches on R replicas == one big-batch step
#
# `train` runs the loop for a number of updates and keeps the weights after each. The
# distributed dataset gives replica r the r-th contiguous slice of every micro-batch, so
# the k·R slices of one update are exactly the big batch. We compare with
# `big_batch_reference` (one device, no strategy, plain `apply_gradients` on the full
# batch) after 1 and after 3 updates, at float32 tolerances (rtol = atol = 1e-6), for a
# plain, a stateful and an adaptive optimizer.

# %%
def train(make_optimizer, k, updates, divide_by=EXAMPLES, apply_every_micro_step=False):
    """`updates` passes over the big batch; weights after each, and the reported losses."""
    loop = build_accumulating_loop(make_optimizer, divide_by)
    loop.weights, loop.reported = [], []
    batches = micro_batches_of(x, y, k)
    for _ in range(updates):
        reported = 0.0
        for data in batches:
            reported += float(loop.accumulate(data))
            if apply_every_micro_step:
                loop.apply()
        if not apply_every_micro_step:
            loop.apply()
        loop.weights.append(weights_of(loop.model))
        loop.reported.append(reported)
    return loop


rows = []
for name in ("sgd", "momentum", "adam"):
    references = [big_batch_reference(OPTIMIZERS[name], x, y, steps=n) for n in (1, 3)]
    for k in (1, 2, 4):
        run = train(OPTIMIZERS[name], k, updates=3)
        after_1, after_3 = (check_close(run.weights[n], ref) for n, ref in zip((0, 2), references))
        assert int(run.optimizer.iterations.numpy()) == 3
        rows.append((name, k, f"{after_1.max_abs:.1e}", f"{after_3.max_abs:.1e}"))
show_table(["optimizer", "k", "max abs diff after 1 update", "after 3"], rows)

# %% [markdown]
# ## 5 · The wrong divisors, measured
#
# Divide by the global *micro* batch instead (right for plain small-batch training) and
# the update is k times too large; divide by the replica's own micro batch (a
# per-replica mean) and it is k·R times too large. With SGD the factor shows up exactly.
# A side effect of the right divisor: the reported losses of one update add up to the
# full-batch loss.

# %%
k = 2
reference_update = updates(big_batch_reference(sgd, x, y), tiny_model().get_weights())
rows = []
for divisor, expected in ((EXAMPLES, 1), (EXAMPLES // k, k), (EXAMPLES // (k * R), k * R)):
    run = train(sgd, k, updates=1, divide_by=divisor)
    ratio = update_ratio(updates(run.weights[0], tiny_model().get_weights()), reference_update)
    rows.append((divisor, f"x{ratio:.6f}", f"x{expected}"))
    assert abs(ratio - expected) < 1e-6 * expected
show_table([f"loss divided by (k={k}, R={R})", "SGD update vs big batch", "expected"], rows)

run = train(sgd, 4, updates=2)
full_batch = [full_batch_loss(w) for w in (tiny_model().get_weights(), run.weights[0])]
print("reported per update:", np.round(run.reported, 6).tolist())
print("full-batch loss    :", np.round(full_batch, 6).tolist())
np.testing.assert_allclose(run.reported, full_batch, rtol=1e-6)

# %% [markdown]
# The posted answer's "divide the sum by k at the end" is equivalent *if* each
# micro-batch loss was already a global-micro-batch average; dividing the loss by the
# update's batch keeps the buffers on the gradient's own scale and needs no extra pass.
#
# ## 6 · One all-reduce per update: the timeline
#
# `count_collectives` counts the all-reduce ops in each traced function. `accumulate`
# has none; `apply` has one (the optimizer packs all gradients into one reduction).
# Applying after every micro-step instead — plain small-batch training — pays one per
# micro-batch, and makes k optimizer updates where accumulation makes one.

# %%
UPDATES = 2
schemes = {"accumulate k, apply once": False, "apply every micro-step": True}
timelines = {}
for label, every in schemes.items():
    run = train(adam, K, UPDATES, divide_by=EXAMPLES // K if every else EXAMPLES,
                apply_every_micro_step=every)
    per_accumulate = count_collectives(run.accumulate, micro_batches[0], replicas=R).all_reduces
    per_apply = count_collectives(run.apply, replicas=R).all_reduces
    applies = K * UPDATES if every else UPDATES
    timelines[label] = (per_accumulate, per_apply, applies, int(run.optimizer.iterations.numpy()))
    assert (per_accumulate, per_apply) == (0, 1)
    assert int(run.optimizer.iterations.numpy()) == applies
show_table(["scheme", "all-reduces in `accumulate`", "in `apply`",
            f"all-reduces per {K * UPDATES} micro-batches", "optimizer updates"],
           [(label, a, b, K * UPDATES * a + n * b, n) for label, (a, b, n, _) in timelines.items()])

# %%
fig, axes = plt.subplots(2, 1, figsize=(8, 3.4), sharex=True)
for ax, (label, every) in zip(axes, schemes.items()):
    per_accumulate, per_apply, applies, _ = timelines[label]
    micro = np.arange(1, K * UPDATES + 1)
    apply_at = micro + 0.5 if every else np.arange(1, UPDATES + 1) * K + 0.5
    ax.broken_barh([(m - 0.4, 0.8) for m in micro], (1.6, 0.8), color="#9ecae1")
    reduce_at = np.concatenate([np.repeat(micro, per_accumulate), np.repeat(apply_at, per_apply)])
    ax.scatter(reduce_at, np.full(len(reduce_at), 1.0), marker="v", s=60, color="#d62728")
    for n, at in enumerate(apply_at, start=1):
        ax.text(at, 0.3, str(n), ha="center", va="center", fontsize=8,
                bbox={"boxstyle": "circle,pad=0.2", "fc": "white", "ec": "black"})
    ax.set_yticks([2.0, 1.0, 0.3], ["micro-steps\n(all replicas)", "all-reduces", "updates"])
    ax.set_ylim(-0.1, 2.6)
    ax.set_title(f"{label}: {len(reduce_at)} all-reduces, {applies} updates", fontsize=9)
axes[-1].set_xlabel(f"micro-batch (k = {K} per update, each split over R = {R} replicas)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 7 · Where optimizer state is created matters
#
# `build_accumulating_loop` calls `optimizer.build(model.trainable_variables)` under the
# scope. Leave it out — let `apply_gradients` create Adam's slots the first time the
# apply `tf.function` is traced — and on this TensorFlow/Keras with 2+ replicas the first
# call fails. Plain SGD (no slots) and a single replica run.

# %%
lazy = {name: lazy_slot_creation.reproduce(strategy, name, examples=EXAMPLES)
        for name in ("sgd", "momentum", "adam")}


def feed_line(error):
    return next(line.strip() for line in error.message.splitlines() if "You must feed" in line)


show_table(["optimizer", "slots created lazily, inside the traced apply", "built first (the fix)"],
           [(name, "ran" if r.lazy_error is None else f"{r.lazy_error.type}: {feed_line(r.lazy_error)}",
             f"max abs diff vs big batch {r.built_first_vs_big_batch.max_abs:.1e}")
            for name, r in lazy.items()])
print("int32 inputs the traced apply is fed at call time:", lazy["adam"].call_time_int32_inputs)

# %%
assert lazy["sgd"].lazy_error is None
for name in ("momentum", "adam"):
    assert lazy[name].lazy_error.type == "InvalidArgumentError"
    assert lazy[name].lazy_error.contains("You must feed a value for placeholder tensor")
    assert lazy[name].lazy_error.contains("with dtype int32")
    assert lazy[name].lazy_error.contains("fn_with_cond")
    assert lazy[name].built_first_vs_big_batch.within()
    assert lazy[name].call_time_int32_inputs == R  # one collective instance key per replica
one_replica = lazy_slot_creation.reproduce(distgrad.make_strategy(1), "adam", examples=EXAMPLES)
print("one replica, lazy Adam slots ->", one_replica.lazy_error or "ran")
assert one_replica.lazy_error is None and one_replica.call_time_int32_inputs == 0

# %% [markdown]
# Why, in three steps through the installed source:
#
# 1. A `tf.function` that creates variables on its first call tries to *lift* their
#    initializers out of the graph (`polymorphic_function.py`,
#    `Function._initialize_uninitialized_variables`). MirroredStrategy initializes replica
#    1's copy of a slot by *reading replica 0's copy*
#    (`mirrored_strategy.py`, `_get_variable_creator_initial_value`), and inside the
#    function that read sits behind `cond(is_initialized)`: it cannot be lifted.
# 2. TF falls back to `fn_with_cond`: it calls the traced function inside a `cond`.
# 3. The all-reduce's collective instance keys are **call-time captures**: int32
#    placeholders fed when the function is called (`cross_device_utils.py`,
#    `CollectiveReplicaLauncher._next_instance_key` → `graph.capture_call_time_value`,
#    one per replica: the R printed above). The `cond` wrapper does not propagate them —
#    the source says so in a comment — so nobody feeds them.
#
# Upstream this is keras-team/keras#23085, fixed by keras-team/keras#23087 (optimizer
# variables created under `tf.init_scope()`), which the installed Keras does not contain
# yet; the assertions above fail when an upgrade changes this.
#
# ## 8 · The buffers are checkpointable — also in the middle of an update
#
# `tf.train.Checkpoint` saves a `SyncOnRead` SUM variable as its cross-replica value,
# the SUM, and restores SUM / R into every replica's copy
# (`tensorflow/python/distribute/values_util.py`, `get_on_read_restore_ops`), which
# leaves the next update's sum unchanged. Save after 2 of 4 micro-steps of the second
# update, restore into a fresh loop, finish the update in both:

# %%
def checkpoint_of(loop):
    return tf.train.Checkpoint(model=loop.model, optimizer=loop.optimizer,
                               accumulators=loop.accumulators)


first = build_accumulating_loop(adam, EXAMPLES)
for data in micro_batches:
    first.accumulate(data)
first.apply()
for data in micro_batches[:2]:
    first.accumulate(data)
path = checkpoint_of(first).save(tempfile.mkdtemp() + "/mid-update")
second = build_accumulating_loop(adam, EXAMPLES)
checkpoint_of(second).restore(path).assert_consumed()
restored_iterations = int(second.optimizer.iterations.numpy())
assert restored_iterations == 1
saved_sum = first.accumulators[0].numpy()
restored_copies = [v.numpy() for v in second.accumulators[0].values]
for copy in restored_copies:
    np.testing.assert_allclose(copy, saved_sum / R, rtol=1e-6)  # SUM / R on every replica
for resumed_loop in (first, second):  # micro-steps 3 and 4: the position is the caller's
    for data in micro_batches[2:]:
        resumed_loop.accumulate(data)
    resumed_loop.apply()
resumed = check_close(weights_of(second.model), weights_of(first.model))
exact = check_close(weights_of(second.model), big_batch_reference(adam, x, y, steps=2))
print(f"restored: optimizer.iterations = {restored_iterations}, each replica's buffer = "
      "saved SUM / R")
print(f"resumed vs uninterrupted: {resumed.max_abs:.1e}; vs 2 big-batch steps: {exact.max_abs:.1e}")

# %% [markdown]
# `aggregation=SUM` is what makes this possible: with `aggregation=NONE` (OpenNMT-tf's
# accumulator) the buffers can be neither read in cross-replica context nor saved on 2+
# replicas (`tests/test_accumulator.py` pins both).
#
# ## 9 · The packaged form: `GradientAccumulator`
#
# `distgrad.GradientAccumulator` is the buffers of section 3 with what a real model needs
# besides, each pinned in `tests/test_accumulator.py`: a micro-step counter
# (`micro_steps`, checkpointed with the buffers, so the loop position is saved too),
# float32 buffers for float16/bfloat16 weights, `None` gradients skipped,
# `tf.IndexedSlices` summed into the dense buffer (embeddings; what Adam does with them
# is [lesson 07, section 3](07_beyond_the_basics.ipynb)), and errors for the misuses of
# sections 1 and 7. Its `add` is the first half of section 3's `train_step`:

# %%
show_code(distgrad.GradientAccumulator.add)

# %% [markdown]
# The question's loop with it — `make_apply_step` builds the optimizer under the scope
# and wraps `strategy.run(accumulator.apply_gradients, ...)` in a `tf.function`:

# %%
with strategy.scope():
    model, optimizer = tiny_model(), sgd()
    accumulator = distgrad.GradientAccumulator(model.trainable_variables)


def train_step(model, data):
    x, y = data
    with tf.GradientTape() as tape:
        per_example_loss = keras.losses.mean_squared_error(y, model(x, training=True))
        loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=EXAMPLES)
    accumulator.add(tape.gradient(loss, model.trainable_variables))
    return loss


accumulate = tf.function(lambda data: strategy.run(fn=train_step, args=(model, data)))
apply_step = accumulator.make_apply_step(optimizer)
for update in range(3):
    for data in micro_batches:
        accumulate(data)
    assert accumulator.micro_steps == K
    apply_step()
assert accumulator.micro_steps == 0 and int(optimizer.iterations.numpy()) == 3
same = check_close(weights_of(model), weights_of(loop.model))  # section 3's loop
print(f"GradientAccumulator vs section 3's loop, 3 updates: max abs diff {same.max_abs:.1e}")
assert count_collectives(apply_step.function, replicas=R).all_reduces == 1
try:
    with strategy.scope():  # cross-replica context: the question's mistake
        accumulator.add([tf.zeros_like(v) for v in model.trainable_variables])
except RuntimeError as err:
    misuse = err
print(textwrap.fill(f"add() outside strategy.run -> RuntimeError: {misuse}", 90,
                    subsequent_indent="  "))
assert "must run in replica context" in str(misuse)

# %% [markdown]
# ## 10 · The picture: big batch vs accumulated vs naive small batch
#
# Full-batch loss after each pass over the data: one device on the big batch, k = 4
# accumulated micro-batches on R replicas, and the naive alternative — an optimizer step
# after every micro-batch. The first two are the same run (the assertion checks the
# weights after every update); the naive run is a different optimization (four times as
# many smaller steps), not the big-batch training you wanted to keep. On this tiny,
# well-conditioned problem more steps simply descend faster; the point of accumulating
# is to keep a recipe tuned for the big batch (learning rate, schedule, gradient noise)
# when that batch no longer fits in memory — and only the accumulated run reproduces it.

# %%
PASSES = 10
slow_sgd = lambda: keras.optimizers.SGD(0.05)
accumulated = train(slow_sgd, 4, PASSES)
naive = train(slow_sgd, 4, PASSES, divide_by=EXAMPLES // 4, apply_every_micro_step=True)
start = tiny_model().get_weights()
big_batch = [start] + [big_batch_reference(slow_sgd, x, y, steps=n) for n in range(1, PASSES + 1)]
for n in range(PASSES):
    check_close(accumulated.weights[n], big_batch[n + 1], what=f"update {n + 1}")
check_not_close(naive.weights[-1], accumulated.weights[-1])
assert int(accumulated.optimizer.iterations.numpy()) == PASSES
assert int(naive.optimizer.iterations.numpy()) == 4 * PASSES

curves = {"big batch, 1 device": [full_batch_loss(w) for w in big_batch],
          f"accumulated, k=4, R={R}": [full_batch_loss(w) for w in [start] + accumulated.weights],
          "naive: step every micro-batch": [full_batch_loss(w) for w in [start] + naive.weights]}
fig, ax = plt.subplots(figsize=(6, 3.5))
for (label, losses), style in zip(curves.items(), [{"lw": 4, "alpha": 0.4, "marker": "o"},
                                                   {"color": "k", "ls": "--", "marker": "."},
                                                   {"marker": "s", "ms": 3}]):
    ax.plot(np.arange(PASSES + 1), losses, label=label, **style)
ax.set_xlabel("passes over the big batch")
ax.set_ylabel("full-batch loss")
ax.legend()
plt.tight_layout()
plt.show()
show_table(["run", f"loss after {PASSES} passes", "optimizer updates"],
           [(label, f"{losses[-1]:.5f}", n) for (label, losses), n in
            zip(curves.items(), (PASSES, int(accumulated.optimizer.iterations.numpy()),
                                 int(naive.optimizer.iterations.numpy())))])

# %% [markdown]
# ## 11 · The same loop in tf-keras (Keras 2)
#
# The question was asked on TensorFlow 2.x with Keras 2, and many users still train
# on it: TensorFlow ≤ 2.15, or the `tf-keras` package behind `tf.keras` when
# `TF_USE_LEGACY_KERAS=1` is set *before* TensorFlow is imported. This notebook runs
# Keras 3, and a process cannot switch, so the tf-keras program below is written to a
# file and run in a child Python (`distgrad.lab.legacy.run_legacy` sets the variable and
# puts the folder on `PYTHONPATH`). It is section 3's loop, with
# `distgrad.GradientAccumulator` (which holds no Keras object of its own: tf.distribute
# variables, and the optimizer you pass) and a tf-keras `Adam`. The lab supplies the
# incidentals: the tiny model, the weights as lists, and the one-device big-batch
# `model.fit` to compare with.

# %%
program_folder = tempfile.mkdtemp(prefix="lesson02-tf-keras-")

# %%
# %%writefile {program_folder}/tf_keras_custom_loop.py
import numpy as np
import tensorflow as tf  # tf-keras here: run_legacy set TF_USE_LEGACY_KERAS=1 before

from distgrad import GradientAccumulator
from distgrad.lab.legacy import legacy_strategy
from distgrad.lab.legacy_fit import big_batch_fit, tiny_model, weights


def train(replicas, x, y, accumulation_steps, updates):
    strategy = legacy_strategy(replicas)  # first: the logical devices
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    with strategy.scope():
        model, optimizer = tiny_model(), tf.keras.optimizers.Adam(0.01)
        accumulator = GradientAccumulator(model.trainable_variables)

    def train_step(data):  # the question's fn: its gradients go into the buffers
        features, targets = data
        with tf.GradientTape() as tape:
            predictions = model(features, training=True)
            per_example_loss = tf.reduce_mean(tf.square(predictions - targets), axis=-1)
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=len(x))
        accumulator.add(tape.gradient(loss, model.trainable_variables))

    accumulate = tf.function(lambda data: strategy.run(train_step, args=(data,)))
    apply_step = accumulator.make_apply_step(optimizer)  # builds Adam under the scope
    micro_batches = list(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x) // accumulation_steps)))
    for update in range(updates):
        for data in micro_batches:
            accumulate(data)
        apply_step()
    big_batch, _ = big_batch_fit(tiny_model, lambda: tf.keras.optimizers.Adam(0.01), x, y,
                                 batch_size=len(x), epochs=updates)
    return {"accumulated": weights(model), "big_batch": weights(big_batch),
            "optimizer": type(optimizer).__module__,
            "updates": int(optimizer.iterations.numpy())}

# %%
from distgrad.lab.legacy import run_legacy

tf_keras_run = run_legacy("tf_keras_custom_loop:train", R, env={"PYTHONPATH": program_folder},
                          x=x.tolist(), y=y.tolist(), accumulation_steps=K, updates=3)
tf_keras_diff = check_close(tf_keras_run["accumulated"], tf_keras_run["big_batch"])
print(f"TensorFlow {tf_keras_run.tensorflow}, tf-keras {tf_keras_run.tf_keras}, "
      f"{tf_keras_run.replicas} replicas, k = {K}: {tf_keras_run['updates']} updates")
print(f"GradientAccumulator + tf-keras Adam vs 3 big-batch steps: max abs diff "
      f"{tf_keras_diff.max_abs:.1e}")
assert tf_keras_run.replicas == R and tf_keras_run.tf_keras.startswith("2.")
assert tf_keras_run["optimizer"].startswith("tf_keras.")  # a tf-keras Adam, not Keras 3's
assert tf_keras_run["updates"] == 3

# %% [markdown]
# Equal to the big batch at float32 tolerances, on the versions printed above. For
# `model.fit` in tf-keras, `distgrad.tf_keras.AccumulatingOptimizer` is the packaged
# form ([lesson 03, section 7](03_cond_and_merge_call.ipynb); with `mixed_float16`,
# [lesson 04, section 6](04_loss_scale_optimizer_pitfall.ipynb)).

# %% [markdown]
# ## Takeaways
#
# * `strategy.run` returns `PerReplica` values in cross-replica context; you cannot add
#   them up in Python or hand them to `apply_gradients`. Accumulate *inside*
#   `strategy.run`, into replica-local `SyncOnRead` variables: zero communication.
# * Apply once per k micro-batches inside a second `strategy.run`; the optimizer's SUM
#   all-reduce is the single sync of the update (1 instead of k).
# * Divide each micro-batch loss by the global batch of the whole update
#   (micro batch × R × k). Per-replica means make the update k·R times too large.
# * Build the optimizer under the scope before the first traced apply (stateful
#   optimizers fail otherwise on 2+ replicas, keras-team/keras#23085).
# * Use `aggregation=SUM` for the buffers: they can then be read across replicas and
#   checkpointed mid-update.
# * `experimental_run_v2` is gone; it is `strategy.run` (tensorflow/tensorflow#37551).
# * In tf-keras (Keras 2, `TF_USE_LEGACY_KERAS=1` set before TensorFlow is imported) the
#   loop and `GradientAccumulator` are the same, with a tf-keras optimizer (section 11).
#
# ## Exercises
#
# 1. Predict the SGD update of one accumulated update when each micro-batch loss is
#    divided by the global *micro* batch, `EXAMPLES // K`, then run the first cell below.
# 2. In `build_accumulating_loop`, make the buffers `synchronization=ON_WRITE` (keep
#    `aggregation=SUM`), rerun that cell, then the second cell below. Where does each
#    micro-step's sum happen now, and by what factor is the update off?
# 3. Remove `optimizer.build(...)` from `build_accumulating_loop`, rerun it, and run
#    `train(adam, 2, 1)`. Which error do you get, and which section explains it?
# 4. In section 11's program, replace both `tf.keras.optimizers.Adam(0.01)` by the
#    question's era's optimizer, `tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9)`
#    (an `OptimizerV2`), and rerun the `%%writefile` cell and the one after it. Does the
#    loop still equal the big batch?
#
# <details><summary>Answers</summary>
#
# 1. k = 4 times the big-batch step (section 5).
# 2. A `MirroredVariable` updated in replica context with `aggregation=SUM` sums the R
#    values in a `merge_call` at every micro-step (one more `AddN` per variable in
#    `accumulate`: the R gradients meet on one device);
#    `read_value()` in `apply_step` then returns that sum on every replica, and the
#    optimizer sums it again: R times the big-batch step.
# 3. `InvalidArgumentError: You must feed a value for placeholder tensor ...` (section 7).
# 4. Yes: `make_apply_step` creates an `OptimizerV2`'s slots under the scope before the
#    traced apply, as section 7 requires (`tests/test_tf_keras_custom_loop.py` checks it).
#
# </details>

# %%
EXERCISE_DIVIDE_BY = EXAMPLES // K
exercise = train(sgd, K, updates=1, divide_by=EXERCISE_DIVIDE_BY)
ratio = update_ratio(updates(exercise.weights[0], tiny_model().get_weights()), reference_update)
print(f"loss / {EXERCISE_DIVIDE_BY}: SGD update x{ratio:.4f} of one big-batch step")

# %%
exercise = build_accumulating_loop(sgd, EXAMPLES)
graph = exercise.accumulate.get_concrete_function(micro_batches[0]).graph.as_graph_def()
print("AddN ops in accumulate:", graph_op_types(graph)["AddN"])
for data in micro_batches:
    exercise.accumulate(data)
exercise.apply()
ratio = update_ratio(updates(weights_of(exercise.model), tiny_model().get_weights()),
                     reference_update)
print(f"SGD update x{ratio:.4f} of one big-batch step")

# %% [markdown]
# ## Further reading
#
# * keras-team/keras#23085 (stateful optimizers fail to trace under tf.distribute) and
#   its fix keras-team/keras#23087.
# * tensorflow/tensorflow#32176 — gradient accumulation for distribution strategies.
# * OpenNMT-tf, `opennmt/optimizers/utils.py` (`GradientAccumulator`) and its trainer:
#   the two-function structure used here.
# * `tf.VariableSynchronization` / `tf.VariableAggregation` API docs; installed source
#   `tensorflow/python/distribute/values.py` (`SyncOnReadVariable`) and
#   `values_util.py` (`get_on_read_restore_ops`).
