"""A custom accumulation loop checkpointed mid-cycle and resumed exactly in a fresh process.

One process (`custom_loop`, MirroredStrategy on 2 replicas): train k=3 micro-batches per
Adam update with `GradientAccumulator` over a shuffled, repeated `tf.data` pipeline, save
a `tf.train.Checkpoint` after micro-batch 4 (1 update done, 1 micro-batch of the next
cycle accumulated), restore it in a fresh process and finish. On TensorFlow 2.21 a
distributed iterator cannot go into a checkpoint (`iterator_checkpointability`), so the
data position is a step count in the checkpoint and the resumed pipeline `skip`s that many
micro-batches (`data="skip"`), or the checkpoint holds a plain `tf.data` iterator whose
global batches the loop splits over the replicas itself (`data="plain_iterator"`).

The data (`global_micro_batches`), the one-device answer (`reference_weights`) and the
loop's pieces are also those of the cluster under `PreemptionCheckpointHandler`
(`distgrad_course.lab.preemption`). The functions that run in a child import TensorFlow
themselves.
"""

from __future__ import annotations

import os

import numpy as np

EXAMPLES = 48  # two epochs of 6 global micro-batches: 12 micro-batches, 4 updates
FEATURES = 4
MICRO_BATCH = 8  # global micro-batch (all replicas together)
ACCUMULATION_STEPS = 3
EPOCHS = 2
MICRO_STEPS = EXAMPLES * EPOCHS // MICRO_BATCH
SHUFFLE_SEED = 7
LEARNING_RATE = 0.01
SPLIT = 4  # the mid-cycle checkpoint: 1 update done, 1 micro-batch of the next accumulated
DATA_MODES = ("skip", "plain_iterator")


# ----------------------------------------------------------------------------- shared


def global_micro_batches(epochs: int | None = EPOCHS):
    """The input of every run: `(x, y)` global micro-batches of MICRO_BATCH examples, the
    examples shuffled with a fixed seed and reshuffled each of `epochs` epochs (None:
    repeated forever).

    The first iteration of a dataset it builds is the same in every process and for every
    call (the op seed, with TensorFlow's global seed unset or equal, fixes the order of
    every epoch), so a resumed run rebuilds it and `skip`s; a second `iter()` over the
    *same* dataset object reshuffles.
    """
    import tensorflow as tf

    from distgrad_course.lab.data import regression_data

    x, y = regression_data(EXAMPLES, FEATURES)
    return (tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(EXAMPLES, seed=SHUFFLE_SEED, reshuffle_each_iteration=True)
            .repeat(epochs)
            .batch(MICRO_BATCH, drop_remainder=True))


