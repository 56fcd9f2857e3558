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
# **Short answer.** As posted, the patch fails in Keras 3 before any distribution question
# arises: it passes `args, kwargs` to the original as two positional arguments (a
# `TypeError`), and it reads the `grads_and_vars` zip twice, so it accumulates nothing.
# With those two Python bugs fixed it raises the question's `RuntimeError` under
# `MirroredStrategy`: `apply_gradients` contains sync points (`merge_call`s), and
# `MirroredStrategy` cannot run a `merge_call` inside a `tf.cond` traced in replica context.
# Keras 3's own `gradient_accumulation_steps` has the same shape and fails the same way in
# `model.fit` (keras-team/keras#20582). The minimal fix keeps the question's `tf.cond` and
# takes it in **cross-replica** context — `merge_call`, cond, `call_for_each_replica` — the
# shape Keras' `LossScaleOptimizer` uses; `distgrad.optimizer.AccumulatingOptimizer` is
# that fix packaged as an optimizer for `model.fit`. The mask trick is not accumulation:
# the optimizer still updates on every micro-step (with zero gradients), which is harmless
# only for plain SGD.

# %%
import distgrad

strategy = distgrad.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync

from distgrad.lab.display import show_code, show_environment, show_table, statements

show_environment(distgrad.environment_report(strategy))

# %%
import importlib.util
import inspect
import pathlib

import keras
import matplotlib.pyplot as plt
import numpy as np
import tensorflow as tf
from IPython.display import Code, display
from keras.src.optimizers import base_optimizer, loss_scale_optimizer
from tensorflow.python.distribute import mirrored_run, mirrored_strategy, values

from distgrad.lab.compare import OPTIMIZERS, check_close, check_not_close, weight_diff
from distgrad.lab.data import regression_data, tiny_model
from distgrad.lab.graph import fit_step_placement
from distgrad.lab.recipes import custom_loop_run, fit_run
from distgrad.optimizer import AccumulatingOptimizer
from distgrad.pitfalls import cond_merge_call, mask_trick

tf.get_logger().setLevel("ERROR")  # fresh tf.functions on purpose: silence retracing notes
assert R >= 2, "this lesson is about several replicas: set DISTGRAD_REPLICAS >= 2"
STEPS, MICRO_BATCH, UPDATES = 4, 2 * R, 3  # k micro-batches of B per update, n updates
print(f"k = {STEPS} micro-batches of B = {MICRO_BATCH} per update, n = {UPDATES} updates")


def show_source(function, *markers, context=2):
    """Display the lines of `function`'s source around each marker; assert they exist."""
    lines = inspect.getsource(function).splitlines()
    excerpt = []
    for marker in markers:
        hits = [i for i, line in enumerate(lines) if marker in line]
        assert hits, f"{marker!r} not in {function.__qualname__}: the source changed"
        i = hits[0]
        excerpt += lines[max(0, i - context): i + context + 1] + ["    ..."]
    excerpt = [line.split("  # pylint:")[0] for line in excerpt]  # keep lines short
    display(Code("\n".join(excerpt), language="python"))


def error_line(error, width=96):
    """The last line of a captured error's message, without the type, cut to `width`."""
    line = error.message.strip().splitlines()[-1].strip().removeprefix(f"{error.type}: ")
    return line if len(line) <= width else line[:width - 3] + "..."


# %% [markdown]
# ## 1 · The question's code, and what it does
#
# The question's patch with `tf.cond` ("the happy path"), exactly as posted:

# %%
def get_patched_optimizer(optimizer, n, trainable_variables):
    """Patch optimizer for gradient accumulation.

    :param optimizer:
        The optimizer to patch.
    :param n:
        The number of accumulation steps before applying gradients.
    :param trainable_variables:
        Trainable parameters of the model
    :return:
        A patched patched optimizer for gradient accumulation.
    """
    accumulator = _GradientAccumulationPatch(
        n=n,
        orig_apply_gradients=optimizer.apply_gradients,
        trainable_variables=trainable_variables
    )

    # Replace the original function
    optimizer.apply_gradients = accumulator.apply_gradients

    return optimizer


