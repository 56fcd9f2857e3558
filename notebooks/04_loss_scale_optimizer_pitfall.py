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
# gradients by monkey-patching `optimizer.apply_gradients` with the mask patch of
# [lesson 03 §6](03_cond_and_merge_call.ipynb): add the gradients into variables, always
# call the original with `accumulated * apply` (apply = 1 every n-th step, else 0), reset
# with `accumulated * keep`. On the GPU, under `mixed_float16`, the optimizer had been
# wrapped in a `LossScaleOptimizer` first, and the patch went onto the wrapper: training
# behaved as if `assign_add` "did nothing", while `assign` converged. They concluded they
# had patched the wrong instance — but patching `optimizer.inner_optimizer.apply_gradients`
# "does not work either", and they never found out why.
#
# **Short answer.** Patching the wrapper *does* accumulate. What kills it is the first
# overflow, which dynamic loss scaling expects (it starts at 2**15 and halves): the
# non-finite micro-batch goes into the accumulator, the reset `inf * 0` is `nan`, and from
# then on every step hands the wrapper `nan`; it skips every step forever. Patching the
# inner optimizer fails for a different reason in each Keras: in tf-keras the question's
# patch returns `None` and breaks the wrapper's `tf.cond`; in Keras 3 the wrapper calls
# `inner_optimizer.apply`, so the patch never runs. The fix is an accumulating optimizer
# *inside* the wrapper. On the way we meet a hole in Keras 3's own `LossScaleOptimizer`:
# it checks finiteness on replica 0 only, so the wrapper to use is distgrad's
# `AllReplicasFiniteLossScaleOptimizer`, which checks every replica (§5).

# %%
import distgrad

strategy = distgrad.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync

from distgrad.lab.display import show_environment, show_table

show_environment(distgrad.environment_report(strategy))

# %%
import importlib.util
import inspect
import pathlib
import re
import textwrap
import warnings

import keras
import matplotlib.pyplot as plt
import numpy as np
import tensorflow as tf
from IPython.display import Code, display
from keras.src.optimizers import loss_scale_optimizer

from distgrad.lab import mixed
from distgrad.lab.compare import OPTIMIZERS, check_close, check_not_close
from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
from distgrad.pitfalls import loss_scale_patch as lsp
from distgrad.pitfalls import lso_first_replica_finite as first_replica
from distgrad.pitfalls.mask_trick import QuestionMaskPatch

tf.get_logger().setLevel("ERROR")  # fresh tf.functions on purpose: silence retracing notes
assert R >= 2, "this lesson needs several replicas: set DISTGRAD_REPLICAS >= 2"
S, C = mixed.DEFAULT_INITIAL_SCALE, mixed.CONTROLLED_INITIAL_SCALE
MIXED = {"rtol": mixed.MIXED_PRECISION_RTOL, "atol": mixed.MIXED_PRECISION_ATOL}
print(f"default initial loss scale {S:g}; mixed-precision tolerance {MIXED}")

# %% [markdown]
# ## The question's two patches
#
# The question's answer shows how the patch was installed, and the variant that "does
# NOT work either" (quoted as posted):
#
# ```python
# if precision_policy.name.startswith('mixed'):
#     logger.info(f'Using LossScaleOptimizer (policy: "{precision_policy.name})"')
#     optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
#
# if grad_acc_n > 1:
#     # --> This patched the LossScaleOptimizer which caused the problem:
#     optimizer = grad_acc.get_patched_optimizer(optimizer=optimizer, n=grad_acc_n)
# ```
#
# ```python
# if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
#     # Warning: This does NOT work either (just an example)!
#     optimizer.inner_optimizer.apply_gradients = accumulator.apply_gradients
#     raise Exception('Don\'t do this!')
# else:
#     optimizer.apply_gradients = accumulator.apply_gradients
# ```
#
# As runnable code, both patches: the accumulator is `QuestionMaskPatch`, the question's
# class as posted ([lesson 03 §6](03_cond_and_merge_call.ipynb) shows it), built on the
# `apply_gradients` it replaces. `model.compile` under `mixed_float16` would add the same
# `LossScaleOptimizer` by itself; the user did it by hand.

# %%
def install_question_patch(optimizer, n, trainable_variables, target):
    """Patch `optimizer` (a LossScaleOptimizer) as the question did; returns the accumulator."""
    if target == "loss_scale_optimizer":  # the question's run: the wrapper's method
        patched = optimizer
    elif target == "inner_optimizer":  # the answer's "does NOT work either"
        patched = optimizer.inner_optimizer
    else:
        raise ValueError(f"unknown target {target!r}")
    accumulator = QuestionMaskPatch(n, patched.apply_gradients, trainable_variables)
    patched.apply_gradients = accumulator.apply_gradients
    return accumulator


# %% [markdown]
# The `lsp` functions below (`distgrad.pitfalls.loss_scale_patch`) take it as `install=`:
# they build a tiny model and `LossScaleOptimizer(SGD)` under the strategy scope, call it,
# compile, and run `model.fit` under `mixed_float16` (`mixed.mixed_precision_policy()`
# restores `float32` afterwards).
#
# ## 1 · Keras 3: which methods run, where, on which gradients
#
# `lsp.spy_patched_fit` runs two micro-batches of `model.fit` with n = 2 and records every
# *execution* of the methods between the train step and the variable update. To make
# "which gradient" one number, every replica and micro-batch sees the same 4 examples
# and the learning rate is 0; the last column is the gradient passed divided by one
# replica's unscaled float32 contribution (≈ loss scale: scaled; ≈ 1: unscaled).

