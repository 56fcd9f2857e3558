"""The Examples in the reference classes' docstrings (what the API page shows), run as
written: the names they leave to the reader (`strategy`, `make_model`, `dataset`,
`inputs`, `outputs`) are defined here, and each run is checked by its update count."""

from __future__ import annotations

import re
import textwrap

import keras
import numpy as np
import tensorflow as tf

import distgrad
from distgrad import backup_and_restore, callbacks, optimizer

BATCHES, BATCH, K = 10, 32, 4  # the Examples' 10 batches of 32 an epoch, k = 4


def example(cls) -> str:
    (code,) = re.findall(r"```python\n(.*?)```", cls.__doc__, re.DOTALL)
    return textwrap.dedent(code)


def names(strategy) -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCHES * BATCH, 4)).astype("float32")
    y = x @ rng.normal(size=(4, 1)).astype("float32")
    inputs = keras.Input((4,))
    return {"keras": keras, "tf": tf, "strategy": strategy,
            **{name: getattr(distgrad, name) for name in (
                "AccumulatingOptimizer", "AccumulationCallback", "BackupAndRestore",
                "ResumableFitModel")},
            "make_model": lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
            "dataset": tf.data.Dataset.from_tensor_slices((x, y)),
            "inputs": inputs, "outputs": keras.layers.Dense(1)(inputs)}


def test_the_accumulating_optimizer_example_makes_three_updates_an_epoch(strategy2):
    run = names(strategy2)
    exec(example(optimizer.AccumulatingOptimizer), run)
    # 10 batches: 2 full cycles, then the open one flushed, in each of 3 epochs.
    assert run["model"].optimizer.iterations.numpy() == 3 * 3


def test_the_accumulation_callback_example_logs_a_count_per_epoch(strategy2):
    run = names(strategy2)
    with strategy2.scope():
        run["model"] = run["make_model"]()
        run["model"].compile(optimizer=distgrad.AccumulatingOptimizer(
            keras.optimizers.SGD(0.1), K), loss="mse")
    exec(example(callbacks.AccumulationCallback), run)
    assert run["history"].history["skipped_updates"] == [0, 0, 0]
    assert run["model"].optimizer.iterations.numpy() == 3 * 3


def test_the_backup_and_restore_example_runs_with_a_local_directory(tmp_path):
    code = example(backup_and_restore.BackupAndRestore)
    assert '"gs://bucket/run"' in code
    run = names(tf.distribute.get_strategy())
    exec(code.replace('"gs://bucket/run"', repr(str(tmp_path / "run"))), run)
    assert run["model"].optimizer.iterations.numpy() == 10 * BATCHES // K  # carried on
    assert not (tmp_path / "run").exists()  # delete_checkpoint: gone after a whole fit
