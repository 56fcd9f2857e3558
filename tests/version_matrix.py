"""The version matrix (`make matrix`): the reference-class tests and every lesson, on every
TensorFlow minor with Keras 3, each in its own virtual environment.

    python tests/version_matrix.py            # every cell not yet run at this commit
    python tests/version_matrix.py --tf 2.18  # the cells of one TensorFlow minor, again

A cell is one environment under build/matrix/CELL/env: `tensorflow==2.NN.*`, the Keras 3
pip resolves for it, `tf-keras==2.NN.*` (the legacy tests' children), and the project with
the extras `make` installs except the docs. One extra cell pins Keras to the lower bound of
pyproject.toml, on the oldest TensorFlow: the oldest stack the package declares. Each cell
is installed, run and removed before the next (about 2.7 GB each). After every cell the
results go to docs/versions/matrix.json (pass, or the first failure and its message, per
test file and per lesson) and docs/versions/matrix.md (the tables docs/versions.md
includes); logs and executed lessons stay in build/matrix/CELL/. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "matrix"
RESULTS = ROOT / "docs" / "versions" / "matrix.json"
TABLES = RESULTS.with_suffix(".md")
TF_MINORS = ("2.16", "2.17", "2.18", "2.19", "2.20", "2.21")
EXTRAS = "course,test,legacy"
FREE_GB_NEEDED = 6
# Everything in tests/ runs but these: the benchmark smoke run, the .py/.ipynb pairing (text
# only), the child-process runner's protocol (the lab, no TF/Keras behaviour), and the
# 2-process clusters of lesson 06, which the lesson itself runs in every cell.
NOT_REFERENCE = {"test_benchmarks.py", "test_notebook_pairs.py", "test_child.py",
                 "test_multiworker.py"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXCEPTION = re.compile(r"[\w.]*(Error|Exception|Exit)\b")
ARROW = re.compile(r"^-+> *\d+ (.*)$", re.MULTILINE)  # IPython marks the failing line: ---> 12


def keras_lower_bound() -> str:
    return re.search(r'"keras>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


def cells() -> list[dict]:
    plain = [{"name": f"tf{tf}", "tf": tf, "keras": None} for tf in TF_MINORS]
    oldest = keras_lower_bound()  # Keras at its declared bound on the oldest TF of its era
    return plain + [{"name": f"tf{TF_MINORS[0]}-keras{oldest}", "tf": TF_MINORS[0],
                     "keras": oldest}]


def test_files() -> list[str]:
    return [f"tests/{p.name}" for p in sorted((ROOT / "tests").glob("test_*.py"))
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


def installed_versions(python: Path) -> dict:
    code = ("import importlib.metadata as m, json, platform; print(json.dumps({n: m.version(d) "
            "for n, d in [('tensorflow', 'tensorflow'), ('keras', 'keras'), ('tf_keras', "
            "'tf-keras'), ('numpy', 'numpy')]} | {'python': platform.python_version()}))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                     check=True).stdout)


def summary(text: str, limit: int = 200) -> str:
    """An error message's first line and, if it has more, its last exception line (a
    child's or a traced function's), else its last line."""
    lines = [line.strip()[:limit] for line in ANSI.sub("", text or "").splitlines()
             if line.strip()]
    raised = [line for line in lines[1:] if EXCEPTION.match(line)] or lines[1:]
    return " … ".join(lines[:1] + raised[-1:])


def failure_of(problem: ET.Element) -> str:
    """A junit failure's message; pytest cuts a long one: then its `E` lines in the report."""
    message = problem.get("message") or ""
    if message and "full report in element text" not in message:
        return summary(message)
    report = (problem.text or "").splitlines()
    return summary("\n".join(line[1:] for line in report if line.startswith("E ")) or message)


def junit_results(junit: Path, keys: list[str], module_of) -> dict:
    """Per key (test file or lesson): pass, or its first failing test and message."""
    results = {key: {"status": "not run"} for key in keys}
    cases = ET.parse(junit).iter("testcase") if junit.exists() else []
    for case in cases:
        where = f"{case.get('classname')}.{case.get('name')}."
        key = next((k for k in keys if f"{module_of(k)}." in where), None)
        if key is None:
            continue
        record = results[key]
        if record["status"] == "not run":
            record.update(status="pass", tests=0, time_s=0.0)
        record["tests"] += 1
        record["time_s"] = round(record["time_s"] + float(case.get("time", 0)), 1)
        problem = next((p for p in case if p.tag in ("failure", "error")), None)
        if problem is not None:
            record["failed"] = record.get("failed", 0) + 1
            if record["status"] == "pass":
                record.update(status="fail", test=case.get("name"), message=failure_of(problem))
    return results


def lesson_failure(executed: Path) -> dict:
    """A lesson's first cell with an error: its index, the failing line, the exception."""
    for index, cell in enumerate(json.loads(executed.read_text())["cells"]):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                traceback = ANSI.sub("", "\n".join(output.get("traceback", [])))
                arrows = ARROW.findall(traceback)  # the cell's own frame comes first
                return {"cell": index, "line": arrows[0].strip()[:200] if arrows else "",
                        "message": summary(f"{output['ename']}: {output['evalue']}")}
    return {}  # no error output: a timeout, whose message junit has


