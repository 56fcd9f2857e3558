"""Interrupt a `model.fit`, run it again with a backup callback, compare with no interruption.

Lesson 08 and `tests/backup_and_restore/test_backup_and_restore.py` use these. A run is one
`fit` of a fresh seeded model over a `tf.data` pipeline of `EPOCHS` epochs of `BATCHES`
batches, with a backup callback (`keras.callbacks.BackupAndRestore` or distgrad's) in
`backup_dir`:

* `interrupted_fit(...)`: the first `fit` stops after `cut` batches (counted across
  epochs) with `Preempted`, raised from `on_train_batch_end`; a fresh model then runs
  the same `fit` again, as a restarted job would, and the result is that second `fit`.
* `fit_in_child(...)` / `fit_on_worker(...)`: the same in a fresh process, or on every
  worker of a local `MultiWorkerMirroredStrategy` cluster, where the cut is a real fault:
  the process sends itself `SIGKILL` after `cut` batches (nothing runs after it), or
  `SIGTERM` (`TermSelf`; `fit_on_worker(sigterm_after=...)`): a preemption notice.

The model kinds (`KINDS`): "adam" (plain Adam), "accumulating"
(`AccumulatingOptimizer(Adam, ACCUMULATION_STEPS)`), "micro_batching"
(`MicroBatchingModel`, MICRO_BATCHES micro-batches inside each step) and "mixed"
(`mixed_float16` with `AllReplicasFiniteLossScaleOptimizer(AccumulatingOptimizer(...))`)
and "dropout" ("accumulating" with a seeded `Dropout(0.5)` between the two layers).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal

import keras
import numpy as np
import tensorflow as tf

EPOCHS, BATCHES, GLOBAL_BATCH = 2, 8, 8
ACCUMULATION_STEPS = 3  # 8 batches per epoch: a cycle straddles the epoch's end
MICRO_BATCHES = 2  # per step of MicroBatchingModel: 8 examples = 2 replicas x 2 x 2
LEARNING_RATE = 0.05
KINDS = ("adam", "accumulating", "micro_batching", "mixed", "dropout")


class Preempted(Exception):
    """Raised by `Interrupt`: stands for the job being stopped."""


class Interrupt(keras.callbacks.Callback):
    """Raise `Preempted` at the end of the `after`-th batch of the `fit` (across epochs)."""

    def __init__(self, after: int):
        super().__init__()
        self.after, self.seen = after, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.after:
            raise Preempted(f"stopped after {self.after} batches")


class KillSelf(Interrupt):
    """`SIGKILL` this process at the end of the `after`-th batch: a fault, not an exception
    (no `finally`, no callback, no flush runs after it)."""

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.after:
            os.kill(os.getpid(), signal.SIGKILL)


class TermSelf(Interrupt):
    """Send this process a real `SIGTERM` at the end of the `after`-th batch, as a
    scheduler or a spot VM's shutdown would: what runs next is the process' handler."""

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.after:
            os.kill(os.getpid(), signal.SIGTERM)


def examples(batches: int = BATCHES, global_batch: int = GLOBAL_BATCH):
    from distgrad_course.lab.data import regression_data

    return regression_data(batches * global_batch)


def dataset(batches: int = BATCHES, global_batch: int = GLOBAL_BATCH, shuffle_seed=None,
            repeat: bool = False) -> tf.data.Dataset:
    """The pipeline: `batches` global batches in a fixed order; with `shuffle_seed`, shuffled
    once with that seed (the same order in every epoch and every process)."""
    x, y = examples(batches, global_batch)
    data = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle_seed is not None:
        data = data.shuffle(len(x), seed=shuffle_seed, reshuffle_each_iteration=False)
    data = data.batch(global_batch, drop_remainder=True)
    return data.repeat() if repeat else data


def build(strategy, kind: str = "accumulating", multi_worker: bool = False,
          resumable: bool = True) -> keras.Model:
    """A fresh seeded model of `kind`, compiled under `strategy.scope()`; `resumable`: with
    `ResumableFit`, whose `fit` hands `BackupAndRestore` its arguments."""
    from distgrad.backup_and_restore import ResumableFit
    from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
    from distgrad.multi_worker import MultiWorkerFit
    from distgrad.optimizer import AccumulatingOptimizer
    from distgrad.train_step import MicroBatching
    from distgrad_course.lab.data import tiny_model

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    policy = "mixed_float16" if kind == "mixed" else None
    with strategy.scope():
        layers = tiny_model(dtype_policy=policy)
        if kind == "dropout":
            hidden, output = layers.layers
            layers = keras.Sequential([keras.Input(hidden.input.shape[1:]), hidden,
                                       keras.layers.Dropout(0.5, seed=3), output])
        bases = ((ResumableFit,) if resumable else ()) + (
            (MultiWorkerFit,) if multi_worker else ()) + (
            (MicroBatching,) if kind == "micro_batching" else ())
        options = {"accumulation_steps": MICRO_BATCHES} if kind == "micro_batching" else {}
        model = (type("Model", (*bases, keras.Model), {})(layers.inputs, layers.outputs,
                                                         **options) if bases else layers)
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        if kind in ("accumulating", "mixed", "dropout"):
            optimizer = AccumulatingOptimizer(optimizer, ACCUMULATION_STEPS)
        if kind == "mixed":
            optimizer = AllReplicasFiniteLossScaleOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


@dataclasses.dataclass
class FitResult:
    """What a `fit` ended with: weights, updates (`iterations`), micro-batches accumulated
    (`None` without an `AccumulatingOptimizer`), the loss scale (`None` without one), and
    the `History` of that `fit` call (a resumed `fit` logs only the epochs it ran)."""

    weights: list
    updates: int
    micro_steps: int | None
    loss_scale: float | None
    history: dict


def assert_same_run(got: FitResult, expected: FitResult) -> None:
    """Equal updates and micro-batches, weights to float32 rounding, equal epoch logs."""
    assert (got.updates, got.micro_steps, got.loss_scale) == (
        expected.updates, expected.micro_steps, expected.loss_scale)
    for a, b in zip(got.weights, expected.weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    epochs = len(got.history["loss"])  # a resumed fit logs the epochs it ran
    for name, values in got.history.items():
        np.testing.assert_allclose(values, expected.history[name][-epochs:], rtol=1e-6)


def result_of(model: keras.Model, history) -> FitResult:
    from distgrad.callbacks import accumulating_optimizer_of

    optimizer = model.optimizer
    accumulating = accumulating_optimizer_of(optimizer)
    scale = getattr(optimizer, "dynamic_scale", None)
    return FitResult(
        weights=[np.asarray(w.numpy()) for w in model.weights],
        updates=int(optimizer.iterations.numpy()),
        micro_steps=(None if accumulating is None
                     else int(accumulating.total_micro_steps.numpy())),
        loss_scale=None if scale is None else float(scale.numpy()),
        history={name: [float(v) for v in values]
                 for name, values in history.history.items()})


def _callback(callback: str, backup_dir: str, save_freq, double_checkpoint=False,
              handle_sigterm=True, run_id=None):
    from distgrad.backup_and_restore import BackupAndRestore

    if callback == "keras":
        return keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq,
                                                double_checkpoint=double_checkpoint)
    return BackupAndRestore(backup_dir, save_freq=save_freq,
                            double_checkpoint=double_checkpoint, handle_sigterm=handle_sigterm,
                            run_id=run_id)


def one_fit(strategy, backup_dir: str, kind: str = "accumulating", callback: str = "distgrad",
            save_freq=3, stop=None, steps_per_epoch=None, multi_worker=False,
            data=None, extra=(), batches: int = BATCHES,
            double_checkpoint: bool = False, handle_sigterm: bool = True,
            run_id=None, resumable: bool = True) -> FitResult:
    """One `fit` of a fresh model with the backup callback, then the callbacks `extra`,
    then `stop` (a callback that ends it early), if given. Without `data`: `dataset` of
    `batches` batches per epoch. `resumable`: the model is a `ResumableFit`. A stop
    (`Preempted`, or `SystemExit` on SIGTERM) is raised again without the fit's traceback,
    after the stopped fit's data iterator is freed (`free_stopped_fit`)."""
    model = build(strategy, kind, multi_worker=multi_worker, resumable=resumable)
    if data is None:
        data = dataset(batches, repeat=steps_per_epoch is not None)
    callbacks = [_callback(callback, backup_dir, save_freq, double_checkpoint,
                           handle_sigterm, run_id), *extra]
    callbacks += [stop] if stop else []
    try:
        history = model.fit(data, epochs=EPOCHS, steps_per_epoch=steps_per_epoch, verbose=0,
                            callbacks=callbacks, shuffle=False)  # (the pipeline's own order)
    except Preempted as stopped:
        raised = Preempted(*stopped.args)
    except SystemExit as stopped:  # BackupAndRestore's exit on SIGTERM
        raised = SystemExit(stopped.code)
    else:
        return result_of(model, history)
    free_stopped_fit()  # the traceback is gone: nothing but a cycle holds the fit's frames
    raise raised


