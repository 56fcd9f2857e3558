"""Run one function of a real module in a process of its own, get back its result.

Every experiment that needs a process of its own uses this one runner and its one result
protocol: tf-keras (`TF_USE_LEGACY_KERAS=1` must be set before TensorFlow is imported,
`distgrad_course.lab.tf_keras_runner`), a fresh peak RSS (`distgrad_course.lab.memory`),
resuming from a checkpoint in a new runtime (`distgrad_course.lab.resume`), and the workers of
a local `MultiWorkerMirroredStrategy` cluster (`distgrad_course.lab.local_cluster`).

The child runs `python -m distgrad_course.lab.child MODULE:FUNCTION KWARGS_PATH RESULT_PATH`
(on Linux it is forked from a server that has imported TensorFlow but started no
runtime, `distgrad_course.lab.fork_server`, which runs this module in it as `python -m` would;
the server never imports this module, this module imports the server): it imports
`MODULE`, calls `FUNCTION(**kwargs)` with the JSON object in `KWARGS_PATH`, and writes
`{"value": <JSON of the return value>, "error": null | {"type", "message"}}` to
`RESULT_PATH` (a raised exception's traceback also goes to its stderr). Return values
may hold numpy arrays and scalars, eager tensors and dataclasses; they come back as
lists, dicts and Python numbers, non-finite floats as "nan", "inf", "-inf". The child
ends with `os._exit`, so a collective still blocked on a dead peer cannot hang its
interpreter's teardown. A child that exits without writing the file (`os._exit`,
`sys.exit`, a crash) is reported as such, whatever its exit status.

`DISTGRAD_CHILD_LOG=/path/file` (off when unset or empty) appends one JSON line per
child to that file: `{"event": "start", "target", "forked", "new_server", "pid"}` when
it starts (`new_server`: a fork server was started for it, and its start-up counts in
this child's seconds) and `{"event": "result", "target", "forked", "pid", "seconds",
"returncode"}` when its result is taken. Each line is one `write` to a file opened for
appending, so children and test processes may share the file.

This module imports only the standard library. The package's own `import distgrad`
imports TensorFlow and Keras (to register distgrad's saveable classes), and in the
child that happens with the child's environment in place: the parent sets it when it
starts the child (or its fork server), before the child imports anything.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from distgrad_course.lab import fork_server

MODULE = "distgrad_course.lab.child"  # what the child runs: `python -m MODULE ...`
DEFAULT_TIMEOUT_S = 300.0
LOG_ENV = "DISTGRAD_CHILD_LOG"

# Started straight from a large process, a child's `ru_maxrss` would start at the
# *parent's* peak: Linux carries the pre-exec memory map's high-water mark into the
# exec'd program's rusage (fs/exec.c, setmax_mm_hiwater_rss), and subprocess shares
# that map (vfork). A tiny process in between makes the floor its own few MB.
_TRAMPOLINE = ("import subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
               "sys.exit(code if code >= 0 else 128 - code)")


class ChildError(RuntimeError):
    """A child raised or exited without a result; the message ends with its stderr tail."""


@dataclasses.dataclass(frozen=True)
class ChildResult:
    """One child's outcome.

    `returncode` is its exit status (None if it never exited), `reported` whether it
    wrote its result file, `value` the JSON of what the function returned (None
    unless it returned), `error` the exception it raised (`{"type", "message"}`) or
    None, `stderr_tail` the last lines of its stderr, `seconds` its wall time.
    """

    target: str
    returncode: int | None
    reported: bool
    value: object
    error: dict | None
    stderr_tail: str
    seconds: float

    @property
    def ok(self) -> bool:
        """The function returned and the child exited with status 0."""
        return self.returncode == 0 and self.reported and self.error is None

    def check(self) -> ChildResult:
        """Return self if the child succeeded, else raise ChildError describing it."""
        if self.ok:
            return self
        if self.error is not None:
            what = (f"exited with status {self.returncode} after raising "
                    f"{self.error['type']}: {self.error['message']}")
        elif self.reported:
            what = f"returned, then exited with status {self.returncode}"
        else:
            what = (f"exited with status {self.returncode} without a result (did it call "
                    "os._exit or sys.exit, or crash?)")
        raise ChildError(f"{self.target} {what}\nstderr tail:\n{self.stderr_tail}")


def to_json(value):
    """`value` with numpy arrays/scalars, tensors and dataclasses as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if hasattr(value, "numpy"):
        value = value.numpy()
    if hasattr(value, "tolist"):  # numpy arrays and numpy scalars
        return to_json(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def check_target(target) -> str:
    """`target` if it reads `"package.module:function"`; else TypeError / ValueError."""
    if not isinstance(target, str):
        raise TypeError(f"target must be a 'package.module:function' string, got "
                        f"{type(target).__name__}.")
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}.")
    return target


