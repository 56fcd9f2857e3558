"""Launch N local worker processes for `MultiWorkerMirroredStrategy`, collect results.

`run_workers("package.module:function", num_workers=2, **kwargs)` starts one child per
worker on localhost (`distgrad_course.lab.child.Child`: one process, one result protocol),
each with its own `TF_CONFIG` (ports picked free at run time), calls
`function(task_index=i, num_workers=n, **kwargs)` in every worker and returns every
worker's `ChildResult`. The workers share one machine, and no two of them share a GPU
(`worker_devices`): with at least one visible GPU per worker, worker i sees its own
GPU(s) only; with fewer, every worker sees the CPU only (`CUDA_VISIBLE_DEVICES=""`).
Every process it starts is killed (its whole process group) when it returns, on
timeout and on error: a worker never outlives the call.

A worker function must create the strategy itself, first thing:
`strategy = make_worker_strategy(timeout_seconds=...)` (`distgrad_course.lab.workers` has
the lesson-06 ones), which also keeps float32 exact on GPUs (TF32 off, as
`distgrad_course.make_strategy`) and lets the worker's GPUs grow their memory.

This module imports only the standard library.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time

from distgrad_course.lab.args import positive_int
from distgrad_course.lab.child import Child, ChildResult, check_timeout, resolve

DEFAULT_TIMEOUT_S = 240.0


def visible_gpus() -> list[str]:
    """The GPU ids this process may hand out, without importing TensorFlow: those of
    `CUDA_VISIBLE_DEVICES` if it is set, else one per line of `nvidia-smi -L`, else none."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        lines = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                               timeout=30, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(lines) if line.startswith("GPU ")]


def worker_devices(task_index: int, num_workers: int, gpus: list[str]) -> dict:
    """`CUDA_VISIBLE_DEVICES` of worker `task_index` (pure function): with at least one of
    `gpus` per worker, its own contiguous share of them; else none (the CPU only), since
    two processes on one GPU would compete for its memory."""
    share = len(gpus) // num_workers
    mine = gpus[task_index * share:(task_index + 1) * share] if share else []
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


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
    `returncode`, `stderr_tail`). Every worker's environment gets `TF_CONFIG`, its
    `CUDA_VISIBLE_DEVICES` (`worker_devices`; `env` may override it) and `env`.

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
    ports, gpus = free_ports(num_workers), visible_gpus()
    workers: list[Child] = []
    try:
        for index in range(num_workers):
            workers.append(Child(
                target, {"task_index": index, "num_workers": num_workers, **kwargs},
                env={**worker_devices(index, num_workers, gpus), **(env or {}),
                     "TF_CONFIG": tf_config(ports, index)}))
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
    fail after `timeout_seconds` instead of waiting forever for a dead peer. Its GPUs, if
    any, grow their memory as needed, and TF32 is off (float32 compared at 1e-6)."""
    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        tf.config.experimental.set_memory_growth(gpu, True)
    tf.config.experimental.enable_tensor_float_32_execution(False)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