class _GradientAccumulationPatch:

    def __init__(
        self,
        n: int,
        orig_apply_gradients,
        trainable_variables
    ):
        self.n = tf.constant(n, dtype=tf.int64)
        policy = tf.keras.mixed_precision.global_policy()
        self.variable_dtype = policy.variable_dtype
        self.accu_gradients = [
            tf.Variable(
                tf.zeros(g.shape, dtype=g.dtype),
            ) for g in trainable_variables
        ]

        self._current_step = tf.Variable(0, dtype=tf.int64)
        self._orig_apply_gradients = orig_apply_gradients

    def apply_gradients(self, grads_and_vars, *args, **kwargs):

        trainable_variables = [var for (_, var) in grads_and_vars]
        gradients = [grad for (grad, _) in grads_and_vars]

        # Always accumulate gradients
        for i, grad in enumerate(gradients):
            self.accu_gradients[i].assign_add(grad)

        tf.cond(
            self._can_apply_on_next_step(),
            true_fn=lambda: self.apply_accu_gradients(trainable_variables, args, kwargs),
            false_fn=lambda: None
        )

    def apply_accu_gradients(self, trainable_variables, *args, **kwargs):

        # Call the original apply_gradients() function
        self._orig_apply_gradients(zip(self.accu_gradients, trainable_variables), *args, **kwargs)

        # Reset all accumulated gradients to zero
        for i in range(len(self.accu_gradients)):
            self.accu_gradients[i].assign(tf.zeros_like(trainable_variables[i]))

    def _can_apply_on_next_step(self):
        """
        :return: True if gradients should be applied; False otherwise.
        """
        # Increment (always do this first)
        self._current_step.assign_add(1)
        count_mod_steps = tf.math.mod(self._current_step, self.n)
        return tf.equal(count_mod_steps, 0)


# %% [markdown]
# `get_patched_optimizer` swaps the bound method on the optimizer instance.
# `cond_merge_call.reproduce(strategy, patch_class)` installs a patch class the same way
# (after the model and optimizer are built, under the strategy scope) and trains a tiny
# model with `SGD(0.1)` in a `tf.function` custom loop: one `strategy.run(replica_step)`
# per micro-batch, `apply_gradients` inside it (lesson 01's replica step). `None` means
# no strategy.

# %%
sgd = keras.optimizers.SGD(0.1)
assert get_patched_optimizer(sgd, 2, tiny_model().trainable_variables) is sgd
assert type(sgd.apply_gradients.__self__) is _GradientAccumulationPatch

posted = {"no strategy": cond_merge_call.reproduce(None, _GradientAccumulationPatch),
          f"MirroredStrategy, {R} replicas": cond_merge_call.reproduce(
              strategy, _GradientAccumulationPatch)}
show_table(["the posted patch", "error", "message"],
           [(name, f"`{r.error.type}`", error_line(r.error)) for name, r in posted.items()])
for r in posted.values():
    assert r.error.type == "TypeError"
    assert r.error.contains("apply_gradients() takes 2 positional arguments but 4 were given")

# %% [markdown]
# **Bug 1: `args, kwargs`.** `true_fn` calls `apply_accu_gradients(trainable_variables,
# args, kwargs)`: the tuple and the dict become two more positional arguments, which
# `apply_accu_gradients(..., *args, **kwargs)` hands on to the original. Keras 3's
# `apply_gradients(self, grads_and_vars)` takes none. tf-keras' `OptimizerV2`, the
# question's optimizer, has two optional parameters there, so the tuple and the dict land
# in `name` and `experimental_aggregate_gradients` without an error:

# %%
assert list(inspect.signature(keras.optimizers.SGD.apply_gradients).parameters) == [
    "self", "grads_and_vars"]
optimizer_v2 = pathlib.Path(importlib.util.find_spec("tf_keras").submodule_search_locations[0],
                            "src/optimizers/legacy/optimizer_v2.py").read_text()
assert "self, grads_and_vars, name=None, experimental_aggregate_gradients=True" in optimizer_v2


# %% [markdown]
# Fix 1, and nothing else: `apply_accu_gradients` takes the tuple and the dict it is
# handed as the two arguments they are, and unpacks them for the original.

# %%
class StarredPatch(_GradientAccumulationPatch):
    def apply_accu_gradients(self, trainable_variables, args, kwargs):  # fix 1
        super().apply_accu_gradients(trainable_variables, *args, **kwargs)


starred = cond_merge_call.reproduce(None, StarredPatch, n=2, micro_steps=4)
print(f"no strategy: error {starred.error}, updates {starred.updates} "
      f"after {starred.micro_steps} micro-steps, max |Δw| {starred.weight_change}")
assert starred.error is None and starred.updates == 2
assert starred.weight_change == 0.0

