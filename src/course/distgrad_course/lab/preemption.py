"""Preemption of a cluster mid-cycle: `PreemptionCheckpointHandler`, SIGTERM and SIGKILL.

A cluster (`preemptible_worker`, one replica per worker of a `MultiWorkerMirroredStrategy`)
trains the accumulation loop of `distgrad_course.lab.custom_loop_resume` under
`tf.distribute.experimental.PreemptionCheckpointHandler`, one `handler.run` per
micro-batch, the chief also saving every `save_every` micro-batches with a
`tf.train.CheckpointManager`. The cluster manager of `distgrad_course.lab.cluster_manager`
(`run_cluster_with_restarts`) starts it, signals a worker (`Fault`) and restarts it;
`preemption_experiment` runs one of SCENARIOS (SIGTERM, SIGKILL, a survivor left alone, a
worker that never comes back) and returns its numbers.

The handler saves every worker at the same run count (its `run()` calls), so the workers
must stay within one micro-batch of each other: an all-reduce in every micro-batch does
that (on MWMS a finite distributed dataset has one, its has-data flag; the loop adds the
summed loss). Without one, a worker runs ahead to the next apply, and a SIGTERM fails
both workers instead of saving (scenario "SIGTERM_without_sync").

The names a lesson reaches through this module are importable from here too:
`run_cluster_with_restarts`, `Fault`, `RestartsExhausted`, `read_progress` (the
manager's), `iterator_checkpointability`, `reference_weights`, `load_weights` (the
loop's). The launcher imports only the standard library and NumPy; the functions that run
in a child import TensorFlow themselves.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time

import numpy as np

from distgrad_course.lab.cluster_manager import RESTART_EXIT_CODE, _write_json, progress_path
from distgrad_course.lab.cluster_manager import Fault as Fault
from distgrad_course.lab.cluster_manager import RestartsExhausted as RestartsExhausted
from distgrad_course.lab.cluster_manager import read_progress as read_progress
from distgrad_course.lab.cluster_manager import (
    run_cluster_with_restarts as run_cluster_with_restarts,
)
from distgrad_course.lab.custom_loop_resume import (
    ACCUMULATION_STEPS,
    EPOCHS,
    MICRO_BATCH,
    MICRO_STEPS,
    SPLIT,
    _build,
    _error,
    _replica_fn,
    global_micro_batches,
)
from distgrad_course.lab.custom_loop_resume import (
    iterator_checkpointability as iterator_checkpointability,
)
from distgrad_course.lab.custom_loop_resume import load_weights as load_weights
from distgrad_course.lab.custom_loop_resume import reference_weights as reference_weights


def preemptible_worker(task_index: int, num_workers: int, workdir: str, attempt: int = 0,
                       save_every: int = 0, step_delay: float | list = 0.0,
                       sync_micro_steps: bool = True, infinite_data: bool = False,
                       collective_timeout: float = 30.0) -> dict:
    """One worker of the accumulation loop under `PreemptionCheckpointHandler`.

    The handler restores the latest checkpoint of `workdir/checkpoints` when it is created
    (model, Adam, accumulator, `micro_batches`: the data position, and its own
    `checkpointed_runs`); each micro-batch is one `handler.run(train_micro_step)`. On
    SIGTERM to any worker, every worker saves at the same micro-batch and calls the
    exit_fn, which writes the "exit" record (`read_progress`) and exits with
    RESTART_EXIT_CODE. `save_every` > 0: every that many micro-batches a
    `tf.train.CheckpointManager` saves too (the chief into `workdir/checkpoints`, the
    others into a scratch directory): what a SIGKILL falls back to. `step_delay`: seconds
    to sleep after each micro-batch (time for the launcher to signal mid-run); a list:
    one per worker. `sync_micro_steps`: sum the micro-batch loss over all workers (one
    scalar all-reduce), which keeps the workers within one micro-batch of each other, as
    the handler needs. `infinite_data`: the pipeline repeats forever (the loop still stops
    after MICRO_STEPS); on a finite one the distributed iterator all-reduces a has-data
    flag at every `next` on MWMS, on an infinite one it does not.

    Returns the restored and final counters; the chief writes its final weights to
    `workdir/final.npz`.
    """
    from distgrad_course.lab.local_cluster import make_worker_strategy

    strategy = make_worker_strategy(collective_timeout)
    import tensorflow as tf

    from distgrad_course.lab.compare import weights_of
    from distgrad_course.lab.graph import count_collectives

    # On a Google Cloud CPU VM the handler would detect GCE_CPU and ignore SIGTERM
    # (failure_handling.py: its run() only calls the function there). An unreachable
    # metadata address makes `on_gcp()` False at once, on any machine.
    os.environ.setdefault("GCE_METADATA_IP", "127.0.0.1:9")
    os.makedirs(os.path.join(workdir, "progress"), exist_ok=True)
    progress = progress_path(workdir, attempt, task_index)
    _write_json(f"{progress}.strategy.json", {"pid": os.getpid()})  # its constructor returned
    if isinstance(step_delay, list):
        step_delay = step_delay[task_index]
    model, optimizer, accumulator, micro_batches, apply_step = _build(strategy)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                     accumulator=accumulator, micro_batches=micro_batches)
    checkpoint_dir = os.path.join(workdir, "checkpoints")

    def counters():
        return {"micro_batches": int(micro_batches.numpy()),
                "optimizer_iterations": int(optimizer.iterations.numpy()),
                "accumulator_micro_steps": accumulator.micro_steps}

    def exit_fn():  # the handler calls it once every worker has saved
        _write_json(f"{progress}.exit.json",
                    {**counters(), "latest": tf.train.latest_checkpoint(checkpoint_dir)})
        os._exit(RESTART_EXIT_CODE)

    handler = tf.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, checkpoint, checkpoint_dir,
        tf.distribute.experimental.TerminationConfig(exit_fn=exit_fn))
    # The constructor restored the latest checkpoint of checkpoint_dir, if there is one.
    restored = {**counters(), "total_run_calls": int(handler.total_run_calls),
                "checkpoint": tf.train.latest_checkpoint(checkpoint_dir)}
    completed, sleeping = restored["micro_batches"], False
    handler_sigterm = signal.getsignal(signal.SIGTERM)  # the handler's own function

    def observe_sigterm(signum, frame):
        _write_json(f"{progress}.sigterm.json",
                    {"after_micro_batch": completed, "sleeping": sleeping})
        handler_sigterm(signum, frame)

    signal.signal(signal.SIGTERM, observe_sigterm)
    is_chief = task_index == 0
    manager = None
    if save_every:
        target = checkpoint_dir if is_chief else os.path.join(
            workdir, f"scratch-attempt{attempt}-worker{task_index}")
        manager = tf.train.CheckpointManager(checkpoint, target, max_to_keep=2)

    per_worker = MICRO_BATCH // num_workers
    start = restored["micro_batches"]

    def dataset_fn(context):  # this worker's contiguous slice of every global micro-batch
        lo = context.input_pipeline_id * per_worker
        return global_micro_batches(None if infinite_data else EPOCHS).map(
            lambda x, y: (x[lo:lo + per_worker], y[lo:lo + per_worker])).skip(start)

    batches = iter(strategy.distribute_datasets_from_function(dataset_fn))
    try:
        tf.train.Checkpoint(iterator=batches)
        iterator_error = None
    except (TypeError, ValueError) as err:
        iterator_error = _error(err)
    replica_fn = _replica_fn(model, accumulator)

    @tf.function
    def accumulate(iterator):
        losses = strategy.run(replica_fn, args=next(iterator))
        if sync_micro_steps:
            return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)
        return strategy.experimental_local_results(losses)[0]

    def train_micro_step():
        loss = accumulate(batches)
        if accumulator.micro_steps == ACCUMULATION_STEPS:
            apply_step()  # the gradient all-reduce: the one sync of an update
        micro_batches.assign_add(1)
        return loss

    periodic = []
    while completed < MICRO_STEPS:
        handler.run(train_micro_step)
        completed = int(micro_batches.numpy())
        if manager is not None and completed % save_every == 0 and completed < MICRO_STEPS:
            manager.save()  # on every worker: the accumulator's SUM is read collectively
            periodic.append(completed)
        sleeping = bool(step_delay)
        _write_json(progress, {"pid": os.getpid(), "micro_batches": completed,
                               "periodic_saves": periodic})
        if step_delay:
            time.sleep(step_delay)
        sleeping = False
    with strategy.scope():
        all_reduce_ops = count_collectives(accumulate, batches).all_reduce_ops
    if is_chief:
        np.savez(os.path.join(workdir, "final.npz"), *weights_of(model))
    return {"task_index": task_index, "restored": restored, "periodic_saves": periodic,
            "iterator_checkpoint_error": iterator_error, **counters(),
            "total_run_calls": int(handler.total_run_calls),
            "all_reduce_ops_per_accumulate": all_reduce_ops}


# ------------------------------------------------------------- experiments for a lesson

WORKER = "distgrad_course.lab.preemption:preemptible_worker"
# Each scenario: the keyword arguments of `run_cluster_with_restarts` (the launcher's and
# the workers' options together).
SCENARIOS = {
    # SIGTERM to worker 1 after micro-batch SPLIT - 1 (an update): the handler saves after
    # the next one, SPLIT, mid-cycle. Worker 1 is the slower one and the pipeline is
    # infinite: only the loss all-reduce keeps worker 0 from running ahead.
    "SIGTERM": {"faults": [Fault(1, "SIGTERM", SPLIT - 1)], "max_restarts": 1,
                "step_delay": [0.0, 0.5], "infinite_data": True},
    # The same without that all-reduce: worker 0 runs on to the next apply and waits there.
    "SIGTERM_without_sync": {"faults": [Fault(1, "SIGTERM", SPLIT - 1)], "max_restarts": 0,
                             "step_delay": [0.0, 0.5], "infinite_data": True,
                             "sync_micro_steps": False, "collective_timeout": 10.0},
    # SIGKILL to the chief after micro-batch SPLIT + 1 (no chance to save): the restarted
    # cluster resumes from the last periodic save (every 2 micro-batches).
    "SIGKILL": {"faults": [Fault(0, "SIGKILL", SPLIT + 1)], "max_restarts": 1,
                "step_delay": 0.75, "save_every": 2},
    # SIGKILL to worker 1 and no cluster manager killing the rest: the chief fails by
    # itself (a collective timeout, or the coordination service's missed heartbeats).
    "SIGKILL_survivor_alone": {"faults": [Fault(1, "SIGKILL", SPLIT)], "max_restarts": 0,
                               "kill_survivors": False, "step_delay": 0.5, "save_every": 2,
                               "collective_timeout": 10.0},
    # Worker 1 never comes (back): the chief waits in the strategy's constructor for it;
    # each attempt ends at the launcher's timeout, and the launcher gives up after one
    # restart.
    "worker_never_returns": {"faults": [Fault(1, "ABSENT", attempt=None)], "max_restarts": 1,
                             "timeout": 10.0},
}


def uninterrupted_cluster(workdir: str | None = None, num_workers: int = 2) -> dict:
    """The 2-worker loop without faults: its final weights and the workers' reports."""
    run = run_cluster_with_restarts(WORKER, num_workers, workdir, max_restarts=0)
    return {"weights": load_weights(os.path.join(run.workdir, "final.npz")),
            "workers": [r.value for r in run.results], "seconds": run.attempts[0].seconds}


