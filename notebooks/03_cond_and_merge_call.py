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
# # 03 · `tf.cond`, `merge_call`, and an accumulating optimizer for `model.fit`
#
# **The question** ([Q3](../questions.md#q3), TF 2.5, tensorflow/tensorflow#50454). To
# accumulate gradients, a user replaces `optimizer.apply_gradients` by a function that adds
# the gradients into variables and calls the original `apply_gradients` inside
# `tf.cond(step % n == 0, ...)`. Under a distribution strategy that raises
# `RuntimeError: merge_call called while defining a new graph or a tf.function ...`.
# Their workaround drops the `tf.cond`: always call the original with
# `accumulated * mask` (mask 1 on every n-th step, else 0). It runs. Is it accumulation?
#
# **Short answer.** `apply_gradients` contains sync points (the gradient all-reduce and
# the mirrored-variable update, both `merge_call`s under `MirroredStrategy`), and
# `MirroredStrategy` cannot run a `merge_call` inside a `tf.cond` traced in replica
# context. Keras 3's own `gradient_accumulation_steps` has the same shape and fails the
# same way in `model.fit` (keras-team/keras#20582). The mask trick is not accumulation:
# the optimizer still updates on every micro-step (with zero gradients), which is harmless
# only for plain SGD. The fix decides in **cross-replica** context — the shape Keras'
# `LossScaleOptimizer` uses — and `distgrad.optimizer.AccumulatingOptimizer` packages it
# as a drop-in optimizer for `model.fit`.

# %%
import distgrad

strategy = distgrad.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
distgrad.environment_report(strategy)

# %%
import inspect
import os
import tempfile

import keras
import matplotlib.pyplot as plt
import numpy as np
import tensorflow as tf
from keras.src.optimizers import base_optimizer, loss_scale_optimizer
from tensorflow.python.distribute import mirrored_run, mirrored_strategy

from distgrad.lab.compare import check_close, weight_diff, weights_of
from distgrad.lab.data import regression_data
from distgrad.lab.recipes import custom_loop_run, fit_run
from distgrad.optimizer import AccumulatingOptimizer
from distgrad.pitfalls import cond_merge_call, mask_trick

tf.get_logger().setLevel("ERROR")  # fresh tf.functions on purpose: silence retracing notes
assert R >= 2, "this lesson is about several replicas: set DISTGRAD_REPLICAS >= 2"
STEPS, MICRO_BATCH, UPDATES = 4, 2 * R, 3  # k micro-batches of B per update, n updates
print(f"k = {STEPS} micro-batches of B = {MICRO_BATCH} per update, n = {UPDATES} updates")


def show_source(function, *markers, context=2):
    """Print the lines of `function`'s source around each marker; assert they exist."""
    lines = inspect.getsource(function).splitlines()
    for marker in markers:
        hits = [i for i, line in enumerate(lines) if marker in line]
        assert hits, f"{marker!r} not in {function.__qualname__}: the source changed"
        i = hits[0]
        print("\n".join(lines[max(0, i - context): i + context + 1]))
        print("    ...")


# %% [markdown]
# ## 1 · Reproduce: `apply_gradients` inside `tf.cond`
#
# `SeedCondPatch` is the question's `_GradientAccumulationPatch` with `tf.cond`, kept as
# written. `reproduce` installs it on a Keras `SGD` and runs a `tf.function` custom loop:
# one `strategy.run(replica_step)` per micro-batch.

# %%
record = cond_merge_call.reproduce(strategy)
print(record.error.type, "-", record.error.message.strip().splitlines()[-1][:400], "...")
assert record.error.type == "RuntimeError"
assert record.error.contains(cond_merge_call.MERGE_CALL_ERROR)
assert record.error.contains("control flow statement which contains a synchronization point")

# %% [markdown]
# The same patch without any strategy runs: there, `apply_gradients` has no `merge_call`
# at all (`strategy_supports_no_merge_call()` is true), so nothing crosses threads.