# %% [markdown]
# It runs, applies on every second micro-step, and the weights never move. **Bug 2: the
# zip.** Keras' `train_step`, lesson 01's replica step and the question's own `train_step`
# all pass `zip(gradients, variables)`, an iterator: the first list comprehension consumes
# it, `gradients` is empty, nothing is accumulated, and every n-th step applies zeros.

# %%
pairs = zip(["g0", "g1"], ["v0", "v1"])
first, second = [v for (_, v) in pairs], [g for (g, _) in pairs]
print("first read:", first, " second read:", second)
assert first == ["v0", "v1"] and second == []


# %% [markdown]
# Fix 2: read it once into a list.

# %%
class CallsFixedCondPatch(StarredPatch):
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        super().apply_gradients(list(grads_and_vars), *args, **kwargs)  # fix 2


fixed_calls = {"no strategy": cond_merge_call.reproduce(None, CallsFixedCondPatch),
               f"MirroredStrategy, {R} replicas": cond_merge_call.reproduce(
                   strategy, CallsFixedCondPatch)}
show_table(["both Python bugs fixed", "updates", "max abs weight change", "error"], [
    (name, "" if r.error else r.updates, "" if r.error else f"{r.weight_change:.3f}",
     "" if r.error is None else f"`{r.error.type}`")
    for name, r in fixed_calls.items()])
plain, record = fixed_calls.values()
assert plain.error is None and plain.updates == plain.micro_steps // 2 and plain.weight_change > 1e-3
assert plain.supports_no_merge_call and record.supports_no_merge_call is False
assert record.error.type == "RuntimeError"
assert record.error.contains(cond_merge_call.MERGE_CALL_ERROR)
assert record.error.contains("control flow statement which contains a synchronization point")
print("RuntimeError:", cond_merge_call.MERGE_CALL_ERROR, "...")

# %% [markdown]
# Now the question's error. Without a strategy the same code trains: there
# `apply_gradients` has no `merge_call` at all (`strategy_supports_no_merge_call()` is
# true), so nothing crosses threads. (`distgrad.pitfalls.cond_merge_call.CondPatch` is this
# patch reduced to what fails, for the tests and for a fresh process below.)
#
# ## 2 · Keras 3's built-in `gradient_accumulation_steps` hits the same wall
#
# `keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)` in `model.fit` under
# `MirroredStrategy` (keras-team/keras#20582, open):

# %%
builtin = cond_merge_call.reproduce_builtin(strategy, steps=STEPS)
builtin_plain = cond_merge_call.reproduce_builtin(None, steps=STEPS, updates=2)
show_table(["`gradient_accumulation_steps=4` in `fit`", "error", "updates", "vs big batch"], [
    (f"{builtin.strategy}, {builtin.replicas} replicas", f"`{builtin.error.type}`", "", ""),
    ("no strategy", "none", builtin_plain.updates, f"{builtin_plain.vs_big_batch.max_abs:.1e}")])
assert builtin.error.type == "RuntimeError"
assert builtin.error.contains("Exception encountered when calling Cond.call()")
assert builtin.error.contains(cond_merge_call.MERGE_CALL_ERROR)
assert builtin_plain.error is None and builtin_plain.vs_big_batch.within()
assert (builtin_plain.updates, builtin_plain.micro_steps) == (2, 2 * STEPS)
assert (builtin.tensorflow, builtin.keras) == (tf.__version__, keras.__version__)

# %% [markdown]
# Without a strategy the built-in is correct. Keras' own distributed test of it
# (`keras/src/backend/tensorflow/optimizer_distribute_test.py`,
# `test_gradient_accumulation`) calls `strategy.run` eagerly, where `ops.cond` is a Python
# `if`; `model.fit` traces the step, and the cond becomes a graph.
#
# ## 3 · Look inside: why a sync point cannot sit in a replica-context `tf.cond`
#
# <div class="diagram" data-diagram="contexts">
#
# [Replica context and cross-replica context](../call-path.md#contexts)
#
# </div>
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
# all-GPU devices. Keras' `model.fit` does not ask for that by default:
# `jit_compile="auto"` turns XLA off under `tf.distribute`
# (`Trainer._resolve_auto_jit_compile`).

# %%
show_source(mirrored_strategy.MirroredExtended._use_merge_call,
            "return not control_flow_util.GraphOrParentsInXlaContext(", context=3)

