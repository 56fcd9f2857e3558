"""Worker functions for lesson 06, run in every worker by `distgrad.multiworker.run_workers`.

Each takes `(task_index, num_workers, **options)`, creates its
`MultiWorkerMirroredStrategy` first (before other TensorFlow work) and returns a small
JSON-serializable dict. Worker w trains on the w-th contiguous slice of the global
batch, so the workers together see exactly the batch one device sees.
"""

from __future__ import annotations

import time

from distgrad.multiworker import make_worker_strategy

GLOBAL_BATCH = 16


def _optimizer(name: str):
    import keras

    return {
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
    }[name]


def _shard(task_index: int, num_workers: int, examples: int = GLOBAL_BATCH):
    from distgrad.equivalence import regression_data

    if examples % num_workers:
        raise ValueError(f"global batch {examples} is not divisible by {num_workers} workers.")
    x, y = regression_data(examples)
    per_worker = examples // num_workers
    lo, hi = task_index * per_worker, (task_index + 1) * per_worker
    return x, y, x[lo:hi], y[lo:hi]


def sync_and_equivalence(task_index: int, num_workers: int, optimizer: str = "sgd",
                         steps: int = 2, collective_timeout: float = 60.0) -> dict:
    """Plain `apply_gradients` on MWMS: where it syncs, and equality with one device."""
    strategy = make_worker_strategy(collective_timeout)
    import tensorflow as tf

    from distgrad.collectives import count_collectives
    from distgrad.equivalence import big_batch_reference, tiny_model, weight_diff, weights_of
    from distgrad.sync import make_replica_step

    make_optimizer = _optimizer(optimizer)
    with strategy.scope():
        model, opt = tiny_model(), make_optimizer()
        opt.build(model.trainable_variables)
        no_merge_call = bool(tf.__internal__.distribute.strategy_supports_no_merge_call())
    x, y, x_local, y_local = _shard(task_index, num_workers)
    replica_step = make_replica_step(GLOBAL_BATCH)

    @tf.function
    def step(xb, yb):
        return strategy.run(replica_step, args=(model, opt, xb, yb))

    for _ in range(steps):
        step(tf.constant(x_local), tf.constant(y_local))
    with strategy.scope():
        collectives = count_collectives(step, tf.constant(x_local), tf.constant(y_local))
    reference = big_batch_reference(make_optimizer, x, y, steps=steps)
    diff = weight_diff(weights_of(model), reference)
    return {
        "replicas": strategy.num_replicas_in_sync,
        "local_devices": list(strategy.extended.worker_devices),
        "supports_no_merge_call": no_merge_call,
        "collective_op_types": collectives.op_types,
        "all_reduces_per_step": collectives.all_reduce_ops,  # one replica per worker
        "iterations": int(opt.iterations.numpy()),
        "max_abs_diff_vs_one_device": diff.max_abs,
        "max_rel_diff_vs_one_device": diff.max_rel,
    }


def cond_around_apply(task_index: int, num_workers: int, collective_timeout: float = 30.0) -> dict:
    """`tf.cond(flag, apply_gradients, ...)` in replica context on MWMS: the lesson-03 error."""
    strategy = make_worker_strategy(collective_timeout)
    import tensorflow as tf

    from distgrad.equivalence import per_example_squared_error, tiny_model

    with strategy.scope():
        model, opt = tiny_model(), _optimizer("sgd")()
        opt.build(model.trainable_variables)
    _, _, x_local, y_local = _shard(task_index, num_workers)

    def replica_fn(xb, yb, flag):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(per_example_squared_error(yb, model(xb)),
                                              global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        tf.cond(flag, lambda: opt.apply_gradients(zip(grads, model.trainable_variables)),
                lambda: opt.iterations)
        return loss

    @tf.function
    def step(xb, yb, flag):
        return strategy.run(replica_fn, args=(xb, yb, flag))

    try:
        step(tf.constant(x_local), tf.constant(y_local), tf.constant(True))
        return {"error": None}
    except Exception as err:  # the pitfall: recorded, not hidden
        return {"error": {"type": type(err).__name__, "message": str(err)}}


def dead_worker(task_index: int, num_workers: int, collective_timeout: float = 10.0,
                dying_worker: int = 1) -> dict:
    """Worker `dying_worker` exits after one step; the others run a second step.

    The survivors' next all-reduce has no peer: with `collective_timeout` set it fails
    within that bound (the strategy's peer health check may abort it sooner).
    """
    import os

    strategy = make_worker_strategy(collective_timeout)
    import tensorflow as tf

    from distgrad.equivalence import tiny_model
    from distgrad.sync import make_replica_step

    with strategy.scope():
        model, opt = tiny_model(), _optimizer("sgd")()
        opt.build(model.trainable_variables)
    _, _, x_local, y_local = _shard(task_index, num_workers)
    replica_step = make_replica_step(GLOBAL_BATCH)

    @tf.function
    def step(xb, yb):
        return strategy.run(replica_step, args=(model, opt, xb, yb))

    step(tf.constant(x_local), tf.constant(y_local))
    if task_index == dying_worker:
        os._exit(3)  # a crash: no goodbye to the peers
    started = time.monotonic()
    try:
        step(tf.constant(x_local), tf.constant(y_local))
        return {"error": None, "seconds": time.monotonic() - started}
    except Exception as err:
        # TensorFlow prefixes the reason with the op's Python traceback; keep the reason.
        return {"error": {"type": type(err).__name__, "message": str(err)[-600:]},
                "seconds": time.monotonic() - started}


def checkpoint_from_chief(task_index: int, num_workers: int, directory: str,
                          steps: int = 2, collective_timeout: float = 60.0) -> dict:
    """Train `steps` SGD steps, then save a `tf.train.Checkpoint` of model and optimizer.

    Every worker must take part in the save (variables are read collectively), but only
    the chief (task 0) writes into `directory`; the others write to a throwaway
    directory of their own, the pattern of the TensorFlow multi-worker tutorial.
    """
    import tempfile

    strategy = make_worker_strategy(collective_timeout)
    import tensorflow as tf

    from distgrad.equivalence import tiny_model
    from distgrad.sync import make_replica_step

    with strategy.scope():
        model, opt = tiny_model(), _optimizer("sgd")()
        opt.build(model.trainable_variables)
    _, _, x_local, y_local = _shard(task_index, num_workers)
    replica_step = make_replica_step(GLOBAL_BATCH)

    @tf.function
    def step(xb, yb):
        return strategy.run(replica_step, args=(model, opt, xb, yb))

    for _ in range(steps):
        step(tf.constant(x_local), tf.constant(y_local))
    is_chief = task_index == 0
    target = directory if is_chief else tempfile.mkdtemp(prefix=f"worker{task_index}-")
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(f"{target}/ckpt")
    return {"is_chief": is_chief, "path": path if is_chief else None}