# %%
plain = cond_merge_call.reproduce(None)
print(plain)
assert plain.error is None and plain.supports_no_merge_call
assert plain.updates == plain.micro_steps // 2  # n = 2: it applied every second step
assert record.supports_no_merge_call is False

# %% [markdown]
# ## 2 · Keras 3's built-in `gradient_accumulation_steps` hits the same wall
#
# `keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)` in `model.fit` under
# `MirroredStrategy` (keras-team/keras#20582, open):

# %%
builtin = cond_merge_call.reproduce_builtin(strategy, steps=STEPS)
print(f"TensorFlow {builtin.tensorflow}, Keras {builtin.keras}, {builtin.strategy} x{builtin.replicas}")
print(builtin.error.type, "-", builtin.error.message.splitlines()[0])
assert builtin.error.type == "RuntimeError"
assert builtin.error.contains("Exception encountered when calling Cond.call()")
assert builtin.error.contains(cond_merge_call.MERGE_CALL_ERROR)

builtin_plain = cond_merge_call.reproduce_builtin(None, steps=STEPS, updates=2)
print("without a strategy:", builtin_plain.error, builtin_plain.vs_big_batch,
      f"updates={builtin_plain.updates}, micro-steps={builtin_plain.micro_steps}")
assert builtin_plain.error is None and builtin_plain.vs_big_batch.within()

# %% [markdown]
# Without a strategy the built-in is correct. Keras' own distributed test of it
# (`keras/src/backend/tensorflow/optimizer_distribute_test.py`,
# `test_gradient_accumulation`) calls `strategy.run` eagerly, where `ops.cond` is a Python
# `if`; `model.fit` traces the step, and the cond becomes a graph.
#
# ## 3 · Look inside: why a sync point cannot sit in a replica-context `tf.cond`
#
# **Where the sync points are.** The built-in's branch is an `ops.cond` whose true branch
# calls `_backend_update_step`; in the TensorFlow backend that function all-reduces the
# gradients and then `maybe_merge_call`s into `_distributed_tf_update_step` (lesson 01).

# %%
show_source(base_optimizer.BaseOptimizer._backend_apply_gradients,
            "self._backend_update_step(", "ops.cond(")

# %% [markdown]
# **Why `MirroredStrategy` refuses.** It runs the replica function once per device, each
# in its own thread, all tracing into one graph. A `merge_call` pauses every replica
# thread and runs the merge function *in the main thread*, on that graph. A `tf.cond`
# branch is traced as a separate graph, so a `merge_call` from inside it would hand the
# main thread tensors it cannot use. `_MirroredReplicaContext._merge_call` checks exactly
# that:

# %%
show_source(mirrored_run._MirroredReplicaContext._merge_call,
            "3. The `fn` passed to `_call_for_each_replica` contains a control-flow",
            "if ops.get_default_graph() != t.graph:", context=3)

# %% [markdown]
# **When there is no `merge_call`.** `MirroredStrategy` (and `MultiWorkerMirroredStrategy`,
# which shares this code) skip `merge_call` only inside an XLA-compiled function on
# all-GPU devices. Then the all-reduce is launched from each replica itself, and a cond
# around it works as long as every replica takes the same branch. Keras' `model.fit`
# does not ask for that by default: `jit_compile="auto"` turns XLA off under
# `tf.distribute` (`Trainer._resolve_auto_jit_compile`).

# %%
show_source(mirrored_strategy.MirroredExtended._use_merge_call,
            "return not control_flow_util.GraphOrParentsInXlaContext(", context=3)

# %% [markdown]
# On CPUs, then, `MultiWorkerMirroredStrategy` is a `merge_call` strategy too. Here is the
# same patch under a single-worker `MultiWorkerMirroredStrategy` (a fresh process, no
# `TF_CONFIG`: one worker, one CPU). This machine has no GPU, so the XLA-on-GPU path is
# described from the source above, not run.

# %%
multiworker = cond_merge_call.reproduce_under_multiworker()
print(multiworker.replicas, "replica; no merge_call:", multiworker.supports_no_merge_call,
      "->", multiworker.error.type)
