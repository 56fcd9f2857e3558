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
# # 07 · Beyond the questions: what accumulation gets wrong in real training
#
# **The question** (beyond the [four questions](../questions.md), whose models were dense
# regressions on equal micro-batches): *with padded sequences, BatchNorm, Dropout,
# embeddings and clipping, do k micro-batches on R replicas still equal one big-batch step?*
#
# **The short answer.** Only for what is a sum over examples, and only if each example, or
# each real token, weighs what it weighs in the big batch: divide by the count of the whole
# update (all micro-batches, all replicas), never average the micro-batches' own means (the
# fix below). Clip the accumulated gradient, and let schedules count updates. Two things
# depend on how the batch is split, and no bookkeeping recovers them: BatchNorm's batch
# statistics and Dropout's random masks. And Keras 3's Adam treats repeated embedding rows
# differently from their sum. Each is shown in a deep dive below.

# %%
import distgrad_course

strategy = distgrad_course.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
assert R >= 2, "the fix and the deep dives compare R >= 2 replicas with one device"

from distgrad_course.lab.display import show_code, show_environment, show_table

show_environment(distgrad_course.environment_report(strategy))

# %%
import tensorflow as tf

tf.get_logger().setLevel("ERROR")  # fresh tf.functions per experiment, on purpose


def sci(value):
    """A difference in a table: 0 stays 0, the rest in scientific notation."""
    return "0" if value == 0 else f"{value:.1e}"


# %% [markdown]
# ## 1 · The fix
#
# Padded sequences hold different numbers of real tokens, so micro-batches do too. The
# loop below adds each micro-batch's *summed* masked loss gradient, and the count of its
# real tokens, to buffers of each replica's own; once per update it divides by the
# update's token count, summed over the replicas, and applies.

# %% tags=["fix"]
# K micro-batches of padded sequences on every replica, each real token weighted alike: the
# summed masked loss is divided by the update's token count (all micro-batches, all replicas).
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

K, MICRO, EPOCHS = 4, 4, 2  # micro-batches per update; sequences per micro-batch (all replicas)
rng = np.random.default_rng(0)
x = rng.normal(size=(22, 6, 3)).astype("float32")  # 22 sequences of up to 6 tokens
y = rng.normal(size=(22, 6, 1)).astype("float32")
mask = (np.arange(6) < rng.integers(1, 7, size=(22, 1))).astype("float32")  # 0: padding
dataset = tf.data.Dataset.from_tensor_slices((x, y, mask)).batch(MICRO)  # the 6th holds 2
dist_dataset = strategy.experimental_distribute_dataset(dataset)

