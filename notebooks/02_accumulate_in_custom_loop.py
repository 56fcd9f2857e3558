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
# **The question** ([asked in Spanish, TF 2.x](../questions.md#q2)). The model outgrew
# the GPUs, and smaller batches made the gradient noisy: can you accumulate gradients over
# several batches under `MirroredStrategy`? Adding up what `strategy.run(train_step)`
# returns and calling `apply_gradients` once fails: TensorFlow says gradients must be
# applied inside `strategy.run` ([the loop, reproduced](#deep-dive-the-questions-loop-reproduced)).
#
# **Short answer.** Yes, with *one* all-reduce per update. Code inside `strategy.run`
# runs once on each device, in **replica context**; the loop around it is in
# **cross-replica context**, where each result is a `PerReplica` value (one tensor per
# device) that `+` cannot add and `apply_gradients` cannot all-reduce. So sum inside
# `strategy.run`, into replica-local buffers (no communication), each loss divided by
# the examples of the whole *update*; every k micro-batches, a second `strategy.run`
# applies the buffers, and the optimizer's all-reduce is the update's one sync.
#
# **The posted answer** fails as posted: `experimental_run_v2` is gone. With `strategy.run`
# in its place, its mirrored accumulators all-reduce every micro-step, and its apply runs
# only outside the scope, right only if each loss is divided by the global micro-batch
# ([measured](#deep-dive-the-posted-answer-as-far-as-it-runs)).

# %%
import tensorflow as tf

import distgrad
import distgrad_course

strategy = distgrad_course.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
assert R >= 2, "this lesson is about several replicas: set DISTGRAD_REPLICAS >= 2"
from distgrad_course.lab.display import show_environment, show_table

tf.get_logger().setLevel("ERROR")  # quiet TensorFlow's INFO lines (strategies, retracing)
show_environment(distgrad_course.environment_report(strategy))

# %% [markdown]
# ## 1 · The fix
#
# Two epochs of 300 examples, 8 per replica per micro-batch, k = 4, over `tf.data`. Each
# epoch's leftover micro-batches make a smaller last update, their losses divided by the
# examples they hold, as one device treats a smaller last batch. It runs pasted into a
# file. The change from the question's loop:
#
# ```diff
# -for b in batches:
# -    per_replica_gradients = strategy.run(fn=self.train_step, args=(model, data))
# -    total_gradient += per_replica_gradients
# -optimizer.apply_gradients(zip(total_gradient, model.trainable_variables))
# +for step, batch in enumerate(dist_dataset):  # sums: ON_READ buffers made under the scope
# +    accumulate(batch, tf.constant(examples))  # strategy.run: each replica adds to its sums
# +    if step % K == K - 1:
# +        apply()  # strategy.run: apply_gradients(sums), the all-reduce; then sums = 0
# ```

# %% tags=["fix"]
import keras
import numpy as np
import tensorflow as tf

# Two or more replicas: your GPUs, or two logical CPUs on a machine without GPUs.
cpu = tf.config.list_physical_devices("CPU")[0]
if not (tf.config.list_physical_devices("GPU") or tf.config.get_logical_device_configuration(cpu)):
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.experimental.enable_tensor_float_32_execution(False)  # exact float32 for the check
devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
strategy = tf.distribute.MirroredStrategy(devices)

N, PER_REPLICA, K, EPOCHS = 300, 8, 4, 2  # examples per epoch, micro-batch per replica, k
MICRO = PER_REPLICA * strategy.num_replicas_in_sync  # one micro-batch, all replicas
UPDATE = K * MICRO  # examples in one full update: the big batch that does not fit
x = np.random.default_rng(0).normal(size=(N, 4)).astype("float32")
y = np.sin(x).sum(axis=1, keepdims=True)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)  # last micro-batch smaller
dist_dataset = strategy.experimental_distribute_dataset(dataset)

