"""`BackupAndRestore`: `keras.callbacks.BackupAndRestore` that resumes where the backup
was taken, where Keras 3's restarts the interrupted epoch from its first batch.

    model = ResumableFitModel(inputs, outputs)  # or class M(ResumableFit, keras.Model)
    model.compile(...)
    model.fit(dataset, epochs=10, callbacks=[BackupAndRestore("gs://b/run-1", save_freq=50)])

This file imports only TensorFlow, Keras, the standard library and three files copied
with it: `backup_commit.py` (the files and their commit), `fit_data.py` (`ResumableFit`,
what it needs of `fit`'s data) and `preemption.py` (`SIGTERM`). Each is imported as
`distgrad.<name>`, or, copied into a project, as `<name>`.
"""

from __future__ import annotations

import os
import warnings
import zlib

import keras
import tensorflow as tf

try:
    from distgrad.backup_commit import FORMAT, LEGACY_FORMAT, BackupStore, run_identity
    from distgrad.fit_data import describe_fit_data
    from distgrad.preemption import PREEMPTED_EXIT_CODE, SigtermWatch, cluster_of
except ImportError:  # copied into a project: the three files beside this one
    from backup_commit import FORMAT, LEGACY_FORMAT, BackupStore, run_identity
    from fit_data import describe_fit_data
    from preemption import PREEMPTED_EXIT_CODE, SigtermWatch, cluster_of

__all__ = ["BackupAndRestore", "PREEMPTED_EXIT_CODE"]

DATA_ORDER_FIX = (
    "To resume exactly, the data must come in the same order when fit starts again: pass "
    "fit(..., shuffle=False) and shuffle once yourself with a seed, or a tf.data.Dataset "
    "shuffled with dataset.shuffle(buffer_size, seed=SEED, reshuffle_each_iteration=False) "
    "(or .shuffle(buffer_size, seed=SEED).repeat() with fit(steps_per_epoch=...), one "
    "iterator for all epochs).")
NO_FIT_ARGUMENTS = (
    "BackupAndRestore was not given fit's arguments, so it cannot check that the data comes "
    "in the same order when fit starts again, nor record the global batch (a restart on "
    "another number of workers is then refused), and it takes a new iterator over the data "
    "in every epoch (a fit(steps_per_epoch=...) that reads one iterator across epochs would "
    "resume at the wrong batch after an epoch-end backup). Fix: build the model as "
    "distgrad.ResumableFitModel(inputs, outputs) or class M(distgrad.ResumableFit, "
    "keras.Model), or call callback.set_fit_arguments(x, y, batch_size=..., shuffle=..., "
    "steps_per_epoch=...) before fit.")