def make_model():
    return keras.Sequential([keras.Input((None, 3)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])

def per_token_loss(model, x, y):
    return tf.reduce_mean(tf.square(model(x, training=True) - y), axis=-1)

def replica_local(shape):  # one copy per replica: adding to it needs no communication
    return tf.Variable(tf.zeros(shape), trainable=False, aggregation=tf.VariableAggregation.SUM,
                       synchronization=tf.VariableSynchronization.ON_READ)

keras.utils.set_random_seed(0)
with strategy.scope():
    model, optimizer = make_model(), keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    buffers = [replica_local(v.shape) for v in model.trainable_variables]
    tokens = replica_local([])  # the real tokens this replica has accumulated

@tf.function
def accumulate(batch):
    def step(x, y, mask):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(per_token_loss(model, x, y) * mask)  # a sum: apply() divides
        for buffer, gradient in zip(buffers, tape.gradient(loss, model.trainable_variables)):
            buffer.assign_add(gradient)
        tokens.assign_add(tf.reduce_sum(mask))
    strategy.run(step, args=batch)

@tf.function
def apply():
    def step():
        context = tf.distribute.get_replica_context()
        total = context.all_reduce("SUM", tokens.read_value())  # the update's tokens, all replicas
        mean = [buffer.read_value() / total for buffer in buffers]
        optimizer.apply_gradients(zip(mean, model.trainable_variables))  # SUMs the replicas
        for variable in buffers + [tokens]:
            variable.assign(tf.zeros_like(variable))
    strategy.run(step)

for _epoch in range(EPOCHS):
    for step, batch in enumerate(dist_dataset, start=1):
        accumulate(batch)
        if step % K == 0:
            apply()
    if step % K:  # the epoch's leftover micro-batches (here 2, the last of 2 sequences): one
        apply()  # smaller update, divided by its own token count like any other

# %% tags=["check"]
# One device, no strategy: one step per update on the big batch's token mean (K * MICRO
# sequences; the leftover micro-batches make a smaller last batch). Same seed, same weights.
keras.utils.set_random_seed(0)
one_device, one_optimizer = make_model(), keras.optimizers.Adam(0.01)
for xb, yb, mb in dataset.unbatch().batch(K * MICRO).repeat(EPOCHS):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(per_token_loss(one_device, xb, yb) * mb) / tf.reduce_sum(mb)
    grads = tape.gradient(loss, one_device.trainable_variables)
    one_optimizer.apply_gradients(zip(grads, one_device.trainable_variables))
for got, want in zip(model.get_weights(), one_device.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
print(f"{strategy.num_replicas_in_sync} replicas, token-weighted: equal to one device")

# %% [markdown]
# ## 2 · Why it works
#
# The big-batch loss is `sum(loss · mask) / total_tokens`. A loop that takes each
# micro-batch's token mean and averages those means gives a token in a short micro-batch
# more weight than one in a long micro-batch (the bug that huggingface/transformers#34191
# fixed in its `Trainer` in October 2024); so does a per-replica mean, across replicas.
# The fix sums instead, and divides once per update. Its `apply` runs in *replica context*
# (the function `strategy.run` calls once per replica, seeing that replica's values): there
# `context.all_reduce` sums the replicas' token counts, one scalar, before
# `apply_gradients` sums their gradients. `mean_of_means.reproduce` measures all four
# choices on one batch of padded sequences, gradients against the big batch's:

# %%
from distgrad_course.pitfalls import mean_of_means

R = strategy.num_replicas_in_sync  # from here on the fix's strategy: no second set of collectives
uneven = mean_of_means.reproduce(micro_batches=2, strategy=strategy)
print("real tokens per micro-batch:", uneven.token_counts)
show_table(["normalizer", "max abs gradient diff vs big batch", "relative to the gradient"], [
    ("each micro-batch's own count, means averaged", sci(uneven.mean_of_means_vs_big_batch),
     sci(uneven.mean_of_means_vs_big_batch / uneven.gradient_scale)),
    ("the update's total count", sci(uneven.global_count_vs_big_batch),
     sci(uneven.global_count_vs_big_batch / uneven.gradient_scale)),
    (f"each replica's own count ({R} replicas)", sci(uneven.per_replica_mean_vs_big_batch),
     sci(uneven.per_replica_mean_vs_big_batch / uneven.gradient_scale)),
    ("`global_token_count` (all-reduced)", sci(uneven.global_count_across_replicas_vs_big_batch),
     sci(uneven.global_count_across_replicas_vs_big_batch / uneven.gradient_scale)),
])
assert len(set(uneven.token_counts)) > 1
assert uneven.mean_of_means_vs_big_batch > 0.1 * uneven.gradient_scale  # wrong by >10%
assert uneven.global_count_vs_big_batch <= 1e-6  # right
assert uneven.per_replica_mean_vs_big_batch > 0.1 * uneven.gradient_scale
assert uneven.global_count_across_replicas_vs_big_batch <= 1e-6

# %% [markdown]
# The same four numbers, drawn: only the counts summed over the whole update (and over the
# replicas) land at float32 rounding.

# %%
import matplotlib.pyplot as plt

errors = {"mean of micro-batch means": uneven.mean_of_means_vs_big_batch,
          "the update's count": uneven.global_count_vs_big_batch,
          f"each replica's own count ({R})": uneven.per_replica_mean_vs_big_batch,
          "all-reduced count": uneven.global_count_across_replicas_vs_big_batch}
relative = [max(e / uneven.gradient_scale, 1e-9) for e in errors.values()]  # 0 drawn at 1e-9
fig, ax = plt.subplots(figsize=(7.5, 2.4))
ax.barh(list(errors), relative, color=["tab:red" if r > 1e-6 else "tab:green" for r in relative])
ax.set_xscale("log")
ax.axvline(1e-6, color="gray", linestyle="--", linewidth=1)
ax.set_xlabel("max |gradient − big batch's| / gradient scale (log; dashed: 1e-6)")
ax.invert_yaxis()
plt.tight_layout()
plt.show()

# %%
show_code(mean_of_means.reproduce)

# %% [markdown]
# ## 3 · The packaged form
#
# For a loop that knows the update's token count before its first micro-step,
# `distgrad.normalization` has `token_loss(per_token_loss, mask, normalizer)`, the masked
# sum over that count, and `global_token_count(mask)`, the count all-reduced over the
# replicas. Accumulate the loss with `GradientAccumulator` (lesson 02) or
# `AccumulatingOptimizer` (lesson 03), which also clips the update and lets schedules
# count updates (deep dive below).

# %%
from distgrad.normalization import global_token_count, token_loss

show_code(token_loss)

# %%
show_code(global_token_count)

# %% [markdown]
# <div class="admonition warning">
# <p class="admonition-title">Limits</p>
#
# * **BatchNorm statistics** are those of each forward pass: per replica, per micro-batch
#   ([BatchNorm](#deep-dive-batchnorm-statistics-are-per-forward-pass)).
# * **Dropout's randomness**: other micro-batches draw other masks
#   ([Dropout](#deep-dive-dropout-draws-other-masks-for-other-micro-batches)).
# * **Repeated embedding rows** reach Keras 3's Adam as an `IndexedSlices`, squared before
#   they are summed ([sparse gradients](#deep-dive-sparse-gradients-the-same-gradient-two-adam-updates)).
# * **Clipping each micro-batch** is not clipping the update
#   ([clipping](#deep-dive-clipping-and-schedules-belong-to-the-update)).
# * **A partial last batch** is weighed right here because the fix counts what it sums; a
#   loop that divides by a fixed batch size is not
#   ([pitfalls](../pitfalls.md#last-batch-scaling)).
#
# </div>

# %% [markdown]
# ## Deep dive · BatchNorm statistics are per forward pass
#
# In training mode `BatchNormalization` uses the statistics of the batch it sees: B/R
# examples per replica, B/k per micro-batch. That changes the function being
# differentiated, so no gradient bookkeeping can recover the big-batch step.
# `BatchNormalization(synchronized=True)` all-reduces the statistics across replicas
# and *does* recover it; across sequential micro-batches nothing can: the later
# micro-batches' statistics don't exist yet when the first one runs. `LayerNormalization`
# has no batch statistics (each example is normalized by itself), so accumulating it
# is exact.

# %%
from distgrad_course.pitfalls import batchnorm_statistics

bn = batchnorm_statistics.reproduce(strategy, micro_batches=2)
scale = bn.one_device_update_max_abs
show_table(["one SGD step with", "max abs weight diff vs big batch", "relative to the update"], [
    (f"plain BatchNorm, {R} replicas", sci(bn.replicas_plain_bn.max_abs),
     sci(bn.replicas_plain_bn.max_abs / scale)),
    (f"`synchronized=True`, {R} replicas", sci(bn.replicas_synchronized_bn.max_abs),
     sci(bn.replicas_synchronized_bn.max_abs / scale)),
    ("BatchNorm, 2 accumulated micro-batches", sci(bn.accumulated_micro_batches.max_abs),
     sci(bn.accumulated_micro_batches.max_abs / scale)),
    ("LayerNorm, 2 accumulated micro-batches", sci(bn.accumulated_layer_norm.max_abs),
     "(vs its own big batch)"),
])
assert bn.replicas_plain_bn.max_abs > 0.01 * scale
assert bn.replicas_synchronized_bn.within()
assert bn.accumulated_micro_batches.max_abs > 0.01 * scale
assert bn.accumulated_layer_norm.within()

# %% [markdown]
# The moving averages are a second effect: they are updated by every forward pass in
# training mode, so with k micro-batches k times per optimizer update. Four forward
# passes over the same batch move the moving mean four times
# (`moving_mean = momentum · moving_mean + (1 − momentum) · batch_mean`, from 0):

# %%
layer = keras.layers.BatchNormalization(momentum=0.99)
batch = tf.constant(np.random.default_rng(0).normal(2.0, 1.0, size=(8, 3)), tf.float32)
for _ in range(4):
    layer(batch, training=True)
expected = (1 - 0.99 ** 4) * tf.reduce_mean(batch, axis=0).numpy()
print("moving mean after 4 micro-batches:", np.round(layer.moving_mean.numpy(), 6))
np.testing.assert_allclose(layer.moving_mean.numpy(), expected, rtol=1e-5)

# With the same statistics in every micro-batch, momentum ** (1/k) per micro-batch moves
# the averages as one forward pass at `momentum` does:
adjusted = keras.layers.BatchNormalization(momentum=0.99 ** (1 / 4))
for _ in range(4):
    adjusted(batch, training=True)
once = keras.layers.BatchNormalization(momentum=0.99)
once(batch, training=True)
np.testing.assert_allclose(adjusted.moving_mean.numpy(), once.moving_mean.numpy(), rtol=1e-5)

# %% [markdown]
# What to do: prefer normalizations without batch statistics (LayerNorm, GroupNorm) when
# you accumulate; use `synchronized=True` across replicas; and if you keep BatchNorm with
# k micro-batches, give it `momentum ** (1 / k)`, so that its moving averages forget at
# the rate of one update (exactly so when the micro-batches' statistics agree, as above).

# %% [markdown]
# ## Deep dive · Dropout draws other masks for other micro-batches
#
# In training mode `Dropout` zeroes a random part of its input, drawn anew at every call
# from the layer's seed generator. One batch of 8 is one draw; the same 8 examples as two
# micro-batches of 4 are two draws, from the same seed:

# %%
def dropout_masks(micro_batches, seed=7):
    """Which of 8 x 6 inputs a fresh Dropout(0.5, seed) keeps, called once per micro-batch."""
    layer = keras.layers.Dropout(0.5, seed=seed)
    parts = tf.split(tf.ones((8, 6)), micro_batches)
    return np.concatenate([layer(part, training=True).numpy() != 0 for part in parts])


one_draw, two_draws = dropout_masks(1), dropout_masks(2)
differing_rows = [i for i in range(8) if not np.array_equal(one_draw[i], two_draws[i])]
print("examples whose mask differs, 1 batch of 8 vs 2 micro-batches of 4:", differing_rows)
assert differing_rows  # the same examples, other masks

# %% [markdown]
# So the gradients differ too. The same model (the same seeds) with `Dropout(0.5)`, the
# gradient of one batch of 8 against the sum of its two micro-batches' gradients, each
# loss divided by the 8 examples of the update; then the same with the rate at 0:

# %%
def dropout_gradients(rate, micro_batches):
    keras.utils.set_random_seed(0)  # the same initial weights, the same dropout seed
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dropout(rate, seed=7), keras.layers.Dense(2)])
    data = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    total = [tf.zeros_like(v) for v in model.trainable_variables]
    for part in np.split(data, micro_batches):
        with tf.GradientTape() as tape:
            errors = keras.losses.mean_squared_error(part[:, 4:], model(part[:, :4], training=True))
            loss = tf.reduce_sum(errors) / len(data)
        total = [t + g for t, g in zip(total, tape.gradient(loss, model.trainable_variables))]
    return [t.numpy() for t in total]


