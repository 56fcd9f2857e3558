"""Callbacks for `model.fit`: the incomplete cycle at an epoch's end, and exact resume.

    model.fit(x, y, epochs=3, callbacks=[AccumulationCallback("flush")])
    model.fit(dataset, epochs=3, callbacks=[BackupAndRestore("/backup", save_freq=50)])

`AccumulationCallback`:

An epoch of n micro-batches leaves n mod k of them accumulated and not applied. By
default they stay (the optimizer carries them into the next epoch, whose first
micro-batches complete the cycle); this callback can apply them (`flush`) or drop them
(`discard`), and puts the optimizer's `skipped_updates` into the epoch's logs.

`BackupAndRestore` (below `AccumulationCallback`) replaces
`keras.callbacks.BackupAndRestore`, which resumes an interrupted epoch from its first
batch (see its docstring).

This file imports only TensorFlow, Keras, the standard library, `backup_commit.py`
(`BackupAndRestore`'s commit protocol, imported as `distgrad.backup_commit` or, copied,
as `backup_commit`) and `preemption.py` (its `SIGTERM` handler, likewise): copy the three
files into a project. `AccumulationCallback` drives any
optimizer with `flush()`, `discard()` and `skipped_updates` (distgrad's
`AccumulatingOptimizer`), also inside a `LossScaleOptimizer`. In a custom loop, call
`optimizer.flush()` or `optimizer.discard()` yourself after the epoch.
"""

from __future__ import annotations

import os
import sys
import warnings

import keras
import tensorflow as tf

try:
    from distgrad.backup_commit import FORMAT, LEGACY_FORMAT, BackupStore, run_identity
    from distgrad.preemption import PREEMPTED_EXIT_CODE, SigtermWatch, cluster_of
except ImportError:  # copied into a project: backup_commit.py, preemption.py beside it
    from backup_commit import FORMAT, LEGACY_FORMAT, BackupStore, run_identity
    from preemption import PREEMPTED_EXIT_CODE, SigtermWatch, cluster_of

__all__ = ["AccumulationCallback", "BackupAndRestore", "PREEMPTED_EXIT_CODE",
           "accumulating_optimizer_of"]

INCOMPLETE_CYCLE_ACTIONS = ("carry", "flush", "discard")


def accumulating_optimizer_of(optimizer):
    """`optimizer`, or the one it wraps (`inner_optimizer`, recursively), that has
    `flush`, `discard` and `skipped_updates`; None if there is none."""
    while optimizer is not None:
        if all(hasattr(optimizer, name) for name in ("flush", "discard", "skipped_updates")):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def _count(variable) -> int:
    return 0 if variable is None else int(keras.ops.convert_to_numpy(variable))  # unbuilt: 0