# %%
def show_calls(record):
    show_table(["step", "function", "context", "calls", "dtype", "gradient ÷ unscaled"], [
        (step, f"`{function}`", context, calls, dtypes[0] if dtypes else "",
         "" if seen is None else f"{seen:.1f}")
        for step, function, context, calls, dtypes, seen in record.table()])


spied = {target: lsp.spy_patched_fit(strategy, target, install=install_question_patch)
         for target in ("loss_scale_optimizer", "inner_optimizer")}
show_calls(spied["loss_scale_optimizer"])

# %%
wrapper_patch = spied["loss_scale_optimizer"]
for step in (1, 2):
    calls = wrapper_patch.of("QuestionMaskPatch.apply_gradients", step)
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
show_calls(spied["inner_optimizer"])
inner_patch = spied["inner_optimizer"]
assert inner_patch.count("QuestionMaskPatch.apply_gradients") == 0
assert inner_patch.count("SGD.apply_gradients") == 0
source = inspect.getsource(loss_scale_optimizer.LossScaleOptimizer._stateful_handle_finite_grads)
assert "self.inner_optimizer.apply(" in source and "apply_gradients" not in source
display(Code("\n".join(line for line in source.splitlines() if "inner_optimizer" in line),
             language="python"))

# %% [markdown]
# The patch never runs: `LossScaleOptimizer._stateful_handle_finite_grads` calls
# `self.inner_optimizer.apply(...)`, not `apply_gradients`, so the instance attribute the
# user set is never looked up. Training is plain, non-accumulating training.
#
# ## 2 · Keras 3: the overflow that freezes the weights
#
# `lsp.reproduce` runs 6 micro-batches (n = 2, SGD 0.1) in ordinary graph-mode `fit` and
# records, after each, the loss scale, `iterations`, the largest weight change and what
# the patch's accumulators hold. To control overflows we start the scale at `C` and give
# micro-batch 3 one example whose target is `OUTLIER_TARGET`: its *scaled* gradient
# exceeds float16's 65504 while the float32 loss stays finite — an overflow caused by loss
# scaling, as in real training.

# %%
runs = {target: lsp.reproduce(strategy, target, overflow_step=3, install=install_question_patch)
        for target in ("none", "loss_scale_optimizer", "inner_optimizer")}
labels = {"none": "stock wrapper, no patch", "loss_scale_optimizer": "patch on the wrapper",
          "inner_optimizer": "patch on inner_optimizer"}
micro = np.arange(1, 7)
fig, (ax_scale, ax_change, ax_state) = plt.subplots(1, 3, figsize=(12, 3.3))
for (target, run), marker in zip(runs.items(), "os^"):
    ax_scale.plot(micro, np.log2(run.loss_scales), marker=marker, label=labels[target])
    ax_change.plot(micro, np.maximum(run.weight_changes, 1e-6), marker=marker,
                   label=labels[target])
states = runs["loss_scale_optimizer"].accumulator_states
levels = {"finite": 0, "inf": 1, "nan": 2}
ax_state.step(micro, [levels[s] for s in states], where="mid", color="C1", marker="s")
ax_state.set_yticks(list(levels.values()), list(levels))
ax_state.annotate("reset: inf × keep(0) = nan", (4, 2), (1.2, 1.55), fontsize=8,
                  arrowprops={"arrowstyle": "->"})
for ax, title in ((ax_scale, "log2(loss scale)"), (ax_change, "max |Δw| (floor 1e-6)"),
                  (ax_state, "accumulator (patch on the wrapper)")):
    ax.axvline(3, color="red", linestyle=":", linewidth=1)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("micro-batch (overflow at 3)")
ax_change.set_yscale("log")
ax_scale.legend(fontsize=7)
fig.tight_layout()

# %%
stock, wrapped, inner = runs["none"], runs["loss_scale_optimizer"], runs["inner_optimizer"]
assert stock.loss_scales == (C, C) + (C / 2,) * 4 and stock.weight_changes[2] == 0.0
assert stock.iterations == (1, 2, 2, 3, 4, 5)  # only micro-batch 3 skipped
assert min(stock.weight_changes[:2] + stock.weight_changes[3:]) > 0.01
assert wrapped.loss_scales == (C, C, C / 2, C / 4, C / 8, C / 16)  # halved every step
assert wrapped.iterations == (1, 2, 2, 2, 2, 2)  # every step after the overflow skipped
assert wrapped.weight_changes[2:] == (0.0,) * 4 and wrapped.accumulators_finite is False
assert states[:2] == ("finite", "finite") and states[2] != "finite"
assert states[3:] == ("nan",) * 3  # from the first reset on: nan forever
assert inner.patch_calls == 0
check_close(inner.final_weights, stock.final_weights, rtol=0, atol=0)  # plain training
show_table(["", "loss scale ÷ C", "iterations", "accumulator"], [
    (labels[t], ", ".join(f"{s / C:g}" for s in r.loss_scales), ", ".join(map(str, r.iterations)),
     "" if r.accumulator_states is None else ", ".join(r.accumulator_states))
    for t, r in runs.items()])

