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
# # 04 · Patching `apply_gradients` under `mixed_float16`: the LossScaleOptimizer pitfall
#
# **The question** ([Q3](../questions.md#q3), second half; TF 2.5, June 2021,
# tensorflow/tensorflow#50454 "assign_add() not working on GPU?"). The user accumulates
# gradients by monkey-patching `optimizer.apply_gradients`: add the gradients into
# variables, always call the original with `accumulated * apply` (apply = 1 every n-th
# step, else 0), reset with `accumulated * keep`. On the GPU, under `mixed_float16`, the
# optimizer had been wrapped in a `LossScaleOptimizer` first, and the patch went onto the
# wrapper: training behaved as if `assign_add` "did nothing", while `assign` converged.
# They concluded they had patched the wrong instance — but patching
# `optimizer.inner_optimizer.apply_gradients` "does not work either", and they never
# found out why.
#
# **Short answer.** Patching the wrapper *does* accumulate. What kills it is the first
# overflow, which dynamic loss scaling expects (it starts at 2**15 and halves): the
# non-finite micro-batch goes into the accumulator, the reset `inf * 0` is `nan`, and from
# then on every step hands the wrapper `nan`; it skips every step forever. Patching the
# inner optimizer fails for a different reason in each Keras: in tf-keras the seed's
# patch returns `None` and breaks the wrapper's `tf.cond`; in Keras 3 the wrapper calls
# `inner_optimizer.apply`, so the patch never runs. On the way we meet a hole in Keras 3's
# own `LossScaleOptimizer`: it checks finiteness on replica 0 only.

# %%
import distgrad

strategy = distgrad.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
distgrad.environment_report(strategy)

# %%
import importlib.util
import inspect
import pathlib

import keras
import matplotlib.pyplot as plt
import numpy as np
import tensorflow as tf
from keras.src.optimizers import loss_scale_optimizer

from distgrad.lab import mixed
from distgrad.lab.compare import check_close, check_not_close
from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
from distgrad.pitfalls import loss_scale_patch as lsp
from distgrad.pitfalls import lso_first_replica_finite as first_replica

tf.get_logger().setLevel("ERROR")  # fresh tf.functions on purpose: silence retracing notes
assert R >= 2, "this lesson needs several replicas: set DISTGRAD_REPLICAS >= 2"
S, C = mixed.DEFAULT_INITIAL_SCALE, mixed.CONTROLLED_INITIAL_SCALE
MIXED = {"rtol": mixed.MIXED_PRECISION_RTOL, "atol": mixed.MIXED_PRECISION_ATOL}
print(f"default initial loss scale {S:g}; mixed-precision tolerance {MIXED}")

# %% [markdown]
# `SeedAccumulationPatch` (`distgrad.pitfalls.mask_trick`; lesson 03 met it) is the
# question's patch line for line (plus a `calls` counter);
# `lsp.patch_optimizer(optimizer, n, variables, target)` installs it on the
# wrapper (`"loss_scale_optimizer"`) or on `inner_optimizer`. `model.compile` under
# `mixed_float16` adds the same `LossScaleOptimizer` by itself; the user did it by hand.
# All policy changes go through `mixed.mixed_precision_policy()`, which restores `float32`.
#
# ## 1 · Keras 3: which methods run, where, on which gradients
#
# `lsp.spy_patched_fit` runs two micro-batches of `model.fit` with n = 2 and records every
# *execution* of the methods between the train step and the variable update. To make
# "which gradient" one number, every replica and micro-batch sees the same 4 examples
# and the learning rate is 0; `scale_seen` is the gradient passed divided by one
# replica's unscaled float32 contribution (≈ loss scale: scaled; ≈ 1: unscaled).

# %%
def show(record):
    for step, function, context, calls, dtypes, seen in record.table():
        seen = "" if seen is None else f"{seen:10.1f}"
        print(f"step {step}  {function:52s} {context:13s} x{calls}  {dtypes[0]}  {seen}")


spied = {target: lsp.spy_patched_fit(strategy, target)
         for target in ("loss_scale_optimizer", "inner_optimizer")}
show(spied["loss_scale_optimizer"])

