"""The version matrix (`make matrix`): the reference-class tests and every lesson, on every
TensorFlow minor with Keras 3, each in its own virtual environment, and on the nightlies.

    cd src/course/distgrad_course  # (the driver runs from anywhere; shorter lines here)
    python3 version_matrix.py            # every cell not yet run at this commit
    python3 version_matrix.py --tf 2.18  # the cells of one TensorFlow minor, again
    python3 version_matrix.py --tf 2.15  # the Keras 2 cell (tf.keras is Keras 2), again
    python3 version_matrix.py --nightly  # the nightly cell (= --cell nightly), again
    python3 version_matrix.py --cell nightly \
        --only tests/accumulating_optimizer/test_optimizer.py  # part of it
    python3 version_matrix.py --tables   # only re-render the tables from matrix.json

A cell is one environment under build/matrix/CELL/env: `tensorflow==2.NN.*`, the Keras 3
pip resolves for it, `tf-keras==2.NN.*` (the legacy tests' children), and the project with
the extras `make` installs except the docs. One extra cell pins Keras to the lower bound of
pyproject.toml, on the oldest TensorFlow: the oldest stack the package declares. The
`nightly` cell (the canary) installs `tf-nightly`, `keras-nightly` and `tf-keras-nightly`
(without it if pip cannot resolve it against that tf-nightly: the tests that need tf-keras
are then "not run", with pip's reason) with the extras' other requirements in one pip
call, then the project with `--no-deps`: tf-nightly imports as `tensorflow` but is not the
distribution `tensorflow` that pyproject.toml requires, and `-e .[...]` would install the
release beside it. Each cell is installed, run and removed before the next (about 2.7 GB
each). After every cell the results go to docs/versions/matrix.json (pass, or the first
failure and its message, per test file and per lesson; per test of
tests/test_upstream_reports.py too) and to the tables that docs/versions.md and
docs/upstream.md include: docs/versions/matrix.md, nightly.md and upstream-status.md (the
status of each upstream report, derived from the per-test results). Logs and executed
lessons stay in build/matrix/CELL/. Standard library only.

The `tf2.15` cell is the last TensorFlow whose tf.keras is Keras 2 (it has no Keras 3):
`tensorflow==2.15.*` with the Keras 2.15 it brings and `tf-keras==2.15.*`. It runs what
applies there, KERAS_2_TESTS selected by KERAS_2_SELECTION: the tf-keras tests (their
children with `TF_USE_LEGACY_KERAS=1`, tf-keras 2.15), tests/test_version_checks.py
(`import distgrad`, and fit, mixed_float16 fit and GradientAccumulator on TF 2.15's own
tf.keras, without the switch), the tf-keras recipes and the tf-keras runs of the upstream
reports; no lesson (they are Keras 3). Its results are kept per test too ("per_test" in
matrix.json, a table in matrix.md).

The driver reads a run's results with `matrix_results.py` and renders the tables with
`matrix_tables.py`, the two modules beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run by path (`make matrix`, any Python): its package is beside it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from distgrad_course.matrix_results import (
    NIGHTLY,
    RELEASE,
    UPSTREAM_TESTS,
    junit_results,
    lesson_failure,
    per_test_results,
    summary,
    upstream_results,
)
from distgrad_course.matrix_tables import write_tables

ROOT = Path(__file__).resolve().parents[3]  # src/course/distgrad_course/version_matrix.py
BUILD = ROOT / "build" / "matrix"
RESULTS = ROOT / "docs" / "versions" / "matrix.json"
# The matrix's own files: not what the tests run with (tree_state leaves them out).
OWN_FILES = tuple(f"src/course/distgrad_course/{name}.py"
                  for name in ("version_matrix", "matrix_results", "matrix_tables"))
TF_MINORS = ("2.16", "2.17", "2.18", "2.19", "2.20", "2.21")
KERAS_2_TF = "2.15"  # the last TensorFlow whose tf.keras is Keras 2
KERAS_2_TESTS = ("tests/tf_keras_optimizer/test_tf_keras_optimizer.py",
                 "tests/tf_keras_optimizer/test_tf_keras_mixed_precision.py",
                 "tests/tf_keras_optimizer/test_tf_keras_custom_loop.py",
                 "tests/test_tf_keras_runner.py", "tests/test_version_checks.py",
                 "tests/test_copy_alone.py", "tests/test_user_paths.py", "tests/test_recipes.py",
                 UPSTREAM_TESTS)
# pytest -k: whole files for the tf-keras ones and test_version_checks.py (whose Keras 3
# tests skip themselves), else the tests named for tf-keras: the tf-keras recipes' runs,
# the reports' tf-keras runs, the copied tf-keras file, the tf-keras user path.
KERAS_2_SELECTION = ("test_tf_keras_ or test_version_checks or "
                     "(test_the_recipe_runs and tf-keras) or "
                     "(test_each_reproduction and tf_keras) or test_the_copied_tf_keras_file "
                     "or test_tf_keras_skips")
EXTRAS = "test,legacy"
COURSE = ROOT / "src" / "course"  # the course package, installed beside the project
FREE_GB_NEEDED = 6
# Everything in tests/ runs but these: the benchmark smoke runs, the .py/.ipynb pairing (text
# only), the child-process runner's protocol (the lab, no TF/Keras behaviour), the
# 2-process clusters of lesson 06, which the lesson itself runs in every cell, and this
# driver's own logic; nor the files of docs/cluster/ and .github/ (no TF/Keras behaviour).
NOT_REFERENCE = {"test_benchmarks.py", "test_multi_worker_bench.py", "test_notebook_pairs.py",
                 "test_child.py", "test_local_cluster.py", "test_version_matrix_status.py",
                 "test_kubernetes.py", "test_workflows.py"}


def keras_lower_bound() -> str:
    """The oldest Keras 3 pyproject.toml allows: it excludes 3.0.* ... 3.N.* one by one
    (Keras 2.15 stays allowed, for TensorFlow 2.15)."""
    spec = re.search(r'"keras(>=[^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    excluded = {int(n) for n in re.findall(r"!=3\.(\d+)\.\*", spec)}
    return f"3.{next(n for n in range(100) if n not in excluded)}"


def cells() -> list[dict]:
    plain = [{"name": f"tf{tf}", "tf": tf, "keras": None} for tf in TF_MINORS]
    oldest = keras_lower_bound()  # Keras at its declared bound on the oldest TF of its era
    return [{"name": f"tf{KERAS_2_TF}", "tf": KERAS_2_TF, "keras": None, "keras2": True},
            *plain] + [{"name": f"tf{TF_MINORS[0]}-keras{oldest}", "tf": TF_MINORS[0],
                     "keras": oldest},
                    {"name": "nightly", "tf": "nightly", "keras": None, "nightly": True}]


def test_files() -> list[str]:
    """tests/test_*.py and the reference classes' specs in tests/<class>/test_*.py."""
    return [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").rglob("test_*.py"))
            if p.name not in NOT_REFERENCE]


