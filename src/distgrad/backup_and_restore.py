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
import tempfile
import warnings

import keras
import tensorflow as tf

try:
    from distgrad import backup_commit, fit_data, preemption
except ImportError:  # copied into a project: the three files beside this one
    import backup_commit
    import fit_data
    import preemption

PREEMPTED_EXIT_CODE = preemption.PREEMPTED_EXIT_CODE
__all__ = ["BackupAndRestore", "PREEMPTED_EXIT_CODE"]

NO_FIT_ARGUMENTS = (
    "BackupAndRestore was not given fit's arguments: build the model as "
    "distgrad.ResumableFitModel(inputs, outputs) or class M(distgrad.ResumableFit, "
    "keras.Model), or call callback.set_fit_arguments(x, y, batch_size=..., shuffle=..., "
    "steps_per_epoch=...) before fit. Without them it cannot check the data's order, nor "
    "record the global batch (another worker count is then refused), and a "
    "fit(steps_per_epoch=...) resumes at the wrong batch after an epoch-end backup.")


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up `fit` and resumes it exactly: mid-epoch, mid-cycle, after a `SIGTERM`.

    A `fit` interrupted anywhere and run again with the same arguments ends with the
    weights, `iterations` and epoch logs of the uninterrupted one. It restores the model,
    the optimizer (slots, `iterations`, an `AccumulatingOptimizer`'s accumulators, a loss
    scale), the epoch, the epoch's metrics so far and the position in the data: the data
    iterator's saved state on one device with no strategy; under a strategy (whose
    iterator TensorFlow cannot save) the batches the backup holds are read and dropped.

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
        ValueError: a bad argument; (at `fit` start) data whose order cannot repeat, with
            `save_freq=n`; a backup of another run, setup or data; workers that read
            different backups; a torn newest backup with none kept before it.
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
        self._fit_data = fit_data.describe_fit_data(x, y, batch_size, shuffle,
                                                    steps_per_epoch, validation_split)

    def _strategy(self):
        return self.model.distribute_strategy

    def _writes(self) -> bool:
        """The chief writes. The others still call `save_weights`, into a local temporary
        file: reading replica-local variables is a collective every worker must join."""
        strategy = self._strategy()
        return not preemption.is_multi_worker(strategy) or strategy.extended.should_checkpoint

    def on_train_begin(self, logs=None):
        self._data, self._fit_data = self._fit_data, None  # this fit's only
        if self._data is None:
            warnings.warn(NO_FIT_ARGUMENTS, UserWarning, stacklevel=2)
        else:
            self._check_data_order()
        self._epoch, self._batches_done, self._since_backup = 0, 0, 0
        self._step, self._iterator, self._read = 0, None, 0
        self._iterator_unsaved = False  # its state could not be saved: not tried again
        self._store = backup_commit.BackupStore(self.backup_dir, self.double_checkpoint)
        self._resume = self._restore()
        if self._resume is not None:
            self.model._initial_epoch = self._resume["epoch"]  # as Keras' callback does
        self._wrap_train_function()
        self._trained = 0  # batches trained by this fit (not read and dropped)
        self._sigterm = None
        if self.handle_sigterm:
            strategy = self._strategy()
            multi = preemption.is_multi_worker(strategy)
            cluster = preemption.cluster_of(strategy) if multi else None
            self._sigterm = preemption.SigtermWatch(cluster)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._batches_done = epoch, 0

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

    def _check_data_order(self):
        why, certain = self._data.why_order, self._data.order_certain
        if not why:
            return
        if self.save_freq != "epoch" and certain:
            raise ValueError(
                f"BackupAndRestore(save_freq={self.save_freq}) resumes mid-epoch by skipping "
                f"the batches already trained, but {why}: the resumed epoch would train "
                f"again on some examples and never on others. {fit_data.DATA_ORDER_FIX} Or "
                "back up at epoch ends only: save_freq='epoch'.")
        warnings.warn(f"BackupAndRestore: {why}: a resumed fit may not equal an uninterrupted "
                      f"one. {fit_data.DATA_ORDER_FIX}", UserWarning, stacklevel=3)

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
            if not resume["restored"]:  # the resumed epoch's first step (metrics reset)
                resume["restored"] = True
                self._restore_metrics(resume["metrics"], iterator.element_spec)
                if self._restore_iterator(iterator, resume):  # its state, if saved
                    self._read = resume["read"]
            before = resume["read"] - resume["batch"]  # earlier epochs' reads of it
            if self._step < resume["batch"]:  # trained before the backup: read, drop
                self._read_to(iterator, before + self._step + steps)
                return self.model.get_metrics_result()  # the epoch's logs so far
            self._read_to(iterator, before + self._step)
            self._resume = None
        self._read += steps
        return self._keras_train(iterator)

    def _restore_iterator(self, iterator, resume: dict) -> bool:
        """Restore the iterator's state saved with the backup, so that the batches it
        holds are not read again; False where there is none (or it fails: warned)."""
        if not resume["read"] or not isinstance(iterator, tf.data.Iterator):
            return False
        try:
            with self._store.attachment(resume["record"], "iterator") as local:
                return local is not None and fit_data.restore_iterator_state(iterator, local)
        except (ValueError, AssertionError, tf.errors.OpError) as error:
            warnings.warn(f"BackupAndRestore: the data iterator's saved state cannot be "
                          f"restored ({error}): the {resume['read']} batches the backup "
                          "holds are read and dropped instead.", UserWarning, stacklevel=2)
            return False

    def _iterator_state(self, directory: str):
        """The state of the iterator `fit` reads, a file in `directory`, where TensorFlow
        can save it (a `tf.data.Iterator`); None elsewhere, or if that fails (warned)."""
        if not isinstance(self._iterator, tf.data.Iterator) or self._iterator_unsaved:
            return None
        try:
            return fit_data.save_iterator_state(self._iterator, directory)
        except (ValueError, tf.errors.OpError) as error:
            self._iterator_unsaved = True
            warnings.warn(f"BackupAndRestore: the data iterator's state cannot be saved "
                          f"({error}): a resume reads and drops the batches a backup holds.",
                          UserWarning, stacklevel=2)
            return None

    def _read_to(self, iterator, position: int) -> None:
        while self._read < position:
            next(iterator)
            self._read += 1

    def _restore_metrics(self, totals, element_spec) -> None:
        if totals is None:
            return  # the epoch's logs then average the batches after the resume only
        if len(self.model.metrics_variables) != len(totals):
            # With no strategy Keras builds the compiled metrics at the first step: build
            # them (public `compute_metrics`, on a batch of zeros), then overwrite them.
            zeros = tf.nest.map_structure(
                lambda spec: tf.zeros([d or 1 for d in spec.shape], spec.dtype), element_spec)
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(zeros)
            self.model.compute_metrics(x, y, self.model(x), sample_weight)
        variables = self.model.metrics_variables
        if len(variables) != len(totals):
            raise ValueError(
                f"BackupAndRestore: the backup in {self.backup_dir} holds {len(totals)} metric "
                f"variables, this model has {len(variables)}: compile it with the metrics of "
                "the run that wrote the backup, or delete the backup to start over.")
        for variable, value in zip(variables, totals):
            variable.assign(tf.cast(value, variable.dtype))

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
        with tempfile.TemporaryDirectory(prefix="distgrad-iterator-") as local:
            state = self._iterator_state(local) if read else None
            self._store.save(self.model, metadata, write=self._writes(),
                             attachments={"iterator": state} if state else None)

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
            multi = preemption.is_multi_worker(strategy)
            workers = len(preemption.cluster_of(strategy)[1]) if multi else 1
            identity = backup_commit.run_identity(
                self.model, strategy.num_replicas_in_sync, workers, self.run_id,
                None if self._data is None else self._data.global_batch)
            metadata = self._store.load(self.model, identity,  # refuses another identity
                                        agree=self._check_same_backup_on_every_worker)
        return None if metadata is None else self._resume_point(metadata)

    def _check_same_backup_on_every_worker(self, manifest) -> None:
        """Before any weights load: every worker read the chief's manifest (not, say, its
        own host's local directory's)."""
        strategy = self._strategy()
        key = "no backup" if manifest is None else repr(
            [manifest.get(k) for k in ("generation", "run_id", "epoch", "batch")])
        multi = preemption.is_multi_worker(strategy)
        if multi and not preemption.same_on_every_worker(strategy, key):
            raise ValueError(
                f"BackupAndRestore: the workers read different backups from "
                f"{self.backup_dir} (this one: {key}). Every worker must read the chief's "
                "backup: put backup_dir on a file system or bucket all workers share, not a "
                "local path on each host.")

    def _resume_point(self, metadata: dict) -> dict:
        formats = (backup_commit.FORMAT, backup_commit.LEGACY_FORMAT)
        if metadata.get("format") not in formats:  # keras.callbacks.BackupAndRestore's
            if metadata.get("batch"):
                warnings.warn(
                    f"BackupAndRestore: {self.backup_dir} was written by "
                    "keras.callbacks.BackupAndRestore, which does not record how many "
                    f"batches its weights hold: epoch {metadata['epoch']} restarts from its "
                    "first batch, as Keras does.", UserWarning, stacklevel=3)
            return {"epoch": metadata["epoch"], "batch": 0, "read": 0, "metrics": None,
                    "record": metadata, "restored": False}
        expected, found = metadata["batches_per_epoch"], self.params.get("steps")
        if expected is not None and found is not None and expected != found:
            raise ValueError(
                f"BackupAndRestore: the backup in {self.backup_dir} was taken with "
                f"{expected} batches per epoch, this fit has {found}: other data, batch size "
                "or steps_per_epoch. Resume with the same fit arguments, or delete the "
                "backup directory to start over.")
        return {"epoch": metadata["epoch"], "batch": metadata["batches_done"],
                "read": metadata["batches_from_iterator"], "metrics": metadata["metrics"],
                "record": metadata, "restored": False}
