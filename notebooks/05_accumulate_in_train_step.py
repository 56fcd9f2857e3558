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
# # 05 · Accumulating inside `train_step`: the `g += _g` no-op, and one that works in `fit`
#
# **The question** ([Stack Overflow, TF 2.4 era](../questions.md#q4)). A user overrides
# `Model.train_step`, splits each batch into micro-batches inside a `tf.while_loop`, and
# accumulates the gradients with
#
# ```python
# for g, _g in zip(grad, _grad):
#     g += _g
# return [i + step, grad]
# ```
#
# Memory goes down, but training no longer matches plain `fit`. The accepted answer,
# `grad = [g + _g for g, _g in zip(grad, _grad)]`, works; the "final solution" posted with
# it has bugs of its own (`super(self).fit`, a missing `return`, private APIs that Keras 3
# removed, ...).
#
# **Short answer.** `g += _g` on a `tf.Tensor` rebinds the Python name `g` and changes
# nothing in the list, so each step applies the *first* micro-batch's gradient only. That
# is Python, not TensorFlow. Below: the no-op with numbers, a reusable micro-batching
# `train_step` (`distgrad.train_step.MicroBatching`) that is exactly equivalent to a
# big-batch step under `MirroredStrategy` and mixed precision with one all-reduce per step,
# what it buys in memory and costs in time, and each bug of the posted solution, run.

# %%
import os

# §5 reads the CPU allocator's statistics, which exist only with oneDNN on (TensorFlow
# turns it on by itself only on CPUs with AVX-512): set before TensorFlow is imported.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
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

from distgrad.lab.compare import check_close, weights_of
from distgrad.lab.data import regression_data, tiny_model
from distgrad.lab.graph import fit_step_placement
from distgrad.pitfalls import compound_assignment, final_solution
from distgrad.train_step import MicroBatching, check_micro_batches, with_micro_batches

tf.get_logger().setLevel("ERROR")  # fresh models retrace on purpose; silence the notes
GLOBAL_BATCH = 8 * R
x, y = regression_data(2 * GLOBAL_BATCH)  # two fit steps per epoch

# %% [markdown]
# ## 1 · Reproduce: the loop body changes nothing
#
# `compound_assignment.reproduce` runs the question's body in a `tf.while_loop` over three
# iterations: the accumulator starts at `[[1, 2], 10]` and iteration *i* adds
# `[[i+1, i+1], 10(i+1)]`. Next to it: the accepted fix (return new tensors), a
# `tf.Variable` with `assign_add`, the same body run eagerly in a plain Python loop, and
# NumPy arrays.

# %%
record = compound_assignment.reproduce(iterations=3)
for name in ("initial", "expected", "compound_in_while_loop", "returned_in_while_loop",
             "variable_assign_add", "eager_python_loop", "numpy_in_place"):
    print(f"{name:24s} {getattr(record, name)}")
assert record.compound_in_while_loop == record.initial  # g += _g: nothing accumulated
assert record.returned_in_while_loop == record.expected  # grad = [g + _g ...]; return grad
assert record.variable_assign_add == record.expected  # state change, not a name
assert record.eager_python_loop == record.initial  # same no-op without any graph
assert record.numpy_in_place == record.expected  # ndarray.__iadd__ works in place

# %% [markdown]
# ## 2 · Look inside: Python name rebinding
#
# `for g, _g in zip(grad, _grad)` binds the name `g` to each list element in turn.
# `g += _g` asks `type(g).__iadd__`; a `tf.Tensor` has none (tensors are immutable), so
# Python falls back to `g = g + _g`: a **new** tensor bound to the loop name `g`, thrown
# away at the next iteration. `grad` still holds the old tensors. NumPy arrays *do* have
# an in-place `__iadd__`, which is why the line looks right to NumPy users, and why it
# works on eager NumPy-like code and silently fails on tensors.
#
# Variables are the other way to hold state: `tf.Variable.__iadd__` refuses `+=` with an
# error that names the fix, while a Keras 3 `keras.Variable` has no `__iadd__` at all and
# is rebound to a plain tensor, silently, like a tensor.

