"""A cluster manager for local MultiWorkerMirroredStrategy jobs, with fault injection.

`run_cluster_with_restarts` starts the workers (`distgrad_course.lab.local_cluster`),
signals one of them (`Fault`) once its progress file (`progress_path`) shows a given
micro-batch, or leaves it out, restarts the whole cluster after a failure, at most
`max_restarts` times, and kills every process it started. A worker that saved and wants
the cluster restarted exits with RESTART_EXIT_CODE. What runs on it:
`distgrad_course.lab.preemption.preemptible_worker`.

It imports the standard library and the lab's child runner only (the workers import
TensorFlow themselves).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import tempfile
import time

from distgrad_course.lab.child import Child, ChildResult, check_timeout, resolve
from distgrad_course.lab.local_cluster import free_ports, tf_config, visible_gpus, worker_devices

# What the worker's exit_fn exits with after the handler saved (TensorFlow's own default off
# Google Cloud is `sys.exit(42)`, BorgTerminationConfig in failure_handling.py).
RESTART_EXIT_CODE = 42


def _write_json(path: str, value: dict) -> None:
    """Replace `path` with `value` at once (write a sibling, then rename)."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(value, f)
    os.replace(partial, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def progress_path(workdir: str, attempt: int, task_index: int) -> str:
    """The file worker `task_index` of `attempt` rewrites after every micro-batch
    (`{"pid", "micro_batches", "periodic_saves"}`); `<it>.strategy.json` says its
    strategy was created, `<it>.sigterm.json` when SIGTERM arrived and `<it>.exit.json`
    what the exit_fn saw."""
    return os.path.join(workdir, "progress", f"attempt{attempt}-worker{task_index}.json")


def read_progress(workdir: str, attempt: int, task_index: int, what: str = "") -> dict | None:
    """The progress record (`what=""`), or its "strategy", "sigterm" or "exit" record;
    None if there is none."""
    path = progress_path(workdir, attempt, task_index)
    return _read_json(f"{path}.{what}.json" if what else path)



FAULTS = ("SIGTERM", "SIGKILL", "ABSENT")


@dataclasses.dataclass(frozen=True)
class Fault:
    """What happens to worker `worker` in attempt `attempt` (None: in every attempt).

    "SIGTERM" / "SIGKILL": that signal, once the worker's progress file shows at least
    `after_micro_batch` micro-batches done. "ABSENT": the worker is not started at all
    (its machine is gone).
    """

    worker: int
    kind: str = "SIGTERM"
    after_micro_batch: int = 4  # preemption.SPLIT: mid-cycle
    attempt: int | None = 0

    def __post_init__(self):
        if self.kind not in FAULTS:
            raise ValueError(f"kind must be one of {FAULTS}, got {self.kind!r}.")


@dataclasses.dataclass
class Attempt:
    """One start of the whole cluster.

    `signals`: what the launcher sent (`worker`, `signal`, `micro_batches` its progress
    file showed then, `seconds` into the attempt). `absent`: workers not started.
    `returncodes`: each worker's exit status (negative: killed by that signal; None: not
    started). `killed_by_launcher`: workers still running when the launcher ended the
    attempt. `results`: each worker's `ChildResult`.
    """

    index: int
    ports: list
    signals: list
    absent: list
    returncodes: list
    killed_by_launcher: list
    timed_out: bool
    seconds: float
    results: list

    @property
    def succeeded(self) -> bool:
        return all(r.ok for r in self.results)


class RestartsExhausted(RuntimeError):
    """The cluster failed `max_restarts + 1` times; `attempts` holds every `Attempt`."""

    def __init__(self, message: str, attempts: list):
        super().__init__(message)
        self.attempts = attempts


@dataclasses.dataclass
class ClusterRun:
    """What `run_cluster_with_restarts` did: every `Attempt`, the last one succeeded."""

    workdir: str
    attempts: list

    @property
    def results(self) -> list[ChildResult]:
        return self.attempts[-1].results


def _applies(fault: Fault, attempt: int) -> bool:
    return fault.attempt is None or fault.attempt == attempt


def _run_attempt(target: str, num_workers: int, attempt: int, workdir: str, faults,
                 timeout: float, peer_grace: float, kill_survivors: bool, env: dict | None,
                 kwargs: dict) -> Attempt:
    ports, gpus = free_ports(num_workers), visible_gpus()
    faults = [f for f in faults if _applies(f, attempt)]
    absent = sorted({f.worker for f in faults if f.kind == "ABSENT"})
    pending = [f for f in faults if f.kind != "ABSENT" and f.worker not in absent]
    workers: dict[int, Child] = {}
    signals, timed_out, first_exit = [], False, None
    started = time.monotonic()
    try:
        for index in range(num_workers):
            if index not in absent:
                workers[index] = Child(
                    target, {"task_index": index, "num_workers": num_workers,
                             "workdir": workdir, "attempt": attempt, **kwargs},
                    env={**worker_devices(index, num_workers, gpus), **(env or {}),
                         "TF_CONFIG": tf_config(ports, index)})
        while not all(w.poll() for w in workers.values()):
            now = time.monotonic()
            for fault in list(pending):
                progress = read_progress(workdir, attempt, fault.worker)
                due = progress is not None and progress["micro_batches"] >= fault.after_micro_batch
                if due and not workers[fault.worker].poll():
                    os.kill(workers[fault.worker].process.pid, getattr(signal, fault.kind))
                    signals.append({"worker": fault.worker, "signal": fault.kind,
                                    "micro_batches": progress["micro_batches"],
                                    "seconds": now - started})
                    pending.remove(fault)
            exited = [w.process.returncode for w in workers.values() if w.poll()]
            if exited and first_exit is None:
                first_exit = now
            if first_exit is not None:
                # Saved and asked for a restart: the others get `peer_grace` seconds to
                # finish their part. Any other failure: a cluster manager restarts the whole
                # job at once (without kill_survivors: the survivors fail by themselves).
                restart_asked = all(code in (0, RESTART_EXIT_CODE) for code in exited)
                if (restart_asked and now - first_exit > peer_grace) or (
                        not restart_asked and kill_survivors):
                    break
            if now - started > timeout:
                timed_out = True
                break
            time.sleep(0.05)
        killed = [i for i, w in workers.items() if not w.poll()]
    finally:
        done = {i: w.result() for i, w in workers.items()}  # kills a worker still running
    results = [done.get(i) or ChildResult(target, None, False, None, None,
                                          "not started (an ABSENT fault)", 0.0)
               for i in range(num_workers)]
    return Attempt(attempt, ports, signals, absent, [r.returncode for r in results], killed,
                   timed_out, time.monotonic() - started, results)


def run_cluster_with_restarts(target: str, num_workers: int = 2, workdir: str | None = None,
                              faults=(), max_restarts: int = 2, timeout: float = 120.0,
                              peer_grace: float = 30.0, kill_survivors: bool = True,
                              env: dict | None = None, **kwargs) -> ClusterRun:
    """A cluster manager for local MultiWorkerMirroredStrategy jobs.

    Starts `target(task_index=i, num_workers=n, workdir=workdir, attempt=a, **kwargs)` in
    `num_workers` local processes (`TF_CONFIG` on fresh ports each attempt, each worker
    its own GPUs or the CPU only, as `distgrad_course.lab.local_cluster.run_workers`), applies
    each `Fault` (a signal sent when the worker's progress file, `progress_path`, is due;
    or a worker left out), and when an attempt ends without every worker succeeding,
    starts the whole cluster again: at most `max_restarts` times. When a worker exits
    with RESTART_EXIT_CODE (it saved), the others get `peer_grace` seconds to exit; any
    other failure ends the attempt at once (`kill_survivors`), or lets the survivors fail
    by themselves. An attempt running longer than `timeout` seconds is ended (and counts
    as failed). Every process it started is killed before it returns or raises.

    Returns a `ClusterRun` (`workdir`, every `Attempt`; the last one succeeded).

    Raises:
        RestartsExhausted: the last allowed attempt failed too (the message lists every
            attempt's exit codes, signals and errors; `.attempts` holds them).
        ValueError: a bad number of workers or restarts, a non-positive timeout, a fault
            for a worker that does not exist.
        ImportError / AttributeError: `target` cannot be imported here.
    """
    from distgrad_course.lab.args import positive_int

    positive_int("num_workers", num_workers)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}.")
    timeout, peer_grace = check_timeout(timeout), check_timeout(peer_grace)
    faults = list(faults)
    for fault in faults:
        if not 0 <= fault.worker < num_workers:
            raise ValueError(f"a fault for worker {fault.worker}, but the workers are "
                             f"0..{num_workers - 1}.")
    resolve(target)
    workdir = workdir or tempfile.mkdtemp(prefix="distgrad-cluster-")
    attempts = []
    for attempt in range(max_restarts + 1):
        attempts.append(_run_attempt(target, num_workers, attempt, workdir, faults, timeout,
                                     peer_grace, kill_survivors, env, kwargs))
        if attempts[-1].succeeded:
            return ClusterRun(workdir, attempts)
    lines = []
    for a in attempts:
        errors = [r.error and f"{r.error['type']}: {r.error['message'][-300:]}"
                  for r in a.results]
        lines.append(f"attempt {a.index}: exit codes {a.returncodes}, signals {a.signals}, "
                     f"absent {a.absent}, killed by the launcher {a.killed_by_launcher}"
                     f"{', timed out' if a.timed_out else ''}, errors {errors}")
    raise RestartsExhausted(f"the cluster failed {len(attempts)} times (max_restarts="
                            f"{max_restarts}); gave up.\n" + "\n".join(lines), attempts)
