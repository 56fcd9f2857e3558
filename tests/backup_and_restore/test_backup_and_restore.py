"""`distgrad.BackupAndRestore`: an interrupted `fit`, run again, equals one that was
never interrupted; Keras 3's own callback replays the interrupted epoch.

Lesson 08 runs (and asserts) what is not repeated here: the restart of a 2-worker cluster
after a SIGKILL, the bytes a mid-cycle backup holds, tf-keras' resume on other batches.
`tests/backup_and_restore/test_backup_commit.py` kills the process at every file operation
of a backup.

The runs (`distgrad_course.lab.backup`): 2 epochs of 8 global batches of 8 examples, a `tf.data`
pipeline, 2 replicas (`MirroredStrategy` on logical CPUs, or 2 worker processes);
"accumulating" is `AccumulatingOptimizer(Adam, 3)`, so a cycle straddles each epoch's end.
An interruption is `Preempted` raised after `cut` batches (counted across epochs), or a
real SIGKILL of the process; the job then starts again with a fresh model and the same
`fit` call.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import warnings

import keras
import pytest
import tensorflow as tf

from distgrad.backup_and_restore import MANIFEST as METADATA_FILE
from distgrad.backup_and_restore import BackupAndRestore
from distgrad_course.lab import backup
from distgrad_course.lab.backup import assert_same_run
from distgrad_course.lab.child import run_child
from distgrad_course.lab.compare import weight_diff


@pytest.fixture(scope="module")
def references(strategy2, tmp_path_factory):
    """Uninterrupted runs, per (kind, save_freq, steps_per_epoch)."""
    cache = {}

    def reference(kind="accumulating", save_freq=3, steps_per_epoch=None, data=None):
        key = (kind, save_freq, steps_per_epoch, data is not None)
        if key not in cache:
            cache[key] = backup.one_fit(strategy2, str(tmp_path_factory.mktemp("ref")), kind=kind,
                                        save_freq=save_freq, steps_per_epoch=steps_per_epoch,
                                        data=data)
        return cache[key]

    return reference


# ------------------------------------------------------------------ Keras 3's own callback

@pytest.mark.parametrize("kind, cut, save_freq, updates, expected_updates", [
    ("adam", 6, 3, 22, 16),  # backup after batch 6: epoch 0 runs its 6 batches again
    ("accumulating", 6, 3, 7, 5),
    ("accumulating", 10, 4, 8, 5),  # backup after 8 + ... : epoch 1 replays from batch 0
])
def test_keras_backup_and_restore_replays_the_interrupted_epoch(
        strategy2, references, tmp_path, kind, cut, save_freq, updates, expected_updates):
    expected = references(kind, save_freq)
    got = backup.interrupted_fit(strategy2, str(tmp_path), cut, kind=kind, callback="keras",
                                 save_freq=save_freq)
    assert (expected.updates, got.updates) == (expected_updates, updates)
    assert weight_diff(got.weights, expected.weights).max_abs > 1e-3


def test_keras_writes_the_batch_of_its_backup(strategy2, tmp_path):
    with pytest.raises(backup.Preempted):
        backup.one_fit(strategy2, str(tmp_path), kind="adam", callback="keras", save_freq=3,
                       stop=backup.Interrupt(6))
    assert json.loads((tmp_path / METADATA_FILE).read_text()) == {"epoch": 0, "batch": 5}


def test_keras_backs_up_a_resumed_epoch_as_epoch_0(strategy2, tmp_path):
    """A second interruption (docs/upstream.md): a new Keras callback counts epochs from 0
    until its first epoch ends, so its backups inside resumed epoch 1 say epoch 0."""
    with pytest.raises(backup.Preempted):  # backup after 9 batches: epoch 1, batch index 0
        backup.one_fit(strategy2, str(tmp_path), kind="adam", callback="keras",
                       stop=backup.Interrupt(10))
    assert json.loads((tmp_path / METADATA_FILE).read_text()) == {"epoch": 1, "batch": 0}
    with pytest.raises(backup.Preempted):  # resumes epoch 1 at batch 0; backup after 3
        backup.one_fit(strategy2, str(tmp_path), kind="adam", callback="keras",
                       stop=backup.Interrupt(4))
    assert json.loads((tmp_path / METADATA_FILE).read_text()) == {"epoch": 0, "batch": 2}


# ------------------------------------------------------------------ distgrad's callback

class KeepEveryBackup(keras.callbacks.Callback):
    """After each batch, copy the backup directory: with `save_freq=1` the copy after batch
    n is what a job interrupted after batch n leaves behind."""

    def __init__(self, backup_dir, copies):
        super().__init__()
        self.backup_dir, self.copies, self.seen = backup_dir, copies, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        shutil.copytree(self.backup_dir, os.path.join(self.copies, f"cut{self.seen}"))


def test_an_interrupted_fit_resumes_exactly_at_every_cut_point(strategy2, references, tmp_path):
    """Every batch of both epochs: mid-cycle, right after an update, at the epoch's end with
    a cycle carried over into the next, after the very last batch (cut 15 of 16)."""
    live, copies = str(tmp_path / "live"), str(tmp_path / "copies")
    backup.one_fit(strategy2, live, save_freq=1, stop=KeepEveryBackup(live, copies))
    expected = references("accumulating", 1)
    for cut in range(1, backup.EPOCHS * backup.BATCHES):
        assert_same_run(backup.one_fit(strategy2, os.path.join(copies, f"cut{cut}"),
                                       save_freq=1), expected)


@pytest.mark.parametrize("cut", [2, 8, 13])  # before the 1st backup; epoch 0's end; epoch 1
def test_batches_after_the_last_backup_are_trained_again_once(strategy2, references, tmp_path,
                                                               cut):
    assert_same_run(backup.interrupted_fit(strategy2, str(tmp_path), cut, save_freq=3),
                    references("accumulating", 3))


@pytest.mark.parametrize("kind, cut, save_freq, steps_per_epoch", [
    ("adam", 6, 3, None),  # the case: Keras 3 makes 22 updates of 16
    ("micro_batching", 5, 2, None),
    ("mixed", 10, 4, None),  # loss scale and skipped micro-batch restored
    ("accumulating", 11, 3, backup.BATCHES),  # steps_per_epoch: one iterator for all epochs
    ("accumulating", 8, "epoch", None),
])
def test_every_kind_resumes_exactly(strategy2, references, tmp_path, kind, cut, save_freq,
                                    steps_per_epoch):
    expected = references(kind, save_freq, steps_per_epoch)
    got = backup.interrupted_fit(strategy2, str(tmp_path), cut, kind=kind, save_freq=save_freq,
                                 steps_per_epoch=steps_per_epoch)
    assert_same_run(got, expected)


@pytest.mark.parametrize("data_batches, repeat", [(12, True), (2 * backup.BATCHES, False)])
def test_an_epoch_end_backup_resumes_where_one_iterator_reads_on(strategy2, tmp_path,
                                                                 data_batches, repeat):
    """fit(steps_per_epoch=8): Keras reads one iterator across epochs, over 12 batches
    repeated or 16 read over both epochs. Stopped after batch 1 of epoch 1, the backup after
    epoch 0 resumes at the iterator's batch 8, not a new iterator's batch 0 (which it does
    without fit's arguments: the test's second half)."""
    options = {"save_freq": "epoch", "steps_per_epoch": backup.BATCHES,
               "data": backup.dataset(data_batches, repeat=repeat)}
    expected = backup.one_fit(strategy2, str(tmp_path / "ref"), **options)
    cut = backup.BATCHES + 1
    assert_same_run(backup.interrupted_fit(strategy2, str(tmp_path / "b"), cut, **options),
                    expected)
    with pytest.warns(UserWarning, match="was not given fit's arguments"):
        blind = backup.interrupted_fit(strategy2, str(tmp_path / "c"), cut, resumable=False,
                                       **options)
    assert weight_diff(blind.weights, expected.weights).max_abs > 1e-3


def test_without_fit_arguments_it_warns_once_per_fit_and_resumes_exactly(
        strategy2, references, tmp_path):
    """A plain Keras model: BackupAndRestore cannot see fit's data (Keras hands callbacks
    none): one warning per fit naming the fix; a mid-epoch resume is still exact."""
    with pytest.warns(UserWarning) as record:
        got = backup.interrupted_fit(strategy2, str(tmp_path), 11, resumable=False)
    warned = [str(w.message) for w in record if "was not given fit's arguments" in str(w.message)]
    assert len(warned) == 2 and "distgrad.ResumableFitModel(inputs, outputs)" in warned[0]
    assert_same_run(got, references("accumulating", 3))


def test_no_reference_file_reads_stack_frames():
    """Keras hands callbacks no data: it comes through `ResumableFit`, not `fit`'s frames."""
    source = pathlib.Path(backup.__file__).parents[1]
    for path in source.glob("*.py"):
        text = path.read_text()
        assert "_getframe" not in text and "f_locals" not in text, path.name