# %% [markdown]
# Outside XLA, then, `MultiWorkerMirroredStrategy` is a `merge_call` strategy too. Here is
# the same cond around `apply_gradients` (`cond_merge_call.CondPatch`) under a
# single-worker `MultiWorkerMirroredStrategy`, in a fresh process without `TF_CONFIG` (one
# worker, its local devices):

# %%
multiworker = cond_merge_call.reproduce_under_multiworker()
print(f"MultiWorkerMirroredStrategy, {multiworker.replicas} replica(s); no merge_call: "
      f"{multiworker.supports_no_merge_call} -> {multiworker.error.type}")
# one worker, its local devices: its GPUs, else its CPU
assert multiworker.replicas == max(1, len(tf.config.list_physical_devices("GPU")))
assert multiworker.supports_no_merge_call is False
assert multiworker.error.type == "RuntimeError"
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
# ## 4 · The minimal fix of the question's patch
#
# Keep everything, move the cond. The question's accumulators, `tf.Variable`s created
# under the strategy scope, are `MirroredVariable`s with aggregation `NONE`, and a
# replica-context write to such a variable updates the local copy only:

# %%
with strategy.scope():
    probe = tf.Variable(0.0)
print(type(probe).__name__, probe.aggregation)
assert type(probe).__name__ == "MirroredVariable"
assert probe.aggregation == tf.VariableAggregation.NONE
show_source(values._on_write_update_replica,
            "if var.aggregation == vs.VariableAggregation.NONE:", context=1)


# %% [markdown]
# So each replica adds its gradients to its own copy, without communication, and then
# calls `merge_call` once. The merge function runs once for all replicas, in
# cross-replica context: it counts the step, conds, and in the taken branch calls the
# original `apply_gradients` on every replica with `call_for_each_replica`.

# %%
class CrossReplicaCondPatch(CallsFixedCondPatch):
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        trainable_variables = [var for (_, var) in grads_and_vars]
        for i, (grad, _) in enumerate(grads_and_vars):
            self.accu_gradients[i].assign_add(grad)  # replica-local: no communication

        def cross_replica_step(distribution):  # runs once, for all replicas
            def apply_on_replicas():
                distribution.extended.call_for_each_replica(
                    self.apply_accu_gradients, args=(trainable_variables, args, kwargs))

            tf.cond(self._can_apply_on_next_step(), apply_on_replicas, lambda: None)

        tf.distribute.get_replica_context().merge_call(cross_replica_step)


# %% [markdown]
# Like the question's, it applies the **sum** of the k accumulated gradients. In a custom
# loop whose replicas divide their loss by the global batch of the *update*
# (k × B examples), that sum is the big batch's mean gradient. Compared with `fit` on one
# device, batches of k × B, for SGD, momentum, Adam and AdamW:

# %%
x, y = regression_data(MICRO_BATCH * STEPS * UPDATES)
references = {name: fit_run(None, make, x, y, STEPS * MICRO_BATCH)
              for name, make in OPTIMIZERS.items()}
minimal = {name: cond_merge_call.patched_run(strategy, CrossReplicaCondPatch, make, x, y,
                                             MICRO_BATCH, STEPS, loss_batch=STEPS * MICRO_BATCH)
           for name, make in OPTIMIZERS.items()}
show_table(["optimizer", f"updates after {STEPS * UPDATES} micro-steps",
            "max abs diff vs big batch", "all-reduces per step (every call, in cond)"], [
    (name, r.updates, f"{weight_diff(r.final, references[name].final).max_abs:.1e}",
     f"{r.placement.every_call}, {r.placement.conditional}") for name, r in minimal.items()])
for name, r in minimal.items():
    assert r.error is None and r.updates == references[name].updates == UPDATES
    check_close(r.final, references[name].final, what=name)  # rtol = atol = 1e-6
    assert (r.placement.every_call, r.placement.conditional) == (0, 1)

# %% [markdown]
# One all-reduce per update, inside the branch. In `model.fit` — the question's setting —
# Keras' loss is each micro-batch's mean, so the sum is k times the big batch's mean
# gradient: with SGD it equals a big batch at k times the learning rate, and with momentum
# it is not the big batch at all.

# %%
in_fit = {name: cond_merge_call.patched_run(strategy, CrossReplicaCondPatch, OPTIMIZERS[name],
                                            x, y, MICRO_BATCH, STEPS, fit=True)
          for name in ("sgd", "momentum")}