def run(cmd, log: Path, timeout: float, cwd=ROOT, env=None) -> int:
    """Run `cmd` in its own process group, output appended to `log`; 124 on timeout."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(map(str, cmd))}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[timed out after {timeout:.0f} s]\n")
            return 124
        finally:  # xdist workers, kernels and children of a failed run go too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_leftovers(env_dir: Path) -> None:
    """Kill the programs of `env_dir` still running (a kernel or child that left its process
    group when a run was cut short)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "cmdline").read_bytes().startswith(f"{env_dir}/".encode()):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass


def git_commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    changed = git("status", "--porcelain", "--", "src", "tests", "notebooks", "pyproject.toml")
    head = git("rev-parse", "--short=12", "HEAD")
    return head + ("+uncommitted" if changed else "")


def tree_state() -> dict:
    """{path: digest} of the files the tests run with that differ from HEAD (changed, new or
    deleted) under src/, tests/ (but the matrix's OWN_FILES), notebooks/ and pyproject.toml."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True).stdout
    paths = ["--", "src", "tests", "notebooks", "pyproject.toml"]
    names = git("diff", "HEAD", "--name-only", "-z", *paths).split(b"\0")
    names += git("ls-files", "-z", "--others", "--exclude-standard", *paths).split(b"\0")
    state = {}
    for name in {n.decode() for n in names if n} - set(OWN_FILES):
        path = ROOT / name
        state[name] = (hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.is_file()
                       else "deleted")
    return state


def installed_versions(python: Path) -> dict:
    """What pip installed: the version of each distribution (a release or its nightly)."""
    names = [(key, [RELEASE[key], NIGHTLY[key]]) for key in RELEASE] + [("numpy", ["numpy"])]
    code = ("import importlib.metadata as m, json, platform, sys\n"
            "def v(d):\n try: return m.version(d)\n except m.PackageNotFoundError: return None\n"
            "out, dists = {'python': platform.python_version()}, {}\n"
            f"for key, names in {names!r}:\n"
            " found = [(d, v(d)) for d in names if v(d)]\n"
            " if found: out[key], dists[key] = found[0][1], found[0][0]\n"
            "print(json.dumps(out | {'distributions': dists}))")
    versions = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                         check=True).stdout)
    dists = versions.pop("distributions")
    if any(dists[k] != RELEASE[k] for k in dists if k in RELEASE):
        versions["distributions"] = dists  # a nightly: say which distribution it is
    return versions


def nightly_requirements() -> list[str]:
    """Every requirement of the project and its extras but TensorFlow, Keras and tf-keras."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    course = tomllib.loads((COURSE / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"]) + [r for r in course["dependencies"]
                                               if r != "distgrad"]
    for extra in EXTRAS.split(","):
        wanted += project["optional-dependencies"][extra]
    released = set(RELEASE.values())
    return [r for r in wanted
            if re.match(r"[\w.-]+", r)[0].lower().replace("_", "-") not in released]