# %%
print("tf.Tensor has __iadd__:  ", record.tensor_has_iadd)
print("np.ndarray has __iadd__: ", record.ndarray_has_iadd)
print("tf.Variable += 1.0 ->    ", record.tf_variable_iadd_error)
print("keras.Variable += 1.0 -> the name now holds a", record.keras_variable_rebound_to,
      "; the variable still reads", record.keras_variable_value_after)
assert not record.tensor_has_iadd and record.ndarray_has_iadd
assert record.tf_variable_iadd_error.type == "RuntimeError"
assert record.tf_variable_iadd_error.contains("Use `variable.assign_add(value)`")
assert record.keras_variable_rebound_to == "EagerTensor" and record.keras_variable_value_after == 1.0

# %% [markdown]
# **Why loop variables must be returned.** `tf.while_loop(cond, body, loop_vars)` traces
# `body` once into a function whose *outputs* become the next iteration's inputs (in the
# graph they are the `While` op's loop-carried values). Whatever the body does to Python
# objects happens once, at trace time; only returned tensors (and state changes such as
# `assign_add`) survive an iteration.
#
# What does that do to training? `reproduce_in_fit` runs the question's first
# `GradAccumModel.train_step` (Keras 3 spelling, otherwise unchanged: the first micro-batch
# outside the loop, `g += _g` inside) for one SGD step on a batch of 16 split 4 ways:

# %%
in_fit = compound_assignment.reproduce_in_fit(micro_batches=4, examples=16)
print("g += _g vs one step on the first micro-batch only:", in_fit.vs_first_micro_batch)
print("g += _g vs one step on the whole batch:           ", in_fit.vs_full_batch)
print("accepted fix, no 1/k: update / full-batch update = ", round(in_fit.returned_ratio, 6))
assert in_fit.vs_first_micro_batch.within() and not in_fit.vs_full_batch.within()
assert abs(in_fit.returned_ratio - 4.0) < 4e-6  # sum of k means: k times too large

# %% [markdown]
# So the question's model trained on a quarter of every batch, which is why its curves
# drifted from plain `fit`. The accepted fix sums correctly; without the division the
# question commented out, the SGD step is k times too large.
#
# ## 3 · The fix: `MicroBatching.train_step`
#
# `distgrad.train_step.MicroBatching` is a mixin for `keras.Model`; `MicroBatchingModel`
# is `MicroBatching + keras.Model` (it accepts functional `inputs, outputs`), and
# `with_micro_batches(model, k)` wraps the layers of an existing functional/Sequential
# model. The step, as installed:

# %%
print(inspect.getsource(MicroBatching.train_step))

# %% [markdown]
# Why each line is there (all read from the installed Keras,
# `keras/src/backend/tensorflow/trainer.py`, `TensorFlowTrainer.train_step`):
#
# * **Scaling.** `compute_loss` already returns the mean over the slice it is given,
#   divided by R (`keras/src/losses/loss.py`, `scale_loss_for_distribution`). Dividing by
#   k once more makes the k slice losses sum to the replica's mean / R, and the optimizer's
#   SUM all-reduce makes that the global mean. Regularization losses are added once per
#   slice, times 1/k: once per step.
# * **Mixed precision.** `optimizer.scale_loss` multiplies by the dynamic loss scale (the
#   identity without a `LossScaleOptimizer`); the summed *scaled* gradients reach
#   `apply_gradients` once, so the `LossScaleOptimizer` checks, unscales, and updates once.
# * **Metrics.** The loss tracker gets each slice's loss weighted by the slice size, and
#   `compute_metrics` runs on each slice; Keras' `Mean`-based metrics over k equal slices
#   equal the metric over the batch.
# * **No `tf.cond`, one all-reduce.** The loop body contains no `apply_gradients`, hence
#   no `merge_call` and no collective; it is applied after the loop, unconditionally.
# * **An explicit `tf.while_loop`**, because Keras traces `train_step` under
#   `tf.autograph.experimental.do_not_convert` (`TensorFlowTrainer._make_function`): a
#   Python `for i in tf.range(k)` fails there instead of becoming a loop.
# * **`parallel_iterations=1`**: the next slice's forward pass does not depend on this
#   slice's gradients, and `tf.while_loop` allows 10 iterations to run in parallel by
#   default (its `parallel_iterations` argument), which could keep several slices'
#   activations alive together.
#
# ## 4 · Prove it
#
# ### Equivalence with big-batch `fit`, for SGD, momentum and Adam
#
# Each recipe trains for 2 epochs of 2 steps with `fit`; the reference is plain Keras on
# one device with the whole batch. Weights must agree to `rtol = atol = 1e-6`, and the
# `loss` and `mae` that `fit` reports must be the big-batch ones.

