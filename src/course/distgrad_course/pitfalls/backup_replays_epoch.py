"""Pitfall: Keras 3's `BackupAndRestore(save_freq=n)` trains the interrupted epoch again.

A `fit` of 2 epochs of 8 batches with a backup every `save_freq` batches is interrupted
after `cut` batches and run again with a fresh model, as a restarted job would: once with
`keras.callbacks.BackupAndRestore`, once with `distgrad.BackupAndRestore`
(`distgrad_course.lab.backup.timeline` runs and records each). Keras' callback restores the
backup's weights and its epoch, not its batch: the epoch starts over from batch 0, and
the batches already in the weights are trained a second time.
"""

from __future__ import annotations

import dataclasses
import tempfile

from distgrad_course.lab.backup import Timeline, timeline


@dataclasses.dataclass(frozen=True)
class Replay:
    """Both restarts, and the batches Keras' restart trained that its backup already held
    (each an update made twice)."""

    keras: Timeline
    distgrad: Timeline
    trained_twice: list


def reproduce(strategy, cut: int = 7, save_freq: int = 3, kind: str = "adam",
              directory: str | None = None) -> Replay:
    """Run the interrupted job with each callback under `strategy`; `directory` holds the
    backups (a new temporary directory if None)."""
    directory = directory or tempfile.mkdtemp()
    runs = {name: timeline(strategy, directory, name, cut=cut, save_freq=save_freq, kind=kind)
            for name in ("keras", "distgrad")}
    in_backup = set(range(max(runs["keras"].backups, default=0)))
    return Replay(keras=runs["keras"], distgrad=runs["distgrad"],
                  trained_twice=[i for i in runs["keras"].resumed_trained if i in in_backup])