k_times_lr = fit_run(None, lambda: keras.optimizers.SGD(0.1 * STEPS), x, y, STEPS * MICRO_BATCH)
print("fit, SGD(0.1) vs big batch with SGD(0.1 * k): max abs diff",
      f"{check_close(in_fit['sgd'].final, k_times_lr.final).max_abs:.1e}")
print("fit, momentum vs big batch: max abs diff",
      f"{check_not_close(in_fit['momentum'].final, references['momentum'].final).max_abs:.1e}")
assert in_fit["sgd"].updates == UPDATES
assert (in_fit["sgd"].placement.every_call, in_fit["sgd"].placement.conditional) == (0, 1)

# %% [markdown]
# ## 5 · The packaged form: `AccumulatingOptimizer`
#
# `distgrad.optimizer.AccumulatingOptimizer(inner_optimizer, accumulation_steps)` is the
# same shape as a Keras 3 optimizer: its `apply` adds this replica's gradients to
# replica-local float32 accumulators, then (under `MirroredStrategy`) `merge_call`s into
# `_cross_replica_step`:

# %%
show_code(AccumulatingOptimizer._cross_replica_step)

# %% [markdown]
# On the taken branch every replica runs `_apply_accumulated`: it divides the sums by the
# cycle's micro-step count, k (the mean, so `model.fit`'s loss needs no change), clips if
# the inner optimizer was configured to, and hands the result to the inner optimizer,
# whose SUM all-reduce is the only gradient communication of the cycle:

# %%
show_code(AccumulatingOptimizer._apply_accumulated)

# %% [markdown]
# Unlike the minimal fix, it checks every replica's accumulators before it applies
# (lesson 04 shows why), its accumulators are float32, its counters say what they count
# (`iterations` is the inner optimizer's: updates; `total_micro_steps`: micro-batches), and
# it is an optimizer, not a patch: `model.compile(optimizer=AccumulatingOptimizer(...))`.
# In `model.fit` on R replicas, and in the custom loop, against one-device big-batch `fit`:

# %%
adam = OPTIMIZERS["adam"]
packaged_fit = fit_run(strategy, lambda: AccumulatingOptimizer(adam(), STEPS), x, y, MICRO_BATCH)
loop = custom_loop_run(strategy, lambda: AccumulatingOptimizer(adam(), STEPS), x, y, MICRO_BATCH)
show_table(["Adam, accumulated", "max abs diff vs big batch", "updates", "micro-steps"], [
    (name, f"{check_close(run.final, references['adam'].final).max_abs:.1e}", run.updates,
     run.total_micro_steps) for name, run in (("`model.fit`", packaged_fit), ("custom loop", loop))])
for run in (packaged_fit, loop):
    assert (run.updates, run.total_micro_steps) == (UPDATES, UPDATES * STEPS)
    assert {a.dtype for a in run.optimizer.accumulators} == {"float32"}

# %% [markdown]
# Clipping must act on the summed update. The wrapper takes the inner optimizer's
# `global_clipnorm` and clips the all-reduced mean (lesson 01: Keras would clip each
# replica's partial gradient), paying one extra all-reduce per update:

# %%
clipped = lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05)
clip_reference = fit_run(None, clipped, x, y, MICRO_BATCH * STEPS)
clip_run = fit_run(strategy, lambda: AccumulatingOptimizer(clipped(), STEPS), x, y, MICRO_BATCH)
placement = fit_step_placement(clip_run.model, x, y, MICRO_BATCH)
unclipped_gap = weight_diff(clip_reference.final, references["sgd"].final).max_abs
print("global_clipnorm, vs one-device clipped big batch: max abs diff",
      f"{check_close(clip_run.final, clip_reference.final).max_abs:.1e}")
print(f"  clipping is active: unclipped differs by {unclipped_gap:.3e}")
print(f"  all-reduces per step with clipping: {placement.every_call} on every call, "
      f"{placement.conditional} in the cond branch")
assert not weight_diff(clip_reference.final, references["sgd"].final).within()
assert (placement.every_call, placement.conditional) == (0, 2)

# %% [markdown]
# ## 6 · The question's workaround: the mask trick, measured
#
# The question's second version drops the `tf.cond` and always calls the original with
# `accu_gradients * apply`. `mask_trick.QuestionMaskPatch` is it as posted, plus a call
# counter:

# %%
show_code(mask_trick.QuestionMaskPatch)

# %% [markdown]
# The question changes only `apply_gradients`; the rest is the class of §1, statement for
# statement (`statements` compares the code, not its line breaks, comments or docstring):