assert multiworker.supports_no_merge_call is False
assert multiworker.error.contains(cond_merge_call.MERGE_CALL_ERROR)

# %% [markdown]
# **The working shape is in Keras.** `LossScaleOptimizer` must also skip or apply an
# update depending on a tensor (are the gradients finite?). Its TensorFlow path does not
# cond in replica context: it `merge_call`s first, evaluates the condition in
# cross-replica context, conds *there*, and goes back to the replicas with
# `call_for_each_replica` for the inner optimizer's `apply`, whose own `merge_call`s then
# run in fresh replica threads of the branch graph:

# %%
show_source(loss_scale_optimizer.LossScaleOptimizer._tf_apply,
            "# Note: We must call this cond() in a cross-replica context.",
            "tf.distribute.get_replica_context().merge_call(", context=3)

# %% [markdown]
# ## 4 · The mask trick, measured
#
# `mask_trick.patch_with_mask` installs lesson 04's `SeedAccumulationPatch` (the question's
# second version, line for line) and divides the gradients by k, so that, where it works,
# it averages like one big batch. `mask_trick.reproduce` feeds the same n·k micro-batches
# of B through `model.fit` on R replicas three ways: with the mask trick, with
# `AccumulatingOptimizer`, and — the reference — plain `fit` on one device with batches
# of k·B.

# %%
records = {name: mask_trick.reproduce(strategy, name, steps=STEPS, updates=UPDATES,
                                      micro_batch=MICRO_BATCH)
           for name in mask_trick.OPTIMIZERS}
print(f"{'optimizer':9s} {'mask trick vs big batch':>24s} {'iterations':>10s}   "
      f"{'AccumulatingOptimizer':>22s} {'iterations':>10s}")
for name, r in records.items():
    print(f"{name:9s} {r.mask_vs_big_batch.max_abs:24.3e} {r.mask_iterations:10d}   "
          f"{r.accumulating_vs_big_batch.max_abs:22.3e} {r.accumulating_iterations:10d}")

# %%
assert records["sgd"].mask_vs_big_batch.within()  # plain SGD: the mask trick matches
for name in ("momentum", "adam", "adamw"):
    assert not records[name].mask_vs_big_batch.within()  # drifts
for r in records.values():
    assert r.mask_iterations == UPDATES * STEPS  # iterations counts micro-steps
    assert r.accumulating_vs_big_batch.within()  # rtol = atol = 1e-6
    assert r.accumulating_iterations == r.reference_updates == UPDATES

# %% [markdown]
# Why: on the k−1 masked micro-steps the optimizer still runs its update rule, with a zero
# gradient. `zero_gradient_step` makes one real step, then one zero-gradient step, and
# compares the weights with the update rule evaluated by hand in numpy: momentum keeps
# moving (`w += momentum * velocity`), Adam's moments decay (`m *= beta_1`,
# `v *= beta_2`) and it still steps along `m / sqrt(v)`, decoupled weight decay shrinks the
# weights every micro-step, and `iterations` (Adam's bias correction, every learning-rate
# schedule) advances each time.

# %%
probes = {name: mask_trick.zero_gradient_step(name) for name in mask_trick.OPTIMIZERS}
probes["sgd+weight_decay"] = mask_trick.zero_gradient_step(
    lambda: keras.optimizers.SGD(0.1, weight_decay=0.1))
for name, p in probes.items():
    decay = "" if p.moments_vs_decay is None else f", moments vs beta*moments {p.moments_vs_decay.max_abs:.1e}"
    print(f"{name:17s} weights moved {p.weight_change_max_abs:.3e}; vs the update rule "
          f"{p.vs_prediction.max_abs:.1e}{decay}; iterations {p.iterations_before} -> {p.iterations_after}")
    assert p.vs_prediction.within() and p.iterations_after == p.iterations_before + 1
    if p.moments_vs_decay is not None:
        assert p.moments_vs_decay.within()
assert probes["sgd"].weight_change_max_abs == 0.0
assert all(probes[n].weight_change_max_abs > 0 for n in ("momentum", "adam", "adamw", "sgd+weight_decay"))