# %%
wrapper_patch = spied["loss_scale_optimizer"]
for step in (1, 2):
    calls = wrapper_patch.of("SeedAccumulationPatch.apply_gradients", step)
    assert sorted(c.replica for c in calls) == list(range(R))  # once per replica
    assert {c.context for c in calls} == {"replica"} and {c.dtypes for c in calls} == {("float32",)}
    assert all(abs(c.scale_seen / S - 1) < 1e-2 for c in calls)  # scaled partial gradients
assert all(c.scale_seen == 0.0 for c in wrapper_patch.of("LossScaleOptimizer.apply_gradients", 1))
assert all(abs(c.scale_seen / (2 * S) - 1) < 1e-2
           for c in wrapper_patch.of("LossScaleOptimizer.apply_gradients", 2))
assert all(abs(c.scale_seen / 2 - 1) < 1e-2 for c in wrapper_patch.of("SGD.apply", 2))

# %% [markdown]
# Read it top to bottom. The patch runs per replica, in replica context, on **scaled**
# float32 gradients: Keras 3's `TensorFlowTrainer.train_step` multiplies the loss by
# `optimizer.scale_loss` and differentiates with respect to the float32 variables (the
# float16 part of the backward pass is inside; the cast back to float32 is the last op).
# On step 1 it hands the wrapper zeros; on step 2 the scaled *sum* (2 × scale); the
# wrapper checks finiteness, divides by its current `dynamic_scale` in
# `_stateful_handle_finite_grads`, and the inner `SGD.apply` gets the unscaled sum; its
# all-reduce then sums the replicas. So, without overflows, this *is* accumulation.
#
# Now the inner-optimizer patch:

# %%
show(spied["inner_optimizer"])
inner_patch = spied["inner_optimizer"]
assert inner_patch.count("SeedAccumulationPatch.apply_gradients") == 0
assert inner_patch.count("SGD.apply_gradients") == 0
source = inspect.getsource(loss_scale_optimizer.LossScaleOptimizer._stateful_handle_finite_grads)
assert "self.inner_optimizer.apply(" in source and "apply_gradients" not in source
print([line.strip() for line in source.splitlines() if "inner_optimizer" in line])

# %% [markdown]
# The patch never runs: `LossScaleOptimizer._stateful_handle_finite_grads` calls
# `self.inner_optimizer.apply(...)`, not `apply_gradients`, so the instance attribute the
# user set is never looked up. Training is plain, non-accumulating training.
#
# ## 2 · Keras 3: what `model.fit` does to the weights
#
# `lsp.reproduce` runs 6 micro-batches (n = 2, SGD 0.1) in ordinary graph-mode `fit` and
# records the loss scale, `iterations` and the largest weight change after each. To
# control overflows we start the scale at `C` and give micro-batch 3 one example whose
# target is `OUTLIER_TARGET`: its *scaled* gradient exceeds float16's 65504 while the
# float32 loss stays finite — an overflow caused by loss scaling, as in real training.

# %%
runs = {target: lsp.reproduce(strategy, target, overflow_step=3)
        for target in ("none", "loss_scale_optimizer", "inner_optimizer")}
for target, run in runs.items():
    print(f"{target:21s} scale {run.loss_scales}\n{'':21s} iterations {run.iterations}  "
          f"max |Δw| {tuple(round(c, 4) for c in run.weight_changes)}  "
          f"accumulators finite: {run.accumulators_finite}")

# %%
stock, wrapped, inner = runs["none"], runs["loss_scale_optimizer"], runs["inner_optimizer"]
assert stock.loss_scales == (C, C) + (C / 2,) * 4 and stock.weight_changes[2] == 0.0
assert wrapped.loss_scales == (C, C, C / 2, C / 4, C / 8, C / 16)  # halved every step
assert wrapped.iterations == (1, 2, 2, 2, 2, 2)  # every step after the overflow skipped
assert wrapped.weight_changes[2:] == (0.0,) * 4 and wrapped.accumulators_finite is False
assert inner.patch_calls == 0
check_close(inner.final_weights, stock.final_weights, rtol=0, atol=0)  # plain training

# %% [markdown]
# The stock wrapper skips micro-batch 3, halves the scale once and trains on. The
# patched wrapper skips *every* step from the overflow on: the accumulator holds `nan`
# (`inf * keep` with keep = 0 is `nan`), the scale halves each step, the weights are
# frozen — "assign_add does nothing". With `assign(grad)` the poison is overwritten on
# the next step, which is why the user's `assign` run converged.
#
# Before the first overflow the wrapper patch matches one big-batch step per window (the
# patch sums micro-batch gradients, so the reference uses twice the learning rate):

