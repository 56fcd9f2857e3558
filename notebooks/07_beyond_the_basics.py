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
# Lessons 02–05 made k micro-batches on R replicas equal one big-batch step for a dense
# regression model. Real models bring padding, BatchNorm, embeddings, clipping and
# schedules. Each section reproduces the mistake, explains it from the installed source,
# and shows what to do instead; the figure at the end puts all of them side by side.

# %%
import distgrad

strategy = distgrad.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
assert R >= 2, "sections 1, 2 and 4 compare R >= 2 replicas with one device"

from distgrad.lab.display import show_code, show_environment, show_table  # noqa: E402

show_environment(distgrad.environment_report(strategy))

# %%
import keras
import matplotlib.pyplot as plt
import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")  # fresh tf.functions per experiment, on purpose


def sci(value):
    """A difference in a table: 0 stays 0, the rest in scientific notation."""
    return "0" if value == 0 else f"{value:.1e}"


# %% [markdown]
# ## 1 · Uneven micro-batches: the mean of means is not the mean
#
# With padded sequences each micro-batch holds a different number of real tokens. The
# big-batch loss is `sum(loss · mask) / total_tokens`. A loop that takes each
# micro-batch's token mean and averages those means gives a token in a short
# micro-batch more weight than one in a long micro-batch (the bug that
# huggingface/transformers#34191 fixed in its `Trainer` in October 2024). Normalize every
# micro-batch's masked *sum* by the token count of the whole update instead, across
# micro-batches **and** replicas: `distgrad.normalization.global_token_count`
# all-reduces the count once.

# %%
from distgrad.normalization import global_token_count, token_loss
from distgrad.pitfalls import mean_of_means

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
# The two functions the right rows use, from `distgrad/normalization.py`:

# %%
show_code(token_loss)

# %%
show_code(global_token_count)

# %% [markdown]
# ## 2 · BatchNorm: statistics are per forward pass
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
from distgrad.pitfalls import batchnorm_statistics

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
#
# ## 3 · Sparse gradients: the same gradient, two Adam updates
#
# An `Embedding` lookup's gradient is a `tf.IndexedSlices` with one row per *lookup*: a
# token that appears twice appears twice in `indices`. Feed Keras 3's Adam that gradient
# as IndexedSlices, or densified, and the weights differ, but only on the repeated row
# (two Adam steps on one embedding table, `sparse_duplicates.reproduce`):

# %%
from distgrad.pitfalls import sparse_duplicates

adam_sparse = sparse_duplicates.reproduce(tokens=(1, 1, 2))
adam_unique = sparse_duplicates.reproduce(tokens=(1, 2, 3))
clip = sparse_duplicates.reproduce(
    (1, 1, 2), optimizer_factory=lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5))
momentum = sparse_duplicates.reproduce(
    (1, 1, 2), optimizer_factory=lambda: keras.optimizers.SGD(0.1, momentum=0.9))
show_table(["optimizer", "tokens", "sparse vs dense", "rows that differ", "deduplicated vs dense"], [
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
# only when no token repeats (lesson 02 compares its accumulator with a dense-gradient
# reference for this reason). Deduplicating first (`distgrad.sparse.deduplicate`) makes
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
# ## 4 · Clipping and schedules belong to the update, not the micro-step
#
# Clipping by global norm is not linear: clip(g₁) + clip(g₂) ≠ clip(g₁ + g₂). A loop that
# clips each micro-batch before accumulating (what an optimizer with `global_clipnorm`
# does when it is applied every micro-step, as in lesson 03's mask trick) computes
# another update than the big batch. `AccumulatingOptimizer` takes the clipping off its
# inner optimizer and clips the accumulated, all-reduced gradient (lesson 03). A
# learning-rate schedule on the inner optimizer is evaluated at the inner `iterations`,
# which counts *updates*.

# %%
from distgrad.pitfalls import clip_per_micro_batch

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
    ("schedule vs a constant learning rate", sci(clipping.schedule_vs_constant_learning_rate.max_abs),
     "(the schedule acts)"),
])
assert clipping.clip_each_micro_batch_vs_big_batch.max_abs > 0.1 * update_scale
assert clipping.accumulating_optimizer_clip_vs_big_batch.within()
assert (clipping.updates, clipping.micro_steps) == (2, 8)
assert clipping.schedule_accumulating_vs_big_batch.within()
assert clipping.schedule_vs_constant_learning_rate.max_abs > 1e-2

# %% [markdown]
# Restarting is the last thing real training adds: `AccumulatingOptimizer`'s accumulators
# and counters are optimizer state, saved with the model, so a save in the middle of a
# cycle continues exactly where it stopped ([lesson 03](03_cond_and_merge_call.ipynb),
# section 6).
#
# ## 5 · All of it in one picture
#
# Each pair of bars is one section's experiment: the wrong recipe and the right one, as
# the difference from the big-batch result relative to the size of the gradient or
# update (the last column of each table; for sparse Adam, relative to the dense update).
# A difference of exactly 0 is drawn at the left edge.