# %%
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


def fit(on, optimizer, micro_batches=None, model_factory=tiny_model, data=(x, y),
        batch_size=GLOBAL_BATCH, epochs=2, loss="mse", metrics=("mae",)):
    """Fit a fresh model; micro_batches=None is plain Keras."""
    with on.scope():
        model = model_factory()
        if micro_batches is not None:
            model = with_micro_batches(model, micro_batches)
        model.compile(optimizer=optimizer(), loss=loss, metrics=list(metrics))
    history = model.fit(*data, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


def same_history(actual, expected):
    return all(np.allclose(actual[key], expected[key], rtol=1e-6, atol=1e-6) for key in expected)


one_device = tf.distribute.get_strategy()
K = 4
for name, make in OPTIMIZERS.items():
    plain, plain_history = fit(one_device, make)
    micro, micro_history = fit(strategy, make, micro_batches=K)
    diff = check_close(weights_of(micro), weights_of(plain))
    print(f"{name:9s} {R} replicas x {K} micro-batches vs 1 device, big batch: {diff}")
    print(f"          history {micro_history}\n          big batch {plain_history}")
    assert same_history(micro_history, plain_history)
    assert int(micro.optimizer.iterations.numpy()) == 4  # one update per fit step

# %% [markdown]
# ### One all-reduce per step, outside the loop
#
# `fit_step_placement` traces the very `tf.function` that `model.fit` calls each step
# (`model.train_function`), and counts the all-reduce ops in it, and
# how many of them sit inside a `tf.while_loop` body (those would run k times).

# %%
micro, _ = fit(strategy, OPTIMIZERS["adam"], micro_batches=K, epochs=1)
plain, _ = fit(strategy, OPTIMIZERS["adam"], epochs=1)
micro_counts = fit_step_placement(micro, x, y, GLOBAL_BATCH)
plain_counts = fit_step_placement(plain, x, y, GLOBAL_BATCH)
print("micro-batched step:", micro_counts)
print("plain Keras step:  ", plain_counts)
if R > 1:
    assert micro_counts.all_reduces == plain_counts.all_reduces == 1
assert micro_counts.in_while_bodies == 0 and micro_counts.while_loops == 1

# %% [markdown]
# ### Mixed precision
#
# Under `mixed_float16` the forward and backward passes run in float16: a different split
# of the batch changes float16 sums in the backward pass, so a big-batch step is not an
# exact reference.
# Two checks that are exact: (1) R replicas x 2 micro-batches equals 1 device x 2R
# micro-batches, because both see the same float16 slices of 4 examples and differ only in
# the 1/R and 1/k factors and in the order of float32 sums; (2) a step whose gradients
# overflow is skipped *once* and halves the loss scale *once*, not once per micro-batch.

# %%
def mixed_model():
    return tiny_model(dtype_policy="mixed_float16")


def lso_sgd(initial_scale=2.0 ** 15):
    return lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                       initial_scale=initial_scale)


replicas_run, replicas_history = fit(strategy, lso_sgd(), 2, model_factory=mixed_model)
device_run, device_history = fit(one_device, lso_sgd(), 2 * R, model_factory=mixed_model)
print(f"mixed_float16, {R} replicas x 2 vs 1 device x {2 * R}:",
      check_close(weights_of(replicas_run), weights_of(device_run)))
assert same_history(replicas_history, device_history)

overflow, _ = fit(strategy, lso_sgd(2.0 ** 10), K, model_factory=mixed_model,
                  data=(x[:GLOBAL_BATCH] * 3e4, y[:GLOBAL_BATCH]), epochs=1)
