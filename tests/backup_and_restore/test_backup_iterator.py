"""`BackupAndRestore` saves the state of `fit`'s data iterator with each backup where
TensorFlow can (a `tf.data.Iterator`: one device, no strategy), so that a resume restores
the position instead of reading and dropping the batches the backup holds; elsewhere
(`tf.distribute` iterators, pipelines with state TensorFlow cannot save) it reads them.

Runs: `distgrad_course.lab.backup`'s (2 epochs of 8 or 12 global batches of 8,
`AccumulatingOptimizer(Adam, 3)`), with no strategy, or `MirroredStrategy` on 1 CPU.
"""

from __future__ import annotations

import json

import pytest
import tensorflow as tf

from distgrad.backup_and_restore import MANIFEST
from distgrad_course.lab import backup, object_store
from distgrad_course.lab.backup import assert_same_run
from distgrad_course.lab.child import run_child

NO_STRATEGY = tf.distribute.get_strategy()  # TensorFlow's default: one device
SCENARIO = {"kind": "accumulating", "save_freq": 1, "batches": 12}
KILLED_AT = 14  # as in test_backup_commit.py: batch 2 of epoch 1, mid-cycle
ONE_BACKUP = [
    ["copy", "ckpt-14.weights.h5"],
    ["copy", "ckpt-14.iterator"],  # the iterator's state, committed with the weights
    ["write", "training_metadata.json.tmp"],
    ["rename:copy", "training_metadata.json"],  # the commit point
    ["rename:remove", "training_metadata.json.tmp"],
    ["remove", "ckpt-13.weights.h5"],
    ["remove", "ckpt-13.iterator"],
]
COMMIT = 3
reads = []  # one entry per batch the pipeline below produces


def counted_data(saveable: bool = True) -> tf.data.Dataset:
    """lab.backup's 8 batches, each counted as the pipeline makes it (a Python side
    effect, which TensorFlow refuses to save unless told to ignore it)."""
    def count(x, y):
        tf.py_function(lambda: reads.append(1) or 0, [], tf.int32)
        return x, y

    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False  # no batch read ahead
    if saveable:
        options.experimental_external_state_policy = (
            tf.data.experimental.ExternalStatePolicy.IGNORE)
    return backup.dataset().map(count).with_options(options)


def stopped_then_resumed(strategy, directory, cut: int = 14, **options):
    """Stopped after `cut` batches (backup every 3: the last after 12, batch 4 of epoch 1),
    then resumed: the resumed run, and the batches the pipeline made for it."""
    with pytest.raises(backup.Preempted):
        backup.one_fit(strategy, str(directory), data=counted_data(**options),
                       stop=backup.Interrupt(cut))
    reads.clear()
    resumed = backup.one_fit(strategy, str(directory), data=counted_data(**options))
    return resumed, len(reads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return backup.one_fit(NO_STRATEGY, str(tmp_path_factory.mktemp("ref")),
                          data=counted_data())


def test_on_one_device_a_resume_restores_the_position_without_reading(reference, tmp_path):
    resumed, made = stopped_then_resumed(NO_STRATEGY, tmp_path / "b")
    assert_same_run(resumed, reference)
    assert made == 4  # epoch 1's batches 4-7: none of the 4 of it the backup holds


def test_under_a_strategy_the_batches_the_backup_holds_are_read_again(strategy1, tmp_path):
    with pytest.raises(ValueError, match="expecting iterator to be a trackable object"):  # TF 2.21
        tf.train.Checkpoint(iterator=iter(strategy1.experimental_distribute_dataset(
            backup.dataset())))
    resumed, made = stopped_then_resumed(strategy1, tmp_path / "b")
    assert made >= 4 + 4  # epoch 1 read from its first batch (and ahead: prefetched)
    assert_same_run(resumed, backup.one_fit(strategy1, str(tmp_path / "ref"),
                                            data=counted_data()))


def test_a_torn_iterator_state_is_read_past_with_a_warning(reference, tmp_path):
    with pytest.raises(backup.Preempted):
        backup.one_fit(NO_STRATEGY, str(tmp_path), data=counted_data(),
                       stop=backup.Interrupt(14))
    state = tmp_path / json.loads((tmp_path / MANIFEST).read_text())["attachments"][
        "iterator"]["name"]
    state.write_bytes(state.read_bytes()[:10])
    with pytest.warns(UserWarning, match="saved state cannot be restored .* the 4 batches "
                                         "the backup holds are read and dropped instead"):
        assert_same_run(backup.one_fit(NO_STRATEGY, str(tmp_path), data=counted_data()),
                        reference)


def test_a_pipeline_tensorflow_cannot_save_warns_once_and_resumes_by_reading(
        reference, tmp_path):
    with pytest.warns(UserWarning, match="EagerPyFunc is stateful") as record:
        resumed, made = stopped_then_resumed(NO_STRATEGY, tmp_path, saveable=False)
    assert sum("state cannot be saved" in str(w.message) for w in record) == 2  # per fit
    assert made == 4 + 4
    assert_same_run(resumed, reference)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ran = object_store.fit_under(NO_STRATEGY, str(tmp_path_factory.mktemp("ref") / "b"),
                                 **SCENARIO)
    return backup.FitResult(**ran["result"]), ran["log"]


def test_the_iterator_state_is_committed_with_the_weights(uninterrupted):
    _, log = uninterrupted
    assert [[op, name] for batch, op, name in log if batch == KILLED_AT] == ONE_BACKUP


@pytest.mark.parametrize("index", range(len(ONE_BACKUP)),
                         ids=[f"{op}-{name.split('.')[-1]}" for op, name in ONE_BACKUP])
def test_one_device_killed_at_every_operation_of_a_backup_resumes_exactly(
        uninterrupted, tmp_path, index):
    directory = tmp_path / "b"
    killed = run_child("distgrad_course.lab.object_store:fit_in_child",
                       {"backup_dir": str(directory), "kill_at": [KILLED_AT, index],
                        "replicas": 0, **SCENARIO}, timeout=240, check=False)
    assert killed.returncode == object_store.KILLED and not killed.ok, killed.stderr_tail
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["generation"] == KILLED_AT - (index <= COMMIT)
    resumed = object_store.fit_under(NO_STRATEGY, str(directory), **SCENARIO)
    assert_same_run(backup.FitResult(**resumed["result"]), uninterrupted[0])