# %% [markdown]
# The stock wrapper skips micro-batch 3, halves the scale once and trains on. The
# patched wrapper skips *every* step from the overflow on: micro-batch 3's non-finite
# gradient is added into the accumulator, the next reset multiplies it by keep = 0, and
# `inf * 0` is `nan`; from then on the accumulator holds `nan`, every step hands the
# wrapper a non-finite gradient, the scale halves each step, the weights are frozen —
# "assign_add does nothing". With `assign(grad)` the poison is overwritten on the next
# step, which is why the user's `assign` run converged.
#
# Before the first overflow the wrapper patch matches one big-batch step per window (the
# patch sums micro-batch gradients, so the reference uses twice the learning rate):

# %%
clean = lsp.reproduce(strategy, "loss_scale_optimizer", overflow_step=None,
                      install=install_question_patch)
no_accumulation = lsp.reproduce(strategy, "none", overflow_step=None)
print("patch on the wrapper vs big batch:",
      f"{check_close(clean.final_weights, lsp.accumulated_reference(strategy), **MIXED).max_abs:.1e}")
check_not_close(clean.final_weights, no_accumulation.final_weights, **MIXED)
assert clean.iterations == (1, 2, 3, 4, 5, 6)  # but `iterations` counts micro-batches

# %% [markdown]
# No outlier is needed on the user's side. At the default initial scale, on one device,
# this lesson's data overflow by themselves on the first micro-batch:

# %%
one_device = distgrad.make_strategy(1)
natural_stock = lsp.reproduce(one_device, "none", overflow_step=None, initial_scale=S)
natural_patch = lsp.reproduce(one_device, "loss_scale_optimizer", overflow_step=None,
                              initial_scale=S, install=install_question_patch)
show_table(["one device, scale 2**15", "loss scale ÷ S", "iterations"], [
    (name, ", ".join(f"{s / S:g}" for s in r.loss_scales), ", ".join(map(str, r.iterations)))
    for name, r in (("stock wrapper", natural_stock), ("patch on the wrapper", natural_patch))])
assert natural_stock.loss_scales[0] == S / 2 and natural_stock.iterations[-1] >= 3
assert natural_patch.iterations == (0,) * 6 and natural_patch.weight_changes == (0.0,) * 6

# %% [markdown]
# ## 3 · The original: tf-keras, the question's own `train_step`
#
# The user wrote Keras 2 code: a custom `train_step` with `get_scaled_loss` /
# `get_unscaled_gradients` and the era's `OptimizerV2` (`tf.keras.optimizers.legacy.SGD`).
# `distgrad/pitfalls/legacy_loss_scale.py` holds it (the question's `train_step`, reduced
# to a tiny model) and the question's patch for tf-keras; it is imported only in a child
# process where `distgrad.lab.legacy.run_legacy` sets `TF_USE_LEGACY_KERAS=1` before
# TensorFlow is imported:

# %%
legacy_file = pathlib.Path(importlib.util.find_spec("distgrad.pitfalls").submodule_search_locations[0],
                           "legacy_loss_scale.py").read_text()
start = legacy_file.index("    def train_step(self, data):")
display(Code(legacy_file[start:legacy_file.index("\n\n", start)], language="python"))

# %% [markdown]
# `lsp.legacy_reproduction` runs it, the same data and both patches, plus tf-keras'
# newer optimizer (`LossScaleOptimizerV3`):

# %%
legacy = lsp.legacy_reproduction(replicas=R)
print(f"TensorFlow {legacy.tensorflow}, tf-keras {legacy.tf_keras}, {legacy.replicas} "
      f"replicas, {legacy.seconds:.0f} s")
show_table(["tf-keras scenario", "wrapper", "patch calls", "outcome"], [
    (name, record.lso_class, "" if record.patch_calls is None else record.patch_calls,
     f"`{record.error.type}`" if record.error else
     "iterations " + ", ".join(map(str, record.iterations)))
    for name, record in legacy.records.items()])

# %%
assert legacy.tf_keras.startswith("2.") and legacy.replicas == R
assert "optimizers.legacy" in legacy["patch on LSO"].inner_class  # the era's OptimizerV2
assert legacy["patch on LSO"].lso_class == "LossScaleOptimizer"
assert legacy["v3: patch on inner"].lso_class == "LossScaleOptimizerV3"
patched = legacy["patch on LSO"]
assert patched.weight_changes[0::2] == (0.0,) * 3  # k = 2: every second micro-batch updates
assert patched.patch_traces[0] == {"context": "replica", "args": [], "kwargs": []}
frozen = legacy["patch on LSO, overflow at 3"]
assert frozen.loss_scales == wrapped.loss_scales and frozen.accumulators_finite is False
assert frozen.iterations == (1, 2, 3, 4, 5, 6)  # tf-keras counts skipped steps
np.testing.assert_allclose(frozen.weight_changes, wrapped.weight_changes, **MIXED)
check_close(legacy["patch on LSO"].final_weights, legacy["big batch"].final_weights, **MIXED)
for broken in (legacy["patch on inner, overflow at 3"], legacy["patch on inner"]):
    assert broken.error.type == "ValueError"
    assert broken.error.contains("Lengths of branch outputs of cond must match")
    assert broken.error.contains("_apply_gradients_cross_replica")
    assert broken.patch_traces[0]["context"] == "replica"
    assert broken.patch_traces[0]["kwargs"] == ["experimental_aggregate_gradients", "name"]