# %%
posted_init = statements(_GradientAccumulationPatch.__init__)
mask_init = statements(mask_trick.QuestionMaskPatch.__init__)
assert [s for s in mask_init if "attr='calls'" not in s] == posted_init  # but the counter
assert (statements(mask_trick.QuestionMaskPatch._can_apply_on_next_step)
        == statements(_GradientAccumulationPatch._can_apply_on_next_step))
print(f"__init__: {len(posted_init)} statements as posted, + 1 counter; "
      "_can_apply_on_next_step: as posted")

# %% [markdown]
# `mask_trick.patch_with_mask` installs it and divides the gradients by k, so that, where
# it works, it averages like one big batch. `mask_trick.reproduce` feeds the same n·k
# micro-batches of B through `model.fit` on R replicas with the mask trick and with
# `AccumulatingOptimizer`, and compares both with the big-batch reference:

# %%
records = {name: mask_trick.reproduce(strategy, name, steps=STEPS, updates=UPDATES,
                                      micro_batch=MICRO_BATCH)
           for name in OPTIMIZERS}
show_table(["optimizer", "mask trick vs big batch", "its iterations",
            "AccumulatingOptimizer vs big batch", "its iterations"], [
    (name, f"{r.mask_vs_big_batch.max_abs:.2e}", r.mask_iterations,
     f"{r.accumulating_vs_big_batch.max_abs:.2e}", r.accumulating_iterations)
    for name, r in records.items()])

# %%
assert records["sgd"].mask_vs_big_batch.within()  # plain SGD: the mask trick matches
for name in ("momentum", "adam", "adamw"):
    assert not records[name].mask_vs_big_batch.within()  # drifts
    assert records[name].mask_vs_big_batch.max_abs > 1e-3
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
probes = {name: mask_trick.zero_gradient_step(name) for name in OPTIMIZERS}
probes["sgd+weight_decay"] = mask_trick.zero_gradient_step(
    lambda: keras.optimizers.SGD(0.1, weight_decay=0.1))
adam_like = [name for name, p in probes.items() if p.moments_vs_decay is not None]
show_table(["zero-gradient step", "weights moved", "vs the update rule", "moments vs beta · moments",
            "iterations"], [
    (name, f"{p.weight_change_max_abs:.3e}", f"{p.vs_prediction.max_abs:.1e}",
     "" if p.moments_vs_decay is None else f"{p.moments_vs_decay.max_abs:.1e}",
     f"{p.iterations_before} → {p.iterations_after}") for name, p in probes.items()])
for p in probes.values():
    assert p.vs_prediction.within() and (p.iterations_before, p.iterations_after) == (1, 2)
assert adam_like == ["adam", "adamw"]
assert all(probes[name].moments_vs_decay.within() for name in adam_like)
assert probes["sgd"].weight_change_max_abs == 0.0
assert all(probes[n].weight_change_max_abs > 1e-3 for n in ("momentum", "adam", "adamw", "sgd+weight_decay"))

# %% [markdown]
# And it costs k all-reduces per update instead of one. `fit_step_placement` traces
# `strategy.run(model.train_step)` the way `model.fit` runs it and splits the all-reduces
# into those that run on every call and those inside a `tf.cond` branch:

# %%
r = records["adam"]
show_table(["Adam in `fit`", "all-reduces: every call", "in a cond branch", "per update"], [
    (name, p.every_call, p.conditional, p.per_update(STEPS))
    for name, p in (("mask trick", r.mask_placement),
                    ("AccumulatingOptimizer", r.accumulating_placement))])
assert (r.mask_placement.every_call, r.mask_placement.conditional) == (1, 0)
assert r.mask_placement.per_update(STEPS) == STEPS
assert (r.accumulating_placement.every_call, r.accumulating_placement.conditional) == (0, 1)
assert r.accumulating_placement.per_update(STEPS) == 1

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
# ## 7 · The question's own stack: tf-keras `model.fit`
#
# The question's author wrote Keras 2 (`tf.keras`, TF 2.5), and many users still train
# on it: TensorFlow ≤ 2.15, or the `tf-keras` package behind `tf.keras` when
# `TF_USE_LEGACY_KERAS=1` is set before TensorFlow is imported. For them the packaged fix
# is `distgrad.tf_keras.AccumulatingOptimizer`: section 5's cross-replica cond for
# tf-keras' optimizers, `tf.keras.optimizers.*` and the era's
# `tf.keras.optimizers.legacy.*`. Its `_cross_replica_step` (the file cannot be imported
# in this Keras 3 process, so we read it):

