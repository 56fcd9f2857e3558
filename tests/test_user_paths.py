"""The user's path: code written the way a user writes it, from the README and the API page.

No lab helper is imported here. Each test builds its data, model and strategy as a user
would (`distgrad_course.make_strategy`, `tf.data`, `keras.Model`), and checks the result against
the run it must equal: the same training on one big batch, or the uninterrupted run. A
fresh process is a plain `python script.py`, as a user would start one.
"""

from __future__ import annotations

import json
import os
import textwrap
import warnings

import keras
import numpy as np
import pytest
import script_runs
import tensorflow as tf

import distgrad
import distgrad_course
from distgrad_course.lab.mixed import check_float16_close

K = 2  # micro-batches per update
MICRO = 8  # examples per micro-batch, over all replicas
FLOAT32 = {"rtol": 1e-6, "atol": 1e-6}
# mixed_float16 runs are compared at float16's rounding bound (distgrad_course.lab.mixed): the
# reference sums a big batch of K * MICRO / 2 examples per replica in float16.
BIG_BATCH_PER_REPLICA = K * MICRO // 2
OUTLIER = 1.0e4  # a target whose float16 scaled gradient overflows at any loss scale >= 1
# Keras' default initial scale, 2**15, overflows on this data in the first steps, by design
# (then two runs skip different steps); these tests start low enough to overflow only
# where they put an outlier.
SCALE = 2.0**8


@pytest.fixture(scope="module")
def strategy():
    strategy = distgrad_course.make_strategy(2)
    assert strategy.num_replicas_in_sync >= 2
    return strategy


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def regression(examples, seed=0, outputs=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 4)).astype("float32")
    w = rng.normal(size=(4, outputs)).astype("float32")
    return x, (x @ w + 0.1 * rng.normal(size=(examples, outputs))).astype("float32")


def make_model(model_class=keras.Model, **kwargs):
    keras.utils.set_random_seed(7)  # every model starts from the same weights
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = keras.layers.Dense(1, dtype="float32")(hidden)
    return model_class(inputs, outputs, **kwargs)


def batches(x, y, size):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(size, drop_remainder=True)


def assert_same_weights(model, reference, tolerance):
    for actual, expected in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(actual, expected, **tolerance)


def assert_same_float16_updates(model, reference):
    """Two mixed_float16 trainings from make_model()'s weights: the same updates up to
    float16 rounding."""
    check_float16_close(model.get_weights(), reference.get_weights(),
                        make_model().get_weights(), batch=BIG_BATCH_PER_REPLICA)


def without(x, y, first, count):
    """The data without `count` examples from `first` on."""
    keep = np.r_[0:first, first + count:len(x)]
    return x[keep], y[keep]


# -- the three ways to accumulate, float32 and mixed_float16, 2 replicas ---------------


def fit_accumulating(strategy, x, y, mixed=False):
    with strategy.scope():
        model = make_model()
        optimizer = distgrad.AccumulatingOptimizer(keras.optimizers.Adam(0.01), K)
        if mixed:
            optimizer = distgrad.AllReplicasFiniteLossScaleOptimizer(optimizer,
                                                                     initial_scale=SCALE)
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(batches(x, y, MICRO), epochs=2, verbose=0)
    return model


def fit_micro_batching(strategy, x, y, mixed=False):
    with strategy.scope():
        model = make_model(distgrad.MicroBatchingModel, accumulation_steps=K)
        optimizer = keras.optimizers.Adam(0.01)
        if mixed:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=SCALE)
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(batches(x, y, K * MICRO), epochs=2, verbose=0)
    return model