dropout_rows = []
for rate in (0.5, 0.0):
    big, accumulated = dropout_gradients(rate, 1), dropout_gradients(rate, 2)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(accumulated, big))
    dropout_rows.append((rate, diff, diff / max(float(np.abs(g).max()) for g in big)))
show_table(["Dropout rate", "max abs gradient diff, 2 micro-batches vs 1 batch", "relative"],
           [(rate, sci(diff), sci(relative)) for rate, diff, relative in dropout_rows])
assert dropout_rows[0][2] > 0.1  # dropout on: accumulation is not the big batch
assert dropout_rows[1][1] <= 1e-6  # dropout off: it is

# %% [markdown]
# A check that accumulation equals the big batch must therefore turn dropout off (rate 0,
# or `training=False` for that layer), as every model of this course does.

# %% [markdown]
# ## Deep dive · Sparse gradients: the same gradient, two Adam updates
#
# An `Embedding` lookup's gradient is a `tf.IndexedSlices` with one row per *lookup*: a
# token that appears twice appears twice in `indices`. Feed Keras 3's Adam that gradient
# as IndexedSlices, or densified, and the weights differ, but only on the repeated row
# (two Adam steps on one embedding table, `sparse_duplicates.reproduce`):

# %%
from distgrad_course.pitfalls import sparse_duplicates

