"""Launch N local worker processes for `MultiWorkerMirroredStrategy`, collect results.

`run_workers("package.module:function", num_workers=2)` starts one Python process per
worker on localhost, each with its own `TF_CONFIG` (ports picked free at run time),
calls `function(task_index, num_workers, **kwargs)` in every worker, and returns each
worker's JSON-serializable return value. Every process it starts is killed (by pid) when
it returns, on timeout, and on error — a worker never outlives the call.

A worker function must create the strategy itself, first thing:
`strategy = distgrad.multiworker.make_worker_strategy(timeout_seconds=...)`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

DEFAULT_TIMEOUT_S = 240.0


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """One worker's outcome: `returncode`, its returned `value` (or None), the `error`
    it raised (type and message) if any, and the tail of its stderr."""

    task_index: int
    returncode: int | None
    value: object
    error: dict | None
    stderr_tail: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None


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


def _resolve(target: str):
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}.")
    return getattr(importlib.import_module(module_name), function_name)


def run_workers(target: str, num_workers: int = 2, timeout: float = DEFAULT_TIMEOUT_S,
                env: dict | None = None, **kwargs) -> list[WorkerResult]:
    """Run `target(task_index, num_workers, **kwargs)` in `num_workers` local workers.

    Returns one `WorkerResult` per worker, in task order. Raises ValueError for
    `num_workers` < 1 or a malformed target, TimeoutError (after killing every worker)
    when the workers have not all finished within `timeout` seconds.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}.")
    _resolve(target)  # fail here, not in N subprocesses
    ports = free_ports(num_workers)
    payload = json.dumps(kwargs)
    with tempfile.TemporaryDirectory(prefix="distgrad-workers-") as tmp:
        procs = []
        try:
            for index in range(num_workers):
                result_path = os.path.join(tmp, f"worker{index}.json")
                worker_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {}),
                              "TF_CONFIG": tf_config(ports, index)}
                stderr = open(os.path.join(tmp, f"worker{index}.err"), "w+")
                proc = subprocess.Popen(
                    [sys.executable, "-m", "distgrad.multiworker", target, str(index),
                     str(num_workers), result_path, payload],
                    env=worker_env, stdout=subprocess.DEVNULL, stderr=stderr,
                    start_new_session=True,
                )
                procs.append((proc, stderr, result_path, time.monotonic()))
            deadline = time.monotonic() + timeout
            finished = {}
            while len(finished) < num_workers:
                for index, (proc, _, _, started) in enumerate(procs):
                    if index not in finished and proc.poll() is not None:
                        finished[index] = time.monotonic() - started
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"workers {sorted(set(range(num_workers)) - set(finished))} did not "
                        f"finish within {timeout:.0f} s; all workers were killed."
                    )
                time.sleep(0.05)
            results = []
            for index, (proc, stderr, result_path, _) in enumerate(procs):
                stderr.seek(0)
                tail = stderr.read()[-4000:]
                outcome = {}
                if os.path.exists(result_path):
                    with open(result_path) as f:
                        outcome = json.load(f)
                results.append(WorkerResult(index, proc.returncode, outcome.get("value"),
                                            outcome.get("error"), tail, finished[index]))
            return results
        finally:
            for proc, stderr, _, _ in procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
                stderr.close()


def make_worker_strategy(timeout_seconds: float | None = 60.0):
    """Inside a worker: a `MultiWorkerMirroredStrategy` from `TF_CONFIG`, whose collectives
    fail after `timeout_seconds` instead of waiting forever for a dead peer."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def _worker_main(argv: list[str]) -> int:
    target, index, num_workers, result_path, payload = argv
    try:
        value = _resolve(target)(int(index), int(num_workers), **json.loads(payload))
        outcome = {"value": value, "error": None}
        code = 0
    except Exception as err:  # reported to the launcher, which decides
        outcome = {"value": None, "error": {"type": type(err).__name__, "message": str(err)}}
        code = 1
    with open(result_path, "w") as f:
        json.dump(outcome, f)
    sys.stdout.flush()
    # Skip interpreter teardown: a collective op still blocked on a dead peer can hang it.
    os._exit(code)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
