"""distgrad: gradient accumulation under `tf.distribute` that equals one big-batch step.

The reference classes, each in a file that imports only TensorFlow, Keras, NumPy and
the standard library (copy one into your project and it works alone):

* `AccumulatingOptimizer` (`distgrad/optimizer.py`): a Keras 3 optimizer wrapper, for
  `model.fit` and custom loops;
* `GradientAccumulator` (`distgrad/accumulator.py`): replica-local buffers for a custom
  loop, one all-reduce per update;
* `MicroBatching`, `MicroBatchingModel`, `with_micro_batches` (`distgrad/train_step.py`):
  k micro-batches inside one `fit` step;
* `AccumulationCallback` (`distgrad/callbacks.py`): in `fit`, flush or discard an
  `AccumulatingOptimizer`'s incomplete cycle at each epoch's end, and log skipped updates;
* `BackupAndRestore` (`distgrad/backup_and_restore.py`): `keras.callbacks.BackupAndRestore`
  that resumes an interrupted `fit` where its backup was taken (mid-epoch, mid-cycle, after
  a `SIGTERM`), where Keras 3's trains the interrupted epoch again; `ResumableFit`,
  `ResumableFitModel` (same file): a model whose `fit` hands it `fit`'s arguments;
* `MultiWorkerFit`, `MultiWorkerFitModel` (`distgrad/multi_worker.py`): `model.fit` on a
  multi-worker `MultiWorkerMirroredStrategy`, where stock Keras 3 fails;
* `distgrad.tf_keras.AccumulatingOptimizer` (`distgrad/tf_keras/optimizer.py`, TensorFlow
  only): `AccumulatingOptimizer` for tf-keras (Keras 2), imported where
  `TF_USE_LEGACY_KERAS=1` was set before TensorFlow.

`import distgrad` is enough to load a saved model (`keras.models.load_model`): it imports
TensorFlow and Keras and the modules of every class `model.save` can hold
(`AccumulatingOptimizer`, `AllReplicasFiniteLossScaleOptimizer`, `MicroBatchingModel`,
`MultiWorkerFitModel`, `ResumableFitModel`), which registers them with Keras. In a process that set
`TF_USE_LEGACY_KERAS=1` before importing TensorFlow (tf-keras, Keras 2), it registers
`distgrad.tf_keras.AccumulatingOptimizer` with tf-keras instead, and leaves Keras 3 alone.
The other names are imported when first used. The course (the lab, the pitfall
reproductions, the device setup) is a package of its own, `distgrad_course` (src/course).

On TensorFlow 2.15, whose `tf.keras` is its own Keras 2.15 and which has no Keras 3,
`import distgrad` registers `distgrad.tf_keras.AccumulatingOptimizer` too; there
`GradientAccumulator`, `distgrad.tf_keras.AccumulatingOptimizer` and the names that need
TensorFlow only work, and a name that needs Keras 3 raises an ImportError naming the fix.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os

__version__ = "0.2.0"

_EXPORTS = {
    "AccumulatingOptimizer": "distgrad.optimizer",
    "AccumulationCallback": "distgrad.callbacks",
    "BackupAndRestore": "distgrad.backup_and_restore",
    "PREEMPTED_EXIT_CODE": "distgrad.backup_and_restore",
    "ResumableFit": "distgrad.backup_and_restore",
    "ResumableFitModel": "distgrad.backup_and_restore",
    "GradientAccumulator": "distgrad.accumulator",
    "MicroBatching": "distgrad.train_step",
    "MicroBatchingModel": "distgrad.train_step",
    "with_micro_batches": "distgrad.train_step",
    "check_micro_batches": "distgrad.train_step",
    "MultiWorkerFit": "distgrad.multi_worker",
    "MultiWorkerFitModel": "distgrad.multi_worker",
    "check_multi_worker_input": "distgrad.multi_worker",
    "AllReplicasFiniteLossScaleOptimizer": "distgrad.mixed_precision",
    "clip_by_global_norm_across_replicas": "distgrad.clipping",
}

__all__ = sorted(_EXPORTS)

# The modules whose classes `model.save` can write: Keras finds a class at load time only
# if its module was imported (it imports only Keras' own modules by itself).
SAVEABLE_MODULES = ("distgrad.optimizer", "distgrad.mixed_precision", "distgrad.train_step",
                    "distgrad.multi_worker", "distgrad.backup_and_restore")
LEGACY_SAVEABLE_MODULES = ("distgrad.tf_keras.optimizer",)


# The names whose modules work without Keras 3 (TensorFlow 2.15, where `keras` is Keras 2).
KERAS_2_EXPORTS = {"GradientAccumulator", "clip_by_global_norm_across_replicas"}


def _uses_legacy_keras() -> bool:
    """What TensorFlow decides at import (tensorflow/python/util/lazy_loader.py): tf.keras
    is tf-keras if TF_USE_LEGACY_KERAS says so and tf-keras is installed."""
    return (os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")
            and importlib.util.find_spec("tf_keras") is not None)


def _keras_version() -> str:
    """The installed `keras` (3.x from TensorFlow >= 2.16, 2.15 from TensorFlow 2.15), read
    without importing it: importing Keras 2.15 into a tf-keras 2.15 process would make
    tf-keras deserialize optimizers as the `keras` package's classes."""
    try:
        return importlib.metadata.version("keras")
    except importlib.metadata.PackageNotFoundError:  # keras-nightly
        import keras

        return keras.__version__


def _keras_3() -> bool:
    return not _keras_version().startswith("2.")


# A tf-keras process does not import Keras 3 here (its classes are imported when used).
for _module in (LEGACY_SAVEABLE_MODULES if _uses_legacy_keras() or not _keras_3()
                else SAVEABLE_MODULES):
    importlib.import_module(_module)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'distgrad' has no attribute {name!r}")
    if name not in KERAS_2_EXPORTS and not _keras_3():
        instead = ("distgrad.tf_keras.AccumulatingOptimizer (tf.keras, Keras 2) in model.fit, "
                   "or distgrad.GradientAccumulator in a custom loop; or " if
                   name == "AccumulatingOptimizer" else "")
        raise ImportError(
            f"distgrad.{name} needs Keras 3 (TensorFlow >= 2.16), but keras is "
            f"{_keras_version()} here: use {instead}pip install -U 'tensorflow>=2.16' "
            "'keras>=3.10'.")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
