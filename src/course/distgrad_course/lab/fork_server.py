"""Start children by forking a server that has already imported TensorFlow (Linux).

Importing TensorFlow and Keras costs a fresh interpreter about 5 s of CPU, more than
most experiments that need a process of their own. A fork server pays it once: it
imports them (its environment decides what the import sees), creates no runtime, and
forks one child per request. A request names a module and its arguments, and the child
runs it as `python -m MODULE ARGV...` would (`runpy.run_module` as `__main__`, with that
`sys.argv`, session, standard files, directory, environment and `sys.path`), or a script,
as `python SCRIPT ARGV...` would (`runpy.run_path`, `start_script`); this module knows
nothing of what they do. Each child starts its TensorFlow runtime itself,
so it gets its own devices, `TF_CONFIG` and logical-device setup, as a new interpreter
would; what it shares with the server is what importing TensorFlow and Keras did
(NumPy's global generator is reseeded in the child). The child ends with `os._exit`:
status 0 when the module returns, `SystemExit`'s code as Python would turn it into a
status, 1 with the traceback on its stderr when it raises (70 if the child could not be
set up); unlike an interpreter's exit it runs no `atexit` handlers (they would be the
server's, TensorFlow's teardown among them).

One server serves every request whose environment differs from its own only in
variables not read at import (`TF_CONFIG`, `PYTHONPATH`, `DISTGRAD_*`);
any other difference (`TF_USE_LEGACY_KERAS`, `TF_ENABLE_ONEDNN_OPTS`, ...) gets a
server of its own. `DISTGRAD_FORK_SERVER=0` turns it off: every child is then a
fresh interpreter. Off Linux it is always off.

Per request the server forks a monitor, which forks the child (its own session, so
killing its process group kills all it started), sends the child's pid, waits for it
and sends its exit status; the caller reads both from a socket of its own
(`ForkedProcess`, which answers like `subprocess.Popen`). A server exits when its
caller closes the control socket, as when the calling process ends.

This module imports only the standard library until a server imports TensorFlow.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback

ENV = "DISTGRAD_FORK_SERVER"
# Not read at import (TF_CONFIG: when a strategy starts; PYTHONPATH: the child's
# sys.path is rebuilt; pytest sets PYTEST_CURRENT_TEST per test): a child may differ
# from its server in these.
PER_CHILD = ("TF_CONFIG", "PYTHONPATH", "PYTEST_CURRENT_TEST")
PER_CHILD_PREFIX = "DISTGRAD_"
READY_TIMEOUT_S = 300.0
_MESSAGE = 1 << 20


def enabled() -> bool:
    """Whether children are forked from a server: on Linux unless `DISTGRAD_FORK_SERVER=0`."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be '1' (fork children from a server) or '0' (start "
                         f"each child as a fresh interpreter), got {value!r}.")
    return value == "1" and sys.platform.startswith("linux")


def server_env(env: dict) -> dict:
    """`env` without the variables a child may set for itself (pure function)."""
    return {name: value for name, value in env.items()
            if name not in PER_CHILD and not name.startswith(PER_CHILD_PREFIX)}


class ForkedProcess:
    """A child forked by the server `server_pid`, with `subprocess.Popen`'s `pid`,
    `returncode`, `poll()` and `wait(timeout)` (raising `subprocess.TimeoutExpired`);
    `new_server` says whether the server was started for it (its start-up is then part
    of this child's start)."""

    def __init__(self, status: socket.socket, args, server_pid: int, new_server: bool = False):
        self.args = args
        self.server_pid = server_pid
        self.new_server = new_server
        self.returncode: int | None = None
        self._status = status
        self._buffer = b""
        status.settimeout(READY_TIMEOUT_S)
        self.pid = int(self._line())

    def _line(self) -> bytes:
        while b"\n" not in self._buffer:
            data = self._status.recv(64)
            if not data:  # the monitor died: nothing can say what happened to the child
                raise ChildProcessError(f"the fork server's monitor of {self.args} vanished")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._status.settimeout(timeout)
            try:
                self.returncode = int(self._line())
            except (TimeoutError, BlockingIOError):  # BlockingIOError: timeout 0
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._status.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None


