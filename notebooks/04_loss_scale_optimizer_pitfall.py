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
# **The question** ([Q3](../questions.md#q3), second half; TF 2.5, 2021,
# tensorflow/tensorflow#50454). Under `mixed_float16` the user accumulated gradients by
# monkey-patching `apply_gradients` of the `LossScaleOptimizer`; training behaved as if
# `assign_add` did nothing. Patching its `inner_optimizer` instead "does not work either".
#
# **Short answer.** Don't patch: pass
# `distgrad.AllReplicasFiniteLossScaleOptimizer(distgrad.AccumulatingOptimizer(inner, k))`
# to `model.compile`. A *loss-scale optimizer* multiplies the loss by a scale so that
# float16 gradients do not underflow, divides the gradients by it, and skips a step whose
# gradients overflowed, halving the scale. Outside the accumulator, it unscales and checks
# each micro-batch before it is accumulated in float32. It must be distgrad's: under
# `MirroredStrategy` (one *replica*, a copy of the model, per device) Keras 3's own
# wrapper decides "finite" from the first replica only, and an `AccumulatingOptimizer`
# inside it (`compile` adds it under `mixed_float16`) is refused there with an error naming
# this fix (on one replica Keras' wrapper is right, and used). The question's patch dies at the first overflow: the reset `inf * 0` is `nan`, and
# every later step is skipped.
#
# **Why "only on GPU".** The asker's own answer ties the trouble to `mixed_float16`, the
# policy of their GPU runs, and their code wraps the optimizer in a `LossScaleOptimizer`
# only under a `mixed` policy ([run](#deep-dive-the-questions-two-patches-in-keras-3)).
# Their float32 runs had no wrapper: the patch sat on the plain optimizer. The freeze
# belongs to the policy, not the device: this lesson reproduces it on CPU replicas
# ([the overflow](#the-overflow-that-freezes-the-weights)).

# %%
import tensorflow as tf

import distgrad_course
from distgrad_course.lab.display import show_code, show_environment, show_table

strategy = distgrad_course.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
assert R >= 2, "this lesson needs several replicas: set DISTGRAD_REPLICAS >= 2"
tf.get_logger().setLevel("ERROR")  # no INFO lines; the cells below retrace on purpose
show_environment(distgrad_course.environment_report(strategy))

# %% [markdown]
# ## 1 · The fix
#
# `model.fit` over `tf.data` under `mixed_float16`, the composition given to `compile`.

# %% tags=["fix"]
import keras
import numpy as np
import tensorflow as tf

import distgrad  # the fix: AllReplicasFiniteLossScaleOptimizer(AccumulatingOptimizer(...))

# Two or more replicas: your GPUs, or two logical CPUs on a machine without GPUs.
cpu = tf.config.list_physical_devices("CPU")[0]
if not (tf.config.list_physical_devices("GPU") or tf.config.get_logical_device_configuration(cpu)):
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.experimental.enable_tensor_float_32_execution(False)  # exact float32 for the check
devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
strategy = tf.distribute.MirroredStrategy(devices)

keras.mixed_precision.set_global_policy("mixed_float16")  # float16 math, float32 weights
accumulation_steps, micro_batch = 2, 8 * strategy.num_replicas_in_sync  # 8 examples a replica
rng = np.random.default_rng(0)
x = rng.normal(size=(9 * micro_batch, 4)).astype("float32")  # 9 micro-batches: 4 cycles + 1
y = x @ rng.normal(size=(4, 1)).astype("float32")
examples = tf.data.Dataset.from_tensor_slices((x, y))
with strategy.scope():
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(1),
        keras.layers.Activation("linear", dtype="float32"),  # float32 output: float32 loss
    ])
    initial_weights = model.get_weights()  # for the check
    # The loss-scale wrapper OUTSIDE the accumulator: it unscales each micro-batch, and skips
    # one that overflowed on ANY replica before it reaches the float32 accumulators.
    optimizer = distgrad.AllReplicasFiniteLossScaleOptimizer(
        distgrad.AccumulatingOptimizer(keras.optimizers.SGD(0.1), accumulation_steps),
        initial_scale=2.0**10)  # as the check's reference (Keras' default: 2**15)
    model.compile(optimizer=optimizer, loss="mse")  # a LossScaleOptimizer already: kept as is
# The epoch ends with a cycle open (micro-batch 9): "flush" applies it now, as the mean of
# its micro-batches; the default, "carry", would complete it with the next epoch's first.
history = model.fit(examples.batch(micro_batch), epochs=1, shuffle=False, verbose=0,
                    callbacks=[distgrad.AccumulationCallback("flush")])

# %% tags=["check"]
# One device, no strategy: one big-batch step per cycle, same policy and loss scale.
reference = keras.models.clone_model(model)  # the same layers, mixed_float16 too
reference.set_weights(initial_weights)
reference.compile(optimizer=keras.mixed_precision.LossScaleOptimizer(
    keras.optimizers.SGD(0.1), initial_scale=2.0**10), loss="mse")
reference.fit(examples.batch(accumulation_steps * micro_batch), shuffle=False, verbose=0)
assert (optimizer.iterations.numpy(), optimizer.skipped_steps.numpy()) == (5, 0)  # 4 cycles + 1
n = 29 + accumulation_steps * micro_batch  # float16 roundings in a row (see below)
bound = 2 * n * 2**-11 / (1 - n * 2**-11)  # how far two float16 orders can drift apart
for ours, big_batch, start in zip(model.get_weights(), reference.get_weights(), initial_weights):
    assert np.abs(ours - big_batch).max() <= bound * np.abs(big_batch - start).max()

