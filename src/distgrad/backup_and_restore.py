"""`BackupAndRestore`: `keras.callbacks.BackupAndRestore` that resumes where the backup
was taken, where Keras 3's restarts the interrupted epoch from its first batch.

    model = ResumableFitModel(inputs, outputs)  # or class M(ResumableFit, keras.Model)
    model.compile(...)
    model.fit(dataset, epochs=10, callbacks=[BackupAndRestore("gs://b/run-1", save_freq=50)])

It imports only TensorFlow, Keras and the standard library: copy this one file. Below the
callback: what it needs of `fit`'s data (`ResumableFit`), the files of a backup and their
commit (`BackupStore`), and `SIGTERM` (`SigtermWatch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
import warnings
import zipfile
import zlib

import keras
import tensorflow as tf

__all__ = ["PREEMPTED_EXIT_CODE", "BackupAndRestore", "BackupStore", "DATA_ORDER_FIX", "FitData",
           "ResumableFit", "ResumableFitModel", "SigtermWatch", "describe_fit_data"]

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

    Example:

    ```python
    model = ResumableFitModel(inputs, outputs)  # its fit tells the callback its data
    model.compile(optimizer=AccumulatingOptimizer(keras.optimizers.Adam(), 4), loss="mse")
    # Run the same line again after a preemption: it resumes from the last backup (after
    # a SIGTERM, the one taken as the running batch finished: no batch is lost).
    model.fit(dataset.batch(32), epochs=10,
              callbacks=[BackupAndRestore("gs://bucket/run", save_freq=100)])
    ```

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
        self._fit_data = describe_fit_data(x, y, batch_size, shuffle,
                                                    steps_per_epoch, validation_split)

    def _strategy(self):
        return self.model.distribute_strategy

    def _writes(self) -> bool:
        """The chief writes. The others still call `save_weights`, into a local temporary
        file: reading replica-local variables is a collective every worker must join."""
        strategy = self._strategy()
        return not is_multi_worker(strategy) or strategy.extended.should_checkpoint

    def on_train_begin(self, logs=None):
        self._data, self._fit_data = self._fit_data, None  # this fit's only
        if self._data is None:
            warnings.warn(NO_FIT_ARGUMENTS, UserWarning, stacklevel=2)
        else:
            self._check_data_order()
        self._epoch, self._batches_done, self._since_backup = 0, 0, 0
        self._step, self._iterator, self._read = 0, None, 0
        self._iterator_unsaved = False  # its state could not be saved: not tried again
        self._store = BackupStore(self.backup_dir, self.double_checkpoint)
        self._resume = self._restore()
        if self._resume is not None:
            self.model._initial_epoch = self._resume["epoch"]  # as Keras' callback does
        self._wrap_train_function()
        self._trained = 0  # batches trained by this fit (not read and dropped)
        self._sigterm = None
        if self.handle_sigterm:
            strategy = self._strategy()
            multi = is_multi_worker(strategy)
            cluster = cluster_of(strategy) if multi else None
            self._sigterm = SigtermWatch(cluster)

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
                f"again on some examples and never on others. {DATA_ORDER_FIX} Or "
                "back up at epoch ends only: save_freq='epoch'.")
        warnings.warn(f"BackupAndRestore: {why}: a resumed fit may not equal an uninterrupted "
                      f"one. {DATA_ORDER_FIX}", UserWarning, stacklevel=3)

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
                return local is not None and restore_iterator_state(iterator, local)
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
            return save_iterator_state(self._iterator, directory)
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
            multi = is_multi_worker(strategy)
            workers = len(cluster_of(strategy)[1]) if multi else 1
            identity = run_identity(
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
        multi = is_multi_worker(strategy)
        if multi and not same_on_every_worker(strategy, key):
            raise ValueError(
                f"BackupAndRestore: the workers read different backups from "
                f"{self.backup_dir} (this one: {key}). Every worker must read the chief's "
                "backup: put backup_dir on a file system or bucket all workers share, not a "
                "local path on each host.")

    def _resume_point(self, metadata: dict) -> dict:
        formats = (FORMAT, LEGACY_FORMAT)
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


# ---- What `BackupAndRestore` must know of `fit`'s data, taken from `fit`'s own arguments.
#
#     class MyModel(ResumableFit, keras.Model): ...       # subclassed models
#     model = ResumableFitModel(inputs, outputs)           # functional
#     model.fit(dataset, epochs=3, callbacks=[BackupAndRestore("/backup", save_freq=50)])
#
# Keras hands callbacks neither `fit`'s data nor its arguments. `ResumableFit.fit` hands
# its arguments to each callback in `callbacks` that has `set_fit_arguments` (distgrad's
# `BackupAndRestore`), then runs Keras' `fit` unchanged. Without the mixin, call
# `callback.set_fit_arguments(x, ...)` with `fit`'s arguments before each `fit`.
#
# `describe_fit_data(...)` says, from those arguments alone:
#
# * whether the data comes in the same order when `fit` starts again (a resumed epoch skips
#   the batches its backup holds: right only if they are the same batches);
# * the global batch (a restart on another number of workers resumes exactly only with it);
# * when Keras starts a new iterator over the data: every epoch, or, with
#   `fit(steps_per_epoch=...)`, only when the data's own batches run out.
#
# `save_iterator_state` and `restore_iterator_state` keep the position of the iterator
# `fit` reads where TensorFlow can save it (one device, no strategy).


FIT_ARGUMENTS = ("x", "y", "batch_size", "shuffle", "steps_per_epoch", "validation_split")
DATA_ORDER_FIX = (
    "To resume exactly, the data must come in the same order when fit starts again: pass "
    "fit(..., shuffle=False) and shuffle once yourself with a seed, or a tf.data.Dataset "
    "shuffled with dataset.shuffle(buffer_size, seed=SEED, reshuffle_each_iteration=False) "
    "(or .shuffle(buffer_size, seed=SEED).repeat() with fit(steps_per_epoch=...), one "
    "iterator for all epochs).")
SHUFFLE_OPS = ("ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3",
               "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2")


@dataclasses.dataclass(frozen=True)
class FitData:
    """`why_order`: why the data may come in another order at a restart ("" if it
    repeats); `order_certain`: whether that is certain, not only impossible to rule out;
    `global_batch`: examples per step, None where unknown; `steps_per_epoch`: `fit`'s;
    `batches`: the data's own batch count (None: infinite or unknown)."""

    why_order: str
    order_certain: bool
    global_batch: int | None
    steps_per_epoch: int | None
    batches: int | None

    def new_iterator_after(self, read: int) -> bool:
        """Whether Keras' next epoch reads a new iterator, `read` batches having been read
        from the current one (`keras/src/trainers/epoch_iterator.py`: a new one every
        epoch without `steps_per_epoch`; with it, once the data's batches are read)."""
        return self.steps_per_epoch is None or (self.batches is not None
                                                and read >= self.batches)