print("overflowing step: iterations", int(overflow.optimizer.iterations.numpy()),
      "loss scale 1024 ->", float(overflow.optimizer.dynamic_scale.numpy()))
assert int(overflow.optimizer.iterations.numpy()) == 0
assert float(overflow.optimizer.dynamic_scale.numpy()) == 2.0 ** 9

# %% [markdown]
# One caveat belongs to Keras, not to micro-batching (lesson 04): under `MirroredStrategy`
# Keras 3's `LossScaleOptimizer` decides "all gradients finite?" from replica 0's *local*
# gradients, so an overflow on another replica only is applied to the weights, with plain
# `fit` and with `MicroBatching` alike (`tests/test_train_step.py` pins both). Lesson 04's
# `AllReplicasFiniteLossScaleOptimizer` fixes it, and drops into `MicroBatching` unchanged:
# the overflow on replica 1 is skipped, and the step still has one all-reduce.

# %%
from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer

if R > 1:
    targets = y[:GLOBAL_BATCH].copy()
    targets[GLOBAL_BATCH // R:] = 6e4  # only the replicas after replica 0 overflow
    guarded, _ = fit(strategy, lambda: AllReplicasFiniteLossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0 ** 10), 2, model_factory=mixed_model,
        data=(x[:GLOBAL_BATCH], targets), epochs=1)
    guarded_counts = fit_step_placement(guarded, x[:GLOBAL_BATCH], targets,
                                                     GLOBAL_BATCH)
    print("overflow on replicas 1..R-1: iterations", int(guarded.optimizer.iterations.numpy()),
          "| loss scale", float(guarded.optimizer.dynamic_scale.numpy()), "|", guarded_counts)
    assert int(guarded.optimizer.iterations.numpy()) == 0
    assert (guarded_counts.all_reduces, guarded_counts.in_while_bodies) == (1, 0)

# %% [markdown]
#
# ### A batch that does not split
#
# Every batch must hold a multiple of `accumulation_steps x replicas` examples, the last batch of
# an epoch included. With static shapes the step fails while tracing, with a `ValueError`;
# with a partial last batch (numpy input whose length is not a multiple of `batch_size`) it
# fails when that batch arrives. Both messages name the fix.

# %%
ragged_x, ragged_y = regression_data(2 * GLOBAL_BATCH - 2)
try:
    fit(strategy, OPTIMIZERS["sgd"], K, data=(ragged_x, ragged_y), epochs=1)
    ragged_error = None
except tf.errors.InvalidArgumentError as err:
    ragged_error = next(line for line in str(err).splitlines() if "assertion failed" in line)
print(ragged_error[:400])
assert "drop_remainder=True" in ragged_error and f"accumulation_steps={K}" in ragged_error

try:
    check_micro_batches(12, 4, 2)
except ValueError as err:
    print(err)
    assert "multiple of accumulation_steps x replicas = 8 (e.g. 8 or 16)" in str(err)

# %% [markdown]
# ## 5 · What it buys: memory, and what it costs: time
#
# A wide MLP (3 tanh layers of 512 units, 64 inputs) trains on one global batch of 4096
# examples with k = 1 ... 16 micro-batches: its activations, not its weights, dominate. **Allocator peak**: TensorFlow's own counter of
# tensor bytes (`tf.config.experimental.get_memory_info`, reset before the step) on
# `allocator_device(...)`: on a GPU the first GPU (replica 0); on CPU the one allocator all
# logical CPU devices share, i.e. every replica together. We report the peak *above* what
# was live before the step (weights, slots, data). It counts tensors only, and on CPU not
# even all of them: the probe below shows small temporaries are not counted, so the CPU
# number is a lower bound that tracks the large activations, which is what k changes.

# %%
from distgrad.lab.memory import (
    allocator_counts,
    allocator_device,
    fresh_process_step_memory,
    profile_fit_step,
    wide_mlp,
)

device = allocator_device(len(tf.config.list_physical_devices("GPU")))
if device == "CPU:0":
    probe = {kib: allocator_counts(kib * 1024, device) for kib in (128, 256, 1024)}
    print("CPU allocator statistic counts a temporary of (KiB):", probe)
    assert probe == {128: False, 256: True, 1024: True}