adam_sparse = sparse_duplicates.reproduce(tokens=(1, 1, 2))
adam_unique = sparse_duplicates.reproduce(tokens=(1, 2, 3))
clip = sparse_duplicates.reproduce(
    (1, 1, 2), optimizer_factory=lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5))
momentum = sparse_duplicates.reproduce(
    (1, 1, 2), optimizer_factory=lambda: keras.optimizers.SGD(0.1, momentum=0.9))
show_table(["optimizer", "tokens", "sparse vs dense", "rows that differ",
            "deduplicated vs dense"], [
    ("Adam", adam_sparse.tokens, sci(adam_sparse.sparse_vs_dense), adam_sparse.rows_differing,
     sci(adam_sparse.deduplicated_vs_dense)),
    ("Adam", adam_unique.tokens, sci(adam_unique.sparse_vs_dense), adam_unique.rows_differing,
     sci(adam_unique.deduplicated_vs_dense)),
    ("SGD, `global_clipnorm`", clip.tokens, sci(clip.sparse_vs_dense), clip.rows_differing,
     sci(clip.deduplicated_vs_dense)),
    ("SGD, momentum", momentum.tokens, sci(momentum.sparse_vs_dense), momentum.rows_differing,
     sci(momentum.deduplicated_vs_dense)),
])
assert adam_sparse.sparse_vs_dense > 1e-3 and adam_sparse.rows_differing == (1,)
assert adam_unique.sparse_vs_dense == 0.0
assert adam_sparse.deduplicated_vs_dense == 0.0
assert clip.sparse_vs_dense > 1e-3 and clip.deduplicated_vs_dense == 0.0
assert momentum.sparse_vs_dense <= 1e-6

