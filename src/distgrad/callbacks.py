"""`AccumulationCallback`: the incomplete cycle at an epoch's end, in `model.fit`.

    model.fit(x, y, epochs=3, callbacks=[AccumulationCallback("flush")])

An epoch of n micro-batches leaves n mod k of them accumulated and not applied. By
default they stay (the optimizer carries them into the next epoch, whose first
micro-batches complete the cycle); this callback can apply them (`flush`) or drop them
(`discard`), and puts the optimizer's `skipped_updates` into the epoch's logs.

(Exact resume after a preemption: `BackupAndRestore`, in `backup_and_restore.py`.)

This file imports only Keras and the standard library: copy it into a project and use it
alone. `AccumulationCallback` drives any
optimizer with `flush()`, `discard()` and `skipped_updates` (distgrad's
`AccumulatingOptimizer`), also inside a `LossScaleOptimizer`. In a custom loop, call
`optimizer.flush()` or `optimizer.discard()` yourself after the epoch.
"""

from __future__ import annotations

import keras

__all__ = ["AccumulationCallback", "accumulating_optimizer_of"]

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

    Example:

    ```python
    # k = 4 and 10 batches an epoch: each epoch ends with 2 batches, applied as an update.
    history = model.fit(dataset.batch(32), epochs=3,
                        callbacks=[AccumulationCallback("flush")])
    history.history["skipped_updates"]  # one count per epoch
    ```

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
