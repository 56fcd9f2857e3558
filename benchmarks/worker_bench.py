"""What runs inside each worker process of the multi-worker benchmark.

`bench_worker(task_index, num_workers, ...)` is called in every worker by
`distgrad_course.lab.local_cluster.run_workers`: it creates the `MultiWorkerMirroredStrategy`,
builds the runners of one k at a time, and times them in paired, interleaved rounds.
Every worker runs the same sequence of steps (the collectives need it); each returns its
own times, and the chief also the loopback bytes of each runner's block.

The runners are those of the one-process benchmark (`benchmarks.loop_runners`,
`benchmarks.fit_runners`), with two changes for several workers: the fit runners' models
are `distgrad.multi_worker.MultiWorkerFitModel`s (stock Keras 3 `fit` fails on several
workers, keras-team/keras#20585), and a *compute-only* runner trains the same plain step
on a model outside the strategy: the same per-worker work, no all-reduce.

Bytes are read from `/proc/self/net/dev`: the driver runs the workers in a network
namespace of their own (`benchmarks.multi_worker`), so the loopback there carries only
their traffic. Each timed block runs between two untimed barriers (an all-reduce of one
float, so every worker starts the block together), and the chief reads the loopback's
transmitted bytes at both.
"""

from __future__ import annotations

import gc
import time


def block_of(block: int, k: int) -> int:
    """Micro-batches of one timed block at `k`: `block`, or k when k is larger (one update)."""
    return max(block, k)


KEYS = ("plain", "gradient_accumulator", "accumulating_optimizer", "micro_batching",
        "mask_trick", "compute_only")


def loopback_bytes() -> int | None:
    """Bytes the loopback of this process' network namespace has transmitted, or None."""
    try:
        with open("/proc/self/net/dev") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # receive: 8 fields, then transmit bytes
    return None


def _runner_classes():
    """{key: runner class}, imported in the worker (TensorFlow is imported here)."""
    from benchmarks.fit_runners import MaskTrickFit, MicroBatchingFit
    from benchmarks.loop_runners import (
        AccumulatingOptimizerCustom,
        GradientAccumulatorCustom,
        PlainCustom,
    )
    from benchmarks.runners import mlp
    from distgrad.multi_worker import MultiWorkerFit, MultiWorkerFitModel
    from distgrad.train_step import MicroBatchingModel

    class MicroBatchingMultiWorkerModel(MultiWorkerFit, MicroBatchingModel):
        """`MicroBatchingModel` with `fit` on several workers."""

    class MicroBatchingMultiWorker(MicroBatchingFit):
        def _model(self):
            base = mlp(self.sizes.features, self.sizes.hidden, self.sizes.layers)
            return MicroBatchingMultiWorkerModel(base.inputs, base.outputs,
                                                 accumulation_steps=self.k)

    class MaskTrickMultiWorker(MaskTrickFit):
        def _model(self):
            base = mlp(self.sizes.features, self.sizes.hidden, self.sizes.layers)
            return MultiWorkerFitModel(base.inputs, base.outputs)

    return {"plain": PlainCustom, "gradient_accumulator": GradientAccumulatorCustom,
            "accumulating_optimizer": AccumulatingOptimizerCustom,
            "micro_batching": MicroBatchingMultiWorker, "mask_trick": MaskTrickMultiWorker,
            "compute_only": PlainCustom}


def bench_worker(task_index: int, num_workers: int, sizes: dict, ks: list, rounds: int,
                 keys: list, threads: int, collective_timeout: float = 600.0) -> dict:
    """Time `keys` at every k of `ks` on this worker; see the module docstring.

    `sizes`: `features`, `hidden`, `layers`, `per_worker_batch`, `block` (micro-batches
    per timed block: `block_of(block, k)`, the same for every runner of one k). Returns
    `{"times": {k: {key: [seconds per round]}}, "bytes": {k: {key: [loopback bytes of
    each round's block]}} (chief; None elsewhere), "per_replica_batch", "parameters",
    "threads"}`.
    """
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    from benchmarks.runners import Sizes, block_data
    from distgrad_course.lab.local_cluster import make_worker_strategy

    strategy = make_worker_strategy(timeout_seconds=collective_timeout)
    if strategy.num_replicas_in_sync != num_workers:
        raise RuntimeError(f"{strategy.num_replicas_in_sync} replicas on {num_workers} "
                           "workers: the benchmark wants one replica per worker.")
    per_worker = sizes["per_worker_batch"]

    def runner_sizes(micro_batch, k):
        return Sizes(features=sizes["features"], hidden=sizes["hidden"],
                     layers=sizes["layers"], micro_batch=micro_batch,
                     micro_batches_per_block=block_of(sizes["block"], k), repeats=rounds,
                     scaling_repeats=rounds)

    @tf.function
    def barrier_step():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            "SUM", tf.ones([])))

    def barrier():
        barrier_step()

    classes = _runner_classes()
    times, block_bytes, parameters, per_replica_batch = {}, {}, None, None
    for k in ks:
        global_sizes = runner_sizes(per_worker * num_workers, k)
        local_sizes = runner_sizes(per_worker, k)
        runners = {}
        for key in keys:
            if key == "compute_only":
                x, y = block_data(local_sizes, k)
                runners[key] = classes[key](tf.distribute.get_strategy(), local_sizes, k, x, y)
            else:
                x, y = block_data(global_sizes, k)
                runners[key] = classes[key](strategy, global_sizes, k, x, y)
        first = next(iter(runners.values()))
        if parameters is None:
            parameters = int(sum(v.shape.num_elements() for v in first.model.trainable_variables))
        plain = runners.get("plain")
        if plain is not None and per_replica_batch is None:
            local = strategy.experimental_local_results(plain.micro_batches[0][0])
            per_replica_batch = int(local[0].shape[0])
            if per_replica_batch != per_worker:
                raise RuntimeError(f"each worker got {per_replica_batch} examples per "
                                   f"micro-batch, not {per_worker}.")
        updates = global_sizes.block_updates(k)
        times[k] = {key: [] for key in runners}
        block_bytes[k] = {key: [] for key in runners}
        order = list(runners)
        for r in range(rounds):
            rotated = order[r % len(order):] + order[:r % len(order)]
            for key in rotated:
                barrier()
                before = loopback_bytes()
                gc.collect()
                gc.disable()
                try:
                    times[k][key].append(runners[key].run(updates))
                finally:
                    gc.enable()
                barrier()
                after = loopback_bytes()
                block_bytes[k][key].append(None if before is None or after is None
                                           else after - before)
        del runners, plain, first
        gc.collect()
    barrier()
    # A worker whose last all-reduce is done may still have to serve its buffers to a
    # peer (gRPC RecvBuf); exiting at once closes that socket under the peer ("Socket
    # closed", seen behind the rate limit). Linger before returning (and exiting).
    time.sleep(2.0)
    return {"times": times, "bytes": block_bytes if task_index == 0 else None,
            "per_replica_batch": per_replica_batch, "parameters": parameters,
            "threads": threads}
