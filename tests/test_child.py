"""distgrad_course.lab.child: one function of a real module in a fresh Python, one result
protocol."""

import ast
import json
import os
import resource
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from distgrad_course.lab import child as child_module
from distgrad_course.lab import fork_server
from distgrad_course.lab.child import Child, ChildError, ChildResult, run_child, to_json

TESTS_ON_PATH = {"PYTHONPATH": os.path.dirname(__file__)}


def test_the_return_value_and_the_kwargs_come_back_as_json():
    result = run_child("workers_for_tests:plain_values", {"n": 3, "nested": {"a": [1, 2]}},
                       env={**TESTS_ON_PATH, "DISTGRAD_TEST_VARIABLE": "set"})
    assert result.ok and result.reported and result.returncode == 0
    assert result.value == {
        "kwargs": {"n": 3, "nested": {"a": [1, 2]}}, "array": [0.0, 1.0, 2.0],
        "scalar": 0.5, "flag": True, "nan": "nan", "infinities": ["inf", "-inf"],
        "pair": {"name": "a", "value": 1.5}, "env": "set"}
    assert result.seconds > 0


def test_an_environment_value_of_none_removes_the_variable(monkeypatch):
    monkeypatch.setenv("DISTGRAD_TEST_VARIABLE", "inherited")
    inherited = run_child("workers_for_tests:plain_values", env=TESTS_ON_PATH)
    removed = run_child("workers_for_tests:plain_values",
                        env={**TESTS_ON_PATH, "DISTGRAD_TEST_VARIABLE": None})
    assert (inherited.value["env"], removed.value["env"]) == ("inherited", None)


def test_a_raised_exception_is_reported_with_its_type_message_and_traceback():
    result = run_child("workers_for_tests:raise_marker", {"marker": "marker-0815"},
                       env=TESTS_ON_PATH, check=False)
    assert not result.ok and result.reported
    assert (result.returncode, result.error) == (1, {"type": "ValueError",
                                                     "message": "marker-0815"})
    assert "Traceback" in result.stderr_tail and "marker-0815" in result.stderr_tail
    with pytest.raises(ChildError, match="exited with status 1 after raising ValueError: "
                                         "marker-0815"):
        result.check()


@pytest.mark.parametrize("code", [0, 3])
def test_exiting_without_a_result_is_a_failure_whatever_the_status(code):
    result = run_child("workers_for_tests:exit_without_result", {"code": code},
                       env=TESTS_ON_PATH, check=False)
    assert (result.returncode, result.reported, result.value, result.ok) == (
        code, False, None, False)
    with pytest.raises(ChildError, match=f"exited with status {code} without a result"):
        result.check()


def test_a_child_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(TimeoutError, match="ran longer than 1 s and was killed"):
        run_child("workers_for_tests:sleep_for", env=TESTS_ON_PATH, timeout=1)
    child = Child("workers_for_tests:sleep_forever",
                  {"task_index": 0, "num_workers": 1, "pid_file": str(tmp_path / "pid")},
                  env=TESTS_ON_PATH)
    while not (tmp_path / "pid").exists():
        assert not child.poll(), child.result().stderr_tail
        time.sleep(0.05)
    result = child.result()  # kills a child that still runs
    assert result.returncode == -9 and not result.reported
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid").read_text()), 0)
    assert child.result() is result  # the same outcome on every call


def test_the_trampoline_gives_the_child_a_peak_rss_of_its_own(monkeypatch):
    # Started straight from this process, the child's ru_maxrss starts at our peak;
    # through the trampoline it is the child's own. Our peak is made 2 GiB first, well
    # above a child's (~0.6 GiB: `import distgrad` imports TensorFlow and Keras).
    np.ones(2 * 2**30, dtype=np.uint8)  # touched, then freed: the peak stays
    ours = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    monkeypatch.setenv(fork_server.ENV, "0")  # a forked child's peak is its server's
    direct = run_child("workers_for_tests:peak_rss_kib", env=TESTS_ON_PATH).value
    isolated = run_child("workers_for_tests:peak_rss_kib", env=TESTS_ON_PATH,
                         trampoline=True).value
    assert ours > 2 * 2**20  # KiB
    assert direct >= ours
    assert isolated < ours / 2