print("the patched inner apply_gradients was traced in", broken.patch_traces[0]["context"],
      "context,\n  with the keyword arguments", broken.patch_traces[0]["kwargs"])
print(*broken.error.message.strip().splitlines()[-3:], sep="\n")
legacy_source = pathlib.Path(importlib.util.find_spec("tf_keras").submodule_search_locations[0],
                             "src/mixed_precision/loss_scale_optimizer.py").read_text()
assert "smart_cond.smart_cond(" in legacy_source
assert "should_apply_grads, apply_fn, do_not_apply_fn" in legacy_source
assert "experimental_aggregate_gradients=False" in legacy_source

# %% [markdown]
# * **Patch on the wrapper** behaves as in Keras 3 (the same weight changes within the
#   mixed tolerance): correct accumulation of *unscaled* gradients (the question's train
#   step unscales first) until the overflow, frozen after it. tf-keras counts the skipped
#   steps in `iterations`.
# * **Patch on `inner_optimizer`** is reached in tf-keras — `LossScaleOptimizer._apply_gradients`
#   calls `self._optimizer.apply_gradients(..., experimental_aggregate_gradients=False)`
#   from `call_for_each_replica` — but inside the wrapper's
#   `smart_cond(should_apply_grads, apply_fn, do_not_apply_fn)`. The question's patch
#   returns `None`; `do_not_apply_fn` returns the `iterations` increment: the branches'
#   outputs differ and tracing fails with the `ValueError` above.
#
# Returning the original's result is enough to make it trace:

# %%
returning = legacy["patch on inner, returning the result"]
assert returning.error is None and returning.weights_finite and returning.accumulators_finite
scale = returning.loss_scales[0]
assert returning.loss_scales == (scale,) * 2 + (scale / 2,) * 4  # halved once, at the overflow
assert returning.patch_calls == 5  # the overflowing micro-batch 3 never reached it
assert returning.iterations == (1, 2, 3, 4, 5, 6)  # an inner-optimizer step per micro-batch
assert [c > 0 for c in returning.weight_changes] == [False, True, False, False, True, False]
# tf-keras' newer optimizer behaves alike: the same weight moves; without overflow, big batch
assert legacy["v3: patch on inner, overflow at 3"].weight_changes == returning.weight_changes
check_close(legacy["v3: patch on inner"].final_weights, legacy["big batch"].final_weights, **MIXED)
show_table(["patch on inner, returning the result", "value"], [
    ("patch calls", returning.patch_calls),
    ("iterations", ", ".join(map(str, returning.iterations))),
    ("weights moved at micro-batch", ", ".join(
        str(t + 1) for t, c in enumerate(returning.weight_changes) if c > 0))])

# %% [markdown]
# That gets one thing right: the accumulator sits *inside* the wrapper, so the wrapper
# skips the overflowing micro-batch before it reaches the accumulator (5 calls for 6
# micro-batches) and nothing is poisoned. But it is still the mask trick of
# [lesson 03 §6](03_cond_and_merge_call.ipynb): every call runs the inner optimizer's
# `apply_gradients`, mostly with zeros, so `iterations` counts micro-batches, and a
# momentum or Adam optimizer would drift; it only looks right here because SGD ignores a
# zero gradient. The right composition is the same order with real accumulation (§5).

# %% [markdown]
# ## 4 · A hole in Keras 3's wrapper: `finite` from the first replica
#
# `LossScaleOptimizer._tf_apply` (installed source):

# %%
tf_apply = inspect.getsource(loss_scale_optimizer.LossScaleOptimizer._tf_apply)
excerpt = tf_apply[tf_apply.index("finite_per_replica ="):tf_apply.index("def apply_fn")]
display(Code(excerpt.rstrip(), language="python"))
assert "experimental_local_results(" in excerpt and ")[0]" in excerpt
assert "grads_and_vars = self._optimizer.aggregate_gradients(grads_and_vars)" in legacy_source

# %% [markdown]
# The comment is inherited from tf-keras, whose `apply_gradients` all-reduces the
# gradients *before* the check ("so that any NaN or Inf gradients are propagated to each
# replica"). Keras 3's train step passes each replica's *partial* gradients; the SUM
# happens later, inside the inner optimizer. Plain `model.fit`, SGD, `mixed_float16`, the
# default scale, an overflow in one replica's shard of micro-batch 2:

# %%
rows, stock_runs = [], {}
for replicas_hit in [(1,), (0,), tuple(range(R))]:
    run = stock_runs[replicas_hit] = first_replica.reproduce(strategy, overflow_replicas=replicas_hit)
    flags = first_replica.finite_flags(strategy, overflow_replicas=replicas_hit)
    rows.append((replicas_hit, flags.finite_by_replica, ", ".join(f"{s / S:g}" for s in run.loss_scales),
                 run.weights_finite))
    assert run.weights_finite == (0 in replicas_hit)  # only replica 0's flag counts
show_table(["overflow on replicas", "`check_finite` per replica", "loss scale ÷ S",
            "weights finite"], rows)
