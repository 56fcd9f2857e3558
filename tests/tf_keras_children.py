"""The tf-keras programs of `tests/test_tf_keras_*.py`, one per scenario group.

Each runs in a `distgrad_course.lab.tf_keras_runner.run_tf_keras` child (tf-keras,
`TF_USE_LEGACY_KERAS=1`) and returns the observations its tests assert, as JSON: weights as
lists, counters after every batch (`distgrad_course.lab.tf_keras_fit.Counters`), errors as
`{"type", "message"}`. The class under test is imported from `module` (default
`distgrad.tf_keras`), so that `tests/test_copy_alone.py` can run the same program on a
copied file.
"""

import importlib
import tempfile

import numpy as np

from distgrad_course.lab.tf_keras_runner import tf_keras_strategy


def _accumulating(module):
    return importlib.import_module(module).AccumulatingOptimizer


def _error(call):
    try:
        call()
    except Exception as err:  # the error is the observation
        return {"type": type(err).__name__, "message": str(err)}
    return None


def traced_all_reduces(strategy, run):
    """Run `run()` and return, per function it traced, the `batch_reduce_to` calls (every
    all-reduce of a MirroredStrategy: the optimizers' gradient sums and
    `ReplicaContext.all_reduce`) as the number of values and whether a `tf.cond` branch
    holds it. (A function that creates variables on its first call is traced twice.)"""
    import tensorflow as tf

    graphs, traces, extended = [], [], strategy.extended  # graphs kept: ids stay unique
    original = extended.batch_reduce_to

    def spy(reduce_op, value_destination_pairs, options=None):
        pairs = list(value_destination_pairs)
        graph = outermost = tf.compat.v1.get_default_graph()
        while hasattr(getattr(outermost, "outer_graph", None), "outer_graph"):
            outermost = outermost.outer_graph  # up to the traced function's own graph
        if not any(outermost is g for g in graphs):
            graphs.append(outermost)
            traces.append([])
        traces[[g is outermost for g in graphs].index(True)].append(
            {"values": len(pairs), "in_cond": "cond" in getattr(graph, "name", "")})
        return original(reduce_op, pairs, options)

    extended.batch_reduce_to = spy
    try:
        run()
    finally:
        del extended.batch_reduce_to
    return traces


def fit_equivalence(replicas, x, y, micro_batch, accumulation_steps, names=None,
                    module="distgrad.tf_keras"):
    """`model.fit` with `AccumulatingOptimizer(inner, k)` on `replicas` replicas (batches of
    `micro_batch`) and one-device big-batch `fit` (batches of k * micro_batch), per inner
    optimizer of `tf_keras_fit.OPTIMIZERS` (or `names`), plus SGD with global_clipnorm and
    Adam accumulated without a strategy."""
    strategy = tf_keras_strategy(replicas)
    import tensorflow as tf

    from distgrad_course.lab import tf_keras_fit

    accumulating, k = _accumulating(module), accumulation_steps
    inner = dict(tf_keras_fit.OPTIMIZERS, **{
        "clipped sgd": lambda: tf.keras.optimizers.SGD(0.1, global_clipnorm=0.05)})
    runs = {}
    for name in names or inner:
        big, big_rows = tf_keras_fit.big_batch_fit(tf_keras_fit.tiny_model, inner[name], x, y,
                                                 k * micro_batch)
        model, rows = tf_keras_fit.fit(strategy, tf_keras_fit.tiny_model,
                                     lambda name=name: accumulating(inner[name](), k), x, y,
                                     micro_batch)
        runs[name] = {"accumulated": tf_keras_fit.weights(model), "rows": rows,
                      "big_batch": tf_keras_fit.weights(big), "big_batch_updates":
                      big_rows[-1]["updates"], "optimizer": type(model.optimizer).__name__,
                      "module": type(model.optimizer).__module__,
                      "accumulator_dtypes": [a.dtype.name for a in
                                             model.optimizer.accumulators]}
    if names is None:
        runs["adam"]["all_reduces"] = traced_all_reduces(strategy, lambda: tf_keras_fit.fit(
            strategy, tf_keras_fit.tiny_model, lambda: accumulating(inner["adam"](), k), x, y,
            micro_batch))
        model, rows = tf_keras_fit.fit(tf.distribute.get_strategy(), tf_keras_fit.tiny_model,
                                     lambda: accumulating(inner["adam"](), k), x, y, micro_batch)
        runs["adam, no strategy"] = {"accumulated": tf_keras_fit.weights(model), "rows": rows,
                                     "big_batch": runs["adam"]["big_batch"]}
        unclipped, _ = tf_keras_fit.big_batch_fit(tf_keras_fit.tiny_model,
                                                lambda: tf.keras.optimizers.SGD(0.1), x, y,
                                                k * micro_batch)
        runs["clipped sgd"]["unclipped_big_batch"] = tf_keras_fit.weights(unclipped)
    return runs