def custom_loop(strategy, x, y, mixed=False, make_optimizer=None):
    """GradientAccumulator's loop, as its docstring and lesson 02 show it."""
    with strategy.scope():
        model = make_model()
        optimizer = (make_optimizer or (lambda: keras.optimizers.Adam(0.01)))()
        if mixed:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=SCALE)
        accumulator = distgrad.GradientAccumulator(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError(reduction="none")
    global_batch = K * MICRO  # of a whole update: the loss is divided by it

    @tf.function
    def accumulate(inputs, targets):
        def step(inputs, targets):
            with tf.GradientTape() as tape:
                per_example = loss_fn(targets, model(inputs, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
                if mixed:
                    loss = optimizer.scale_loss(loss)
            accumulator.add(tape.gradient(loss, model.trainable_variables))

        strategy.run(step, args=(inputs, targets))

    apply_step = accumulator.make_apply_step(optimizer)
    for _ in range(2):  # epochs
        for step, (inputs, targets) in enumerate(
                strategy.experimental_distribute_dataset(batches(x, y, MICRO))):
            accumulate(inputs, targets)
            if (step + 1) % K == 0:
                apply_step()
    return model, optimizer, accumulator


def big_batch(strategy, x, y, epochs=2, mixed=False, **compile_kwargs):
    """The reference: plain Keras, one step per K micro-batches."""
    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.Adam(0.01)
        if mixed:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=SCALE)
        model.compile(**{"optimizer": optimizer, "loss": "mse", **compile_kwargs})
    model.fit(batches(x, y, K * MICRO), epochs=epochs, verbose=0)
    return model


@pytest.mark.parametrize("way", [fit_accumulating, fit_micro_batching,
                                 lambda *a, **k: custom_loop(*a, **k)[0]],
                         ids=["AccumulatingOptimizer", "MicroBatchingModel",
                              "GradientAccumulator"])
@pytest.mark.parametrize("precision", ["float32", "mixed_float16"])
def test_each_way_equals_big_batch(strategy, way, precision):
    mixed = precision == "mixed_float16"
    x, y = regression(8 * MICRO)
    keras.mixed_precision.set_global_policy(precision)
    try:
        model = way(strategy, x, y, mixed=mixed)
        reference = big_batch(strategy, x, y, mixed=mixed)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    if mixed:
        assert_same_float16_updates(model, reference)
    else:
        assert_same_weights(model, reference, FLOAT32)
    assert not np.allclose(model.get_weights()[0], make_model().get_weights()[0])  # it trained


# -- mixed precision, an overflow in replica 1's shard only -----------------------------


def overflow_on_replica_1(x, y, batch, batch_size=MICRO):
    """`y` with one outlier in replica 1's half of batch `batch` (0-based): a distributed
    dataset gives replica r the r-th contiguous slice of each batch."""
    y = y.copy()
    y[batch * batch_size + batch_size // 2] = OUTLIER
    return x, y


@pytest.mark.usefixtures("mixed_float16", "collect_garbage")
def test_compile_alone_on_one_device_trains_as_the_big_batch_and_counts_skips():
    # The most common accumulation user: one GPU, mixed_float16, no strategy; compile adds
    # Keras' own wrapper, right on one replica. Data small enough for its initial scale.
    x, y = regression(8 * MICRO)
    x, y = x / 4, y / 4
    model = make_model()
    model.compile(optimizer=distgrad.AccumulatingOptimizer(keras.optimizers.Adam(0.01), K),
                  loss="mse")
    model.fit(batches(x, y, MICRO), epochs=2, verbose=0)
    reference = make_model()
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    reference.fit(batches(x, y, K * MICRO), epochs=2, verbose=0)
    check_float16_close(model.get_weights(), reference.get_weights(), make_model().get_weights(),
                        batch=K * MICRO)  # one device: the whole big batch
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    accumulating = model.optimizer.inner_optimizer
    assert int(accumulating.iterations.numpy()) == 8
    assert int(accumulating.skipped_micro_batches.numpy()) == 0
    y[3 * MICRO] = OUTLIER  # micro-batch 4 overflows: skipped, counted, warned
    with pytest.warns(UserWarning, match=r"^AccumulatingOptimizer: 2 micro-batch\(es\) "
                                         r"skipped in this fit \(2 in all"):
        model.fit(batches(x, y, MICRO), epochs=2, verbose=0)
    assert int(accumulating.skipped_micro_batches.numpy()) == 2


@pytest.mark.usefixtures("mixed_float16", "collect_garbage")
def test_compile_alone_is_refused_before_the_first_step_and_the_named_fix_works(strategy):
    x, y = regression(8 * MICRO)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=distgrad.AccumulatingOptimizer(keras.optimizers.Adam(0.01), K),
                      loss="mse")
    before = model.get_weights()
    with pytest.raises(ValueError, match="^Under mixed_float16 on 2 replicas, hand model.compile"
                       ) as refused:
        model.fit(batches(x, y, MICRO), verbose=0)
    fix = "distgrad.AllReplicasFiniteLossScaleOptimizer(distgrad.AccumulatingOptimizer("
    assert fix in str(refused.value).split(". ")[0]  # the first sentence
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    with strategy.scope():  # the fix, as the message writes it
        model = make_model()
        model.compile(optimizer=distgrad.AllReplicasFiniteLossScaleOptimizer(
            distgrad.AccumulatingOptimizer(keras.optimizers.Adam(0.01), K)), loss="mse")
    model.fit(batches(x, y, MICRO), epochs=2, verbose=0)
    skipped = int(model.optimizer.skipped_steps.numpy())  # at 2**15, some: by design
    assert int(model.optimizer.iterations.numpy()) == (16 - skipped) // K
    assert int(model.optimizer.inner_optimizer.skipped_updates.numpy()) == 0


@pytest.mark.usefixtures("mixed_float16")
def test_accumulating_optimizer_skips_only_the_overflowing_micro_batch(strategy):
    x, y = overflow_on_replica_1(*regression(9 * MICRO), batch=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fit_accumulating(strategy, x, y, mixed=True)
    optimizer = model.optimizer
    # 18 micro-batches, 2 overflowing (one per epoch): 16 accumulated, 8 updates.
    assert int(optimizer.skipped_steps.numpy()) == 2
    assert int(optimizer.iterations.numpy()) == 8
    assert int(optimizer.inner_optimizer.skipped_updates.numpy()) == 0  # no cycle lost
    assert float(optimizer.dynamic_scale.numpy()) == SCALE / 4
    told = ("AllReplicasFiniteLossScaleOptimizer: 2 micro-batch(es) skipped in this fit (2 in "
            "all, `optimizer.skipped_steps`): their gradients overflowed on some replica, and "
            "the loss scale was halved each time (now 64). A few are expected while the scale "
            "comes down from its initial value.")
    assert [str(w.message) for w in caught if "skipped in this fit" in str(w.message)] == [told]
    # It equals big batch on the 16 good micro-batches, in the same order.
    assert_same_float16_updates(model, big_batch(strategy, *without(x, y, 2 * MICRO, MICRO),
                                mixed=True))


@pytest.mark.usefixtures("mixed_float16")
def test_micro_batching_under_the_wrapper_compile_adds_skips_the_step(strategy):
    x, y = regression(8 * MICRO)
    # Small enough for Keras' default initial scale, 2**15, not to overflow on its own.
    x, y = overflow_on_replica_1(x / 4, y / 4, batch=1, batch_size=K * MICRO)
    with strategy.scope():
        model = make_model(distgrad.MicroBatchingModel, accumulation_steps=K)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    with pytest.warns(UserWarning, match=r"MicroBatching: 1 step\(s\) skipped in this fit"):
        history = model.fit(batches(x, y, K * MICRO), verbose=0)
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer  # compile's own
    assert history.history["skipped_updates"] == [1]
    assert int(model.optimizer.iterations.numpy()) == 3
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**14
    # Big batch without the skipped step, also under the wrapper compile adds (2**15).
    assert_same_float16_updates(model, big_batch(strategy, *without(x, y, 2 * MICRO, 2 * MICRO),
                                epochs=1))


def test_gradient_accumulator_under_keras_wrapper_skips_the_update(strategy, mixed_float16):
    x, y = overflow_on_replica_1(*regression(8 * MICRO), batch=2)  # in update 2
    with pytest.warns(UserWarning, match="update skipped.*halved its scale"):
        model, optimizer, accumulator = custom_loop(strategy, x, y, mixed=True)
    assert type(optimizer) is keras.optimizers.LossScaleOptimizer
    # 2 epochs of 4 updates, one skipped in each.
    assert int(accumulator.skipped_updates.numpy()) == 2
    assert int(optimizer.iterations.numpy()) == 6
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert_same_float16_updates(model, big_batch(strategy, *without(x, y, 2 * MICRO, 2 * MICRO),
                                mixed=True))


# -- save mid-cycle, load in a fresh process after a bare `import distgrad`, resume --------

RESUME_SCRIPT = """
import json, sys
import numpy as np
import distgrad  # all it takes to load distgrad's classes
import keras
import tensorflow as tf

import distgrad_course  # (the test's two logical CPUs)
strategy = distgrad_course.make_strategy(2)
out = {}
for name, job in json.loads(sys.argv[1]).items():
    with strategy.scope():
        model = keras.models.load_model(job["path"])
    rest = np.load(job["rest"])
    model.fit(tf.data.Dataset.from_tensor_slices((rest["x"], rest["y"])).batch(job["batch"]),
              verbose=0)
    np.savez(job["path"] + ".resumed.npz", *model.get_weights())
    out[name] = [type(model).__name__, type(model.optimizer).__name__]
print(json.dumps(out))
"""


def run_script(tmp_path, source, *args, env=None):
    """`python script.py ARGS` in a process that never imported distgrad (`script_runs`);
    the JSON of its last line."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    code, stdout, stderr = script_runs.run(script, list(args), {**os.environ, **(env or {})},
                                           tmp_path, 300)
    assert code == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def saveable(name, strategy):
    """A compiled model holding the saveable class `name`."""
    def accumulating():
        return distgrad.AccumulatingOptimizer(keras.optimizers.Adam(0.01), K)

    with strategy.scope():
        if name == "MicroBatchingModel":
            model = make_model(distgrad.MicroBatchingModel, accumulation_steps=K)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        elif name == "MultiWorkerFitModel":
            model = make_model(distgrad.MultiWorkerFitModel)
            model.compile(optimizer=accumulating(), loss="mse")
        elif name == "AllReplicasFiniteLossScaleOptimizer":  # under mixed_float16
            keras.mixed_precision.set_global_policy("mixed_float16")
            try:
                model = make_model()
            finally:
                keras.mixed_precision.set_global_policy("float32")
            model.compile(optimizer=distgrad.AllReplicasFiniteLossScaleOptimizer(
                accumulating()), loss="mse")
        else:
            model = make_model()
            model.compile(optimizer=accumulating(), loss="mse")
    return model


SAVEABLE = {"AccumulatingOptimizer": ("Functional", "AccumulatingOptimizer"),
            "AllReplicasFiniteLossScaleOptimizer": ("Functional",
                                                    "AllReplicasFiniteLossScaleOptimizer"),
            "MicroBatchingModel": ("MicroBatchingModel", "Adam"),
            "MultiWorkerFitModel": ("MultiWorkerFitModel", "AccumulatingOptimizer")}


def test_a_bare_import_loads_every_saved_class_in_a_fresh_process_and_resumes_exactly(
        strategy, tmp_path):
    x, y = regression(8 * MICRO)
    jobs, references = {}, {}
    for name in SAVEABLE:
        # Cut after 3 micro-batches: mid-cycle (MicroBatchingModel: after its first step).
        batch = K * MICRO if name == "MicroBatchingModel" else MICRO
        cut = batch if name == "MicroBatchingModel" else 3 * MICRO
        model, reference = saveable(name, strategy), saveable(name, strategy)
        model.fit(batches(x[:cut], y[:cut], batch), verbose=0)
        reference.fit(batches(x, y, batch), verbose=0)
        references[name] = reference.get_weights()
        path = str(tmp_path / f"{name}.keras")
        model.save(path)
        np.savez(path + ".rest.npz", x=x[cut:], y=y[cut:])
        jobs[name] = {"path": path, "rest": path + ".rest.npz", "batch": batch}
    loaded = run_script(tmp_path, RESUME_SCRIPT, json.dumps(jobs))
    for name, (model_class, optimizer_class) in SAVEABLE.items():
        assert loaded[name][0] == model_class
        assert loaded[name][1] == optimizer_class
        resumed = np.load(jobs[name]["path"] + ".resumed.npz")
        for i, expected in enumerate(references[name]):
            np.testing.assert_allclose(resumed[f"arr_{i}"], expected, **FLOAT32, err_msg=name)


# -- what users pass to compile and fit next --------------------------------------------


WAYS = ("AccumulatingOptimizer", "MicroBatchingModel", "big batch")


def fit_both_ways(strategy, make, compile_kwargs, data, epochs=2, ways=WAYS, **fit_kwargs):
    """`make()` model trained with AccumulatingOptimizer (micro-batches of MICRO) and as a
    MicroBatchingModel (batches of K * MICRO), and plain Keras on K * MICRO: the three
    models and histories. `data(batch_size)` returns the dataset."""
    compile_kwargs = dict(compile_kwargs)
    optimizer = compile_kwargs.pop("optimizer")
    runs = {}
    for way in ways:
        with strategy.scope():
            if way == "MicroBatchingModel":
                model = make(distgrad.MicroBatchingModel, accumulation_steps=K)
            else:
                model = make(keras.Model)
            wrapped = optimizer()
            if way == "AccumulatingOptimizer":
                wrapped = distgrad.AccumulatingOptimizer(wrapped, K)
            model.compile(optimizer=wrapped, **compile_kwargs)
        size = MICRO if way == "AccumulatingOptimizer" else K * MICRO
        history = model.fit(data(size), epochs=epochs, verbose=0, **fit_kwargs)
        runs[way] = (model, history.history)
    return runs


def check_runs(runs, keys=("loss",)):
    reference, reference_history = runs.pop("big batch")
    for way, (model, history) in runs.items():
        assert_same_weights(model, reference, FLOAT32)
        for key in keys:
            np.testing.assert_allclose(history[key], reference_history[key], rtol=1e-5,
                                       err_msg=f"{way}: {key}")


def two_layer(model_class, **kwargs):
    return make_model(model_class, **kwargs)


class LearningRateLog(keras.callbacks.Callback):
    """A user's callback: the learning rate the optimizer reports after every epoch."""

    def on_epoch_end(self, epoch, logs=None):
        logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


def test_a_warmup_schedule_counts_updates_and_a_callback_reads_the_rate(strategy):
    x, y = regression(8 * MICRO)

    def adam_with_warmup():
        return keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(
            0.0, decay_steps=8, warmup_target=0.02, warmup_steps=3))

    runs = fit_both_ways(strategy, two_layer, {"optimizer": adam_with_warmup, "loss": "mse"},
                         lambda size: batches(x, y, size), epochs=3,
                         callbacks=[LearningRateLog()])
    rates = runs["big batch"][1]["lr"]
    assert rates[0] != rates[1] != rates[2]  # warm-up, then decay: the schedule moved
    check_runs(runs, keys=("loss", "lr"))


def test_validation_data_and_sample_weights(strategy):
    x, y = regression(8 * MICRO)
    weights = np.random.default_rng(1).uniform(0.5, 2.0, size=len(x)).astype("float32")
    x_val, y_val = regression(2 * MICRO, seed=3)

    def weighted(size):
        return tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(size, drop_remainder=True)

    runs = fit_both_ways(strategy, two_layer, {"optimizer": lambda: keras.optimizers.Adam(0.01),
                                               "loss": "mse", "weighted_metrics": ["mae"]},
                         weighted, validation_data=(x_val, y_val))
    check_runs(runs, keys=("loss", "mae", "val_loss", "val_mae"))


def test_class_weight(strategy):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8 * MICRO, 4)).astype("float32")
    labels = (x[:, 0] > 0.3).astype("int32") + (x[:, 1] > 0.5).astype("int32")  # 3 classes

    def classifier(model_class, **kwargs):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(8)(inputs))
        return model_class(inputs, outputs, **kwargs)

    runs = fit_both_ways(
        strategy, classifier, {"optimizer": lambda: keras.optimizers.SGD(0.1),
                               "loss": "sparse_categorical_crossentropy"},
        lambda size: batches(x, labels, size), class_weight={0: 1.0, 1: 3.0, 2: 0.5})
    check_runs(runs)