# %%
clean = lsp.reproduce(strategy, "loss_scale_optimizer", overflow_step=None)
no_accumulation = lsp.reproduce(strategy, "none", overflow_step=None)
print(check_close(clean.final_weights, lsp.accumulated_reference(strategy), **MIXED))
check_not_close(clean.final_weights, no_accumulation.final_weights, **MIXED)
assert clean.iterations == (1, 2, 3, 4, 5, 6)  # but `iterations` counts micro-batches

# %% [markdown]
# No outlier is needed on the user's side. At the default initial scale, on one device,
# this lesson's data overflow by themselves on the first micro-batch:

# %%
one_device = distgrad.make_strategy(1)
natural_stock = lsp.reproduce(one_device, "none", overflow_step=None, initial_scale=S)
natural_patch = lsp.reproduce(one_device, "loss_scale_optimizer", overflow_step=None, initial_scale=S)
print("stock  ", natural_stock.loss_scales, natural_stock.iterations)
print("patched", natural_patch.loss_scales, natural_patch.iterations)
assert natural_stock.loss_scales[0] == S / 2 and natural_stock.iterations[-1] >= 3
assert natural_patch.iterations == (0,) * 6 and natural_patch.weight_changes == (0.0,) * 6

# %% [markdown]
# ## 3 · The original: tf-keras, the question's own `train_step`
#
# The user wrote Keras 2 code: a custom `train_step` with `get_scaled_loss` /
# `get_unscaled_gradients` and the era's `OptimizerV2` (`tf.keras.optimizers.legacy.SGD`).
# `lsp.legacy_reproduction` runs it, the same data and both patches, under tf-keras in one
# child process (`distgrad.lab.legacy.run_legacy` sets `TF_USE_LEGACY_KERAS=1` before
# TensorFlow is imported; the tf-keras code is `distgrad/pitfalls/legacy_loss_scale.py`),
# plus tf-keras' newer optimizer (`LossScaleOptimizerV3`).

# %%
legacy = lsp.legacy_reproduction(replicas=R)
print(f"TensorFlow {legacy.tensorflow}, tf-keras {legacy.tf_keras}, {legacy.replicas} "
      f"replicas, {legacy.seconds:.0f} s")
for name, record in legacy.records.items():
    outcome = f"{record.error.type}" if record.error else f"iterations {record.iterations}"
    print(f"{name:40s} {record.lso_class:22s} calls {record.patch_calls}  {outcome}")

# %%
frozen = legacy["patch on LSO, overflow at 3"]
assert frozen.loss_scales == wrapped.loss_scales and frozen.accumulators_finite is False
assert frozen.iterations == (1, 2, 3, 4, 5, 6)  # tf-keras counts skipped steps
np.testing.assert_allclose(frozen.weight_changes, wrapped.weight_changes, **MIXED)
check_close(legacy["patch on LSO"].final_weights, legacy["big batch"].final_weights, **MIXED)
broken = legacy["patch on inner"]
assert broken.error.type == "ValueError"
assert broken.error.contains("Lengths of branch outputs of cond must match")
print(broken.patch_traces[0])
fixed_return = legacy["patch on inner, returning the result"]
assert fixed_return.error is None and fixed_return.patch_calls == 5 and fixed_return.weights_finite
print(broken.error.message.strip().splitlines()[-3:])

# %% [markdown]
# * **Patch on the wrapper** behaves exactly as in Keras 3 (same weight changes within the
#   mixed tolerance): correct accumulation of *unscaled* gradients (the seed's train step
#   unscales first) until the overflow, frozen after it. tf-keras still counts the skipped
#   steps in `iterations`.
# * **Patch on `inner_optimizer`** is reached in tf-keras — `LossScaleOptimizer._apply_gradients`
#   calls `self._optimizer.apply_gradients(..., experimental_aggregate_gradients=False)`
#   from `call_for_each_replica` — but inside the wrapper's
#   `smart_cond(should_apply_grads, apply_fn, do_not_apply_fn)`. The seed's patch returns
#   `None`; `do_not_apply_fn` returns the `iterations` increment: the branches' outputs
#   differ and tracing fails with the `ValueError` above. Returning the original's result
#   is enough: then the overflowing micro-batch never reaches the accumulator (5 calls for
#   6 micro-batches). That — accumulation *inside* the wrapper — is the right composition.