def _dataset_shuffles(dataset: tf.data.Dataset) -> list[str]:
    """One line per shuffle op of `dataset`'s graph that has no seed, or reshuffles each
    iteration: what changes its order from one iterator to the next. (The graph is read
    through `Dataset._as_serialized_graph`, a private method: docs/design.md.)"""
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


def _leading_dimension(element_spec):
    dimensions = {spec.shape[0] for spec in tf.nest.flatten(element_spec, expand_composites=True)
                  if isinstance(spec, tf.TensorSpec) and spec.shape.rank}
    return dimensions.pop() if len(dimensions) == 1 else None


def _examples(x):
    """The number of examples of `x` if it is arrays (NumPy, tensors, nested), else None."""
    leaves = tf.nest.flatten(x)
    if not leaves or not all(hasattr(leaf, "shape") and len(leaf.shape) for leaf in leaves):
        return None
    return int(leaves[0].shape[0])


def describe_fit_data(x=None, y=None, batch_size=None, shuffle=True, steps_per_epoch=None,
                      validation_split=0.0) -> FitData:
    """What `BackupAndRestore` needs of `fit(x, y, batch_size=..., shuffle=...,
    steps_per_epoch=..., validation_split=...)`'s data (`FitData`)."""
    if isinstance(x, tf.data.Dataset):
        shuffles = _dataset_shuffles(x)
        cardinality = int(x.cardinality())
        return FitData("the tf.data.Dataset has " + "; ".join(shuffles) if shuffles else "",
                       True, _leading_dimension(x.element_spec), steps_per_epoch,
                       cardinality if cardinality >= 0 else None)
    if isinstance(x, keras.utils.PyDataset):
        why = ("fit(shuffle=True) shuffles the PyDataset's batches anew in every epoch"
               if shuffle else "")
        return FitData(why, True, None, steps_per_epoch, x.num_batches)
    examples = _examples(x)
    if examples is not None:  # Keras' array adapter: batch_size, 32 by default
        why = f"fit(shuffle={shuffle!r}) shuffles the arrays anew in every epoch" if shuffle else ""
        batch = batch_size or 32
        trained = math.ceil(examples * (1.0 - validation_split))  # Keras' split_at
        return FitData(why, True, batch, steps_per_epoch, math.ceil(trained / batch))
    kind = ("distributed dataset" if isinstance(x, tf.distribute.DistributedDataset)
            else "Python generator" if inspect.isgenerator(x) else type(x).__name__)
    why = (f"the order of a {kind} cannot be inspected; a resumed fit skips as many batches "
           "of it as were trained, which is right only if it yields the same batches in the "
           "same order again")
    return FitData(why, False, None, steps_per_epoch, None)