class AccumulationCallback(keras.callbacks.Callback):
    """At each epoch's end: carry, flush or discard the incomplete cycle; log skips.

    Args:
        incomplete_cycle: "carry" (default; what the optimizer does alone: the next
            epoch completes the cycle), "flush" (`optimizer.flush()`: apply it now, as the
            mean of its micro-batches) or "discard" (`optimizer.discard()`: drop it).

    Logs: every epoch's logs (hence `History`) get `skipped_updates`, the optimizer's
    count of cycles dropped as non-finite, read after the action; and, when the model's
    optimizer is a loss-scale wrapper that counts its skipped steps
    (`AllReplicasFiniteLossScaleOptimizer.skipped_steps`), `skipped_micro_batches`: the
    micro-batches it skipped as overflowing. (The optimizers themselves warn at the end
    of every `fit` that skipped something, with or without this callback.)

    Order: Keras validates before `on_epoch_end`, so an epoch's `val_` metrics see the
    weights before a flush. List this callback before a `ModelCheckpoint` that should
    save the flushed weights.

    Raises:
        ValueError: `incomplete_cycle` is not one of "carry", "flush", "discard";
            (at `on_train_begin`) the model's optimizer has no `flush` / `discard`.
    """

    def __init__(self, incomplete_cycle: str = "carry"):
        super().__init__()
        if incomplete_cycle not in INCOMPLETE_CYCLE_ACTIONS:
            raise ValueError(f"incomplete_cycle must be one of {INCOMPLETE_CYCLE_ACTIONS}, "
                             f"got {incomplete_cycle!r}.")
        self.incomplete_cycle = incomplete_cycle

    def _optimizer(self):
        found = accumulating_optimizer_of(self.model.optimizer)
        if found is None:
            raise ValueError(
                "AccumulationCallback needs an optimizer with flush() and discard(), such as "
                f"distgrad's AccumulatingOptimizer; the model's is "
                f"{type(self.model.optimizer).__name__}.")
        return found

    def on_train_begin(self, logs=None):
        self._optimizer()  # fail now, not after the first epoch

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self._optimizer()
        if self.incomplete_cycle == "flush":
            optimizer.flush()
        elif self.incomplete_cycle == "discard":
            optimizer.discard()
        if logs is None:
            return
        logs["skipped_updates"] = _count(optimizer.skipped_updates)
        wrapper = self.model.optimizer
        if wrapper is not optimizer and hasattr(wrapper, "skipped_steps"):
            logs["skipped_micro_batches"] = _count(getattr(wrapper, "skipped_steps", None))


# ---------------------------------------------------------------------------------------
# BackupAndRestore
# ---------------------------------------------------------------------------------------

SHUFFLE_OPS = ("ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3",
               "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2")
DATA_ORDER_FIX = (
    "To resume exactly, the data must come in the same order when fit starts again: pass "
    "fit(..., shuffle=False) and shuffle once yourself with a seed, or a tf.data.Dataset "
    "shuffled with dataset.shuffle(buffer_size, seed=SEED, reshuffle_each_iteration=False) "
    "(or .shuffle(buffer_size, seed=SEED).repeat() with fit(steps_per_epoch=...), one "
    "iterator for all epochs).")