# %% [markdown]
# **Why**, from the installed source. Adam's `update_step`
# (`keras/src/optimizers/adam.py`):

# %%
show_code(keras.optimizers.Adam.update_step)

# %% [markdown]
# `ops.subtract(gradient, m)` densifies the IndexedSlices, so every row's first moment
# decays, touched or not: untouched rows are *not* the difference. But `ops.square` is an
# elementwise op that Keras applies to an IndexedSlices' *values*
# (`elementwise_unary` in `keras/src/backend/tensorflow/sparse.py`), before duplicate
# rows are summed: the second moment gets a² + b² where the dense gradient gives
# (a + b)². Here with a = 1, b = 2 on row 1:

# %%
gradient = tf.IndexedSlices(values=tf.constant([[1.0], [2.0], [3.0]]),
                            indices=tf.constant([1, 1, 2]), dense_shape=tf.constant([4, 1]))
squared = keras.ops.square(gradient)
difference = keras.ops.subtract(gradient, tf.zeros([4, 1]))
show_table(["", "type", "row 1 (dense)"], [
    ("`ops.square(gradient)`", type(squared).__name__,
     float(tf.convert_to_tensor(squared)[1, 0])),
    ("`ops.square(dense gradient)`", "EagerTensor",
     float(keras.ops.square(tf.convert_to_tensor(gradient))[1, 0])),
    ("`ops.subtract(gradient, m)`", type(difference).__name__, float(difference[1, 0])),
])
assert isinstance(squared, tf.IndexedSlices) and squared.indices.numpy().tolist() == [1, 1, 2]
assert float(tf.convert_to_tensor(squared)[1, 0]) == 1.0 ** 2 + 2.0 ** 2
assert float(keras.ops.square(tf.convert_to_tensor(gradient))[1, 0]) == (1.0 + 2.0) ** 2
assert not isinstance(difference, tf.IndexedSlices)

# %% [markdown]
# `global_clipnorm` likewise computes the norm over the duplicated rows (third row of the
# table); linear updates (SGD, momentum) are unaffected. keras-team/keras#19992 discusses
# how Keras 3's optimizers handle sparse gradients, and tensorflow/tensorflow#28090 TF1's
# `_deduplicate_indexed_slices`.
#
# **What this means for accumulation.** An accumulator that densifies computes the
# *dense* (mathematically exact) update, which is what Keras' big-batch step computes
# only when no token repeats. Deduplicating first (`distgrad.sparse.deduplicate`) makes
# the sparse path exact too, at the price of a `tf.unique`. Memory: a dense buffer costs
# the whole table, a sparse one only the touched rows:

# %%
from distgrad.sparse import deduplicate, dense_bytes, sparse_bytes

