"""What a cell of the version matrix ran: its pytest junit XML and executed lessons read into
the results `version_matrix.py` records in docs/versions/matrix.json (pass, or the first
failure and its message; per test for the Keras 2 cell and tests/test_upstream_reports.py).
Standard library only; `version_matrix.py` loads it from its own folder.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

UPSTREAM_TESTS = "tests/test_upstream_reports.py"
# The test of tests/test_upstream_reports.py that runs a report's file and asserts its
# defect, one per (file stem, keras module): the status of a report is theirs.
DEFECT_TEST = re.compile(
    r"^test_each_reproduction_shows_what_the_page_says\[(\w+?)-(keras|tf_keras)\]$")
NIGHTLY = {"tensorflow": "tf-nightly", "keras": "keras-nightly", "tf_keras": "tf-keras-nightly"}
RELEASE = {"tensorflow": "tensorflow", "keras": "keras", "tf_keras": "tf-keras"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXCEPTION = re.compile(r"[\w.]*(Error|Exception|Exit)\b")
ARROW = re.compile(r"^-+> *\d+ (.*)$", re.MULTILINE)  # IPython marks the failing line: ---> 12


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


def per_test_results(junit: Path) -> dict:
    """Per test ("test_x.py::name[id]"): pass, skipped, failure or error, and its message."""
    results = {}
    cases = ET.parse(junit).iter("testcase") if junit.exists() else []
    for case in cases:
        key = f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        problem = next((p for p in case if p.tag in ("failure", "error", "skipped")), None)
        outcome = ({"status": "pass"} if problem is None else
                   {"status": problem.tag, "message": failure_of(problem)})
        if results.get(key, {}).get("status", "pass") == "pass":
            results[key] = outcome  # a setup or teardown error is a second case
    return results


def upstream_results(junit: Path) -> dict:
    """Per test of tests/test_upstream_reports.py: pass, or fail / error and its message."""
    results = {}
    cases = ET.parse(junit).iter("testcase") if junit.exists() else []
    for case in cases:
        if not case.get("classname", "").endswith("test_upstream_reports"):
            continue
        problem = next((p for p in case if p.tag in ("failure", "error", "skipped")), None)
        outcome = ({"status": "pass"} if problem is None else
                   {"status": {"skipped": "skipped"}.get(problem.tag, problem.tag),
                    "message": failure_of(problem)})
        if results.get(case.get("name"), {}).get("status", "pass") == "pass":
            results[case.get("name")] = outcome  # a setup or teardown error is a second case
    return results