def test_a_model_with_two_outputs(strategy):
    x, y = regression(8 * MICRO, outputs=2)

    def two_outputs(model_class, **kwargs):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        outputs = {"a": keras.layers.Dense(1, name="a")(hidden),
                   "b": keras.layers.Dense(1, name="b")(hidden)}
        return model_class(inputs, outputs, **kwargs)

    def data(size):
        targets = {"a": y[:, :1], "b": y[:, 1:]}
        return tf.data.Dataset.from_tensor_slices((x, targets)).batch(size, drop_remainder=True)

    runs = fit_both_ways(strategy, two_outputs, {
        "optimizer": lambda: keras.optimizers.Adam(0.01),
        "loss": {"a": "mse", "b": "mae"}, "loss_weights": {"a": 1.0, "b": 0.5}}, data)
    check_runs(runs, keys=("loss", "a_loss", "b_loss"))


@pytest.mark.parametrize("way", ["AccumulatingOptimizer", "MicroBatchingModel",
                                 "GradientAccumulator"])
def test_global_clipnorm_clips_what_one_device_would(strategy, way):
    # Keras 3 clips each replica's part before its all-reduce (lesson 01): the reference
    # is one device, and the clip is tight enough to act on every step.
    x, y = regression(8 * MICRO)

    def clipped_adam():
        return keras.optimizers.Adam(0.01, global_clipnorm=0.05)

    one_device = big_batch(tf.distribute.get_strategy(), x, y, optimizer=clipped_adam())
    if way == "GradientAccumulator":
        model = custom_loop(strategy, x, y, make_optimizer=clipped_adam)[0]
    else:
        model = fit_both_ways(strategy, two_layer, {"optimizer": clipped_adam, "loss": "mse"},
                              lambda size: batches(x, y, size), ways=(way,))[way][0]
    assert_same_weights(model, one_device, FLOAT32)