applied = stock_runs[(1,)]  # the wrapper saw nothing wrong and applied micro-batch 2
assert applied.loss_scales[1] == S and applied.iterations[:2] == (1, 2)
assert applied.weight_changes[1] == float("inf")
for replicas_hit in [(0,), tuple(range(R))]:  # skipped: iterations wait, the scale halves once
    run = stock_runs[replicas_hit]
    assert run.loss_scales == (S, S / 2, S / 2, S / 2) and run.iterations == (1, 1, 2, 3)
    assert run.weight_changes[1] == 0.0
stock_legacy = legacy["stock, overflow on replica 1 only"]  # tf-keras got it right:
assert stock_legacy.weights_finite and stock_legacy.weight_changes[2] == 0.0
assert stock_legacy.loss_scales == returning.loss_scales  # skipped, the scale halved once

# %% [markdown]
# An overflow on replica 1 only is applied: the inner optimizer's all-reduce sums `inf`
# into every copy of the weights. The fix,
# `distgrad.mixed_precision.AllReplicasFiniteLossScaleOptimizer`, is the stock wrapper
# with `finite = reduce_all(stack(experimental_local_results(...)))`: all replicas'
# flags, read in cross-replica context (no extra collective).

# %%
for replicas_hit in [(1,), (0,), tuple(range(R))]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = first_replica.reproduce(strategy, overflow_replicas=replicas_hit, fixed=True)
    print(f"fixed wrapper, overflow on {replicas_hit}: loss scale ÷ S",
          [s / S for s in run.loss_scales])
    told = [str(w.message) for w in caught if "skipped in this fit" in str(w.message)]
    assert len(told) == 1 and told[0].startswith(  # and it says so, once
        "AllReplicasFiniteLossScaleOptimizer: 1 step(s) skipped in this fit")
    assert run.weights_finite and run.loss_scales == (S, S / 2, S / 2, S / 2)
    assert run.iterations == (1, 1, 2, 3)  # skipped, exactly as the stock one skips replica 0's
    check_close(run.final_weights, stock_runs[(0,)].final_weights, rtol=0, atol=0)

# %% [markdown]
# ## 5 · The fix: accumulate *inside* an all-replicas-finite wrapper
#
# `distgrad.optimizer.AccumulatingOptimizer` ([lesson 03 §5](03_cond_and_merge_call.ipynb))
# under `mixed_float16`. Handed to `model.compile` alone, Keras would wrap it in its own
# `LossScaleOptimizer` — the wrapper of §4, blind to replica 1. `AccumulatingOptimizer`
# refuses that wrapper at the first step, on every replica count, and names the fix:

# %%
mb = 4 * R
x, y = mixed.overflow_data(8, mb, None, R)
try:
    mixed.mixed_precision_fit(strategy, x, y, mb, 2, initial_scale=None)  # compile wraps it
    raise AssertionError("Keras' own wrapper was accepted")
except ValueError as err:
    refusal = str(err)
refusal = re.sub(r"\x1b\[[0-9;]*m", "", refusal)  # Keras' traceback adds terminal bold
print("ValueError:", textwrap.fill(refusal[refusal.index("AccumulatingOptimizer is inside"):],
                                   88, subsequent_indent="  "))
assert "from replica 0 only" in refusal
assert "AllReplicasFiniteLossScaleOptimizer(distgrad.AccumulatingOptimizer(" in refusal

# %% [markdown]
# The fix is the line the error names:
# `model.compile(optimizer=AllReplicasFiniteLossScaleOptimizer(AccumulatingOptimizer(SGD, 2)))`.
# Keras adds no wrapper of its own around one that already is a `LossScaleOptimizer`.
# That order is what makes it right:
#
# * **unscale, then accumulate**: the wrapper divides each micro-batch by the scale *it*
#   was computed with before our `apply` adds it — the scale may change inside a cycle;
# * **float32 accumulators** (asserted below);
# * **a micro-batch that overflowed on any replica is skipped before accumulation**: not
#   added, not counted in `total_micro_steps`, loss scale halved, `iterations`
#   unchanged; the cycle waits for k good micro-batches;
# * **real accumulation**: the inner optimizer steps once per cycle, so `iterations`
#   counts updates.

# %%
fixed_default = mixed.mixed_precision_fit(strategy, x, y, mb, 2)  # the wrapper given to compile
print(f"{fixed_default.wrapper}({fixed_default.wrapped})")
print("accumulators:", ", ".join(fixed_default.accumulator_dtypes))
assert fixed_default.wrapper == "AllReplicasFiniteLossScaleOptimizer"
assert fixed_default.wrapped == "AccumulatingOptimizer"
assert fixed_default.accumulator_dtypes == ("float32",) * 4 and all(fixed_default.weights_finite)
rows = []
for name, make in OPTIMIZERS.items():  # SGD(0.1), with momentum, Adam(0.01), AdamW
    accumulated = mixed.mixed_precision_fit(strategy, x, y, mb, 2, make)
    big_batch = mixed.mixed_precision_fit(strategy, x, y, 2 * mb, None, make)
    diff = check_close(accumulated.final_weights, big_batch.final_weights, **MIXED)
    rows.append((name, f"{diff.max_abs:.1e}", ", ".join(map(str, accumulated.iterations))))
    check_not_close(accumulated.final_weights, accumulated.initial_weights, **MIXED)  # it trained
    assert accumulated.iterations == (0, 1, 1, 2, 2, 3, 3, 4)  # updates, not micro-batches
    assert accumulated.total_micro_steps == tuple(range(1, 9))
    assert accumulated.accumulator_dtypes == ("float32",) * 4