# %% [markdown]
# And it costs k all-reduces per update instead of one. `fit_step_placement` traces
# `strategy.run(model.train_step)` the way `model.fit` runs it and splits the all-reduces
# into those that run on every call and those inside a `tf.cond` branch:

# %%
r = records["adam"]
print("mask trick:            ", r.mask_placement, "->", r.mask_placement.per_update(STEPS), "per update")
print("AccumulatingOptimizer: ", r.accumulating_placement, "->",
      r.accumulating_placement.per_update(STEPS), "per update")
assert (r.mask_placement.every_call, r.mask_placement.per_update(STEPS)) == (1, STEPS)
assert (r.accumulating_placement.every_call, r.accumulating_placement.conditional) == (0, 1)

# %%
names = list(records)
fig, ax = plt.subplots(figsize=(6, 3))
positions = np.arange(len(names))
floor = 1e-9  # to show exact zeros on a log axis
ax.bar(positions - 0.2, [max(records[n].mask_vs_big_batch.max_abs, floor) for n in names], 0.4,
       label="mask trick")
ax.bar(positions + 0.2, [max(records[n].accumulating_vs_big_batch.max_abs, floor) for n in names],
       0.4, label="AccumulatingOptimizer")
ax.axhline(1e-6, color="gray", linestyle="--", linewidth=1, label="atol 1e-6")
ax.set_xticks(positions, names)
ax.set_yscale("log")
ax.set_ylabel("max |w - w_big batch|")
ax.set_title(f"after {UPDATES} updates of k={STEPS} micro-batches, {R} replicas")
ax.legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# ## 5 · The fix
#
# **(a) Decide in Python** (lesson 02): accumulate in one `tf.function`, apply in another,
# and let a Python `if` choose which to run. No control flow is traced around a sync point.
# That needs a custom loop.
#
# **(b) Decide in cross-replica context**, as `LossScaleOptimizer` does. That fits inside
# one traced step, hence inside `model.fit`. `AccumulatingOptimizer(inner_optimizer, accumulation_steps)` is
# a Keras 3 optimizer: its `apply` adds this replica's gradients to replica-local float32
# accumulators (ON_READ variables: no communication), then `merge_call`s once:

# %%
print(inspect.getsource(AccumulatingOptimizer._cross_replica_step))
print(inspect.getsource(AccumulatingOptimizer._apply_accumulated))

# %% [markdown]
# The inner optimizer's ordinary `apply` then runs on `accumulated / k` in replica
# context: its one SUM all-reduce is the only gradient communication of the cycle, its
# `iterations` counts updates (the wrapper's `iterations` *is* the inner one;
# `total_micro_steps` counts calls), and its weight decay runs once per update. Clipping moves
# from the inner optimizer to the wrapper, which clips the all-reduced mean (lesson 01:
# Keras would clip each replica's partial gradient), paying one extra all-reduce only when
# clipping is on. Without a strategy, the same code takes a plain `tf.cond`.
#
# ## 6 · Prove it
#
# Section 4 already compared `AccumulatingOptimizer` in `model.fit` on R replicas with
# one-device big-batch `fit` for SGD, momentum, Adam and AdamW. The same holds in a
# custom loop (`apply_gradients` inside `strategy.run`), and with clipping, which must act
# on the summed update:

# %%
x, y = regression_data(MICRO_BATCH * STEPS * UPDATES)
adam = mask_trick.OPTIMIZERS["adam"]
reference = fit_run(None, adam, x, y, MICRO_BATCH * STEPS)
loop = custom_loop_run(strategy, lambda: AccumulatingOptimizer(adam(), STEPS), x, y, MICRO_BATCH)
print("custom loop vs big batch:", check_close(loop.final, reference.final),
      f"updates={loop.updates}, micro-steps={loop.total_micro_steps}")
assert (loop.updates, loop.total_micro_steps) == (UPDATES, UPDATES * STEPS)

