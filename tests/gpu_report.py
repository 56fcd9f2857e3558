"""Write `build/gpu-check/report.md` from what `make gpu-check` left in `build/gpu-check/`.

    python tests/gpu_report.py build/gpu-check

Reads `lessons.xml` and `checks.xml` (pytest's JUnit XML of the lessons and of
`tests/gpu_checks.py`) and `results.json` (what the checks measured), and writes one
Markdown page: the machine, each lesson and check with its outcome (the first line of
a failure's message), and the measured values. Standard library only.
"""

from __future__ import annotations

import json
import pathlib
import sys
import xml.etree.ElementTree as ET


def outcomes(junit_path: pathlib.Path) -> list[tuple[str, str, str]]:
    """`(test name, "passed" | "failed" | "error" | "skipped", first message line)`."""
    if not junit_path.exists():
        return [(junit_path.name, "missing", "the run wrote no results (did it start?)")]
    rows = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        status, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                status = {"failure": "failed"}.get(kind, kind)
                text = found.get("message") or found.text or ""
                message = text.strip().splitlines()[0][:160] if text.strip() else ""
                break
        rows.append((case.get("name", "?"), status, message))
    return rows


def table(header: list[str], rows) -> list[str]:
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows), ""]


def report(directory: pathlib.Path) -> str:
    results_path = directory / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    environment = results.pop("environment", {})
    lines = ["# GPU check", ""]
    lines += table(["what", "value"], sorted(environment.items())) if environment else [
        "No `results.json`: the checks did not reach a GPU.", ""]
    for title, name in (("Lessons", "lessons.xml"), ("GPU-only checks", "checks.xml")):
        rows = outcomes(directory / name)
        passed = sum(status == "passed" for _, status, _ in rows)
        lines += [f"## {title}: {passed} of {len(rows)} passed", ""]
        lines += table(["test", "outcome", "first line of the failure"], rows)
    lines += ["## Measured", ""]
    for check, records in sorted(results.items()):
        lines += [f"### `{check}`", ""]
        keys = sorted({key for record in records for key in record})
        lines += table(keys, ([record.get(key, "") for key in keys] for record in records))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/gpu_report.py BUILD_DIR", file=sys.stderr)
        return 2
    directory = pathlib.Path(argv[0])
    (directory / "report.md").write_text(report(directory))
    print(f"wrote {directory / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