rng = np.random.default_rng(0)
WIDE = {"features": 64, "hidden": 512, "layers": 3}
WIDE_BATCH = 4096
wide_x = rng.normal(size=(WIDE_BATCH, WIDE["features"])).astype("float32")
wide_y = rng.normal(size=(WIDE_BATCH, 1)).astype("float32")
MICRO = [1, 2, 4, 8, 16]
step_mib, step_ms = {}, {}
for k in MICRO:
    with strategy.scope():
        model = wide_mlp(accumulation_steps=k, **WIDE)
    model.fit(wide_x, wide_y, batch_size=WIDE_BATCH, verbose=0)  # trace; not measured
    step, seconds = profile_fit_step(model, wide_x, wide_y, WIDE_BATCH, timed_steps=3,
                                     device=device)  # seconds: fastest of 3 steps
    step_mib[k], step_ms[k] = step.step_bytes / 2 ** 20, 1000 * seconds
    print(f"k={k:2d}: step peak {step_mib[k]:6.1f} MiB above live on {device}, {step_ms[k]:6.0f} ms/step")
assert step_mib[1] - step_mib[8] > 3  # MiB: the full-batch activations are gone

# %% [markdown]
# **Peak RSS**, for comparison, in a fresh process per setting (`fresh_process_step_memory`:
# RSS is a lifetime maximum, so a process can only measure one configuration). It includes
# the TensorFlow runtime, Python, the traced graphs, and all tensors, so the step is a
# small difference on a large base. One replica here, k = 1 and k = 16.

# %%
fresh = {k: fresh_process_step_memory(k, batch_size=WIDE_BATCH, timed_steps=1, **WIDE)
         for k in (1, 16)}
for k, m in fresh.items():
    print(f"k={k:2d}: RSS before fit {m.rss_before / 2**20:6.0f} MiB, peak {m.rss_peak / 2**20:6.0f} MiB "
          f"(+{m.rss_growth / 2**20:.0f} MiB, tracing included); allocator step {m.step.step_bytes / 2**20:.1f} MiB")
    assert m.rss_before > 10 * m.step.step_bytes  # the runtime, not the step, dominates RSS

# %%
fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 3.5))
left.plot(MICRO, [step_mib[k] for k in MICRO], "o-")
left.set(xscale="log", xlabel="micro-batches k", ylabel="MiB",
         title=f"allocator peak above live ({device}, {R} replicas)")
middle.plot(MICRO, [step_ms[k] for k in MICRO], "o-")
middle.set(xscale="log", xlabel="micro-batches k", ylabel="ms per step",
           title="step time (fastest of 3; shared CPU)")
for axis in (left, middle):
    axis.set_xticks(MICRO, [str(k) for k in MICRO])
labels_rss = [f"k={k}" for k in fresh]
right.bar(labels_rss, [m.rss_before / 2 ** 20 for m in fresh.values()], label="RSS before fit")
right.bar(labels_rss, [m.rss_growth / 2 ** 20 for m in fresh.values()],
          bottom=[m.rss_before / 2 ** 20 for m in fresh.values()], label="growth to peak")