def _is_multi_worker(strategy) -> bool:
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up `fit` and resumes it exactly: mid-epoch, mid-cycle, after a `SIGTERM`.

    A `fit` interrupted anywhere and run again with the same arguments ends with the
    weights, `iterations` and epoch logs of the uninterrupted one. It restores the model,
    the optimizer (slots, `iterations`, an `AccumulatingOptimizer`'s accumulators, a loss
    scale), the epoch, the epoch's metrics so far and the position in the data: the
    batches the backup holds are read and dropped, not trained again.

    Args:
        backup_dir: a local path or one `tf.io.gfile` writes (gs://, s3://). On several
            workers every worker must see the chief's files; only the chief writes there.
        save_freq: "epoch", or an integer n: every n batches, counted across epochs.
        double_checkpoint: keep the previous backup too, restored (with a warning) when
            the newest is missing, torn or unreadable.
        delete_checkpoint: delete the backup when `fit` ends normally.
        handle_sigterm: on `SIGTERM`, finish the batch, back up (every worker after the
            same batch) and exit with `PREEMPTED_EXIT_CODE` (42): requeue the job on it.
            A Python handler installed before is called too.
        run_id: names the run (a restart passes the same); default: `SLURM_JOB_ID`, else
            the first backup's uuid.

    `fit`'s data: give it the arguments of each `fit` (`ResumableFit`, or
    `set_fit_arguments`) and it refuses data whose order cannot repeat (with
    `save_freq=n`), and records the global batch. Without, it warns once per `fit`.

    The run's identity (recorded in every backup, checked before anything trains): the
    run id, `accumulation_steps`, the optimizer's class chain and variable layout, the
    global batch, replicas and workers. Another number of workers or replicas resumes
    exactly with the same global batch (replica-local sums are restored as SUM / R);
    anything else that differs is refused by name.

    Raises:
        ValueError: a bad argument; (at `fit` start) data whose order cannot repeat with
            `save_freq=n`; an unbuilt model; a backup of another run, setup, data, or
            worker count with another global batch; workers that restored different
            backups; a torn newest backup with none kept before it.
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
        if not isinstance(handle_sigterm, bool):
            raise ValueError(f"handle_sigterm must be True or False, got {handle_sigterm!r}.")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.handle_sigterm = handle_sigterm
        self.run_id = run_id
        self._fit_data = None

    def set_fit_arguments(self, x=None, y=None, batch_size=None, shuffle=True,
                          steps_per_epoch=None, validation_split=0.0):
        """Tell the callback the arguments of the next `fit` (`ResumableFit` does)."""
        self._fit_data = describe_fit_data(x, y, batch_size, shuffle, steps_per_epoch,
                                           validation_split)

    # -- fit hooks --------------------------------------------------------------------------

    def _strategy(self):
        return self.model.distribute_strategy

    def _writes(self) -> bool:
        """The chief writes. The others still call `save_weights`, into a local temporary
        file: reading replica-local variables is a collective every worker must join."""
        strategy = self._strategy()
        return not _is_multi_worker(strategy) or strategy.extended.should_checkpoint

    def on_train_begin(self, logs=None):
        self._data, self._fit_data = self._fit_data, None  # this fit's only
        if self._data is None:
            warnings.warn(NO_FIT_ARGUMENTS, UserWarning, stacklevel=2)
        else:
            self._check_data_order()
        self._epoch, self._batches_done, self._since_backup = 0, 0, 0
        self._step, self._iterator, self._read = 0, None, 0
        self._store = BackupStore(self.backup_dir, keep_previous=self.double_checkpoint)
        self._resume = self._restore()
        if self._resume is not None:
            self.model._initial_epoch = self._resume["epoch"]  # as Keras' callback does
        self._wrap_train_function()
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
        self._step = batch  # the first batch of the step `_train` runs next

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
        self._resume = None  # a backup after the epoch's last batch resumes into its end
        if self.save_freq == "epoch":
            self._backup(epoch=epoch + 1, batch=0)

    def on_train_end(self, logs=None):
        if self._sigterm is not None:
            self._sigterm.close()
        self._resume = None
        self.model.train_function = self._keras_train
        self.model._initial_epoch = None  # a later fit of this model starts where told
        if self.delete_checkpoint and self._writes():
            self._store.delete()

    # -- data -------------------------------------------------------------------------------

    def _check_data_order(self):
        why, certain = self._data.why_order, self._data.order_certain
        if not why:
            return
        if self.save_freq != "epoch" and certain:
            raise ValueError(
                f"BackupAndRestore(save_freq={self.save_freq}) resumes mid-epoch by skipping "
                f"the batches already trained, but {why}: the resumed epoch would train "
                f"again on some examples and never on others. {DATA_ORDER_FIX} Or back up "
                "at epoch ends only: save_freq='epoch'.")
        warnings.warn(f"BackupAndRestore: {why}: a resumed fit may not equal an "
                      f"uninterrupted one. {DATA_ORDER_FIX}", UserWarning, stacklevel=3)

    def _wrap_train_function(self):
        """Keras' TensorFlow trainer calls `model.train_function(iterator)` once per step:
        the wrapper counts the batches read from each iterator, and, resuming, reads and
        drops the batches the backup holds instead of training them."""
        train = self.model.train_function
        self._keras_train = getattr(train, "distgrad_wraps", train)  # one a failed fit left

        def train_function(iterator):
            return self._train(iterator)

        train_function.distgrad_wraps = self._keras_train
        self.model.train_function = train_function

    def _train(self, iterator):
        if iterator is not self._iterator:  # Keras' new iterator (a new epoch)
            self._iterator, self._read = iterator, 0
        steps, resume = self.model.steps_per_execution, self._resume
        if resume is not None:
            before = resume["read"] - resume["batch"]  # earlier epochs' reads of it
            if self._step < resume["batch"]:  # trained before the backup: read, drop
                self._read_to(iterator, before + self._step + steps)
                return self.model.get_metrics_result()  # the epoch's logs so far
            self._read_to(iterator, before + self._step)
            self._resume = None
        self._read += steps
        return self._keras_train(iterator)

    def _read_to(self, iterator, position: int) -> None:
        while self._read < position:
            next(iterator)
            self._read += 1

    # -- metrics ----------------------------------------------------------------------------

    def _restore_metrics(self, totals) -> None:
        variables = self.model.metrics_variables
        if totals is None or len(totals) != len(variables):
            return  # the epoch's logs then average the batches after the resume only
        for variable, value in zip(variables, totals):
            variable.assign(tf.cast(value, variable.dtype))

    # -- backup and restore -----------------------------------------------------------------

    def _backup(self, epoch: int, batch: int) -> None:
        self._since_backup = 0
        read = self._read
        if batch == 0 and (self._data is None or self._data.new_iterator_after(read)):
            read = 0  # the next epoch reads a new iterator
        metadata = {
            "epoch": epoch,
            "batch": max(batch - 1, 0),  # keras.callbacks.BackupAndRestore's meaning
            "batches_done": batch,  # of `epoch`, in the backup's weights
            "batches_from_iterator": read,
            "batches_per_epoch": self.params.get("steps"),
            "metrics": [v.numpy().tolist() for v in self.model.metrics_variables]
            if batch else None,
        }
        self._store.save(self.model, metadata, write=self._writes())

    def _restore(self):
        """Load the backup, if any, into the model; return where fit resumes, or None."""
        if not self.model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, the model must be built before you "
                f"call fit(). Model {self.model.name} is unbuilt: build it with keras.Input "
                "or by calling it on a batch of data.")
        strategy, optimizer = self._strategy(), self.model.optimizer
        with strategy.scope():
            if optimizer is not None and not optimizer.built:
                optimizer.build(self.model.trainable_variables)  # its variables, to load into
            workers = len(cluster_of(strategy)[1]) if _is_multi_worker(strategy) else 1
            identity = run_identity(self.model, strategy.num_replicas_in_sync, workers,
                                    self.run_id, None if self._data is None
                                    else self._data.global_batch)
            metadata = self._store.load(self.model, identity,  # refuses another identity
                                        agree=self._check_same_backup_on_every_worker)
        return None if metadata is None else self._resume_point(metadata)

    def _check_same_backup_on_every_worker(self, manifest) -> None:
        """One all-reduce, before any weights load: every worker read the manifest the
        chief read (not, say, its own host's local directory's)."""
        strategy = self._strategy()
        if not _is_multi_worker(strategy):
            return
        key = "no backup" if manifest is None else repr(
            [manifest.get(k) for k in ("generation", "run_id", "epoch", "batch")])
        mark = float(zlib.crc32(key.encode()) % (1 << 20) + 1)  # sums of squares exact
        local = tf.constant([mark, mark * mark], tf.float64)
        total, squares = strategy.reduce("SUM", strategy.run(lambda: tf.identity(local)),
                                         axis=None).numpy()
        if strategy.num_replicas_in_sync * squares != total * total:
            raise ValueError(
                f"BackupAndRestore: the workers read different backups from "
                f"{self.backup_dir} (this one: {key}). Every worker must read the chief's "
                "backup: put backup_dir on a file system or bucket all workers share, not a "
                "local path on each host.")

    def _resume_point(self, metadata: dict) -> dict:
        if metadata.get("format") not in (FORMAT, LEGACY_FORMAT):  # keras.callbacks' backup
            if metadata.get("batch"):
                warnings.warn(
                    f"BackupAndRestore: {self.backup_dir} was written by "
                    "keras.callbacks.BackupAndRestore, which does not record how many "
                    f"batches its weights hold: epoch {metadata['epoch']} restarts from its "
                    "first batch, as Keras does.", UserWarning, stacklevel=3)
            return {"epoch": metadata["epoch"], "batch": 0, "read": 0, "metrics": None}
        expected, found = metadata["batches_per_epoch"], self.params.get("steps")
        if expected is not None and found is not None and expected != found:
            raise ValueError(
                f"BackupAndRestore: the backup in {self.backup_dir} was taken with "
                f"{expected} batches per epoch, this fit has {found}: other data, batch size "
                "or steps_per_epoch. Resume with the same fit arguments, or delete the "
                "backup directory to start over.")
        return {"epoch": metadata["epoch"], "batch": metadata["batches_done"],
                "read": metadata["batches_from_iterator"], "metrics": metadata["metrics"]}
