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
# **The question** ([Q3](../questions.md#q3), TF 2.5, tensorflow/tensorflow#50454). A patched
# `optimizer.apply_gradients` adds the gradients into variables and calls the original inside
# `tf.cond(step % n == 0, ...)`: under a strategy, `RuntimeError: merge_call called while
# defining a new graph or a tf.function`. The workaround calls the original every step with
# `accumulated * mask` (1 every n-th step, else 0). It runs. Is it accumulation?
#
# **Short answer.** Code inside `strategy.run`, where `model.fit` calls `apply_gradients`,
# runs in *replica context*: once per replica, each in its own thread under
# `MirroredStrategy`. A `merge_call` pauses the replicas and runs one function for all of
# them, in *cross-replica context*. `apply_gradients` holds such sync points, and
# `MirroredStrategy` cannot run one from a `tf.cond` branch traced in replica context. The
# fix takes the cond in cross-replica context: `merge_call`, the cond, then
# `call_for_each_replica` to apply on every replica. `distgrad.AccumulatingOptimizer`
# packages it for `model.fit`. The mask is no accumulation: the optimizer still steps on
# every micro-batch, with a zero gradient, which only plain SGD ignores.

# %%
import tensorflow as tf

import distgrad_course

strategy = distgrad_course.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
assert R >= 2, "this lesson is about several replicas: set DISTGRAD_REPLICAS >= 2"
tf.get_logger().setLevel("ERROR")  # no INFO lines; the cells below retrace on purpose

from distgrad_course.lab.display import show_code, show_environment, show_table, statements

show_environment(distgrad_course.environment_report(strategy))

# %% [markdown]
# ## 1 · The fix
#
# Wrap the optimizer, keep `model.fit`. The cell runs as it is in a new file; the next
# checks it against one big-batch step per update on one device.

# %% tags=["fix"]
import keras
import numpy as np
import tensorflow as tf

import distgrad  # the packaged form: `pip install .` in a clone of this repository (not on PyPI)

# Two or more replicas: your GPUs, or two logical CPUs on a machine without GPUs.
cpu = tf.config.list_physical_devices("CPU")[0]
if (not tf.config.list_physical_devices("GPU")
        and not tf.config.get_logical_device_configuration(cpu)):
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.experimental.enable_tensor_float_32_execution(False)  # exact float32 for the check
strategy = tf.distribute.MirroredStrategy(
    tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU"))

K, EPOCHS = 4, 2  # k micro-batches per update
BATCH = 4 * strategy.num_replicas_in_sync  # a micro-batch: 4 examples on each replica
x = np.random.default_rng(0).normal(size=(10 * BATCH, 3)).astype("float32")  # 10 micro-batches
y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)  # no shuffle: the check replays

with strategy.scope():  # the model, the inner optimizer and the wrapper: all in this scope
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    optimizer = distgrad.AccumulatingOptimizer(keras.optimizers.Adam(0.01), accumulation_steps=K)
    model.compile(optimizer=optimizer, loss="mse")  # Keras' mean loss: the wrapper applies the mean
initial = model.get_weights()
# Nested inputs/outputs: fit handles them (the optimizer only ever sees the gradients).

# 10 micro-batches an epoch, k = 4: each epoch ends with a cycle left open. It carries over: the
# next epoch's first micro-batches complete it (distgrad.AccumulationCallback("flush") would apply
# it at the epoch's end, "discard" drop it). 2 epochs = 20 micro-batches = 5 updates, none open.
report = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: print(
    f"epoch {epoch + 1}: {int(optimizer.iterations.numpy())} updates, "
    f"{int(optimizer.micro_steps.numpy())} micro-batch(es) of an open cycle"))
history = model.fit(dataset, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[report])

# %% tags=["check"]
# One device, no accumulation: one Adam step per big batch of K micro-batches, in the same order.
big = keras.models.clone_model(model)
big.set_weights(initial)
big.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=False)  # as fit above
big.fit(np.tile(x, (EPOCHS, 1)), np.tile(y, (EPOCHS, 1)), batch_size=K * BATCH, shuffle=False,
        verbose=0)