# %% [markdown]
# ## 4 · A hole in Keras 3's wrapper: `finite` from the first replica
#
# `LossScaleOptimizer._tf_apply` (installed source):

# %%
tf_apply = inspect.getsource(loss_scale_optimizer.LossScaleOptimizer._tf_apply)
excerpt = tf_apply[tf_apply.index("finite_per_replica ="):tf_apply.index("def apply_fn")]
print(excerpt)
assert "experimental_local_results(" in excerpt and ")[0]" in excerpt
legacy_source = pathlib.Path(importlib.util.find_spec("tf_keras").submodule_search_locations[0],
                             "src/mixed_precision/loss_scale_optimizer.py").read_text()
assert "grads_and_vars = self._optimizer.aggregate_gradients(grads_and_vars)" in legacy_source

# %% [markdown]
# The comment is inherited from tf-keras, whose `apply_gradients` all-reduces the
# gradients *before* the check ("so that any NaN or Inf gradients are propagated to each
# replica"). Keras 3's train step passes each replica's *partial* gradients; the SUM
# happens later, inside the inner optimizer. Plain `model.fit`, SGD, `mixed_float16`, the
# default scale, an overflow in one replica's shard of micro-batch 2:

# %%
for replicas_hit in [(1,), (0,), tuple(range(R))]:
    run = first_replica.reproduce(strategy, overflow_replicas=replicas_hit)
    flags = first_replica.finite_flags(strategy, overflow_replicas=replicas_hit)
    print(f"overflow on {replicas_hit}: check_finite {flags.finite_by_replica}, "
          f"scale {run.loss_scales}, weights finite: {run.weights_finite}")
    assert run.weights_finite == (0 in replicas_hit)  # only replica 0's flag counts
assert legacy["stock, overflow on replica 1 only"].weights_finite  # tf-keras got it right

# %% [markdown]
# An overflow on replica 1 only is applied: the inner optimizer's all-reduce sums `inf`
# into every copy of the weights. The fix,
# `distgrad.mixed_precision.AllReplicasFiniteLossScaleOptimizer`, is the stock wrapper
# with `finite = reduce_all(stack(experimental_local_results(...)))`: all replicas'
# flags, read in cross-replica context (no extra collective).

# %%
for replicas_hit in [(1,), (0,)]:
    run = first_replica.reproduce(strategy, overflow_replicas=replicas_hit, fixed=True)
    print(f"fixed wrapper, overflow on {replicas_hit}: scale {run.loss_scales}")
    assert run.weights_finite and run.loss_scales == (S, S / 2, S / 2, S / 2)

# %% [markdown]
# ## 5 · The fix: accumulate *inside* the wrapper
#
# `distgrad.optimizer.AccumulatingOptimizer` (lesson 03) under `mixed_float16`: pass it
# to `model.compile` and Keras wraps it, `LossScaleOptimizer(AccumulatingOptimizer(SGD))`.
# That order is the whole fix:
#
# * **unscale, then accumulate**: the wrapper divides each micro-batch by the scale *it*
#   was computed with before our `apply` adds it — the scale may change inside a cycle;
# * **float32 accumulators**, whatever the variables' dtype (asserted below);
# * **a micro-batch the wrapper sees overflow is skipped before accumulation**: not added,
#   not counted in `total_micro_steps`, loss scale halved, `iterations` unchanged; the cycle
#   waits for `steps` good micro-batches.