clipped = lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05)
clip_reference = fit_run(None, clipped, x, y, MICRO_BATCH * STEPS)
clip_run = fit_run(strategy, lambda: AccumulatingOptimizer(clipped(), STEPS), x, y, MICRO_BATCH)
unclipped = fit_run(None, mask_trick.OPTIMIZERS["sgd"], x, y, MICRO_BATCH * STEPS)
print("global_clipnorm, vs one-device clipped big batch:", check_close(clip_run.final, clip_reference.final))
print("  (clipping is active: unclipped differs by",
      f"{weight_diff(clip_reference.final, unclipped.final).max_abs:.3e})")
assert not weight_diff(clip_reference.final, unclipped.final).within()
placement = mask_trick.fit_step_placement(clip_run.model, x, y, MICRO_BATCH)
print("  all-reduces with clipping:", placement)
assert (placement.every_call, placement.conditional) == (0, 2)

# %% [markdown]
# Its state is ordinary optimizer state. Save in the middle of an accumulation cycle,
# load, continue: the result equals the uninterrupted run.

# %%
split = 6 * MICRO_BATCH  # 1 update + 2 accumulated micro-batches
first = fit_run(strategy, lambda: AccumulatingOptimizer(adam(), STEPS), x[:split], y[:split],
                MICRO_BATCH)
with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "mid_cycle.keras")
    first.model.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
print(type(loaded.optimizer).__name__, "updates", int(loaded.optimizer.iterations.numpy()),
      "micro-steps", int(loaded.optimizer.total_micro_steps.numpy()))
assert (int(loaded.optimizer.iterations.numpy()), int(loaded.optimizer.total_micro_steps.numpy())) == (1, 6)
loaded.fit(x[split:], y[split:], batch_size=MICRO_BATCH, epochs=1, shuffle=False, verbose=0)
print("saved mid-cycle, loaded, continued vs big batch:", check_close(weights_of(loaded), reference.final))

# %% [markdown]
# ## Takeaways
#
# * A sync point (`apply_gradients`: all-reduce and mirrored update, both `merge_call`s)
#   inside a `tf.cond` traced in replica context fails under `MirroredStrategy`, and under
#   `MultiWorkerMirroredStrategy` on CPUs. Only XLA-compiled steps on GPUs skip
#   `merge_call`.
# * Keras 3's `gradient_accumulation_steps` is such a cond: it works without a strategy
#   and fails in `model.fit` under `MirroredStrategy` (keras-team/keras#20582).
# * The mask trick runs but is not accumulation: the optimizer updates on every micro-step.
#   Only plain SGD ignores zero gradients; momentum, Adam and weight decay drift,
#   `iterations` counts micro-steps, and every micro-step pays the all-reduce.
# * Decide in Python (lesson 02), or decide in cross-replica context via `merge_call` and
#   go back with `call_for_each_replica`, as `LossScaleOptimizer` does.
#   `AccumulatingOptimizer` does the latter: one all-reduce per update, updates counted as
#   iterations, clipping and weight decay on the accumulated update, checkpointable.
# * Under `mixed_float16`, `model.compile` wraps it in a `LossScaleOptimizer`; what happens
#   to non-finite micro-batches is lesson 04.
#
# ## Further reading
#
# * keras-team/keras#20582 — "Rethink the conditional in the gradient accumulation".
# * keras-team/keras#17429, tensorflow/tensorflow#59487, keras-team/tf-keras#301 — the
#   same `merge_call` RuntimeError from accumulation in `train_step` / optimizer wrappers.
# * keras-team/keras#16633, keras-team/tf-keras#107 — gradient accumulation requests.
# * tensorflow/tensorflow#50454 — the question's own issue; tensorflow/addons#2525 — the
#   same author's accumulator proposal.
# * Installed source: `keras/src/optimizers/loss_scale_optimizer.py` (`_tf_apply`),
#   `keras/src/optimizers/base_optimizer.py` (`_backend_apply_gradients`),
#   `tensorflow/python/distribute/mirrored_run.py` (`_MirroredReplicaContext._merge_call`),
#   `tensorflow/python/distribute/merge_call_interim.py`.