class _Server:
    """One server process and the control socket to it."""

    def __init__(self, env: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()  # the server's stderr
        self.process = subprocess.Popen(
            [sys.executable, "-m", "distgrad_course.lab.fork_server", str(theirs.fileno())],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
            pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.control = ours
        ours.settimeout(READY_TIMEOUT_S)
        try:
            ready = ours.recv(_MESSAGE)
        except TimeoutError:
            ready = b""
        ours.settimeout(None)
        if ready != b"ready":
            self.close()
            self._log.seek(0)
            tail = self._log.read().decode(errors="replace").strip().splitlines()[-15:]
            raise RuntimeError("the fork server did not start (set DISTGRAD_FORK_SERVER=0 "
                               "to start each child as a fresh interpreter); its stderr:\n"
                               + "\n".join(tail))

    def alive(self) -> bool:
        return self.process.poll() is None

    def start(self, request: dict) -> socket.socket:
        ours, theirs = socket.socketpair()
        try:
            socket.send_fds(self.control, [json.dumps(request).encode()], [theirs.fileno()])
        finally:
            theirs.close()
        return ours

    def close(self) -> None:
        self.control.close()
        self.wait()

    def wait(self) -> None:
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


_servers: dict[tuple, _Server] = {}
_lock = threading.Lock()


def start(module: str, argv: list[str], env: dict, stderr_path: str) -> ForkedProcess:
    """Fork a child that runs `python -m module *argv` with `env`, from a matching server
    (started on first use), its stderr appended to `stderr_path`, stdout discarded."""
    return _start({"module": module, "argv": list(argv), "env": env, "cwd": os.getcwd(),
                   "stderr": stderr_path}, ["-m", module, *argv])


def start_script(script: str, argv: list[str], env: dict, cwd: str, stdout_path: str,
                 stderr_path: str) -> ForkedProcess:
    """Fork a child that runs `python script *argv` in `cwd` with `env`, as `start` does,
    its stdout and stderr appended to the two files."""
    return _start({"script": script, "argv": list(argv), "env": env, "cwd": cwd,
                   "stdout": stdout_path, "stderr": stderr_path}, [script, *argv])


def _start(request: dict, args: list[str]) -> ForkedProcess:
    base = server_env(request["env"])
    key = tuple(sorted(base.items()))
    with _lock:
        server = _servers.get(key)
        new_server = server is None or not server.alive()
        if new_server:
            server = _servers[key] = _Server(base)
        status = server.start(request)
    return ForkedProcess(status, args, server.process.pid, new_server)


@atexit.register
def _close_all() -> None:
    for server in _servers.values():  # all at once: each server then exits on its own
        server.control.close()
    for server in _servers.values():
        server.wait()
    _servers.clear()


def _preload() -> None:
    import tensorflow as tf

    if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
        importlib.import_module("tf_keras")
    else:
        importlib.import_module("keras")
    from tensorflow.python.eager import context

    # Private: every public way to ask would start the runtime.
    if context.context()._context_handle is not None:
        raise RuntimeError(f"importing TensorFlow {tf.__version__} started its runtime; "
                           "a forked child could not configure its own devices.")


def _exit_status(stop: SystemExit) -> int:
    """The status an interpreter exits with on an uncaught `stop` (a code that is not an
    integer is printed to stderr and gives 1, as Python does)."""
    code = stop.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _become_child(request: dict, session_made: int, base_path: list[str]) -> None:
    """In the forked child: the session, files, directory, environment, `sys.path` and
    `sys.argv` that `python -m MODULE ARGV...` (or `python SCRIPT ARGV...`) would have had,
    then the module (or script) run as `__main__`; ends with `os._exit` (never returns)."""
    script = request.get("script")
    try:
        os.setsid()
        os.close(session_made)  # the monitor may now report this pid (and kill its group)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDWR)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        stdout = os.open(request["stdout"], flags) if "stdout" in request else devnull
        stderr = os.open(request["stderr"], flags)
        for fd, source in ((0, devnull), (1, stdout), (2, stderr)):
            os.dup2(source, fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        # sys.path[0]: the script's folder, symlinks resolved (`python SCRIPT`), or the
        # directory (`python -m`)
        first = os.path.dirname(os.path.realpath(script)) if script else request["cwd"]
        sys.path[:] = [first, *extra, *base_path]
        importlib.invalidate_caches()
        # Python's `random` reseeds itself after a fork; NumPy's global generator does
        # not, and a fresh interpreter would seed it from the OS.
        sys.modules["numpy"].random.seed()
        # run_module sets argv[0] to the module's file, run_path to the script
        sys.argv = [script or "-m", *request["argv"]]
    except BaseException:  # reported as the child's stderr and exit status
        traceback.print_exc()
        _flush_and_exit(70)
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_status(stop)
    except BaseException:  # as an interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    _flush_and_exit(code)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream: nothing more to say
            pass
    os._exit(code)


def _serve(control: socket.socket, base_path: list[str]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    control.sendall(b"ready")
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, _MESSAGE, 1)
        except OSError:
            return
        if not message:
            return
        status = socket.socket(fileno=fds[0])
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:  # the monitor
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            session_wait, session_made = os.pipe()
            pid = os.fork()
            if pid == 0:
                status.close()
                os.close(session_wait)
                _become_child(request, session_made, base_path)
            os.close(session_made)
            os.read(session_wait, 1)  # EOF once the child has its own session (or died)
            status.sendall(f"{pid}\n".encode())
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            status.sendall(f"{code}\n".encode())
            os._exit(0)
        status.close()


def _main(fd: str) -> None:
    control = socket.socket(fileno=int(fd))
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own]
    _preload()
    # Python's advice for a fork without exec: the children's collections then skip the
    # ~320k objects of the import (a full collection right after it: 0.19 s -> 0 s) and
    # leave the pages they live on shared.
    gc.freeze()
    _serve(control, base_path)
    # Nothing of the server's is left to save; a normal exit would spend ~1 s of CPU
    # tearing down TensorFlow.
    os._exit(0)


if __name__ == "__main__":
    _main(sys.argv[1])
