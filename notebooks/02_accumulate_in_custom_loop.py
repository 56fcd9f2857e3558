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
# **Short answer.** Yes, and it costs *one* all-reduce per update: keep one gradient
# buffer per replica (a `SyncOnRead` variable, no communication while you add to it),
# divide every micro-batch loss by the global batch of the *whole update*, and apply once
# per k micro-batches *inside* `strategy.run`, where the optimizer's own SUM all-reduce is
# the single sync. `distgrad.accumulator.GradientAccumulator` does exactly that; below we
# reproduce the question and the answer, build the accumulator, and prove that k
# micro-batches on R replicas give the same weights as one big-batch step.

# %%
import distgrad

strategy = distgrad.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
distgrad.environment_report(strategy)

# %%
import inspect

import keras
import matplotlib.pyplot as plt
import numpy as np
import tensorflow as tf

from distgrad.accumulator import GradientAccumulator
from distgrad.lab.accumulation import AccumulatedTrainer, full_batch_loss, train_accumulated
from distgrad.lab.compare import check_close, check_not_close, update_ratio, updates, weights_of
from distgrad.lab.data import (
    embedding_model,
    per_example_squared_error,
    regression_data,
    tiny_model,
    token_data,
)
from distgrad.lab.recipes import big_batch_reference, dense_gradient_reference
from distgrad.pitfalls import lazy_slot_creation, outside_strategy_run

# Every experiment below builds fresh tf.functions on purpose; silence the retracing notes.
tf.get_logger().setLevel("ERROR")
assert R >= 2, "this lesson is about several replicas: set DISTGRAD_REPLICAS >= 2"
EXAMPLES = 8 * R  # the big batch: divisible by k * R for k in 1, 2, 4
x, y = regression_data(EXAMPLES)
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}

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
record = outside_strategy_run.reproduce(strategy)
print("strategy.run returned:", record.gradient_type)
print("per_replica + per_replica         ->", record.sum_error)
print("apply_gradients, outside scope    ->", record.apply_outside_scope_error)
print("apply_gradients, in scope         ->", record.apply_in_scope_error)
print("apply_gradients, traced, in scope ->",
      record.apply_in_traced_function_error.message.strip().splitlines()[-1])

# %%
assert record.gradient_type == "PerReplica"
assert record.sum_error.type == "TypeError"
assert record.sum_error.contains("unsupported operand type(s) for +: 'PerReplica' and 'PerReplica'")
assert record.apply_outside_scope_error.type == "ValueError"
assert record.apply_outside_scope_error.contains("Type PerReplica is not supported as a gradient source")
assert record.apply_in_scope_error.type == "AttributeError"
assert record.apply_in_scope_error.contains("'NoneType' object has no attribute 'merge_call'")
assert record.apply_in_traced_function_error.contains("'NoneType' object has no attribute 'merge_call'")

# %% [markdown]
# Keras 3's message is cryptic: under the scope there is no replica context, and
# `maybe_merge_call` (`tensorflow/python/distribute/merge_call_interim.py`) calls
# `get_replica_context().merge_call` on `None`. The message the user quoted came from
# tf.keras 2's `OptimizerV2`. `tf-keras` still ships it; run in a child process:

# %%
legacy = outside_strategy_run.reproduce_legacy(replicas=R)
print(legacy)
assert legacy.type == "RuntimeError"
assert "`apply_gradients() cannot be called in cross-replica context" in legacy.message

# %% [markdown]
# ## 2 · The posted answer, as far as it runs
#
# Its first line of TensorFlow no longer exists: `experimental_run_v2` was renamed
# `run` in TF 2.2 (tensorflow/tensorflow#37551) and the old name was gone by TF 2.4
# (tensorflow/tensorflow#49187). With `strategy.run` in its place the
# accumulation runs: the answer sums `experimental_local_results` in cross-replica
# context into accumulators created as plain `tf.Variable`s under the scope, which makes
# them **MirroredVariables**. So at *every* micro-step the R gradients are copied to one
# device, summed there, and written back into R copies of the accumulator: the
# communication the accumulation was supposed to save, k times per update.
#
# The apply then fails under `strategy.scope()` exactly like the question's. Outside the
# scope it happens to *run* (`DistributedVariable._update` re-enters the variable's own
# strategy via `distribute_lib.enter_or_assert_strategy`), and we can look at the
# numbers: with the usual per-replica mean loss (`reduce_mean`, what
# `keras.losses.MeanSquaredError()` does; the answer says nothing about scaling), the
# sum over replicas is R times the mean gradient, and the answer's `/ k` leaves it so.

