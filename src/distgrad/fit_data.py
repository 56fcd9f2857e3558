"""What `BackupAndRestore` must know of `fit`'s data, taken from `fit`'s own arguments.

    class MyModel(ResumableFit, keras.Model): ...       # subclassed models
    model = ResumableFitModel(inputs, outputs)           # functional
    model.fit(dataset, epochs=3, callbacks=[BackupAndRestore("/backup", save_freq=50)])

Keras hands callbacks neither `fit`'s data nor its arguments. `ResumableFit.fit` hands
its arguments to each callback in `callbacks` that has `set_fit_arguments` (distgrad's
`BackupAndRestore`), then runs Keras' `fit` unchanged. Without the mixin, call
`callback.set_fit_arguments(x, ...)` with `fit`'s arguments before each `fit`.

`describe_fit_data(...)` says, from those arguments alone:

* whether the data comes in the same order when `fit` starts again (a resumed epoch skips
  the batches its backup holds: right only if they are the same batches);
* the global batch (a restart on another number of workers resumes exactly only with it);
* when Keras starts a new iterator over the data: every epoch, or, with
  `fit(steps_per_epoch=...)`, only when the data's own batches run out.

`save_iterator_state` and `restore_iterator_state` keep the position of the iterator
`fit` reads where TensorFlow can save it (one device, no strategy).

This file imports only TensorFlow, Keras and the standard library: copy it with
`backup_and_restore.py`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import tempfile
import zipfile

import keras
import tensorflow as tf

__all__ = ["DATA_ORDER_FIX", "FitData", "ResumableFit", "ResumableFitModel", "describe_fit_data",
           "restore_iterator_state", "save_iterator_state"]

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
