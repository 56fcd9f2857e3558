"""Each lesson is a pair: notebooks/NN_name.py (jupytext percent, the source) and .ipynb."""

import pathlib

import jupytext
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def cells(path):
    return [(c.cell_type, c.source.strip()) for c in jupytext.read(path).cells]


def test_there_are_lessons():
    assert SOURCES, "no notebooks/NN_name.py lessons found"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_py_and_ipynb_have_the_same_cells(source):
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} missing: run `jupytext --sync {source}`"
    assert cells(source) == cells(paired), f"run `jupytext --sync {source}`"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_lesson_is_percent_format_and_asserts_something(source):
    text = source.read_text()
    assert "format_name: percent" in text
    code = "\n".join(s for t, s in cells(source) if t == "code")
    assert "make_strategy(" in code, "a lesson starts by choosing its devices"
    assert "assert " in code or "check_" in code, "a lesson that asserts nothing teaches nothing"


def test_every_ipynb_has_a_py_source_and_no_outputs():
    for paired in NOTEBOOKS.glob("*.ipynb"):
        assert paired.with_suffix(".py").exists(), f"{paired.name} has no .py source"
        nb = jupytext.read(paired)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
            f"{paired.name} has committed outputs; executed copies belong in docs/lessons/")