def test_a_seeded_dropout_layer_does_not_resume_exactly(strategy2, references, tmp_path):
    """A limit: the Dropout layer's seed generator state is a layer variable but not one of
    the model's weights, so `save_weights` leaves it out; the restart draws other masks."""
    model = backup.build(strategy2, "dropout")
    dropout = next(layer for layer in model.layers if isinstance(layer, keras.layers.Dropout))
    assert [v.path for v in dropout.variables] == ["seed_generator/seed_generator_state"]
    assert not dropout.weights
    expected = references("dropout", 3)
    got = backup.interrupted_fit(strategy2, str(tmp_path), 10, kind="dropout")
    assert got.updates == expected.updates == 5
    assert weight_diff(got.weights, expected.weights).max_abs > 1e-3


def test_a_seeded_shuffle_that_does_not_reshuffle_resumes_exactly(strategy2, references,
                                                                   tmp_path):
    data = backup.dataset(shuffle_seed=7)
    expected = references("accumulating", 3, data=data)
    got = backup.interrupted_fit(strategy2, str(tmp_path), 11, data=data)
    assert_same_run(got, expected)
    assert expected.weights[0].tolist() != references("accumulating", 3).weights[0].tolist()


def stopped_at_each(strategy, directory, cuts) -> tuple[int, int]:
    """Start the job once per cut, each start stopped after that many batches (read and
    dropped ones included); the (epoch, batches done) of the backup left behind."""
    for cut in cuts:
        with pytest.raises(backup.Preempted):
            backup.one_fit(strategy, str(directory), stop=backup.Interrupt(cut))
    metadata = json.loads((directory / METADATA_FILE).read_text())
    return metadata["epoch"], metadata["batches_done"]


