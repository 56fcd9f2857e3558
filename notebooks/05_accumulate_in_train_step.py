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
# **The question** ([Q4](../questions.md#q4), Stack Overflow, TF 2.3–2.4). A `train_step`
# override splits each batch into micro-batches in a `tf.while_loop` and sums their gradients
# with `for g, _g in zip(grad, _grad): g += _g`. Memory goes down, but training no longer
# matches plain `fit`. What should an accumulator inside `fit` look like?
#
# **Short answer.** `g += _g` sums nothing: a `tf.Tensor` cannot change in place, so Python
# runs `g = g + _g`, binding the name `g` to a new tensor while the list keeps the old ones;
# each step applies the first micro-batch's gradient. Return new tensors from the loop body,
# divide each micro-batch's loss by k, slice the batch *this replica received* (every input,
# target and weight, with `tf.nest`), and call `apply_gradients` once, after the loop. Under
# `MirroredStrategy` (one model copy, a *replica*, per device) that call does the step's one
# **all-reduce**: the sum of the replicas' gradients.

# %%
import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # for the memory deep dive's CPU statistics
import tensorflow as tf

import distgrad
import distgrad_course
from distgrad_course.lab.display import show_code, show_environment, show_table

tf.get_logger().setLevel("ERROR")  # fresh models retrace on purpose; silence the notes

strategy = distgrad_course.make_strategy()  # first: logical devices must exist before TF starts
R = strategy.num_replicas_in_sync
assert R >= 2, "this lesson compares R >= 2 replicas with one device: set DISTGRAD_REPLICAS"
show_environment(distgrad_course.environment_report(strategy))

# %% [markdown]
# ## 1 · The fix
#
# Keras calls `train_step` for every batch of `fit`, on each replica with its share. Below:
# k micro-batches in a `tf.while_loop`, one `apply_gradients` after it, on a two-output model
# with sample weights fed by `tf.data`. It runs as it is in a file of its own.

# %% tags=["fix"]
import keras
import numpy as np
import tensorflow as tf

# Two or more replicas: your GPUs, or two logical CPUs on a machine without GPUs.
cpu, gpus = tf.config.list_physical_devices("CPU")[0], tf.config.list_physical_devices("GPU")
if not gpus and not tf.config.get_logical_device_configuration(cpu):
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.experimental.enable_tensor_float_32_execution(False)  # exact float32 for the check
strategy = tf.distribute.MirroredStrategy(
    tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU"))

class FixedGradAccumModel(keras.Model):
    def __init__(self, *args, accumulation_steps=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.accumulation_steps = accumulation_steps

    def train_step(self, data):
        k, replicas = self.accumulation_steps, self.distribute_strategy.num_replicas_in_sync
        n = tf.shape(tf.nest.flatten(data)[0])[0]  # the batch THIS replica received
        with tf.control_dependencies([tf.debugging.assert_equal(n % k, 0, message=(
                "the batch does not split into k micro-batches: drop_remainder=True"))]):
            size = n // k
        loss_metric = next(m for m in self.metrics if m.name == "loss")  # compile's loss mean

        def body(i, sums):  # micro-batch i: slice every input, target and sample weight
            x, y, w = keras.utils.unpack_x_y_sample_weight(tf.nest.map_structure(
                lambda t: t[i * size:(i + 1) * size], data))
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x, y, y_pred, sample_weight=w, training=True)
                scaled = self.optimizer.scale_loss(loss / k)  # k means sum to the batch mean
            grads = tape.gradient(scaled, self.trainable_variables)
            loss_metric.update_state(loss * replicas, sample_weight=size)  # as Keras' step does
            self.compute_metrics(x, y, y_pred, sample_weight=w)
            return i + 1, [s + g for s, g in zip(sums, grads)]  # new tensors, returned

        zeros = [tf.zeros(v.shape, v.dtype) for v in self.trainable_variables]
        _, sums = tf.while_loop(lambda i, _: i < k, body, [tf.constant(0), zeros],
                                parallel_iterations=1)  # one micro-batch in memory at a time
        self.optimizer.apply_gradients(zip(sums, self.trainable_variables))  # the all-reduce
        return self.get_metrics_result()

def build(model_class, **kwargs):  # two outputs: a nested y to slice
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return model_class(inputs, [keras.layers.Dense(1)(hidden), keras.layers.Dense(2)(hidden)],
                       **kwargs)

K, GLOBAL_BATCH = 4, 4 * 2 * strategy.num_replicas_in_sync  # micro-batches of 2 examples
rng = np.random.default_rng(0)
x = rng.normal(size=(3 * GLOBAL_BATCH + 5, 4)).astype("float32")  # 3 batches, 5 left over
targets = (x[:, :1] - x[:, 1:2], np.tanh(x[:, 2:]))
weights = rng.uniform(0.5, 1.5, size=len(x)).astype("float32")
# Epoch end: the 5 examples left over are dropped (drop_remainder); every step is a whole
# update, so nothing carries over. A batch that does not split fails the assertion above.
dataset = tf.data.Dataset.from_tensor_slices((x, targets, weights)).batch(
    GLOBAL_BATCH, drop_remainder=True)
with strategy.scope():
    model = build(FixedGradAccumModel, accumulation_steps=K)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=["mse", "mse"])
initial = model.get_weights()
history = model.fit(dataset, epochs=2, shuffle=False, verbose=0)  # shuffle in the pipeline
print(f"{strategy.num_replicas_in_sync} replicas x {K}:", np.round(history.history["loss"], 6))

# %% [markdown]
# A batch that does not split fails the step's assertion instead of silently skipping
# examples ([run](#deep-dive-the-limits-run)). The check: plain Keras, one device, one
# big-batch step per batch.

# %% tags=["check"]
reference = build(keras.Model)  # plain Keras, one device: no strategy scope
reference.set_weights(initial)
reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=["mse", "mse"])
expected = reference.fit(dataset, epochs=2, shuffle=False, verbose=0)  # one step per batch
for ours, theirs in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)
assert model.optimizer.iterations.numpy() == reference.optimizer.iterations.numpy() == 6
print("two outputs, sample weights: weights and losses equal one device, big batch")

# %% [markdown]
# ## 2 · Why it works
#
# **`g += _g` rebinds a name.** The loop binds the name `g` to each list element in turn.
# `tf.Tensor` has no `__iadd__`, so `g += _g` runs `g = g + _g`: the name holds a new tensor,
# the list is untouched. (NumPy arrays do add in place: the line looks right.) And
# `tf.while_loop` runs its Python body once, to trace it: only what the body returns reaches
# the next iteration. The question's body and the accepted answer's, which
# `compound_assignment.reproduce` runs for three iterations from `[[1, 2], 10]`:

# %%
from IPython.display import display

from distgrad_course.pitfalls import compound_assignment

display(show_code(compound_assignment.compound_body), show_code(compound_assignment.returned_body))

# %%
record = compound_assignment.reproduce(iterations=3)
print("start", record.initial, "| g += _g:", record.compound_in_while_loop,
      "| returned:", record.returned_in_while_loop)
assert not record.tensor_has_iadd  # so `g += _g` is `g = g + _g`
assert record.compound_in_while_loop == record.initial == [[1.0, 2.0], 10.0]  # nothing summed
assert record.returned_in_while_loop == record.expected == [[7.0, 8.0], 70.0]

# %% [markdown]
# So in `fit` the question's step is one plain step on the first micro-batch.
# `reproduce_in_fit` runs its `train_step` (Keras 3 spelling; shown in the deep dive below)
# for one SGD step, 16 examples, k = 4:

# %%
in_fit = compound_assignment.reproduce_in_fit(micro_batches=4, examples=16)
print(f"max abs diff to a plain step on the first micro-batch "
      f"{in_fit.vs_first_micro_batch.max_abs:.1e}, on the batch {in_fit.vs_full_batch.max_abs:.1e}")
assert in_fit.vs_first_micro_batch.within() and not in_fit.vs_full_batch.within()

# %% [markdown]
# ### Deep dive · The question's `train_step`, run as posted
#
# The question's `GradAccumModel`, as posted. It runs on Keras 3 unchanged: `keras.Model`
# is what `tensorflow.keras.models.Model` imports since TF 2.16, and Keras 3 keeps
# `compiled_loss` and `compiled_metrics` as deprecated shims (they warn, below).

# %%
import warnings

from distgrad_course.lab.compare import check_close, weight_diff, weights_of
from distgrad_course.lab.data import regression_data, tiny_model

tf.get_logger().setLevel("ERROR")  # fresh models retrace on purpose; silence the notes


class GradAccumModel(keras.Model):
    def fit(self, *args, batch_size = 32, grad_accum = 1, **kwargs):
        self.train_function = None
        if batch_size % grad_accum != 0:
            raise ValueError('Batch size must be divisible by the Gradient accumulation steps, dummy!')
        self.grad_accum = grad_accum
        self.batch_size = batch_size
        return super(GradAccumModel, self).fit(*args,  # noqa: UP008 - as posted
                                               batch_size = self.batch_size,
                                               **kwargs)

    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            (x, y), sample_weight = data, None

        step = self.batch_size // self.grad_accum

        # FIRST GRADIENT
        with tf.GradientTape() as tape:
            y_pred = self(x[:step], training = True)  # Forward pass
            loss = self.compiled_loss(y[:step], y_pred, sample_weight = sample_weight, regularization_losses = self.losses)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.compiled_metrics.update_state(y[:step], y_pred)

        i = tf.constant(step)
        def cond(i, *args):
            return i < self.batch_size
        def body(i, grad):
            with tf.GradientTape() as tape:
                y_pred = self(x[i:i + step], training = True) # Forward pass
                loss = self.compiled_loss(y[i:i + step], y_pred, sample_weight = sample_weight, regularization_losses = self.losses)
            _grad = tape.gradient(loss, self.trainable_variables)

            for g,_g in zip(grad, _grad):
                g += _g

            self.compiled_metrics.update_state(y[i:i + step], y_pred)
            return [i + step, grad]

        i, gradients = tf.while_loop(cond, body, [i, gradients], parallel_iterations = 1)

        # Update weights
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {m.name: m.result() for m in self.metrics}


# %% [markdown]
# One SGD step on a batch of 16, `grad_accum=4` (micro-batches of 4), on one device as in
# the question, next to plain Keras on the whole batch and on the first micro-batch only:

# %%
x16, y16 = regression_data(16)


def one_step(model, x, y, **fit_kwargs):
    """Compile `model` with SGD(0.1), MSE and MAE; fit one step on the batch (x, y)."""
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0,
                        **fit_kwargs)
    return model, {key: values[0] for key, values in history.history.items()}


def question_model():
    base = tiny_model()
    return GradAccumModel(base.inputs, base.outputs)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    question, question_logs = one_step(question_model(), x16, y16, grad_accum=4)
    question_k1, _ = one_step(question_model(), x16, y16, grad_accum=1)
deprecations = sorted({str(w.message).split(". ")[0] for w in caught
                       if "deprecated" in str(w.message)})
print("Keras warns:", *deprecations, sep="\n  ")
assert deprecations == ["`model.compiled_loss()` is deprecated",
                        "`model.compiled_metrics()` is deprecated"]
full_batch, full_logs = one_step(tiny_model(), x16, y16)
first_micro_batch, _ = one_step(tiny_model(), x16[:4], y16[:4])

vs_first = weight_diff(weights_of(question), weights_of(first_micro_batch))
vs_full = weight_diff(weights_of(question), weights_of(full_batch))
k1_vs_full = weight_diff(weights_of(question_k1), weights_of(full_batch))
show_table(["the question's model", "max abs diff to: full-batch step", "first micro-batch step"],
           [("grad_accum=4", f"{vs_full.max_abs:.3e}", f"{vs_first.max_abs:.3e}"),
            ("grad_accum=1 (the loop never runs)", f"{k1_vs_full.max_abs:.3e}", "")])
assert vs_first.within() and not vs_full.within()  # it trained on the first quarter only
assert k1_vs_full.within()

# %% [markdown]
# The history is wrong as well. The `mae` is right (the metric sees every slice), but the
# reported `loss` is the mean *prediction*: the `compiled_metrics` shim feeds `y_pred` to
# every `Mean` metric, and Keras 3's loss tracker is one
# (`keras/src/backend/tensorflow/trainer.py`, `_compiled_metrics_update_state`).

# %%
mean_prediction = float(np.mean(tiny_model()(x16)))  # the weights before the step
show_table(["", "question's `fit`", "plain `fit`"],
           [("loss", f"{question_logs['loss']:.6f}", f"{full_logs['loss']:.6f}"),
            ("mae", f"{question_logs['mae']:.6f}", f"{full_logs['mae']:.6f}")])
print(f"mean prediction of the initial model: {mean_prediction:.6f}")
assert abs(question_logs["loss"] - mean_prediction) <= 1e-6
assert abs(question_logs["mae"] - full_logs["mae"]) <= 1e-6
assert abs(question_logs["loss"] - full_logs["loss"]) > 1.0

# %% [markdown]
# `reproduce_in_fit` (section 2 above) runs the same step in Keras 3 spelling
# (`compute_loss` for the removed `compiled_loss`), with or without the accepted fix:

# %%
show_code(compound_assignment.QuestionGradAccumModel.train_step)

# %% [markdown]
# ### Deep dive · `+=` on tensors, variables and NumPy arrays
#
# The rest of `compound_assignment.reproduce`'s record: a `tf.Variable` with `assign_add` in
# the loop body, the question's body run eagerly in a plain Python loop, and NumPy arrays.

# %%
show_code(compound_assignment.reproduce)

# %%
rows = [("`g += _g` in `tf.while_loop` (the question)", record.compound_in_while_loop),
        ("`grad = [g + _g ...]`, returned (the answer)", record.returned_in_while_loop),
        ("`tf.Variable.assign_add` in the body", record.variable_assign_add),
        ("`g += _g`, eager Python loop", record.eager_python_loop),
        ("`g += _g` on NumPy arrays", record.numpy_in_place)]
show_table(["pattern", "after 3 iterations", "accumulated?"],
           [(name, value, "yes" if value == record.expected else "no") for name, value in rows])
assert record.variable_assign_add == record.expected  # state change, not a name
assert record.eager_python_loop == record.initial  # same no-op without any graph
assert record.numpy_in_place == record.expected  # ndarray.__iadd__ works in place

# %% [markdown]
# Variables are the other way to hold state: `tf.Variable.__iadd__` refuses `+=` with an
# error that names the fix, while a Keras 3 `keras.Variable` has no `__iadd__` at all, so
# `+=` rebinds the name to a plain tensor, silently, as with a tensor:

# %%
show_table(["", "`+=`"],
           [("`tf.Tensor` has `__iadd__`", record.tensor_has_iadd),
            ("`np.ndarray` has `__iadd__`", record.ndarray_has_iadd),
            ("`tf.Variable += 1.0`", f"{record.tf_variable_iadd_error.type}: "
                                     + "... Use `variable.assign_add(value)` ..."),
            ("`keras.Variable += 1.0`",
             f"the name now holds an {record.keras_variable_rebound_to}; "
             + f"the variable still reads {record.keras_variable_value_after}")])
assert not record.tensor_has_iadd and record.ndarray_has_iadd
assert record.tf_variable_iadd_error.type == "RuntimeError"
assert record.tf_variable_iadd_error.contains(
    "`variable += value` with `tf.Variable`s is not supported. Use `variable.assign_add(value)`")
assert record.keras_variable_rebound_to == "EagerTensor"
assert record.keras_variable_value_after == 1.0

# %% [markdown]
# ### Deep dive · `tf.while_loop` traces its body once; Keras traces without AutoGraph
#
# `tf.while_loop(cond, body, loop_vars)` runs the Python `body` *once*, to trace it into the
# body of a `While` op; the values it returns become the next iteration's inputs. A Python
# side effect in the body happens once, at trace time, however many iterations run:

# %%
import inspect

body_traces = []


def counting_body(i, total):
    body_traces.append(i)  # Python: runs while tracing, not per iteration
    return i + 1, total + 1.0


@tf.function
def three_iterations():
    return tf.while_loop(lambda i, _: i < 3, counting_body, [tf.constant(0), tf.constant(0.0)])


_, total = three_iterations()
loop_ops = {op.type for op in three_iterations.get_concrete_function().graph.get_operations()}
print(f"loop result {float(total)}, Python body ran {len(body_traces)} time(s), "
      f"While ops in the graph: {sorted(loop_ops & {'While', 'StatelessWhile'})}")
assert float(total) == 3.0 and len(body_traces) == 1
assert loop_ops & {"While", "StatelessWhile"}

# %% [markdown]
# Two choices in the fix come from TensorFlow, not from the question:
#
# * **An explicit `tf.while_loop`.** Keras traces `train_step` without AutoGraph
#   (`tf.autograph.experimental.do_not_convert` in `TensorFlowTrainer._make_function`),
#   so a Python `for i in tf.range(k)` does not become a loop; it fails (below).
# * **`parallel_iterations=1`.** The default lets `tf.while_loop` run up to 10 iterations
#   at once; the next micro-batch's forward pass does not depend on this one's gradients,
#   so several micro-batches' activations could be alive together, which is the memory
#   accumulation exists to save.

# %%
class RangeLoopModel(keras.Model):
    def train_step(self, data):
        total = tf.constant(0.0)
        for _ in tf.range(2):
            total += 1.0
        return {"total": total}


base = tiny_model()
range_model = RangeLoopModel(base.inputs, base.outputs)
range_model.compile(optimizer="sgd", loss="mse")
try:
    range_model.fit(x16, y16, batch_size=16, verbose=0)
    range_error = None
except tf.errors.OperatorNotAllowedInGraphError as err:
    range_error = str(err)
print("for i in tf.range(k) in train_step:\n ", range_error[:62], "...")
default_parallel = inspect.signature(tf.while_loop).parameters["parallel_iterations"].default
print("tf.while_loop's default parallel_iterations:", default_parallel)
assert range_error.startswith("Iterating over a symbolic `tf.Tensor` is not allowed")
assert default_parallel == 10

# %% [markdown]
# ### The sum is the big-batch gradient, with one all-reduce
#
# `compute_loss` returns a micro-batch's mean loss divided by R (Keras'
# `scale_loss_for_distribution`). Divided by k too, a replica's k losses add up to its batch
# mean / R; the SUM all-reduce in `apply_gradients` adds the replicas: the gradient of the
# batch mean, as on one device. (Equal micro-batches make the mean of means the mean.) The
# loop body has no `apply_gradients`, so nothing in it synchronizes:
#
# ```mermaid
# flowchart LR
#     D["batch of B"] --> R0["replica 0, B/R examples:<br/>k micro-batches, sum of grad(loss / k)"]
#     D --> R1["replica 1: the same"]
#     R0 & R1 --> A["apply_gradients:<br/>one SUM all-reduce, one update"]
# ```
#
# `fit_step_placement` traces the function `fit` runs each step and counts its all-reduces
# per replica, and those inside a loop body (they would run k times):

# %%
from distgrad_course.lab.graph import fit_step_placement

R = strategy.num_replicas_in_sync  # from here on the fix cell's strategy is the lesson's
ours = fit_step_placement(model, x, targets, GLOBAL_BATCH)
print(f"all-reduces per step: {ours.all_reduces}, inside the while loop: {ours.in_while_bodies}")
assert ours.all_reduces == 1 and ours.in_while_bodies == 0 and ours.while_loops == 1

# %% [markdown]
# ### Deep dive · How the all-reduces are counted, and plain Keras beside the fix
#
# `fit_step_placement` builds `fit`'s train function, traces it on a distributed iterator,
# and hands the graph (every function it calls, loop bodies and `tf.cond` branches
# included) to `placement_of_graph`:

# %%
from distgrad_course.lab.graph import placement_of_graph

display(show_code(fit_step_placement), show_code(placement_of_graph))

# %% [markdown]
# Plain Keras under the same strategy has the same one all-reduce, and no loop:

# %%
with strategy.scope():
    plain = build(keras.Model)
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss=["mse", "mse"])
plain.fit(dataset, epochs=1, shuffle=False, verbose=0)  # builds the optimizer first
theirs = fit_step_placement(plain, x, targets, GLOBAL_BATCH)
show_table(["`fit` step", "all-reduces", "inside the loop body", "while loops"],
           [(f"the fix, k={K}", ours.all_reduces, ours.in_while_bodies, ours.while_loops),
            ("plain Keras", theirs.all_reduces, theirs.in_while_bodies, theirs.while_loops)])
assert ours.all_reduces == theirs.all_reduces == 1
assert ours.in_while_bodies == 0 and ours.while_loops == 1

# %% [markdown]
# ## 3 · The packaged form
#
# `distgrad.MicroBatchingModel(inputs, outputs, accumulation_steps=k)` is this `train_step`
# plus a batch check that names the sizes that work, a policy for non-finite steps
# (`non_finite=`), and a refusal, at the start of `fit`, of what cannot run (Limits); its
# code in the deep dive below. Subclassed models take the mixin,
# `class MyModel(distgrad.MicroBatching, keras.Model)`. The fix cell's model and data:

# %%
with strategy.scope():
    packaged = build(distgrad.MicroBatchingModel, accumulation_steps=K)
    packaged.compile(optimizer=keras.optimizers.Adam(0.01), loss=["mse", "mse"])
packaged.set_weights(initial)
packaged.fit(dataset, epochs=2, shuffle=False, verbose=0)
diff = check_close(weights_of(packaged), weights_of(model))
print(f"MicroBatchingModel vs the fix cell's model: max abs diff {diff.max_abs:.1e}")

# %% [markdown]
# <div class="admonition warning">
# <p class="admonition-title">Limits</p>
#
# * **BatchNorm** in training mode normalizes each micro-batch by its own statistics and
#   moves its averages k times per step ([pitfall](../pitfalls.md#batchnorm-statistics),
#   shown in [lesson 07](07_beyond_the_basics.ipynb)).
# * **Dropout** draws a new mask per micro-batch: the same training in distribution, not
#   the same numbers ([run](#deep-dive-the-limits-run)).
# * **A batch that does not split** into k equal micro-batches per replica fails the step:
#   batch with `drop_remainder=True` ([run](#deep-dive-the-limits-run)).
# * **`steps_per_execution > 1`** and **`jit_compile=True`** on several replicas fail in
#   stock Keras too ([upstream](../upstream.md#steps-per-execution), keras-team/keras#19005);
#   `MicroBatching` refuses them, naming the fix ([run](#deep-dive-the-limits-run)).
# * **`mixed_float16` on several replicas**: `compile` wraps the fix cell's optimizer in
#   Keras' `LossScaleOptimizer`, which checks replica 0's gradients only, so another
#   replica's overflow reaches the weights. Compile with
#   `distgrad.AllReplicasFiniteLossScaleOptimizer(optimizer)` ([run](#deep-dive-mixed-precision)).
# * **Validation is not micro-batched**: `test_step` is Keras' own, and
#   `validation_batch_size` defaults to `batch_size`, the big batch. Pass the micro-batch
#   size, or batch a validation dataset so ([run](#deep-dive-the-limits-run)).
#
# </div>

# %% [markdown]
# ### In-step or cross-step accumulation?
#
# The fix's `train_step` splits *one* fit step; `AccumulatingOptimizer`
# ([lessons 02](02_accumulate_in_custom_loop.ipynb)–[03](03_cond_and_merge_call.ipynb))
# accumulates across *k* fit steps and updates on every k-th. Both make one update from
# k micro-batches with one all-reduce.
#
# | | in-step: this `train_step`, `MicroBatching` | cross-step: `AccumulatingOptimizer` |
# |---|---|---|
# | one fit step is | one update (`iterations` == steps: the check) | one micro-batch; k steps per update |
# | metrics in the history | those of the big batch (the check) | those of micro-batches |
# | data pipeline | yields the **big** batch (the input batch must fit in memory) | yields micro-batches |
# | k | a constant in the traced step | optimizer state |
# | state between steps | none: the sums are loop variables of one step | accumulator variables, checkpointed |
# | batch size constraint | every batch divisible by k x replicas (Limits) | none per batch |
#
# Choose in-step when you want `fit` to behave exactly as with the big batch and only the
# activations do not fit. Choose cross-step when even the input batch does not fit, or
# when the pipeline already produces small batches.

# %% [markdown]
# ## Deep dive · `MicroBatching`: its `train_step`, three optimizers, `fit`'s history
#
# `MicroBatching.train_step` is the fix cell's plus a check that names the batch sizes that
# work, a guard for XLA, and variables the loss does not reach (`None` gradients):

# %%
from distgrad.train_step import MicroBatching, check_micro_batches, with_micro_batches

show_code(MicroBatching.train_step)

# %% [markdown]
# Each run below trains for 2 epochs of 2 steps with `fit`: the fix (`FixedGradAccumModel`
# from the fix cell) and `MicroBatching` on R replicas with k = 4 micro-batches per
# replica, against plain Keras on one device with the whole batch, for SGD, momentum and
# Adam. Weights must agree to `rtol = atol = 1e-6`, and the `loss` and `mae` that `fit`
# reports must be the big-batch ones.

# %%
x_reg, y_reg = regression_data(2 * GLOBAL_BATCH)  # two fit steps per epoch
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}
one_device = tf.distribute.get_strategy()


def fixed(model, accumulation_steps):
    return FixedGradAccumModel(model.inputs, model.outputs, accumulation_steps=accumulation_steps)