def make_model():  # seeded: the check below builds the same initial weights
    init = keras.initializers.GlorotUniform
    return keras.Sequential([keras.Input((4,)),
                             keras.layers.Dense(16, "tanh", kernel_initializer=init(seed=0)),
                             keras.layers.Dense(1, kernel_initializer=init(seed=1))])

with strategy.scope():
    model, optimizer = make_model(), keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)  # its slots now, not inside the traced apply
    sums = [tf.Variable(tf.zeros_like(v), trainable=False,  # one copy per replica
                        synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.SUM) for v in model.trainable_variables]

def add_gradients(batch, examples):  # on each replica; nothing leaves the device
    features, targets = batch  # features may be nested; with several outputs, add their losses
    with tf.GradientTape() as tape:
        per_example = keras.losses.mean_squared_error(targets, model(features, training=True))
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=examples)
    for total, gradient in zip(sums, tape.gradient(loss, model.trainable_variables)):
        total.assign_add(gradient)  # this replica's copy only

def apply_sums():  # on each replica, its own sums: the optimizer's SUM all-reduce adds them
    optimizer.apply_gradients(zip([s.read_value() for s in sums], model.trainable_variables))
    for total in sums:
        total.assign(tf.zeros_like(total))

accumulate = tf.function(lambda batch, examples: strategy.run(add_gradients, (batch, examples)))
apply = tf.function(lambda: strategy.run(apply_sums))
for _epoch in range(EPOCHS):
    for step, batch in enumerate(dist_dataset):
        examples = min(UPDATE, N - step // K * UPDATE)  # in this update: fewer in the last
        accumulate(batch, tf.constant(examples))
        if step % K == K - 1:
            apply()
    if step % K != K - 1:  # the epoch's leftover micro-batches: one smaller update
        apply()

# %% [markdown]
# **The check:** the same epochs on one device, one big batch per update, no strategy.

# %% tags=["check"]
one, one_optimizer = make_model(), keras.optimizers.Adam(0.01)  # one device, no strategy
for _epoch in range(EPOCHS):
    for bx, by in tf.data.Dataset.from_tensor_slices((x, y)).batch(UPDATE):  # last one smaller
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(by, one(bx, training=True)))
        one_optimizer.apply_gradients(zip(tape.gradient(loss, one.trainable_variables),
                                          one.trainable_variables))
for accumulated, big_batch in zip(model.get_weights(), one.get_weights()):
    np.testing.assert_allclose(accumulated, big_batch, rtol=1e-6, atol=1e-6)
print(f"{int(optimizer.iterations.numpy())} updates on {len(devices)} replicas == big batch")

# %% [markdown]
# ## 2 · Why it works
#
# **Where the sum lives.** Created under the scope with `synchronization=ON_READ,
# aggregation=SUM`, a buffer is a `SyncOnReadVariable`: one copy per replica, which
# `assign_add` in replica context changes alone; read in cross-replica context, it is
# the SUM of its copies.
#
# **What the loss is divided by.** The buffers sum over k micro-batches, the
# all-reduce over R replicas. With $B$ the examples of the update,
#
# $$\sum_{j=1}^{k}\sum_{r=1}^{R} \nabla \frac{1}{B}\sum_{i \in (j, r)} \ell_i
#   = \nabla \frac{1}{B}\sum_{i=1}^{B} \ell_i ,$$
#
# the big batch's mean gradient.
#
# **Where the apply runs.** In a second `strategy.run`: each replica passes its sums to
# `optimizer.apply_gradients`, whose SUM all-reduce
# (`TFOptimizer._all_reduce_sum_gradients`) adds them before one update of the mirrored
# weights. Python decides when, so nothing traced branches on the micro-step.
# `optimizer.build` creates Adam's slots before that function is traced
# ([otherwise it fails](#deep-dive-where-optimizer-state-is-created)).
#
# **What the buffers cost.** One float32 copy of the trainable weights on each replica,
# whatever k:

# %%
copies = [copy for total in sums for copy in total.values]  # every replica's copy of each buffer
buffer_bytes, weight_bytes = (sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in vs)
                              for vs in (copies, model.trainable_variables))
print(f"buffers: {buffer_bytes} bytes on {R} replicas; trainable weights: {weight_bytes} bytes")
assert buffer_bytes == R * weight_bytes and {c.dtype for c in copies} == {tf.float32}
assert len({copy.device for copy in copies}) == R  # one copy on each replica's device

# %% [markdown]
# ### Deep dive · The experiments' set-up: the fix as a function
#
# The proofs below need fresh loops for several optimizers, k and loss divisors, on a
# small problem whose big batch is one update: `build_accumulating_loop` is the fix
# cell's model, buffers and two functions, with those as arguments (the model is
# `lab.data.tiny_model`, the loss the fix's). From here on the lesson uses the fix cell's
# `strategy` only: two `MirroredStrategy` objects over the same devices number their
# collectives alike, and must not both run them in one process.

# %%
import tempfile
import textwrap
import types

import matplotlib.pyplot as plt

from distgrad_course.lab.compare import (
    OPTIMIZERS,
    check_close,
    check_not_close,
    update_ratio,
    updates,
    weights_of,
)
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.graph import ALL_REDUCE_OP_TYPES, count_collectives, graph_op_types
from distgrad_course.lab.recipes import big_batch_reference
from distgrad_course.pitfalls import lazy_slot_creation, outside_strategy_run

R = strategy.num_replicas_in_sync  # the fix's strategy (all your GPUs)
EXAMPLES = 8 * R  # the big batch of one update: divisible by k * R for k in 1, 2, 4
x, y = regression_data(EXAMPLES)  # 4 features, 1 output: lab.data.tiny_model's problem
sgd, adam = OPTIMIZERS["sgd"], OPTIMIZERS["adam"]  # SGD(0.1), Adam(0.01)


def full_batch_loss(weights):
    """Mean loss of the model with `weights` on the whole big batch."""
    model = tiny_model()
    model.set_weights(weights)
    return float(tf.reduce_mean(keras.losses.mean_squared_error(y, model(x))))


def build_accumulating_loop(make_optimizer, divide_by, make_model=tiny_model,
                            synchronization=tf.VariableSynchronization.ON_READ):
    """The fix cell's model, optimizer, buffers and its two tf.functions."""
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer()
        optimizer.build(model.trainable_variables)  # optimizer state now, not in a trace
        accumulators = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                    synchronization=synchronization,
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


def train(make_optimizer, k, updates, divide_by=EXAMPLES, apply_every_micro_step=False,
          make_model=tiny_model):
    """`updates` passes over the big batch; weights after each, and the reported losses."""
    loop = build_accumulating_loop(make_optimizer, divide_by, make_model)
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


def draw_timeline(applies, per_micro_batch, per_update):
    """One row per schedule: micro-steps, all-reduces, updates (`applies`: the micro-step
    indices, from 0, after which the loop applies; the last one ends the epoch)."""
    steps = max(max(after) for after in applies.values()) + 1
    fig, axes = plt.subplots(len(applies), 1, figsize=(8, 1.7 * len(applies)), sharex=True)
    micro = np.arange(1, steps + 1)
    for ax, (label, after) in zip(axes, applies.items()):
        apply_at = np.asarray(after) + 1.5
        ax.broken_barh([(m - 0.4, 0.8) for m in micro], (1.6, 0.8), color="#9ecae1")
        reduce_at = np.concatenate([np.repeat(micro, per_micro_batch),
                                    np.repeat(apply_at, per_update)])
        ax.scatter(reduce_at, np.full(len(reduce_at), 1.0), marker="v", s=40, color="#d62728")
        for n, at in enumerate(apply_at, start=1):
            ax.text(at, 0.3, str(n), ha="center", va="center", fontsize=8,
                    bbox={"boxstyle": "circle,pad=0.2", "fc": "white", "ec": "black"})
        ax.set_yticks([2.0, 1.0, 0.3], ["micro-steps\n(all replicas)", "all-reduces", "updates"])
        ax.set_ylim(-0.1, 2.6)
        ax.set_title(f"{label}: {len(reduce_at)} all-reduces, {len(after)} updates",
                     fontsize=10)
    axes[-1].set_xlabel(f"micro-batch of one epoch (k = {K}, each split over R = {R} replicas)")
    plt.tight_layout()
    plt.show()