assert int(optimizer.iterations.numpy()) == int(big.optimizer.iterations.numpy()) == 5
for accumulated, big_batch in zip(model.get_weights(), big.get_weights()):
    np.testing.assert_allclose(accumulated, big_batch, rtol=1e-6, atol=1e-6)
print(f"{strategy.num_replicas_in_sync} replicas, k = {K}: equal to one big-batch step per update")

# %% [markdown]
# The third update straddles the two epochs; the check replays the same stream, so it
# covers it. Under `mixed_float16`, compile
# `distgrad.AllReplicasFiniteLossScaleOptimizer(distgrad.AccumulatingOptimizer(inner, k))`:
# on several replicas Keras' own `LossScaleOptimizer` around it is refused with an error
# naming that call ([lesson 04](04_loss_scale_optimizer_pitfall.ipynb#1-the-fix)).

# %% [markdown]
# ## 2 · Why it works
#
# <div class="diagram" data-diagram="contexts">
#
# [Replica context and cross-replica context](../call-path.md#contexts)
#
# </div>
#
# `MirroredStrategy` traces the replica function once per device, each in its own thread,
# into one graph. A `merge_call` pauses the replica threads and runs its function once, in
# the main thread, on that graph. A `tf.cond` branch is a graph of its own, so
# `_MirroredReplicaContext._merge_call` refuses a `merge_call` from inside it. The
# question's patch calls the original `apply_gradients`, whose all-reduce and update are
# `merge_call`s, from such a branch. `cond_merge_call.reproduce(strategy, Patch)` installs
# a patch as the question does and trains a tiny model with SGD in a custom loop
# (`None`: no strategy).

# %% [markdown]
# ### Deep dive · The question's patch as posted, and its two Python bugs
#
# First the lab's helpers and the sizes the page uses from here on (k = `STEPS`
# micro-batches of B = `MICRO_BATCH` examples per update, n = `UPDATES` updates), then the
# question's patch with `tf.cond` ("the happy path"), exactly as posted.

# %%
from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.compare import OPTIMIZERS, check_close, weight_diff
from distgrad_course.lab.data import regression_data
from distgrad_course.lab.recipes import fit_run
from distgrad_course.pitfalls import cond_merge_call

R = strategy.num_replicas_in_sync  # the fix cell's strategy, used from here on
STEPS, MICRO_BATCH, UPDATES = 4, 2 * R, 3  # k micro-batches of B per update, n updates

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
# `get_patched_optimizer` swaps the bound method on the optimizer instance;
# `cond_merge_call.reproduce` installs a patch class the same way, after the model and
# optimizer are built, under the strategy scope. As posted, it fails before any
# distribution question arises:

# %%
import importlib.util
import inspect
import pathlib

from distgrad_course.lab.data import tiny_model


def error_line(error, width=96):
    """The last line of a captured error's message, without the type, cut to `width`."""
    line = error.message.strip().splitlines()[-1].strip().removeprefix(f"{error.type}: ")
    return line if len(line) <= width else line[:width - 3] + "..."


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
# Fix 2: read it once into a list. `CallsFixedCondPatch` is the question's patch with both
# Python bugs fixed, and nothing else changed.

# %%
class CallsFixedCondPatch(StarredPatch):
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        super().apply_gradients(list(grads_and_vars), *args, **kwargs)  # fix 2


# %% [markdown]
# ### The sync point in the branch
#
# With its two Python bugs fixed (`CallsFixedCondPatch`, deep dive above), the question's
# patch trains without a strategy, where `apply_gradients` has no `merge_call`, and raises
# the question's error under `MirroredStrategy`:

# %%
plain = cond_merge_call.reproduce(None, CallsFixedCondPatch)
record = cond_merge_call.reproduce(strategy, CallsFixedCondPatch)
print(f"no strategy: {plain.updates} updates, max |Δw| {plain.weight_change:.3f}")
print(f"{R} replicas: {record.error.type}: {cond_merge_call.MERGE_CALL_ERROR} ...")
assert plain.error is None and plain.updates == plain.micro_steps // 2
assert plain.weight_change > 1e-3
assert plain.supports_no_merge_call and record.supports_no_merge_call is False
assert record.error.type == "RuntimeError"
assert record.error.contains(cond_merge_call.MERGE_CALL_ERROR)
assert record.error.contains("control flow statement which contains a synchronization point")

