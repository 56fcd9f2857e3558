"""Launch N local worker processes for `MultiWorkerMirroredStrategy`, collect results.

`run_workers("package.module:function", num_workers=2, **kwargs)` starts one child per
worker on localhost (`distgrad.lab.child.Child`: one process, one result protocol),
each with its own `TF_CONFIG` (ports picked free at run time), calls
`function(task_index=i, num_workers=n, **kwargs)` in every worker and returns every
worker's `ChildResult`. The workers share one machine, so each is given its CPU only
(`CUDA_VISIBLE_DEVICES=""` unless `env` sets it): one replica per worker, and no two
processes competing for one GPU. Every process it starts is killed (its whole process group)
when it returns, on timeout and on error: a worker never outlives the call.

A worker function must create the strategy itself, first thing:
`strategy = make_worker_strategy(timeout_seconds=...)` (`distgrad.lab.workers` has
the lesson-06 ones).

This module imports only the standard library.
"""

from __future__ import annotations

import json
import socket
import time

from distgrad.lab.args import positive_int
from distgrad.lab.child import Child, ChildResult, check_timeout, resolve

DEFAULT_TIMEOUT_S = 240.0
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def tf_config(ports: list[int], task_index: int) -> str:
    """The `TF_CONFIG` JSON for worker `task_index` of a localhost cluster on `ports`."""
    return json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": task_index},
    })


def run_workers(target: str, num_workers: int = 2, timeout: float = DEFAULT_TIMEOUT_S,
                env: dict | None = None, **kwargs) -> list[ChildResult]:
    """Run `target(task_index=i, num_workers=num_workers, **kwargs)` in each local worker.

    Returns one `ChildResult` per worker, in task order (`ok`, `value`, `error`,
    `returncode`, `stderr_tail`). Every worker's environment gets `TF_CONFIG`,
    `CUDA_VISIBLE_DEVICES=""` (CPU only; `env` may override it) and `env`.

    Raises:
        ValueError: `num_workers` < 1, a malformed target or a non-positive timeout.
        ImportError / AttributeError: `target` cannot be imported here (checked once
            here, not in N workers).
        TimeoutError: the workers have not all finished within `timeout` seconds
            (every worker is killed first).
    """
    positive_int("num_workers", num_workers)
    timeout = check_timeout(timeout)
    resolve(target)
    ports = free_ports(num_workers)
    workers: list[Child] = []
    try:
        for index in range(num_workers):
            workers.append(Child(
                target, {"task_index": index, "num_workers": num_workers, **kwargs},
                env={**CPU_ONLY, **(env or {}), "TF_CONFIG": tf_config(ports, index)}))
        deadline = time.monotonic() + timeout
        while not all(w.poll() for w in workers):
            if time.monotonic() > deadline:
                running = [i for i, w in enumerate(workers) if not w.poll()]
                raise TimeoutError(f"workers {running} did not finish within {timeout:.0f} s; "
                                   "all workers were killed.")
            time.sleep(0.05)
        return [w.result() for w in workers]
    finally:
        for w in workers:
            w.result()  # kills a worker still running, closes its files


def make_worker_strategy(timeout_seconds: float | None = 60.0):
    """Inside a worker: a `MultiWorkerMirroredStrategy` from `TF_CONFIG`, whose collectives
    fail after `timeout_seconds` instead of waiting forever for a dead peer."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