# %%
answer = outside_strategy_run.reproduce_posted_answer(strategy, accumulation_steps=2)
print("experimental_run_v2              ->", answer.run_v2_error)
print("accumulators are                 ->", answer.accumulator_type)
print("apply under strategy.scope()     ->",
      answer.apply_in_scope_error.message.strip().splitlines()[-1])
print(f"accumulated / k vs true gradient: x{answer.gradient_ratio:.6f}")
print(f"SGD update vs one big-batch step: x{answer.update_ratio_per_replica_mean:.6f} "
      f"(per-replica mean loss), x{answer.update_ratio_global_micro_batch:.6f} "
      "(loss / global micro batch)")

# %%
assert answer.run_v2_error.type == "AttributeError"
assert answer.run_v2_error.contains("object has no attribute 'experimental_run_v2'")
assert answer.accumulator_type == "MirroredVariable"
assert answer.apply_in_scope_error.contains("'NoneType' object has no attribute 'merge_call'")
assert abs(answer.gradient_ratio - R) < 1e-6 * R
assert abs(answer.update_ratio_per_replica_mean - R) < 1e-6 * R
assert abs(answer.update_ratio_global_micro_batch - 1) < 1e-6

# %% [markdown]
# So the answer computes the right thing only if the loss is already scaled by the
# global micro batch, only outside the strategy scope, and with cross-device copies at
# every micro-step. Let us put the state in the right place instead.
#
# ## 3 · Look inside: where the accumulator's state lives
#
# `GradientAccumulator` creates, under `strategy.scope()`, one
# `tf.Variable(synchronization=ON_READ, aggregation=SUM)` per model variable (float32
# whatever the variable's dtype) and an `ON_READ` / `ONLY_FIRST_REPLICA` micro-step
# counter. MirroredStrategy turns each into a `SyncOnReadVariable`: one independent copy
# per replica. `add` runs in replica context and only touches the local copy:

# %%
print(inspect.getsource(GradientAccumulator.add))

# %% [markdown]
# `AccumulatedTrainer` wires it into the OpenNMT-tf shape: an accumulate `tf.function`
# (`strategy.run` of forward, backward, `accumulator.add`), an apply `tf.function`, and a
# Python loop deciding when to call which. After one micro-step each replica's buffer
# holds its own partial gradient; read in cross-replica context the buffer is their SUM:

# %%
K = 4
trainer = AccumulatedTrainer(strategy, OPTIMIZERS["sgd"], x, y, accumulation_steps=K)
trainer.accumulate_step(0)
buffer = trainer.accumulator.accumulated[0]
copies = [v.numpy() for v in buffer.values]
print(type(buffer).__name__, buffer.dtype.name, "| micro-steps:", trainer.accumulator.micro_steps)
for replica, copy in enumerate(copies):
    print(f"replica {replica}: {np.round(copy.ravel()[:4], 5)} ...")
print(f"cross-replica read: {np.round(buffer.numpy().ravel()[:4], 5)} ...")
assert type(buffer).__name__ == "SyncOnReadVariable" and buffer.dtype == tf.float32
np.testing.assert_allclose(sum(copies), buffer.numpy(), rtol=1e-6, atol=1e-7)
assert trainer.accumulator.micro_steps == 1

# %% [markdown]
# After all K micro-steps the summed buffers are the mean gradient of the whole big
# batch — because each micro-batch loss was divided by the big batch size (section 5):

# %%
for j in range(1, K):
    trainer.accumulate_step(j)
model0 = tiny_model()  # same seed: the initial weights
with tf.GradientTape() as tape:
    big_batch_loss = tf.reduce_mean(per_example_squared_error(tf.constant(y), model0(tf.constant(x))))
mean_gradient = [g.numpy() for g in tape.gradient(big_batch_loss, model0.trainable_variables)]
print("summed buffers vs big-batch mean gradient:",
      check_close([b.numpy() for b in trainer.accumulator.accumulated], mean_gradient))