def fit(on, optimizer, accumulation_steps=None, wrap=fixed, model_factory=tiny_model,
        data=(x_reg, y_reg), epochs=2, metrics=("mae",)):
    """Fit a fresh model; accumulation_steps=None is plain Keras."""
    with on.scope():
        model = model_factory()
        if accumulation_steps is not None:
            model = wrap(model, accumulation_steps)
        model.compile(optimizer=optimizer(), loss="mse", metrics=list(metrics))
    history = model.fit(*data, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


def same_history(actual, expected):
    return all(np.allclose(actual[key], expected[key], rtol=1e-6, atol=1e-6) for key in expected)


rows = []
for name, make in OPTIMIZERS.items():
    plain, plain_history = fit(one_device, make)
    ours, our_history = fit(strategy, make, K)
    packaged, packaged_history = fit(strategy, make, K, wrap=with_micro_batches)
    diff = check_close(weights_of(ours), weights_of(plain))
    packaged_diff = check_close(weights_of(packaged), weights_of(ours))
    check_close(weights_of(packaged), weights_of(plain))
    assert same_history(our_history, plain_history)
    assert same_history(packaged_history, plain_history)
    for trained in (ours, packaged):
        assert int(trained.optimizer.iterations.numpy()) == 4  # one update per fit step
    rows.append((name, f"{diff.max_abs:.1e}", f"{our_history['loss'][-1]:.6f}",
                 f"{plain_history['loss'][-1]:.6f}", int(ours.optimizer.iterations.numpy()),
                 f"{packaged_diff.max_abs:.1e}"))
show_table(["optimizer", f"{R} replicas x {K} vs 1 device: max abs diff",
            "last loss (ours)", "(big batch)", "updates", "`MicroBatching` vs ours"], rows)

# %% [markdown]
# ## Deep dive · The limits, run
#
# **A batch that does not split.** A last batch of `GLOBAL_BATCH - 2` examples (numpy input
# whose length is not a multiple of `batch_size`) does not split into k micro-batches per
# replica. The fix fails its assertion when that batch arrives; `MicroBatching` too, with a
# message that names the fix, and with static shapes already while tracing (`ValueError`
# from `check_micro_batches`). Without the assertion, `// k` would round the micro-batch
# size down and the examples after the k-th micro-batch would never be seen.

# %%
import textwrap

ragged_x, ragged_y = regression_data(2 * GLOBAL_BATCH - 2)


def ragged_error(wrap):
    try:
        fit(strategy, OPTIMIZERS["sgd"], K, wrap=wrap, data=(ragged_x, ragged_y), epochs=1)
    except tf.errors.InvalidArgumentError as err:
        line = next(line for line in str(err).splitlines() if "assertion failed" in line)
        return line[line.index("assertion failed"):].split("] [")[0] + "]"  # the message


fix_error, packaged_error = ragged_error(fixed), ragged_error(with_micro_batches)
print("the fix:", fix_error)
print(textwrap.fill("MicroBatching: " + packaged_error, 96))
assert "the batch does not split into k micro-batches" in fix_error
assert "drop_remainder=True" in packaged_error
assert f"not divisible by accumulation_steps={K} ({R} replica(s))" in packaged_error

try:
    check_micro_batches(12, 4, 2)
    split_error = None
except ValueError as err:
    split_error = str(err)
print(textwrap.fill(split_error, 96))
assert "multiple of accumulation_steps x replicas = 8 (e.g. 8 or 16)" in split_error

# %% [markdown]
# **Dropout.** Each forward pass draws a new mask. With k = 1 the micro-batching step draws
# the same mask as plain Keras and lands on the same weights; with k = 4 it draws four masks
# for four slices, and one SGD step lands elsewhere (one device, a seeded `Dropout`):

# %%
def dropout_step(accumulation_steps=None):
    init = keras.initializers.GlorotUniform
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(16, activation="tanh", kernel_initializer=init(seed=0))(inputs)
    hidden = keras.layers.Dropout(0.5, seed=1)(hidden)
    outputs = keras.layers.Dense(1, kernel_initializer=init(seed=1))(hidden)
    model = (keras.Model(inputs, outputs) if accumulation_steps is None else
             FixedGradAccumModel(inputs, outputs, accumulation_steps=accumulation_steps))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x16, y16, batch_size=16, shuffle=False, verbose=0)
    return weights_of(model)


with_dropout = dropout_step()
one_mask, four_masks = (weight_diff(dropout_step(k), with_dropout) for k in (1, 4))
print(f"Dropout, max abs diff to plain Keras: k=1 {one_mask.max_abs:.1e}, "
      f"k=4 {four_masks.max_abs:.1e}")
assert one_mask.within() and not four_masks.within()

# %% [markdown]
# **`steps_per_execution > 1` and `jit_compile=True` on several replicas.** Stock Keras
# fails there ([upstream](../upstream.md#steps-per-execution); keras-team/keras#19005 for XLA
# over devices that are not all GPUs). `MicroBatching` refuses both at the start of `fit`;
# on GPUs XLA can compile the step, but it compiles assertions out, so the default
# `non_finite="raise"` refuses at the first step. Each message names the fix:

# %%
refusals = {}
for flag in ({"steps_per_execution": 2}, {"jit_compile": True}):
    with strategy.scope():
        refused = with_micro_batches(tiny_model(), K)
        refused.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **flag)
    try:
        refused.fit(x_reg, y_reg, batch_size=GLOBAL_BATCH, verbose=0)
    except ValueError as err:
        refusals[next(iter(flag))] = str(err)
for name, message in refusals.items():
    fix = message[max(message.rfind("Compile with"), message.rfind("compile with")):]
    print(f"{name}:", textwrap.shorten(message, 80), "\n    ...", textwrap.shorten(fix, 90))
assert "Compile with steps_per_execution=1" in refusals["steps_per_execution"]
assert "jit_compile=False" in refusals["jit_compile"]

# %% [markdown]
# **Validation.** The fix overrides `train_step` only: `validation_data` goes through Keras'
# own `test_step`, one forward pass per validation batch, and for arrays that batch is
# `validation_batch_size`, by default `batch_size`, the big batch
# (`keras/src/backend/tensorflow/trainer.py`, `fit`). Counted by a callback:

# %%
class CountTestBatches(keras.callbacks.Callback):
    def on_test_begin(self, logs=None):
        self.batches = 0

    def on_test_batch_end(self, batch, logs=None):
        self.batches += 1