def save_iterator_state(iterator: tf.data.Iterator, directory: str) -> str:
    """Save `iterator`'s position (`tf.train.Checkpoint`, files in `directory`) into one
    zip file there; its path. Raises what TensorFlow raises for a pipeline whose state it
    cannot save (a `py_function`, unless the dataset's `experimental_external_state_policy`
    is IGNORE). A `tf.distribute` iterator is not a `tf.data.Iterator`: TensorFlow 2.21
    cannot checkpoint it."""
    prefix = os.path.join(directory, "state", "iterator")
    tf.train.Checkpoint(iterator=iterator).write(prefix)
    path = os.path.join(directory, "iterator.zip")
    with zipfile.ZipFile(path, "w") as archive:
        for name in os.listdir(os.path.dirname(prefix)):
            archive.write(os.path.join(os.path.dirname(prefix), name), name)
    return path


def restore_iterator_state(iterator: tf.data.Iterator, path: str) -> bool:
    """Restore into `iterator` (a new one over the same pipeline) the position saved in
    `path` by `save_iterator_state`; True. Raises if the file or the pipeline differ."""
    with tempfile.TemporaryDirectory(prefix="distgrad-iterator-") as state:
        with zipfile.ZipFile(path) as archive:
            archive.extractall(state)
        tf.train.Checkpoint(iterator=iterator).read(
            os.path.join(state, "iterator")).assert_consumed()
    return True


class ResumableFit:
    """Mixin for `keras.Model`: its `fit` hands `fit`'s arguments to `BackupAndRestore`.

    Put it first in the bases: `class M(ResumableFit, keras.Model)`; with distgrad's other
    mixins, `class M(ResumableFit, MultiWorkerFit, MicroBatching, keras.Model)`.

    Args: none of its own; all go to the next class. State: none. `fit` is Keras' own.
    """

    def fit(self, *args, **kwargs):
        # Keras' own signature: a mixin after this one may take (*args, **kwargs).
        bound = inspect.signature(keras.Model.fit).bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = {name: bound.arguments[name] for name in FIT_ARGUMENTS
                     if name in bound.arguments}
        callbacks = bound.arguments.get("callbacks") or []
        for callback in getattr(callbacks, "callbacks", callbacks):  # a list, a CallbackList
            if hasattr(callback, "set_fit_arguments"):
                callback.set_fit_arguments(**arguments)
        return super().fit(*args, **kwargs)


@keras.saving.register_keras_serializable(package="distgrad")
class ResumableFitModel(ResumableFit, keras.Model):
    """`keras.Model` whose `fit` hands its arguments to `BackupAndRestore`; accepts
    functional arguments: `ResumableFitModel(inputs, outputs)` (see `ResumableFit`)."""