def test_a_fit_interrupted_twice_resumes_exactly(strategy2, references, tmp_path):
    """The second interruption falls in epoch 1 of the resumed fit: its backups must say
    epoch 1 (Keras 3's own callback writes epoch 0 there: it counts from 0 again)."""
    # After 5 batches (backup: 3); then 11 batches, 3 of them read and dropped: the restart
    # stops after batch 2 of epoch 1, its last backup after 9 batches, batch 1 of epoch 1.
    assert stopped_at_each(strategy2, tmp_path, (5, 11)) == (1, 1)
    assert_same_run(backup.one_fit(strategy2, str(tmp_path)), references("accumulating", 3))


def test_no_backup_is_taken_while_the_backed_up_batches_are_skipped(strategy2, references,
                                                                    tmp_path):
    """The backup after batch 12 holds batch 4 of epoch 1. Its restart reads and drops
    batches 0-3 of epoch 1 and is interrupted there: a backup taken while dropping would
    record 3 batches for weights that hold 4, and the third start would train batch 3 twice.
    """
    assert stopped_at_each(strategy2, tmp_path, (13, 4)) == (1, 4)
    assert_same_run(backup.one_fit(strategy2, str(tmp_path)), references("accumulating", 3))


def test_the_backup_is_deleted_when_fit_ends(strategy2, tmp_path):
    backup.one_fit(strategy2, str(tmp_path / "b"))
    assert not (tmp_path / "b").exists()


def test_a_fresh_process_killed_mid_cycle_resumes_exactly(references, tmp_path):
    """A real fault: the first process SIGKILLs itself after batch 10 (last backup: 9)."""
    options = {"backup_dir": str(tmp_path), "kind": "accumulating", "save_freq": 3}
    killed = run_child("distgrad_course.lab.backup:fit_in_child", {**options, "kill_after": 10},
                       timeout=240, check=False)
    assert killed.returncode == -9 and not killed.ok
    metadata = json.loads((tmp_path / METADATA_FILE).read_text())
    assert (metadata["epoch"], metadata["batches_done"]) == (1, 1)  # 9 = 8 + 1 batches
    resumed = run_child("distgrad_course.lab.backup:fit_in_child", options, timeout=240).value
    assert_same_run(backup.FitResult(**resumed), references("accumulating", 3))


# ------------------------------------------------------------------ data it cannot resume

def _fit_arrays(strategy, tmp_path, save_freq, **fit_options):
    model = backup.build(strategy, "adam")
    x, y = backup.examples()
    model.fit(x, y, batch_size=backup.GLOBAL_BATCH, verbose=0,
              callbacks=[BackupAndRestore(str(tmp_path), save_freq=save_freq)], **fit_options)
    return model