show_table(["8 micro-batches, k = 2", "vs 4 big-batch steps", "iterations"], rows)

# %%
x6, y6 = mixed.overflow_data(6, mb, None, R)
growing = lambda inner, **kw: keras.mixed_precision.LossScaleOptimizer(
    inner, **{**kw, "dynamic_growth_steps": 1})  # the scale doubles after every micro-batch
fixed = mixed.mixed_precision_fit(strategy, x6, y6, mb, 2, lambda: keras.optimizers.SGD(0.2),
                                  initial_scale=16, dynamic_growth_steps=1)
patched = lsp.reproduce(strategy, "loss_scale_optimizer", overflow_step=None, initial_scale=16,
                        wrapper=growing, install=install_question_patch)
reference = lsp.accumulated_reference(strategy, initial_scale=16)
print("loss scales", fixed.loss_scales)
print("AccumulatingOptimizer vs big batch:",
      f"{check_close(fixed.final_weights, reference, **MIXED).max_abs:.1e}")
print("the question's patch on the wrapper vs big batch:",
      f"{check_not_close(patched.final_weights, reference, **MIXED).max_abs:.1e}")

# %% [markdown]
# With a scale that changes inside every cycle, the question's wrapper patch (scaled sum ÷
# latest scale) is wrong even without an overflow; unscaling per micro-batch is not.
#
# ### Non-finite micro-batches: what the wrapper skips, and what it tells you
#
# Sixteen micro-batches, k = 2, the scale starting low and doubling after every 4 good
# micro-batches, and two outliers: at micro-batch 8 on **every** replica, at micro-batch
# 12 on **replica 1 only** — the one Keras' own wrapper would not see (§4).

# %%
def skipped(record):
    """Micro-batches the wrapper skipped: `total_micro_steps` did not move."""
    previous = (0,) + record.total_micro_steps[:-1]
    return [t + 1 for t, (a, b) in enumerate(zip(previous, record.total_micro_steps)) if a == b]


ALL_REPLICAS_OUTLIER, ONE_REPLICA_OUTLIER, START = 8, 12, 2.0**8
x16, y16 = mixed.overflow_data(16, mb, ALL_REPLICAS_OUTLIER, R)
_, y_one = mixed.overflow_data(16, mb, ONE_REPLICA_OUTLIER, R, overflow_replicas=(1,))
y16 = np.maximum(y16, y_one)  # both outliers (OUTLIER_TARGET is the largest target)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    safe = mixed.mixed_precision_fit(strategy, x16, y16, mb, 2, initial_scale=START,
                                     dynamic_growth_steps=4)
fig, (ax_scale, ax_updates) = plt.subplots(1, 2, figsize=(11, 3.6))
steps = np.arange(1, 17)
ax_scale.step(steps, np.log2(safe.loss_scales), where="post", color="C1")
ax_updates.step(steps, safe.iterations, where="post", color="C1", label="updates")
ax_updates.step(steps, safe.total_micro_steps, where="post", color="C1", linestyle="--",
                label="micro-batches accumulated")
for ax in (ax_scale, ax_updates):
    ax.axvline(ALL_REPLICAS_OUTLIER, color="gray", linestyle=":", label="outlier, all replicas")
    ax.axvline(ONE_REPLICA_OUTLIER, color="red", linestyle=":", label="outlier, replica 1")
    ax.set_xlabel("micro-batch")
ax_scale.set_ylabel("log2(loss scale)")
ax_updates.set_ylabel("count")
ax_scale.legend(fontsize=8)
ax_updates.legend(fontsize=8)
fig.tight_layout()
show_table(["skipped micro-batches", "dropped cycles", "updates", "total_micro_steps"], [
    (skipped(safe), safe.skipped_updates, ", ".join(map(str, safe.iterations)),
     ", ".join(map(str, safe.total_micro_steps)))])
skip_warnings = [str(w.message) for w in caught if "skipped in this fit" in str(w.message)]
print("UserWarning:", textwrap.fill(skip_warnings[0], 88, subsequent_indent="  "))

# %%
assert all(safe.weights_finite)
scales = (START,) + safe.loss_scales
halved = [t + 1 for t in range(16) if scales[t + 1] == scales[t] / 2]
assert halved == skipped(safe) == [ALL_REPLICAS_OUTLIER, ONE_REPLICA_OUTLIER]
assert safe.iterations[-1] == safe.total_micro_steps[-1] // 2  # every cycle applied
assert safe.skipped_updates == 0  # no cycle dropped
assert len(skip_warnings) == 1 and "2 micro-batch(es) skipped in this fit" in skip_warnings[0]

# %% [markdown]
# Read the plot: every halving of the scale is a skipped micro-batch (`total_micro_steps`
# does not move) and a pause in the updates, and both outliers are skipped — replica 1's
# too. No cycle is lost: the cycle waits for two good micro-batches. Nothing is silent
# either: `fit` ends with one warning that says how many micro-batches were skipped.