def reference_weights() -> list[np.ndarray]:
    """One device, one Adam step per ACCUMULATION_STEPS consecutive global micro-batches
    (their concatenation, mean loss): what every accumulated run must end with."""
    import keras
    import tensorflow as tf

    from distgrad_course.lab.compare import weights_of
    from distgrad_course.lab.data import per_example_squared_error, tiny_model

    batches = list(global_micro_batches())
    model, optimizer = tiny_model(), keras.optimizers.Adam(LEARNING_RATE)
    for start in range(0, len(batches), ACCUMULATION_STEPS):
        group = batches[start:start + ACCUMULATION_STEPS]
        x = tf.concat([b[0] for b in group], 0)
        y = tf.concat([b[1] for b in group], 0)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example_squared_error(y, model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return weights_of(model)


def _error(err: BaseException) -> dict:
    return {"type": type(err).__name__, "message": str(err)}


def _replica_fn(model, accumulator):
    """Replica context: one micro-batch's gradients into the accumulator, its loss out.
    The loss is divided by the global batch of the whole update (MICRO_BATCH * k)."""
    import tensorflow as tf

    from distgrad_course.lab.data import per_example_squared_error

    def replica_fn(x, y):
        with tf.GradientTape() as tape:
            per_example = per_example_squared_error(y, model(x, training=True))
            loss = tf.reduce_sum(per_example) / (MICRO_BATCH * ACCUMULATION_STEPS)
        accumulator.add(tape.gradient(loss, model.trainable_variables))
        return loss

    return replica_fn


def _build(strategy):
    """Model, Adam, accumulator and the micro-batch counter, under `strategy`; the apply
    step (which builds Adam under the scope, before any trace)."""
    import keras
    import tensorflow as tf

    from distgrad.accumulator import GradientAccumulator
    from distgrad_course.lab.data import tiny_model

    with strategy.scope():
        model = tiny_model()
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        accumulator = GradientAccumulator(model.trainable_variables)
        micro_batches = tf.Variable(0, dtype=tf.int64, trainable=False, name="micro_batches")
    return model, optimizer, accumulator, micro_batches, accumulator.make_apply_step(optimizer)


# ------------------------------------------------------------- one process, 2 replicas


def iterator_checkpointability(replicas: int = 2) -> dict:
    """Which iterators `tf.train.Checkpoint(iterator=...)` accepts, under
    `make_strategy(replicas)`: None where it does, else the error (`type`, `message`)."""
    from distgrad_course.devices import make_strategy

    strategy = make_strategy(replicas)
    import tensorflow as tf

    def per_replica(context):
        return global_micro_batches().unbatch().batch(
            context.get_per_replica_batch_size(MICRO_BATCH), drop_remainder=True)

    iterators = {
        "experimental_distribute_dataset": lambda: iter(
            strategy.experimental_distribute_dataset(global_micro_batches())),
        "distribute_datasets_from_function": lambda: iter(
            strategy.distribute_datasets_from_function(per_replica)),
        "plain_tf_data": lambda: iter(global_micro_batches()),
    }
    found = {}
    for name, make in iterators.items():
        try:
            tf.train.Checkpoint(iterator=make())
            found[name] = None
        except (TypeError, ValueError) as err:
            found[name] = _error(err)
    return found


def custom_loop(workdir: str, phase: str, data: str = "skip", replicas: int = 2,
                without_accumulator: bool = False) -> dict:
    """The custom loop on `make_strategy(replicas)`, in a process of its own.

    `phase="first"`: all MICRO_STEPS micro-batches from scratch, saving a checkpoint into
    `workdir` after micro-batch SPLIT; its final weights are the uninterrupted run.
    `phase="rest"`: restore that checkpoint (a fresh process) and finish;
    `without_accumulator=True` leaves the accumulator out of what it restores (the
    mistake: the micro-batch accumulated before the save is lost). Each writes its
    final weights to `workdir/<phase>[_without_accumulator].npz` (`"weights_file"`) and
    returns the counters, the restored ones included. `data`: how the checkpoint keeps
    the data position, "skip" (a `micro_batches` count; the pipeline skips that many)
    or "plain_iterator" (a plain tf.data iterator of global batches, which the loop
    splits over the replicas itself).
    """
    if phase not in ("first", "rest"):
        raise ValueError(f"phase must be 'first' or 'rest', got {phase!r}.")
    if data not in DATA_MODES:
        raise ValueError(f"data must be one of {DATA_MODES}, got {data!r}.")
    if without_accumulator and phase != "rest":
        raise ValueError("without_accumulator applies to phase 'rest' only.")
    from distgrad_course.devices import make_strategy

    strategy = make_strategy(replicas)
    import tensorflow as tf

    from distgrad_course.lab.compare import weights_of

    model, optimizer, accumulator, micro_batches, apply_step = _build(strategy)
    state = {"model": model, "optimizer": optimizer, "micro_batches": micro_batches}
    if not without_accumulator:
        state["accumulator"] = accumulator
    plain = iter(global_micro_batches()) if data == "plain_iterator" else None
    if plain is not None:
        state["iterator"] = plain
    checkpoint = tf.train.Checkpoint(**state)
    restored = None
    if phase == "rest":
        status = checkpoint.restore(tf.train.latest_checkpoint(workdir))
        if without_accumulator:
            status.expect_partial()
        else:
            status.assert_consumed()  # every saved value found its variable
        restored = {"iterations": int(optimizer.iterations.numpy()),
                    "micro_steps": accumulator.micro_steps,
                    "micro_batches": int(micro_batches.numpy())}
    if plain is None:
        batches = iter(strategy.experimental_distribute_dataset(
            global_micro_batches().skip(int(micro_batches.numpy()))))
    replica_fn = _replica_fn(model, accumulator)

    @tf.function
    def accumulate(x, y):
        strategy.run(replica_fn, args=(x, y))

    def next_batch():
        if plain is None:
            return next(batches)
        x, y = next(plain)  # a global batch: replica r takes the r-th contiguous slice
        per = MICRO_BATCH // strategy.num_replicas_in_sync
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: (x[ctx.replica_id_in_sync_group * per:][:per],
                         y[ctx.replica_id_in_sync_group * per:][:per]))

    saved = None
    while int(micro_batches.numpy()) < MICRO_STEPS:
        accumulate(*next_batch())
        if accumulator.micro_steps == ACCUMULATION_STEPS:
            apply_step()
        micro_batches.assign_add(1)
        if phase == "first" and int(micro_batches.numpy()) == SPLIT:
            saved = {"path": checkpoint.save(os.path.join(workdir, "ckpt")),
                     "iterations": int(optimizer.iterations.numpy()),
                     "micro_steps": accumulator.micro_steps}
    weights_file = os.path.join(
        workdir, f"{phase}{'_without_accumulator' if without_accumulator else ''}.npz")
    np.savez(weights_file, *weights_of(model))
    return {"phase": phase, "data": data, "saved": saved, "restored": restored,
            "weights_file": weights_file,
            "iterations": int(optimizer.iterations.numpy()),
            "micro_steps": accumulator.micro_steps,
            "micro_batches": int(micro_batches.numpy())}


def load_weights(path: str) -> list[np.ndarray]:
    """The arrays `np.savez(path, *weights)` wrote, in order."""
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def resume_custom_loop(workdir: str, data: str = "skip", replicas: int = 2,
                       without_accumulator: bool = False, timeout: float = 300.0) -> dict:
    """`custom_loop` phase "first" then phase "rest", each in a fresh process
    (`distgrad_course.lab.child.run_child`): their reports, with their final weights
    (`"weights"`). Raises `ChildError` with a child's stderr tail if a phase fails."""
    from distgrad_course.lab.child import run_child

    reports = {}
    for phase in ("first", "rest"):
        reports[phase] = run_child(
            "distgrad_course.lab.custom_loop_resume:custom_loop",
            {"workdir": workdir, "phase": phase, "data": data, "replicas": replicas,
             "without_accumulator": without_accumulator and phase == "rest"},
            timeout=timeout).value
        reports[phase]["weights"] = load_weights(reports[phase]["weights_file"])
    return reports