# ---- The files of a `BackupAndRestore` backup, committed so that a kill at any moment
# leaves a whole backup behind: on a local disk, and on object storage (gs://, s3://),
# where a rename is a copy followed by a delete and only the write of one object is atomic.
#
#     store = BackupStore("gs://bucket/run-1", keep_previous=False)
#     metadata = store.load(model)  # the newest whole backup's metadata (weights loaded), or None
#     store.save(model, metadata, write=is_chief)  # every worker: save_weights is a collective
#
# The commit protocol (the anchors: `tf.train.CheckpointManager`'s `checkpoint` index file,
# Orbax's commit marker):
#
# 1. The weights go to a file of a new name, `ckpt-<generation>.weights.h5`:
#    `model.save_weights` writes a local temporary file (Keras writes with h5py, which knows
#    only local files), copied into the directory with `tf.io.gfile.copy`.
# 2. The commit point: the manifest `training_metadata.json`, one small JSON object that
#    names that file and its size, with the backup's metadata (epoch, batch, position in the
#    data). It is written as `training_metadata.json.tmp`, then renamed over the manifest: a
#    local rename is atomic; an object store's rename copies one object (atomic) and then
#    deletes the temporary one, so a kill between the two leaves only a stray `.tmp`.
# 3. Only then are the files the manifest no longer names deleted.
#
# A generation may have attachments beside its weights, copied in step 1 as
# `ckpt-<generation>.<key>` and named by the manifest: `BackupAndRestore` attaches the state
# of `fit`'s data iterator where TensorFlow can save it (one device, no strategy).
#
# A restore reads the manifest and only the file it names. A backup killed before its commit
# left at most a file no manifest names, overwritten by the next backup of that generation.
# With `keep_previous` (`double_checkpoint`) the manifest also names the generation before,
# kept until the next commit: when the newest file is missing, of another size than recorded
# (a torn upload) or unreadable, the restore warns and falls back to it. Without, it raises.
#
# Every worker reads the backup; only the writer (`write=True`, the chief) touches the
# directory, every operation through `tf.io.gfile` (as gs:// needs). The others save into a
# local temporary directory (reading replica-local variables is a collective).
#
# Older layouts restore as before and are replaced by the next commit: distgrad 0.2's
# (`latest.weights.h5`, `training_metadata.json` of format "distgrad.BackupAndRestore/1",
# `pending.*` files of an interrupted commit) and `keras.callbacks.BackupAndRestore`'s (the
# same two files, `{"epoch", "batch"}` only). Their commit does not hold on object storage.
#
# The manifest also records the run's identity (`run_identity`), which `load(model,
# identity)` checks before loading any weights (`check_identity`).

FORMAT = "distgrad.BackupAndRestore/2"
LEGACY_FORMAT = "distgrad.BackupAndRestore/1"  # distgrad 0.2
MANIFEST = "training_metadata.json"  # the name keras.callbacks.BackupAndRestore uses
MANIFEST_TEMP = MANIFEST + ".tmp"
# distgrad 0.2's layout (Keras' own: the first file and MANIFEST): deleted by the next commit
LEGACY_WEIGHTS = "latest.weights.h5"
LEGACY_PENDING_WEIGHTS = "pending.weights.h5"
LEGACY_PENDING_METADATA = "pending_metadata.json"
LEGACY_FILES = (LEGACY_WEIGHTS, LEGACY_PENDING_WEIGHTS, LEGACY_PENDING_METADATA,
                LEGACY_WEIGHTS + ".bkp", MANIFEST + ".bkp")


# What identifies a run, recorded in every manifest and compared at restore.
IDENTITY_FIELDS = ("run_id", "accumulation_steps", "optimizer", "optimizer_variables",
                   "global_batch", "replicas", "workers")
# May differ at a restart with the same global batch: replica-local sums are restored as
# SUM / R (`SyncOnReadVariable.assign`), so the next update all-reduces the same totals.
TOPOLOGY_FIELDS = ("replicas", "workers")


def weights_name(generation: int) -> str:
    return f"ckpt-{generation}.weights.h5"


def _optimizer_chain(optimizer) -> list:
    """`optimizer` and those it wraps (`inner_optimizer`, recursively), outermost first."""
    chain = []
    while optimizer is not None:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return chain


def _variable_layout(model, optimizer) -> list:
    """[name, shape] of each of the optimizer's (built) variables. A slot's name begins with
    its model variable's path, which holds per-process layer counters (`dense_4`): that
    prefix becomes the variable's index, `<weight 2>`, the same in every process."""
    prefixes = sorted(((v.path.replace("/", "_") + "_", f"<weight {i}>_")
                       for i, v in enumerate(model.trainable_variables)),
                      key=lambda pair: -len(pair[0]))
    layout = []
    for variable in optimizer.variables:
        name = variable.name
        for prefix, short in prefixes:
            if name.startswith(prefix):
                name = short + name[len(prefix):]
                break
        layout.append([name, [int(d) for d in variable.shape]])
    return layout