# %% [markdown]
# Equal up to float16's rounding, by a bound derived from it, not by a tolerance that
# happened to pass on one machine. float16 keeps 11 significant bits, so each rounding is
# off by at most $u = 2^{-11}$ of its value. A result that went through $n$ roundings in a
# row is off by at most $\gamma_n = nu/(1-nu)$ of the magnitudes involved (Higham,
# *Accuracy and Stability of Numerical Algorithms*, Lemma 3.1), and two runs that round in
# different orders (another sum order, oneDNN's AVX512-FP16 kernels, tensor cores, XLA)
# differ by at most $2\gamma_n$ of each weight's largest update. For this model $n = 29 +$
# the big batch: the dot products of 4 and 16 terms with their bias and activation (24),
# the loss gradient (2), back through the output layer and tanh (3), and the big batch's
# sum over its `accumulation_steps * micro_batch` examples, 32 on two replicas, where
# $n = 61$ and the bound is 6.1 %. float32 lessons check at 1e-6.

# %% [markdown]
# ## 2 · Why it works
#
# ### Keras' own wrapper: right on one replica, refused on several
#
# Given the `AccumulatingOptimizer` alone under `mixed_float16`, `compile` wraps it in
# Keras' own `LossScaleOptimizer` (`mixed_precision_fit(..., initial_scale=None)` does
# that). On one replica that wrapper checks the only replica there is, and it is used.
# It calls the `AccumulatingOptimizer` for finite micro-batches only, so the skips are read
# off its loss scale, which halves at each one: counted in `skipped_micro_batches`, and
# warned of at the end of `fit`. At Keras' default scale, 2**15, this lesson's data
# overflow by themselves at first. On R replicas `fit` fails before its first step, with
# the fix first:

# %%
import inspect
import textwrap
import warnings

import matplotlib.pyplot as plt
from IPython.display import Code, display
from keras.src.optimizers import loss_scale_optimizer

from distgrad_course.lab import mixed  # the lesson's data and model.fit runs (not for your code)
from distgrad_course.pitfalls import lso_first_replica_finite as first_replica

keras.mixed_precision.set_global_policy("float32")  # the fix cell's; the runs below set theirs
mb = 4 * R  # the global micro-batch of the runs below (`strategy`: the fix cell's)
x8, y8 = mixed.overflow_data(8, mb, None, R)
one_device = distgrad_course.make_strategy(1)
with warnings.catch_warnings(record=True) as told:
    warnings.simplefilter("always")
    alone = mixed.mixed_precision_fit(one_device, x8, y8, mb, 2, initial_scale=None)
print(f"one replica: {alone.wrapper}({alone.wrapped}), "
      f"{alone.skipped_micro_batches} micro-batch(es) skipped and counted")
assert alone.wrapper == "LossScaleOptimizer" and alone.skipped_micro_batches >= 1
assert alone.total_micro_steps[-1] == 8 - alone.skipped_micro_batches  # the others summed
assert [w for w in told if "micro-batch(es) skipped in this fit" in str(w.message)]
try:
    mixed.mixed_precision_fit(strategy, x8, y8, mb, 2, initial_scale=None)  # compile wraps it
    raise AssertionError("Keras' own wrapper was accepted")
except ValueError as err:
    refusal = str(err)  # raised in `build`, before any step: no Keras message around it
assert refusal == distgrad.optimizer.STOCK_WRAPPER_MESSAGE.format(replicas=R)
assert refusal.startswith(f"Under mixed_float16 on {R} replicas, hand model.compile the "
                          "loss-scale wrapper yourself: model.compile(optimizer=distgrad.")
assert "checks replica 0's gradients only" in refusal
parts = refusal.replace("optimizer=distgrad.", "optimizer=\ndistgrad.").split("\n")
print("ValueError:", *(textwrap.fill(part, 92, initial_indent="  ", subsequent_indent="  ")
                       for part in parts), sep="\n")

# %% [markdown]
# ### Keras' wrapper reads replica 0's flag
#
# Each replica's gradients are summed over replicas (*all-reduced*) later, in the inner
# optimizer. `LossScaleOptimizer._tf_apply` asks every replica whether its gradients are
# finite, and keeps replica 0's answer:

# %%
tf_apply = inspect.getsource(loss_scale_optimizer.LossScaleOptimizer._tf_apply)
excerpt = tf_apply[tf_apply.index("finite_per_replica ="):tf_apply.index("def apply_fn")]
display(Code(excerpt.rstrip(), language="python"))
assert "experimental_local_results(" in excerpt and ")[0]" in excerpt

# %% [markdown]
# The comment held in tf-keras, which all-reduced first (tf-keras deep dive). The
# experiment (source below): `model.fit`, `SGD`, the wrapper `compile` adds (scale
# S = 2**15), a target 1e4 in the listed replicas' shards of micro-batch 2.

# %%
S = mixed.DEFAULT_INITIAL_SCALE
rows, runs, warned = [], {}, {}
for hit in [(1,), (0,), tuple(range(R))]:  # the replicas whose shard overflows
    flags = first_replica.finite_flags(strategy, overflow_replicas=hit).finite_by_replica
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock = first_replica.reproduce(strategy, overflow_replicas=hit)
        fixed = first_replica.reproduce(strategy, overflow_replicas=hit, fixed=True)
    runs[hit] = stock, fixed
    warned[hit] = [str(w.message) for w in caught if "skipped in this fit" in str(w.message)]
    assert stock.weights_finite == (0 in hit)  # Keras' wrapper: only replica 0's flag counts
    assert fixed.weights_finite and fixed.loss_scales == (S, S / 2, S / 2, S / 2)  # distgrad's
    rows.append((hit, flags, *(f"{', '.join(f'{s / S:g}' for s in run.loss_scales)}; "
                               f"{run.weights_finite}" for run in (stock, fixed))))
