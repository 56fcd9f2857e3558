"""Lesson 05's facts: in-step micro-batching in model.fit (distgrad.train_step,
distgrad_course.lab.memory)."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import distgrad_course
from distgrad.train_step import (
    MicroBatching,
    MicroBatchingModel,
    check_micro_batches,
    with_micro_batches,
)
from distgrad_course.lab.compare import OPTIMIZERS, check_close, weights_of
from distgrad_course.lab.data import classifier_model, regression_data, tiny_model
from distgrad_course.lab.graph import fit_step_placement, placement_of_graph
from distgrad_course.lab.memory import (
    StepMemory,
    allocator_device,
    measure_step_memory,
    profile_fit_step,
    ru_maxrss_bytes,
    step_memory_from_info,
)
from distgrad_course.lab.mixed import check_float16_close

EXAMPLES, BATCH = 32, 16  # two fit steps per epoch


def fit(strategy, optimizer, micro_batches=None, epochs=2, model_factory=tiny_model,
        x=None, y=None, batch_size=BATCH, **fit_kwargs):
    """Train a fresh model with `fit`; micro_batches=None is plain Keras."""
    if x is None:
        x, y = regression_data(EXAMPLES)
    with strategy.scope():
        model = model_factory()
        if micro_batches is not None:
            model = with_micro_batches(model, micro_batches)
        model.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                        **fit_kwargs)
    return model, history.history


@functools.cache
def _plain_one_device(name):
    model, history = fit(tf.distribute.get_strategy(), OPTIMIZERS[name])
    return weights_of(model), history


def check_history(actual, expected):
    actual = dict(actual)
    # Under a LossScaleOptimizer MicroBatching logs the steps it skipped (none here).
    skipped = actual.pop("skipped_updates", None)
    assert skipped is None or skipped == [0] * len(actual["loss"])
    assert set(actual) == set(expected) - {"skipped_updates"} == {"loss", "mae"}
    for key in actual:
        assert actual[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-6), key


# --- equivalence -------------------------------------------------------------------------


# Lesson 05 §4 fits SGD, momentum and Adam on R replicas the same way (once per suite).
@pytest.mark.parametrize("replicas, name", [(1, name) for name in sorted(OPTIMIZERS)]
                         + [(2, "adamw")])
def test_four_micro_batches_in_fit_equal_plain_big_batch_fit(replicas, name):
    model, history = fit(distgrad_course.make_strategy(replicas), OPTIMIZERS[name], micro_batches=4)
    reference_weights, reference_history = _plain_one_device(name)
    check_close(weights_of(model), reference_weights)
    check_history(history, reference_history)  # fit's loss and mae are the big-batch ones
    assert int(model.optimizer.iterations.numpy()) == 2 * EXAMPLES // BATCH  # one per fit step


@pytest.mark.parametrize("micro_batches", [2, 8])  # k=1: exactness test below
def test_any_micro_batch_count_dividing_the_replica_batch_gives_the_same_weights(
        strategy2, micro_batches):
    model, history = fit(strategy2, OPTIMIZERS["adam"], micro_batches=micro_batches)
    reference_weights, reference_history = _plain_one_device("adam")
    check_close(weights_of(model), reference_weights)
    check_history(history, reference_history)


def test_one_micro_batch_is_exactly_keras_train_step(strategy1):
    model, history = fit(strategy1, OPTIMIZERS["adam"], micro_batches=1)
    reference_weights, reference_history = _plain_one_device("adam")
    assert check_close(weights_of(model), reference_weights).max_abs == 0.0
    assert history == reference_history


def test_sample_weights_are_sliced_with_their_micro_batch(strategy2):
    x, y = regression_data(EXAMPLES)
    weights = np.linspace(0.1, 2.0, EXAMPLES).astype("float32")
    model, history = fit(strategy2, OPTIMIZERS["sgd"], micro_batches=4, x=x, y=y,
                         sample_weight=weights)
    reference, reference_history = fit(tf.distribute.get_strategy(), OPTIMIZERS["sgd"], x=x, y=y,
                                       sample_weight=weights)
    check_close(weights_of(model), weights_of(reference))
    check_history(history, reference_history)


def regularized_model():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1),
                           kernel_initializer=keras.initializers.GlorotUniform(seed=0))(inputs)
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=1))(h)
    return keras.Model(inputs, outputs)


def test_regularization_loss_is_counted_once_per_step_not_once_per_micro_batch(strategy2):
    model, history = fit(strategy2, OPTIMIZERS["sgd"], micro_batches=4,
                         model_factory=regularized_model)
    reference, reference_history = fit(tf.distribute.get_strategy(), OPTIMIZERS["sgd"],
                                       model_factory=regularized_model)
    check_close(weights_of(model), weights_of(reference))
    check_history(history, reference_history)


class TwoHeads(keras.Model):
    """A subclassed model with a layer the loss never uses (its gradient is None)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh",
                                         kernel_initializer=keras.initializers.GlorotUniform(0))
        self.head = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1))
        self.unused = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(2))

    def build(self, input_shape):
        self.hidden.build(input_shape)
        self.head.build((None, 8))
        self.unused.build((None, 8))

    def call(self, x, training=False):
        return self.head(self.hidden(x))


