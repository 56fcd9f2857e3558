"""Each lesson's fix runs unchanged when pasted into a new file.

A lesson's core shows the fix as one code cell tagged `fix` (jupytext: `# %% tags=["fix"]`)
and, right after it, a one-device check of at most 10 lines tagged `check`. A reader pastes
both into a file and runs it: so does this test, as `python pasted.py` in an empty folder,
with nothing of the notebook around it (no earlier cell, no `distgrad_course.lab`). The
process is forked from a server that has imported TensorFlow and started no runtime
(`distgrad_course.lab.fork_server`); `DISTGRAD_FORK_SERVER=0` makes it a fresh interpreter.
"""

from __future__ import annotations

import ast
import os
import pathlib
import sys

import jupytext
import pytest
import script_runs

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
# What a fix may import: the stack, and distgrad where its packaged form is the point.
ALLOWED_TOP_LEVEL = {"tensorflow", "keras", "numpy", "distgrad"}
CHECK_LINES = 10
TIMEOUT_S = 600


def tagged(source: pathlib.Path, tag: str) -> list[str]:
    return [
        cell.source
        for cell in jupytext.read(source).cells
        if cell.cell_type == "code" and tag in cell.metadata.get("tags", [])
    ]


def fix_and_check(source: pathlib.Path) -> tuple[str, str]:
    fixes, checks = tagged(source, "fix"), tagged(source, "check")
    assert len(fixes) == 1, f"{source.name}: {len(fixes)} cells tagged 'fix', want one"
    assert len(checks) == 1, f"{source.name}: {len(checks)} cells tagged 'check', want one"
    cells = jupytext.read(source).cells
    order = [i for i, c in enumerate(cells) if set(c.metadata.get("tags", [])) & {"fix", "check"}]
    assert "fix" in cells[order[0]].metadata["tags"], f"{source.name}: the check comes first"
    return fixes[0], checks[0]


def imported_modules(code: str) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add(node.module or "")
    return modules


def test_there_are_lessons():
    assert SOURCES


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name[:2])
def test_the_fix_imports_only_the_stack_and_the_check_is_short(source):
    fix, check = fix_and_check(source)
    modules = imported_modules(fix + "\n" + check)
    foreign = {
        m
        for m in modules
        if m.split(".")[0] not in ALLOWED_TOP_LEVEL | set(sys.stdlib_module_names)
        or m.startswith("distgrad_course.lab")
    }
    assert not foreign, f"{source.name}: the fix imports {sorted(foreign)}"
    lines = [s for s in check.splitlines() if s.strip() and not s.strip().startswith("#")]
    assert len(lines) <= CHECK_LINES, f"{source.name}: the one-device check has {len(lines)} lines"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name[:2])
def test_the_fix_and_its_check_run_pasted_into_a_new_file(source, tmp_path):
    fix, check = fix_and_check(source)
    script = tmp_path / "pasted.py"
    script.write_text(fix + "\n\n" + check + '\nprint("the pasted fix ran")\n', encoding="utf-8")
    cleared = ("TF_CONFIG", "TF_USE_LEGACY_KERAS", "DISTGRAD_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(cleared)}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    code, stdout, stderr = script_runs.run(script.name, [], env, tmp_path, TIMEOUT_S)
    assert code == 0 and "the pasted fix ran" in stdout, (
        f"{source.name}'s fix + check, pasted into a new file, failed:\n"
        f"{stdout[-3000:]}\n{stderr[-3000:]}"
    )