# %% [markdown]
# ### Deep dive · Keras 3's built-in `gradient_accumulation_steps` hits the same wall
#
# `keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)` in `model.fit` under
# `MirroredStrategy` (keras-team/keras#20582, open). On the version matrix's nightly cell
# (keras-nightly) the same `RuntimeError` comes without Keras' `Cond.call()` wrapper
# around its message ([upstream status](../upstream.md#status)):

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

# %% [markdown]
# ### Deep dive · TensorFlow internals: the refusal, the exception, and Keras' working shape
#
# **Where the sync points are.** The built-in's branch is an `ops.cond` whose true branch
# calls `_backend_update_step`; in the TensorFlow backend that function all-reduces the
# gradients and then `maybe_merge_call`s into `_distributed_tf_update_step` (lesson 01).

# %%
from IPython.display import Code, display
from keras.src.optimizers import base_optimizer, loss_scale_optimizer
from tensorflow.python.distribute import mirrored_run, mirrored_strategy, values


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


show_source(base_optimizer.BaseOptimizer._backend_apply_gradients,
            "self._backend_update_step(", "ops.cond(")

# %% [markdown]
# **The refusal.** `_MirroredReplicaContext._merge_call` checks that the graph the replica
# thread is tracing into is the main thread's; a `tf.cond` branch is not:

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
# **Replica-local accumulators.** The question's accumulators, `tf.Variable`s created
# under the strategy scope, are `MirroredVariable`s with aggregation `NONE`, and a
# replica-context write to such a variable updates the local copy only: the minimal fix
# below adds each replica's gradients without communication.

# %%
with strategy.scope():
    probe = tf.Variable(0.0)
print(type(probe).__name__, probe.aggregation)
assert type(probe).__name__ == "MirroredVariable"
assert probe.aggregation == tf.VariableAggregation.NONE
show_source(values._on_write_update_replica,
            "if var.aggregation == vs.VariableAggregation.NONE:", context=1)


# %% [markdown]
# ### The minimal fix: the same cond, in cross-replica context
#
# Keep everything, move the cond. Each replica adds its gradients to its own accumulators,
# without communication, then calls `merge_call` once. The merge function counts, conds,
# and in the taken branch calls the original on every replica with
# `call_for_each_replica`, as Keras' `LossScaleOptimizer` does.

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
# Like the question's, it applies the **sum** of k gradients: in a custom loop whose loss
# is divided by the update's global batch (k × B), the big batch's mean gradient. Against
# `fit` on one device with batches of k × B:

# %%
x, y = regression_data(MICRO_BATCH * STEPS * UPDATES)
references = {name: fit_run(None, make, x, y, STEPS * MICRO_BATCH)  # one device, k × B
              for name, make in OPTIMIZERS.items()}
for name, make in OPTIMIZERS.items():
    r = cond_merge_call.patched_run(strategy, CrossReplicaCondPatch, make, x, y, MICRO_BATCH,
                                    STEPS, loss_batch=STEPS * MICRO_BATCH)
    diff = check_close(r.final, references[name].final, what=name)  # rtol = atol = 1e-6
    print(f"{name:8} {r.updates} updates, vs big batch {diff.max_abs:.1e}; all-reduces: "
          f"{r.placement.every_call} on every call, {r.placement.conditional} in the cond")
    assert r.error is None and r.updates == references[name].updates == UPDATES
    assert (r.placement.every_call, r.placement.conditional) == (0, 1)

# %% [markdown]
# One all-reduce per update, in the branch. In `model.fit`, whose loss is each
# micro-batch's mean, the sum is k times too large (deep dive below): `AccumulatingOptimizer`
# divides by k. The mask workaround runs, but the optimizer steps on every micro-batch:
# plain SGD matches the big batch; momentum, Adam and AdamW end over 1e-3 away after 3
# updates (deep dive after the Limits).

# %% [markdown]
# ### Deep dive · The minimal fix in `model.fit`: a sum, not a mean
#
# With SGD the sum equals a big batch at k times the learning rate; with momentum it is
# not the big batch at all.