# %%
experiments = [
    ("1 · token means per micro-batch",
     uneven.mean_of_means_vs_big_batch / uneven.gradient_scale,
     uneven.global_count_vs_big_batch / uneven.gradient_scale, "update's token count"),
    ("1 · token means per replica",
     uneven.per_replica_mean_vs_big_batch / uneven.gradient_scale,
     uneven.global_count_across_replicas_vs_big_batch / uneven.gradient_scale,
     "all-reduced token count"),
    ("2 · BatchNorm on replicas", bn.replicas_plain_bn.max_abs / scale,
     bn.replicas_synchronized_bn.max_abs / scale, "synchronized=True"),
    ("2 · BatchNorm, micro-batches", bn.accumulated_micro_batches.max_abs / scale,
     bn.accumulated_layer_norm.max_abs / scale, "LayerNorm"),
    ("3 · Adam, repeated tokens", adam_sparse.sparse_vs_dense / adam_sparse.dense_update_max_abs,
     adam_sparse.deduplicated_vs_dense / adam_sparse.dense_update_max_abs, "deduplicate"),
    ("4 · clip per micro-batch",
     clipping.clip_each_micro_batch_vs_big_batch.max_abs / update_scale,
     clipping.accumulating_optimizer_clip_vs_big_batch.max_abs / update_scale,
     "clip the accumulated update"),
]
FLOOR = 1e-9
fig, axis = plt.subplots(figsize=(9, 4.2))
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
# ## 6 · Which pattern to use
#
# | pattern | use it when | avoids |
# |---|---|---|
# | a custom loop with replica-local accumulators, Python deciding when to apply ([lesson 02](02_accumulate_in_custom_loop.ipynb); `GradientAccumulator`) | you own the training loop | `tf.cond` around sync points; k all-reduces per update; applying outside `strategy.run` |
# | `AccumulatingOptimizer` ([lesson 03](03_cond_and_merge_call.ipynb)): wraps any Keras optimizer, `model.fit` unchanged | you use `fit` and want callbacks and metrics per micro-batch | the `merge_call` RuntimeError of Keras' built-in `gradient_accumulation_steps` under `MirroredStrategy` (keras-team/keras#20582); the mask trick's drift; per-replica clipping |
# | a micro-batching `train_step` ([lesson 05](05_accumulate_in_train_step.ipynb); `MicroBatching`): one `fit` step = one update | only the activations of the big batch do not fit | `g += _g` rebinding; ragged micro-batches; extra all-reduces |
# | any of the above on `MultiWorkerMirroredStrategy` ([lesson 06](06_multi_worker.ipynb)) | more than one machine | dead workers hanging the job (set a collective timeout) |
#
# Whatever the pattern: normalize by the **update's** example or token count (section 1),
# don't expect BatchNorm to see the big batch (section 2), decide how sparse gradients are
# summed (section 3), clip and schedule per update (section 4).
#
# ## Takeaways
#
# * Normalize by the count of the whole update: all micro-batches, all replicas.
# * BatchNorm statistics can be synchronized across replicas, not across micro-batches;
#   its moving averages move once per micro-batch. LayerNorm accumulates exactly.
# * Keras 3's Adam squares an IndexedSlices' rows *before* summing duplicates: sparse and
#   dense gradients give different updates when tokens repeat; deduplicate.
# * Clip the accumulated gradient; let schedules count updates.
#
# ## Exercises
#
# 1. Rerun section 1 with `mean_of_means.reproduce(micro_batches=4, strategy=strategy)`:
#    does the mean of means get further from the big batch with more, smaller
#    micro-batches?
# 2. Which other Keras optimizers care about repeated tokens? Try
#    `sparse_duplicates.reproduce((1, 1, 2), optimizer_factory=lambda:
#    keras.optimizers.Adagrad(0.1))`, then `RMSprop(0.01)` and `SGD(0.1, nesterov=True,
#    momentum=0.9)`, and predict from each `update_step` (`show_code(...)`) first.
# 3. Does clipping each micro-batch matter when the clip never acts? Rerun section 4 with
#    `clip_per_micro_batch.reproduce(strategy, clip_norm=100.0)` and read the first row.
#
# ## Further reading
#
# * huggingface/transformers#34191: token-count normalization across accumulation steps.
# * Keras `BatchNormalization(synchronized=True)`; `keras/src/layers/normalization/
#   batch_normalization.py`.
# * keras-team/keras#19992 (sparse gradients in Keras 3's optimizers),
#   tensorflow/tensorflow#28090 (duplicate indices and `_deduplicate_indexed_slices`).
