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
# regression model. Real models bring padding, BatchNorm, embeddings, clipping, schedules
# and restarts. Each section reproduces the mistake, explains it from the installed
# source, and shows what `distgrad` does about it.

# %%
import distgrad

strategy = distgrad.make_strategy()
R = strategy.num_replicas_in_sync
distgrad.environment_report(strategy)

# %%
import keras
import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")  # fresh tf.functions per experiment, on purpose

# %% [markdown]
# ## 1 · Uneven micro-batches: the mean of means is not the mean
#
# With padded sequences each micro-batch holds a different number of real tokens. The
# big-batch loss is `sum(loss · mask) / total_tokens`. A loop that takes each
# micro-batch's token mean and averages those means gives a token in a short micro-batch
# more weight than one in a long micro-batch. (This is the bug several major training
# libraries shipped and fixed in 2024.) Normalize every micro-batch's masked *sum* by the
# token count of the whole update instead — across micro-batches **and** replicas
# (`distgrad.normalization.global_token_count` all-reduces the count once).

# %%
from distgrad.pitfalls import mean_of_means

uneven = mean_of_means.reproduce(micro_batches=2, strategy=strategy)
print(uneven)
assert len(set(uneven.token_counts)) > 1
assert uneven.mean_of_means_vs_big_batch > 0.1 * uneven.gradient_scale  # wrong by >10%
assert uneven.global_count_vs_big_batch <= 1e-6  # right
assert uneven.per_replica_mean_vs_big_batch > 0.1 * uneven.gradient_scale
assert uneven.global_count_across_replicas_vs_big_batch <= 1e-6

# %% [markdown]
# ## 2 · BatchNorm: statistics are per forward pass
#
# In training mode `BatchNormalization` uses the statistics of the batch it sees: B/R
# examples per replica, B/k per micro-batch. That changes the function being
# differentiated, so no gradient bookkeeping can recover the big-batch step.
# `BatchNormalization(synchronized=True)` all-reduces the statistics across replicas
# and *does* recover it; across sequential micro-batches nothing can — the later
# micro-batches' statistics don't exist yet when the first one runs.

# %%
from distgrad.pitfalls import batchnorm_statistics

bn = batchnorm_statistics.reproduce(strategy, micro_batches=2)
print(f"one-device update (max abs):         {bn.one_device_update_max_abs:.3e}")
print(f"{R} replicas, plain BatchNorm:         {bn.replicas_plain_bn.max_abs:.3e}")
print(f"{R} replicas, synchronized=True:       {bn.replicas_synchronized_bn.max_abs:.3e}")
print(f"2 accumulated micro-batches, 1 device: {bn.accumulated_micro_batches.max_abs:.3e}")
assert bn.replicas_plain_bn.max_abs > 0.01 * bn.one_device_update_max_abs
assert bn.replicas_synchronized_bn.within()
assert bn.accumulated_micro_batches.max_abs > 0.01 * bn.one_device_update_max_abs

# %% [markdown]
# What to do: prefer normalizations without batch statistics (LayerNorm, GroupNorm) when
# you accumulate; use `synchronized=True` across replicas; and know that with k
# micro-batches the moving averages are also updated k times per optimizer update.
#
# ## 3 · Sparse gradients: the same gradient, two Adam updates
#
# An `Embedding` lookup's gradient is a `tf.IndexedSlices` with one row per *lookup*: a
# token that appears twice appears twice in `indices`. Feed Keras 3's Adam that gradient
# as IndexedSlices, or densified, and the weights differ — but only on the repeated row:

# %%
from distgrad.lab.compare import check_close
from distgrad.pitfalls import sparse_duplicates

adam_sparse = sparse_duplicates.reproduce(tokens=(1, 1, 2))
adam_unique = sparse_duplicates.reproduce(tokens=(1, 2, 3))
print(adam_sparse)
print(adam_unique)
assert adam_sparse.sparse_vs_dense > 1e-3 and adam_sparse.rows_differing == (1,)
assert adam_unique.sparse_vs_dense == 0.0
assert adam_sparse.deduplicated_vs_dense == 0.0