class MicroBatchedTwoHeads(MicroBatching, TwoHeads):
    pass


def test_mixin_works_for_subclassed_models_and_leaves_unconnected_weights_alone(strategy2):
    x, y = regression_data(EXAMPLES)

    def run(cls, **kwargs):
        with strategy2.scope():
            model = cls(**kwargs)
            model.build((None, 4))
            model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
        initial = weights_of(model)
        with pytest.warns(UserWarning, match="Gradients do not exist"):
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return initial, weights_of(model)

    initial, micro = run(MicroBatchedTwoHeads, accumulation_steps=4)
    _, plain = run(TwoHeads)
    check_close(micro, plain)
    # the unused head's kernel and bias (last two weights) did not move
    check_close(micro[-2:], initial[-2:], rtol=0, atol=0)


def test_question_setup_softmax_crossentropy_and_accuracy_match_plain_fit(strategy2):
    x, _ = regression_data(EXAMPLES)
    labels = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")

    def run(on, micro_batches):
        with on.scope():
            model = classifier_model(micro_batches)
            model.compile(optimizer=keras.optimizers.Adam(1e-2),
                          loss=keras.losses.SparseCategoricalCrossentropy(), metrics=["acc"])
        history = model.fit(x, labels, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
        return weights_of(model), history.history

    micro, micro_history = run(strategy2, 4)
    plain, plain_history = run(tf.distribute.get_strategy(), None)
    check_close(micro, plain)
    assert set(micro_history) == {"loss", "acc"}
    for key in plain_history:
        assert micro_history[key] == pytest.approx(plain_history[key], rel=1e-6, abs=1e-6)


# --- one all-reduce per step ---------------------------------------------------------------


def test_fit_step_has_one_all_reduce_and_none_inside_the_micro_batch_loop(strategy2):
    x, y = regression_data(BATCH)
    micro, _ = fit(strategy2, OPTIMIZERS["adam"], micro_batches=4, epochs=1, x=x, y=y)
    plain, _ = fit(strategy2, OPTIMIZERS["adam"], epochs=1, x=x, y=y)
    counts = fit_step_placement(micro, x, y, BATCH)
    assert (counts.all_reduces, counts.in_while_bodies, counts.while_loops) == (1, 0, 1)
    plain_counts = fit_step_placement(plain, x, y, BATCH)
    assert (plain_counts.all_reduces, plain_counts.while_loops) == (1, 0)


def test_step_collectives_finds_an_all_reduce_inside_a_while_body():
    # Traced only, never run: what a per-micro-batch apply would look like.
    @tf.function
    def step():
        def body(i, total):
            reduced = tf.raw_ops.CollectiveReduceV2(
                input=tf.constant([1.0]), group_size=1, group_key=1, instance_key=1,
                ordering_token=[], merge_op="Add", final_op="Id")
            return i + 1, total + reduced
        return tf.while_loop(lambda i, _: i < 3, body, [tf.constant(0), tf.constant([0.0])])

    counts = placement_of_graph(step.get_concrete_function().graph.as_graph_def(), 1)
    assert (counts.all_reduces, counts.in_while_bodies, counts.while_loops) == (1, 1, 1)


# --- mixed precision ---------------------------------------------------------------------


def mixed_model():
    return tiny_model(dtype_policy="mixed_float16")


def lso_sgd(initial_scale=2.0 ** 15):
    return lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                       initial_scale=initial_scale)