def test_children_are_forked_from_one_server_and_each_starts_its_own_runtime(monkeypatch):
    monkeypatch.setenv(fork_server.ENV, "1")  # also when the suite runs with the server off
    # DISTGRAD_REPLICAS is read when the child makes its strategy: 3 logical devices in
    # one child, 1 in the next, from the same server, so the server started no runtime.
    children = {n: Child("workers_for_tests:replicas_in_sync",
                         env={**TESTS_ON_PATH, "DISTGRAD_REPLICAS": str(n)}) for n in (3, 1)}
    assert all(child.forked for child in children.values())
    assert {n: child.wait().check().value for n, child in children.items()} == {3: 3, 1: 1}
    servers = {child.process.server_pid for child in children.values()}
    draws = [run_child("workers_for_tests:numpy_global_draw", env=TESTS_ON_PATH).value
             for _ in range(2)]
    assert draws[0] != draws[1]  # NumPy's global generator is reseeded in each child
    other = Child("workers_for_tests:plain_values",
                  env={**TESTS_ON_PATH, "TF_ENABLE_ONEDNN_OPTS": "0"})  # read at import
    assert other.wait().ok and len(servers) == 1 and other.process.server_pid not in servers


def test_the_fork_server_can_be_turned_off_and_a_bad_switch_is_refused(monkeypatch):
    monkeypatch.setenv(fork_server.ENV, "0")
    child = Child("workers_for_tests:plain_values", env=TESTS_ON_PATH)
    assert not child.forked and child.wait().ok
    monkeypatch.setenv(fork_server.ENV, "yes")
    with pytest.raises(ValueError, match="DISTGRAD_FORK_SERVER must be '1'"):
        Child("workers_for_tests:plain_values", env=TESTS_ON_PATH)