# -- the next flags a user tries ------------------------------------------------------


@pytest.mark.usefixtures("collect_garbage")
@pytest.mark.parametrize("flag, fix", [({"jit_compile": True}, "jit_compile=False"),
                                       ({"steps_per_execution": 4}, "steps_per_execution=1")],
                         ids=["jit_compile", "steps_per_execution"])
@pytest.mark.parametrize("way", ["AccumulatingOptimizer", "MicroBatchingModel"])
def test_flags_stock_keras_cannot_run_on_two_replicas_fail_at_the_start_naming_the_fix(
        strategy, flag, fix, way):
    x, y = regression(8 * MICRO)
    with strategy.scope():
        if way == "MicroBatchingModel":
            model = make_model(distgrad.MicroBatchingModel, accumulation_steps=K)
            optimizer = keras.optimizers.Adam(0.01)
        else:
            model = make_model()
            optimizer = distgrad.AccumulatingOptimizer(keras.optimizers.Adam(0.01), K)
        model.compile(optimizer=optimizer, loss="mse", **flag)
    before = model.get_weights()
    with pytest.raises(ValueError, match=f"{fix}") as failed:
        model.fit(batches(x, y, MICRO), verbose=0)
    assert "stock Keras, plain Adam too" in str(failed.value)
    for now, then in zip(model.get_weights(), before):
        np.testing.assert_array_equal(now, then)  # nothing ran