show_table(["overflow on", "`check_finite` per replica", "Keras: scale ÷ S; finite weights",
            "distgrad: scale ÷ S; finite weights"], rows)
display(show_code(first_replica.reproduce))

# %% [markdown]
# On replica 1's overflow Keras' wrapper applies the step: the all-reduce sums `inf` into
# every copy of the weights. distgrad's wrapper ANDs all replicas' flags, read in
# *cross-replica context* (inside `merge_call`, where one function sees every replica's
# values; the per-replica step runs in *replica context*), and skips in every row.

# %% [markdown]
# ### Deep dive · The same runs, step by step

# %%
from distgrad import non_finite
from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
from distgrad_course.lab.compare import OPTIMIZERS, check_close, check_not_close

ours = inspect.getsource(AllReplicasFiniteLossScaleOptimizer._tf_apply)
start, end = ours.index("        def _handle_cross_replica"), ours.index("            def apply_fn")
display(Code(textwrap.dedent(ours[start:end]).rstrip(), language="python"))
assert "finite = finite_everywhere(distribution, finite_per_replica)" in ours
assert ")[0]" not in ours  # no replica is taken for all
# On one worker, every replica's flag ANDed; on several workers, one more small all-reduce
# (MultiWorkerMirroredStrategy: a worker sees only its own replicas' flags).
everywhere = inspect.getsource(non_finite.finite_everywhere)
assert "return tf.reduce_all(tf.stack(local))" in everywhere
for hit, (_stock, fixed) in runs.items():
    assert len(warned[hit]) == 1 and warned[hit][0].startswith(  # and it says so, once
        "AllReplicasFiniteLossScaleOptimizer: 1 step(s) skipped in this fit")
    assert fixed.iterations == (1, 1, 2, 3)  # skipped, exactly as the stock one skips replica 0's
    check_close(fixed.final_weights, runs[(0,)][0].final_weights, rtol=0, atol=0)
applied = runs[(1,)][0]  # Keras' wrapper saw nothing wrong and applied micro-batch 2
assert applied.loss_scales[1] == S and applied.iterations[:2] == (1, 2)
assert applied.weight_changes[1] == float("inf")
for hit in [(0,), tuple(range(R))]:  # skipped: iterations wait, the scale halves once
    stock = runs[hit][0]
    assert stock.loss_scales == (S, S / 2, S / 2, S / 2) and stock.iterations == (1, 1, 2, 3)
    assert stock.weight_changes[1] == 0.0
show_table(["overflow on", "Keras: iterations", "Keras: max |Δw|", "distgrad: iterations"], [
    (hit, ", ".join(map(str, stock.iterations)),
     ", ".join(f"{change:.2g}" for change in stock.weight_changes),
     ", ".join(map(str, fixed.iterations))) for hit, (stock, fixed) in runs.items()])

# %% [markdown]
# `iterations` counts applied steps: Keras' wrapper applied micro-batch 2 on replica 1's
# overflow (an infinite weight change); every skip leaves `iterations` and the weights
# alone and halves the scale once. distgrad's wrapper skips exactly as Keras' skips an
# overflow on replica 0, to the bit, and warns once at the end of the `fit`.

# %% [markdown]
# ### With accumulation: skipped on every replica, no cycle lost
#
# The fix's composition in `model.fit`, read after each micro-batch: 16 micro-batches,
# k = 2, the scale doubling after 4 good ones, an outlier at micro-batch 8 on every
# replica and one at 12 on replica 1 only.