def run_identity(model, replicas: int, workers: int, run_id=None, global_batch=None) -> dict:
    """What identifies the run of `model` (compiled, its optimizer built). `run_id`: the
    user's, else `SLURM_JOB_ID` from the environment, else None (`check_identity` then
    adopts the backup's, or a new uuid). `global_batch`: None where unknown."""
    if run_id is None:
        run_id = os.environ.get("SLURM_JOB_ID") or None
    chain = _optimizer_chain(model.optimizer)
    steps = next((o.accumulation_steps for o in chain if hasattr(o, "accumulation_steps")),
                 getattr(model, "accumulation_steps", None))
    return {"run_id": None if run_id is None else str(run_id),
            "accumulation_steps": None if steps is None else int(steps),
            "global_batch": None if global_batch is None else int(global_batch),
            "replicas": int(replicas), "workers": int(workers),
            "optimizer": " > ".join(type(o).__name__ for o in chain),
            "optimizer_variables": (_variable_layout(model, model.optimizer)
                                    if model.optimizer is not None else [])}


def _layout_difference(recorded: list, now: list) -> str:
    if len(recorded) != len(now):
        return f"{len(recorded)} variables (recorded) vs {len(now)} now"
    first = next(i for i, (a, b) in enumerate(zip(recorded, now)) if a != b)
    return f"variable {first} is {recorded[first]} (recorded) vs {now[first]} now"


def check_identity(recorded: dict, identity: dict, directory: str) -> dict:
    """`identity` with its run id filled in (the recorded one, or a new uuid when there is
    no backup or it recorded none); raises `ValueError` naming every field of `recorded`
    that differs. Fields `recorded` lacks (an older backup) are not compared, nor a global
    batch unknown on either side; replicas and workers may differ with the same global batch."""
    identity = dict(identity)
    if identity["run_id"] is None:
        identity["run_id"] = (recorded or {}).get("run_id") or uuid.uuid4().hex
    recorded = recorded or {}
    batch, batch_now = recorded.get("global_batch"), identity["global_batch"]
    same_batch = batch is not None and batch == batch_now
    differences = []
    for field in IDENTITY_FIELDS:
        if field not in recorded or recorded[field] == identity[field]:
            continue
        if field == "global_batch" and batch_now is None or field in TOPOLOGY_FIELDS and same_batch:
            continue
        if field == "optimizer_variables":
            what = _layout_difference(recorded[field], identity[field])
        else:
            what = f"{recorded[field]!r} (recorded) vs {identity[field]!r} now"
        if field in TOPOLOGY_FIELDS:
            what += (f", and the global batch is {batch!r} (recorded) vs {batch_now!r} now: "
                     "another worker or replica count resumes exactly only with the same "
                     "global batch, known on both sides (give BackupAndRestore fit's "
                     "arguments: distgrad.ResumableFitModel)")
        differences.append(f"{field}: {what}")
    if differences:
        raise ValueError(
            f"BackupAndRestore: to resume the backup in {directory}, run with the setup it "
            "recorded (and its run id: BackupAndRestore(run_id=...) or SLURM_JOB_ID); to "
            f"start over, pass a new backup_dir, or delete {directory}. It belongs to "
            "another run or setup: " + "; ".join(differences) + ".")
    return identity


def _files(record: dict) -> list:
    """The files of one generation: its weights and its attachments."""
    return [record["weights"], *(a["name"] for a in record.get("attachments", {}).values())]