test_batches = {}
for validation_batch_size in (None, GLOBAL_BATCH // K):
    with strategy.scope():
        validated = fixed(tiny_model(), K)
        validated.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    counter = CountTestBatches()
    validated.fit(x_reg, y_reg, batch_size=GLOBAL_BATCH, validation_data=(x_reg, y_reg),
                  validation_batch_size=validation_batch_size, callbacks=[counter], verbose=0)
    test_batches[validation_batch_size] = counter.batches
print(f"validation batches over {len(x_reg)} examples: {test_batches}")
steps = len(x_reg) // GLOBAL_BATCH  # fit steps per epoch
assert test_batches == {None: steps, GLOBAL_BATCH // K: K * steps}  # big batches by default

# %% [markdown]
# ## Deep dive · Mixed precision
#
# Under `mixed_float16` the forward and backward passes run in float16: a different split
# of the batch changes float16 sums in the backward pass, so a big-batch step is not an
# exact reference. Two checks that are exact: (1) R replicas x 2 micro-batches equals
# 1 device x 2R micro-batches, because both see the same float16 slices of 4 examples and
# differ only in the 1/R and 1/k factors and in the order of float32 sums; (2) a step
# whose gradients overflow is skipped *once* and halves the loss scale *once*, not once
# per micro-batch. Both hold because the fix passes each micro-batch's loss through
# `optimizer.scale_loss` and the summed gradients to `apply_gradients` once.

# %%
def mixed_model():
    return tiny_model(dtype_policy="mixed_float16")


def lso_sgd(initial_scale=2.0 ** 15):
    return lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                       initial_scale=initial_scale)


replicas_run, replicas_history = fit(strategy, lso_sgd(), 2, model_factory=mixed_model)
device_run, device_history = fit(one_device, lso_sgd(), 2 * R, model_factory=mixed_model)
mixed_diff = check_close(weights_of(replicas_run), weights_of(device_run))
print(f"mixed_float16, {R} replicas x 2 vs 1 device x {2 * R}: "
      f"max abs diff {mixed_diff.max_abs:.1e}")
assert same_history(replicas_history, device_history)

overflow, _ = fit(strategy, lso_sgd(2.0 ** 10), K, model_factory=mixed_model,
                  data=(x_reg[:GLOBAL_BATCH] * 3e4, y_reg[:GLOBAL_BATCH]), epochs=1)
print("overflowing step: updates", int(overflow.optimizer.iterations.numpy()),
      "| loss scale 1024 ->", float(overflow.optimizer.dynamic_scale.numpy()))
assert int(overflow.optimizer.iterations.numpy()) == 0
assert float(overflow.optimizer.dynamic_scale.numpy()) == 2.0 ** 9

overflow_targets = y_reg[:GLOBAL_BATCH].copy()
overflow_targets[GLOBAL_BATCH // R:] = 6e4  # only the replicas after replica 0 overflow
stock, _ = fit(strategy, lso_sgd(2.0 ** 10), 2, model_factory=mixed_model,
               data=(x_reg[:GLOBAL_BATCH], overflow_targets), epochs=1)
stock_finite = all(np.isfinite(w).all() for w in weights_of(stock))
print("Keras' wrapper, overflow on replicas 1..R-1: updates",
      int(stock.optimizer.iterations.numpy()), "| finite weights", stock_finite)
assert int(stock.optimizer.iterations.numpy()) == 1 and not stock_finite  # applied: inf

# %% [markdown]
# One caveat belongs to Keras, not to accumulation
# ([lesson 04](04_loss_scale_optimizer_pitfall.ipynb)): under `MirroredStrategy` Keras 3's
# `LossScaleOptimizer` decides "all gradients finite?" from replica 0's *local* gradients,
# so an overflow on another replica only is applied to the weights (the last run above). Lesson 04's `AllReplicasFiniteLossScaleOptimizer` fixes it and
# drops into the fix's `train_step` unchanged: the overflow on the replicas after
# replica 0 is skipped, the step still has one all-reduce, and `fit` ends with a warning
# that counts the skip. (The packaged `MicroBatching` is right under Keras' own wrapper
# too: it hands it a NaN gradient on every replica when any replica overflowed;
# `tests/micro_batching/test_train_step.py` and `tests/test_user_paths.py` run it.)

# %%
from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    guarded, _ = fit(strategy, lambda: AllReplicasFiniteLossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0 ** 10), 2, model_factory=mixed_model,
        data=(x_reg[:GLOBAL_BATCH], overflow_targets), epochs=1)
told = [str(w.message) for w in caught if "skipped in this fit" in str(w.message)]
assert len(told) == 1 and "1 step(s) skipped in this fit" in told[0]
guarded_counts = fit_step_placement(guarded, x_reg[:GLOBAL_BATCH], overflow_targets, GLOBAL_BATCH)
print("overflow on replicas 1..R-1: updates", int(guarded.optimizer.iterations.numpy()),
      "| loss scale", float(guarded.optimizer.dynamic_scale.numpy()),
      "| all-reduces", guarded_counts.all_reduces,
      "| in while bodies", guarded_counts.in_while_bodies)
assert int(guarded.optimizer.iterations.numpy()) == 0
assert float(guarded.optimizer.dynamic_scale.numpy()) == 2.0 ** 9
assert (guarded_counts.all_reduces, guarded_counts.in_while_bodies) == (1, 0)
# %% [markdown]
# ## Deep dive · What it buys: memory, and what it costs: time
#
# A wide MLP (3 tanh layers of 512 units, 64 inputs; `lab.memory.wide_mlp`, a
# `MicroBatchingModel`) trains on one global batch of 4096 examples with k = 1, 4 and 16
# micro-batches: its activations, not its weights, dominate. **Allocator peak**:
# TensorFlow's own counter of tensor bytes (`tf.config.experimental.get_memory_info`,
# reset before the step) on `allocator_device(...)`: with GPUs the first GPU (replica 0);
# on CPU the one allocator all logical CPU devices share, i.e. every replica together.
# We report the peak *above* what was live before the step (weights, slots, data). It
# counts tensors only, and the CPU allocator not even all of them: the probe below shows
# that it does not count small temporaries, so a CPU number is a lower bound that tracks
# the large activations, which is what k changes.

# %%
import matplotlib.pyplot as plt

from distgrad_course.lab.memory import (
    allocator_counts,
    allocator_device,
    fresh_process_step_memory,
    profile_fit_step,
    wide_mlp,
)

probe = {kib: allocator_counts(kib * 1024, "CPU:0") for kib in (128, 256, 1024)}
print("CPU allocator statistic counts a temporary of (KiB):", probe)
assert probe == {128: False, 256: True, 1024: True}

device = allocator_device(len(tf.config.list_physical_devices("GPU")))
rng = np.random.default_rng(0)
WIDE = {"features": 64, "hidden": 512, "layers": 3}
WIDE_BATCH = 4096
wide_x = rng.normal(size=(WIDE_BATCH, WIDE["features"])).astype("float32")
wide_y = rng.normal(size=(WIDE_BATCH, 1)).astype("float32")
MICRO = [1, 4, 16]
step_mib, step_ms = {}, {}
for k in MICRO:
    with strategy.scope():
        model = wide_mlp(accumulation_steps=k, **WIDE)
    model.fit(wide_x, wide_y, batch_size=WIDE_BATCH, verbose=0)  # trace; not measured
    step, seconds = profile_fit_step(model, wide_x, wide_y, WIDE_BATCH, timed_steps=3,
                                     device=device)  # seconds: fastest of 3 steps
    step_mib[k], step_ms[k] = step.step_bytes / 2 ** 20, 1000 * seconds
show_table(["k", f"step peak above live on {device} (MiB)", "ms per step (fastest of 3)"],
           [(k, f"{step_mib[k]:.1f}", f"{step_ms[k]:.0f}") for k in MICRO])
assert step_mib[1] - step_mib[16] > 3  # MiB: the full-batch activations are gone

# %% [markdown]
# **Peak RSS**, for comparison, in a fresh process per setting (`fresh_process_step_memory`:
# RSS is a lifetime maximum, so a process can only measure one configuration). It includes
# the TensorFlow runtime, Python, the traced graphs, and all tensors, so the step is a
# small difference on a large base. One replica, k = 1 and k = 16.

# %%
fresh = {k: fresh_process_step_memory(k, batch_size=WIDE_BATCH, timed_steps=1, **WIDE)
         for k in (1, 16)}
show_table(["k", "RSS before fit (MiB)", "peak RSS (MiB)", "growth, tracing included",
            "allocator step (MiB)"],
           [(k, f"{m.rss_before / 2**20:.0f}", f"{m.rss_peak / 2**20:.0f}",
             f"+{m.rss_growth / 2**20:.0f}", f"{m.step.step_bytes / 2**20:.1f}")
            for k, m in fresh.items()])
for m in fresh.values():
    assert m.rss_before > 10 * m.step.step_bytes  # the runtime, not the step, dominates RSS

# %%
fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 3.5))
left.plot(MICRO, [step_mib[k] for k in MICRO], "o-")
left.set(xscale="log", xlabel="micro-batches k", ylabel="MiB",
         title=f"allocator peak above live ({device}, {R} replicas)")