# %% [markdown]
# The apply step runs `strategy.run(accumulator.apply_gradients, args=(optimizer,))`:
# each replica passes its *local* sums to `optimizer.apply_gradients`, whose SUM
# all-reduce turns them into the big-batch gradient and updates every mirrored copy once.
# Then the buffers reset. Everything is gated on a check that something was accumulated:

# %%
print(inspect.getsource(GradientAccumulator.apply_gradients))
trainer.apply_step()
assert trainer.accumulator.micro_steps == 0 and int(trainer.optimizer.iterations.numpy()) == 1

# %% [markdown]
# ## 4 · Prove it: k micro-batches on R replicas == one big-batch step
#
# `train_accumulated` feeds micro-batch j = `x[j*g:(j+1)*g]` (g = global micro batch);
# the distributed dataset gives replica r the r-th contiguous slice of it, so the k·R
# slices of one update are exactly the big batch. We compare with
# `big_batch_reference` (one device, no strategy, plain `apply_gradients` on the full
# batch) after 1 and after 3 updates, at float32 tolerances (rtol = atol = 1e-6).

# %%
references = {(name, steps): big_batch_reference(make, x, y, steps=steps)
              for name, make in OPTIMIZERS.items() for steps in (1, 3)}
for name, make in OPTIMIZERS.items():
    for k in (1, 2, 4):
        run = train_accumulated(strategy, make, x, y, k, updates=3)
        after_1 = check_close(run.weights_per_update[0], references[name, 1])
        after_3 = check_close(run.final, references[name, 3])
        assert run.iterations == 3 and run.micro_steps_left == 0 and run.copies_agree
        print(f"{name:8s} k={k} R={R}: after 1 update max|diff| {after_1.max_abs:.1e}, "
              f"after 3 {after_3.max_abs:.1e}, optimizer.iterations = {run.iterations}")

# %% [markdown]
# ### Embeddings: sparse gradients
#
# An `Embedding` layer's gradient is a `tf.IndexedSlices`. `SyncOnReadVariable` has no
# `scatter_add` (`values.py`: "Variables with `synchronization=ON_READ` doesn't support
# `scatter_add`"), so `add` sums the slices into the dense buffer with
# `unsorted_segment_sum` (repeated rows add up). The optimizer therefore receives a
# *dense* gradient. SGD and momentum do the same arithmetic on sparse and dense
# gradients, so we compare with the ordinary (sparse) big-batch reference. Keras 3's Adam
# does not (its sparse path differs when rows repeat, lesson 07), so for Adam we compare
# like with like: a big-batch reference whose gradients are densified first.

# %%
tokens, targets = token_data(EXAMPLES)
for name in ("sgd", "momentum", "adam"):
    run = train_accumulated(strategy, OPTIMIZERS[name], tokens, targets, 4, updates=3,
                            model_factory=embedding_model)
    make_reference = dense_gradient_reference if name == "adam" else big_batch_reference
    diff = check_close(run.final, make_reference(OPTIMIZERS[name], tokens, targets, steps=3,
                                                 model_factory=embedding_model))
    print(f"{name:8s} embedding, k=4, vs {make_reference.__name__}: {diff}")
sparse_vs_dense = check_not_close(
    big_batch_reference(OPTIMIZERS["adam"], tokens, targets, model_factory=embedding_model),
    dense_gradient_reference(OPTIMIZERS["adam"], tokens, targets, model_factory=embedding_model))
print("Adam, one step, sparse vs dense gradient:", sparse_vs_dense)

# %% [markdown]
# ## 5 · Why each micro-batch loss is divided by the global batch of the update
#
# Two sums stand between a micro-batch loss and the applied gradient: the accumulator
# sums over k micro-steps, the optimizer sums over R replicas. With B = micro batch per
# replica × R × k examples in the update,
#
# $$\sum_{j=1}^{k}\sum_{r=1}^{R} \nabla \frac{1}{B}\sum_{i \in (j, r)} \ell_i
#   = \nabla \frac{1}{B}\sum_{i=1}^{B} \ell_i ,$$
#
# the big batch's mean gradient. Divide by the global *micro* batch instead (right for
# plain small-batch training) and the update is k times too large; take a per-replica
# mean and it is k·R times too large. With SGD the factor shows up exactly:

# %%
k = 2
reference_update = updates(references["sgd", 1], tiny_model().get_weights())
for scaling, expected in (("update", 1), ("micro_batch", k), ("per_replica_mean", k * R)):
    run = train_accumulated(strategy, OPTIMIZERS["sgd"], x, y, k, loss_scaling=scaling)
    ratio = update_ratio(updates(run.final, run.initial), reference_update)
    print(f"loss / {scaling:17s} -> SGD update x{ratio:.6f} (expected x{expected})")
    assert abs(ratio - expected) < 1e-6 * expected

# %% [markdown]
# Dividing the accumulated sum by k at the end (the posted answer) is equivalent *if*
# each micro-batch loss was already a global-micro-batch average; scaling the loss by
# the update's batch keeps the buffers on the gradient's own scale and needs no extra
# pass. A side effect: the reported losses of one update add up to the full-batch loss.

# %%
run = train_accumulated(strategy, OPTIMIZERS["sgd"], x, y, 4, updates=2)
print("reported per update:", np.round(run.reported_losses, 6))
print("full-batch loss    :", np.round(run.losses[:-1], 6))
np.testing.assert_allclose(run.reported_losses, run.losses[:-1], rtol=1e-6)

# %% [markdown]
# ## 6 · Count the all-reduces: one per update
#
# `count_collectives` (lesson 01) counts the all-reduce ops in each traced function. The
# accumulate function has none; the apply function has one (the optimizer packs all
# gradients into one reduction). Applying after every micro-step instead — plain
# small-batch training — pays k of them per k micro-batches.

# %%
accumulated = train_accumulated(strategy, OPTIMIZERS["adam"], x, y, 4)
every_step = train_accumulated(strategy, OPTIMIZERS["adam"], x, y, 4, apply_every_micro_step=True)
print("accumulate fn:", accumulated.accumulate.op_types, "| apply fn:", accumulated.apply.op_types)
print("all-reduces per 4 micro-batches: accumulated", accumulated.all_reduces_per_update,
      "| apply every micro-step", every_step.all_reduces_per_update)
assert accumulated.accumulate.all_reduces == 0 and accumulated.apply.all_reduces == 1
assert accumulated.all_reduces_per_update == 1 and every_step.all_reduces_per_update == 4

fig, ax = plt.subplots(figsize=(5, 2.4))
ax.barh(["accumulate, apply once", "apply every micro-step"],
        [accumulated.all_reduces_per_update, every_step.all_reduces_per_update])
ax.set_xlabel("all-reduces per 4 micro-batches")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 7 · Where optimizer state is created matters
#
# Build the optimizer *lazily* — let `apply_gradients` create Adam's slots the first time
# the apply `tf.function` is traced — and on TF 2.21 / Keras 3.15 with 2+ replicas the
# first call fails. Plain SGD (no slots) and a single replica run.

# %%
lazy = {name: lazy_slot_creation.reproduce(strategy, name) for name in ("sgd", "momentum", "adam")}
for name, result in lazy.items():
    if result.lazy_error is None:
        print(f"{name:8s} lazy slots -> ran")
        continue
    lines = result.lazy_error.message.splitlines()
    feed = next(line.strip() for line in lines if "You must feed" in line)
    print(f"{name:8s} lazy slots -> {result.lazy_error.type}: {feed}\n{'':22s}{lines[-1].strip()}")
print("traced apply's int32 inputs fed at call time:", lazy["adam"].call_time_int32_inputs)
print("built first (the fix) vs big batch:", lazy["adam"].built_first_vs_big_batch)

# %%
assert lazy["sgd"].lazy_error is None
for name in ("momentum", "adam"):
    assert lazy[name].lazy_error.type == "InvalidArgumentError"
    assert lazy[name].lazy_error.contains("You must feed a value for placeholder tensor")
    assert lazy[name].lazy_error.contains("fn_with_cond")
    assert lazy[name].built_first_vs_big_batch.within()