def test_mixed_precision_one_micro_batch_equals_keras_fit(strategy2):
    micro, micro_history = fit(strategy2, lso_sgd(), 1, model_factory=mixed_model)
    plain, plain_history = fit(strategy2, lso_sgd(), model_factory=mixed_model)
    check_close(weights_of(micro), weights_of(plain))
    check_history(micro_history, plain_history)


def test_mixed_precision_two_replicas_two_micro_batches_equal_one_replica_four(strategy2):
    # Same float16 slices of 4 examples either way; only the 1/R and 1/k factors move.
    two, two_history = fit(strategy2, lso_sgd(), 2, model_factory=mixed_model)
    one, one_history = fit(tf.distribute.get_strategy(), lso_sgd(), 4, model_factory=mixed_model)
    check_close(weights_of(two), weights_of(one))
    check_history(two_history, one_history)
    assert int(two.optimizer.iterations.numpy()) == 4


def test_mixed_precision_micro_batches_apply_the_unscaled_mean_of_scaled_slice_gradients():
    x, y = regression_data(BATCH)
    micro, _ = fit(tf.distribute.get_strategy(), lso_sgd(), 4, epochs=1, model_factory=mixed_model,
                   x=x, y=y)
    # By hand: scale each slice's mean loss by S/k, sum the float32 gradients, divide by S.
    # The same float16 math in other kernels (eager here, a traced and fused step in fit,
    # XLA on a GPU): equal up to float16 rounding, in slices of 4 examples.
    model, scale = mixed_model(), 2.0 ** 15
    initial = weights_of(model)
    summed = [tf.zeros_like(v) for v in model.trainable_variables]
    for j in range(4):
        with tf.GradientTape() as tape:
            pred = model(x[4 * j:4 * j + 4], training=True)
            loss = tf.reduce_mean(tf.square(pred - y[4 * j:4 * j + 4])) / 4.0 * scale
        summed = [s + g for s, g in zip(summed, tape.gradient(loss, model.trainable_variables))]
    for v, g in zip(model.trainable_variables, summed):
        v.assign(v - 0.1 * (g / scale))
    check_float16_close(weights_of(micro), weights_of(model), initial, batch=4)
    assert float(micro.optimizer.dynamic_scale.numpy()) == scale  # finite: unchanged


