"""Worker functions for lesson 06, run in every worker by
`distgrad_course.lab.local_cluster.run_workers`.

Each takes `(task_index, num_workers, **options)`, creates its
`MultiWorkerMirroredStrategy` first (before other TensorFlow work) and returns a small
JSON-serializable dict. `train_on_worker` is the one the lesson shows: written out, with
a `tf.data` pipeline per worker. The others feed worker w the w-th contiguous slice of
the global batch as a tensor (one replica per worker, as `run_workers` starts them), so
the workers together see exactly the batch one device sees. `optimizer` options name an
entry of `distgrad_course.lab.compare.OPTIMIZERS`.
"""

from __future__ import annotations

import time

from distgrad_course.lab.local_cluster import make_worker_strategy

GLOBAL_BATCH = 16


def _optimizer(name: str):
    from distgrad_course.lab.compare import OPTIMIZERS

    return OPTIMIZERS[name]


def _shard(task_index: int, num_workers: int, examples: int = GLOBAL_BATCH):
    from distgrad_course.lab.data import regression_data

    if examples % num_workers:
        raise ValueError(f"global batch {examples} is not divisible by {num_workers} workers.")
    x, y = regression_data(examples)
    per_worker = examples // num_workers
    lo, hi = task_index * per_worker, (task_index + 1) * per_worker
    return x, y, x[lo:hi], y[lo:hi]