# %%
ALL_REPLICAS_OUTLIER, ONE_REPLICA_OUTLIER, START = 8, 12, 2.0**8
x16, y16 = mixed.overflow_data(16, mb, ALL_REPLICAS_OUTLIER, R)  # a target 1e4 in every shard
y16[(ONE_REPLICA_OUTLIER - 1) * mb + mb // R] = mixed.OUTLIER_TARGET  # in replica 1's shard
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    safe = mixed.mixed_precision_fit(strategy, x16, y16, mb, 2, initial_scale=START,
                                     dynamic_growth_steps=4)
fig, (ax_scale, ax_count) = plt.subplots(1, 2, figsize=(10, 3))
micro_batches = np.arange(1, 17)
ax_scale.step(micro_batches, np.log2(safe.loss_scales), where="post")
ax_count.step(micro_batches, safe.iterations, where="post", label="updates")
ax_count.step(micro_batches, safe.total_micro_steps, "--", where="post", label="accumulated")
for ax, title in ((ax_scale, "log2(loss scale)"), (ax_count, "micro-batches, updates")):
    ax.axvline(ALL_REPLICAS_OUTLIER, color="gray", linestyle=":", label="outlier, all replicas")
    ax.axvline(ONE_REPLICA_OUTLIER, color="red", linestyle=":", label="outlier, replica 1")
    ax.set(title=title, xlabel="micro-batch")
ax_count.legend(fontsize=8)
before = (START,) + safe.loss_scales[:-1]
halved = [t + 1 for t, (b, a) in enumerate(zip(before, safe.loss_scales)) if a == b / 2]
assert halved == [ALL_REPLICAS_OUTLIER, ONE_REPLICA_OUTLIER] and all(safe.weights_finite)

# %% [markdown]
# The scale halves at both outliers, replica 1's too. A skipped micro-batch is not
# accumulated (the dashed line stands still); the cycle waits for two good ones.

# %% [markdown]
# ### Deep dive · The skipped micro-batches in numbers, and the warning

# %%
def skipped(record):
    """Micro-batches the wrapper skipped: `total_micro_steps` did not move."""
    previous = (0,) + record.total_micro_steps[:-1]
    return [t + 1 for t, (a, b) in enumerate(zip(previous, record.total_micro_steps)) if a == b]


show_table(["skipped micro-batches", "dropped cycles", "updates", "total_micro_steps"], [
    (skipped(safe), safe.skipped_updates, ", ".join(map(str, safe.iterations)),
     ", ".join(map(str, safe.total_micro_steps)))])
skip_warnings = [str(w.message) for w in caught if "skipped in this fit" in str(w.message)]
print("UserWarning:", textwrap.fill(skip_warnings[0], 88, subsequent_indent="  "))
assert halved == skipped(safe) == [ALL_REPLICAS_OUTLIER, ONE_REPLICA_OUTLIER]
assert safe.iterations[-1] == safe.total_micro_steps[-1] // 2  # every cycle applied
assert safe.skipped_updates == 0  # no cycle dropped
assert len(skip_warnings) == 1 and "2 micro-batch(es) skipped in this fit" in skip_warnings[0]

# %% [markdown]
# ## 3 · The packaged form
#
# [`distgrad.AccumulatingOptimizer`](../api.md#distgrad.optimizer.AccumulatingOptimizer)
# inside [`distgrad.AllReplicasFiniteLossScaleOptimizer`](../api.md#distgrad.mixed_precision)
# (`src/distgrad/optimizer.py`, `mixed_precision.py`). Each micro-batch is **unscaled
# with its own scale, then accumulated** in **float32**; one that overflowed on any
# replica is **skipped before accumulation** (the cycle waits for k good ones); the inner
# optimizer steps **once per cycle**, so `iterations` counts updates. An open cycle
# carries on into the next epoch unless `AccumulationCallback("flush")` applies it. On
# tf-keras, `compile` builds this order itself around `distgrad.tf_keras.AccumulatingOptimizer`.

# %% [markdown]
# <div class="admonition warning">
# <p class="admonition-title">Limits</p>
#
# * **float16 rounding**: equal to the big batch up to $2\gamma_n$ of the update (6.1 %
#   on two replicas), not 1e-6.
# * **Skips**: an overflow skips one micro-batch; the run then equals the big batch
#   without it (tf-keras deep dive).
# * **`steps_per_execution > 1` and XLA (`jit_compile`)** on several replicas fail in stock
#   Keras too ([upstream](../upstream.md#steps-per-execution)); distgrad refuses them at
#   once, naming the fix ([API](../api.md#distgrad.optimizer.AccumulatingOptimizer)).
# * **tf-keras `.h5`** under `mixed_float16` cannot restore the optimizer: save as `.keras`
#   ([API](../api.md#distgrad.tf_keras.optimizer.AccumulatingOptimizer)).
# * **BatchNorm** normalises each micro-batch by its own statistics
#   ([lesson 07](07_beyond_the_basics.ipynb), [pitfalls](../pitfalls.md#batchnorm-statistics)).
# * **A smaller last micro-batch**: `"flush"` averages micro-batch means
#   ([pitfalls](../pitfalls.md#mean-of-means)).
#
# </div>

# %% [markdown]
# ## Deep dive · The composition against the big batch, four optimizers
#
# The composition handed to `compile` (what `mixed.mixed_precision_fit` builds by default),
# on the 8 micro-batches of section 2, against 4 big-batch steps, for SGD, SGD with
# momentum, Adam and AdamW:

# %%
# The fix cell's count, and the bound of the runs below: a replica sums at most 8 examples
# (a big batch of 2 micro-batches) through tiny_model's 4 -> 8 -> 1 layers.
assert mixed.step_roundings(accumulation_steps * micro_batch, widths=(4, 16, 1)) == n
assert abs(bound - mixed.float16_rtol(n)) < 1e-12
assert mixed.step_roundings(32, widths=(4, 16, 1)) == 61  # two replicas: 6.1 %
assert abs(mixed.float16_rtol(61) - 0.0614) < 5e-5
F16 = {"batch": 8}
print(f"float16 bound: {mixed.float16_rtol(mixed.step_roundings(**F16)):.2%} of the update")
fixed_default = mixed.mixed_precision_fit(strategy, x8, y8, mb, 2)  # the wrapper given to compile
print(f"{fixed_default.wrapper}({fixed_default.wrapped})")
print("accumulators:", ", ".join(fixed_default.accumulator_dtypes))
assert fixed_default.wrapper == "AllReplicasFiniteLossScaleOptimizer"
assert fixed_default.wrapped == "AccumulatingOptimizer"
assert fixed_default.accumulator_dtypes == ("float32",) * 4 and all(fixed_default.weights_finite)
rows = []
for name, make in OPTIMIZERS.items():  # SGD(0.1), with momentum, Adam(0.01), AdamW
    accumulated = mixed.mixed_precision_fit(strategy, x8, y8, mb, 2, make)
    big_batch = mixed.mixed_precision_fit(strategy, x8, y8, 2 * mb, None, make)
    diff = mixed.check_float16_close(accumulated.final_weights, big_batch.final_weights,
                                     accumulated.initial_weights, **F16)
    rows.append((name, f"{diff.max_abs:.1e}", ", ".join(map(str, accumulated.iterations))))
    check_not_close(accumulated.final_weights, accumulated.initial_weights)  # it trained
    assert accumulated.iterations == (0, 1, 1, 2, 2, 3, 3, 4)  # updates, not micro-batches
    assert accumulated.total_micro_steps == tuple(range(1, 9))
    assert accumulated.accumulator_dtypes == ("float32",) * 4
show_table(["8 micro-batches, k = 2", "vs 4 big-batch steps", "iterations"], rows)

# %% [markdown]
# ## Deep dive · The question's two patches in Keras 3
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
# class as posted ([lesson 03](03_cond_and_merge_call.ipynb) shows it): every call adds
# the gradients into variables, calls the original with `accumulated * apply` (apply = 1
# every n-th call, else 0) and resets with `accumulated * keep` (keep = 1 - apply).

# %%
from distgrad_course.pitfalls import loss_scale_patch as lsp
from distgrad_course.pitfalls.mask_trick import QuestionMaskPatch

C = mixed.CONTROLLED_INITIAL_SCALE
print(f"default initial loss scale S = {S:g}, controlled C = {C:g}")


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


def questions_optimizer(policy):  # the question's first `if`, under the policy of a run
    keras.mixed_precision.set_global_policy(policy)
    optimizer = keras.optimizers.SGD(0.1)
    if keras.mixed_precision.global_policy().name.startswith("mixed"):
        optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
    return type(optimizer).__name__


# Why "only on GPU": the float32 runs patched the optimizer itself, the mixed ones the wrapper
assert questions_optimizer("float32") == "SGD"
assert questions_optimizer("mixed_float16") == "LossScaleOptimizer"
keras.mixed_precision.set_global_policy("float32")  # the runs below set their own


# %% [markdown]
# The `lsp` functions below (`distgrad_course.pitfalls.loss_scale_patch`) take it as `install=`:
# they build a tiny model and `LossScaleOptimizer(SGD)` under the strategy scope, call it,
# compile, and run `model.fit` under `mixed_float16`.
#
# ### Which methods run, where, on which gradients
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
# `optimizer.scale_loss` and differentiates with respect to the float32 variables. On
# step 1 it hands the wrapper zeros; on step 2 the scaled *sum* (2 × scale); the wrapper
# checks finiteness, divides by its current `dynamic_scale` in
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
# ### The overflow that freezes the weights
#
# `lsp.reproduce` runs 6 micro-batches (n = 2, SGD 0.1) in ordinary graph-mode `fit` and
# records, after each, the loss scale, `iterations`, the largest weight change and what
# the patch's accumulators hold. The scale starts at `C` and micro-batch 3 holds one
# example whose target is `OUTLIER_TARGET`: its *scaled* gradient exceeds float16's 65504
# while the float32 loss stays finite, an overflow caused by loss scaling, as in real
# training.

# %%
freeze_runs = {target: lsp.reproduce(strategy, target, overflow_step=3,
                                     install=install_question_patch)
               for target in ("none", "loss_scale_optimizer", "inner_optimizer")}
labels = {"none": "stock wrapper, no patch", "loss_scale_optimizer": "patch on the wrapper",
          "inner_optimizer": "patch on inner_optimizer"}
micro = np.arange(1, 7)
fig, (ax_scale, ax_change, ax_state) = plt.subplots(1, 3, figsize=(12, 3.3))
for (target, run), marker in zip(freeze_runs.items(), "os^"):
    ax_scale.plot(micro, np.log2(run.loss_scales), marker=marker, label=labels[target])
    ax_change.plot(micro, np.maximum(run.weight_changes, 1e-6), marker=marker,
                   label=labels[target])
states = freeze_runs["loss_scale_optimizer"].accumulator_states
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
stock, wrapped, inner = (freeze_runs[t] for t in ("none", "loss_scale_optimizer",
                                                   "inner_optimizer"))
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
    for t, r in freeze_runs.items()])