def test_an_overflowing_step_is_skipped_once_and_halves_the_scale_once(strategy):
    x, y = regression_data(BATCH)
    x = x * 3e4  # float16 activations overflow
    model, _ = fit(strategy, lso_sgd(2.0 ** 10), 4, epochs=1, model_factory=mixed_model, x=x, y=y)
    with strategy.scope():
        initial = weights_of(mixed_model())
    check_close(weights_of(model), initial, rtol=0, atol=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** 9  # once, not 4 times


def test_under_keras_own_wrapper_an_overflow_on_any_replica_skips_the_step(strategy2):
    # Keras 3's LossScaleOptimizer._tf_apply takes `finite` from replica 0's *local*
    # gradients (lesson 04, pitfalls.lso_first_replica_finite). MicroBatching hands it a
    # NaN gradient on every replica when any replica's sum overflowed.
    x, y = regression_data(BATCH)
    for overflowing_replica in (1, 0):
        targets = y.copy()
        half = slice(BATCH // 2, None) if overflowing_replica else slice(None, BATCH // 2)
        targets[half] = 6e4  # float16 backprop of (pred - 6e4) * loss scale overflows
        with pytest.warns(UserWarning, match=r"1 step\(s\) skipped in this fit"):
            model, history = fit(strategy2, lso_sgd(2.0 ** 10), 2, epochs=1,
                                 model_factory=mixed_model, x=x, y=targets)
        assert all(np.isfinite(w).all() for w in weights_of(model))
        assert int(model.optimizer.iterations.numpy()) == 0
        assert float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** 9
        assert history["skipped_updates"] == [1]


def test_the_all_replicas_finite_wrapper_of_lesson_04_composes_with_micro_batching(strategy2):
    from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer

    x, y = regression_data(BATCH)
    y = y.copy()
    y[BATCH // 2:] = 6e4  # replica 1 only overflows

    def wrapper():
        return AllReplicasFiniteLossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                   initial_scale=2.0 ** 10)

    model, _ = fit(strategy2, wrapper, 2, epochs=1, model_factory=mixed_model, x=x, y=y)
    with strategy2.scope():
        initial = weights_of(mixed_model())
    check_close(weights_of(model), initial, rtol=0, atol=0)  # skipped
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** 9
    counts = fit_step_placement(model, x, y, BATCH)
    assert (counts.all_reduces, counts.in_while_bodies) == (1, 0)


# --- bad input ---------------------------------------------------------------------------


@pytest.mark.usefixtures("collect_garbage")
def test_ragged_last_batch_raises_naming_the_fix_on_one_replica(strategy1):
    # On R replicas lesson 05 makes and asserts the same fit (once per suite).
    x, y = regression_data(30)  # the last batch of 14 does not split
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        fit(strategy1, OPTIMIZERS["sgd"], micro_batches=4, epochs=1, x=x, y=y)
    message = str(info.value)
    assert "not divisible by accumulation_steps=4 (1 replica(s))" in message
    assert "drop_remainder=True" in message


def test_under_xla_micro_batching_matches_and_a_ragged_batch_raises_instead_of_truncating():
    x, y = regression_data(EXAMPLES)

    def run(micro_batches, data):
        # XLA cannot raise on a NaN (it compiles assertions out): "skip" is the policy there.
        model = tiny_model() if micro_batches is None else with_micro_batches(
            tiny_model(), micro_batches, non_finite="skip")
        model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse", jit_compile=True)
        model.fit(*data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return weights_of(model)

    check_close(run(4, (x, y)), run(None, (x, y)))
    # XLA drops tf.debugging assertions: without the trace-time check the ragged last
    # batch of 14 would train on 12 examples without a word.
    with pytest.raises(ValueError, match=r"drop_remainder=True.*jit_compile=False.*"
                                         r"jit_compile=True needs a static batch dimension"):
        run(4, (x[:30], y[:30]))


@pytest.mark.usefixtures("collect_garbage")
def test_static_batch_that_does_not_split_raises_at_trace_time(strategy2):
    x, y = regression_data(EXAMPLES)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(12, drop_remainder=True)
    with strategy2.scope():
        model = with_micro_batches(tiny_model(), 8)
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"multiple of accumulation_steps x replicas = 16 "
                                         r"\(e.g. 16\).*global batch of 12 examples cannot be "
                                         r"split into 2 replica\(s\) x accumulation_steps=8"):
        model.fit(dataset, shuffle=False, verbose=0)


def test_check_micro_batches_returns_the_slice_size_or_names_batch_sizes_that_work():
    assert check_micro_batches(16, 4, 2) == 2
    assert check_micro_batches(16, 1, 1) == 16
    with pytest.raises(ValueError,
                       match=r"multiple of accumulation_steps x replicas = 8 \(e.g. 8 or 16\)"):
        check_micro_batches(12, 4, 2)
    with pytest.raises(ValueError, match="accumulation_steps must be an integer >= 1, got 0"):
        check_micro_batches(16, 0)
    with pytest.raises(ValueError, match="replicas must be an integer >= 1, got 1.5"):
        check_micro_batches(16, 2, 1.5)


def test_micro_batches_is_validated_and_changing_it_drops_the_traced_step(strategy1):
    x, y = regression_data(BATCH)
    model, _ = fit(strategy1, OPTIMIZERS["sgd"], micro_batches=2, epochs=1, x=x, y=y)
    assert model.train_function is not None
    model.accumulation_steps = 4
    assert model.train_function is None
    with pytest.raises(ValueError, match="accumulation_steps must be an integer >= 1, got True"):
        model.accumulation_steps = True
    with pytest.raises(ValueError, match="accumulation_steps must be an integer >= 1"):
        MicroBatchingModel(model.inputs, model.outputs, accumulation_steps=0)


def test_with_micro_batches_shares_weights_and_rejects_subclassed_models():
    base = tiny_model()
    wrapped = with_micro_batches(base, 2)
    assert [id(v) for v in wrapped.trainable_variables] == [id(v) for v in base.trainable_variables]
    with pytest.raises(ValueError, match=r"use the mixin|subclass `class MyModel\(MicroBatching"):
        with_micro_batches(TwoHeads(), 2)


# --- memory ------------------------------------------------------------------------------


def test_ru_maxrss_units_are_kib_on_linux_and_bytes_on_macos():
    assert ru_maxrss_bytes(3, "Linux") == 3 * 1024
    assert ru_maxrss_bytes(3, "Darwin") == 3


def test_allocator_device_is_the_first_gpu_when_there_is_one():
    assert allocator_device(0) == "CPU:0"
    assert allocator_device(2) == "GPU:0"
    with pytest.raises(ValueError, match="physical_gpus must be >= 0"):
        allocator_device(-1)


def test_step_memory_is_the_peak_above_what_was_live_before():
    step = step_memory_from_info("GPU:0", {"current": 100, "peak": 100},
                                 {"current": 120, "peak": 400})
    assert step == StepMemory("GPU:0", 100, 400) and step.step_bytes == 300
    with pytest.raises(ValueError, match="needs 'current' and 'peak'"):
        step_memory_from_info("GPU:0", {"current": 1}, {"current": 1, "peak": 1})
    with pytest.raises(ValueError, match="reset_memory_stats"):
        step_memory_from_info("GPU:0", {"current": 100, "peak": 100}, {"current": 0, "peak": 50})


def test_cpu_allocator_peak_sees_a_temporary_tensor():
    def make_temporary():
        return float(tf.reduce_sum(tf.ones([256, 1024])))  # 1 MiB, freed on return

    step = measure_step_memory(make_temporary, "CPU:0")
    assert step.device == "CPU:0"
    assert step.step_bytes >= 256 * 1024 * 4


def test_profile_fit_step_needs_a_timed_step():
    # Lesson 05 profiles the wide model's fit steps (k = 1, 4, 16) once per suite.
    with pytest.raises(ValueError, match="timed_steps must be an integer >= 1"):
        profile_fit_step(None, None, None, 1024, timed_steps=0)


def test_a_saved_micro_batching_model_loads_with_its_accumulation_steps(tmp_path):
    x, y = regression_data(16)
    model = with_micro_batches(tiny_model(), 4)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(tmp_path / "micro.keras")
    loaded = keras.models.load_model(tmp_path / "micro.keras")
    assert isinstance(loaded, MicroBatchingModel) and loaded.accumulation_steps == 4
    check_close(weights_of(loaded), weights_of(model), rtol=0, atol=0)
    loaded.fit(x, y, batch_size=16, verbose=0)
    model.fit(x, y, batch_size=16, verbose=0)
    check_close(weights_of(loaded), weights_of(model))