middle.plot(MICRO, [step_ms[k] for k in MICRO], "o-")
middle.set(xscale="log", xlabel="micro-batches k", ylabel="ms per step",
           title="step time (fastest of 3)")
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
# with k towards a floor (gradients, the accumulated sums, the slices of the input batch).
# Peak RSS, measured for the same workload in fresh processes, is set by the runtime and
# tracing, far above one step's tensors: it is the wrong instrument for this question,
# and the allocator statistic is the right one. The cost is time: the k micro-batches run
# one after another (`parallel_iterations=1`), each a smaller matrix product. The step
# times above are measured, not asserted: they depend on the machine and its load.

# %% [markdown]
# ## Deep dive · The posted "final solution", against Keras 3
#
# The answer's "final solution" sums correctly (`grad = [g + _g ...]`) and divides by k,
# but wraps `fit` and reaches into Keras 2's private API.
# `final_solution.audit_final_solution` runs each problem; where the code is needed to
# run at all, `QuestionFinalSolutionModel` ports it only where Keras 3 forces it (public
# imports, `scale_loss`, `super()`), keeping its logic:

# %%
from distgrad_course.pitfalls import final_solution

show_code(final_solution.QuestionFinalSolutionModel)

# %% [markdown]
# `audit_final_solution` fits it with `grad_accum_steps=1`, and with k = R on one device and
# on R replicas, reads its history, and probes each removed import and attribute:

# %%
show_code(final_solution.audit_final_solution)

# %%
audit = final_solution.audit_final_solution(strategy)
attributes_present = [name for name, present in audit.attributes_present.items() if present]
show_table(["#", "the posted code", "on the installed TF / Keras"], [
    (1, "`super(self).fit(...)`",
     f"{audit.super_self_error.type}: super() argument 1 must be a type"),
    (2, "private imports", ", ".join(f"`{m.split('.')[-1]}`: {e.type}"
                                     for m, e in audit.import_errors.items())),
    (2, "`isinstance(opt, <tensorflow.python.keras LossScaleOptimizer>)`", audit.legacy_isinstance),
    (3, "private optimizer attributes still present", attributes_present or "none"),
    (3, "`apply_gradients(..., experimental_aggregate_gradients=False)`",
     audit.aggregate_flag_error.type),
    (3, "Keras 3 `apply_gradients` clips by itself", audit.apply_clips_itself),
    (4, "`fit(grad_accum_steps=1)`, one batch, one epoch: updates", audit.iterations_with_k1),
    (5, "reported loss / mean prediction / real loss",
     f"{audit.reported_loss:.4f} / {audit.mean_prediction:.4f} / {audit.true_loss:.4f}"),
    (6, "replicas read in `fit` / of the model",
     f"{audit.replicas_seen_in_fit} / {audit.replicas_of_model}"),
    (6, "update / correct update", f"{audit.two_replica_update_ratio:.6f}"),
])
assert audit.super_self_error.type == "TypeError"
assert audit.super_self_error.contains("super() argument 1 must be a type")
assert set(audit.import_errors) == {
    "tensorflow.python.keras.mixed_precision.experimental.loss_scale_optimizer",
    "tensorflow.python.distribute.distribution_strategy_context"}
assert all(e.type == "ModuleNotFoundError" for e in audit.import_errors.values())
assert set(audit.attributes_present) == {
    "optimizer._HAS_AGGREGATE_GRAD", "optimizer._aggregate_gradients",
    "loss_scale_optimizer.get_scaled_loss", "loss_scale_optimizer.get_unscaled_gradients"}
assert not any(audit.attributes_present.values()) and not audit.legacy_isinstance
assert audit.aggregate_flag_error.type == "TypeError"
assert audit.aggregate_flag_error.contains(
    "unexpected keyword argument 'experimental_aggregate_gradients'")
assert audit.apply_clips_itself
assert audit.iterations_with_k1 == 2
assert abs(audit.reported_loss - audit.mean_prediction) < 1e-6 * abs(audit.mean_prediction) + 1e-6
assert abs(audit.reported_loss - audit.true_loss) > 0.01 * abs(audit.true_loss)  # not the loss
assert (audit.replicas_seen_in_fit, audit.replicas_of_model) == (1, R)
assert abs(audit.two_replica_update_ratio - 1 / audit.replicas_of_model) < 1e-6

