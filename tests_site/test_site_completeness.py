"""The hand-written entries of the site are complete: every lesson in the nav, on the
learning path, executed with its pair; every module and reference class in docs/api.md.

The checks live in site_completeness.py. Each runs on the repository (and, for the API
page, on the built site), and each is shown to catch what it is for on a broken copy
of the repository in tmp_path.
"""

from __future__ import annotations

import re
import shutil

import nbformat
import pytest
import site_completeness as completeness
from site_helpers import ROOT, SITE

REFERENCE_CLASSES = ("AccumulatingOptimizer", "GradientAccumulator", "MicroBatching")


# ------------------------------------------------------------------ the repository


def test_every_lesson_is_in_the_nav_with_its_pair():
    assert completeness.nav_lessons(ROOT), "no lessons/NN_slug.ipynb in mkdocs.yml's nav"
    assert not completeness.nav_problems(ROOT), "\n".join(completeness.nav_problems(ROOT))


def test_the_learning_path_links_every_lesson():
    problems = completeness.learning_path_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_every_executed_lesson_has_its_pair_and_outputs():
    problems = completeness.executed_lesson_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_every_module_is_in_the_api_reference():
    modules = completeness.public_modules(ROOT, "distgrad_course")
    assert not any(m.startswith("distgrad.lab") for m in completeness.public_modules(ROOT))
    for package in ("distgrad_course.lab", "distgrad_course.pitfalls"):
        assert package in modules and any(m.startswith(f"{package}.") for m in modules)
    assert not any("._" in m for m in modules)
    problems = completeness.api_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_the_api_reference_lists_the_reference_classes():
    problems = completeness.api_class_problems(ROOT, REFERENCE_CLASSES)
    api_page = SITE / "api" / "index.html"
    if api_page.is_file():  # built: the page itself must show them
        html = api_page.read_text(encoding="utf-8")
        problems += completeness.built_api_class_problems(html, REFERENCE_CLASSES)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("package, page", [("distgrad", "api"),
                                           ("distgrad_course", "course-api")])
def test_the_built_api_page_has_every_module(site, package, page):
    html = (site / page / "index.html").read_text(encoding="utf-8")
    problems = completeness.built_api_problems(ROOT, html, package)
    assert not problems, "\n".join(problems)


# ------------------------------------------------ the checks catch it (broken copies)


