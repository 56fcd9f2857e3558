"""docs/cluster/slurm.sbatch and train.py on a real one-node SLURM (tests/slurm_harness.py:
Debian's slurm-wlm and munge, which `make slurm` installs as root).

The batch job runs 2 tasks of train.py `--check` and is interrupted twice mid-run:
`scontrol requeue` (what a scheduler's preemption does: SLURM ends the tasks and the batch
script, and starts the job again), then SIGTERM to the tasks only (`scancel
--signal=TERM`, what `#SBATCH --signal` sends before the time limit: train.py backs up and
exits 42, and the batch script requeues the job itself). Each run resumes from the last per-batch
backup; the third ends with weights equal to one device (float32, 1e-6), and every task
prints `cluster check passed`. Then `srun -n 2 ... train.py --check`, the page's command.
Skipped only where this process is not root; as root without SLURM, it fails.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time

import numpy as np
import pytest
import slurm_harness
from test_cluster import PASSED, ROOT, SBATCH, SMALL, TRAIN, UPDATES, _env

from distgrad_course.lab.local_cluster import free_ports


def runs_of(text: str) -> list[str]:
    """The job's output, one string per run (the batch script's `job N, run R` line)."""
    return re.split(r"^(?=job \d+, run \d+, on )", text, flags=re.MULTILINE)[1:]


def start_update(run: str) -> int | None:
    """The update a run started at (after its backup was restored); None before that."""
    found = re.findall(r"^starting at update (\d+)", run, re.MULTILINE)
    assert len(found) <= 1, run
    return int(found[0]) if found else None


def last_update(run: str) -> int:
    return max([int(u) for u in re.findall(r"^update (\d+)/", run, re.MULTILINE)], default=0)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = slurm_harness.missing()
    if why and os.geteuid() != 0:
        pytest.skip(why)
    assert why is None, why  # root (CI): `make test` installed it first (`make slurm`)
    with slurm_harness.LocalSlurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def test_a_slurm_job_requeued_twice_resumes_and_equals_one_device(slurm, tmp_path):
    started = time.monotonic()
    out = tmp_path / "job.out"
    [port] = free_ports(1)
    submitted = slurm.run([
        "sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", f"--output={out}",
        f"--chdir={tmp_path}", str(SBATCH), *SMALL, "--throttle", "0.2", "--port", str(port)],
        env=_env(PYTHON=sys.executable, TRAIN=str(TRAIN), BACKUP_DIR=str(tmp_path / "backup")))
    job = submitted.stdout.strip().split(";")[0]
    interruptions = []  # (what, seconds since sbatch)
    deadline = started + 240
    while True:
        info = slurm.job(job)
        runs = runs_of(out.read_text() if out.exists() else "")
        if not interruptions and last_update(runs[-1] if runs else "") >= 2:
            slurm.run(["scontrol", "requeue", job])  # SLURM ends the job, then reruns it
            interruptions.append(("scontrol requeue", time.monotonic() - started))
        elif (len(interruptions) == 1 and len(runs) == 2
              and start_update(runs[1]) is not None
              and last_update(runs[1]) >= start_update(runs[1]) + 2):
            slurm.run(["scancel", "--signal=TERM", job])  # the tasks only, not the script
            interruptions.append(("SIGTERM to the tasks", time.monotonic() - started))
        if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        assert time.monotonic() < deadline, f"job {job} still {info['JobState']}\n" + \
            out.read_text() + slurm.logs()
        time.sleep(0.3)
    seconds = time.monotonic() - started
    text = out.read_text()
    report = f"{interruptions}, {seconds:.0f} s\n{text}\n{slurm.logs()}"
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "2"), \
        report
    first, second, third = runs_of(text)
    # SLURM_RESTART_COUNT: 0, 1, 2.
    assert [int(r) for r in re.findall(r"^job \d+, run (\d+), on ", text, re.M)] == [1, 2, 3]
    assert start_update(first) == 0
    # Each run resumed from the backup of the run before, mid-run.
    # SIGTERM: the batch in progress finishes and is backed up (at most the one update after
    # the last the chief printed): no finished batch is trained again, none is lost.
    assert 2 <= start_update(second) <= last_update(first) + 1 < UPDATES, report
    assert start_update(second) < start_update(third) <= last_update(second) + 1 < UPDATES, report
    # (After `scontrol requeue`, SIGKILL follows in KillWait = 2 s, maybe mid-backup: the
    # commit protocol keeps the last whole one. After the script's own SIGTERM, no SIGKILL.)
    assert second.count("BackupAndRestore: SIGTERM: backed up") == 2, report  # both workers
    assert "preempted (exit 42): requeueing job" in second, report  # the script's own requeue
    assert PASSED not in first + second, report
    assert "preempted" not in first, report  # scontrol requeue ended the script too
    # A requeued job starts again once its credential expired (cred_expire, 5 s here).
    log = (slurm.root / "log" / "slurmctld.log").read_text()
    stamps = re.findall(r"^\[([\d:T-]+)\.\d+\] (Requeuing|sched: Allocate) JobId=", log, re.M)
    assert [what for _, what in stamps] == ["sched: Allocate", "Requeuing"] * 2 + [
        "sched: Allocate"], log
    times = [datetime.datetime.fromisoformat(stamp) for stamp, _ in stamps]
    for requeued, allocated in ((times[1], times[2]), (times[3], times[4])):
        assert 5 <= (allocated - requeued).total_seconds() < 10, stamps
    assert third.count(PASSED) == 2 and last_update(third) == UPDATES, report
    print(f"SLURM job: {seconds:.0f} s, interruptions {interruptions}")


def test_srun_of_train_py_check_passes_on_every_task(slurm, tmp_path):
    # The page's first SLURM command, as written (with this Python).
    [port] = free_ports(1)
    result = slurm.run(["srun", "-n", "2", sys.executable, str(TRAIN), "--check",
                        "--epochs", "1", "--backup-dir", str(tmp_path / "backup"),
                        "--port", str(port)], check=False, env=_env(), cwd=tmp_path,
                       timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.count(PASSED) == 2, result.stdout
    assert np.isfinite(float(re.search(r"longest backup ([\d.]+) s", result.stdout)[1]))


def test_srun_sets_what_the_resolver_reads_and_the_stock_resolver_fails(slurm, tmp_path):
    # The variables tests/test_upstream_reports.py and test_cluster.py set by hand for a
    # task of `srun -n 2` on one node, and upstream report 11 under srun itself.
    script = ROOT / "docs" / "upstream" / "slurm_resolver_without_gpus.py"
    result = slurm.run(["srun", "-n", "2", "bash", "-c",
                        'echo "$SLURM_PROCID $SLURM_STEP_NUM_TASKS $SLURM_STEP_NODELIST '
                        '$SLURM_STEP_TASKS_PER_NODE"; "$0" "$1"', sys.executable, str(script)],
                       check=False, env=_env(), cwd=tmp_path, timeout_s=300)
    assert sorted(result.stdout.splitlines()) == [
        f"{task} 2 {slurm.node} 2" for task in (0, 1)], result.stdout
    assert result.returncode != 0
    assert result.stderr.count("ValueError: range() arg 3 must not be zero") == 2, \
        result.stderr[-3000:]