# %%
from distgrad_course.lab.compare import check_not_close

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
# ## 3 · The packaged form: `AccumulatingOptimizer`
#
# `distgrad.AccumulatingOptimizer(inner_optimizer, accumulation_steps)` is the minimal fix
# as a Keras 3 optimizer, no patch. It adds each replica's gradients to float32
# replica-local accumulators, then `merge_call`s into `_cross_replica_step`, which counts,
# conds, and on every replica hands the sums divided by k to the inner optimizer, so
# `fit`'s mean loss needs no change. `iterations` counts updates; `global_clipnorm` clips
# the all-reduced mean (deep dives below).

# %%
show_code(AccumulatingOptimizer._cross_replica_step)

# %% [markdown]
# <div class="admonition warning">
# <p class="admonition-title">Limits</p>
#
# The §1 check holds for a deterministic model and whole micro-batches. What breaks
# equivalence with the big batch:
#
# * **BatchNorm** normalizes each replica's share of each micro-batch with its own
#   statistics ([lesson 07](07_beyond_the_basics.ipynb),
#   [pitfalls](../pitfalls.md#batchnorm-statistics)).
# * **Dropout** draws other masks than the big batch
#   ([`keras.layers.Dropout`](https://keras.io/api/layers/regularization_layers/dropout/)):
#   equal in expectation only.
# * **A partial last batch**: its mean counts as much as a full micro-batch's
#   ([pitfalls](../pitfalls.md#mean-of-means); across replicas,
#   [pitfalls](../pitfalls.md#last-batch-scaling)). Use whole micro-batches, or
#   `batch(..., drop_remainder=True)`.
# * **`steps_per_execution > 1`** and **`jit_compile=True`** on several replicas:
#   `AccumulatingOptimizer` raises a `ValueError` naming the fix at the first step (deep
#   dive below); stock Keras fails there too
#   ([upstream](../upstream.md#steps-per-execution), keras-team/keras#19005).
#
# </div>

# %% [markdown]
# ### Deep dive · `_apply_accumulated`, `model.fit` and a custom loop
#
# On the taken branch every replica runs `_apply_accumulated`: it divides the sums by the
# cycle's micro-step count, k, and hands them to `apply_to_inner` (in the same file), which clips
# if the inner optimizer was configured to and calls the inner optimizer, whose SUM
# all-reduce is the only gradient communication of the cycle:

# %%
from distgrad import optimizer as optimizer_file

show_code(AccumulatingOptimizer._apply_accumulated)
show_code(optimizer_file.apply_to_inner)

# %% [markdown]
# In `model.fit` on R replicas, and in a custom loop, against one-device big-batch `fit`:

# %%
from distgrad_course.lab.recipes import custom_loop_run

adam = OPTIMIZERS["adam"]
packaged_fit = fit_run(strategy, lambda: AccumulatingOptimizer(adam(), STEPS), x, y, MICRO_BATCH)
loop = custom_loop_run(strategy, lambda: AccumulatingOptimizer(adam(), STEPS), x, y, MICRO_BATCH)
show_table(["Adam, accumulated", "max abs diff vs big batch", "updates", "micro-steps"], [
    (name, f"{check_close(run.final, references['adam'].final).max_abs:.1e}", run.updates,
     run.total_micro_steps)
    for name, run in (("`model.fit`", packaged_fit), ("custom loop", loop))])
for run in (packaged_fit, loop):
    assert (run.updates, run.total_micro_steps) == (UPDATES, UPDATES * STEPS)
    assert {a.dtype for a in run.optimizer.accumulators} == {"float32"}

# %% [markdown]
# ### Deep dive · Clipping the all-reduced mean
#
# Clipping must act on the summed update. The wrapper takes the inner optimizer's
# `global_clipnorm` and clips the all-reduced mean (Keras would clip each replica's
# partial gradient: lesson 01), paying one extra all-reduce per update:

# %%
from distgrad_course.lab.graph import fit_step_placement


def clipped():
    return keras.optimizers.SGD(0.1, global_clipnorm=0.05)


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
# ### Deep dive · What fails at the first step: `steps_per_execution > 1`, `jit_compile=True`
#
# On several replicas stock Keras cannot run a `steps_per_execution > 1` step, nor a
# `jit_compile=True` step on CPU replicas, and fails with an error that names no cause; on
# GPUs XLA cannot raise on a NaN cycle, which the default `non_finite="raise"` asks for.
# The wrapper checks while the step is traced, so `fit` fails before a weight moves:

# %%
from distgrad_course.lab.data import tiny_model

refused = {}
for flag, fix in (("steps_per_execution", "steps_per_execution=1"),
                  ("jit_compile", "jit_compile=False")):
    with strategy.scope():
        flagged = tiny_model()
        flagged.compile(optimizer=AccumulatingOptimizer(adam(), STEPS), loss="mse",
                        **{flag: 2 if flag == "steps_per_execution" else True})
    before = flagged.get_weights()
    try:
        flagged.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    except ValueError as error:
        refused[flag] = str(error)
    assert fix in refused.get(flag, ""), f"{flag}: {refused.get(flag)}"
    assert all(np.array_equal(a, b) for a, b in zip(flagged.get_weights(), before))  # nothing ran
    print(f"{flag}: ValueError at the first step, naming {fix}")

# %% [markdown]
# ## Deep dive · The question's workaround: the mask trick, measured
#
# The question's second version drops the `tf.cond` and always calls the original with
# `accu_gradients * apply`. `mask_trick.QuestionMaskPatch` is it as posted, plus a call
# counter:

# %%
import matplotlib.pyplot as plt

from distgrad_course.pitfalls import mask_trick

show_code(mask_trick.QuestionMaskPatch)

# %% [markdown]
# The question changes only `apply_gradients`; the rest is the class of §2's first deep
# dive, statement for statement (`statements` compares the code, not its line breaks,
# comments or docstring):

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
show_table(["zero-gradient step", "weights moved", "vs the update rule",
            "moments vs beta · moments", "iterations"], [
    (name, f"{p.weight_change_max_abs:.3e}", f"{p.vs_prediction.max_abs:.1e}",
     "" if p.moments_vs_decay is None else f"{p.moments_vs_decay.max_abs:.1e}",
     f"{p.iterations_before} → {p.iterations_after}") for name, p in probes.items()])
for p in probes.values():
    assert p.vs_prediction.within() and (p.iterations_before, p.iterations_after) == (1, 2)
assert adam_like == ["adam", "adamw"]
assert all(probes[name].moments_vs_decay.within() for name in adam_like)
assert probes["sgd"].weight_change_max_abs == 0.0
assert all(probes[n].weight_change_max_abs > 1e-3
           for n in ("momentum", "adam", "adamw", "sgd+weight_decay"))

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
# ## Deep dive · The question's own stack: tf-keras `model.fit`
#
# The question's author wrote Keras 2 (`tf.keras`, TF 2.5), and many users still train
# on it: TensorFlow 2.15, whose own `tf.keras` is Keras 2 (the version matrix's
# [tf2.15 cell](../versions.md#keras-2) runs this class there; no cell runs older
# releases: [what a TF 2.5 user can do](../versions.md#keras-2)), or the `tf-keras`
# package behind `tf.keras` when
# `TF_USE_LEGACY_KERAS=1` is set before TensorFlow is imported. For them the packaged fix
# is `distgrad.tf_keras.AccumulatingOptimizer`: §3's cross-replica cond for
# tf-keras' optimizers, `tf.keras.optimizers.*` and the era's
# `tf.keras.optimizers.legacy.*`. Its `_cross_replica_step` (the file cannot be imported
# in this Keras 3 process, so we read it):

# %%
import tempfile

from distgrad_course.lab.tf_keras_runner import run_tf_keras

tf_keras_source_path = pathlib.Path(
    importlib.util.find_spec("distgrad").submodule_search_locations[0], "tf_keras", "optimizer.py")
tf_keras_source = tf_keras_source_path.read_text()
start = tf_keras_source.index("    def _cross_replica_step(")
display(Code(tf_keras_source[start:tf_keras_source.index("    def _apply_accumulated", start)],
             language="python"))