vocab, dim, batch_tokens = 50_000, 64, 4_096
table = tf.Variable(tf.zeros([vocab, dim]))
token_ids = tf.constant(np.random.default_rng(0).integers(0, vocab, batch_tokens))
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.gather(table, token_ids))
embedding_gradient = tape.gradient(loss, table)
unique = deduplicate(embedding_gradient)
show_table(["buffer for a 50,000 x 64 table, 4,096 lookups", "MiB", "rows"], [
    ("dense", f"{dense_bytes(embedding_gradient) / 2**20:.1f}", vocab),
    ("sparse, as the gradient comes", f"{sparse_bytes(embedding_gradient) / 2**20:.1f}",
     len(embedding_gradient.indices)),
    ("sparse, deduplicated", f"{sparse_bytes(unique) / 2**20:.1f}", len(unique.indices)),
])
assert sparse_bytes(unique) < sparse_bytes(embedding_gradient) < dense_bytes(embedding_gradient)
np.testing.assert_array_equal(tf.convert_to_tensor(unique),
                              tf.convert_to_tensor(embedding_gradient))

# %% [markdown]
# ## Deep dive · Clipping and schedules belong to the update
#
# Clipping by global norm is not linear: clip(g₁) + clip(g₂) ≠ clip(g₁ + g₂). A loop that
# clips each micro-batch before accumulating (what an optimizer with `global_clipnorm`
# does when it is applied every micro-step, as in [lesson 03](03_cond_and_merge_call.ipynb)'s
# mask trick) computes another update than the big batch. `AccumulatingOptimizer` takes the
# clipping off its inner optimizer and clips the accumulated, all-reduced gradient
# ([lesson 03](03_cond_and_merge_call.ipynb)). A learning-rate schedule on the inner
# optimizer is evaluated at the inner `iterations`, which counts *updates*.

# %%
from distgrad_course.pitfalls import clip_per_micro_batch

clipping = clip_per_micro_batch.reproduce(strategy)
update_scale = clipping.big_batch_update_max_abs
show_table(["recipe, vs big-batch `fit`", "max abs weight diff", "relative to the update"], [
    ("clip each micro-batch, then sum", sci(clipping.clip_each_micro_batch_vs_big_batch.max_abs),
     sci(clipping.clip_each_micro_batch_vs_big_batch.max_abs / update_scale)),
    ("`AccumulatingOptimizer(SGD(global_clipnorm))`",
     sci(clipping.accumulating_optimizer_clip_vs_big_batch.max_abs),
     sci(clipping.accumulating_optimizer_clip_vs_big_batch.max_abs / update_scale)),
    (f"schedule: {clipping.updates} updates, {clipping.micro_steps} micro-steps",
     sci(clipping.schedule_accumulating_vs_big_batch.max_abs), ""),
    ("schedule vs a constant learning rate",
     sci(clipping.schedule_vs_constant_learning_rate.max_abs), "(the schedule acts)"),
])
assert clipping.clip_each_micro_batch_vs_big_batch.max_abs > 0.1 * update_scale
assert clipping.accumulating_optimizer_clip_vs_big_batch.within()
assert (clipping.updates, clipping.micro_steps) == (2, 8)
assert clipping.schedule_accumulating_vs_big_batch.within()
assert clipping.schedule_vs_constant_learning_rate.max_abs > 1e-2

# %% [markdown]
# Restarting is the last thing real training adds: the accumulation buffers are state, and a
# checkpoint saved in the middle of an update continues exactly where it stopped. Lesson 02
# shows it for a custom loop's buffers ([lesson 02](02_accumulate_in_custom_loop.ipynb),
# section *Checkpointing in the middle of an update*); `AccumulatingOptimizer`'s buffers and
# counters are optimizer state, saved with the model
# (`tests/accumulating_optimizer/test_optimizer.py`).

# %% [markdown]
# ## Deep dive · All of it in one picture
#
# Each pair of bars is one experiment above: the wrong recipe and the right one, as the
# difference from the big-batch result relative to the size of the gradient or update
# (the last column of each table; for sparse Adam, relative to the dense update). A
# difference of exactly 0 is drawn at the left edge.

# %%
import matplotlib.pyplot as plt