def _fresh_adam_fit(strategy, tf_keras_fit, accumulating, k, non_finite="raise"):
    with strategy.scope():
        model = tf_keras_fit.tiny_model()
        model.compile(optimizer=accumulating(tf_keras_fit.OPTIMIZERS["adam"](), k,
                                             non_finite=non_finite), loss="mse")
    return model


def _copies(variable):
    return [c.numpy().tolist() for c in variable.values]


def state_and_errors(replicas, x, y, bad_x, micro_batch, accumulation_steps, stop_after):
    """`checkpoint_round_trip`, `non_finite_cycles` and `bad_input`, in one child."""
    strategy = tf_keras_strategy(replicas)
    return {"checkpoint": checkpoint_round_trip(strategy, x, y, micro_batch,
                                                accumulation_steps, stop_after),
            "non_finite": non_finite_cycles(strategy, bad_x, y, micro_batch,
                                            accumulation_steps),
            "bad_input": bad_input(strategy), "config": config_round_trips()}


def checkpoint_round_trip(strategy, x, y, micro_batch, accumulation_steps, stop_after):
    """Adam, k micro-batches: fit all of `x` at once, and fit the first `stop_after`
    micro-batches (mid-cycle), save with `tf.train.Checkpoint` and `model.save`, restore
    each into a new model and optimizer, fit the rest. Returns the weights and what the
    restored optimizers hold."""
    import tensorflow as tf

    from distgrad_course.lab import tf_keras_fit

    accumulating, k = _accumulating("distgrad.tf_keras"), accumulation_steps
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    cut = stop_after * micro_batch

    def fit(model, xs, ys):
        model.fit(xs, ys, batch_size=micro_batch, shuffle=False, verbose=0)

    def state(model):
        optimizer = model.optimizer
        return {"micro_steps": int(optimizer.micro_steps.numpy()),
                "iterations": int(optimizer.iterations.numpy()),
                "updates": int(optimizer.inner_optimizer.iterations.numpy()),
                "accumulator": optimizer.accumulators[0].numpy().tolist(),
                "accumulator_copies": _copies(optimizer.accumulators[0])}

    uninterrupted = _fresh_adam_fit(strategy, tf_keras_fit, accumulating, k)
    fit(uninterrupted, x, y)
    first = _fresh_adam_fit(strategy, tf_keras_fit, accumulating, k)
    fit(first, x[:cut], y[:cut])
    saved, directory = state(first), tempfile.mkdtemp()
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(directory + "/ckpt")
    first.save(directory + "/model.keras")
    restored, lazily = (_fresh_adam_fit(strategy, tf_keras_fit, accumulating, k) for _ in "ab")
    with strategy.scope():
        restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
        path).assert_consumed()
    lazy_status = tf.train.Checkpoint(model=lazily, optimizer=lazily.optimizer).restore(path)
    with strategy.scope():
        loaded = tf.keras.models.load_model(directory + "/model.keras")
    result = {"saved": saved, "restored": state(restored), "loaded": state(loaded),
              "loaded_class": type(loaded.optimizer).__name__,
              "uninterrupted": tf_keras_fit.weights(uninterrupted)}
    for name, model in (("restored", restored), ("loaded", loaded), ("lazily", lazily)):
        fit(model, x[cut:], y[cut:])
        result[f"{name}_final"] = tf_keras_fit.weights(model)
    lazy_status.assert_consumed()  # built during `fit`: deferred restoration did it all
    return result