@pytest.mark.parametrize("way", ["AccumulatingOptimizer", "MicroBatchingModel"])
def test_steps_per_execution_runs_on_one_replica(way):
    x, y = regression(8 * MICRO)
    models = {}
    for steps in (1, 4):
        with distgrad_course.make_strategy(1).scope():
            if way == "MicroBatchingModel":
                model = make_model(distgrad.MicroBatchingModel, accumulation_steps=K)
                optimizer, batch = keras.optimizers.Adam(0.01), K * MICRO
            else:
                model = make_model()
                optimizer = distgrad.AccumulatingOptimizer(keras.optimizers.Adam(0.01), K)
                batch = MICRO
            model.compile(optimizer=optimizer, loss="mse", steps_per_execution=steps)
        model.fit(batches(x, y, batch), verbose=0)
        models[steps] = model
    assert_same_weights(models[4], models[1], FLOAT32)


# -- tf-keras (Keras 2): TF_USE_LEGACY_KERAS=1 before TensorFlow, in a process of its own -

TF_KERAS_TRAIN = """
import json, warnings
import numpy as np
import distgrad
import distgrad_course  # (the test's two logical CPUs)
strategy = distgrad_course.make_strategy(2)
import tensorflow as tf
from distgrad.tf_keras import AccumulatingOptimizer

out, K, MICRO = {}, 2, 8
rng = np.random.default_rng(0)
x = rng.normal(size=(8 * MICRO, 4)).astype("float32")
y = (x @ rng.normal(size=(4, 1)) + 0.1 * rng.normal(size=(8 * MICRO, 1))).astype("float32")
x, y = x / 4, y / 4  # small enough for the default initial loss scale, 2**15, not to overflow

def model(accumulate):
    tf.keras.utils.set_random_seed(7)
    with strategy.scope():
        inputs = tf.keras.Input((4,))
        hidden = tf.keras.layers.Dense(8, activation="tanh")(inputs)
        m = tf.keras.Model(inputs, tf.keras.layers.Dense(1, dtype="float32")(hidden))
        adam = tf.keras.optimizers.Adam(0.01)
        m.compile(optimizer=AccumulatingOptimizer(adam, K) if accumulate else adam, loss="mse")
    return m

def data(x, y, size):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(size, drop_remainder=True)

for precision in ("float32", "mixed_float16"):
    tf.keras.mixed_precision.set_global_policy(precision)
    if precision == "mixed_float16":
        # An outlier in replica 1's half of micro-batch 2: skipped; big batch without it.
        bad_y = y.copy()
        bad_y[2 * MICRO + MICRO // 2] = 1e4
        skipping = model(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            skipping.fit(data(x[:7 * MICRO], bad_y[:7 * MICRO], MICRO), verbose=0)
        keep = np.r_[0:2 * MICRO, 3 * MICRO:7 * MICRO]
        reference = model(False)
        reference.fit(data(x[keep], y[keep], K * MICRO), verbose=0)
        accumulating = skipping.optimizer.inner_optimizer
        out["skip"] = {
            "optimizer": type(skipping.optimizer).__name__,
            "updates": int(accumulating.inner_optimizer.iterations.numpy()),
            "skipped_micro_batches": int(accumulating.skipped_micro_batches.numpy()),
            "warnings": [str(w.message) for w in caught
                         if "skipped in this fit" in str(w.message)],
            "weights": [w.tolist() for w in skipping.get_weights()],
            "reference": [w.tolist() for w in reference.get_weights()],
            "initial": [w.tolist() for w in model(False).get_weights()]}
    # Saved after 3 micro-batches (mid-cycle): .keras inside and outside the scope, .h5.
    uninterrupted = model(True)
    uninterrupted.fit(data(x, y, MICRO), verbose=0)
    np.savez(f"{precision}.npz", *uninterrupted.get_weights())
    first = model(True)
    first.fit(data(x[:3 * MICRO], y[:3 * MICRO], MICRO), verbose=0)
    with strategy.scope():
        first.save(f"{precision}-inside.keras")
    first.save(f"{precision}-outside.keras")
    if precision == "float32":
        first.save("float32.h5")
np.savez("rest.npz", x=x[3 * MICRO:], y=y[3 * MICRO:])
print(json.dumps(out))
"""