# %%
mb = 4 * R
x, y = mixed.overflow_data(8, mb, None, R)
auto = mixed.mixed_precision_fit(strategy, x, y, mb, 2, initial_scale=None)
print(auto.wrapper, "(", auto.wrapped, ")", "accumulators:", auto.accumulator_dtypes)
assert (auto.wrapper, auto.wrapped) == ("LossScaleOptimizer", "AccumulatingOptimizer")
assert auto.accumulator_dtypes == ("float32",) * 4
for name, make in {"sgd": lambda: keras.optimizers.SGD(0.1),
                   "adam": lambda: keras.optimizers.Adam(0.01)}.items():
    accumulated = mixed.mixed_precision_fit(strategy, x, y, mb, 2, make)
    big_batch = mixed.mixed_precision_fit(strategy, x, y, 2 * mb, None, make)
    print(f"{name}: 8 micro-batches, k=2 vs 4 big-batch steps:",
          check_close(accumulated.final_weights, big_batch.final_weights, **MIXED))
    assert accumulated.iterations == (0, 1, 1, 2, 2, 3, 3, 4)

# %%
x6, y6 = mixed.overflow_data(6, mb, None, R)
growing = lambda inner, **kw: keras.mixed_precision.LossScaleOptimizer(
    inner, **{**kw, "dynamic_growth_steps": 1})  # the scale doubles after every micro-batch
fixed = mixed.mixed_precision_fit(strategy, x6, y6, mb, 2, lambda: keras.optimizers.SGD(0.2),
                                  initial_scale=16, dynamic_growth_steps=1)
patched = lsp.reproduce(strategy, "loss_scale_optimizer", overflow_step=None, initial_scale=16,
                        wrapper=growing)
reference = lsp.accumulated_reference(strategy, initial_scale=16)
print("scales", fixed.loss_scales)
print("AccumulatingOptimizer vs big batch:", check_close(fixed.final_weights, reference, **MIXED))
print("seed patch on the wrapper vs big batch:", check_not_close(patched.final_weights, reference, **MIXED))

# %% [markdown]
# With a scale that changes inside every cycle, the seed's wrapper patch (scaled sum ÷
# latest scale) is wrong even without an overflow; unscaling per micro-batch is not.
#
# ### Non-finite micro-batches, and the loss-scale trajectory
#
# Now the default scale, growth after every 3 good micro-batches, and an outlier on all
# replicas at micro-batch 8 — once under Keras' wrapper, once under
# `AllReplicasFiniteLossScaleOptimizer`.

# %%
def skipped(record):
    previous = (0,) + record.total_micro_steps[:-1]
    return [t + 1 for t, (a, b) in enumerate(zip(previous, record.total_micro_steps)) if a == b]


x16, y16 = mixed.overflow_data(16, mb, 8, R)
trajectories = {
    "Keras LossScaleOptimizer": mixed.mixed_precision_fit(
        strategy, x16, y16, mb, 2, initial_scale=S, dynamic_growth_steps=3),
    "AllReplicasFiniteLossScaleOptimizer": mixed.mixed_precision_fit(
        strategy, x16, y16, mb, 2, initial_scale=S, dynamic_growth_steps=3,
        wrapper=AllReplicasFiniteLossScaleOptimizer),
}
fig, (ax_scale, ax_updates) = plt.subplots(1, 2, figsize=(11, 3.5))
steps = np.arange(1, 17)
for name, record in trajectories.items():
    ax_scale.step(steps, np.log2(record.loss_scales), where="post", label=name)
    ax_updates.step(steps, record.iterations, where="post", label=name)
    bad = [t + 1 for t, ok in enumerate(record.weights_finite) if not ok]
    if bad:
        ax_updates.axvspan(bad[0], 16, color="red", alpha=0.1, label=f"{name}: weights non-finite")
    print(f"{name}: skipped {skipped(record)}, first non-finite weights at "
          f"{bad[0] if bad else None}, updates {record.iterations[-1]}")
for ax in (ax_scale, ax_updates):
    ax.axvline(8, color="gray", linestyle=":", label="outlier (all replicas)")
    ax.set_xlabel("micro-batch")
ax_scale.set_ylabel("log2(loss scale)")
ax_updates.set_ylabel("updates (iterations)")
ax_updates.legend(fontsize=7)
plt.tight_layout()