def _fit_epoch_iterator():
    """The `epoch_iterator` of the `fit` call running this callback (Keras' TensorFlow
    trainer, `keras/src/backend/tensorflow/trainer.py`), or None. Keras hands callbacks
    neither the data nor its position; this is the one object that holds both."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("epoch_iterator")
        if frame.f_code.co_name == "fit" and hasattr(candidate, "data_adapter"):
            return candidate
        frame = frame.f_back
    return None


def _dataset_shuffles(dataset) -> list[str]:
    """What makes `dataset`'s order change from one iterator to the next: one line per
    shuffle op of its graph that has no seed, or reshuffles each iteration."""
    graph = tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph().numpy())
    constants = {node.name: node for node in graph.node if node.op == "Const"}
    found = []
    for node in graph.node:
        if node.op not in SHUFFLE_OPS:
            continue
        seeds = []
        for name in node.input[2:4]:  # (input_dataset, buffer_size, seed, seed2, ...)
            constant = constants.get(name.split(":")[0].lstrip("^"))
            seeds.append(None if constant is None
                         else tf.make_ndarray(constant.attr["value"].tensor).item())
        if seeds == [0, 0]:
            found.append(f"{node.op} without a seed (a new order in every process)")
        elif node.attr["reshuffle_each_iteration"].b:
            found.append(f"{node.op} with reshuffle_each_iteration=True (a new order in every "
                         "epoch, restarting from the first epoch's in a new process)")
    return found


def _unreproducible_order(epoch_iterator) -> tuple[str, bool]:
    """Why the data of this fit may come in another order when it starts again, and
    whether that is certain (True) or only cannot be ruled out (False); ("", True) when
    the order repeats."""
    if epoch_iterator is None:
        why = ("BackupAndRestore could not find fit's data (not Keras 3's TensorFlow fit?), "
               "so it cannot check that the data comes in the same order again")
        return why, False
    adapter = epoch_iterator.data_adapter
    kind = type(adapter).__name__
    if kind == "ArrayDataAdapter":
        shuffle = getattr(adapter, "_shuffle", False)
        if not shuffle:
            return "", True
        return f"fit(shuffle={shuffle!r}) shuffles the arrays anew in every epoch", True
    if kind == "PyDatasetAdapter":
        if not getattr(adapter, "shuffle", False):
            return "", True
        return "fit(shuffle=True) shuffles the PyDataset's batches anew in every epoch", True
    if kind == "TFDatasetAdapter":
        dataset = getattr(adapter, "_dataset", None)
        if not isinstance(dataset, tf.data.Dataset):
            return "the order of a distributed dataset cannot be inspected", False
        shuffles = _dataset_shuffles(dataset)
        if not shuffles:
            return "", True
        return "the tf.data.Dataset has " + "; ".join(shuffles), True
    source = {"GeneratorDataAdapter": "Python generator", "TorchDataLoaderAdapter":
              "torch DataLoader", "GrainDatasetAdapter": "Grain dataset"}.get(kind, kind)
    why = (f"the order of a {source} cannot be inspected; a resumed fit skips as many "
           "batches of it as were trained, which is right only if it yields the same "
           "batches in the same order again")
    return why, False


def _is_multi_worker(strategy) -> bool:
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


class BackupAndRestore(keras.callbacks.Callback):
    """`keras.callbacks.BackupAndRestore` that resumes where the backup was taken.

        callback = BackupAndRestore("/backup/run-1", save_freq=50)
        model.fit(dataset, epochs=10, callbacks=[callback])  # again after a preemption

    Keras 3's callback writes the epoch *and* the batch, but restores only the epoch
    (`keras/src/callbacks/backup_and_restore.py`, `_load_model`): an interrupted epoch
    restarts from its first batch, with the weights and optimizer state of its last
    backup, so it trains again on the batches already in those weights, and takes their
    updates twice. This one restores the model, the optimizer (slots, `iterations`, an
    `AccumulatingOptimizer`'s accumulators and `micro_steps`, a loss scale), the epoch,
    the metrics of the epoch so far, and the position in the data: the batches of the
    interrupted epoch that the backup holds are read and dropped, not trained again. A
    `fit` interrupted anywhere and run again with the same arguments ends with the
    weights, `iterations` and epoch logs of the uninterrupted one.

    Args (those of `keras.callbacks.BackupAndRestore`):
        backup_dir: directory of the backup, used by nothing else: a local path or one
            `tf.io.gfile` reads (gs://, s3://). On several workers every worker must see
            the chief's files (a shared file system, a bucket); only the chief writes
            there (the others write their copy to a local temporary directory and delete
            it).
        save_freq: "epoch" (at each epoch's end) or an integer n (every n batches,
            counted across epochs). `False` is refused: Keras keeps it for tf-keras'
            preemption saving, which Keras 3 does not have.
        double_checkpoint: also keep the previous backup until the next one is committed,
            restored (with a warning) when the newest is missing, torn or unreadable.
        delete_checkpoint: delete the backup when `fit` ends normally.
        handle_sigterm: back up and exit on `SIGTERM` (below); False leaves `SIGTERM`
            alone (its default action ends the process, with no backup).
        run_id: what names this run (a restart of the same job passes the same); default:
            the environment's `SLURM_JOB_ID`, else the first backup's own (a uuid).

    The run's identity: every backup records the run id, `accumulation_steps` (of an
    `AccumulatingOptimizer` or a `MicroBatchingModel`), replicas, workers, the
    optimizer's class chain and its variables' names and shapes. A restart whose values
    differ is refused before anything trains (backups older than these fields are not
    checked).

    `SIGTERM` (a spot VM's or a scheduler's preemption notice), with `handle_sigterm`:
    the batch running when it arrives is finished, backed up (whatever `save_freq`
    says), and the process exits with status `PREEMPTED_EXIT_CODE` (42, the code
    `tf.distribute`'s preemption handling restarts on): requeue the job on it, e.g. in
    a SLURM script `[ $? -eq 42 ] && scontrol requeue $SLURM_JOB_ID`. The restart
    resumes after that batch. On several workers every worker backs up after the same
    batch and exits: the one that got the signal picks the batch after its current one
    (the others may have started it) and tells them through the coordination service
    (`preemption.py`); the others exit with the same status. The handler is installed
    when `fit` starts (in the main thread; elsewhere it raises) and the one before is
    restored when it ends; a Python handler installed before (yours, or a
    `PreemptionCheckpointHandler`'s) is called too, when the signal arrives. A signal
    that came when no trained batch was left is passed on when `fit` ends. (If `fit`
    raises, Keras calls no callback after it: the handler stays until the next `fit`
    with this callback.)

    Exact resume needs the data in the same order when `fit` starts again. At `fit`
    start it checks (even with no backup yet, so that the first run learns it): with
    `save_freq=n` it raises `ValueError` if the order cannot repeat (`fit(shuffle=True)`
    over arrays or a `PyDataset`, a `tf.data` shuffle without a seed or one that
    reshuffles each iteration: Keras makes a new iterator per epoch, and a new process
    starts the reshuffling over), and warns where it cannot see the order (a generator,
    a distributed dataset); with `save_freq="epoch"` it only warns, since whole epochs
    resume without a batch lost or repeated. What it does not restore: a `Dropout`
    layer's seed generator state (a layer variable, not one of the weights
    `save_weights` writes: the restart draws other masks), and other callbacks' state
    (`ReduceLROnPlateau`, `EarlyStopping`).

    Files (`backup_commit.py`): `ckpt-<generation>.weights.h5` (`model.save_weights`:
    model and optimizer variables), a new name for every backup, then the commit point
    `training_metadata.json`, which names it (`epoch`, `batch` as Keras writes them, the
    position in the data, the metric totals, the batch count per epoch). A process killed
    at any file operation, also on object storage where a rename is a copy then a delete,
    leaves the previous backup or the new one whole. distgrad 0.2's and Keras' own
    backups (`latest.weights.h5`) still restore.

    Raises:
        ValueError: an empty `backup_dir`, a bad `save_freq`; (at `fit` start) data
            whose order cannot repeat with `save_freq=n`; an unbuilt model; a backup
            whose epochs had another number of batches than this `fit` (other data or
            batch size), or of another run id or setup (the run's identity); a backup
            of another model (Keras' own message); a newest backup missing or torn with
            no previous one kept (`double_checkpoint`).
    """

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False,
                 delete_checkpoint=True, handle_sigterm=True, run_id=None):
        super().__init__()
        if not backup_dir:
            raise ValueError("Empty `backup_dir` argument passed")
        if save_freq != "epoch" and (isinstance(save_freq, bool)
                                     or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(
                f"save_freq must be 'epoch' or an integer >= 1 (batches between backups), "
                f"got {save_freq!r}. (save_freq=False is tf-keras' preemption saving, "
                "which Keras 3 does not have.)")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        if not isinstance(handle_sigterm, bool):
            raise ValueError(f"handle_sigterm must be True or False, got {handle_sigterm!r}.")
        self.handle_sigterm = handle_sigterm
        self.run_id = run_id

    # -- paths and roles ------------------------------------------------------------------

    def _strategy(self):
        return self.model.distribute_strategy

    def _writes(self) -> bool:
        """Whether this process writes the backup: the chief does. The others still call
        `save_weights` (into a local temporary file): reading replica-local variables
        (accumulators) is a collective every worker must join."""
        strategy = self._strategy()
        return not _is_multi_worker(strategy) or strategy.extended.should_checkpoint

    # -- fit hooks --------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._epoch_iterator = _fit_epoch_iterator()
        self._check_data_order()
        self._epoch = 0
        self._batches_done = 0  # of the current epoch
        self._since_backup = 0
        self._real_train_function = None
        self._store = BackupStore(self.backup_dir, keep_previous=self.double_checkpoint)
        self._resume = self._restore()
        if self._resume is not None:
            self.model._initial_epoch = self._resume["epoch"]
        self._trained = 0  # batches trained by this fit (not read and dropped)
        self._sigterm = None
        if self.handle_sigterm:
            strategy = self._strategy()
            self._sigterm = SigtermWatch(cluster_of(strategy) if _is_multi_worker(strategy)
                                         else None)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._batches_done = epoch, 0
        resume = self._resume
        if resume is not None and epoch == resume["epoch"]:
            self._restore_metrics(resume["metrics"])  # fit has just reset them

    def on_train_batch_begin(self, batch, logs=None):
        resume = self._resume
        if resume is None:
            return
        if self._real_train_function is None:
            self._real_train_function = self.model.train_function
        train = self._real_train_function
        # Batches earlier epochs read from the same iterator (fit(steps_per_epoch=...)
        # over a repeated dataset): read and dropped with the first step.
        earlier, resume["earlier_batches"] = resume["earlier_batches"], 0
        if batch < resume["batch"]:  # trained before the backup: read the data, drop it
            count = earlier + self.model.steps_per_execution

            def skip(iterator):
                self._read_batches(iterator, count)
                return self.model.get_metrics_result()  # the epoch's logs so far, restored

            self.model.train_function = skip
            return
        self._end_resume()
        if earlier:
            def read_earlier_then_train(iterator):
                self._read_batches(iterator, earlier)
                self.model.train_function = train
                return train(iterator)

            self.model.train_function = read_earlier_then_train

    def _end_resume(self) -> None:
        if self._real_train_function is not None:
            self.model.train_function = self._real_train_function
        self._resume, self._real_train_function = None, None

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1  # `batch` is the last batch of the step (steps_per_execution)
        if self._resume is not None:  # a batch read and dropped: the weights hold more
            self._batches_done = done  # than `done` batches, so no backup here
            return
        self._since_backup += done - self._batches_done
        self._batches_done = done
        self._trained += 1
        if self.save_freq != "epoch" and self._since_backup >= self.save_freq:
            self._backup(epoch=self._epoch, batch=done)
        if self._sigterm is not None and self._sigterm.due(self._trained):
            if self._since_backup:
                self._backup(epoch=self._epoch, batch=done)
            self._sigterm.exit(f"backed up after batch {done} of epoch {self._epoch}")

    def on_epoch_end(self, epoch, logs=None):
        self._end_resume()  # a backup after the epoch's last batch resumes into its end
        if self.save_freq == "epoch":
            self._backup(epoch=epoch + 1, batch=0)

    def on_train_end(self, logs=None):
        if self._sigterm is not None:
            self._sigterm.close()
        self._end_resume()
        self.model._initial_epoch = None  # a later fit of this model starts where told
        if self.delete_checkpoint and self._writes():
            self._store.delete()

    # -- data -------------------------------------------------------------------------------

    def _check_data_order(self):
        why, certain = _unreproducible_order(self._epoch_iterator)
        if not why:
            return
        if self.save_freq != "epoch" and certain:
            raise ValueError(
                f"BackupAndRestore(save_freq={self.save_freq}) resumes mid-epoch by skipping "
                f"the batches already trained, but {why}: the resumed epoch would train "
                f"again on some examples and never on others. {DATA_ORDER_FIX} Or back up "
                "at epoch ends only: save_freq='epoch'.")
        warnings.warn(f"BackupAndRestore: {why}: a resumed fit may not equal an "
                      f"uninterrupted one. {DATA_ORDER_FIX}", UserWarning, stacklevel=2)

    def _batches_from_iterator(self, batches_done: int) -> int:
        """Batches read from the data iterator fit reads now: the current epoch's, and with
        `fit(steps_per_epoch=...)` (one iterator for all epochs) earlier epochs' too."""
        iterator = self._epoch_iterator
        if iterator is None or iterator.steps_per_epoch is None:
            return batches_done  # Keras makes a new iterator for every epoch
        if not hasattr(iterator, "_steps_seen"):
            raise RuntimeError(
                "BackupAndRestore cannot tell how far fit(steps_per_epoch=...) has read its "
                f"data in Keras {keras.__version__} (no EpochIterator._steps_seen): back up "
                "at epoch ends (save_freq='epoch') without steps_per_epoch.")
        return int(iterator._steps_seen)

    @staticmethod
    def _read_batches(iterator, count: int) -> None:
        for _ in range(count):
            next(iterator)

    # -- metrics ----------------------------------------------------------------------------

    def _metric_totals(self) -> list:
        return [v.numpy().tolist() for v in self.model.metrics_variables]

    def _restore_metrics(self, totals) -> None:
        variables = self.model.metrics_variables
        if totals is None or len(totals) != len(variables):
            return  # the epoch's logs then average the batches after the resume only
        for variable, value in zip(variables, totals):
            variable.assign(tf.cast(value, variable.dtype))

    # -- writing ----------------------------------------------------------------------------

    def _backup(self, epoch: int, batch: int) -> None:
        self._since_backup = 0
        metadata = {
            "epoch": epoch,
            "batch": max(batch - 1, 0),  # keras.callbacks.BackupAndRestore's meaning
            "batches_done": batch,  # of `epoch`, in the backup's weights
            "batches_from_iterator": self._batches_from_iterator(batch),
            "batches_per_epoch": self._batches_per_epoch(),
            "metrics": self._metric_totals() if batch else None,
        }
        self._store.save(self.model, metadata, write=self._writes())

    def _batches_per_epoch(self):
        iterator = self._epoch_iterator
        return None if iterator is None else iterator.num_batches

    # -- reading ----------------------------------------------------------------------------

    def _restore(self):
        """Load the backup, if any, into the model; return where fit resumes, or None.
        Every worker reads the same files and writes nothing."""
        if not self.model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, the model must be built before you "
                f"call fit(). Model {self.model.name} is unbuilt: build it with keras.Input "
                "or by calling it on a batch of data.")
        optimizer = self.model.optimizer
        with self._strategy().scope():
            if optimizer is not None and not optimizer.built:
                optimizer.build(self.model.trainable_variables)  # its variables, to load into
            strategy = self._strategy()
            workers = len(cluster_of(strategy)[1]) if _is_multi_worker(strategy) else 1
            identity = run_identity(self.model, strategy.num_replicas_in_sync, workers,
                                    self.run_id)
            metadata = self._store.load(self.model, identity)  # refuses another identity
        return None if metadata is None else self._resume_point(metadata)

    def _resume_point(self, metadata: dict) -> dict:
        if metadata.get("format") not in (FORMAT, LEGACY_FORMAT):  # keras.callbacks' backup
            if metadata.get("batch"):
                warnings.warn(
                    f"BackupAndRestore: {self.backup_dir} was written by "
                    "keras.callbacks.BackupAndRestore, which does not record how many "
                    f"batches its weights hold: epoch {metadata['epoch']} restarts from its "
                    "first batch, as Keras does.", UserWarning, stacklevel=3)
            return {"epoch": metadata["epoch"], "batch": 0, "earlier_batches": 0,
                    "metrics": None}
        expected, found = metadata["batches_per_epoch"], self._batches_per_epoch()
        if expected is not None and found is not None and expected != found:
            raise ValueError(
                f"BackupAndRestore: the backup in {self.backup_dir} was taken with "
                f"{expected} batches per epoch, this fit has {found}: other data, batch size "
                "or steps_per_epoch. Resume with the same fit arguments, or delete the "
                "backup directory to start over.")
        batch = metadata["batches_done"]
        return {"epoch": metadata["epoch"], "batch": batch,
                "earlier_batches": metadata["batches_from_iterator"] - batch,
                "metrics": metadata["metrics"]}