# %% [markdown]
# The bugs, and their fixes:
#
# 1. **`super(self).fit`**: `super()` needs a class; use `super().fit` (TypeError above).
# 2. **Private imports** `tensorflow.python.keras.mixed_precision.experimental` and
#    `tensorflow.python.distribute.distribution_strategy_context` no longer exist. The
#    `tensorflow.python.keras` package that still ships is TF's frozen Keras 2 copy: its
#    `LossScaleOptimizer` is not `keras.optimizers.LossScaleOptimizer`, so the posted
#    `isinstance` check would skip loss scaling without an error.
# 3. **Private optimizer APIs**: `_HAS_AGGREGATE_GRAD`, `_aggregate_gradients`,
#    `get_scaled_loss`, `get_unscaled_gradients`, `experimental_aggregate_gradients` are
#    gone. In Keras 3 `apply_gradients` all-reduces, unscales (`LossScaleOptimizer`) and
#    clips by itself (keras-team/keras#19308 asks for the Keras 2 opt-out back);
#    `optimizer.scale_loss(loss)` is the public way to scale.
# 4. **Missing `return`** after `super().fit(...)` in the `grad_accum_steps == 1` branch:
#    `fit` trains twice (two updates for one batch, above).
# 5. **`compiled_loss` / `compiled_metrics`**: the shims of the question's `train_step`
#    (deep dive in section 2); the history's
#    "loss" is the mean prediction. Use `compute_loss` and `compute_metrics`, and update
#    the loss tracker yourself, as the fix does.
# 6. **The replica count** comes from `get_strategy()` inside `fit`, which runs outside
#    `strategy.scope()` and sees the default strategy (1 replica). The loop then runs to
#    the *global* batch size over a per-replica batch: the extra slices are empty and the
#    update is 1/R of the right one (above). Split the batch actually received
#    (`tf.shape(x)[0]`), as the fix does.
# 7. **Ragged batches**: `step` is fixed from the `batch_size` argument, not from the batch
#    received, so a smaller last batch is split into slices that are weighted 1/k whatever
#    their size; the fix and `MicroBatching` raise instead (Limits).
# 8. **Swapping `self.train_step` on the instance** inside `fit`, with no `try/finally`,
#    leaves the swap in place if `fit` raises. Overriding `train_step` in the class needs
#    no swap.
#
# **The fixed code on the question's setup**: a softmax classifier, sparse categorical
# cross-entropy, an accuracy metric, `fit` with a large batch, with `FixedGradAccumModel`
# on the lesson's strategy against plain Keras on one device.

# %%
from distgrad_course.lab.data import classifier_model

labels = (x_reg[:, 0] > 0).astype("int32") + (x_reg[:, 1] > 0).astype("int32")  # 3 classes


def fit_classifier(on, accumulation_steps=None):
    with on.scope():
        model = classifier_model()
        if accumulation_steps is not None:
            model = fixed(model, accumulation_steps)
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(), metrics=["acc"])
    history = model.fit(x_reg, labels, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0)
    return model, history.history


ours, our_history = fit_classifier(strategy, accumulation_steps=K)
reference, reference_history = fit_classifier(one_device)
show_table(["epoch", f"loss ({R} replicas x {K})", "loss (1 device)", "acc (ours)",
            "acc (1 device)"],
           [(epoch + 1, f"{our_history['loss'][epoch]:.6f}",
             f"{reference_history['loss'][epoch]:.6f}", f"{our_history['acc'][epoch]:.4f}",
             f"{reference_history['acc'][epoch]:.4f}") for epoch in range(3)])
classifier_diff = check_close(weights_of(ours), weights_of(reference))
print(f"weights, max abs diff: {classifier_diff.max_abs:.1e}")
assert same_history(our_history, reference_history)

# %% [markdown]
# ## Takeaways
#
# * `g += _g` on a tensor rebinds a name; a `tf.while_loop` carries only what its body returns.
# * Divide each micro-batch's loss by k, keep the micro-batches equal, and call
#   `apply_gradients` once after the loop: the big-batch step, with one all-reduce.
# * Slice the batch the replica *received*, every structure with `tf.nest.map_structure`.
# * It saves activation memory, not time; the input batch must still fit.
#
# ## Exercises
#
# ### Exercise 1 · Micro-batches of one example
#
# Each replica receives 8 examples. With k = 8 (one example per micro-batch), does the fix
# still equal the big batch? What does `check_micro_batches(GLOBAL_BATCH, 3, R)` say?

# %% [markdown]
# #### Answer
#
# Yes: micro-batches of any equal size keep the mean of their means the batch mean. k = 3
# does not divide 8: `check_micro_batches` raises and names the batch sizes that work.

# %%
ours, _ = fit(strategy, OPTIMIZERS["sgd"], 8)
plain, _ = fit(one_device, OPTIMIZERS["sgd"])
print(f"k = 8: max abs diff {check_close(weights_of(ours), weights_of(plain)).max_abs:.1e}")
try:
    check_micro_batches(GLOBAL_BATCH, 3, R)
    k3_error = None
except ValueError as err:
    k3_error = str(err)
print(textwrap.fill(k3_error, 96))
assert f"multiple of accumulation_steps x replicas = {3 * R}" in k3_error

# %% [markdown]
# ### Exercise 2 · Without the `/ k`
#
# Delete `/ k` in the fix cell's `train_step`. Predict how much larger its SGD update is
# than the big-batch update.

# %% [markdown]
# #### Answer
#
# k times (4): the k micro-batch means add up to k times the batch mean. `reproduce_in_fit`
# (section 2) ran exactly that, the accepted answer's loop without the division, for one
# SGD step with k = 4:

# %%
print(f"accepted fix, no 1/k: update / full-batch update = {in_fit.returned_ratio:.6f}")
assert abs(in_fit.returned_ratio - 4.0) < 4e-6  # sum of k means: k times too large

# %% [markdown]
# ### Exercise 3 · Which step did the question train?
#
# Before running it, say which plain step the question's model (run in the deep dive of
# section 2) matches on 16 examples with `grad_accum=2`, and with `grad_accum=16`.

# %% [markdown]
# #### Answer
#
# A plain step on its first micro-batch: the first 8 examples, and the first example.

# %%
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # compiled_loss / compiled_metrics are deprecated
    for grad_accum, first in ((2, 8), (16, 1)):
        question, _ = one_step(question_model(), x16, y16, grad_accum=grad_accum)
        plain, _ = one_step(tiny_model(), x16[:first], y16[:first])
        diff = weight_diff(weights_of(question), weights_of(plain))
        print(f"grad_accum={grad_accum} vs a plain step on {first} example(s): {diff.max_abs:.1e}")
        assert diff.within()

# %% [markdown]
# ## Further reading
#
# * Keras, *Customizing what happens in `fit()` with TensorFlow* (keras.io guide); the
#   installed `keras/src/backend/tensorflow/trainer.py` (`train_step`, `_make_function`)
#   and `keras/src/losses/loss.py` (`scale_loss_for_distribution`).
# * [`tf.while_loop`](https://www.tensorflow.org/api_docs/python/tf/while_loop),
#   [`tf.nest.map_structure`](https://www.tensorflow.org/api_docs/python/tf/nest/map_structure).
# * keras-team/keras#17429 (`tf.cond` around `apply_gradients` under `MirroredStrategy`),
#   #19308 (Keras 3 sums gradients inside the optimizer), #19246 (`steps_per_execution`),
#   #19005 (`jit_compile` over CPU devices).