def free_stopped_fit() -> None:
    """Free the `tf.data` iterator of a `fit` that raised, while it is young.

    Keras' epoch iterator and its suspended generator hold each other, so only the cyclic
    GC frees the iterator of a `fit` that raised. Freeing an iterator joins its tf.data
    autotuning thread, with the GIL held; when that thread misses the cancellation it
    first sleeps out its period, which doubles from 10 ms up to 60 s (about the
    iterator's age): `benchmarks/iterator_free.py`. Collected now, the wait is short."""
    gc.collect()


def interrupted_fit(strategy, backup_dir: str, cut: int, **options) -> FitResult:
    """`fit` stopped by `Preempted` after `cut` batches, then a fresh model's `fit` again
    (the restarted job); returns the second. `options` go to `one_fit`."""
    try:
        one_fit(strategy, backup_dir, stop=Interrupt(cut), **options)
    except Preempted:
        pass
    else:
        raise AssertionError(f"the fit ended before batch {cut}: nothing was interrupted")
    return one_fit(strategy, backup_dir, **options)


def fit_in_child(backup_dir: str, replicas: int = 2, kill_after: int | None = None,
                 **options) -> dict:
    """In a fresh process (`distgrad_course.lab.child.run_child` target): `one_fit` under
    `make_strategy(replicas)`, killed with SIGKILL after `kill_after` batches if given
    (then the child reports nothing: its caller sees the signal)."""
    from distgrad_course.devices import make_strategy

    strategy = make_strategy(replicas)
    stop = None if kill_after is None else KillSelf(kill_after)
    return dataclasses.asdict(one_fit(strategy, backup_dir, stop=stop, **options))