@contextlib.contextmanager
def _local_copy(path: str):
    """`path` itself if it is local, else a local temporary copy (h5py reads local files)."""
    if "://" not in path:
        yield path
        return
    directory = tempfile.mkdtemp(prefix="distgrad-backup-")
    try:
        local = os.path.join(directory, os.path.basename(path))
        tf.io.gfile.copy(path, local, overwrite=True)
        yield local
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class BackupStore:
    """The backup in `directory`: `load` the newest whole one, `save` and commit a new one,
    `delete` them all. `keep_previous`: the manifest also names the generation before."""

    def __init__(self, directory: str, keep_previous: bool = False):
        self.directory = directory
        self.keep_previous = keep_previous
        self._named = []  # the records the manifest names, the one to keep first
        self._next_generation = 1
        self._legacy = False  # an older layout was restored: its files go at the next commit
        self._made = False
        self.identity = {}  # recorded in every manifest: `load(model, identity)` sets it

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _read_json(self, name: str):
        path = self._path(name)
        if not tf.io.gfile.exists(path):
            return None
        with tf.io.gfile.GFile(path) as file:
            text = file.read()
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"BackupAndRestore: {path} is not JSON ({error}). Delete "
                             f"{self.directory} to start over.") from None

    # -- reading ------------------------------------------------------------------------

    def load(self, model, identity: dict | None = None, agree=None) -> dict | None:
        """Load the newest whole backup into `model` (built, its optimizer built); return
        its metadata, or None if there is no backup. Call it in the strategy's scope.
        `identity` (`run_identity`): checked against the backup's before any weights are
        loaded (`check_identity`); `self.identity` is then what the next backups record.
        `agree(manifest)`: called before any weights are loaded (loading is a collective
        on several workers), with the manifest read (None if there is none)."""
        manifest = self._read_json(MANIFEST)
        if identity is not None:
            current = manifest is not None and manifest.get("format") == FORMAT
            self.identity = check_identity(manifest if current else None,  # older layouts
                                           identity, self.directory)  # record none
        if agree is not None:
            agree(manifest)
        if manifest is None or manifest.get("format") != FORMAT:
            return self._load_legacy(model, manifest)
        records = [{k: v for k, v in manifest.items() if k != "previous"}]
        if manifest.get("previous"):
            records.append(manifest["previous"])
        self._next_generation = max(r["generation"] for r in records) + 1
        for index, record in enumerate(records):
            problem = self._load_generation(model, record)
            if problem is None:
                self._named = [record] + [r for r in records if r is not record]
                return record
            if index + 1 < len(records):
                warnings.warn(f"BackupAndRestore: {problem}: restoring the backup before it, "
                              f"{records[index + 1]['weights']}.", UserWarning, stacklevel=3)
        fallback = ("" if len(records) > 1 else
                    " No backup before it is kept (double_checkpoint=True keeps one).")
        raise ValueError(f"BackupAndRestore: {problem}.{fallback} Delete {self.directory} "
                         "to start over.")

    def _load_generation(self, model, record: dict) -> str | None:
        """Load one generation's weights; what is wrong with its file, or None."""
        path = self._path(record["weights"])
        if not tf.io.gfile.exists(path):
            return f"{path} is missing"
        size = tf.io.gfile.stat(path).length
        if size != record["weights_bytes"]:
            return (f"{path} has {size} bytes, not the {record['weights_bytes']} its manifest "
                    "recorded (a torn write)")
        try:
            with _local_copy(path) as local:
                model.load_weights(local)
        except OSError as error:  # h5py: a damaged file
            return f"{path} cannot be read ({error})"
        return None

    def _load_legacy(self, model, metadata: dict | None) -> dict | None:
        """distgrad 0.2's or Keras' layout, loaded as distgrad 0.2 did."""
        weights = self._path(LEGACY_WEIGHTS)
        if not tf.io.gfile.exists(weights):
            return None
        if (tf.io.gfile.exists(self._path(LEGACY_PENDING_METADATA))
                and not tf.io.gfile.exists(self._path(LEGACY_PENDING_WEIGHTS))):
            metadata = self._read_json(LEGACY_PENDING_METADATA)  # killed between its renames
        if metadata is None:
            raise ValueError(f"BackupAndRestore: {weights} has no {MANIFEST} beside it. "
                             f"Delete {self.directory} to start over.")
        with _local_copy(weights) as local:
            model.load_weights(local)
        self._legacy = True
        return metadata

    # -- writing ------------------------------------------------------------------------

    def save(self, model, metadata: dict, write: bool = True, attachments=None) -> None:
        """`model.save_weights` into a local temporary file (every worker must: it reads
        replica-local variables); with `write`, commit it as the next generation, with
        `attachments` ({key: a local file}, e.g. the data iterator's state) beside it."""
        local_dir = tempfile.mkdtemp(prefix="distgrad-backup-")
        try:
            local = os.path.join(local_dir, "backup.weights.h5")
            model.save_weights(local)
            if not write:
                return
            if not self._made:
                tf.io.gfile.makedirs(self.directory)
                self._made = True
            generation = self._next_generation
            record = {**metadata, **self.identity, "format": FORMAT, "generation": generation,
                      "weights": weights_name(generation),
                      "weights_bytes": os.path.getsize(local), "attachments": {}}
            tf.io.gfile.copy(local, self._path(record["weights"]), overwrite=True)  # 1.
            for key, path in (attachments or {}).items():
                name = f"ckpt-{generation}.{key}"
                record["attachments"][key] = {"name": name, "bytes": os.path.getsize(path)}
                tf.io.gfile.copy(path, self._path(name), overwrite=True)
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)
        named = [record] + self._named[:1] if self.keep_previous else [record]
        manifest = dict(record, **({"previous": named[1]} if len(named) > 1 else {}))
        with tf.io.gfile.GFile(self._path(MANIFEST_TEMP), "w") as file:  # 2.
            file.write(json.dumps(manifest))
        tf.io.gfile.rename(self._path(MANIFEST_TEMP), self._path(MANIFEST), overwrite=True)
        self._next_generation = generation + 1
        kept = {name for r in named for name in _files(r)}  # 3.
        retired = [name for r in self._named for name in _files(r) if name not in kept]
        retired += list(LEGACY_FILES) if self._legacy else []
        self._named, self._legacy = named, False
        for name in retired:
            if tf.io.gfile.exists(self._path(name)):
                tf.io.gfile.remove(self._path(name))

    @contextlib.contextmanager
    def attachment(self, record: dict, key: str):
        """A local copy of `record`'s attachment `key` (None if it has none); `ValueError`
        if its file is missing or of another size than recorded (a torn write)."""
        entry = record.get("attachments", {}).get(key)
        if entry is None:
            yield None
            return
        path = self._path(entry["name"])
        if not tf.io.gfile.exists(path) or tf.io.gfile.stat(path).length != entry["bytes"]:
            raise ValueError(f"{path} is missing or not the {entry['bytes']} bytes its "
                             "manifest recorded")
        with _local_copy(path) as local:
            yield local

    def delete(self) -> None:
        """Delete the backup: the manifest first (a kill midway leaves no backup, not a
        manifest naming deleted files), then the directory."""
        if tf.io.gfile.exists(self._path(MANIFEST)):
            tf.io.gfile.remove(self._path(MANIFEST))
        if tf.io.gfile.exists(self.directory):
            tf.io.gfile.rmtree(self.directory)