# %%
import tempfile

from distgrad.lab.legacy import run_legacy

tf_keras_source = pathlib.Path(importlib.util.find_spec("distgrad").submodule_search_locations[0],
                               "tf_keras", "optimizer.py").read_text()
start = tf_keras_source.index("    def _cross_replica_step(")
display(Code(tf_keras_source[start:tf_keras_source.index("    def _apply_accumulated", start)],
             language="python"))

# %% [markdown]
# The shape is section 5's: count once in cross-replica context, cond there, and
# `call_for_each_replica` into the branch, where the inner optimizer's `apply_gradients`
# all-reduces the cycle's mean. One difference: clipping stays on the inner optimizer,
# because tf-keras' `apply_gradients` sums over replicas *before* it clips (lesson 01,
# section 5), as the installed source shows:

# %%
tf_keras_src = pathlib.Path(importlib.util.find_spec("tf_keras").submodule_search_locations[0],
                            "src", "optimizers", "optimizer.py").read_text()
summed = tf_keras_src.index("grads_and_vars = self.aggregate_gradients(grads_and_vars)")
assert tf_keras_src.find("return super().apply_gradients(grads_and_vars, name=name)", summed) > 0
assert "grads = self._clip_gradients(grads)" in tf_keras_src  # in the base apply_gradients
print("tf-keras Optimizer.apply_gradients:", tf_keras_src[summed:].splitlines()[0].strip())
print("then super().apply_gradients: grads = self._clip_gradients(grads)")

# %% [markdown]
# In the question's code the fix replaces one line: where the question calls
# `get_patched_optimizer(optimizer, n, ...)`, wrap the optimizer instead, before
# `model.compile`. The program below fits the question's model — its own `train_step`,
# `distgrad.pitfalls.legacy_loss_scale.QuestionModel`, shown in lesson 04, here in
# float32 — with k micro-batches on R replicas and with one big batch on one device, for
# each optimizer of `distgrad.lab.legacy_fit.OPTIMIZERS`. It is written to a file and run
# in a child process (`run_legacy` sets `TF_USE_LEGACY_KERAS=1` before TensorFlow starts):

# %%
program_folder = tempfile.mkdtemp(prefix="lesson03-tf-keras-")

# %%
# %%writefile {program_folder}/question_fit.py
import numpy as np
import tensorflow as tf  # tf-keras here: run_legacy set TF_USE_LEGACY_KERAS=1 before

from distgrad.lab.legacy import legacy_strategy
from distgrad.lab.legacy_fit import OPTIMIZERS, weights
from distgrad.pitfalls.legacy_loss_scale import QuestionModel  # the question's train_step
from distgrad.tf_keras import AccumulatingOptimizer