def fit_on_worker(task_index: int, num_workers: int, backup_dir: str,
                  kill_after: int | None = None, collective_timeout: float = 20.0,
                  sigterm_after: int | None = None, worker_1_backup_dir: str | None = None,
                  **options) -> dict:
    """On every worker of a `run_workers` cluster: `one_fit` with `MultiWorkerFitModel` on
    `MultiWorkerMirroredStrategy`, the global batches sharded across the workers; worker 1
    sends itself SIGKILL after `kill_after` batches, or SIGTERM after `sigterm_after`, if
    given; worker 1 backs up to `worker_1_backup_dir` if given (a local path of its host's,
    not the chief's). A worker whose peer died fails within `collective_timeout` seconds
    (its all-reduce times out)."""
    from distgrad_course.lab.local_cluster import make_worker_strategy

    strategy = make_worker_strategy(collective_timeout)
    stop = None
    if task_index == 1 and kill_after is not None:
        stop = KillSelf(kill_after)
    elif task_index == 1 and sigterm_after is not None:
        stop = TermSelf(sigterm_after)
    if task_index == 1 and worker_1_backup_dir is not None:
        backup_dir = worker_1_backup_dir
    return dataclasses.asdict(one_fit(strategy, backup_dir, stop=stop, multi_worker=True,
                                      **options))


# ------------------------------------------------------------------ lesson 08's timeline

class Recorder(keras.callbacks.Callback):
    """Per batch of a `fit` (`(epoch, batch)`), whether a train step ran on it: the
    optimizer's micro-batch count (`iterations` without accumulation) went up. A batch a
    resumed `fit` reads and drops counts as read, not trained."""

    def __init__(self):
        super().__init__()
        self.batches = []  # (epoch, batch, trained)
        self.epoch = 0

    def _count(self) -> int:
        from distgrad.callbacks import accumulating_optimizer_of

        accumulating = accumulating_optimizer_of(self.model.optimizer)
        variable = (self.model.optimizer.iterations if accumulating is None
                    else accumulating.total_micro_steps)
        return int(keras.ops.convert_to_numpy(variable))

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.before = self._count()

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((self.epoch, batch, self._count() > self.before))