# %% [markdown]
# The shape is §3's: count once in cross-replica context, cond there, and
# `call_for_each_replica` into the branch, where the inner optimizer's `apply_gradients`
# all-reduces the cycle's mean. One difference: clipping stays on the inner optimizer,
# because tf-keras' `apply_gradients` sums over replicas *before* it clips (unlike
# Keras 3: lesson 01), as the installed source shows:

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
# `distgrad_course.pitfalls.tf_keras_loss_scale.QuestionModel`, shown in lesson 04, here in
# float32 — with k micro-batches on R replicas and with one big batch on one device, for
# each optimizer of `distgrad_course.lab.tf_keras_fit.OPTIMIZERS`. It is written to a file and run
# in a child process (`run_tf_keras` sets `TF_USE_LEGACY_KERAS=1` before TensorFlow starts):

# %%
program_folder = tempfile.mkdtemp(prefix="lesson03-tf-keras-")

# %%
# %%writefile {program_folder}/question_fit.py
import numpy as np
import tensorflow as tf  # tf-keras here: run_tf_keras set TF_USE_LEGACY_KERAS=1 before

from distgrad.tf_keras import AccumulatingOptimizer
from distgrad_course.lab.tf_keras_fit import OPTIMIZERS, weights
from distgrad_course.lab.tf_keras_runner import tf_keras_strategy
from distgrad_course.pitfalls.tf_keras_loss_scale import QuestionModel  # the question's train_step