# %% [markdown]
# The stock wrapper skips micro-batch 3, halves the scale once and trains on. The
# patched wrapper skips *every* step from the overflow on: micro-batch 3's non-finite
# gradient is added into the accumulator, the next reset multiplies it by keep = 0, and
# `inf * 0` is `nan`; from then on every step hands the wrapper a non-finite gradient,
# the scale halves each step, the weights are frozen: "assign_add does nothing". With
# `assign(grad)` the poison is overwritten on the next step, which is why the user's
# `assign` run converged.
#
# ### Before the first overflow, and without an outlier
#
# Before the first overflow the wrapper patch matches one big-batch step per window (the
# patch sums micro-batch gradients, so the reference uses twice the learning rate):

# %%
clean = lsp.reproduce(strategy, "loss_scale_optimizer", overflow_step=None,
                      install=install_question_patch)
no_accumulation = lsp.reproduce(strategy, "none", overflow_step=None)
clean_diff = mixed.check_float16_close(clean.final_weights, lsp.accumulated_reference(strategy),
                                       clean.initial_weights, **F16)
print(f"patch on the wrapper vs big batch: {clean_diff.max_abs:.1e}")
mixed.check_float16_apart(clean.final_weights, no_accumulation.final_weights,
                          clean.initial_weights, **F16)
assert clean.iterations == (1, 2, 3, 4, 5, 6)  # but `iterations` counts micro-batches

# %% [markdown]
# No outlier is needed on the user's side. At the default initial scale, on one device,
# this lesson's data overflow by themselves on the first micro-batch:

# %%
natural_stock = lsp.reproduce(one_device, "none", overflow_step=None, initial_scale=S)
natural_patch = lsp.reproduce(one_device, "loss_scale_optimizer", overflow_step=None,
                              initial_scale=S, install=install_question_patch)
show_table(["one device, scale 2**15", "loss scale ÷ S", "iterations"], [
    (name, ", ".join(f"{s / S:g}" for s in r.loss_scales), ", ".join(map(str, r.iterations)))
    for name, r in (("stock wrapper", natural_stock), ("patch on the wrapper", natural_patch))])