@dataclasses.dataclass
class Timeline:
    """Which global batches (epoch * BATCHES + batch) each `fit` of an interrupted job
    trained, and where its backups and interruption fell."""

    callback: str
    cut: int
    save_freq: int
    first: list  # global batch ids the first fit trained
    backups: list  # global batch counts after which it wrote a backup
    resumed_trained: list  # global batch ids the second fit trained
    resumed_read: list  # ... that it read and dropped (distgrad's skip)
    updates: int
    expected_updates: int


def timeline(strategy, backup_dir: str, callback: str, cut: int = 6, save_freq: int = 3,
             kind: str = "adam") -> Timeline:
    """Run an interrupted job with `callback` ("keras" or "distgrad") and record it."""
    expected = one_fit(strategy, os.path.join(backup_dir, "reference"), kind=kind,
                       callback=callback, save_freq=save_freq)
    first, resumed = Recorder(), Recorder()
    directory = os.path.join(backup_dir, callback)
    options = {"kind": kind, "callback": callback, "save_freq": save_freq}
    try:
        one_fit(strategy, directory, stop=Interrupt(cut), extra=[first], **options)
    except Preempted:
        pass
    result = one_fit(strategy, directory, extra=[resumed], **options)
    ids = [(e * BATCHES + b, trained) for e, b, trained in resumed.batches]
    return Timeline(
        callback=callback, cut=cut, save_freq=save_freq,
        first=[e * BATCHES + b for e, b, trained in first.batches if trained],
        backups=list(range(save_freq, cut + 1, save_freq)),
        resumed_trained=[i for i, trained in ids if trained],
        resumed_read=[i for i, trained in ids if not trained],
        updates=result.updates, expected_updates=expected.updates)


def plot_timelines(timelines: list[Timeline]):
    """One row per fit: trained batches (blue; red where the backup's weights already hold
    the batch, so it is trained twice), batches read and dropped (grey), backups (dashed)
    and the interruption (x)."""
    import matplotlib.pyplot as plt

    rows = [("first fit (both callbacks)", timelines[0].first, [], timelines[0])]
    rows += [(f"restart, {t.callback} BackupAndRestore", t.resumed_trained, t.resumed_read, t)
             for t in timelines]
    fig, ax = plt.subplots(figsize=(9, 0.75 * len(rows) + 1.0))
    for row, (label, trained, read, t) in enumerate(reversed(rows)):
        in_backup = set(range(max(t.backups, default=0)))
        for i in trained:
            again = row < len(rows) - 1 and i in in_backup
            ax.add_patch(plt.Rectangle((i + 0.05, row + 0.15), 0.9, 0.7,
                                       color="tab:red" if again else "tab:blue"))
        for i in read:
            ax.add_patch(plt.Rectangle((i + 0.05, row + 0.15), 0.9, 0.7, color="0.8"))
        ax.text(-0.3, row + 0.5, label, ha="right", va="center", fontsize=10)
    top = len(rows)
    for b in timelines[0].backups:
        ax.axvline(b, color="black", lw=1.5, ls="--")
        ax.text(b, top + 0.05, "backup", ha="center", va="bottom", fontsize=9)
    ax.plot([timelines[0].cut], [top - 0.5], "x", color="black", ms=12, mew=3)
    ax.axvline(BATCHES, color="0.5", lw=1)
    ax.set_xlim(-0.2, EPOCHS * BATCHES + 0.2)
    ax.set_ylim(0, top + 0.5)
    ax.set_yticks([])
    ax.set_xticks(range(0, EPOCHS * BATCHES + 1, 2))
    ax.set_xlabel("batch (epoch 0: 0-7, epoch 1: 8-15)")
    ax.set_title("blue: trained    red: trained again (already in the backup)    "
                 "grey: read and dropped", fontsize=10, pad=18)
    plt.tight_layout()
    return fig