# %% [markdown]
# **Why**, from the installed source: in `Adam.update_step`
# (`keras/src/optimizers/adam.py`), `ops.subtract(gradient, m)` densifies the
# IndexedSlices — so every row's first moment decays, touched or not (untouched rows are
# *not* the difference). But `ops.square(gradient)` is an elementwise op that Keras
# applies to the IndexedSlices' *values* (`elementwise_unary` in
# `keras/src/backend/tensorflow/sparse.py`), before the duplicate rows are summed: the
# second moment gets a² + b² where the dense gradient gives (a + b)². `global_clipnorm`
# likewise computes the norm over the duplicated rows. Linear updates (SGD, momentum)
# are unaffected. See keras-team/keras#19992 for how Keras 3's optimizers treat sparse
# gradients, and tensorflow/tensorflow#28090 for TF1's `_deduplicate_indexed_slices`.

# %%
clip = sparse_duplicates.reproduce((1, 1, 2), optimizer_factory=lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5))
momentum = sparse_duplicates.reproduce((1, 1, 2), optimizer_factory=lambda: keras.optimizers.SGD(0.1, momentum=0.9))
print("global_clipnorm:", clip)
print("momentum:       ", momentum)
assert clip.sparse_vs_dense > 1e-3 and clip.deduplicated_vs_dense == 0.0
assert momentum.sparse_vs_dense <= 1e-6

# %% [markdown]
# **What this means for accumulation.** An accumulator that densifies computes the
# *dense* (mathematically exact) update, which is what Keras' big-batch step computes
# only when no token repeats. Deduplicating first (`distgrad.sparse.deduplicate`) makes the
# sparse path exact too, at the price of a `tf.unique`. Memory: a dense buffer costs the
# whole table, a sparse one only the touched rows:

# %%
from distgrad.sparse import deduplicate, dense_bytes, sparse_bytes

vocab, dim, batch_tokens = 50_000, 64, 4_096
table = tf.Variable(tf.zeros([vocab, dim]))
token_ids = tf.constant(np.random.default_rng(0).integers(0, vocab, batch_tokens))
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.gather(table, token_ids))
gradient = tape.gradient(loss, table)
print(f"dense buffer:  {dense_bytes(gradient) / 2**20:.1f} MiB")
print(f"sparse (raw):  {sparse_bytes(gradient) / 2**20:.1f} MiB, {len(gradient.indices)} rows")
unique = deduplicate(gradient)
print(f"sparse (dedup): {sparse_bytes(unique) / 2**20:.1f} MiB, {len(unique.indices)} rows")
assert sparse_bytes(unique) < sparse_bytes(gradient) < dense_bytes(gradient)
np.testing.assert_array_equal(tf.convert_to_tensor(unique), tf.convert_to_tensor(gradient))

# %% [markdown]
# ## 4 · Clipping and schedules belong to the update, not the micro-step
#
# Clipping by global norm is not linear: clip(g₁) + clip(g₂) ≠ clip(g₁ + g₂). A loop that
# clips each micro-batch before accumulating — which is what an optimizer with
# `global_clipnorm` does when it is applied every micro-step, as in the 0/1 mask trick —
# computes another update than the big batch. `AccumulatingOptimizer` takes the clipping
# off its inner optimizer and clips the accumulated, all-reduced gradient (lesson 03).
# A learning-rate schedule on the inner optimizer is evaluated at the inner
# `iterations`, which counts *updates*.

# %%
from distgrad.pitfalls import clip_per_micro_batch