def fit_both_ways(replicas, x, y, micro_batch, n):
    strategy = legacy_strategy(replicas)  # first: the logical devices
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    one_device = tf.distribute.get_strategy()
    results = {}
    for name, make_optimizer in OPTIMIZERS.items():
        for where, grad_acc_n in ((strategy, n), (one_device, 1)):
            with where.scope():
                model = QuestionModel()
                optimizer = make_optimizer()
                if grad_acc_n > 1:  # was: get_patched_optimizer(optimizer, n, ...)
                    optimizer = AccumulatingOptimizer(optimizer, grad_acc_n)
                model.compile(optimizer=optimizer, loss="mse")
            model.fit(x, y, batch_size=micro_batch * n // grad_acc_n, shuffle=False, verbose=0)
            results[name, grad_acc_n] = weights(model), int(optimizer.iterations.numpy())
    return {name: {"accumulated": results[name, n], "big_batch": results[name, 1]}
            for name in OPTIMIZERS}

# %%
question_fit = run_legacy("question_fit:fit_both_ways", R, env={"PYTHONPATH": program_folder},
                          x=x.tolist(), y=y.tolist(), micro_batch=MICRO_BATCH, n=STEPS)
print(f"TensorFlow {question_fit.tensorflow}, tf-keras {question_fit.tf_keras}, "
      f"{question_fit.replicas} replicas")
tf_keras_rows = []
for name, run in question_fit.value.items():
    (accumulated, updates), (big_batch, big_batch_updates) = run["accumulated"], run["big_batch"]
    diff = check_close(accumulated, big_batch, what=name)  # rtol = atol = 1e-6
    tf_keras_rows.append((f"`{name}`", f"{diff.max_abs:.1e}", updates, big_batch_updates))
    assert updates == big_batch_updates == UPDATES  # iterations counts updates
show_table(["tf-keras inner optimizer", "max abs diff vs big batch", "updates, accumulated",
            "updates, big batch"], tf_keras_rows)
assert question_fit.replicas == R and question_fit.tf_keras.startswith("2.")
assert {name.removeprefix("legacy ") for name in question_fit.value} == {"momentum", "adam"}

# %% [markdown]
# Equal to the big batch at float32 tolerances for today's tf-keras optimizers and the
# question's era's `OptimizerV2`, with `iterations` counting updates, on the versions
# printed above. Under `mixed_float16` — the question's GPU run — the loss-scale wrapper
# goes *around* it: [lesson 04, section 6](04_loss_scale_optimizer_pitfall.ipynb).

# %% [markdown]
# ## Takeaways
#
# * The question's patch, as posted, has two Python bugs that Keras 3 exposes: `args,
#   kwargs` passed as two positional arguments (`TypeError`), and a `zip` read twice
#   (nothing accumulated, zeros applied). Read `grads_and_vars` into a list once; unpack
#   with `*args, **kwargs`.
# * With those fixed, a sync point (`apply_gradients`: all-reduce and mirrored update, both
#   `merge_call`s) inside a `tf.cond` traced in replica context fails under
#   `MirroredStrategy`, and under `MultiWorkerMirroredStrategy` outside XLA. Keras 3's
#   `gradient_accumulation_steps` is such a cond: it works without a strategy and fails in
#   `model.fit` under `MirroredStrategy` (keras-team/keras#20582).
# * The minimal fix keeps the cond and moves it to cross-replica context: `merge_call`,
#   cond, `call_for_each_replica` back to the replicas — as `LossScaleOptimizer` does. One
#   all-reduce per update; it applies the sum, so the loss must be divided by the update's
#   global batch.
# * `AccumulatingOptimizer` packages that as an optimizer: the mean over k micro-batches,
#   `iterations` counting updates, clipping on the all-reduced mean; equal to big-batch
#   training in `model.fit` and in a custom loop.
# * The mask trick runs but is not accumulation: the optimizer updates on every micro-step.
#   Only plain SGD ignores zero gradients; momentum, Adam and weight decay drift,
#   `iterations` counts micro-steps, and every micro-step pays the all-reduce.
# * On the question's own stack, tf-keras, the fix is `distgrad.tf_keras.AccumulatingOptimizer`
#   wrapped where the question installed its patch: equal to big-batch `model.fit` for
#   tf-keras' optimizers and the era's `OptimizerV2`, with the question's `train_step`.
#
# ## Exercises
#
# 1. Make `CrossReplicaCondPatch` average: in a subclass, override
#    `apply_accu_gradients(self, trainable_variables, args, kwargs)` to pass
#    `[g / tf.cast(self.n, g.dtype) for g in self.accu_gradients]`. Then run
#    `weight_diff(cond_merge_call.patched_run(strategy, YourPatch, OPTIMIZERS["momentum"],
#    x, y, MICRO_BATCH, STEPS, fit=True).final, references["momentum"].final)`: is it now
#    within 1e-6 in `model.fit`?
# 2. Move the cond back into replica context: write a subclass whose `apply_gradients`
#    calls `cross_replica_step(tf.distribute.get_strategy())` directly instead of through
#    `merge_call`. Predict the error of `cond_merge_call.reproduce(strategy, YourPatch)`
#    from §3, then print `error_line(...error)`.
# 3. Predict whether the mask trick matches the big batch for Adam when k = 1, then check:
#    `mask_trick.reproduce(strategy, "adam", steps=1, updates=2,
#    micro_batch=MICRO_BATCH).mask_vs_big_batch.within()`.
# 4. In section 7's program, wrap in the question's mixed-precision order instead:
#    `AccumulatingOptimizer(tf.keras.mixed_precision.LossScaleOptimizer(optimizer),
#    grad_acc_n)`. Rerun the `%%writefile` cell and the next one: what does the
#    constructor tell you, and which lesson explains why?
#
# ## Further reading
#
# * Saving in the middle of an accumulation cycle and restoring it:
#   [lesson 02, §8](02_accumulate_in_custom_loop.ipynb).
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