def run_cell(cell: dict, commit: str) -> dict:
    where = BUILD / cell["name"]
    env_dir, log = where / "env", where / "matrix.log"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    python = env_dir / "bin" / "python"
    record = {"commit": commit, "date": time.strftime("%Y-%m-%d"), "wall_s": {}}
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update(PATH=f"{env_dir / 'bin'}:{environ['PATH']}", VIRTUAL_ENV=str(env_dir),
                   TF_CPP_MIN_LOG_LEVEL="2")
    start = time.monotonic()
    try:
        pins = [f"tensorflow=={cell['tf']}.*", f"tf-keras=={cell['tf']}.*"]
        pins += [f"keras=={cell['keras']}"] if cell["keras"] else []
        code = run([sys.executable, "-m", "venv", env_dir], log, 300)
        code = code or run([python, "-m", "pip", "install", "--disable-pip-version-check",
                            "-e", f".[{EXTRAS}]", *pins], log, 3600, env=environ)
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

        files, begun = test_files(), time.monotonic()
        run([python, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
             f"--junitxml={where / 'tests.xml'}", *files], log, 3600, env=environ)
        record["tests"] = junit_results(where / "tests.xml", files,
                                        lambda f: f.removesuffix(".py").replace("/", "."))
        record["wall_s"]["tests"] = round(time.monotonic() - begun)

        lessons, begun = where / "lessons", time.monotonic()
        lessons.mkdir()
        for notebook in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
            shutil.copy(notebook, lessons)
        run([python, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--nbmake",
             "--nbmake-timeout=900", "--overwrite", f"--junitxml={where / 'lessons.xml'}",
             lessons], log, 3600, env=environ)
        names = sorted(p.stem for p in lessons.glob("*.ipynb"))
        record["lessons"] = junit_results(where / "lessons.xml", names, lambda name: name)
        for name, outcome in record["lessons"].items():
            if outcome["status"] == "fail":
                outcome.update(lesson_failure(lessons / f"{name}.ipynb"))
        record["wall_s"]["lessons"] = round(time.monotonic() - begun)
        failed = [name for group in ("tests", "lessons") for name, r in record[group].items()
                  if r["status"] != "pass"]
        record["status"] = f"{len(failed)} failed" if failed else "pass"
        return record
    finally:
        record["wall_s"]["total"] = round(time.monotonic() - start)
        kill_leftovers(env_dir)
        shutil.rmtree(env_dir, ignore_errors=True)


def code(text: str) -> str:
    return "`" + str(text).replace("`", "'") + "`"


def failure_note(cell: str, key: str, outcome: dict) -> str:
    where = (f"cell {outcome['cell']}, {code(outcome['line'])}" if "cell" in outcome
             else code(outcome["test"]))
    return f"{cell}, {code(Path(key).name)}: {where}: {code(outcome['message'])}"


def write_tables(results: dict) -> None:
    """docs/versions/matrix.md: the cells, then lesson x cell and test file x cell."""
    known = [c["name"] for c in cells()]
    done = {n: results[n] for n in known + sorted(set(results) - set(known)) if n in results}
    rows = ["| cell | TensorFlow | Keras | tf-keras | NumPy | Python | commit | minutes | result |",
            "|---" * 9 + "|"]
    notes = []
    for name, r in done.items():
        v = r.get("versions", {})
        if "message" in r:  # the install failed
            notes.append(f"{name}: {code(r['message'])}")
        result = r["status"] + (f" [{len(notes)}](#matrix-note-{len(notes)})" if "message" in r
                                else "")
        rows.append(" | ".join(["", name, *(v.get(k, "—") for k in (
            "tensorflow", "keras", "tf_keras", "numpy", "python")), code(r["commit"]),
            f"{r['wall_s']['total'] / 60:.0f}", result, ""]).strip())
    for group, title in (("lessons", "lesson"), ("tests", "test file")):
        rows += ["", f"| {title} | " + " | ".join(done) + " |", "|---" * (len(done) + 1) + "|"]
        for key in sorted({k for r in done.values() for k in r.get(group, {})}):
            marks = []
            for name, r in done.items():
                outcome = r.get(group, {}).get(key, {"status": "not run"})
                if outcome["status"] == "fail":
                    notes.append(failure_note(name, key, outcome))
                    marks.append(f"✗ [{len(notes)}](#matrix-note-{len(notes)})")
                else:
                    marks.append({"pass": "✓"}.get(outcome["status"], outcome["status"]))
            rows.append(f"| {code(Path(key).name)} | " + " | ".join(marks) + " |")
    rows += ["", *(f'{i}. <a id="matrix-note-{i}"></a>{note}' for i, note in enumerate(notes, 1))]
    TABLES.write_text("\n".join(rows) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tf", help="run only the cells of this TensorFlow minor (e.g. 2.18) "
                                     "or this one cell (e.g. tf2.16-keras3.10)")
    parser.add_argument("--tables", action="store_true",
                        help="only rewrite docs/versions/matrix.md from matrix.json")
    args = parser.parse_args(argv)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.tables:
        write_tables(results)
        return 0
    chosen = [c for c in cells() if args.tf in (None, c["tf"], c["name"])]
    if not chosen:
        parser.error(f"--tf must be one of {', '.join(TF_MINORS)} or a cell's name")
    commit, total = git_commit(), time.monotonic()
    for cell in chosen:
        if args.tf is None and results.get(cell["name"], {}).get("commit") == commit:
            print(f"{cell['name']}: done at {commit}, skipped", flush=True)
            continue
        BUILD.mkdir(parents=True, exist_ok=True)
        free_gb = shutil.disk_usage(BUILD).free / 2**30
        if free_gb < FREE_GB_NEEDED:
            print(f"{cell['name']}: {free_gb:.1f} GB free, {FREE_GB_NEEDED} needed: stopped")
            return 1
        print(f"{cell['name']}: installing ({free_gb:.0f} GB free)", flush=True)
        results[cell["name"]] = run_cell(cell, commit)
        print(f"{cell['name']}: {results[cell['name']]['status']} in "
              f"{results[cell['name']]['wall_s']['total']} s", flush=True)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        write_tables(results)
    print(f"matrix: {time.monotonic() - total:.0f} s; {RESULTS.relative_to(ROOT)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