def train_on_worker(task_index: int, num_workers: int, optimizer: str = "adam",
                    steps: int = 3) -> dict:
    """Lesson 06's worker: `steps` steps of the replica step of lesson 01 on MWMS.

    The cluster comes from `TF_CONFIG` (`run_workers` sets it); every worker builds the
    same model, feeds its shard of the same global batch of GLOBAL_BATCH examples, and
    the optimizer's SUM all-reduce joins the replicas of all workers. Returns the
    `TF_CONFIG` it read, what the strategy made of it, the collective ops of the traced
    step, and the weights (compared with one device by the caller).
    """
    import json
    import os

    import tensorflow as tf

    # First, before other TensorFlow work: reads TF_CONFIG, starts this worker's server.
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=60))  # a lost peer fails the all-reduce instead of hanging
    tf.config.experimental.enable_tensor_float_32_execution(False)  # exact float32 on GPUs

    from distgrad_course.lab.compare import OPTIMIZERS
    from distgrad_course.lab.data import per_example_squared_error, regression_data, tiny_model
    from distgrad_course.lab.graph import count_collectives

    with strategy.scope():  # mirrored variables: one copy per replica of every worker
        model = tiny_model()
        opt = OPTIMIZERS[optimizer]()
        opt.build(model.trainable_variables)

    def dataset_fn(context):  # called once per worker: its shard, in per-replica batches
        x, y = regression_data(GLOBAL_BATCH)
        return (tf.data.Dataset.from_tensor_slices((x, y))
                .shard(context.num_input_pipelines, context.input_pipeline_id)
                .batch(context.get_per_replica_batch_size(GLOBAL_BATCH))
                .repeat())

    batches = iter(strategy.distribute_datasets_from_function(dataset_fn))

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = per_example_squared_error(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        # The sync point: a SUM all-reduce over every replica of every worker.
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(iterator):
        return strategy.run(replica_step, args=next(iterator))

    for _ in range(steps):
        train_step(batches)
    with strategy.scope():
        collectives = count_collectives(train_step, batches)
        no_merge_call = bool(tf.__internal__.distribute.strategy_supports_no_merge_call())
    return {
        "tf_config": json.loads(os.environ["TF_CONFIG"]),
        "task": [strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id],
        "replicas": strategy.num_replicas_in_sync,
        "local_devices": list(strategy.extended.worker_devices),
        "collective_op_types": collectives.op_types,
        "supports_no_merge_call": no_merge_call,
        "iterations": int(opt.iterations.numpy()),
        "weights": [w.numpy() for w in model.weights],
    }


def strategy_after_runtime_start(task_index: int, num_workers: int) -> dict:
    """Run one eager op, then create MWMS: the error a strategy created too late gets."""
    import tensorflow as tf

    tf.constant(1.0) + 1.0  # any eager op starts TensorFlow's runtime
    try:
        tf.distribute.MultiWorkerMirroredStrategy()
        return {"error": None}
    except RuntimeError as err:
        return {"error": {"type": type(err).__name__, "message": str(err)}}


def cond_around_apply(task_index: int, num_workers: int, collective_timeout: float = 30.0) -> dict:
    """`tf.cond(flag, apply_gradients, ...)` in replica context on MWMS: the lesson-03 error."""
    strategy = make_worker_strategy(collective_timeout)
    import tensorflow as tf

    from distgrad_course.lab.data import per_example_squared_error, tiny_model

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


def _sgd_worker(collective_timeout: float):
    """`(model, optimizer, step)` of a worker: SGD on a tiny model under a fresh MWMS;
    `step(x, y)` runs one replica step on this worker's shard of the global batch."""
    strategy = make_worker_strategy(collective_timeout)
    import tensorflow as tf

    from distgrad_course.lab.data import tiny_model
    from distgrad_course.lab.recipes import make_replica_step

    with strategy.scope():
        model, opt = tiny_model(), _optimizer("sgd")()
        opt.build(model.trainable_variables)
    replica_step = make_replica_step(GLOBAL_BATCH)

    @tf.function
    def step(xb, yb):
        return strategy.run(replica_step, args=(model, opt, xb, yb))

    return model, opt, lambda xb, yb: step(tf.constant(xb), tf.constant(yb))


def dead_worker(task_index: int, num_workers: int, collective_timeout: float = 10.0,
                dying_worker: int = 1) -> dict:
    """Worker `dying_worker` exits after one step; the others run a second step.

    The survivors' next all-reduce has no peer: with `collective_timeout` set it fails
    within that bound (the strategy's peer health check may abort it sooner).
    """
    import os

    _, _, step = _sgd_worker(collective_timeout)
    x_local, y_local = _shard(task_index, num_workers)[2:]

    step(x_local, y_local)
    if task_index == dying_worker:
        # A peer may still be fetching this worker's part of step 1's all-reduce (its
        # RecvBuf is served by this process): give it time, so only step 2 is affected.
        time.sleep(2.0)
        os._exit(3)  # a crash: no goodbye to the peers
    started = time.monotonic()
    try:
        step(x_local, y_local)
        return {"error": None, "seconds": time.monotonic() - started}
    except Exception as err:  # the failure is the observation
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

    model, opt, step = _sgd_worker(collective_timeout)
    import tensorflow as tf

    x_local, y_local = _shard(task_index, num_workers)[2:]
    for _ in range(steps):
        step(x_local, y_local)
    is_chief = task_index == 0
    target = directory if is_chief else tempfile.mkdtemp(prefix=f"worker{task_index}-")
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(f"{target}/ckpt")
    return {"is_chief": is_chief, "path": path if is_chief else None}


def accumulated_equivalence(task_index: int, num_workers: int, recipe: str = "accumulator",
                            optimizer: str = "adam", accumulation_steps: int = 2,
                            updates: int = 2, collective_timeout: float = 60.0) -> dict:
    """Lessons 02/03 on MWMS: k micro-batches per update, each worker its slice of each.

    `recipe="accumulator"`: `GradientAccumulator` (accumulate function, then apply
    function, Python deciding). `recipe="optimizer"`: `AccumulatingOptimizer` through
    `apply_gradients` inside `strategy.run` every micro-step. Both are compared with
    `updates` one-device steps on batches of GLOBAL_BATCH examples.
    """
    strategy = make_worker_strategy(collective_timeout)
    import tensorflow as tf

    from distgrad.accumulator import GradientAccumulator
    from distgrad.optimizer import AccumulatingOptimizer
    from distgrad_course.lab.compare import weight_diff, weights_of
    from distgrad_course.lab.data import per_example_squared_error, regression_data, tiny_model
    from distgrad_course.lab.graph import count_collectives

    if recipe not in ("accumulator", "optimizer"):
        raise ValueError("recipe must be 'accumulator' or 'optimizer'.")
    make_optimizer = _optimizer(optimizer)
    micro = GLOBAL_BATCH // accumulation_steps  # global micro-batch
    if micro % num_workers:
        raise ValueError(f"micro-batch {micro} is not divisible by {num_workers} workers.")
    per_worker = micro // num_workers
    x, y = regression_data(GLOBAL_BATCH * updates)
    with strategy.scope():
        model = tiny_model()
        if recipe == "accumulator":
            opt = make_optimizer()
            accumulator = GradientAccumulator(model.trainable_variables)
        else:
            opt = AccumulatingOptimizer(make_optimizer(), accumulation_steps)
        opt.build(model.trainable_variables)

    def replica_fn(xb, yb):
        with tf.GradientTape() as tape:
            per_example = per_example_squared_error(yb, model(xb, training=True))
            # accumulator: normalize by the whole update; optimizer: it averages over k
            normalizer = GLOBAL_BATCH if recipe == "accumulator" else micro
            loss = tf.reduce_sum(per_example) / normalizer
        grads = tape.gradient(loss, model.trainable_variables)
        if recipe == "accumulator":
            accumulator.add(grads)
        else:
            opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def micro_step(xb, yb):
        return strategy.run(replica_fn, args=(xb, yb))

    apply_step = accumulator.make_apply_step(opt) if recipe == "accumulator" else None
    for update in range(updates):
        for j in range(accumulation_steps):
            lo = update * GLOBAL_BATCH + j * micro + task_index * per_worker
            micro_step(tf.constant(x[lo:lo + per_worker]), tf.constant(y[lo:lo + per_worker]))
        if apply_step is not None:
            apply_step()
    sample = (tf.constant(x[:per_worker]), tf.constant(y[:per_worker]))
    with strategy.scope():
        micro_ops = count_collectives(micro_step, *sample).all_reduce_ops
        apply_ops = count_collectives(apply_step.function).all_reduce_ops if apply_step else 0
    # One device, `updates` steps, each on the next GLOBAL_BATCH examples.
    ref_model, ref_opt = tiny_model(), make_optimizer()
    ref_opt.build(ref_model.trainable_variables)
    for update in range(updates):
        xb = x[update * GLOBAL_BATCH:(update + 1) * GLOBAL_BATCH]
        yb = y[update * GLOBAL_BATCH:(update + 1) * GLOBAL_BATCH]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example_squared_error(yb, ref_model(xb)))
        grads = tape.gradient(loss, ref_model.trainable_variables)
        ref_opt.apply_gradients(zip(grads, ref_model.trainable_variables))
    reference = weights_of(ref_model)
    diff = weight_diff(weights_of(model), reference)
    return {
        "recipe": recipe,
        "iterations": int(opt.iterations.numpy()),
        "all_reduce_ops_per_micro_step_function": micro_ops,
        "all_reduce_ops_per_apply_function": apply_ops,
        "max_abs_diff_vs_one_device": diff.max_abs,
        "max_rel_diff_vs_one_device": diff.max_rel,
    }


def run_script(task_index: int, num_workers: int, path: str) -> dict:
    """Run the Python file `path` in this worker as `python path` would (`run_workers` has
    set its `TF_CONFIG`), then report what its globals `strategy`, `model` and `optimizer`
    hold: the task the strategy read, its replicas and devices, the updates, the weights.

    Lesson 06 writes its fix cell, as it ran in the notebook, to `path` and runs it here on
    every worker of a local cluster.
    """
    import runpy

    script = runpy.run_path(path, run_name="__main__")
    strategy, model, optimizer = script["strategy"], script["model"], script["optimizer"]
    resolver = strategy.cluster_resolver
    return {
        "task": [resolver.task_type, resolver.task_id],
        "replicas": strategy.num_replicas_in_sync,
        "local_devices": list(strategy.extended.worker_devices),
        "updates": int(optimizer.iterations.numpy()),
        "weights": [w.numpy() for w in model.weights],
    }