TF_KERAS_RESUME = """
import json, sys
import numpy as np
import distgrad  # registers distgrad.tf_keras.AccumulatingOptimizer with tf-keras
keras_3_imported = "keras" in sys.modules
import distgrad_course  # (the test's two logical CPUs)
strategy = distgrad_course.make_strategy(2)
import tensorflow as tf

rest, out = np.load("rest.npz"), {"keras 3 imported": keras_3_imported}
for precision in ("float32", "mixed_float16"):
    if precision == "mixed_float16":  # a user who forgot the policy is told so
        try:
            with strategy.scope():
                tf.keras.models.load_model("mixed_float16-inside.keras")
        except ValueError as err:
            out["without the policy"] = str(err)
        tf.keras.mixed_precision.set_global_policy("mixed_float16")
    files = [f"{precision}-inside.keras", f"{precision}-outside.keras"]
    for path in files + (["float32.h5"] if precision == "float32" else []):
        with strategy.scope():
            model = tf.keras.models.load_model(path)
        model.fit(tf.data.Dataset.from_tensor_slices((rest["x"], rest["y"])).batch(8),
                  verbose=0)
        expected = np.load(f"{precision}.npz")
        out[path] = max(float(np.max(np.abs(w - expected[f"arr_{i}"])))
                        for i, w in enumerate(model.get_weights()))
print(json.dumps(out))
"""