clip = clip_per_micro_batch.reproduce(strategy)
print(f"big-batch update (max abs):            {clip.big_batch_update_max_abs:.3e}")
print(f"clip each micro-batch, then sum:       {clip.clip_each_micro_batch_vs_big_batch}")
print(f"AccumulatingOptimizer(global_clipnorm): {clip.accumulating_optimizer_clip_vs_big_batch}")
print(f"schedule, {clip.updates} updates / {clip.micro_steps} micro-steps: "
      f"{clip.schedule_accumulating_vs_big_batch}")
assert clip.clip_each_micro_batch_vs_big_batch.max_abs > 0.1 * clip.big_batch_update_max_abs
assert clip.accumulating_optimizer_clip_vs_big_batch.within()
assert (clip.updates, clip.micro_steps) == (2, 8)
assert clip.schedule_accumulating_vs_big_batch.within()
assert clip.schedule_vs_constant_learning_rate.max_abs > 1e-2  # the schedule really changed lr

# %% [markdown]
# ## 5 · Resume mid-accumulation, in a fresh process
#
# Save after 6 micro-batches — one update done, 2 of the next 4 micro-batches
# accumulated — with `model.save`. A **new Python process** loads the model under its
# own `MirroredStrategy` and fits the rest. `distgrad.lab.resume` runs both phases as
# fresh processes; we compare with one uninterrupted run here.

# %%
import tempfile

from distgrad.lab import resume

report = resume.resume_in_fresh_processes(tempfile.mkdtemp(prefix="distgrad-resume-"), replicas=R)
print({k: v for k, v in report.items() if k != "weights"})
print("resumed vs uninterrupted:", check_close(report["weights"], resume.uninterrupted_weights(strategy)))
assert (report["rest"]["restored_iterations"], report["rest"]["restored_micro_steps"]) == (1, 6)
assert (report["rest"]["iterations"], report["rest"]["micro_steps"]) == (2, 8)

# %% [markdown]
# The checkpoint holds the optimizer's micro-step counter and its float32 accumulators
# (saved as their sum over replicas, restored as sum / R on each replica), so the
# interrupted cycle continues where it stopped.
#
# ## 6 · Which pattern to use
#
# | pattern | use it when | avoids | you may know it as |
# |---|---|---|---|
# | `GradientAccumulator` (lesson 02) — custom loop, two `tf.function`s, Python decides when to apply | you own the training loop | `tf.cond` around sync points; k all-reduces per update; applying outside `strategy.run` | OpenNMT-tf's trainer; PyTorch DDP `no_sync()` + one `step()` |
# | `AccumulatingOptimizer` (lesson 03) — wraps any Keras optimizer, `model.fit` unchanged | you use `fit` and want callbacks/metrics per micro-batch | the `merge_call` RuntimeError of Keras' built-in `gradient_accumulation_steps` under MirroredStrategy (keras-team/keras#20582); the mask trick's drift; per-replica clipping; replica-0-only overflow check | optax `MultiSteps`; Keras `gradient_accumulation_steps` (works without a strategy) |
# | `MicroBatching` `train_step` (lesson 05) — one `fit` step = one update | memory is the limit and one progress-bar step per update is fine | `g += h` rebinding; ragged micro-batches; extra all-reduces | a `train_step` with a `tf.while_loop` over slices |
# | any of the above on `MultiWorkerMirroredStrategy` (lesson 06) | more than one machine | dead workers hanging the job (set a collective timeout) | `torch.distributed` with several nodes |
#
# Whatever the pattern: normalize by the **update's** example or token count (section 1),
# don't expect BatchNorm to see the big batch (section 2), decide how sparse gradients are
# summed (section 3), clip and schedule per update (section 4).
#
# ## Takeaways
#
# * Normalize by the count of the whole update — all micro-batches, all replicas.
# * BatchNorm statistics can be synchronized across replicas, not across micro-batches.
# * Keras 3's Adam squares an IndexedSlices' rows *before* summing duplicates: sparse and
#   dense gradients give different updates when tokens repeat; deduplicate.
# * Clip the accumulated gradient; let schedules count updates.
# * Accumulator state is checkpointable: resuming mid-cycle in a new process is exact.