experiments = [
    ("token means per micro-batch",
     uneven.mean_of_means_vs_big_batch / uneven.gradient_scale,
     uneven.global_count_vs_big_batch / uneven.gradient_scale, "update's token count"),
    ("token means per replica",
     uneven.per_replica_mean_vs_big_batch / uneven.gradient_scale,
     uneven.global_count_across_replicas_vs_big_batch / uneven.gradient_scale,
     "all-reduced token count"),
    ("BatchNorm on replicas", bn.replicas_plain_bn.max_abs / scale,
     bn.replicas_synchronized_bn.max_abs / scale, "synchronized=True"),
    ("BatchNorm, micro-batches", bn.accumulated_micro_batches.max_abs / scale,
     bn.accumulated_layer_norm.max_abs / scale, "LayerNorm"),
    ("Dropout, micro-batches", dropout_rows[0][2], dropout_rows[1][2], "rate 0"),
    ("Adam, repeated tokens", adam_sparse.sparse_vs_dense / adam_sparse.dense_update_max_abs,
     adam_sparse.deduplicated_vs_dense / adam_sparse.dense_update_max_abs, "deduplicate"),
    ("clip per micro-batch",
     clipping.clip_each_micro_batch_vs_big_batch.max_abs / update_scale,
     clipping.accumulating_optimizer_clip_vs_big_batch.max_abs / update_scale,
     "clip the accumulated update"),
]
FLOOR = 1e-9
fig, axis = plt.subplots(figsize=(9, 4.6))
positions = np.arange(len(experiments))[::-1]
wrong = [max(w, FLOOR) for _, w, _, _ in experiments]
right = [max(r, FLOOR) for _, _, r, _ in experiments]
axis.barh(positions + 0.2, wrong, height=0.4, color="tab:red", label="the mistake")
axis.barh(positions - 0.2, right, height=0.4, color="tab:green", label="the fix")
for y_position, (_, _, r, fix) in zip(positions, experiments):
    axis.text(max(r, FLOOR) * 1.5, y_position - 0.2, fix + (" (exactly 0)" if r == 0 else ""),
              va="center", fontsize=8)
axis.axvline(1e-6, color="gray", linestyle=":", linewidth=1)
axis.text(1.2e-6, positions[0] + 0.55, "1e-6", color="gray", fontsize=8)
axis.set(xscale="log", xlim=(FLOOR, 10), yticks=positions,
         yticklabels=[name for name, _, _, _ in experiments],
         xlabel="difference from the big-batch result, relative (log; 0 at the left edge)")
axis.legend(loc="lower right", fontsize=8)
plt.tight_layout()
plt.show()
assert all(w > 1e-2 for w in wrong) and all(r <= 1e-5 for r in right)

# %% [markdown]
# ## Deep dive · Which pattern to use
#
# | pattern | use it when | avoids |
# |---|---|---|
# | a custom loop with replica-local accumulators, Python deciding when to apply ([lesson 02](02_accumulate_in_custom_loop.ipynb); `GradientAccumulator`) | you own the training loop | `tf.cond` around sync points; k all-reduces per update; applying outside `strategy.run` |
# | `AccumulatingOptimizer` ([lesson 03](03_cond_and_merge_call.ipynb)): wraps any Keras optimizer, `model.fit` unchanged | you use `fit` and want callbacks and metrics per micro-batch | the `merge_call` RuntimeError of Keras' built-in `gradient_accumulation_steps` under `MirroredStrategy` (keras-team/keras#20582); the mask trick's drift; per-replica clipping |
# | a micro-batching `train_step` ([lesson 05](05_accumulate_in_train_step.ipynb); `MicroBatching`): one `fit` step = one update | only the activations of the big batch do not fit | `g += _g` rebinding; ragged micro-batches; extra all-reduces |
# | any of the above on `MultiWorkerMirroredStrategy` ([lesson 06](06_multi_worker.ipynb)) | more than one machine | dead workers hanging the job (set a collective timeout) |
#
# Whatever the pattern: normalize by the **update's** example or token count (the fix),
# don't expect BatchNorm or Dropout to see the big batch, decide how sparse gradients are
# summed, clip and schedule per update (the deep dives above).

# %% [markdown]
# ## Takeaways
#
# * Normalize by the count of the whole update: all micro-batches, all replicas; a smaller
#   last update is then weighed right too.
# * BatchNorm statistics can be synchronized across replicas, not across micro-batches;
#   its moving averages move once per micro-batch. LayerNorm accumulates exactly.
# * Dropout draws other masks for other micro-batches: turn it off to check equivalence.
# * Keras 3's Adam squares an IndexedSlices' rows *before* summing duplicates: sparse and
#   dense gradients give different updates when tokens repeat; deduplicate.
# * Clip the accumulated gradient; let schedules count updates.