assert EXAMPLES % (K * R) == 0, "the small problem needs k in 1, 2, 4, 8"
micro_batches = micro_batches_of(x, y, K)  # one update of the small problem, k = 4

# %% [markdown]
# ### k micro-batches on R replicas == one big-batch step
#
# `train(optimizer, k, updates)` runs the fix's loop on a small problem,
# `big_batch_reference` the check's one-device loop. Three optimizers, after 1 and 3
# updates, at float32 tolerances (1e-6):

# %%
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
# ### One all-reduce per update
#
# Counted in the graphs of the fix's two functions: `accumulate` has no all-reduce,
# `apply` one (all gradients packed together). Stepping after every micro-batch would
# pay one per micro-batch, for k times as many updates.

# %%
def all_reduces(function, *args):  # all-reduce ops in the traced graph, per replica
    op_types = graph_op_types(function.get_concrete_function(*args).graph.as_graph_def())
    return sum(n for op, n in op_types.items() if op in ALL_REDUCE_OP_TYPES) // R

per_micro_batch = all_reduces(accumulate, next(iter(dist_dataset)), tf.constant(UPDATE))
per_update = all_reduces(apply)
assert (per_micro_batch, per_update) == (0, 1)
steps = len(dataset)  # micro-batches in one epoch of the fix
applies = [s for s in range(steps) if s % K == K - 1 or s == steps - 1]  # the fix's
draw_timeline({"the fix": applies, "stepping every micro-batch": list(range(steps))},
              per_micro_batch, per_update)

# %% [markdown]
# ## 3 · The packaged form: `GradientAccumulator`
#
# The fix's buffers, plus what real models need (pinned in
# `tests/gradient_accumulator/test_accumulator.py`): a checkpointed micro-step counter,
# float32 buffers for float16 weights, `None` gradients skipped, `tf.IndexedSlices` summed
# densely
# ([what Adam does with them](07_beyond_the_basics.ipynb#deep-dive-sparse-gradients-the-same-gradient-two-adam-updates)),
# errors for misuse. `add` replaces the fix's `assign_add` loop, `make_apply_step(optimizer)`
# its apply:

# %%
with strategy.scope():
    packaged, packaged_optimizer = make_model(), keras.optimizers.Adam(0.01)
    accumulator = distgrad.GradientAccumulator(packaged.trainable_variables)

def add_to_accumulator(batch, examples):  # the fix's add_gradients, with `add`
    features, targets = batch
    with tf.GradientTape() as tape:
        per_example = keras.losses.mean_squared_error(targets, packaged(features, training=True))
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=examples)
    accumulator.add(tape.gradient(loss, packaged.trainable_variables))

