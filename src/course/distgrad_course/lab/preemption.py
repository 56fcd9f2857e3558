"""Preemption mid-cycle: checkpoint a custom accumulation loop, resume it exactly.

One process (`custom_loop`, MirroredStrategy on 2 replicas): train k=3 micro-batches per
Adam update with `GradientAccumulator` over a shuffled, repeated `tf.data` pipeline, save
a `tf.train.Checkpoint` after micro-batch 4 (1 update done, 1 micro-batch of the next
cycle accumulated), restore it in a fresh process and finish. On TensorFlow 2.21 a
distributed iterator cannot go into a checkpoint (`iterator_checkpointability`), so the
data position is a step count in the checkpoint and the resumed pipeline `skip`s that many
micro-batches (`data="skip"`), or the checkpoint holds a plain `tf.data` iterator whose
global batches the loop splits over the replicas itself (`data="plain_iterator"`).

A cluster (`preemptible_worker`, one replica per worker of a `MultiWorkerMirroredStrategy`)
trains the same loop under `tf.distribute.experimental.PreemptionCheckpointHandler`, one
`handler.run` per micro-batch, the chief also saving every `save_every` micro-batches with
a `tf.train.CheckpointManager`. `run_cluster_with_restarts` is the cluster manager: it
starts the workers (`distgrad_course.lab.multiworker`), signals one of them (`Fault`) once its
progress file shows a given micro-batch, restarts the whole cluster after a failure, at
most `max_restarts` times, and kills every process it started. `preemption_experiment`
runs one of SCENARIOS (SIGTERM, SIGKILL, a survivor left alone, a worker that never comes
back) and returns its numbers.

The handler saves every worker at the same run count (its `run()` calls), so the workers
must stay within one micro-batch of each other: an all-reduce in every micro-batch does
that (on MWMS a finite distributed dataset has one, its has-data flag; the loop adds the
summed loss). Without one, a worker runs ahead to the next apply, and a SIGTERM fails
both workers instead of saving (scenario "SIGTERM_without_sync").

The launcher imports only the standard library and NumPy; the functions that run in a
child import TensorFlow themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import tempfile
import time

import numpy as np

from distgrad_course.lab.child import Child, ChildResult, check_timeout, resolve
from distgrad_course.lab.multiworker import free_ports, tf_config, visible_gpus, worker_devices

EXAMPLES = 48  # two epochs of 6 global micro-batches: 12 micro-batches, 4 updates
FEATURES = 4
MICRO_BATCH = 8  # global micro-batch (all replicas together)
ACCUMULATION_STEPS = 3
EPOCHS = 2
MICRO_STEPS = EXAMPLES * EPOCHS // MICRO_BATCH
SHUFFLE_SEED = 7
LEARNING_RATE = 0.01
SPLIT = 4  # the mid-cycle checkpoint: 1 update done, 1 micro-batch of the next accumulated
# What the worker's exit_fn exits with after the handler saved (TensorFlow's own default off
# Google Cloud is `sys.exit(42)`, BorgTerminationConfig in failure_handling.py).
RESTART_EXIT_CODE = 42
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
            "distgrad_course.lab.preemption:custom_loop",
            {"workdir": workdir, "phase": phase, "data": data, "replicas": replicas,
             "without_accumulator": without_accumulator and phase == "rest"},
            timeout=timeout).value
        reports[phase]["weights"] = load_weights(reports[phase]["weights_file"])
    return reports


# ------------------------------------------------- a cluster: MWMS, one replica per worker


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
    from distgrad_course.lab.multiworker import make_worker_strategy

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


# ------------------------------------------------------------ the cluster manager


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
    after_micro_batch: int = SPLIT
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
    its own GPUs or the CPU only, as `distgrad_course.lab.multiworker.run_workers`), applies
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
