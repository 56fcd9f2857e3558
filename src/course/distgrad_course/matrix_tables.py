"""The tables of the version matrix, rendered from the results in docs/versions/matrix.json:
docs/versions/matrix.md (the cells, then lesson x cell and test file x cell), nightly.md
(the nightly cell) and upstream-status.md (the status of each report of docs/upstream.md,
derived from the per-test results of tests/test_upstream_reports.py). Standard library
only; `version_matrix.py` loads it from its own folder.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if __package__:
    from .matrix_results import DEFECT_TEST, NIGHTLY, RELEASE, UPSTREAM_TESTS
else:  # loaded by `python3 version_matrix.py`, which put this folder on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from matrix_results import DEFECT_TEST, NIGHTLY, RELEASE, UPSTREAM_TESTS

ROOT = Path(__file__).resolve().parents[3]  # src/course/distgrad_course/matrix_tables.py
VERSIONS = ROOT / "docs" / "versions"
TABLES = VERSIONS / "matrix.md"
NIGHTLY_TABLE = VERSIONS / "nightly.md"
STATUS_TABLE = VERSIONS / "upstream-status.md"
UPSTREAM_PAGE = ROOT / "docs" / "upstream.md"


def code(text: str) -> str:
    return "`" + str(text).replace("`", "'") + "`"


def failure_note(cell: str, key: str, outcome: dict) -> str:
    where = (f"cell {outcome['cell']}, {code(outcome['line'])}" if "cell" in outcome
             else code(outcome["test"]))
    return f"{cell}, {code(Path(key).name)}: {where}: {code(outcome['message'])}"



def result_text(r: dict) -> str:
    text = r["status"]
    if "only" in r:
        files = [f for f in r["only"] if f.startswith("tests/")]
        lessons = len(r["only"]) - len(files)
        text += (f" (partial cell: {len(files)} test files, "
                 + (f"{lessons} lessons)" if lessons else "no lessons)"))
    if r.get("changed_while_running"):
        text += f"; {len(r['changed_while_running'])} files changed while it ran"
    return text


def write_tables(done: dict) -> None:
    """docs/versions/matrix.md (the cells, then lesson x cell and test file x cell),
    nightly.md (the nightly cell) and upstream-status.md (the status of each report), from
    the recorded cells `done`, in the order of their columns."""
    rows = ["| cell | TensorFlow | Keras | tf-keras | NumPy | Python | commit | date | minutes "
            "| result |", "|---" * 10 + "|"]
    notes = []
    for name, r in done.items():
        v = r.get("versions", {})
        if "message" in r:  # the install failed
            notes.append(f"{name}: {code(r['message'])}")
        result = result_text(r) + (f" [{len(notes)}](#matrix-note-{len(notes)})"
                                   if "message" in r else "")
        rows.append(" | ".join(["", name, *(v.get(k, "—") for k in (
            "tensorflow", "keras", "tf_keras", "numpy", "python")), code(r["commit"]),
            r["date"], f"{r['wall_s']['total'] / 60:.0f}", result, ""]).strip())
    for group, title in (("lessons", "lesson"), ("tests", "test file")):
        rows += ["", f"| {title} | " + " | ".join(done) + " |", "|---" * (len(done) + 1) + "|"]
        for key in sorted({k for r in done.values() for k in r.get(group, {})}):
            marks = []
            for name, r in done.items():
                outcome = r.get(group, {}).get(key, {"status": "not run"})
                if outcome["status"] == "fail":
                    notes.append(failure_note(name, key, outcome))
                    marks.append(f"✗ [{len(notes)}](#matrix-note-{len(notes)})")
                elif outcome["status"].startswith("not run:"):
                    notes.append(f"{name}, {code(Path(key).name)}: {outcome['status']}")
                    marks.append(f"not run [{len(notes)}](#matrix-note-{len(notes)})")
                else:
                    marks.append({"pass": "✓"}.get(outcome["status"], outcome["status"]))
            rows.append(f"| {code(Path(key).name)} | " + " | ".join(marks) + " |")
    rows += ["", *(f'{i}. <a id="matrix-note-{i}"></a>{note}' for i, note in enumerate(notes, 1))]
    rows += per_test_table(done)
    TABLES.write_text("\n".join(rows) + "\n")
    NIGHTLY_TABLE.write_text(nightly_table(done.get("nightly")))
    STATUS_TABLE.write_text(status_table(done))


def per_test_table(done: dict) -> list[str]:
    """The cells recorded per test (the Keras 2 cell): one row per test, its result."""
    rows = []
    for name, r in done.items():
        if "per_test" not in r:
            continue
        counts = {}
        for outcome in r["per_test"].values():
            counts[outcome["status"]] = counts.get(outcome["status"], 0) + 1
        rows += ["", f"Per test, cell {name} (`pytest -k {code(r['selection'])[1:-1]}` on "
                 f"its test files): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                 + ".", "", f"| test | {name} |", "|---|---|"]
        for key, outcome in sorted(r["per_test"].items()):
            mark = {"pass": "✓"}.get(outcome["status"], outcome["status"])
            if outcome["status"] != "pass":
                mark += f": {code(outcome.get('message', ''))}"
            rows.append(f"| {code(key).replace('|', '/')} | {mark.replace('|', '/')} |")
    return rows


def nightly_table(r: dict | None) -> str:
    """The nightly cell: when, what pip installed, what ran, what it showed."""
    if r is None:
        return "The nightly cell has not run yet.\n"
    if "versions" not in r:
        return f"The nightly cell, {r['date']}: {r['status']}: {code(r.get('message', ''))}\n"
    v, dists = r["versions"], r["versions"].get("distributions", {})
    ran = ("every test file of the matrix and every lesson" if "only" not in r else
           f"partial cell: {len(r['only'])} files, " + ", ".join(map(code, r["only"]))
           + ("" if any(not f.startswith("tests/") for f in r["only"]) else "; no lesson"))
    lines = [f"Run on {r['date']} (UTC) at commit {code(r['commit'])}: {ran}. "
             f"Install {r['wall_s'].get('install', 0)} s, tests "
             f"{r['wall_s'].get('tests', 0)} s"
             + (f", lessons {r['wall_s']['lessons']} s" if "lessons" in r["wall_s"] else "")
             + f"; result: {r['status']}.", "",
             "| distribution | version pip installed |", "|---|---|"]
    for key in ("tensorflow", "keras", "tf_keras"):
        lines.append(f"| `{dists.get(key, NIGHTLY[key])}` | {v.get(key, 'not installed')} |")
    lines += [f"| `numpy` | {v.get('numpy', '—')} |", f"| Python | {v.get('python', '—')} |"]
    if "legacy" in r:
        lines += ["", f"tf-keras: {r['legacy']}."]
    if r.get("changed_while_running"):
        lines += ["", "Changed in the working tree while the cell ran (its results may mix two "
                  "versions of these): " + ", ".join(map(code, r["changed_while_running"])) + "."]
    if r.get("pip_check"):
        lines += ["", "`pip check` (the project is installed with `--no-deps`):", "",
                  *(f"* {code(line)}" for line in r["pip_check"])]
    lines += ["", "| test file or lesson | tests | result |", "|---|---|---|"]
    for key, outcome in (r.get("tests", {}) | r.get("lessons", {})).items():
        result = outcome["status"]
        if result == "fail":
            result = (f"{outcome.get('failed', 1)} failed; first "
                      + (f"cell {outcome['cell']}" if "cell" in outcome
                         else code(outcome["test"])) + f": {code(outcome['message'])}")
        lines.append(f"| {code(Path(key).name)} | {outcome.get('tests', '—')} | {result} |")
    others = {}  # the failures of tests/test_upstream_reports.py that are no report's run
    for name, outcome in r.get("upstream", {}).get("tests", {}).items():
        if outcome["status"] != "pass" and not DEFECT_TEST.match(name):
            others.setdefault((name.split("[")[0], outcome.get("message", "")), []).append(name)
    if "upstream" in r:
        lines += ["", f"In {code(Path(UPSTREAM_TESTS).name)}, each report's runs give its "
                  "[status](upstream.md#status)"
                  + ("; its other failures:" if others else "; no other test failed.")]
        if others:
            lines.append("")
        for (test, message), names in others.items():
            lines.append(f"* {len(names)} × {code(test)}: {code(message)}")
    return "\n".join(lines) + "\n"


def version_key(r: dict) -> tuple:
    v = r.get("versions", {})
    return tuple(tuple(int(n) for n in re.findall(r"\d+", v.get(k, "0"))[:3])
                 for k in ("tensorflow", "keras", "tf_keras"))


def report_sections() -> list[tuple[str, str, str]]:
    """(file stem, heading, anchor) of each `## ` section of docs/upstream.md that includes
    a docs/upstream/STEM.py, in page order."""
    parts = re.split(r"^## (.+)$", UPSTREAM_PAGE.read_text(encoding="utf-8"), flags=re.M)
    found = []
    for heading, body in zip(parts[1::2], parts[2::2]):
        title = re.match(r"(.*?)\s*(?:\{#([\w-]+)\})?$", heading)
        for stem in re.findall(r'^--8<-- "upstream/([\w-]+)\.py"$', body, flags=re.M):
            found.append((stem, title[1], title[2] or ""))
    return found


def report_outcome(record: dict, stem: str) -> dict | None:
    """A report in one cell: pass if each run of its file (Keras 3, tf-keras) shows what the
    page says, else its first failing run; None where no run of it was recorded."""
    tests = record.get("upstream", {}).get("tests", {})
    mine = sorted((name, r) for name, r in tests.items()
                  if (m := DEFECT_TEST.match(name)) and m[1] == stem)
    if not mine:
        return None
    failed = [(name, r) for name, r in mine if r["status"] != "pass"]
    if not failed:
        return {"status": "pass"}
    name, r = failed[0]
    message = r.get("message", "")
    # The test says so when the defect's exception is gone; anything else (other numbers,
    # another exception, a child that could not start) is a change, not known to be a fix.
    gone = r["status"] == "failure" and "no longer raises" in message
    # The test checks the exception's type before each fragment of its message: a missing
    # fragment means the same exception, with another message.
    fragment = re.search(r" … assert (['\"])(.+?)\1 in ", message)
    raised = re.search(r"no longer raises ([\w.]+)", message)
    text = (f"no longer raises {code(raised[1].rsplit('.', 1)[-1])}" if gone and raised else
            f"the same exception, without {code(fragment[2])} in its message" if fragment
            else code(message[:160]))
    run = {"keras": "Keras 3", "tf_keras": "tf-keras"}[DEFECT_TEST.match(name)[2]]
    return {"status": "fixed" if gone else "changed", "text": f"{run} run: {text}"}


def status_table(done: dict) -> str:
    """One row per report of docs/upstream.md: its status, derived from the per-test results
    of tests/test_upstream_reports.py in the release cells and the nightly."""
    releases = sorted(((n, r) for n, r in done.items() if n != "nightly" and "versions" in r),
                      key=lambda item: version_key(item[1]))
    recorded = [(n, r) for n, r in releases if "upstream" in r]
    nightly = done.get("nightly") if "upstream" in done.get("nightly", {}) else None
    rows = ["| report | status | reproduces on | differs on |", "|---|---|---|---|"]
    for stem, title, anchor in report_sections():
        seen = [(n, report_outcome(r, stem)) for n, r in recorded]
        seen = [(n, o) for n, o in seen if o is not None]
        tonight = report_outcome(nightly, stem) if nightly else None
        passing = [n for n, o in seen if o["status"] == "pass"]
        later = next((i for i, (n, o) in enumerate(seen)
                      if o["status"] != "pass" and any(p["status"] == "pass"
                                                       for _, p in seen[:i])), None)
        if not seen:
            status = "not recorded on a release"
        elif later is not None:
            name, o = seen[later]
            status = f"{o['status']} in release {name} ({o['text']})"
        elif seen[-1][1]["status"] != "pass":
            status = f"fails on every release recorded ({seen[-1][1]['text']})"
        elif tonight is None:
            status = "reproduces (nightly: not recorded)"
        elif tonight["status"] == "pass":
            status = "reproduces"
            passing.append("nightly")
        else:
            status = f"{tonight['status']} in nightly ({tonight['text']})"
        differing = [n for n, o in seen if o["status"] != "pass"]
        differing += ["nightly"] if tonight and tonight["status"] != "pass" else []
        link = f"[{title}](#{anchor})" if anchor else title
        rows.append(f"| {link} | {status} | {', '.join(passing) or '—'} | "
                    f"{', '.join(differing) or '—'} |")
    rows += ["", "Cells (per-report results of `tests/test_upstream_reports.py`; "
             "[versions](versions.md#matrix)):", ""]
    for name, r in [*recorded, *([("nightly", nightly)] if nightly else [])]:
        up, v = r["upstream"], r["versions"]
        dists = v.get("distributions", RELEASE)
        stack = ", ".join(f"{dists.get(k, RELEASE[k])} {v[k]}" for k in RELEASE if k in v)
        where = (f"run {up['date']} at {code(up['commit'])} in {code(up['environment'])}, "
                 "the same versions" if "environment" in up else f"run {r['date']}")
        rows.append(f"* **{name}**: {stack}; {where}.")
    missing = [(n, r) for n, r in releases if "upstream" not in r]
    if missing:
        whole = sorted({r.get("tests", {}).get(UPSTREAM_TESTS, {}).get("status", "not run")
                        for _, r in missing})
        rows.append(f"* Not recorded per report: {', '.join(n for n, _ in missing)} (run "
                    "before the matrix kept per-test results; "
                    f"`{Path(UPSTREAM_TESTS).name}` as a whole: {', '.join(whole)}).")
    return "\n".join(rows) + "\n"
