"""`BackupAndRestore`'s commit (its `BackupStore`) on emulated object storage: a process
killed at every file operation of a backup, on 1 worker and on 2, restarts into
the uninterrupted run; `double_checkpoint` falls back after a torn write; distgrad 0.2's
layout still restores.

The emulation (`distgrad_course.lab.object_store`) patches `tf.io.gfile`: a rename is a copy, then
a delete, as on GCS and S3, and the process ends with `os._exit` instead of doing the
chosen operation. The run is the issue's: `AccumulatingOptimizer(Adam, 3)`, 2 epochs of 12
global batches of 8 examples, `save_freq=1`, 2 replicas (`MirroredStrategy` on logical CPUs,
or 2 worker processes of one replica each).
"""

from __future__ import annotations

import json

import pytest

from distgrad.backup_and_restore import LEGACY_FORMAT, LEGACY_WEIGHTS, MANIFEST
from distgrad_course.lab import backup, object_store
from distgrad_course.lab.backup import assert_same_run
from distgrad_course.lab.child import run_child

SCENARIO = {"kind": "accumulating", "save_freq": 1, "batches": 12}
KILLED_AT = 14  # the backup after batch 14: batch 2 of epoch 1, mid-cycle (14 = 4 * 3 + 2)
ONE_BACKUP = [  # its operations under the emulation, in order
    ["copy", "ckpt-14.weights.h5"],  # the weights, under a new name
    ["write", "training_metadata.json.tmp"],  # the manifest naming them ...
    ["rename:copy", "training_metadata.json"],  # ... committed: one object written
    ["rename:remove", "training_metadata.json.tmp"],
    ["remove", "ckpt-13.weights.h5"],  # the previous backup, no longer named
]
COMMIT = 2  # the index of the commit point in ONE_BACKUP


@pytest.fixture(scope="module")
def uninterrupted(strategy2, tmp_path_factory):
    """The run with no kill, under the emulation: its `FitResult` and its operations."""
    ran = object_store.fit_under(strategy2, str(tmp_path_factory.mktemp("ref") / "b"),
                                 **SCENARIO)
    return backup.FitResult(**ran["result"]), ran["log"]


def test_a_backup_is_committed_by_writing_one_object(uninterrupted):
    _, log = uninterrupted
    assert [[op, name] for batch, op, name in log if batch == KILLED_AT] == ONE_BACKUP


def committed_generation(directory) -> int:
    return json.loads((directory / MANIFEST).read_text())["generation"]  # = batches: save_freq=1


@pytest.mark.parametrize("index", range(len(ONE_BACKUP)), ids=[op for op, _ in ONE_BACKUP])
def test_a_process_killed_at_every_operation_of_a_backup_resumes_exactly(
        strategy2, uninterrupted, tmp_path, index):
    directory = tmp_path / "b"
    killed = run_child("distgrad_course.lab.object_store:fit_in_child",
                       {"backup_dir": str(directory), "kill_at": [KILLED_AT, index], **SCENARIO},
                       timeout=240, check=False)
    assert killed.returncode == object_store.KILLED and not killed.ok, killed.stderr_tail
    assert committed_generation(directory) == KILLED_AT - (index <= COMMIT)
    resumed = object_store.fit_under(strategy2, str(directory), **SCENARIO)  # the restart
    assert_same_run(backup.FitResult(**resumed["result"]), uninterrupted[0])


@pytest.mark.parametrize("index", range(len(ONE_BACKUP)), ids=[op for op, _ in ONE_BACKUP])
def test_a_chief_killed_at_every_operation_of_a_backup_resumes_exactly_on_two_workers(
        uninterrupted, tmp_path, index):
    """The chief is killed (the other worker with it); the whole cluster restarts. The
    other worker writes nothing to the backup directory: its log is empty."""
    directory = tmp_path / "b"
    killed = object_store.run_cluster(backup_dir=str(directory), kill_at=[KILLED_AT, index],
                                      **SCENARIO)
    assert killed[0].returncode == object_store.KILLED, killed[0].stderr_tail
    assert not killed[1].ok
    assert committed_generation(directory) == KILLED_AT - (index <= COMMIT)
    restarted = [worker.check().value
                 for worker in object_store.run_cluster(backup_dir=str(directory), **SCENARIO)]
    for worker in restarted:
        assert_same_run(backup.FitResult(**worker["result"]), uninterrupted[0])
    assert restarted[0]["log"][-1][1:] == ["rmtree", "."] and restarted[1]["log"] == []


# ------------------------------------------------------------------ double_checkpoint

@pytest.mark.parametrize("damage", ["torn", "missing"])
def test_double_checkpoint_falls_back_to_the_previous_backup(
        strategy2, uninterrupted, tmp_path, collect_garbage, damage):
    with pytest.raises(backup.Preempted):
        backup.one_fit(strategy2, str(tmp_path), stop=backup.Interrupt(KILLED_AT),
                       double_checkpoint=True, **SCENARIO)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert (manifest["weights"], manifest["previous"]["weights"]) == (
        "ckpt-14.weights.h5", "ckpt-13.weights.h5")
    newest = tmp_path / manifest["weights"]
    if damage == "torn":  # an upload cut short
        newest.write_bytes(newest.read_bytes()[:manifest["weights_bytes"] // 2])
    else:
        newest.unlink()
    with pytest.warns(UserWarning, match="restoring the backup before it, ckpt-13.weights.h5"):
        resumed = backup.one_fit(strategy2, str(tmp_path), double_checkpoint=True, **SCENARIO)
    assert_same_run(resumed, uninterrupted[0])


def test_a_torn_backup_with_none_before_it_is_refused_by_name(strategy2, tmp_path,
                                                               collect_garbage):
    with pytest.raises(backup.Preempted):
        backup.one_fit(strategy2, str(tmp_path), stop=backup.Interrupt(3), **SCENARIO)
    newest = tmp_path / "ckpt-3.weights.h5"
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"ckpt-3.weights.h5 has 100 bytes, not the \d+ its "
                                         r"manifest recorded \(a torn write\)\. No backup "
                                         r"before it is kept \(double_checkpoint=True"):
        backup.one_fit(strategy2, str(tmp_path), **SCENARIO)


# ------------------------------------------------------------------ distgrad 0.2's layout

def test_a_backup_of_distgrad_0_2_resumes_exactly_and_is_replaced(
        strategy2, uninterrupted, tmp_path, collect_garbage):
    """distgrad 0.2 wrote `latest.weights.h5` and a `training_metadata.json` of format /1
    with the same fields: made here from a backup after batch 14."""
    with pytest.raises(backup.Preempted):
        backup.one_fit(strategy2, str(tmp_path), stop=backup.Interrupt(KILLED_AT), **SCENARIO)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    (tmp_path / manifest["weights"]).rename(tmp_path / LEGACY_WEIGHTS)
    for name in ("generation", "weights", "weights_bytes"):
        del manifest[name]
    (tmp_path / MANIFEST).write_text(json.dumps({**manifest, "format": LEGACY_FORMAT}))
    resumed = object_store.fit_under(strategy2, str(tmp_path), **SCENARIO)
    assert_same_run(backup.FitResult(**resumed["result"]), uninterrupted[0])
    # replaced at the restart's first commit: after its 3rd batch (epoch 1 from batch 0)
    assert [3, "remove", LEGACY_WEIGHTS] in resumed["log"]