def test_tf_keras_skips_an_overflowing_micro_batch_and_resumes_a_save_exactly(tmp_path):
    legacy = {"TF_USE_LEGACY_KERAS": "1"}
    trained = run_script(tmp_path, TF_KERAS_TRAIN, env=legacy)
    resumed = run_script(tmp_path, TF_KERAS_RESUME, env=legacy)
    assert resumed.pop("keras 3 imported") is False  # `import distgrad` left Keras 3 alone
    skip = trained["skip"]
    assert skip["optimizer"] == "LossScaleOptimizerV3"  # what compile wrapped it in
    assert (skip["updates"], skip["skipped_micro_batches"]) == (3, 1)
    assert len(skip["warnings"]) == 1
    assert "1 micro-batch(es) whose gradients overflowed" in skip["warnings"][0]
    # big batch without the skipped micro-batch, up to float16 rounding
    check_float16_close(*(map(np.array, skip[key]) for key in ("weights", "reference", "initial")),
                        batch=BIG_BATCH_PER_REPLICA)
    assert "set_global_policy('mixed_float16') before load_model" in resumed.pop(
        "without the policy")
    # Resumed from each file, then fit on the rest: the uninterrupted run's weights.
    assert set(resumed) == {"float32-inside.keras", "float32-outside.keras", "float32.h5",
                            "mixed_float16-inside.keras", "mixed_float16-outside.keras"}
    assert all(diff <= FLOAT32["atol"] for diff in resumed.values()), resumed


# -- what a user writes by mistake ------------------------------------------------------


def test_a_gradient_accumulator_takes_no_accumulation_count(strategy):
    with strategy.scope():
        model = make_model()
        with pytest.raises(TypeError, match="takes no accumulation count.*your loop decides"):
            distgrad.GradientAccumulator(model.trainable_variables, 4)