assert natural_stock.loss_scales[0] == S / 2 and natural_stock.iterations[-1] >= 3
assert natural_patch.iterations == (0,) * 6 and natural_patch.weight_changes == (0.0,) * 6

# %% [markdown]
# ### A scale that changes inside a cycle
#
# With the scale doubling after every micro-batch (`dynamic_growth_steps=1`), the two
# micro-batches of a cycle are computed at different scales. The fix unscales each one
# with its own; the question's wrapper patch divides the scaled sum by the latest scale:

# %%
x6, y6 = mixed.overflow_data(6, mb, None, R)  # the data of `lsp.accumulated_reference`
fixed_growing = mixed.mixed_precision_fit(strategy, x6, y6, mb, 2,
                                          lambda: keras.optimizers.SGD(0.2), initial_scale=16,
                                          dynamic_growth_steps=1)
patched_growing = lsp.reproduce(
    strategy, "loss_scale_optimizer", overflow_step=None, initial_scale=16,
    wrapper=lambda inner, **kw: keras.mixed_precision.LossScaleOptimizer(
        inner, **{**kw, "dynamic_growth_steps": 1}),
    install=install_question_patch)
growing_reference = lsp.accumulated_reference(strategy, initial_scale=16)
print("loss scales", fixed_growing.loss_scales)
fixed_diff = mixed.check_float16_close(fixed_growing.final_weights, growing_reference,
                                       fixed_growing.initial_weights, **F16)
print(f"AccumulatingOptimizer vs big batch: {fixed_diff.max_abs:.1e}")
patch_diff = mixed.check_float16_apart(patched_growing.final_weights, growing_reference,
                                       patched_growing.initial_weights, **F16)
print(f"the question's patch on the wrapper vs big batch: {patch_diff.max_abs:.1e}")

# %% [markdown]
# ## Deep dive · The question's own stack: tf-keras
#
# The user wrote Keras 2 code: a custom `train_step` with `get_scaled_loss` /
# `get_unscaled_gradients` and the era's `OptimizerV2` (`tf.keras.optimizers.legacy.SGD`).
# `distgrad_course/pitfalls/tf_keras_loss_scale.py` holds it (the question's `train_step`, reduced
# to a tiny model) and the question's patch for tf-keras; it is imported only in a child
# process where `distgrad_course.lab.tf_keras_runner.run_tf_keras` sets `TF_USE_LEGACY_KERAS=1` before
# TensorFlow is imported:

# %%
import importlib.util
import pathlib

pitfalls_folder = importlib.util.find_spec("distgrad_course.pitfalls").submodule_search_locations[0]
legacy_file = pathlib.Path(pitfalls_folder, "tf_keras_loss_scale.py").read_text()
start = legacy_file.index("    def train_step(self, data):")
display(Code(legacy_file[start:legacy_file.index("\n\n", start)], language="python"))

# %% [markdown]
# ### The two patches in tf-keras
#
# `lsp.tf_keras_reproduction` runs it, the same data and both patches, plus tf-keras'
# newer optimizer (`LossScaleOptimizerV3`):

# %%
legacy = lsp.tf_keras_reproduction(replicas=R)
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
np.testing.assert_allclose(frozen.weight_changes, wrapped.weight_changes,
                           rtol=mixed.float16_rtol(mixed.step_roundings(**F16)))
mixed.check_float16_close(legacy["patch on LSO"].final_weights, legacy["big batch"].final_weights,
                          legacy["big batch"].initial_weights, **F16)
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
# * **Patch on `inner_optimizer`** is reached in tf-keras (`LossScaleOptimizer._apply_gradients`
#   calls `self._optimizer.apply_gradients(..., experimental_aggregate_gradients=False)`
#   from `call_for_each_replica`), but inside the wrapper's
#   `smart_cond(should_apply_grads, apply_fn, do_not_apply_fn)`. The question's patch
#   returns `None`; `do_not_apply_fn` returns the `iterations` increment: the branches'
#   outputs differ and tracing fails with the `ValueError` above.
#
# ### Returning the result
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
mixed.check_float16_close(legacy["v3: patch on inner"].final_weights,
                          legacy["big batch"].final_weights, legacy["big batch"].initial_weights,
                          **F16)
show_table(["patch on inner, returning the result", "value"], [
    ("patch calls", returning.patch_calls),
    ("iterations", ", ".join(map(str, returning.iterations))),
    ("weights moved at micro-batch", ", ".join(
        str(t + 1) for t, c in enumerate(returning.weight_changes) if c > 0))])

# %% [markdown]
# That gets one thing right: the accumulator sits *inside* the wrapper, so the wrapper
# skips the overflowing micro-batch before it reaches the accumulator (5 calls for 6
# micro-batches) and nothing is poisoned. But it is still the mask trick of
# [lesson 03](03_cond_and_merge_call.ipynb): every call runs the inner optimizer's
# `apply_gradients`, mostly with zeros, so `iterations` counts micro-batches, and a
# momentum or Adam optimizer would drift; it only looks right here because SGD ignores a
# zero gradient. The right composition is the same order with real accumulation.
#
# ### tf-keras checked every replica: it all-reduced first
#
# tf-keras' `LossScaleOptimizer.apply_gradients` all-reduces the gradients (through the
# wrapped optimizer's `aggregate_gradients`) *before* it checks them, so the comment
# section 2 showed in Keras 3 was true there, and an overflow on replica 1 only is
# skipped:

# %%
assert "grads_and_vars = self._optimizer.aggregate_gradients(grads_and_vars)" in legacy_source
stock_legacy = legacy["stock, overflow on replica 1 only"]  # tf-keras got it right:
assert stock_legacy.weights_finite and stock_legacy.weight_changes[2] == 0.0
assert stock_legacy.loss_scales == returning.loss_scales  # skipped, the scale halved once
print("tf-keras, overflow on replica 1 only: loss scales", stock_legacy.loss_scales)

# %% [markdown]
# ### The fix on the question's stack: tf-keras, `mixed_float16`, `model.fit`
#
# The question's answer installed the patch *after* the wrapper (`optimizer =
# LossScaleOptimizer(optimizer)`, then `get_patched_optimizer(optimizer, ...)`). On tf-keras
# the fix reverses the order and replaces the patch by an optimizer,
# `distgrad.tf_keras.AccumulatingOptimizer`, so that the loss-scale wrapper is outside.
# In tf-keras that order is forced twice over, as the installed source and the question's
# `train_step` show: `model.compile` under `mixed_float16` wraps any optimizer that is not
# a `LossScaleOptimizer` in one, and the question's `train_step` scales its loss only if
# `model.optimizer` *is* one: an accumulator outside it would silently train float16
# gradients without loss scaling.

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
# `distgrad.tf_keras.AccumulatingOptimizer` answers the wrapper's `aggregate_gradients` call
# by keeping the gradients replica-local (the gradient all-reduce comes once per update;
# `tests/tf_keras_optimizer/test_tf_keras_mixed_precision.py` counts the all-reduces) and
# sharing one number instead: whether every replica's gradients are finite. If any is not,
# every replica hands the wrapper a NaN, so the wrapper skips that micro-batch on every
# replica and halves the scale once. The program below is the question's set-up in the fixed
# order, with the question's `train_step`. It is written to a file and run in a child
# process (`run_tf_keras` sets `TF_USE_LEGACY_KERAS=1` before TensorFlow starts);
# `distgrad_course.lab.tf_keras_fit` supplies the `fit` recipes and reads the counters after
# every micro-batch.

# %%
import shutil
import tempfile

from distgrad_course.lab.tf_keras_runner import run_tf_keras

program_folder = tempfile.mkdtemp(prefix="lesson04-tf-keras-")

# %%
# %%writefile {program_folder}/question_fix.py
import tensorflow as tf  # tf-keras here: run_tf_keras set TF_USE_LEGACY_KERAS=1 before

