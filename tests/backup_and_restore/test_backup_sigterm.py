"""`BackupAndRestore` on `SIGTERM` (`SigtermWatch`): a real `SIGTERM` to one worker of
two, and to a one-process `fit`; each finishes the batch, backs up after the same batch on
every worker, exits with `PREEMPTED_EXIT_CODE`, and the restart equals the uninterrupted run.

The run (`distgrad_course.lab.backup`): `AccumulatingOptimizer(Adam, 3)`, 2 epochs of 8 global
batches, `save_freq="epoch"` (the default: without the handler a `SIGTERM` loses the
epoch), 2 replicas (`MirroredStrategy` on logical CPUs, or 2 worker processes). The signal
is sent by the process to itself (`TermSelf`) at the end of batch 5, after the backup
callback has seen that batch: the batch then running is batch 6.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from distgrad.backup_and_restore import (
    MANIFEST,
    PREEMPTED_EXIT_CODE,
    BackupAndRestore,
    SigtermWatch,
)
from distgrad_course.lab import backup
from distgrad_course.lab.backup import assert_same_run
from distgrad_course.lab.local_cluster import run_workers

SIGNALLED_AFTER = 5
SCENARIO = {"kind": "accumulating", "save_freq": "epoch"}


@pytest.fixture(scope="module")
def uninterrupted(strategy2, tmp_path_factory):
    return backup.one_fit(strategy2, str(tmp_path_factory.mktemp("ref")), **SCENARIO)


@pytest.fixture
def user_handler():
    """A SIGTERM handler of the user's, installed before fit (the test process' own
    handler is back after the test)."""
    calls = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    yield signal.getsignal(signal.SIGTERM), calls
    signal.signal(signal.SIGTERM, before)


def backed_up(directory) -> tuple[int, int]:
    manifest = json.loads((directory / MANIFEST).read_text())
    return manifest["epoch"], manifest["batches_done"]


def test_a_sigterm_to_one_worker_of_two_backs_up_both_after_one_batch_and_resumes_exactly(
        uninterrupted, tmp_path):
    """Worker 1 is signalled after batch 5; at the end of batch 6 it publishes batch 7
    (worker 0 may have started it): both back up after batch 7 and exit with 42."""
    options = {"backup_dir": str(tmp_path), **SCENARIO}
    stopped = run_workers("distgrad_course.lab.backup:fit_on_worker", sigterm_after=SIGNALLED_AFTER,
                          **options)
    assert [w.returncode for w in stopped] == [PREEMPTED_EXIT_CODE] * 2, stopped[1].stderr_tail
    assert "backed up after batch 7 of epoch 0" in stopped[0].stderr_tail
    assert backed_up(tmp_path) == (0, 7)  # no finished batch lost
    for worker in run_workers("distgrad_course.lab.backup:fit_on_worker", **options):
        assert_same_run(backup.FitResult(**worker.check().value), uninterrupted)


def test_two_workers_stopped_resume_exactly_on_one_and_refuse_workers_on_their_own_dirs(
        strategy1, uninterrupted, tmp_path, collect_garbage):
    """The spot cluster comes back smaller: 2 workers (1 replica each) SIGTERMed after
    batch 7, resumed by one process on 1 replica, with the same global batch. Before that,
    a restart whose worker 1 reads its own host's empty directory is refused on both."""
    shared = tmp_path / "shared"
    stopped = run_workers("distgrad_course.lab.backup:fit_on_worker", sigterm_after=SIGNALLED_AFTER,
                          backup_dir=str(shared), **SCENARIO)
    assert [w.returncode for w in stopped] == [PREEMPTED_EXIT_CODE] * 2, stopped[1].stderr_tail
    manifest = (shared / MANIFEST).read_text()
    assert json.loads(manifest)["workers"] == 2
    apart = run_workers("distgrad_course.lab.backup:fit_on_worker", backup_dir=str(shared),
                        worker_1_backup_dir=str(tmp_path / "worker-1-local"), **SCENARIO)
    for worker in apart:
        assert worker.returncode not in (0, PREEMPTED_EXIT_CODE)
        assert "the workers read different backups" in worker.stderr_tail
        assert "a file system or bucket all workers share" in worker.stderr_tail
    assert (shared / MANIFEST).read_text() == manifest  # untouched
    assert_same_run(backup.one_fit(strategy1, str(shared), **SCENARIO), uninterrupted)


def test_a_sigterm_to_a_one_process_fit_backs_up_the_batch_exits_and_resumes_exactly(
        strategy2, uninterrupted, tmp_path, user_handler, collect_garbage):
    """The user's handler is chained (called once) and back in place after the exit."""
    handler, calls = user_handler
    with pytest.raises(SystemExit) as exited:
        backup.one_fit(strategy2, str(tmp_path), stop=backup.TermSelf(SIGNALLED_AFTER),
                       **SCENARIO)
    assert exited.value.code == PREEMPTED_EXIT_CODE
    assert calls == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is handler
    assert backed_up(tmp_path) == (0, SIGNALLED_AFTER + 1)
    assert_same_run(backup.one_fit(strategy2, str(tmp_path), **SCENARIO), uninterrupted)
    assert signal.getsignal(signal.SIGTERM) is handler  # restored at the end of that fit


def test_handle_sigterm_false_leaves_the_handler_alone(strategy2, uninterrupted, tmp_path,
                                                       user_handler):
    handler, calls = user_handler
    got = backup.one_fit(strategy2, str(tmp_path), stop=backup.TermSelf(SIGNALLED_AFTER),
                         handle_sigterm=False, **SCENARIO)
    assert calls == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is handler
    assert_same_run(got, uninterrupted)  # the fit ran to its end
    with pytest.raises(ValueError, match="handle_sigterm must be True or False"):
        BackupAndRestore(str(tmp_path), handle_sigterm="yes")


def test_a_sigterm_not_acted_on_is_passed_on_when_fit_ends(monkeypatch):
    """No trained batch was left (signalled in a multi-worker fit's last batch, or while a
    restart skipped to the end): the default action, restored, gets the signal again."""
    raised = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        watch = SigtermWatch()
        assert signal.getsignal(signal.SIGTERM) == watch._handle  # (else the kill ends pytest)
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.signalled and raised == []
        watch.close()
        assert raised == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_fit_outside_the_main_thread_is_refused_with_the_fix():
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_refusal()))
    thread.start()
    thread.join()
    assert "Pass handle_sigterm=False" in errors[0]


def _refusal() -> str:
    try:
        SigtermWatch()
    except ValueError as error:
        return str(error)
    return "not refused"