def config_round_trips():
    """`get_config` / `from_config`, alone and through tf-keras' (de)serialization of a
    `LossScaleOptimizer` around it (what `model.save` stores)."""
    import tensorflow as tf

    keras, accumulating = tf.keras, _accumulating("distgrad.tf_keras")
    alone = accumulating(keras.optimizers.legacy.SGD(0.1, momentum=0.9), 3, non_finite="skip")
    copy = accumulating.from_config(alone.get_config())
    wrapped = keras.optimizers.deserialize(keras.optimizers.serialize(
        keras.mixed_precision.LossScaleOptimizer(accumulating(keras.optimizers.Adam(0.01), 2))))
    return {"alone": [type(copy.inner_optimizer).__module__, copy.accumulation_steps,
                      copy.non_finite, float(copy.inner_optimizer.momentum)],
            "wrapped": [type(wrapped).__name__, type(wrapped.inner_optimizer).__name__,
                        wrapped.inner_optimizer.accumulation_steps,
                        type(wrapped.inner_optimizer.inner_optimizer).__name__]}


def non_finite_cycles(strategy, x, y, micro_batch, accumulation_steps):
    """`model.fit` with `non_finite` "raise" and "skip" on data whose NaN example makes one
    replica's gradients NaN in the second cycle, and big-batch `fit` of the first cycle."""
    from distgrad_course.lab import tf_keras_fit

    accumulating, k = _accumulating("distgrad.tf_keras"), accumulation_steps
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    first_cycle = slice(0, k * micro_batch)
    big, _ = tf_keras_fit.big_batch_fit(tf_keras_fit.tiny_model, tf_keras_fit.OPTIMIZERS["adam"],
                                      x[first_cycle], y[first_cycle], k * micro_batch)
    result = {"big_batch_first_cycle": tf_keras_fit.weights(big)}
    for policy in ("raise", "skip"):
        model = _fresh_adam_fit(strategy, tf_keras_fit, accumulating, k, non_finite=policy)
        counters = tf_keras_fit.Counters()
        error = _error(lambda model=model, counters=counters: model.fit(
            x, y, batch_size=micro_batch, shuffle=False, verbose=0, callbacks=[counters]))
        optimizer = model.optimizer
        result[policy] = {
            "error": error, "rows": counters.rows, "weights": tf_keras_fit.weights(model),
            "micro_steps": int(optimizer.micro_steps.numpy()),
            "accumulators_finite": all(bool(np.all(np.isfinite(a.numpy())))
                                       for a in optimizer.accumulators)}
    return result


def bad_input(strategy):
    """What each misuse raises: `{case: {"type", "message"} or None}`."""
    import tensorflow as tf

    from distgrad_course.lab import tf_keras_fit

    accumulating, keras = _accumulating("distgrad.tf_keras"), tf.keras
    def keras_3_class():  # distgrad.AccumulatingOptimizer; TF 2.15 (no Keras 3): ImportError
        return _accumulating("distgrad")

    sgd = keras.optimizers.SGD
    with strategy.scope():
        model = tf_keras_fit.tiny_model()
        built = accumulating(sgd(0.1), 2)
        built.build(model.trainable_variables)
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    outside = accumulating(sgd(0.1), 2)  # created without the strategy's scope

    def build_outside_under_scope():
        with strategy.scope():
            outside.build(model.trainable_variables)

    def apply_under_scope(**kwargs):
        with strategy.scope():
            built.apply_gradients(zip(grads, model.trainable_variables), **kwargs)

    def apply_in_replica_context(**kwargs):
        strategy.run(lambda: built.apply_gradients(zip(grads, model.trainable_variables),
                                                   **kwargs))

    def fit_without_merge_call():
        strategy.extended._use_merge_call = lambda: False  # as for an XLA step on GPUs
        try:
            tf_keras_fit.fit(strategy, tf_keras_fit.tiny_model, lambda: accumulating(sgd(0.1), 2),
                           np.ones((8, 4)), np.ones((8, 1)), 8)
        finally:
            del strategy.extended._use_merge_call

    cases = {
        "accumulation_steps=0": lambda: accumulating(sgd(0.1), 0),
        "accumulation_steps=True": lambda: accumulating(sgd(0.1), True),
        "non_finite='warn'": lambda: accumulating(sgd(0.1), 2, non_finite="warn"),
        "clipnorm on the wrapper": lambda: accumulating(sgd(0.1), 2, clipnorm=1.0),
        "a string": lambda: accumulating("adam", 2),
        "a LossScaleOptimizer inside": lambda: accumulating(
            keras.mixed_precision.LossScaleOptimizer(sgd(0.1)), 2),
        "the Keras 3 class": lambda: keras_3_class()(sgd(0.1), 2),
        "created outside the scope": build_outside_under_scope,
        "apply_gradients under the scope": apply_under_scope,
        "skip_gradients_aggregation": lambda: apply_in_replica_context(
            skip_gradients_aggregation=True),
        "2 replicas without merge_call": fit_without_merge_call,
    }
    return {case: _error(call) for case, call in cases.items()}