right.set(ylabel="MiB", title="peak RSS, fresh process, 1 replica")
right.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The allocator numbers show what micro-batching buys: the full-batch activations shrink
# with k towards a floor (gradients, the accumulators, the slices of the input batch).
# Peak RSS, printed for the same workload in fresh processes, is set by the runtime and
# tracing, far above one step's tensors: on CPU it is the wrong instrument for this
# question, and the allocator statistic (or `get_memory_info("GPU:0")` on a GPU) is the
# right one. What micro-batching costs: k smaller matmuls run one after another
# (`parallel_iterations=1`); read the printed step times, which on a shared 2-core CPU are
# noisy even as the fastest of 3. Micro-batching is for batches whose activations do not
# fit, not for speed.
#
# ## 6 · In-step or cross-step accumulation?
#
# `MicroBatching` (this lesson) splits *one* fit step; `AccumulatingOptimizer`
# (`distgrad.optimizer`, lessons 02-03) accumulates across *k* fit steps and updates on
# every k-th. Both make one update from k micro-batches with one all-reduce.
#
# | | in-step: `MicroBatching` | cross-step: `AccumulatingOptimizer` |
# |---|---|---|
# | one fit step is | one update (`iterations` == steps, as asserted above) | one micro-batch; k steps per update |
# | callbacks, progress bar, `steps_per_epoch` | count updates | count micro-batches |
# | metrics in the history | those of the big batch (asserted above) | those of micro-batches |
# | learning-rate schedules | see updates, unchanged | see the inner optimizer's `iterations` (updates) |
# | data pipeline | yields the **big** batch (the input batch must fit in memory) | yields micro-batches |
# | graph | k is a constant in the traced step; changing it retraces | k is optimizer state |
# | extra memory | one gradient-sized accumulator (a loop variable) | accumulator variables, checkpointed |
# | batch size constraint | batch divisible by k x replicas, last batch included | none per batch |
#
# Choose in-step when you want `fit` to behave exactly as with the big batch and only the
# activations do not fit. Choose cross-step when even the input batch does not fit, or when
# the pipeline already produces small batches.
#
# ## 7 · The posted "final solution", against Keras 3
#
# `final_solution.audit_final_solution` runs each problem. Where the code is needed to run at all,
# `QuestionFinalSolutionModel` ports it only where Keras 3 forces it (public imports,
# `scale_loss`, `super()`), keeping its logic.

# %%
audit = final_solution.audit_final_solution(strategy)
print("1. super(self).fit:           ", audit.super_self_error)
for module, error in audit.import_errors.items():
    print("2. import", module, "->", error.type)
print("   Keras 3 LossScaleOptimizer isinstance of tensorflow.python.keras's:", audit.legacy_isinstance)
print("3. private optimizer APIs present:", audit.attributes_present)
print("   apply_gradients(..., experimental_aggregate_gradients=False):", audit.aggregate_flag_error.type)
print("   Keras 3 apply_gradients clips by itself:", audit.apply_clips_itself)
print("4. fit(grad_accum_steps=1), one batch, one epoch -> optimizer steps:", audit.iterations_with_k1)
print(f"5. reported 'loss' {audit.reported_loss:.6f}, mean prediction {audit.mean_prediction:.6f}, "
      f"real loss {audit.true_loss:.6f}")
print(f"6. replicas read in fit: {audit.replicas_seen_in_fit}, model's: {audit.replicas_of_model}, "
      f"update / correct update: {audit.two_replica_update_ratio:.6f}")
assert audit.super_self_error.contains("super() argument 1 must be a type")
assert all(e.type == "ModuleNotFoundError" for e in audit.import_errors.values())
assert not any(audit.attributes_present.values()) and not audit.legacy_isinstance
assert audit.aggregate_flag_error.contains("experimental_aggregate_gradients")
assert audit.apply_clips_itself
assert audit.iterations_with_k1 == 2
assert abs(audit.reported_loss - audit.mean_prediction) < 1e-6 * abs(audit.mean_prediction) + 1e-6
assert abs(audit.two_replica_update_ratio - 1 / audit.replicas_of_model) < 1e-6