assert lazy["adam"].call_time_int32_inputs == R
one_replica = lazy_slot_creation.reproduce(distgrad.make_strategy(1), "adam")
print("one replica, lazy Adam slots ->", one_replica.lazy_error or "ran")
assert one_replica.lazy_error is None

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
# The fix: `optimizer.build(model.trainable_variables)` under `strategy.scope()` before
# tracing, so the apply function creates no variables. `make_apply_step` does it for
# you. Upstream this is keras-team/keras#23085, fixed by keras-team/keras#23087
# (optimizer variables created under `tf.init_scope()`), which Keras 3.15.1 does not
# contain yet; a test fails when an upgrade changes this, so the lesson gets updated.
#
# ## 8 · All of it is checkpointable — also in the middle of an update
#
# `tf.train.Checkpoint(model=..., optimizer=..., accumulator=...)` saves the buffers (as
# their SUM over replicas: restored as SUM / R on each replica, which leaves the next
# update's sum unchanged) and the micro-step counter. Save after 2 of 4 micro-steps,
# restore into a fresh trainer, finish the update in both:

# %%
import tempfile

first = AccumulatedTrainer(strategy, OPTIMIZERS["adam"], x, y, 4)
first.update()
first.accumulate_step(0)
first.accumulate_step(1)
path = first.checkpoint().save(tempfile.mkdtemp() + "/mid-update")
second = AccumulatedTrainer(strategy, OPTIMIZERS["adam"], x, y, 4)
second.checkpoint().restore(path).assert_consumed()
print("restored micro-steps:", second.accumulator.micro_steps,
      "| optimizer.iterations:", int(second.optimizer.iterations.numpy()))
for t in (first, second):
    t.accumulate_step(2)
    t.accumulate_step(3)
    t.apply_step()
print("resumed vs uninterrupted:", check_close(weights_of(second.model), weights_of(first.model)))
print("resumed vs 2 big-batch steps:",
      check_close(weights_of(second.model), big_batch_reference(OPTIMIZERS["adam"], x, y, steps=2)))

# %% [markdown]
# ## 9 · The picture: big batch vs accumulated vs naive small batch
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
UPDATES = 12
sgd = lambda: keras.optimizers.SGD(0.05)
accumulated = train_accumulated(strategy, sgd, x, y, 4, updates=UPDATES)
naive = train_accumulated(strategy, sgd, x, y, 4, updates=UPDATES, apply_every_micro_step=True)
big_batch_losses = [accumulated.losses[0]]
for n in range(1, UPDATES + 1):
    weights = big_batch_reference(sgd, x, y, steps=n)
    check_close(accumulated.weights_per_update[n - 1], weights, what=f"update {n}")
    model_n = tiny_model()
    model_n.set_weights(weights)
    big_batch_losses.append(full_batch_loss(model_n, x, y))
check_not_close(naive.final, accumulated.final)

epochs = np.arange(UPDATES + 1)
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(epochs, big_batch_losses, "o-", lw=4, alpha=0.4, label="big batch, 1 device")
ax.plot(epochs, accumulated.losses, "k.--", label=f"accumulated, k=4, R={R}")
ax.plot(epochs, naive.losses, "s-", ms=3, label="naive: step every micro-batch")
ax.set_xlabel("passes over the big batch")
ax.set_ylabel("full-batch loss")
ax.legend()
plt.tight_layout()
plt.show()
print(f"after {UPDATES} passes: big batch {big_batch_losses[-1]:.5f}, accumulated "
      f"{accumulated.losses[-1]:.5f}, naive {naive.losses[-1]:.5f} "
      f"({naive.iterations} optimizer steps vs {accumulated.iterations})")

# %% [markdown]
# ## Takeaways
#
# * `strategy.run` returns `PerReplica` values in cross-replica context; you cannot add
#   them up in Python or hand them to `apply_gradients`. Accumulate *inside*
#   `strategy.run`, into replica-local `SyncOnRead` variables: zero communication.
# * Apply once per k micro-batches inside `strategy.run`; the optimizer's SUM
#   all-reduce is the single sync of the update (1 instead of k).
# * Divide each micro-batch loss by the global batch of the whole update
#   (micro batch × R × k). Per-replica means make the update k·R times too large.
# * Build the optimizer under the scope before the first traced apply (Keras 3.15 /
#   TF 2.21 fail otherwise with stateful optimizers on 2+ replicas).
# * Use `aggregation=SUM` for the buffers: they can then be read across replicas and
#   checkpointed mid-update (`NONE`, as in OpenNMT-tf's accumulator, can be neither on
#   2+ replicas — see `tests/test_accumulator.py`).
# * `experimental_run_v2` is gone; it is `strategy.run` (tensorflow/tensorflow#37551).
#
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
# * Lesson 05 does the same inside `Model.train_step`, for `fit`.