def test_a_server_that_cannot_start_is_reported_with_the_switch_that_avoids_it(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv(fork_server.ENV, "1")
    with pytest.raises(RuntimeError, match=r"the fork server did not start \(set "
                                           r"DISTGRAD_FORK_SERVER=0"):
        Child("workers_for_tests:plain_values",
              env={**TESTS_ON_PATH, "PYTHONHOME": str(tmp_path / "no-python-here")})


def _imports(module) -> set[str]:
    """The modules `module`'s source imports (its top level and its functions alike)."""
    with open(module.__file__) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_the_child_imports_the_fork_server_and_never_the_other_way_round():
    assert "distgrad_course.lab.fork_server" in _imports(child_module)
    assert not any(name.startswith("distgrad") for name in _imports(fork_server))
    with open(fork_server.__file__) as f:
        assert "lab.child" not in f.read()  # not named in code or docstrings either


PROBE = textwrap.dedent("""\
    import json, os, sys
    with open(sys.argv[1], "w") as f:
        json.dump({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(),
                   "path0": sys.path[0],
                   "child_imported": "distgrad_course.lab.child" in sys.modules}, f)
    mode = sys.argv[2]
    if mode == "exit":
        sys.exit(int(sys.argv[3]))
    if mode == "message":
        sys.exit("message-0815")
    if mode == "raise":
        raise ValueError("marker-4711")
""")


def test_the_fork_server_runs_any_module_as_python_dash_m_would(tmp_path):
    # fork_server.start forks whatever DISTGRAD_FORK_SERVER says (`Child` reads the switch).
    (tmp_path / "fork_probe.py").write_text(PROBE)
    # TF_CPP_MIN_LOG_LEVEL as `Child` sets it: the server the other tests started serves us.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(tmp_path)}
    outcomes = {}
    for mode, extra in (("return", []), ("exit", ["3"]), ("message", []), ("raise", [])):
        out, stderr = tmp_path / f"{mode}.json", tmp_path / f"{mode}.err"
        process = fork_server.start("fork_probe", [str(out), mode, *extra], env, str(stderr))
        outcomes[mode] = (process.wait(timeout=120), json.loads(out.read_text()),
                          stderr.read_text())
    codes = {mode: code for mode, (code, _, _) in outcomes.items()}
    assert codes == {"return": 0, "exit": 3, "message": 1, "raise": 1}
    _, seen, _ = outcomes["return"]
    assert seen["name"] == "__main__" and not seen["child_imported"]  # the server's neither
    assert seen["argv"] == [str(tmp_path / "fork_probe.py"), str(tmp_path / "return.json"),
                            "return"]
    assert (seen["cwd"], seen["path0"]) == (os.getcwd(), os.getcwd())
    assert "message-0815" in outcomes["message"][2]
    assert "Traceback" in outcomes["raise"][2] and "marker-4711" in outcomes["raise"][2]


def test_the_fork_server_runs_a_script_as_python_script_would(tmp_path):
    # fork_server.start_script (tests/script_runs.py) against a fresh `python SCRIPT`: the
    # same __name__, sys.argv, directory, sys.path[0], standard output and exit statuses.
    (tmp_path / "fork_probe.py").write_text(PROBE + 'print("stdout-1234")\n')
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    runs = {}
    for forked in (True, False):
        for mode, extra in (("return", []), ("exit", ["3"]), ("raise", [])):
            out, err = work / f"{mode}.out", work / f"{mode}.err"
            args = [f"{mode}.json", mode, *extra]
            if forked:
                process = fork_server.start_script("../fork_probe.py", args, env, str(work),
                                                   str(out), str(err))
            else:
                with out.open("w") as stdout, err.open("w") as stderr:
                    process = subprocess.Popen([sys.executable, "../fork_probe.py", *args],
                                               cwd=work, env=env, stdout=stdout, stderr=stderr)
            runs[forked, mode] = (process.wait(timeout=120),
                                  json.loads((work / f"{mode}.json").read_text()),
                                  out.read_text(), "marker-4711" in err.read_text())
    assert runs[True, "return"][1]["path0"] == str(tmp_path.resolve())  # the script's folder
    for mode in ("return", "exit", "raise"):
        assert runs[True, mode] == runs[False, mode], mode
    assert [runs[True, mode][0] for mode in ("return", "exit", "raise")] == [0, 3, 1]
    assert runs[True, "return"][2] == "stdout-1234\n" and runs[True, "raise"][3]


def test_the_child_log_gets_one_line_at_start_and_one_at_result(tmp_path, monkeypatch):
    log = tmp_path / "children.jsonl"
    monkeypatch.setenv(child_module.LOG_ENV, str(log))
    ok = run_child("workers_for_tests:plain_values", env=TESTS_ON_PATH)
    failed = run_child("workers_for_tests:exit_without_result", {"code": 3},
                       env=TESTS_ON_PATH, check=False)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(line["event"], line["target"]) for line in lines] == [
        ("start", "workers_for_tests:plain_values"),
        ("result", "workers_for_tests:plain_values"),
        ("start", "workers_for_tests:exit_without_result"),
        ("result", "workers_for_tests:exit_without_result")]
    start, result = lines[0], lines[1]
    assert start["forked"] == result["forked"] == fork_server.enabled()
    assert isinstance(start["new_server"], bool) and start["pid"] == result["pid"]
    assert (result["seconds"], result["returncode"]) == (round(ok.seconds, 4), 0)
    assert lines[3]["returncode"] == failed.returncode == 3


def test_a_server_serves_environments_that_differ_only_after_import():
    env = {"TF_CONFIG": "{}", "PYTHONPATH": "/x", "DISTGRAD_REPLICAS": "2",
           "TF_USE_LEGACY_KERAS": "1", "PATH": "/bin"}
    assert fork_server.server_env(env) == {"TF_USE_LEGACY_KERAS": "1", "PATH": "/bin"}


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"target": 7}, TypeError, "target must be a 'package.module:function' string"),
    ({"target": "module_only"}, ValueError, "target must look like 'package.module:function'"),
    ({"target": ":function_only"}, ValueError, "target must look like"),
    ({"target": "m:f", "timeout": 0}, ValueError, "timeout must be a positive"),
    ({"target": "m:f", "timeout": -1.0}, ValueError, "timeout must be a positive"),
])
def test_bad_arguments_are_refused_before_starting_a_child(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        run_child(**kwargs)


def test_result_ok_needs_exit_zero_a_result_and_no_error():
    assert ChildResult("m:f", 0, True, {}, None, "", 1.0).ok
    assert not ChildResult("m:f", 1, True, None, {"type": "X", "message": ""}, "", 1.0).ok
    assert not ChildResult("m:f", 0, False, None, None, "", 1.0).ok
    assert not ChildResult("m:f", None, False, None, None, "", 0.0).ok


def test_to_json_leaves_plain_values_alone():
    assert to_json({"a": (1, 2.5, None, "s", True)}) == {"a": [1, 2.5, None, "s", True]}