def check_timeout(timeout) -> float:
    """`timeout` if it is a positive number of seconds, else ValueError."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    return float(timeout)


def _log(**record) -> None:
    """Append `record` as one JSON line to the file `DISTGRAD_CHILD_LOG` names, if set."""
    path = os.environ.get(LOG_ENV)
    if path:
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write: whole lines from concurrent processes
        finally:
            os.close(fd)


def resolve(target: str):
    """The function named by `"package.module:function"` (imports the module)."""
    module_name, _, function_name = check_target(target).partition(":")
    return getattr(importlib.import_module(module_name), function_name)


class Child:
    """A started child process calling `target(**kwargs)`.

    `env` is added to this process' environment (a value of None removes that
    variable); `trampoline=True` starts a fresh interpreter through a tiny intermediate
    process, so its peak RSS is its own. Otherwise the child is forked from a server
    (`distgrad_course.lab.fork_server`, `forked` is True) where that is enabled. The child is
    its own process group: `kill()` (and `result()`, `wait()`) never leave it, or
    anything it started, running.
    """

    def __init__(self, target: str, kwargs: dict | None = None, env: dict | None = None,
                 trampoline: bool = False):
        self.target = check_target(target)
        self._dir = tempfile.TemporaryDirectory(prefix="distgrad-child-")
        kwargs_path = os.path.join(self._dir.name, "kwargs.json")
        self._result_path = os.path.join(self._dir.name, "result.json")
        with open(kwargs_path, "w") as f:
            json.dump(kwargs or {}, f)
        stderr_path = os.path.join(self._dir.name, "stderr.txt")
        self._stderr = open(stderr_path, "w+")  # result() reads, closes it
        child_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        for name, value in (env or {}).items():
            if value is None:
                child_env.pop(name, None)
            else:
                child_env[name] = value
        argv = [target, kwargs_path, self._result_path]
        self.forked = not trampoline and fork_server.enabled()
        self.started = time.monotonic()
        if self.forked:
            try:
                self.process = fork_server.start(MODULE, argv, child_env, stderr_path)
            except BaseException:
                self._stderr.close()
                self._dir.cleanup()
                raise
        else:
            command = [sys.executable, "-m", MODULE, *argv]
            if trampoline:
                command = [sys.executable, "-c", _TRAMPOLINE, *command]
            self.process = subprocess.Popen(command, env=child_env, stdout=subprocess.DEVNULL,
                                            stderr=self._stderr, start_new_session=True)
        self.finished: float | None = None
        self._result: ChildResult | None = None
        _log(event="start", target=target, forked=self.forked,
             new_server=bool(getattr(self.process, "new_server", False)), pid=self.process.pid)

    def poll(self) -> bool:
        """True once the child has exited (records its wall time)."""
        if self.finished is None and self.process.poll() is not None:
            self.finished = time.monotonic() - self.started
        return self.finished is not None

    def kill(self) -> None:
        """SIGKILL the child's process group if the child still runs."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def result(self) -> ChildResult:
        """The child's outcome (killing it first if it still runs); the same on every call."""
        if self._result is None:
            self.kill()
            self.poll()
            self._stderr.seek(0)
            tail = "\n".join(self._stderr.read().strip().splitlines()[-25:])
            self._stderr.close()
            outcome = None
            if os.path.exists(self._result_path):
                with open(self._result_path) as f:
                    outcome = json.load(f)
            self._dir.cleanup()
            self._result = ChildResult(
                self.target, self.process.returncode, outcome is not None,
                (outcome or {}).get("value"), (outcome or {}).get("error"), tail,
                self.finished or 0.0)
            _log(event="result", target=self.target, forked=self.forked, pid=self.process.pid,
                 seconds=round(self._result.seconds, 4), returncode=self.process.returncode)
        return self._result

    def wait(self, timeout: float = DEFAULT_TIMEOUT_S) -> ChildResult:
        """Wait up to `timeout` seconds; raises TimeoutError (after killing it) past that."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            tail = self.result().stderr_tail
            raise TimeoutError(f"{self.target} ran longer than {timeout:g} s and was killed."
                               f"\nstderr tail:\n{tail}") from None
        return self.result()


def run_child(target: str, kwargs: dict | None = None, env: dict | None = None,
              timeout: float = DEFAULT_TIMEOUT_S, check: bool = True,
              trampoline: bool = False) -> ChildResult:
    """Call `target(**kwargs)` in a new process with `env` applied (see `Child`).

    `kwargs` must be JSON-serializable. Returns the `ChildResult`.

    Raises:
        TypeError / ValueError: a malformed target, or a non-positive timeout.
        TimeoutError: the child ran longer than `timeout` seconds (it is killed).
        ChildError: with `check=True`, the child raised or exited without a result.
        RuntimeError: the fork server did not start (with its stderr tail).
    """
    check_target(target)
    timeout = check_timeout(timeout)
    result = Child(target, kwargs, env, trampoline).wait(timeout)
    return result.check() if check else result


def _main(argv: list[str]) -> None:
    target, kwargs_path, result_path = argv
    try:
        with open(kwargs_path) as f:
            kwargs = json.load(f)
        text = json.dumps({"value": to_json(resolve(target)(**kwargs)), "error": None})
        code = 0
    except Exception as err:  # reported to the parent, which decides
        traceback.print_exc()
        text = json.dumps({"value": None,
                           "error": {"type": type(err).__name__, "message": str(err)}})
        code = 1
    with open(result_path, "w") as f:
        f.write(text)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _main(sys.argv[1:])
