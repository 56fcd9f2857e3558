"""What the hand-written pages say about the repository is true of it, and stays true:
docs/pitfalls.md (every pitfall, with the lesson that reproduces it), docs/call-path.md
(which lessons embed its drawings), docs/index.md (which lesson answers which question,
the Python it needs), docs/guides/gpu.md (what `make_strategy` does to TensorFloat-32,
executed in a fresh process). No built site needed.

The checks live in page_claims.py; each is also run on a broken copy of the repository
in tmp_path, to show it catches what it is for.
"""

from __future__ import annotations

import os
import re
import shutil

import jupytext
import page_claims as claims
import pytest
from site_helpers import DOCS, ROOT

from distgrad_course.lab.child import run_child

# ------------------------------------------------------------------ the repository


def test_the_pitfalls_page_lists_every_pitfall_with_the_lessons_that_reproduce_it():
    assert claims.pitfall_modules(ROOT), "no modules in src/course/distgrad_course/pitfalls/"
    problems = claims.pitfalls_page_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_the_call_path_page_names_the_lessons_that_embed_each_drawing():
    embeds = claims.diagram_embeds(ROOT)
    assert set(embeds) == {"call-path", "contexts"}
    problems = claims.call_path_page_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_the_home_page_says_which_lesson_answers_which_question():
    problems = claims.index_page_problems(ROOT)
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def tf32():
    path = os.pathsep.join([str(ROOT / "tests_site"), str(ROOT / "src")])
    return run_child("devices_probe:tf32_around_make_strategy", timeout=300,
                     env={"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": path}).value


def gpu_guide() -> str:
    """docs/guides/gpu.md with every run of whitespace as one space (wrapping is free)."""
    return " ".join((DOCS / "guides" / "gpu.md").read_text(encoding="utf-8").split())


def test_make_strategy_turns_tf32_off_as_the_gpu_guide_says(tf32):
    guide = gpu_guide()
    assert "`distgrad_course.make_strategy()` turns TF32 off" in guide
    assert "`environment_report()` then shows `tensor_float_32: False`" in guide
    assert tf32["before"] is True, "TensorFlow's default changed: reread docs/guides/gpu.md"
    assert (tf32["after"], tf32["reported"]) == (False, False), (
        "make_strategy no longer turns TF32 off: docs/guides/gpu.md says it does")


def test_the_gpu_guide_statements_about_the_lessons_hold():
    guide = gpu_guide()
    sources = {p.name: p.read_text(encoding="utf-8")
               for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))}
    assert sources
    assert "No lesson trains with `jit_compile=True`" in guide
    # A code cell that compiles with it (a Limits deep dive) asserts the refusal.
    compiled = [
        (name, cell.source[:60])
        for name in sources
        for cell in jupytext.read(ROOT / "notebooks" / name).cells
        if cell.cell_type == "code"
        and re.search(r"jit_compile\s*=\s*True|\"jit_compile\"|'jit_compile'", cell.source)
        and "ValueError" not in cell.source
    ]
    assert compiled == [], (
        f"cells that compile with jit_compile=True and assert no refusal: {compiled}")
    assert "Every lesson prints `distgrad_course.environment_report(strategy)`" in guide
    assert [n for n, s in sources.items() if "environment_report(" not in s] == []


# ------------------------------------------------ the checks catch it (broken copies)


@pytest.fixture
def tree(tmp_path):
    """A copy of what the checks read."""
    for name in ("docs/pitfalls.md", "docs/call-path.md", "docs/index.md",
                 "docs/questions.md", "pyproject.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs" / "diagrams", tmp_path / "docs" / "diagrams")
    (tmp_path / "notebooks").mkdir()
    for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"):
        shutil.copyfile(path, tmp_path / "notebooks" / path.name)
    pitfalls = tmp_path / "src" / "course" / "distgrad_course" / "pitfalls"
    pitfalls.mkdir(parents=True)
    for path in (ROOT / "src" / "course" / "distgrad_course" / "pitfalls").glob("*.py"):
        shutil.copyfile(path, pitfalls / path.name)
    return tmp_path


def _lesson_importing(tree, module: str) -> str:
    return next(name for name in claims.lesson_names(tree)
                if module in claims.pitfalls_imported_by(
                    (tree / "notebooks" / f"{name}.py").read_text(encoding="utf-8")))


def test_pitfalls_check_names_an_unlisted_module_and_a_wrong_lesson(tree):
    assert claims.pitfalls_page_problems(tree) == []
    pitfalls = tree / "src" / "course" / "distgrad_course" / "pitfalls"
    (pitfalls / "brand_new.py").write_text('"""New."""\n')
    lesson = _lesson_importing(tree, "double_sum")
    source = tree / "notebooks" / f"{lesson}.py"
    # The lesson stops reproducing double_sum and starts reproducing mask_trick.
    text = source.read_text(encoding="utf-8").replace(
        "from distgrad_course.pitfalls import double_sum",
        "from distgrad_course.pitfalls import mask_trick")
    source.write_text(text, encoding="utf-8")
    problems = claims.pitfalls_page_problems(tree)
    assert problems[0].startswith("distgrad_course.pitfalls.brand_new is not on docs/pitfalls.md")
    assert f"docs/pitfalls.md#double-sum links lesson {lesson}, which imports none of" in (
        "\n".join(problems))
    assert any(p.startswith(f"lesson {lesson} reproduces distgrad_course.pitfalls.mask_trick")
               for p in problems)
    assert len(problems) == 3, problems


def test_pitfalls_check_names_a_module_that_is_gone_and_a_section_without_a_lesson(tree):
    page = tree / "docs" / "pitfalls.md"
    page.write_text(page.read_text(encoding="utf-8")
                    + "\n## Gone {#gone}\n\n`distgrad_course.pitfalls.gone`\n", encoding="utf-8")
    assert claims.pitfalls_page_problems(tree) == [
        "docs/pitfalls.md#gone names distgrad_course.pitfalls.gone, which does not exist",
        "docs/pitfalls.md#gone links no lesson",
    ]


def test_call_path_check_names_a_lesson_that_stopped_embedding_a_drawing(tree):
    assert claims.call_path_page_problems(tree) == []
    [lesson] = sorted(claims.diagram_embeds(tree)["call-path"])
    source = tree / "notebooks" / f"{lesson}.py"
    source.write_text(source.read_text(encoding="utf-8").replace(
        'data-diagram="call-path"', 'data-diagram="elsewhere"'), encoding="utf-8")
    [problem] = claims.call_path_page_problems(tree)
    assert problem.startswith("docs/call-path.md says the call-path diagram is embedded in")
    assert problem.endswith("the lessons that embed it: none")


def test_index_check_names_a_wrong_answers_cell_and_a_wrong_python(tree):
    assert claims.index_page_problems(tree) == []
    index = tree / "docs" / "index.md"
    text = index.read_text(encoding="utf-8")
    assert "| [Q4](questions.md#q4) |" in text and "Python 3.10+" in text
    index.write_text(text.replace("| [Q4](questions.md#q4) |", "| — |")
                     .replace("Python 3.10+", "Python 3.9+"), encoding="utf-8")
    problems = claims.index_page_problems(tree)
    assert len(problems) == 2, problems
    assert "questions.md has it answer ['q4']" in problems[0]
    assert "does not match requires-python '>=3.10'" in problems[1]