def uses_tf_keras(path: Path) -> bool:
    """Whether a test file or lesson runs tf-keras (its children import `tf_keras`)."""
    return "tf_keras" in path.read_text(encoding="utf-8")



def clean_environ(env_dir: Path) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update(PATH=f"{env_dir / 'bin'}:{environ['PATH']}", VIRTUAL_ENV=str(env_dir),
                   TF_CPP_MIN_LOG_LEVEL="2")
    return environ


def pytest_cmd(python: Path, workers: int) -> list:
    return [python, "-m", "pytest", "-p", "no:cacheprovider", "-n", str(workers),
            "--dist", "loadfile"]


def install(cell: dict, python: Path, record: dict, log: Path, environ: dict) -> int:
    """Install the cell's stack and the project; for the nightly, set record["legacy"]."""
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    if not cell.get("nightly"):
        pins = [f"tensorflow=={cell['tf']}.*", f"tf-keras=={cell['tf']}.*"]
        pins += [f"keras=={cell['keras']}"] if cell["keras"] else []
        return run([*pip, "-e", f".[{EXTRAS}]", "-e", str(COURSE), *pins], log, 3600,
                   env=environ)
    others = nightly_requirements()
    code = run([*pip, *NIGHTLY.values(), *others], log, 3600, env=environ)
    if code:  # without tf-keras-nightly: its tests are then not run
        errors = [line for line in log.read_text().splitlines() if "ERROR" in line]
        record["legacy"] = ("not run: tf-keras-nightly: "
                            + summary(errors[0] if errors else f"pip exit {code}"))
        code = run([*pip, NIGHTLY["tensorflow"], NIGHTLY["keras"], *others], log, 3600,
                   env=environ)
    # Not `-e .[...]`: it would add the release `tensorflow` (and keras, tf-keras) that
    # pyproject.toml names beside the nightlies, which provide the same modules.
    code = code or run([*pip, "--no-deps", "-e", ".", "-e", str(COURSE)], log, 600,
                       env=environ)
    check = subprocess.run([python, "-m", "pip", "check", "--disable-pip-version-check"],
                           capture_output=True, text=True, check=False, env=environ)
    record["pip_check"] = [line for line in check.stdout.splitlines() if line.strip()]
    return code