# %% [markdown]
# ## Exercises

# %% [markdown]
# ### Exercise 1 · More, smaller micro-batches
#
# Rerun section 2's experiment with `mean_of_means.reproduce(micro_batches=4,
# strategy=strategy)`: does the mean of means get further from the big batch with more,
# smaller micro-batches? And the update's total count?

# %% [markdown]
# #### Answer
#
# Further: the four micro-batches hold more unequal token counts than the two halves, so
# their means are weighted more unequally. The update's count stays exact.

# %%
four = mean_of_means.reproduce(micro_batches=4, strategy=strategy)
relative = {k: r.mean_of_means_vs_big_batch / r.gradient_scale for k, r in [(2, uneven), (4, four)]}
print("tokens per micro-batch:", four.token_counts)
print(f"mean of means, relative to the gradient: k=2 {relative[2]:.3f}, k=4 {relative[4]:.3f}")
assert relative[4] > relative[2] and four.global_count_vs_big_batch <= 1e-6

# %% [markdown]
# ### Exercise 2 · Other optimizers and repeated tokens
#
# Which other Keras optimizers care about repeated tokens? Predict from each `update_step`
# (`show_code(keras.optimizers.Adagrad.update_step)`) first, then try
# `sparse_duplicates.reproduce((1, 1, 2), optimizer_factory=lambda:
# keras.optimizers.Adagrad(0.1))`, then `RMSprop(0.01)` and `SGD(0.1, nesterov=True,
# momentum=0.9)`.

# %% [markdown]
# #### Answer
#
# Adagrad adds `ops.square(gradient)` to its accumulator and RMSprop averages it: both
# square the repeated rows before they are summed, like Adam, and differ on row 1.
# SGD with Nesterov momentum is linear in the gradient: no difference. Deduplicating
# makes all three exact.

# %%
rows = []
for name, make in [("Adagrad", lambda: keras.optimizers.Adagrad(0.1)),
                   ("RMSprop", lambda: keras.optimizers.RMSprop(0.01)),
                   ("SGD, Nesterov",
                    lambda: keras.optimizers.SGD(0.1, nesterov=True, momentum=0.9))]:
    record = sparse_duplicates.reproduce((1, 1, 2), optimizer_factory=make)
    rows.append((name, sci(record.sparse_vs_dense), record.rows_differing,
                 sci(record.deduplicated_vs_dense)))
    assert record.deduplicated_vs_dense == 0.0
    if name == "SGD, Nesterov":
        assert record.sparse_vs_dense <= 1e-6
    else:
        assert record.sparse_vs_dense > 1e-3 and record.rows_differing == (1,)
show_table(["optimizer", "sparse vs dense", "rows that differ", "deduplicated vs dense"], rows)

# %% [markdown]
# ### Exercise 3 · A clip that never acts
#
# Does clipping each micro-batch matter when the clip never acts? Rerun the clipping deep
# dive with `clip_per_micro_batch.reproduce(strategy, clip_norm=100.0)` and read the first
# row.

# %% [markdown]
# #### Answer
#
# No: with a norm far above every gradient's, clipping is the identity, and clipping each
# micro-batch equals the big batch to float32 precision. The mistake only shows once the
# clip acts, which is exactly when it matters.

# %%
loose = clip_per_micro_batch.reproduce(strategy, clip_norm=100.0)
print(f"clip each micro-batch (clip_norm=100) vs big batch: "
      f"{loose.clip_each_micro_batch_vs_big_batch.max_abs:.1e}")
assert loose.clip_each_micro_batch_vs_big_batch.within()

# %% [markdown]
# ## Further reading
#
# * huggingface/transformers#34191: token-count normalization across accumulation steps.
# * Keras `BatchNormalization(synchronized=True)`; `keras/src/layers/normalization/
#   batch_normalization.py`. Keras `Dropout` and its `SeedGenerator`.
# * keras-team/keras#19992 (sparse gradients in Keras 3's optimizers),
#   tensorflow/tensorflow#28090 (duplicate indices and `_deduplicate_indexed_slices`).
# * The [API reference](../api.md): `distgrad.normalization`, `distgrad.sparse`,
#   `distgrad.AccumulatingOptimizer`.
