"""A real one-node SLURM for the tests (tests/test_cluster.py): Debian's `slurm-wlm` and
`munge` (`make slurm` installs them, as root), with daemons and files of its own.

`LocalSlurm(root)` writes, under `root` only: a munge key, `slurm.conf`, the state, spool
and log directories. It never reads or writes `/etc/slurm` or `/etc/munge`: its `munged`
uses its own key and socket (`AuthInfo=socket=...`), and every SLURM command it runs, or a
job it starts, finds the configuration through `SLURM_CONF`. It starts `munged`,
`slurmctld` and `slurmd` in the foreground as children of this process (root: `slurmd`
runs the jobs' tasks as their user), on free ports, and `stop()` cancels the jobs and ends
those three processes (by their ids), whatever happened.

The one node is this machine under its own host name (the name a job's `SLURM_*`
variables carry, which TensorFlow's resolver turns into worker addresses), with
`CPUs=2`. Processes are tracked by `proctrack/linuxproc` and tasks are not bound
(`task/none`): no cgroups needed. A requeued job starts again after `KillWait` (between
SIGTERM and SIGKILL) and after its credential expires (`AuthInfo=cred_expire`): both
are a few seconds here; with SLURM's defaults (30 s and 120 s) a requeued one-task job
started again 156 s after `scontrol requeue` (measured). SLURM 22.05 takes
`cred_expire=5`; `cred_expire=2` is refused as invalid, and then 120 s applies.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
INSTALL_HINT = ("SLURM is not installed: run `make slurm` as root (Debian's slurm-wlm and "
                "munge), or `sudo apt-get install slurm-wlm munge`.")


def missing() -> str | None:
    """Why a local SLURM cannot run here (not root, not installed), or None."""
    if os.geteuid() != 0:
        return "a local SLURM needs root (slurmd runs the jobs' tasks as their user)"
    found = [shutil.which(name) or shutil.which(f"/usr/sbin/{name}") for name in DAEMONS]
    if not all(found) or not shutil.which("sbatch"):
        return INSTALL_HINT
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalSlurm:
    """One SLURM node on this machine, configured under `root`; a context manager."""

    def __init__(self, root: Path, cpus: int = 2, kill_wait_s: int = 2,
                 cred_expire_s: int = 5):
        self.root = Path(root)
        self.cpus, self.kill_wait_s, self.cred_expire_s = cpus, kill_wait_s, cred_expire_s
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- files --------------------------------------------------------------------------

    def _write_files(self) -> None:
        for name in ("munge", "state", "spool", "log"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        if not key.exists():  # our own key, in our own directory
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        controller_port, node_port = _free_ports(2)
        log = self.root / "log"
        self.conf.write_text("\n".join([
            "ClusterName=distgrad-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={controller_port}",
            f"SlurmdPort={node_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire_s}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={log / 'slurmctld.log'}",
            f"SlurmdLogFile={log / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            # A requeued job becomes eligible cred_expire s later; without an event, only
            # the main scheduling loop (default every 60 s) would start it.
            "SchedulerParameters=sched_interval=1",
            "ReturnToService=2",
            "JobRequeue=1",
            f"KillWait={self.kill_wait_s}",
            "MinJobAge=600",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            ""]), encoding="utf-8")

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    # -- daemons ------------------------------------------------------------------------

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")  # the child keeps it open
        self.processes[name] = subprocess.Popen(
            args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start(self) -> LocalSlurm:
        self._write_files()
        munge = self.root / "munge"
        self._start("munged", [
            shutil.which("munged") or "/usr/sbin/munged", "--foreground", "--force",
            f"--key-file={munge / 'munge.key'}", f"--socket={self.munge_socket}",
            f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}",
            f"--log-file={self.root / 'log' / 'munged.log'}"])
        self._wait(self.munge_socket.exists, "munged made no socket")
        self._start("slurmctld", [shutil.which("slurmctld") or "/usr/sbin/slurmctld",
                                  "-D", "-i", "-f", str(self.conf)])
        self._start("slurmd", [shutil.which("slurmd") or "/usr/sbin/slurmd",
                               "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(self._node_ready, "the node never became idle")
        return self

    def _node_ready(self) -> bool:
        state = self.run(["sinfo", "--noheader", "-o", "%t"], check=False).stdout.split()
        return state == ["idle"]

    def _wait(self, ready, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited {process.returncode}: {what}\n"
                                       + self.logs())
            if time.monotonic() > deadline:
                raise RuntimeError(f"after {timeout_s} s: {what}\n" + self.logs())
            time.sleep(0.2)

    def logs(self, tail: int = 3000) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def stop(self) -> None:
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            jobs = self.run(["squeue", "--noheader", "-o", "%i"], check=False).stdout.split()
            if jobs:  # their tasks end within KillWait
                self.run(["scancel", "--full", *jobs], check=False)
                deadline = time.monotonic() + self.kill_wait_s + 2
                while time.monotonic() < deadline and self.run(
                        ["squeue", "--noheader"], check=False).stdout.strip():
                    time.sleep(0.2)
        for name in reversed(DAEMONS):
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> LocalSlurm:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- commands -----------------------------------------------------------------------

    def run(self, args: list[str], check: bool = True, env: dict | None = None,
            timeout_s: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM command against this cluster: `env` (default: this process'
        environment) with `SLURM_CONF` set."""
        return subprocess.run(args, env={**(env or os.environ), "SLURM_CONF": str(self.conf)},
                              check=check, capture_output=True, text=True, timeout=timeout_s,
                              **kwargs)

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(field.split("=", 1) for field in text.split() if "=" in field)