def run_cell(cell: dict, commit: str, only: list[str] | None = None, workers: int = 2) -> dict:
    """Install the cell, run its tests and lessons (those of `only`, if given), remove it."""
    where = BUILD / cell["name"]
    env_dir, log = where / "env", where / "matrix.log"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    python = env_dir / "bin" / "python"
    record = {"commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime()), "wall_s": {}}
    if only is not None:
        record["only"] = only
    environ = clean_environ(env_dir)
    start, tree = time.monotonic(), tree_state()
    try:
        code = run([sys.executable, "-m", "venv", env_dir], log, 300)
        code = code or install(cell, python, record, log, environ)
        record["wall_s"]["install"] = round(time.monotonic() - start)
        if code:
            errors = [line for line in log.read_text().splitlines() if "ERROR" in line]
            record.update(status="install failed",
                          message=summary(errors[0] if errors else f"exit {code}"))
            return record
        record["versions"] = installed_versions(python)
        size = subprocess.run(["du", "-sh", env_dir], capture_output=True, text=True,
                              check=False).stdout
        print(f"  installed {record['versions']}, env {size.split()[0]}", flush=True)

        keras2 = cell.get("keras2", False)
        files = [f for f in (KERAS_2_TESTS if keras2 else test_files())
                 if only is None or f in only]
        skipped = [f for f in files if "legacy" in record and uses_tf_keras(ROOT / f)]
        files, begun = [f for f in files if f not in skipped], time.monotonic()
        if files:
            run([*pytest_cmd(python, workers), f"--junitxml={where / 'tests.xml'}", "-rs",
                 *(["-k", KERAS_2_SELECTION] if keras2 else []), *files], log, 3600,
                env=environ)
        record["tests"] = junit_results(where / "tests.xml", files,
                                        lambda f: f.removesuffix(".py").replace("/", "."))
        record["tests"] |= {f: {"status": record["legacy"]} for f in skipped}
        if keras2:
            record["per_test"] = per_test_results(where / "tests.xml")
            record["selection"] = KERAS_2_SELECTION
        if UPSTREAM_TESTS in files:
            record["upstream"] = {"tests": upstream_results(where / "tests.xml")}
        record["wall_s"]["tests"] = round(time.monotonic() - begun)

        lessons, begun = where / "lessons", time.monotonic()
        lessons.mkdir()
        for notebook in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
            if not keras2 and (only is None or notebook.stem in only):
                shutil.copy(notebook, lessons)
        skipped = [p for p in lessons.glob("*.ipynb") if "legacy" in record and uses_tf_keras(p)]
        for notebook in skipped:
            notebook.unlink()
        names = sorted(p.stem for p in lessons.glob("*.ipynb"))
        if names:
            run([*pytest_cmd(python, workers)[:-2], "--nbmake", "--nbmake-timeout=900",
                 "--overwrite", f"--junitxml={where / 'lessons.xml'}", lessons], log, 3600,
                env=environ)
            record["lessons"] = junit_results(where / "lessons.xml", names, lambda name: name)
            for name, outcome in record["lessons"].items():
                if outcome["status"] == "fail":
                    outcome.update(lesson_failure(lessons / f"{name}.ipynb"))
            record["wall_s"]["lessons"] = round(time.monotonic() - begun)
        if skipped:
            record.setdefault("lessons", {}).update(
                {p.stem: {"status": record["legacy"]} for p in skipped})
        failed = [name for group in ("tests", "lessons") for name, r in record.get(group, {})
                  .items() if r["status"] != "pass" and not r["status"].startswith("not run")]
        record["status"] = f"{len(failed)} failed" if failed else "pass"
        return record
    finally:
        record["wall_s"]["total"] = round(time.monotonic() - start)
        after = tree_state()  # a shared tree: someone may edit what the tests import
        changed = sorted(n for n in tree.keys() | after.keys() if tree.get(n) != after.get(n))
        if changed:  # the files changed while the cell ran: its results may mix two versions
            record["changed_while_running"] = changed
        kill_leftovers(env_dir)
        shutil.rmtree(env_dir, ignore_errors=True)


def fill_reports(record: dict, env_dir: Path, name: str, commit: str) -> dict:
    """Run only tests/test_upstream_reports.py in an existing environment whose versions
    are the cell's, for the per-test results of a cell recorded without them."""
    python, where = env_dir / "bin" / "python", BUILD / f"{name}-reports"
    versions = installed_versions(python)
    differ = {k: (versions.get(k), v) for k, v in record.get("versions", {}).items()
              if k != "python" and versions.get(k) != v}
    if differ:
        raise SystemExit(f"{env_dir} is not the stack of {name}: (has, cell) {differ}")
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    begun = time.monotonic()
    run([*pytest_cmd(python, 1), f"--junitxml={where / 'tests.xml'}", UPSTREAM_TESTS],
        where / "matrix.log", 1800, env=clean_environ(env_dir))
    return {"tests": upstream_results(where / "tests.xml"), "commit": commit,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "versions": versions,
            "environment": str(env_dir.relative_to(ROOT) if env_dir.is_relative_to(ROOT)
                               else env_dir), "wall_s": round(time.monotonic() - begun)}



def ordered(results: dict) -> dict:
    """The recorded cells: those of cells() in its order, then any others."""
    known = [c["name"] for c in cells()]
    return {n: results[n] for n in known + sorted(set(results) - set(known)) if n in results}




def save(name: str, record: dict) -> dict:
    """Put one cell's record into matrix.json (read again: another run may have written it)
    and re-render the tables."""
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[name] = record
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    write_tables(ordered(results))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tf", "--cell", dest="tf",
                        help="run only the cells of this TensorFlow minor (e.g. 2.18) or this "
                             "one cell (e.g. tf2.16-keras3.10, nightly)")
    parser.add_argument("--nightly", action="store_true", help="run only the nightly cell")
    parser.add_argument("--only", nargs="+", metavar="FILE",
                        help="run only these test files (tests/test_x.py) and lessons "
                             "(01_where_gradients_sync); no lesson if none is named. The cell "
                             "is recorded as partial, with the list")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (2)")
    parser.add_argument("--fill-reports", metavar="ENV", type=Path,
                        help="with --cell: run only tests/test_upstream_reports.py in the "
                             "existing environment ENV, which must have the cell's versions, "
                             "and record its per-test results in the cell's record")
    parser.add_argument("--tables", action="store_true",
                        help="only re-render the tables (docs/versions/*.md) from matrix.json")
    args = parser.parse_args(argv)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.tables:
        write_tables(ordered(results))
        return 0
    if args.nightly:
        args.tf = "nightly"
    chosen = [c for c in cells() if args.tf in (None, c["tf"], c["name"])]
    if not chosen:
        parser.error(f"--tf must be one of {', '.join(TF_MINORS)} or a cell's name")
    lessons = [p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")]
    unknown = set(args.only or []) - set(test_files()) - set(lessons)
    if unknown:
        parser.error(f"--only: not a test file of the matrix or a lesson: {sorted(unknown)}")
    commit, total = git_commit(), time.monotonic()
    if args.fill_reports:
        if len(chosen) != 1 or chosen[0]["name"] not in results:
            parser.error("--fill-reports needs --cell and a cell recorded in matrix.json")
        name = chosen[0]["name"]
        record = results[name]
        record["upstream"] = fill_reports(record, args.fill_reports.resolve(), name, commit)
        save(name, record)
        print(f"{name}: per-test results of {UPSTREAM_TESTS} recorded in "
              f"{record['upstream']['wall_s']} s", flush=True)
        return 0
    today = time.strftime("%Y-%m-%d", time.gmtime())
    for cell in chosen:
        done = results.get(cell["name"], {})
        if (args.tf is None and done.get("commit") == commit and "only" not in done
                and (not cell.get("nightly") or done.get("date") == today)):
            print(f"{cell['name']}: done at {commit}, skipped", flush=True)
            continue
        BUILD.mkdir(parents=True, exist_ok=True)
        free_gb = shutil.disk_usage(BUILD).free / 2**30
        if free_gb < FREE_GB_NEEDED:
            print(f"{cell['name']}: {free_gb:.1f} GB free, {FREE_GB_NEEDED} needed: stopped")
            return 1
        print(f"{cell['name']}: installing ({free_gb:.0f} GB free)", flush=True)
        record = run_cell(cell, commit, args.only, args.workers)
        print(f"{cell['name']}: {record['status']} in {record['wall_s']['total']} s",
              flush=True)
        results = save(cell["name"], record)
    print(f"matrix: {time.monotonic() - total:.0f} s; {RESULTS.relative_to(ROOT)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