# %% [markdown]
# ## 6 · The fix on the question's stack: tf-keras, `mixed_float16`, `model.fit`
#
# The question's answer installed the patch *after* the wrapper (`optimizer =
# LossScaleOptimizer(optimizer)`, then `get_patched_optimizer(optimizer, ...)`). On tf-keras
# the fix is section 5's: reverse the order and replace the patch by an optimizer,
# `distgrad.tf_keras.AccumulatingOptimizer`, so that the loss-scale wrapper is outside.
# In tf-keras that order is forced twice over, as the installed source and the question's
# `train_step` (section 3) show: `model.compile` under `mixed_float16` wraps any optimizer
# that is not a `LossScaleOptimizer` in one, and the question's `train_step` scales its
# loss only if `model.optimizer` *is* one — an accumulator outside it would silently
# train float16 gradients without loss scaling.

# %%
training_source = pathlib.Path(importlib.util.find_spec("tf_keras").submodule_search_locations[0],
                               "src", "engine", "training.py").read_text()
get_optimizer = training_source[training_source.index("    def _get_optimizer(self"):]
get_optimizer = get_optimizer[:get_optimizer.index("        return tf.nest.map_structure")]
display(Code(get_optimizer.rstrip(), language="python"))
assert "opt = lso.BaseLossScaleOptimizer(opt)" in get_optimizer
assert "is_mixed_precision = isinstance(" in legacy_file  # the question's train_step
assert "loss = self.optimizer.get_scaled_loss(model_loss)" in legacy_file

# %% [markdown]
# One tf-keras detail: its `LossScaleOptimizer.apply_gradients` all-reduces the gradients
# *before* it checks them, through the wrapped optimizer's `aggregate_gradients`
# (section 4 asserted that line). `distgrad.tf_keras.AccumulatingOptimizer` answers that
# call by keeping the gradients replica-local (the gradient all-reduce comes once per
# update; `tests/test_tf_keras_mixed_precision.py` counts the all-reduces) and sharing one
# number instead: whether every replica's gradients are finite. If any is
# not, every replica hands the wrapper a NaN, so the wrapper skips that micro-batch on
# every replica and halves the scale once. The program below is the question's set-up in
# the fixed order, with the question's `train_step`. It is written to a file and run in a
# child process (`run_legacy` sets `TF_USE_LEGACY_KERAS=1` before TensorFlow starts);
# `distgrad.lab.legacy_fit` supplies the `fit` recipes and reads the counters after every
# micro-batch.

# %%
import tempfile

from distgrad.lab.legacy import run_legacy

program_folder = tempfile.mkdtemp(prefix="lesson04-tf-keras-")

# %%
# %%writefile {program_folder}/question_fix.py
import tensorflow as tf  # tf-keras here: run_legacy set TF_USE_LEGACY_KERAS=1 before

from distgrad.lab.legacy import legacy_strategy
from distgrad.lab.legacy_fit import big_batch_fit, fit, policy, weights
from distgrad.pitfalls.legacy_loss_scale import QuestionModel  # the question's train_step
from distgrad.tf_keras import AccumulatingOptimizer


def build_optimizer(grad_acc_n, initial_scale):
    """The question's set-up, in the fixed order: accumulate first, then scale the loss."""
    optimizer = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    if grad_acc_n > 1:
        optimizer = AccumulatingOptimizer(optimizer, grad_acc_n)
    if tf.keras.mixed_precision.global_policy().name.startswith("mixed"):
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(
            optimizer, initial_scale=initial_scale)
    return optimizer


def main(replicas, data, micro_batch, grad_acc_n, initial_scale):
    """`data`: {name: [x, y, reference_x, reference_y]}: fit (x, y) with accumulation on
    `replicas` replicas, and the reference data as one big batch on one device."""
    strategy = legacy_strategy(replicas)  # first: the logical devices
    results = {}
    with policy("mixed_float16"):
        for name, (x, y, reference_x, reference_y) in data.items():
            model, counters = fit(strategy, QuestionModel,
                                  lambda: build_optimizer(grad_acc_n, initial_scale), x, y,
                                  batch_size=micro_batch)
            big_batch, _ = big_batch_fit(QuestionModel, lambda: build_optimizer(1, initial_scale),
                                         reference_x, reference_y,
                                         batch_size=grad_acc_n * micro_batch)
            results[name] = {"accumulated": weights(model), "big_batch": weights(big_batch),
                             "counters": counters, "wrapping": [
                                 type(model.optimizer).__name__,
                                 type(model.optimizer.inner_optimizer).__name__]}
    return results

# %% [markdown]
# Two data sets: clean (6 micro-batches), and 7 micro-batches with an outlier in
# **replica 1's** shard of micro-batch 3; its reference is the big batch of the 6 others.

# %%
OUTLIER_STEP = 3
clean_x, clean_y = mixed.overflow_data(6, mb, None, R)
bad_x, bad_y = mixed.overflow_data(7, mb, OUTLIER_STEP, R, overflow_replicas=(1,))
others = np.r_[0:(OUTLIER_STEP - 1) * mb, OUTLIER_STEP * mb:7 * mb]
question_fix = run_legacy("question_fix:main", R, env={"PYTHONPATH": program_folder},
                          data={"clean": [a.tolist() for a in (clean_x, clean_y) * 2],
                                "outlier on replica 1": [a.tolist() for a in (
                                    bad_x, bad_y, bad_x[others], bad_y[others])]},
                          micro_batch=mb, grad_acc_n=2, initial_scale=C)
print(f"TensorFlow {question_fix.tensorflow}, tf-keras {question_fix.tf_keras}, "
      f"{question_fix.replicas} replicas")