# %% [markdown]
# The bugs, and their fixes:
#
# 1. **`super(self).fit`**: `super()` needs a class; use `super().fit` (TypeError above).
# 2. **Private imports** `tensorflow.python.keras.mixed_precision.experimental` and
#    `tensorflow.python.distribute.distribution_strategy_context` no longer exist
#    (`tensorflow.python.util.nest` survives but is private: use `tf.nest`/`keras.tree`).
#    The `tensorflow.python.keras` package that still ships is TF's frozen Keras 2 copy: its
#    `LossScaleOptimizer` is not `keras.optimizers.LossScaleOptimizer`, so the posted
#    `isinstance` check would skip loss scaling without an error.
# 3. **Private optimizer APIs**: `_HAS_AGGREGATE_GRAD`, `_aggregate_gradients`,
#    `get_scaled_loss`, `get_unscaled_gradients`, `experimental_aggregate_gradients` are
#    gone. In Keras 3 `apply_gradients` always all-reduces, unscales (`LossScaleOptimizer`)
#    and clips by itself; `optimizer.scale_loss(loss)` is the public way to scale.
# 4. **Missing `return`** after `super().fit(...)` in the `grad_accum_steps == 1` branch:
#    `fit` trains twice (two optimizer steps for one batch, above).
# 5. **`compiled_loss` / `compiled_metrics`** are deprecated shims in Keras 3:
#    `compiled_metrics.update_state` feeds `y_pred` to every `Mean` metric, the loss tracker
#    included, so the history's "loss" is the mean prediction (above). Use
#    `compute_loss` and `compute_metrics`, and update the loss tracker yourself.
# 6. **The replica count** comes from `get_strategy()` inside `fit`, which runs outside
#    `strategy.scope()` and sees the default strategy (1 replica). The loop then runs to
#    the *global* batch size over a per-replica batch: the extra slices are empty and the
#    update is 1/R of the right one (above). Use `self.distribute_strategy`, or better,
#    compute everything from the batch actually received (`tf.shape(x)[0]`), as
#    `MicroBatching` does.
# 7. **Ragged batches**: `step` is fixed from the `batch_size` argument, not from the batch
#    received, so a smaller last batch is split into slices that are weighted 1/k whatever
#    their size; `MicroBatching` raises instead (section 4).
# 8. **Swapping `self.train_step` on the instance** inside `fit`, with no `try/finally`,
#    leaves the swap in place if `fit` raises. Overriding `train_step` in a class, with `k`
#    an attribute whose setter drops the traced function, needs no swap.
#
# **The corrected code, running**: the question's setup (softmax classifier, sparse
# categorical cross-entropy, an accuracy metric, `fit` with a large batch) with
# `MicroBatchingModel`, on the lesson's strategy, against plain Keras on one device.

# %%
from distgrad.lab.data import classifier_model

labels = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")  # 3 classes


def fit_classifier(on, micro_batches=None):
    with on.scope():
        model = classifier_model(micro_batches)
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(), metrics=["acc"])
    history = model.fit(x, labels, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0)
    return model, history.history


fixed, fixed_history = fit_classifier(strategy, micro_batches=K)
reference, reference_history = fit_classifier(one_device)
print(f"MicroBatchingModel, {R} replicas x {K}:", fixed_history)
print("plain Keras, 1 device, big batch:", reference_history)
print(check_close(weights_of(fixed), weights_of(reference)))
assert same_history(fixed_history, reference_history)

# %% [markdown]
# ## Takeaways
#
# * `g += _g` on a tensor rebinds a name; it never updates a list. Inside `tf.while_loop`
#   only returned loop variables (or `Variable.assign_add`) carry values across iterations.
# * A micro-batching `train_step` is exactly a big-batch step when each slice's loss is
#   divided by k *on top of* Keras' own mean and 1/R scaling, and it needs no `tf.cond`:
#   loop, sum, apply once, one all-reduce.
# * Pass each slice's loss through `optimizer.scale_loss`, and the summed scaled gradients
#   to `apply_gradients` once: the `LossScaleOptimizer` then decides, unscales, and halves
#   its scale once per step.
# * Split the batch you *receive* (`tf.shape(x)[0]`), not the `batch_size` you were given,
#   and reject batches that don't split.
# * It saves activation memory, not time; the input batch must still fit.
#
# ## Further reading
#
# * Keras, *Customizing what happens in `fit()` with TensorFlow* (keras.io guide) and the
#   installed `keras/src/backend/tensorflow/trainer.py` (`train_step`, `_make_function`).
# * `keras/src/losses/loss.py` (`scale_loss_for_distribution`) and
#   `keras/src/optimizers/loss_scale_optimizer.py` (`_tf_apply`; introduced by
#   keras-team/keras#18691 for keras-team/keras#18666).
# * tensorflow/tensorflow#47578 and keras-team/keras#16633: gradient accumulation in
#   `fit`; keras-team/keras#17429: why a `tf.cond` around `apply_gradients` in `train_step`
#   fails under `MirroredStrategy` (`merge_call`).
# * keras-team/keras#19308: Keras 3 always sums gradients inside the optimizer.