@pytest.fixture
def tree(tmp_path):
    """A copy of what the checks read, with executed copies that have outputs."""
    for name in ("mkdocs.yml", "docs/index.md", "docs/api.md", "docs/course-api.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, tmp_path / name)
    (tmp_path / "notebooks").mkdir()
    for path in (ROOT / "notebooks").glob("[0-9][0-9]_*"):
        shutil.copyfile(path, tmp_path / "notebooks" / path.name)
    for folder in ("src/distgrad", "src/course/distgrad_course"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (tmp_path / "docs" / "lessons").mkdir()
    for name in completeness.nav_lessons(tmp_path):
        write_executed(tmp_path / "docs" / "lessons" / f"{name}.ipynb", outputs=True)
    return tmp_path


def write_executed(path, outputs: bool):
    cell = nbformat.v4.new_code_cell("print(1)")
    if outputs:
        cell.outputs = [nbformat.v4.new_output("stream", text="1\n")]
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_markdown_cell("# Title"), cell]
    nbformat.write(notebook, path)


def drop_lines(path, needle: str):
    text = path.read_text(encoding="utf-8")
    kept = [line for line in text.splitlines(keepends=True) if needle not in line]
    assert len(kept) < len(text.splitlines()), f"{needle!r} not in {path.name}"
    path.write_text("".join(kept), encoding="utf-8")


def test_nav_check_names_a_lesson_left_out_and_a_missing_pair(tree):
    assert completeness.nav_problems(tree) == []
    first, second = completeness.nav_lessons(tree)[:2]
    drop_lines(tree / "mkdocs.yml", f"lessons/{first}.ipynb")
    (tree / "notebooks" / f"{second}.ipynb").unlink()
    problems = completeness.nav_problems(tree)
    assert len(problems) == 2, problems
    assert f"notebooks/{first}.py is not in the nav" in problems[0]
    assert f"notebooks/{second}.ipynb does not exist" in problems[1]


def test_learning_path_check_names_a_lesson_without_a_row(tree):
    assert completeness.learning_path_problems(tree) == []
    name = completeness.nav_lessons(tree)[-1]
    index = tree / "docs" / "index.md"
    drop_lines(index, f"](lessons/{name}.ipynb)")
    # A link outside the learning-path section does not count.
    index.write_text(index.read_text() + f"\n## Elsewhere\n[x](lessons/{name}.ipynb)\n")
    [problem] = completeness.learning_path_problems(tree)
    assert f"does not link lessons/{name}.ipynb" in problem


def test_executed_lesson_check_names_missing_stale_and_unexecuted_copies(tree):
    assert completeness.executed_lesson_problems(tree) == []
    first, second = completeness.nav_lessons(tree)[:2]
    lessons = tree / "docs" / "lessons"
    (lessons / f"{first}.ipynb").unlink()
    write_executed(lessons / f"{second}.ipynb", outputs=False)
    write_executed(lessons / "99_gone.ipynb", outputs=True)
    gone = "an executed copy of a lesson that is gone (`make lessons` removes it)"
    assert completeness.executed_lesson_problems(tree) == [
        f"docs/lessons/{first}.ipynb is missing: run `make lessons`",
        f"docs/lessons/{second}.ipynb has no outputs: run `make lessons`",
        f"docs/lessons/99_gone.ipynb has no notebooks/99_gone.py: {gone}",
        f"docs/lessons/99_gone.ipynb has no notebooks/99_gone.ipynb: {gone}",
    ]


def test_api_check_names_an_unlisted_module_at_any_depth(tree):
    api, course = tree / "docs" / "api.md", tree / "docs" / "course-api.md"
    for page, package in ((api, "distgrad"), (course, "distgrad_course")):
        modules = completeness.public_modules(tree, package)
        page.write_text("# API\n\n" + "\n\n".join(f"::: {m}" for m in modules) + "\n")
    assert completeness.api_problems(tree) == []

    drop_lines(course, "::: distgrad_course.devices\n")
    lab = tree / "src" / "course" / "distgrad_course" / "lab"
    (lab / "new_helper.py").write_text("def helper():\n    pass\n")
    (tree / "src" / "distgrad" / "brand_new.py").write_text(
        "class A:\n    pass\n\n\ndef b():\n    pass\n\n\ndef _private():\n    pass\n"
    )
    api.write_text(api.read_text() + "\n::: distgrad.brand_new.A\n")
    assert completeness.api_problems(tree) == [
        "distgrad.brand_new is not in docs/api.md: add `::: distgrad.brand_new` where it belongs",
        "distgrad_course.devices is not in docs/course-api.md: add `::: distgrad_course.devices` "
        "where it belongs",
        (
            "distgrad_course.lab.new_helper is not in docs/course-api.md: "
            "add `::: distgrad_course.lab.new_helper` where it belongs"
        ),
    ]
    # Member by member, or a package's directive with show_submodules, covers a module.
    api.write_text(api.read_text() + "\n::: distgrad.brand_new.b\n")
    text = course.read_text() + "\n::: distgrad_course.devices\n"
    with_submodules = "::: distgrad_course.lab\n    options:\n      show_submodules: true\n"
    course.write_text(text.replace("::: distgrad_course.lab\n", with_submodules))
    assert completeness.api_problems(tree) == []


def test_api_class_check_needs_each_class_listed(tree):
    api = tree / "docs" / "api.md"
    api.write_text("# API\n\n::: distgrad.clipping\n")
    problems = completeness.api_class_problems(tree, REFERENCE_CLASSES)
    assert [p.split(": add")[0] for p in problems] == [
        f"docs/api.md does not list {name}" for name in REFERENCE_CLASSES
    ]
    modules = {name: completeness.defining_module(tree, name) for name in REFERENCE_CLASSES}
    api.write_text("\n\n".join(f"::: {modules[n]}.{n}" for n in REFERENCE_CLASSES) + "\n")
    assert completeness.api_class_problems(tree, REFERENCE_CLASSES) == []
    # A module directive lists its classes, unless its `members:` leaves one out.
    module = modules["MicroBatching"]
    api.write_text(
        "\n\n".join(f"::: {modules[n]}" for n in REFERENCE_CLASSES if modules[n] != module)
        + f"\n\n::: {module}\n    options:\n      members: [MicroBatchingModel]\n"
    )
    assert completeness.api_class_problems(tree, REFERENCE_CLASSES) == [
        f"docs/api.md does not list MicroBatching: add `::: {module}.MicroBatching`"
    ]
    assert completeness.api_class_problems(tree, ["NoSuchClass"]) == [
        "no module of src/distgrad defines class NoSuchClass"
    ]


# mkdocstrings-python's markup (checked against a build with the installed version, with
# mkdocs.yml's `show_symbol_type_heading` and `separate_signature: false`).
CLASS_HEADING = (
    '<h3 id="distgrad.optimizer.AccumulatingOptimizer" class="doc doc-heading">\n'
    '<code class="doc-symbol doc-symbol-heading doc-symbol-class"></code>'
    '<code class="highlight language-python"><span class="n">distgrad</span></code>\n</h3>'
)
METHOD_HEADING = (
    '<h4 id="distgrad.accumulator.GradientAccumulator.add" class="doc doc-heading">\n'
    '<code class="doc-symbol doc-symbol-heading doc-symbol-method"></code>'
    '<code class="highlight language-python"><span class="n">add</span></code>\n</h4>'
)
MODULE_HEADING = (
    '<h3 id="distgrad_course.devices" class="doc doc-heading">\n'
    '<code class="doc-symbol doc-symbol-heading doc-symbol-module"></code>'
    '<code>distgrad_course.devices</code>\n</h3>'
)


def test_api_page_checks_need_headings_not_mentions(tree):
    mention = "<p>see <code>MicroBatching</code> and <code>distgrad_course.pitfalls</code></p>"
    html = CLASS_HEADING + METHOD_HEADING + MODULE_HEADING + mention
    assert completeness.built_api_class_problems(html, REFERENCE_CLASSES) == [
        "the built API page has no class heading for GradientAccumulator",
        "the built API page has no class heading for MicroBatching",
    ]
    problems = completeness.built_api_problems(tree, html, "distgrad_course")
    missing = {re.search(r"heading for (\S+)", p).group(1) for p in problems}
    assert "distgrad_course.devices" not in missing
    assert {"distgrad_course.lab", "distgrad_course.pitfalls"} <= missing
    assert missing == set(completeness.public_modules(tree, "distgrad_course")) - {
        "distgrad_course.devices"}
    problems = completeness.built_api_problems(tree, html)
    missing = {re.search(r"heading for (\S+)", p).group(1) for p in problems}
    # distgrad.optimizer may be covered by its class heading if that is its only member.
    assert missing >= set(completeness.public_modules(tree)) - {"distgrad.optimizer"}