def fit_both_ways(replicas, x, y, micro_batch, n):
    strategy = tf_keras_strategy(replicas)  # first: the logical devices
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
question_fit = run_tf_keras("question_fit:fit_both_ways", R, env={"PYTHONPATH": program_folder},
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
# goes *around* it: [lesson 04](04_loss_scale_optimizer_pitfall.ipynb).

# %% [markdown]
# ## Takeaways
#
# * `apply_gradients` holds sync points (`merge_call`s): under `MirroredStrategy` none may
#   sit in a `tf.cond` traced in replica context. Keras 3's `gradient_accumulation_steps`
#   hits the same wall in `model.fit` (keras-team/keras#20582).
# * The fix takes the cond in cross-replica context: `merge_call`, cond,
#   `call_for_each_replica`. One all-reduce per update.
# * In `model.fit`, wrap the optimizer: `distgrad.AccumulatingOptimizer(inner, k)` equals
#   one big-batch step per update; an epoch's open cycle carries over. Under
#   `mixed_float16`, wrap that in `distgrad.AllReplicasFiniteLossScaleOptimizer`.
# * The 0/1 mask steps the optimizer every micro-batch: only plain SGD survives it.
#
# ## Exercises
#
# ### Exercise 1 · Make the minimal fix average
#
# In a subclass of `CrossReplicaCondPatch`, override
# `apply_accu_gradients(self, trainable_variables, args, kwargs)` to pass
# `[g / tf.cast(self.n, g.dtype) for g in self.accu_gradients]` to the original. Train it
# with momentum in `model.fit`:
# `cond_merge_call.patched_run(strategy, YourPatch, OPTIMIZERS["momentum"], x, y,
# MICRO_BATCH, STEPS, fit=True)`. Is it now within 1e-6 of `references["momentum"]`?

# %% [markdown]
# #### Answer
#
# Yes: Keras' loss is each micro-batch's mean, so the mean of k of them is the big batch's
# mean gradient, and the update rule then sees the big batch's gradient once per update.

# %%
class MeanPatch(CrossReplicaCondPatch):
    def apply_accu_gradients(self, trainable_variables, args, kwargs):
        means = [g / tf.cast(self.n, g.dtype) for g in self.accu_gradients]
        self._orig_apply_gradients(zip(means, trainable_variables), *args, **kwargs)
        for accumulator in self.accu_gradients:
            accumulator.assign(tf.zeros_like(accumulator))


averaged = cond_merge_call.patched_run(strategy, MeanPatch, OPTIMIZERS["momentum"], x, y,
                                       MICRO_BATCH, STEPS, fit=True)
diff = check_close(averaged.final, references["momentum"].final)  # rtol = atol = 1e-6
print(f"momentum in fit, mean of k: max abs diff vs big batch {diff.max_abs:.1e}")
assert averaged.updates == UPDATES

# %% [markdown]
# ### Exercise 2 · Move the cond back into replica context
#
# Write a subclass of `CrossReplicaCondPatch` whose `apply_gradients` calls
# `cross_replica_step(tf.distribute.get_strategy())` directly instead of through
# `merge_call`. Predict what `cond_merge_call.reproduce(strategy, YourPatch)` does, then
# run it.

# %% [markdown]
# #### Answer
#
# The question's `RuntimeError`: the cond is traced in replica context again, and the
# original `apply_gradients` in its branch calls `merge_call`.

# %%
class ReplicaCondPatch(CrossReplicaCondPatch):
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        trainable_variables = [var for (_, var) in grads_and_vars]
        for i, (grad, _) in enumerate(grads_and_vars):
            self.accu_gradients[i].assign_add(grad)

        def apply_on_replicas():  # we are on a replica already
            self.apply_accu_gradients(trainable_variables, args, kwargs)

        tf.cond(self._can_apply_on_next_step(), apply_on_replicas, lambda: None)


in_replica = cond_merge_call.reproduce(strategy, ReplicaCondPatch)
print(f"{in_replica.error.type}: {error_line(in_replica.error, width=84)}")
assert in_replica.error.type == "RuntimeError"
assert in_replica.error.contains(cond_merge_call.MERGE_CALL_ERROR)

# %% [markdown]
# ### Exercise 3 · The mask trick with k = 1
#
# Predict whether the mask trick matches the big batch for Adam when k = 1, then check with
# `mask_trick.reproduce(strategy, "adam", steps=1, updates=2, micro_batch=MICRO_BATCH)`.

# %% [markdown]
# #### Answer
#
# It matches: with k = 1 the mask is 1 on every step, no step gets a zero gradient, and
# each micro-batch is the big batch.

# %%
k1 = mask_trick.reproduce(strategy, "adam", steps=1, updates=2, micro_batch=MICRO_BATCH)
print(f"Adam, k = 1: mask trick vs big batch {k1.mask_vs_big_batch.max_abs:.1e}, "
      f"{k1.mask_iterations} iterations")
assert k1.mask_vs_big_batch.within() and k1.mask_iterations == 2

# %% [markdown]
# ### Exercise 4 · The question's mixed-precision order on tf-keras
#
# In the tf-keras deep dive's program, wrap in the question's order instead:
# `AccumulatingOptimizer(tf.keras.mixed_precision.LossScaleOptimizer(optimizer),
# grad_acc_n)`. Rerun the `%%writefile` cell and the next one: what does the constructor
# tell you, and which lesson explains why?

# %% [markdown]
# #### Answer
#
# The constructor raises a `TypeError` before anything runs: wrap the other way round,
# `LossScaleOptimizer(AccumulatingOptimizer(inner, k))`, which `model.compile` builds by
# itself under `mixed_float16`, so that each micro-batch is unscaled and checked before
# it is accumulated. [Lesson 04](04_loss_scale_optimizer_pitfall.ipynb) shows what goes
# wrong in the question's order. The check that raises it:

# %%
checks_source = tf_keras_source_path.read_text()
check_start = checks_source.index("if isinstance(inner_optimizer, keras.mixed_precision.")
check = checks_source[check_start:checks_source.index("if not isinstance", check_start)]
print(check.strip())
assert 'raise TypeError("Wrap the other way round' in check.splitlines()[1]

# %% [markdown]
# ## Further reading
#
# * [lesson 02](02_accumulate_in_custom_loop.ipynb#deep-dive-checkpointing-in-the-middle-of-an-update):
#   saving in the middle of a cycle.
# * keras-team/keras#20582 (the built-in's conditional); keras-team/keras#17429,
#   tensorflow/tensorflow#59487, keras-team/tf-keras#301 (the same RuntimeError);
#   tensorflow/tensorflow#50454 (the question's issue).
# * API: [`ReplicaContext.merge_call`](https://www.tensorflow.org/api_docs/python/tf/distribute/ReplicaContext#merge_call),
#   [`StrategyExtended.call_for_each_replica`](https://www.tensorflow.org/api_docs/python/tf/distribute/StrategyExtended),
#   [`distgrad.AccumulatingOptimizer`](../api.md).
# * Installed source: `keras/src/optimizers/loss_scale_optimizer.py` (`_tf_apply`),
#   `tensorflow/python/distribute/mirrored_run.py` (`_MirroredReplicaContext._merge_call`).