# ---- `BackupAndRestore`'s `SIGTERM`: every worker backs up after the same batch, then
# the process exits with `PREEMPTED_EXIT_CODE`.
#
#     watch = SigtermWatch(cluster_of(strategy) if multi_worker else None)  # at fit start:
#                                     # installs the handler (Python allows the main thread only)
#     if watch.due(trained_batches):  # at the end of every trained batch
#         ...                         # back up
#         watch.exit("...")           # restores the handler; sys.exit(PREEMPTED_EXIT_CODE)
#     watch.close()                   # at fit's end: restores the handler
#
# The handler only records the signal. Python runs it between bytecodes, so after the
# TensorFlow call of the batch then running returns: that batch is finished, then backed up.
#
# On several workers (`MultiWorkerMirroredStrategy`) every step all-reduces, so no worker is
# more than one trained batch ahead of another. The worker that got the signal, at the end of
# its batch n, publishes n + 1 in the coordination service's key-value store, as
# `tf.distribute.experimental.PreemptionCheckpointHandler` does
# (`tensorflow/python/distribute/failure_handling/failure_handling.py`). Every worker's
# watcher thread, blocked on that key since fit started, reads it and acknowledges; the
# signalled worker waits for every acknowledgement before its batch n + 1, so no worker can
# finish that batch without knowing. Per batch this costs a look at a flag
# (`benchmarks/sigterm_cost.py`).
#
# A handler installed before, any Python function (yours; `PreemptionCheckpointHandler`
# installs one of its own), is chained: called right after this one records the signal.
# The default action and `SIG_IGN` have nothing to call. A signal recorded but never acted
# on (it came during the last batch of a multi-worker fit, or while a restart was skipping
# batches to the end) is passed on when fit ends: the handler before is restored, and, if it
# is the default action, the signal raised again (a Python handler was called already).

PREEMPTED_EXIT_CODE = 42  # tf.distribute's exit code to restart on (failure_handling_util)
ACK_TIMEOUT_MS = 60_000  # how long the signalled worker waits for the others to acknowledge
_STOP = "stop"  # the key's value when fit ends with no SIGTERM: the watchers return
_fits = itertools.count()  # multi-worker fits in this process: the same on every worker


def is_multi_worker(strategy) -> bool:
    """A `MultiWorkerMirroredStrategy` of 2+ workers (`_in_multi_worker_mode`: private)."""
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