def mixed_precision(replicas, x, y, overflowing, without, micro_batch, accumulation_steps,
                    initial_scale, stop_after):
    """The third question's stack: tf-keras, `mixed_float16`, `model.fit`, the question's
    `train_step` (`tf_keras_loss_scale.QuestionModel`), `LossScaleOptimizer` around
    `AccumulatingOptimizer`. Clean runs vs one-device big batch; an overflow on one
    replica (the data `overflowing`) vs big batch on the data `without` that micro-batch; a
    checkpoint taken mid-cycle after the overflow (after `stop_after` micro-batches)."""
    strategy = tf_keras_strategy(replicas)
    import tensorflow as tf

    from distgrad_course.lab import tf_keras_fit
    from distgrad_course.pitfalls.tf_keras_loss_scale import QuestionModel

    accumulating, k, keras = _accumulating("distgrad.tf_keras"), accumulation_steps, tf.keras
    inner = tf_keras_fit.OPTIMIZERS

    def scaled(optimizer):
        return keras.mixed_precision.LossScaleOptimizer(optimizer, initial_scale=initial_scale)

    def stock_model():
        return tf_keras_fit.tiny_model(mixed=True)

    result = {}
    with tf_keras_fit.policy("mixed_float16"):
        with strategy.scope():
            model = QuestionModel()
            model.compile(optimizer=accumulating(inner["adam"](), k), loss="mse")
        # Every run's start (the same seeded initializers in both models), for float16 checks.
        initial = QuestionModel()
        initial(np.zeros((1, 4), np.float32))
        result["initial"] = tf_keras_fit.weights(initial)
        assert result["initial"] == tf_keras_fit.weights(stock_model())
        result["compiled"] = [type(model.optimizer).__name__,
                              type(model.optimizer.inner_optimizer).__name__,
                              isinstance(model.optimizer,  # the question's train_step asks
                                         keras.mixed_precision.LossScaleOptimizer)]
        for name, make_model in (("momentum", QuestionModel), ("adam", QuestionModel),
                                 ("legacy momentum", QuestionModel),
                                 ("adam, stock train_step", stock_model)):
            make = inner[name.split(",")[0]]
            model, rows = tf_keras_fit.fit(strategy, make_model, lambda make=make: scaled(
                accumulating(make(), k)), x, y, micro_batch)
            big, _ = tf_keras_fit.big_batch_fit(make_model, lambda make=make: scaled(make()), x,
                                              y, k * micro_batch)
            result[name] = {"accumulated": tf_keras_fit.weights(model), "rows": rows,
                            "big_batch": tf_keras_fit.weights(big)}
        result["all_reduces"] = traced_all_reduces(strategy, lambda: tf_keras_fit.fit(
            strategy, QuestionModel, lambda: scaled(accumulating(inner["adam"](), k)), x, y,
            micro_batch))
        overflowed, rows = tf_keras_fit.fit(strategy, QuestionModel, lambda: scaled(
            accumulating(inner["momentum"](), k)), *overflowing, micro_batch)
        big, _ = tf_keras_fit.big_batch_fit(QuestionModel, lambda: scaled(inner["momentum"]()),
                                          without[0], without[1], k * micro_batch)
        result["overflow"] = {"accumulated": tf_keras_fit.weights(overflowed), "rows": rows,
                              "big_batch_without": tf_keras_fit.weights(big)}
        result["checkpoint"] = _mixed_checkpoint(
            strategy, tf_keras_fit, lambda: scaled(accumulating(inner["momentum"](), k)),
            QuestionModel, *overflowing, micro_batch, stop_after)
    return result