from distgrad.tf_keras import AccumulatingOptimizer
from distgrad_course.lab.tf_keras_fit import big_batch_fit, fit, policy, weights
from distgrad_course.lab.tf_keras_runner import tf_keras_strategy
from distgrad_course.pitfalls.tf_keras_loss_scale import QuestionModel  # the question's train_step


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
    strategy = tf_keras_strategy(replicas)  # first: the logical devices
    results = {}
    with policy("mixed_float16"):
        start = QuestionModel()  # seeded: where every run below starts
        start(tf.zeros((1, 4)))
        for name, (x, y, reference_x, reference_y) in data.items():
            model, counters = fit(strategy, QuestionModel,
                                  lambda: build_optimizer(grad_acc_n, initial_scale), x, y,
                                  batch_size=micro_batch)
            big_batch, _ = big_batch_fit(QuestionModel, lambda: build_optimizer(1, initial_scale),
                                         reference_x, reference_y,
                                         batch_size=grad_acc_n * micro_batch)
            results[name] = {"accumulated": weights(model), "big_batch": weights(big_batch),
                             "initial": weights(start), "counters": counters, "wrapping": [
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
question_fix = run_tf_keras("question_fix:main", R, env={"PYTHONPATH": program_folder},
                          data={"clean": [a.tolist() for a in (clean_x, clean_y) * 2],
                                "outlier on replica 1": [a.tolist() for a in (
                                    bad_x, bad_y, bad_x[others], bad_y[others])]},
                          micro_batch=mb, grad_acc_n=2, initial_scale=C)
shutil.rmtree(program_folder)  # the program ran; a temporary folder is not left behind
print(f"TensorFlow {question_fix.tensorflow}, tf-keras {question_fix.tf_keras}, "
      f"{question_fix.replicas} replicas")
clean, outlier = question_fix["clean"], question_fix["outlier on replica 1"]
print("model.optimizer is {}({}(SGD))".format(*clean["wrapping"]))
for name, run in question_fix.value.items():
    diff = mixed.check_float16_close(run["accumulated"], run["big_batch"], run["initial"],
                                     batch=2 * mb)  # the big batch, on one device
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
# above, also after the outlier: its micro-batch was skipped on **both** replicas
# (`total_micro_steps` stands still at micro-batch 3) and the scale halved once. Unlike
# Keras 3's wrapper (section 2), tf-keras' checks finiteness after an all-reduce (here of
# the one flag), so the outlier on replica 1 is seen everywhere. Three counters, three
# meanings: `total_micro_steps` counts the micro-batches accumulated, the inner SGD's
# `iterations` its updates (what momentum, Adam and schedules see), and
# `model.optimizer.iterations` adds the skipped step, as tf-keras' wrapper counts one (its
# `do_not_apply_fn`, asserted above).
# `tests/tf_keras_optimizer/test_tf_keras_mixed_precision.py` pins the same with Adam,
# `OptimizerV2`, the stock `train_step` and a checkpoint taken mid-cycle.

# %% [markdown]
# ## Takeaways
#
# * Loss scaling outside, real accumulation inside:
#   `AllReplicasFiniteLossScaleOptimizer(AccumulatingOptimizer(inner, k))`.
# * Keras 3's `LossScaleOptimizer` reads replica 0's overflow flag only.
# * A patched `apply_gradients` dies at the first overflow (`inf * 0 = nan`); a patched
#   `inner_optimizer.apply_gradients` never runs in Keras 3.
#
# ## Exercises
#
# ### Exercise 1 · An overflow at the end of a cycle
#
# In the deep dive on the question's patches, the outlier sat in micro-batch 3, inside a
# cycle of n = 2. Move it to micro-batch 4, a cycle's end. What does the patch's
# accumulator hold after each micro-batch: when is it `inf`, when `nan`?

# %% [markdown]
# #### Answer
#
# Never `inf`: micro-batch 4's call adds the overflow, hands the wrapper
# `accumulated * 1` (skipped) and resets with `accumulated * 0`, which is `inf * 0 = nan`,
# all in the same call. From then on it is `nan`, as before.

# %%
at_cycle_end = lsp.reproduce(strategy, "loss_scale_optimizer", overflow_step=4,
                             install=install_question_patch)
print("accumulator after each micro-batch:", ", ".join(at_cycle_end.accumulator_states))
assert at_cycle_end.accumulator_states == ("finite",) * 3 + ("nan",) * 3

# %% [markdown]
# ### Exercise 2 · The cycle left open
#
# Drop the fix cell's `AccumulationCallback("flush")` (the default: carry the open cycle
# on). How many updates, what is `micro_steps` at the end, does the check pass?

# %% [markdown]
# #### Answer
#
# Four updates; the ninth micro-batch waits in the accumulators (`micro_steps` is 1) for
# the next epoch's first. The check fails at its first assertion: `iterations` is 4, not 5.
# The weights are those of the first 4 big-batch steps, up to float16 rounding: the fifth,
# the open cycle's, is missing.

# %%
with mixed.mixed_precision_policy("mixed_float16"), strategy.scope():
    carried = keras.models.clone_model(model)
    carried.set_weights(initial_weights)
    carried.compile(optimizer=distgrad.AllReplicasFiniteLossScaleOptimizer(
        distgrad.AccumulatingOptimizer(keras.optimizers.SGD(0.1), accumulation_steps),
        initial_scale=2.0**10), loss="mse")
    carried.fit(examples.batch(micro_batch), epochs=1, shuffle=False, verbose=0)  # carry
accumulating = carried.optimizer.inner_optimizer
counters = accumulating.iterations.numpy(), accumulating.micro_steps.numpy()
print("updates: {}, micro_steps: {}".format(*counters))
assert counters == (4, 1)
checked = carried.optimizer.iterations.numpy(), carried.optimizer.skipped_steps.numpy()
assert checked == (4, 0)  # what the check's first assertion reads: it wants (5, 0)
with mixed.mixed_precision_policy("mixed_float16"):  # the check's reference, 4 steps only
    four_steps = keras.models.clone_model(model)
    four_steps.set_weights(initial_weights)
    four_steps.compile(optimizer=keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**10), loss="mse")
    four_steps.fit(examples.batch(accumulation_steps * micro_batch).take(4), shuffle=False,
                   verbose=0)
assert four_steps.optimizer.iterations.numpy() == 4
diff = mixed.check_float16_close(carried.get_weights(), four_steps.get_weights(),
                                 initial_weights, batch=accumulation_steps * micro_batch,
                                 widths=(4, 16, 1))
print(f"vs 4 big-batch steps: max abs diff {diff.max_abs:.1e}")

# %% [markdown]
# ### Exercise 3 · The second outlier on replica 0
#
# In section 2's trajectory cell, put the second outlier into replica 0's shard (drop
# `+ mb // R`). Which micro-batches are skipped? Would Keras' own wrapper see it?

# %% [markdown]
# #### Answer
#
# Nothing changes: distgrad's wrapper combines every replica's flag, so it does not
# matter which replica overflowed (micro-batches 8 and 12 skipped, one warning for 2).
# Keras' wrapper would see this one: replica 0 is the replica it reads (section 2's
# table). That is why a test on one device, or with an overflow on replica 0, cannot
# reveal its hole.

# %%
_, y_zero = mixed.overflow_data(16, mb, ALL_REPLICAS_OUTLIER, R)
y_zero[(ONE_REPLICA_OUTLIER - 1) * mb] = mixed.OUTLIER_TARGET  # in replica 0's shard
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    on_zero = mixed.mixed_precision_fit(strategy, x16, y_zero, mb, 2, initial_scale=START,
                                        dynamic_growth_steps=4)
told = [str(w.message) for w in caught if "skipped in this fit" in str(w.message)]
print("skipped micro-batches:", skipped(on_zero))
assert skipped(on_zero) == [ALL_REPLICAS_OUTLIER, ONE_REPLICA_OUTLIER]
assert all(on_zero.weights_finite)
assert len(told) == 1 and "2 micro-batch(es) skipped in this fit" in told[0]

# %% [markdown]
# ## Further reading
#
# * tensorflow/tensorflow#50454 (the question); keras-team/keras#14829 (accumulation with
#   mixed precision in tf.keras).
# * [Upstream: replica 0 only](../upstream.md#loss-scale-first-replica-finite);
#   pitfalls [loss-scale patch](../pitfalls.md#loss-scale-patch) and
#   [one replica checked](../pitfalls.md#lso-first-replica-finite).
# * TensorFlow's *Mixed precision* guide; `keras.mixed_precision.LossScaleOptimizer`.
# * Installed source: `keras/src/optimizers/loss_scale_optimizer.py` (`_tf_apply`),
#   `tf_keras/src/mixed_precision/loss_scale_optimizer.py` (`apply_gradients`).
