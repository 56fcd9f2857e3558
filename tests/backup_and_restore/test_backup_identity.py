"""`BackupAndRestore` records the run's identity in every backup's manifest (run id,
`accumulation_steps`, the optimizer's class chain and variable layout, the global batch,
replicas, workers) and refuses, before anything trains, a restart whose identity differs,
by name. The same setup, another replica count with the same global batch, and a backup
written before these fields, resume exactly. (2 workers to 1: `test_backup_sigterm.py`.)

Runs: `distgrad_course.lab.backup`'s one-replica `fit` (2 epochs of 8 batches, `save_freq=1`),
stopped after 3 batches, then run again.
"""

from __future__ import annotations

import json

import pytest

from distgrad.backup_and_restore import IDENTITY_FIELDS, MANIFEST
from distgrad_course.lab import backup
from distgrad_course.lab.backup import assert_same_run

STOP = 3


@pytest.fixture(autouse=True)
def no_slurm_job(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def stopped_fit(strategy, directory, **options) -> None:
    with pytest.raises(backup.Preempted):
        backup.one_fit(strategy, str(directory), save_freq=1, stop=backup.Interrupt(STOP),
                       **options)


def refused(strategy, directory, match: str, **options) -> None:
    """The restart raises naming `match` and how to start over, and leaves the backup."""
    before = (directory / MANIFEST).read_text()
    with pytest.raises(ValueError, match=match) as raised:
        backup.one_fit(strategy, str(directory), save_freq=1, **options)
    assert str(raised.value).startswith(  # the fix first, then what differs
        f"BackupAndRestore: to resume the backup in {directory}, run with the setup it "
        f"recorded (and its run id: BackupAndRestore(run_id=...) or SLURM_JOB_ID); to start "
        f"over, pass a new backup_dir, or delete {directory}. It belongs to another run")
    assert (directory / MANIFEST).read_text() == before


def test_another_accumulation_steps_is_refused_naming_both(
        strategy1, tmp_path, monkeypatch, collect_garbage):
    stopped_fit(strategy1, tmp_path)
    monkeypatch.setattr(backup, "ACCUMULATION_STEPS", 4)
    refused(strategy1, tmp_path, r"accumulation_steps: 3 \(recorded\) vs 4 now")


def test_another_optimizer_setup_is_refused(strategy1, tmp_path, collect_garbage):
    stopped_fit(strategy1, tmp_path, kind="accumulating")
    refused(strategy1, tmp_path, r"accumulation_steps: 3 \(recorded\) vs None now; optimizer: "
            r"'AccumulatingOptimizer > Adam' \(recorded\) vs 'Adam' now; optimizer_variables: "
            r"17 variables \(recorded\) vs 10 now", kind="adam")


@pytest.mark.parametrize("given", ["argument", "SLURM_JOB_ID"])
def test_another_run_id_is_refused(strategy1, tmp_path, monkeypatch, collect_garbage, given):
    stopped_fit(strategy1, tmp_path, run_id="job-1")
    if given == "argument":
        options = {"run_id": "job-2"}
    else:
        monkeypatch.setenv("SLURM_JOB_ID", "job-2")
        options = {}
    refused(strategy1, tmp_path, r"run_id: 'job-1' \(recorded\) vs 'job-2' now", **options)


@pytest.mark.parametrize("backup_from", ["this version", "before the identity fields"])
def test_the_same_setup_resumes_exactly(strategy1, tmp_path, collect_garbage, backup_from):
    expected = backup.one_fit(strategy1, str(tmp_path / "ref"), save_freq=1)
    directory = tmp_path / "b"
    stopped_fit(strategy1, directory)
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["run_id"]  # the first backup's own
    assert (manifest["accumulation_steps"], manifest["replicas"], manifest["workers"],
            manifest["optimizer"], manifest["global_batch"]) == (
        3, 1, 1, "AccumulatingOptimizer > Adam", backup.GLOBAL_BATCH)
    assert manifest["optimizer_variables"][:2] == [["iteration", []],
                                                   ["<weight 0>_accumulated_gradient", [4, 8]]]
    if backup_from != "this version":
        for record in (manifest, manifest.get("previous") or {}):
            for field in IDENTITY_FIELDS:
                record.pop(field, None)
        (directory / MANIFEST).write_text(json.dumps(manifest))
    assert_same_run(backup.one_fit(strategy1, str(directory), save_freq=1), expected)


def test_another_replica_count_with_the_same_global_batch_resumes_exactly(
        strategy1, strategy2, tmp_path, collect_garbage):
    """2 replicas stopped after 3 batches, resumed on 1: the accumulators' sums are read
    as the SUM over replicas and restored as SUM / R, so the next update is the same."""
    expected = backup.one_fit(strategy2, str(tmp_path / "ref"), save_freq=1)
    stopped_fit(strategy2, tmp_path / "b")
    assert_same_run(backup.one_fit(strategy1, str(tmp_path / "b"), save_freq=1), expected)


def test_another_replica_count_with_another_or_unknown_global_batch_is_refused(
        strategy1, strategy2, tmp_path, collect_garbage):
    stopped_fit(strategy2, tmp_path)
    half = backup.dataset(backup.BATCHES * 2, backup.GLOBAL_BATCH // 2)
    refused(strategy1, tmp_path, r"global_batch: 8 \(recorded\) vs 4 now; replicas: 2 "
            r"\(recorded\) vs 1 now, and the global batch is 8 \(recorded\) vs 4 now: another "
            r"worker or replica count resumes exactly only with the same global batch",
            data=half)
    with pytest.warns(UserWarning, match="was not given fit's arguments"):
        refused(strategy1, tmp_path, r"replicas: 2 \(recorded\) vs 1 now, and the global "
                r"batch is 8 \(recorded\) vs None now", resumable=False)