def _mixed_checkpoint(strategy, tf_keras_fit, make_optimizer, make_model, x, y, micro_batch,
                      stop_after):
    import tensorflow as tf

    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    cut = stop_after * micro_batch
    models = []
    for _ in range(2):
        with strategy.scope():
            model = make_model()
            model.build((None, x.shape[1]))
            model.compile(optimizer=make_optimizer(), loss="mse")
            model.optimizer.build(model.trainable_variables)
        models.append(model)
    first, restored = models
    first.fit(x[:cut], y[:cut], batch_size=micro_batch, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(
        tempfile.mkdtemp() + "/ckpt")
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
        path).assert_consumed()
    optimizer = restored.optimizer
    state = {"loss_scale": float(optimizer.loss_scale.numpy()),
             "micro_steps": int(optimizer.inner_optimizer.micro_steps.numpy()),
             "updates": int(optimizer.inner_optimizer.inner_optimizer.iterations.numpy())}
    restored.fit(x[cut:], y[cut:], batch_size=micro_batch, shuffle=False, verbose=0)
    return {"restored": state, "final": tf_keras_fit.weights(restored)}


def custom_loops(replicas, x, y, micro_batch, accumulation_steps, updates):
    """tf-keras custom loops under MirroredStrategy, `updates` updates of k micro-batches:
    `distgrad.GradientAccumulator` (loss / the update's global batch, `make_apply_step`)
    and `AccumulatingOptimizer` (loss / the micro-batch's global batch, `apply_gradients`
    every micro-step), per inner optimizer, against one-device big-batch `fit`."""
    strategy = tf_keras_strategy(replicas)
    import tensorflow as tf

    from distgrad.accumulator import GradientAccumulator
    from distgrad_course.lab import tf_keras_fit

    accumulating, k = _accumulating("distgrad.tf_keras"), accumulation_steps
    batches = list(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((np.asarray(x, np.float32),
                                            np.asarray(y, np.float32))).batch(micro_batch)))

    def loss_of(model, data, global_batch):
        features, targets = data
        per_example = tf.reduce_mean(tf.square(model(features, training=True) - targets), -1)
        return tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)

    result = {}
    for name in ("adam", "legacy momentum"):
        make = tf_keras_fit.OPTIMIZERS[name]
        big, _ = tf_keras_fit.big_batch_fit(tf_keras_fit.tiny_model, make, x, y, k * micro_batch)
        with strategy.scope():
            model, optimizer = tf_keras_fit.tiny_model(), make()
            accumulator = GradientAccumulator(model.trainable_variables)
            wrapped_model, wrapped = tf_keras_fit.tiny_model(), accumulating(make(), k)

        def add(data, model=model, accumulator=accumulator):
            with tf.GradientTape() as tape:
                loss = loss_of(model, data, k * micro_batch)
            accumulator.add(tape.gradient(loss, model.trainable_variables))

        def step(data, model=wrapped_model, optimizer=wrapped):
            with tf.GradientTape() as tape:
                loss = loss_of(model, data, micro_batch)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                          model.trainable_variables))

        accumulate = tf.function(lambda data, add=add: strategy.run(add, args=(data,)))
        micro_step = tf.function(lambda data, step=step: strategy.run(step, args=(data,)))
        apply_step = accumulator.make_apply_step(optimizer)
        for update in range(updates):
            for data in batches[update * k:(update + 1) * k]:
                accumulate(data)
                micro_step(data)
            apply_step()
        result[name] = {"gradient_accumulator": tf_keras_fit.weights(model),
                        "accumulating_optimizer": tf_keras_fit.weights(wrapped_model),
                        "big_batch": tf_keras_fit.weights(big),
                        "iterations": [int(optimizer.iterations.numpy()),
                                       int(wrapped.iterations.numpy())]}
    return result