clean, outlier = question_fix["clean"], question_fix["outlier on replica 1"]
print("model.optimizer is {}({}(SGD))".format(*clean["wrapping"]))
for name, run in question_fix.value.items():
    diff = check_close(run["accumulated"], run["big_batch"], **MIXED)
    print(f"{name}: accumulated vs big batch, max abs diff {diff.max_abs:.1e}")
show_table(["micro-batch", "loss scale ÷ C", "total_micro_steps", "SGD updates",
            "`iterations`"], [
    (t + 1, f"{row['loss_scale'] / C:g}", row["total_micro_steps"], row["updates"],
     row["iterations"]) for t, row in enumerate(outlier["counters"])])

# %%
assert question_fix.replicas == R and question_fix.tf_keras.startswith("2.")
assert clean["wrapping"] == ["LossScaleOptimizerV3", "AccumulatingOptimizer"]
assert [row["loss_scale"] for row in clean["counters"]] == [C] * 6
assert [row["updates"] for row in clean["counters"]] == [0, 1, 1, 2, 2, 3]
outlier_rows = outlier["counters"]
assert [row["loss_scale"] for row in outlier_rows] == [C, C] + [C / 2] * 5  # halved once
assert [row["total_micro_steps"] for row in outlier_rows] == [1, 2, 2, 3, 4, 5, 6]  # 3 skipped
assert [row["updates"] for row in outlier_rows] == [0, 1, 1, 1, 2, 2, 3]
assert [row["iterations"] for row in outlier_rows] == [0, 1, 2, 2, 3, 3, 4]
assert all(row["weights_finite"] and row["skipped_updates"] == 0 for row in outlier_rows)
assert "self._optimizer.iterations.assign_add(1, read_value=False)" in legacy_source

# %% [markdown]
# Equal to the big batch within the mixed-precision tolerance, on the versions printed
# above — also after the outlier: its micro-batch was skipped on **both** replicas
# (`total_micro_steps` stands still at micro-batch 3) and the scale halved once. Unlike
# Keras 3's wrapper (section 4), tf-keras' checks finiteness after an all-reduce — here of
# the one flag — so the outlier on replica 1 is seen everywhere. Three counters, three
# meanings: `total_micro_steps` counts the micro-batches accumulated, the inner SGD's
# `iterations` its updates (what momentum, Adam and schedules see), and
# `model.optimizer.iterations` adds the skipped step, as tf-keras' wrapper counts one
# (its `do_not_apply_fn`, asserted above). `tests/test_tf_keras_mixed_precision.py` pins
# the same with Adam, `OptimizerV2`, the stock `train_step` and a checkpoint taken
# mid-cycle.

# %% [markdown]
# ## Takeaways
#
# * Patching `apply_gradients` on a `LossScaleOptimizer` accumulates **scaled** gradients
#   (Keras 3) or unscaled ones (the question's tf-keras train step) — and dies at the first
#   overflow: the non-finite micro-batch enters the accumulator, `inf * 0` is `nan`, every
#   later step is skipped. Dynamic loss scaling *expects* overflows, so sooner or later it
#   happens (here, on one device: on the very first micro-batch).
# * Patching `inner_optimizer.apply_gradients` is dead code in Keras 3 (the wrapper calls
#   `inner.apply`), and a `tf.cond` output mismatch in tf-keras (the patch returns `None`).
#   Returning the result makes it trace and keeps overflows out of the accumulator, but it
#   is still the mask trick: an inner-optimizer step on every micro-batch.
# * Compose the other way round, with real accumulation:
#   `AllReplicasFiniteLossScaleOptimizer(AccumulatingOptimizer(inner, k))`, passed to
#   `model.compile` yourself. Unscale per micro-batch, accumulate in float32, skip a
#   micro-batch that overflowed on any replica before accumulation, one update per cycle.
# * Keras 3's `LossScaleOptimizer` checks finiteness on **replica 0 only**; the comment
#   assumes all-reduced gradients that Keras 3 no longer has. `AccumulatingOptimizer`
#   refuses it (the one `compile` adds by itself) at the first step, naming the fix.
# * On the question's own stack (tf-keras, `mixed_float16`, `model.fit`, its `train_step`):
#   `LossScaleOptimizer(distgrad.tf_keras.AccumulatingOptimizer(inner, n))` — the order
#   `model.compile` builds by itself. An overflow on one replica skips that micro-batch on
#   every replica and halves the scale once; the result equals big-batch training.
#
# ## Exercises
#
# 1. Move the outlier of §2 to micro-batch 4, an apply step. Predict the accumulator's
#    states, then check: `lsp.reproduce(strategy, "loss_scale_optimizer", overflow_step=4,
#    install=install_question_patch).accumulator_states`.
# 2. Start the §2 wrapper patch at a scale high enough to overflow at once and predict
#    `iterations`: `lsp.reproduce(strategy, "loss_scale_optimizer", overflow_step=None,
#    initial_scale=2.0**20, install=install_question_patch).iterations`.
# 3. In the trajectory cell put the second outlier on replica 0 instead
#    (`overflow_replicas=(0,)` in `y_one`). Predict `skipped(safe)` and the warning, then
#    rerun that cell and the next: does any assertion fail?
# 4. In §6, move the outlier to replica 0 (`overflow_replicas=(0,)` in `bad_x, bad_y`)
#    and predict the table; then rerun that cell and the next. Does any assertion fail?
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