def preemption_experiment(kind: str = "SIGKILL", workdir: str | None = None,
                          uninterrupted: list | None = None, reference: list | None = None,
                          num_workers: int = 2) -> dict:
    """Run scenario `kind` of SCENARIOS on a local cluster and return its numbers.

    `attempts`: per attempt the signals sent (`micro_batches`: what the worker's progress
    file showed then), the absent workers, exit codes, each worker's wall seconds, the
    workers the launcher killed, whether it timed out. `sigterm`: what the signalled
    worker saw when SIGTERM arrived (`after_micro_batch`, `sleeping`); `exits`: the
    exit_fn records of attempt 0 (what each worker had saved); `periodic_saves`: the
    chief's periodic saves in attempt 0. A run that completed adds `resumed` (what the
    restarted chief restored), `final` and the largest weight differences from
    `uninterrupted` (the 2-worker run without faults; run here if None) and `reference`
    (one device, big batches; computed here if None). A run that gave up adds `error`
    (the launcher's message) and `worker_errors` (per attempt, per worker).
    """
    if kind not in SCENARIOS:
        raise ValueError(f"kind must be one of {tuple(SCENARIOS)}, got {kind!r}.")
    workdir = workdir or tempfile.mkdtemp(prefix=f"distgrad-{kind.lower()}-")
    fault = SCENARIOS[kind]["faults"][0]
    try:
        attempts = run_cluster_with_restarts(WORKER, num_workers, workdir,
                                             **SCENARIOS[kind]).attempts
        error = None
    except RestartsExhausted as err:
        attempts, error = err.attempts, str(err)
    report = {
        "kind": kind, "faulty_worker": fault.worker,
        "attempts": [{"signals": a.signals, "absent": a.absent, "returncodes": a.returncodes,
                      "worker_seconds": [round(r.seconds, 1) for r in a.results],
                      "killed_by_launcher": a.killed_by_launcher, "timed_out": a.timed_out,
                      "seconds": round(a.seconds, 1)} for a in attempts],
        "sigterm": read_progress(workdir, 0, fault.worker, "sigterm"),
        "exits": [read_progress(workdir, 0, i, "exit") for i in range(num_workers)],
        "periodic_saves": (read_progress(workdir, 0, 0) or {}).get("periodic_saves"),
        "latest_checkpoint_at_end": _latest_checkpoint_name(workdir),
    }
    if error is not None:
        report.update({"error": error,
                       "worker_errors": [[r.error for r in a.results] for a in attempts]})
        return report
    if uninterrupted is None:
        uninterrupted = uninterrupted_cluster(num_workers=num_workers)["weights"]
    if reference is None:
        reference = reference_weights()
    from distgrad_course.lab.compare import weight_diff  # (imports Keras: here, not at the top)

    final = load_weights(os.path.join(workdir, "final.npz"))
    chief = attempts[-1].results[0].value
    report.update({
        "error": None, "resumed": chief["restored"],
        "final": {k: chief[k] for k in ("micro_batches", "optimizer_iterations",
                                        "accumulator_micro_steps", "total_run_calls")},
        "max_abs_diff_vs_uninterrupted": weight_diff(final, uninterrupted).max_abs,
        "max_abs_diff_vs_one_device": weight_diff(final, reference).max_abs,
    })
    return report


def _latest_checkpoint_name(workdir: str) -> str | None:
    """The basename of the latest checkpoint in `workdir/checkpoints` (no TensorFlow)."""
    state = os.path.join(workdir, "checkpoints", "checkpoint")
    if not os.path.exists(state):
        return None
    with open(state) as f:
        first = f.readline()  # model_checkpoint_path: "ckpt-N"
    return os.path.basename(first.split(":", 1)[1].strip().strip('"'))