@pytest.mark.parametrize("make_data, fragment", [
    (lambda: tf.random.set_seed(None) or backup.dataset().unbatch().shuffle(64).batch(8),
     "ShuffleDatasetV3 without a seed"),  # (an earlier test's global seed would seed it)
    (lambda: backup.dataset().unbatch().shuffle(64, seed=1).batch(8),
     "ShuffleDatasetV3 with reshuffle_each_iteration=True"),
])
def test_a_dataset_whose_order_cannot_repeat_is_refused_at_fit_start(strategy2, tmp_path,
                                                                     make_data, fragment):
    model = backup.build(strategy2, "adam")
    with pytest.raises(ValueError, match="resumes mid-epoch by skipping") as error:
        model.fit(make_data(), epochs=2, verbose=0,
                  callbacks=[BackupAndRestore(str(tmp_path), save_freq=3)])
    assert fragment in str(error.value) and "reshuffle_each_iteration=False" in str(error.value)
    assert int(model.optimizer.iterations.numpy()) == 0  # refused before the first step


def test_fit_shuffling_arrays_is_refused_mid_epoch_and_warned_at_epoch_ends(strategy2,
                                                                            tmp_path):
    with pytest.raises(ValueError, match=r"fit\(shuffle=True\) shuffles the arrays"):
        _fit_arrays(strategy2, tmp_path / "a", 3)  # Keras' default: shuffle=True
    with pytest.warns(UserWarning, match=r"fit\(shuffle=True\) shuffles the arrays"):
        _fit_arrays(strategy2, tmp_path / "b", "epoch")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (Keras' save_weights: DeprecationWarning)
        _fit_arrays(strategy2, tmp_path / "c", 3, shuffle=False)


def test_a_generator_is_warned_about(strategy2, tmp_path):
    x, y = backup.examples()

    def batches():
        for i in range(0, len(x), backup.GLOBAL_BATCH):
            yield x[i:i + backup.GLOBAL_BATCH], y[i:i + backup.GLOBAL_BATCH]

    model = backup.build(strategy2, "adam")
    with pytest.warns(UserWarning, match="order of a Python generator cannot be inspected"):
        model.fit(batches(), verbose=0, callbacks=[BackupAndRestore(str(tmp_path), save_freq=3)])


def test_other_data_than_the_backup_is_refused(strategy2, tmp_path):
    with pytest.raises(backup.Preempted):
        backup.one_fit(strategy2, str(tmp_path), stop=backup.Interrupt(5))
    with pytest.raises(ValueError, match="taken with 8 batches per epoch, this fit has 4"):
        backup.one_fit(strategy2, str(tmp_path), data=backup.dataset(batches=4))


@pytest.mark.parametrize("save_freq", [False, 0, "batch", 2.5])
def test_bad_save_freq_names_the_choices(save_freq):
    with pytest.raises(ValueError, match="save_freq must be 'epoch' or an integer >= 1"):
        BackupAndRestore("/tmp/unused", save_freq=save_freq)


# ------------------------------------------------------------------ the files

def test_a_keras_backup_resumes_at_its_epoch_start_with_a_warning(strategy2, tmp_path):
    with pytest.raises(backup.Preempted):
        backup.one_fit(strategy2, str(tmp_path), kind="adam", callback="keras",
                       stop=backup.Interrupt(6))
    with pytest.warns(UserWarning, match="written by keras.callbacks.BackupAndRestore"):
        resumed = backup.one_fit(strategy2, str(tmp_path), kind="adam")
    assert resumed.updates == 22  # what Keras' own callback gives


def test_a_resumed_fit_leaves_no_initial_epoch_behind(strategy2, tmp_path):
    with pytest.raises(backup.Preempted):
        backup.one_fit(strategy2, str(tmp_path), stop=backup.Interrupt(10))
    model = backup.build(strategy2)
    model.fit(backup.dataset(), epochs=2, verbose=0, shuffle=False,
              callbacks=[BackupAndRestore(str(tmp_path), save_freq=3)])
    history = model.fit(backup.dataset(), epochs=1, verbose=0, shuffle=False)
    assert len(history.history["loss"]) == 1 and model._initial_epoch is None
    assert not os.path.exists(tmp_path)


def test_a_stopped_fits_iterator_is_freed_by_a_collection_after_the_except_not_inside():
    """Why lesson 08 and `backup.one_fit` collect after the `except` block: inside it, the
    exception's traceback still holds the fit's frames, and so its data iterator."""
    import gc

    from tensorflow.python.data.ops.iterator_ops import OwnedIterator

    def alive() -> int:
        return sum(isinstance(o, OwnedIterator) for o in gc.get_objects())

    gc.collect()
    before = alive()
    try:
        backup.build(tf.distribute.get_strategy(), "adam").fit(
            backup.dataset(), epochs=2, verbose=0, callbacks=[backup.Interrupt(3)])
    except backup.Preempted:
        gc.collect()
        inside = alive()
    gc.collect()
    assert (inside - before, alive() - before) == (1, 0)
