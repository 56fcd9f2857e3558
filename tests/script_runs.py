"""Run a script as `python SCRIPT ARGS...` would, in a process of its own (its own session,
its standard output and error in files): forked from a server that has imported TensorFlow
with that environment and started no runtime (`distgrad_course.lab.fork_server`, about
3 s of CPU less per process), or, with `DISTGRAD_FORK_SERVER=0`, a fresh interpreter.
The Recipes page's scripts, the lessons' pasted fixes and the cluster page's workers run
this way. One difference: a forked script ends with `os._exit` once it returns, without
`atexit` handlers or the interpreter's finalization, so only a fresh run can show a
failure at exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from distgrad_course.lab import fork_server


def start(script, args: list, env: dict, cwd, out: Path, err: Path):
    """`python script *args` in `cwd`, its output written to the files `out` and `err`; a
    process with `subprocess.Popen`'s `pid`, `poll()` and `wait(timeout)`."""
    out.write_text("")
    err.write_text("")
    args = [str(arg) for arg in args]
    if fork_server.enabled():
        return fork_server.start_script(str(script), args, env, str(cwd), str(out), str(err))
    with out.open("w") as stdout, err.open("w") as stderr:
        return subprocess.Popen([sys.executable, str(script), *args], cwd=cwd, env=env,
                                stdout=stdout, stderr=stderr, start_new_session=True)


def kill(process) -> None:
    """Kill `process` and all it started (its session), if it still runs."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run(script, args: list, env: dict, cwd, timeout_s: float) -> tuple[int, str, str]:
    """Run it to its end: (exit status, stdout, stderr); killed after `timeout_s`, which
    raises `subprocess.TimeoutExpired`."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        process = start(script, args, env, cwd, out, err)
        try:
            code = process.wait(timeout_s)
        finally:
            kill(process)
        return code, out.read_text(), err.read_text()