def same_on_every_worker(strategy, key: str) -> bool:
    """Whether every worker of `strategy` passed the same `key`: one all-reduce of a
    20-bit hash h and h * h (equal iff R * sum(h^2) == sum(h)^2; float64 sums exact)."""
    mark = float(zlib.crc32(key.encode()) % (1 << 20) + 1)
    local = tf.constant([mark, mark * mark], tf.float64)
    total, squares = strategy.reduce("SUM", strategy.run(lambda: tf.identity(local)),
                                     axis=None).numpy()
    return strategy.num_replicas_in_sync * squares == total * total


def cluster_of(strategy) -> tuple[str, list[str]]:
    """(this worker's id, every worker's id) of a multi-worker strategy."""
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec()
    ids = [f"{job}_{index}" for job in ("chief", "worker") if job in spec.jobs
           for index in range(spec.num_tasks(job))]
    return f"{resolver.task_type}_{resolver.task_id}", ids


class SigtermWatch:
    """The `SIGTERM` handler of one `fit`. `cluster`: None on one worker, else what
    `cluster_of` returns."""

    def __init__(self, cluster=None):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "BackupAndRestore(handle_sigterm=True) installs a SIGTERM handler, which "
                "Python allows only in the main thread; this fit runs in thread "
                f"{threading.current_thread().name!r}. Pass handle_sigterm=False (a SIGTERM "
                "then ends the process without a backup), or call fit in the main thread.")
        previous = signal.getsignal(signal.SIGTERM)
        while isinstance(getattr(previous, "__self__", None), SigtermWatch):
            previous = previous.__self__.previous  # left by a fit that raised: unwrap it
        self.previous = previous
        self.signalled = False
        self._acted = False
        self._agreed = None  # the batch every worker backs up after, once known
        self._published = False
        self._cluster, self._watcher = cluster, None
        if cluster is not None:
            self._key = f"distgrad_BackupAndRestore_sigterm_{next(_fits)}"
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name="BackupAndRestore-sigterm")
            self._watcher.start()
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.signalled = True
        if callable(self.previous):
            self.previous(signum, frame)

    def _watch(self):
        """Watcher thread: wait for the agreed batch; acknowledge it."""
        value = _kv().get_config_key_value(self._key)
        if value == _STOP:
            return
        self._agreed = int(value)
        _kv().set_config_key_value(f"{self._key}_ack_{self._cluster[0]}", "1")

    def due(self, trained: int) -> bool:
        """At the end of trained batch number `trained` (counted from 1 in this fit):
        whether to back up now and exit."""
        if self._cluster is None:
            return self.signalled
        if self.signalled and not self._published:
            self._published = True
            self._publish(trained + 1)
        return self._agreed is not None and trained >= self._agreed

    def _publish(self, batch: int) -> None:
        kv = _kv()
        try:
            kv.set_config_key_value(self._key, str(batch))
        except tf.errors.AlreadyExistsError:
            return  # another worker was signalled first: its batch holds
        for worker in self._cluster[1]:  # every watcher has read it (this one's too)
            try:
                kv.get_config_key_value(f"{self._key}_ack_{worker}", ACK_TIMEOUT_MS)
            except tf.errors.OpError as error:
                sys.stderr.write(f"BackupAndRestore: worker {worker} did not acknowledge the "
                                 f"SIGTERM batch ({type(error).__name__}); going on.\n")

    def exit(self, message: str):
        """Restore the handler before, and exit with `PREEMPTED_EXIT_CODE`."""
        self._acted = True
        self._restore()
        sys.stderr.write(f"BackupAndRestore: SIGTERM: {message}; exiting with status "
                         f"{PREEMPTED_EXIT_CODE}.\n")
        sys.stderr.flush()
        sys.exit(PREEMPTED_EXIT_CODE)

    def close(self) -> None:
        """At fit's end: stop the watcher, restore the handler before, pass on a signal
        that was not acted on."""
        if self._watcher is not None:
            try:
                _kv().set_config_key_value(self._key, _STOP)
            except tf.errors.OpError:
                pass  # a batch was published (or a peer already stopped it)
            self._watcher.join(timeout=10)
        self._restore()
        if self.signalled and not self._acted and not callable(self.previous):
            signal.raise_signal(signal.SIGTERM)

    def _restore(self) -> None:
        if signal.getsignal(signal.SIGTERM) == self._handle:
            previous = signal.SIG_DFL if self.previous is None else self.previous  # (set in C)
            signal.signal(signal.SIGTERM, previous)


def _kv():
    from tensorflow.python.eager import context  # the key-value store: no public API

    return context.context()
