"""What the executed lessons print fits the page's content column."""

import json
import pathlib

import pytest

LESSONS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "lessons"
MAX_LINE = 100


def long_output_lines(notebook: pathlib.Path, limit: int = MAX_LINE) -> list[str]:
    """Text output lines (streams and text/plain results) longer than `limit`."""
    found = []
    for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            found += [line for line in text.splitlines() if len(line) > limit]
    return found


def test_long_output_lines_are_found(tmp_path):
    notebook = tmp_path / "n.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code", "outputs": [
        {"output_type": "stream", "name": "stdout", "text": ["short\n", "x" * 101 + "\n"]}]}]}))
    assert long_output_lines(notebook) == ["x" * 101]


SOURCES = sorted((LESSONS.parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_every_lesson_was_executed_into_the_site():
    """Run alone on a fresh checkout (no `make course`), the check below would collect
    nothing and pass: this one fails instead, naming the command."""
    executed = sorted(p.name for p in LESSONS.glob("*.ipynb"))
    assert executed == [p.name for p in SOURCES], (
        "docs/lessons/ holds no executed copy of every lesson: run `make course` first")


@pytest.mark.parametrize("notebook", [LESSONS / p.name for p in SOURCES], ids=lambda p: p.stem)
def test_executed_lesson_output_lines_fit_the_page(notebook):
    assert notebook.exists(), f"{notebook} was not executed: run `make course` first"
    assert long_output_lines(notebook) == []