add_micro_batch = tf.function(lambda b, n: strategy.run(add_to_accumulator, (b, n)))
apply_step = accumulator.make_apply_step(packaged_optimizer)
for _epoch in range(EPOCHS):
    for step, batch in enumerate(dist_dataset):
        add_micro_batch(batch, tf.constant(min(UPDATE, N - step // K * UPDATE)))
        if step % K == K - 1 or step == steps - 1:  # every k, and at the epoch's end
            assert accumulator.micro_steps == step % K + 1
            apply_step()
same = check_close(weights_of(packaged), weights_of(model))  # the fix's weights
print(f"GradientAccumulator vs the fix, {EPOCHS} epochs: max abs diff {same.max_abs:.1e}")
assert accumulator.micro_steps == 0 and all_reduces(apply_step.function) == 1
assert int(packaged_optimizer.iterations.numpy()) == int(optimizer.iterations.numpy())

# %% [markdown]
# ### Data of unknown size: a constant divisor
#
# With `.repeat()`, or a stream of unknown size, divide every loss by the constant
# `UPDATE` (k × the global micro-batch): each example weighs 1 / `UPDATE`. An incomplete
# last cycle, applied, is an update whose missing micro-batches added zero (to drop it,
# zero the sums). The fix's loop and the check's one device, continued:

# %%
updates_before = int(optimizer.iterations.numpy())
stream = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(MICRO)  # endless, no N
for step, batch in enumerate(strategy.experimental_distribute_dataset(stream.take(3 * K + 2))):
    accumulate(batch, tf.constant(UPDATE))  # the constant divisor
    if step % K == K - 1:
        apply()
apply()  # stopped mid-cycle: 2 of K micro-batches in the sums, applied as sum / UPDATE
for bx, by in stream.take(3 * K + 2).unbatch().batch(UPDATE):  # one device, the same examples
    with tf.GradientTape() as tape:  # each update's loss summed, divided by UPDATE
        loss = tf.reduce_sum(keras.losses.mean_squared_error(by, one(bx, training=True))) / UPDATE
    one_optimizer.apply_gradients(zip(tape.gradient(loss, one.trainable_variables),
                                      one.trainable_variables))
for accumulated, big_batch in zip(model.get_weights(), one.get_weights()):
    np.testing.assert_allclose(accumulated, big_batch, rtol=1e-6, atol=1e-6)
assert int(optimizer.iterations.numpy()) == updates_before + 4  # 3 full updates + 1 partial

# %% [markdown]
# <div class="admonition warning">
# <p class="admonition-title">Limits</p>
#
# * **An epoch's partial last update**: the fix divides by the examples it holds; the
#   constant `UPDATE` (above) makes it a smaller step
#   ([pitfall](../pitfalls.md#last-batch-scaling)).
# * **BatchNorm** normalizes each micro-batch on each replica, not the big batch
#   ([lesson 07](07_beyond_the_basics.ipynb#deep-dive-batchnorm-statistics-are-per-forward-pass)).
# * **Dropout** draws other masks in k·R small passes than in one big one: a big-batch
#   step in distribution, not bit for bit ([deep dive](#deep-dive-dropout-draws-other-masks)).
#
# </div>
#
# ## Takeaways
#
# * Sum gradients inside `strategy.run`, into replica-local `SyncOnRead` buffers.
# * Apply every k micro-batches in a second `strategy.run`: one all-reduce per update.
# * Divide each loss by the examples of the whole update (fewer in an epoch's last one).
# * Build the optimizer under the scope before the apply is traced.

# %% [markdown]
# ## Exercises
#
# ### Exercise 1 · The micro-batch divisor
#
# In the fix, divide each loss by `MICRO` (right for plain small-batch training) instead
# of the update's examples. By what factor is a full update's gradient off?

# %% [markdown]
# #### Answer
#
# k = 4 times: the buffers add k micro-batch means (the epoch's last update is off by its
# examples / `MICRO`). The [wrong-divisors deep dive](#deep-dive-the-wrong-divisors-measured)
# measures all three divisors; here, the SGD step on the small problem:

# %%
reference_update = updates(big_batch_reference(sgd, x, y), tiny_model().get_weights())
exercise = train(sgd, K, updates=1, divide_by=EXAMPLES // K)
ratio = update_ratio(updates(exercise.weights[0], tiny_model().get_weights()), reference_update)
print(f"loss / {EXAMPLES // K}: SGD update x{ratio:.4f} of one big-batch step")
assert abs(ratio - K) < 1e-6 * K

# %% [markdown]
# ### Exercise 2 · Mirrored buffers
#
# In a pasted copy of the fix and check, create the buffers with
# `synchronization=ON_WRITE` (keep `aggregation=SUM`). Where does each micro-step's sum
# happen now, and by what factor is the update off?

# %% [markdown]
# #### Answer
#
# A `MirroredVariable` updated in replica context with `aggregation=SUM` sums the R
# values in a `merge_call` at every micro-step (one more `AddN` per variable in
# `accumulate`: the R gradients meet on one device). `read_value()` in the apply then
# returns that sum on every replica, and the optimizer sums it again: R times the
# big-batch gradient, and the check fails. The same change in the small problem's loop:

# %%
def add_n_ops(loop):
    graph = loop.accumulate.get_concrete_function(micro_batches[0]).graph.as_graph_def()
    return graph_op_types(graph)["AddN"]


mirrored = build_accumulating_loop(sgd, EXAMPLES,
                                   synchronization=tf.VariableSynchronization.ON_WRITE)
replica_local = build_accumulating_loop(sgd, EXAMPLES)
print(f"AddN ops in accumulate: {add_n_ops(mirrored)} with "
      f"{type(mirrored.accumulators[0]).__name__} buffers, "
      f"{add_n_ops(replica_local)} with SyncOnRead ones")
assert add_n_ops(mirrored) - add_n_ops(replica_local) == len(mirrored.accumulators)
for data in micro_batches:
    mirrored.accumulate(data)
mirrored.apply()
ratio = update_ratio(updates(weights_of(mirrored.model), tiny_model().get_weights()),
                     reference_update)
print(f"SGD update x{ratio:.4f} of one big-batch step")
assert abs(ratio - R) < 1e-6 * R

# %% [markdown]
# ### Exercise 3 · Build the optimizer later
#
# In a pasted copy of the fix, delete `optimizer.build(...)`. What happens, and would
# plain SGD run?

# %% [markdown]
# #### Answer
#
# On this TensorFlow and Keras with 2+ replicas the first `apply()` raises
# `InvalidArgumentError: You must feed a value for placeholder tensor ...`: Adam creates
# its slots while the apply is traced, and TensorFlow then loses the all-reduce's
# call-time keys. SGD has no slots and runs. The
# [deep dive](#deep-dive-where-optimizer-state-is-created) reproduces both.

# %% [markdown]
# ## Further reading
#
# * keras-team/keras#23085 (optimizer slots traced under tf.distribute), fixed by #23087.
# * tensorflow/tensorflow#32176: gradient accumulation for distribution strategies.
# * OpenNMT-tf's `GradientAccumulator` and trainer: the two-function structure.
# * [Custom training with tf.distribute.Strategy](https://www.tensorflow.org/tutorials/distribute/custom_training).
# * `tf.VariableSynchronization`, `tf.VariableAggregation`; installed source
#   `tensorflow/python/distribute/values.py` (`SyncOnReadVariable`).

# %% [markdown]
# ## Deep dive · The question's loop, reproduced
#
# The question's loop:
#
# ```python
# for b in batches:
#     per_replica_gradients = strategy.run(fn=self.train_step, args=(model, data))
#     total_gradient += per_replica_gradients
# optimizer.apply_gradients(zip(total_gradient, model.trainable_variables))
# ```
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
legacy = outside_strategy_run.reproduce_tf_keras(replicas=R)
print(textwrap.fill(f"{legacy.type}: {legacy.message.strip()}", 90, subsequent_indent="  "))
assert legacy.type == "RuntimeError"
assert "`apply_gradients() cannot be called in cross-replica context" in legacy.message
assert "Use `tf.distribute.Strategy.run` to enter replica context" in legacy.message

# %% [markdown]
# `GradientAccumulator` refuses the question's mistake with a message that says what to
# do:

# %%
try:
    with strategy.scope():  # cross-replica context: the question's mistake
        accumulator.add([tf.zeros_like(v) for v in packaged.trainable_variables])
except RuntimeError as err:
    misuse = err
print(textwrap.fill(f"add() outside strategy.run -> RuntimeError: {misuse}", 90,
                    subsequent_indent="  "))
assert "must run in replica context" in str(misuse)

# %% [markdown]
# ## Deep dive · The posted answer, as far as it runs
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
# scaled differently:
# [lesson 01's deep dive](01_where_gradients_sync.ipynb#deep-dive-a-keras-3-loss-object-is-already-divided-by-r).)

# %%
answer = outside_strategy_run.reproduce_posted_answer(strategy, accumulation_steps=2,
                                                      examples=EXAMPLES)
show_table(["the posted answer", "on this TensorFlow"], [
    ("`strategy.experimental_run_v2`",
     f"{answer.run_v2_error.type}: {last_line(answer.run_v2_error)}"),
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
# every micro-step. Its "divide the sum by k at the end" is equivalent *if* each
# micro-batch loss was already a global-micro-batch average; dividing the loss by the
# update's batch, as the fix does, keeps the buffers on the gradient's own scale and
# needs no extra pass.

# %% [markdown]
# ## Deep dive · Inside the buffers
#
# A buffer after **one** micro-step: each replica's copy holds its own partial
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
print(f"summed buffers after {K} micro-steps vs big-batch mean gradient: "
      f"max abs {diff.max_abs:.1e}")

# %% [markdown]
# ## Deep dive · The wrong divisors, measured
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
# ## Deep dive · Where optimizer state is created
#
# The fix calls `optimizer.build(model.trainable_variables)` under the scope. Leave it
# out — let `apply_gradients` create Adam's slots the first time the apply
# `tf.function` is traced — and on this TensorFlow/Keras with 2+ replicas the first
# call fails. Plain SGD (no slots) and a single replica run.

# %%
lazy = {name: lazy_slot_creation.reproduce(strategy, name, examples=EXAMPLES)
        for name in ("sgd", "momentum", "adam")}


def feed_line(error):
    return next(line.strip() for line in error.message.splitlines() if "You must feed" in line)


show_table(["optimizer", "slots created lazily, inside the traced apply", "built first (the fix)"],
           [(name,
             "ran" if r.lazy_error is None else f"{r.lazy_error.type}: {feed_line(r.lazy_error)}",
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
one_replica = lazy_slot_creation.reproduce(distgrad_course.make_strategy(1), "adam", examples=EXAMPLES)
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
# yet; the assertions above fail when an upgrade changes this. The version matrix's nightly
# cell (keras-nightly, Keras 3.16 in development) contains it, and there the report no
# longer raises ([upstream status](../upstream.md#status)): keep the `build` until a
# release you use has it.

# %% [markdown]
# ## Deep dive · Checkpointing in the middle of an update
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
# replicas. `GradientAccumulator` also checkpoints its micro-step counter, so the loop's
# position is saved too (`tests/gradient_accumulator/test_accumulator.py` pins all three).

# %% [markdown]
# ## Deep dive · Accumulating vs stepping every micro-batch
#
# Full-batch loss after each pass over the data: one device on the big batch, k = 4
# accumulated micro-batches on R replicas, and the naive alternative — an optimizer step
# after every micro-batch. The first two are the same run (the assertion checks the
# weights after every update); the naive run is a different optimization (four times as
# many smaller steps), not the big-batch training you wanted to keep. On this tiny,
# well-conditioned problem more steps simply descend faster; the point of accumulating
# is to keep a recipe tuned for the big batch (learning rate, schedule, gradient noise)
# when that batch no longer fits in memory — and only the accumulated run reproduces it.
# Both runs trace the same two functions: no all-reduce per micro-batch, one per apply.

# %%
PASSES = 10


def slow_sgd():
    return keras.optimizers.SGD(0.05)


accumulated = train(slow_sgd, 4, PASSES)
naive = train(slow_sgd, 4, PASSES, divide_by=EXAMPLES // 4, apply_every_micro_step=True)
for run in (accumulated, naive):
    assert count_collectives(run.accumulate, micro_batches[0], replicas=R).all_reduces == 0
    assert count_collectives(run.apply, replicas=R).all_reduces == 1
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
# ## Deep dive · The same loop in tf-keras (Keras 2)
#
# The question was asked on TensorFlow 2.x with Keras 2, and many users still train
# on it: TensorFlow 2.15, whose own `tf.keras` is Keras 2 (the version matrix's
# [tf2.15 cell](../versions.md#keras-2) runs this class there; no cell runs older
# releases), or the `tf-keras` package behind `tf.keras` when
# `TF_USE_LEGACY_KERAS=1` is set *before* TensorFlow is imported. This notebook runs
# Keras 3, and a process cannot switch, so the tf-keras program below is written to a
# file and run in a child Python (`distgrad_course.lab.tf_keras_runner.run_tf_keras` sets the variable and
# puts the folder on `PYTHONPATH`). It is the fix's loop, with
# `distgrad.GradientAccumulator` (which holds no Keras object of its own: tf.distribute
# variables, and the optimizer you pass) and a tf-keras `Adam`. The lab supplies the
# incidentals: the tiny model, the weights as lists, and the one-device big-batch
# `model.fit` to compare with.

# %%
program_folder = tempfile.mkdtemp(prefix="lesson02-tf-keras-")

# %%
# %%writefile {program_folder}/tf_keras_custom_loop.py
import numpy as np
import tensorflow as tf  # tf-keras here: run_tf_keras set TF_USE_LEGACY_KERAS=1 before

from distgrad import GradientAccumulator
from distgrad_course.lab.tf_keras_fit import big_batch_fit, tiny_model, weights
from distgrad_course.lab.tf_keras_runner import tf_keras_strategy


def train(replicas, x, y, accumulation_steps, updates):
    strategy = tf_keras_strategy(replicas)  # first: the logical devices
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
    for _update in range(updates):
        for data in micro_batches:
            accumulate(data)
        apply_step()
    big_batch, _ = big_batch_fit(tiny_model, lambda: tf.keras.optimizers.Adam(0.01), x, y,
                                 batch_size=len(x), epochs=updates)
    return {"accumulated": weights(model), "big_batch": weights(big_batch),
            "optimizer": type(optimizer).__module__,
            "updates": int(optimizer.iterations.numpy())}

# %%
from distgrad_course.lab.tf_keras_runner import run_tf_keras

tf_keras_run = run_tf_keras("tf_keras_custom_loop:train", R, env={"PYTHONPATH": program_folder},
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
# form ([lesson 03's tf-keras deep dive](03_cond_and_merge_call.ipynb#deep-dive-the-questions-own-stack-tf-keras-modelfit);
# with `mixed_float16`,
# [lesson 04's](04_loss_scale_optimizer_pitfall.ipynb#deep-dive-the-questions-own-stack-tf-keras)).

# %% [markdown]
# ## Deep dive · Dropout draws other masks
#
# The fix's model has no Dropout, and its check is exact. With a `Dropout` layer, one
# device with the same seed reproduces its own big-batch run exactly, but the
# accumulated run draws its masks in k·R smaller forward passes, other masks than the
# big batch's one pass: the weights part.

# %%
def dropout_model():
    """lab.data.tiny_model with Dropout(0.5) between its two layers."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([keras.Input((4,)),
                             keras.layers.Dense(8, "tanh", kernel_initializer=init(seed=0)),
                             keras.layers.Dropout(0.5, seed=0),
                             keras.layers.Dense(1, kernel_initializer=init(seed=1))])


once, again = (big_batch_reference(sgd, x, y, steps=3, model_factory=dropout_model)
               for _ in range(2))
same_seed = check_close(again, once)  # one device, the same seed: the same masks
with_dropout = train(sgd, K, updates=3, make_model=dropout_model)
apart = check_not_close(with_dropout.weights[-1], once)
print(f"big batch twice: max abs diff {same_seed.max_abs:.1e}; "
      f"accumulated (k={K}, R={R}) vs big batch: {apart.max_abs:.1e}")