# %%
safe = trajectories["AllReplicasFiniteLossScaleOptimizer"]
scales = (S,) + safe.loss_scales
assert all(safe.weights_finite) and 8 in skipped(safe)
assert [t + 1 for t in range(16) if scales[t + 1] == scales[t] / 2] == skipped(safe)
assert safe.iterations[-1] == safe.total_micro_steps[-1] // 2
stock_run = trajectories["Keras LossScaleOptimizer"]
if not all(stock_run.weights_finite):  # an overflow the wrapper missed
    t = stock_run.weights_finite.index(False)
    missed = sorted(set(skipped(safe)) - set(skipped(stock_run)))
    assert missed and missed[0] <= t + 1  # the all-replica check skipped it, in this cycle
    assert stock_run.loss_scales[t] == stock_run.loss_scales[t - 1]  # no halving: unseen
    assert stock_run.total_micro_steps[t] == stock_run.total_micro_steps[t - 1] + 1  # added

# %% [markdown]
# Read the plot: every halving of the scale is a skipped micro-batch (`total_micro_steps`
# does not move) and a pause in the updates; growth follows every 3 good micro-batches.
# Compare the two printouts: a micro-batch the all-replica wrapper skips but Keras'
# wrapper does not is an overflow that happened *by itself* on a replica other than 0
# (we injected only the one on all replicas). Under Keras' wrapper it is accumulated and
# summed into the weights at the end of its cycle — the red band, if your run has one
# (ours, on CPU, does): section 4's hole, met in the wild, inside the accumulating
# optimizer.
#
# So the accumulating optimizer must not trust the wrapper's check. The semantics
# `AccumulatingOptimizer` implements: when an update is due, check **every replica's**
# accumulators in cross-replica context (no collective); if any is non-finite, **drop the
# cycle** — no update, accumulators reset, `iterations` unchanged. (The loss scale is not
# lowered: the wrapper never learned of the overflow. Wrapping with
# `AllReplicasFiniteLossScaleOptimizer` instead skips the bad micro-batch itself and
# halves the scale.) With an overflow on replica 1 only, at micro-batch 3:

# %%
x_hole, y_hole = mixed.overflow_data(8, mb, 3, R, overflow_replicas=(1,))
hole = mixed.mixed_precision_fit(strategy, x_hole, y_hole, mb, 2)
print("Keras' wrapper:    iterations", hole.iterations, "finite", hole.weights_finite)
assert all(hole.weights_finite) and hole.iterations == (0, 1, 1, 1, 1, 2, 2, 3)  # cycle 2 dropped
guarded = mixed.mixed_precision_fit(strategy, x_hole, y_hole, mb, 2,
                                    wrapper=AllReplicasFiniteLossScaleOptimizer)
print("all-replica check: total_micro_steps", guarded.total_micro_steps,
      "finite", guarded.weights_finite)
assert all(guarded.weights_finite) and guarded.total_micro_steps == (1, 2, 2, 3, 4, 5, 6, 7)

# %% [markdown]
# ## Takeaways
#
# * Patching `apply_gradients` on a `LossScaleOptimizer` accumulates **scaled** gradients
#   (Keras 3) or unscaled ones (the seed's tf-keras train step) — and dies at the first
#   overflow: `nan` enters the accumulator, `x * 0` cannot reset it, every later step is
#   skipped. Dynamic loss scaling *expects* overflows, so sooner or later it happens
#   (here, on one device: on the very first micro-batch).
# * Patching `inner_optimizer.apply_gradients` is dead code in Keras 3 (the wrapper calls
#   `inner.apply`), and a `tf.cond` output mismatch in tf-keras (the patch returns `None`).
# * Compose the other way round: `LossScaleOptimizer(Accumulating(inner))`. Unscale per
#   micro-batch, accumulate in float32, skip non-finite micro-batches before accumulation.
# * Keras 3's `LossScaleOptimizer` checks finiteness on **replica 0 only**; the comment
#   assumes all-reduced gradients that Keras 3 no longer has. Check all replicas.
#
# ## Further reading
#
# * tensorflow/tensorflow#50454 — the question's issue ("assign_add() not working on GPU?").
# * keras-team/keras#14829 — gradient accumulation with mixed precision in tf.keras.
# * TensorFlow guide *Mixed precision*; `keras.mixed_precision.LossScaleOptimizer` API docs.
# * Installed source: `keras/src/optimizers/loss_scale_optimizer.py` (`_tf_apply`,
#   `_stateful_handle_finite_grads`), `keras/src/backend/tensorflow/trainer.py`
#   (`train_step`), `tf_keras/src/mixed_precision/loss_scale_optimizer.py`
#   (`apply_gradients`, `_apply_gradients`).
