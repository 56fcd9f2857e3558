"""Statements of hand-written pages that name the repository: checked against it.

docs/pitfalls.md says which lesson reproduces which pitfall, docs/call-path.md which
lessons embed its drawings, docs/index.md which question each lesson answers and which
Python the course needs. Each check takes a repository root and returns its problems,
one line each that says what to fix (empty: the page is true), so a test runs it on the
real tree and on a broken copy of it (tests_site/test_docs_pages.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib
from site_helpers import hooks

PITFALLS = "distgrad_course.pitfalls"
_SECTION = re.compile(r"^## (?P<title>.+?)\s*\{#(?P<anchor>[\w-]+)\}\s*$", re.MULTILINE)
_LESSON_LINK = re.compile(r"\]\(lessons/(?P<name>\d\d_[\w-]+)\.ipynb(?:#[^)]*)?\)")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


def _read(root: Path, relative: str) -> str:
    return (root / relative).read_text(encoding="utf-8")


def lesson_names(root: Path) -> list[str]:
    """`NN_slug` of every jupytext lesson source notebooks/NN_slug.py."""
    return sorted(p.stem for p in (root / "notebooks").glob("[0-9][0-9]_*.py"))


# ------------------------------------------------------------------------ pitfalls.md


def pitfall_modules(root: Path) -> list[str]:
    """Module names (`per_replica_mean`, ...) of src/course/distgrad_course/pitfalls/, not
    `_private`."""
    folder = root / "src" / "course" / "distgrad_course" / "pitfalls"
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


def pitfalls_imported_by(source: str) -> set[str]:
    """The `distgrad_course.pitfalls` modules a lesson's source imports (any import form)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == PITFALLS:
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{PITFALLS}."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names
                      if a.name.startswith(f"{PITFALLS}.")}
    return found


def pitfall_sections(text: str) -> list[dict]:
    """The `## Title {#anchor}` sections of pitfalls.md: the modules each names as
    `distgrad_course.pitfalls.NAME` and the lessons it links."""
    text = _COMMENT.sub("", text)
    heads = list(_SECTION.finditer(text))
    sections = []
    for i, head in enumerate(heads):
        body = text[head.end(): heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        sections.append({
            "anchor": head.group("anchor"),
            "modules": set(re.findall(rf"`{re.escape(PITFALLS)}\.(\w+)`", body)),
            "lessons": {m.group("name") for m in _LESSON_LINK.finditer(body)},
        })
    return sections


def pitfalls_page_problems(root: Path) -> list[str]:
    """docs/pitfalls.md names every pitfall module, in a section that links each lesson
    importing it; every lesson a section links imports one of the section's modules."""
    sections = pitfall_sections(_read(root, "docs/pitfalls.md"))
    modules = pitfall_modules(root)
    imports = {name: pitfalls_imported_by(_read(root, f"notebooks/{name}.py"))
               for name in lesson_names(root)}
    problems = []
    for module in modules:
        if not any(module in s["modules"] for s in sections):
            problems.append(f"{PITFALLS}.{module} is not on docs/pitfalls.md: add a section "
                            f"`## Title {{#{module.replace('_', '-')}}}` that names it")
    for s in sections:
        where = f"docs/pitfalls.md#{s['anchor']}"
        for module in sorted(s["modules"] - set(modules)):
            problems.append(f"{where} names {PITFALLS}.{module}, which does not exist")
        if not s["lessons"]:
            problems.append(f"{where} links no lesson")
        for lesson in sorted(s["lessons"]):
            if lesson not in imports:
                problems.append(f"{where} links lessons/{lesson}.ipynb, which does not exist")
            elif not imports[lesson] & s["modules"]:
                problems.append(f"{where} links lesson {lesson}, which imports none of "
                                f"{sorted(s['modules'])}")
    for lesson, used in imports.items():
        for module in sorted(used & set(modules)):
            if not any(module in s["modules"] and lesson in s["lessons"] for s in sections):
                problems.append(f"lesson {lesson} reproduces {PITFALLS}.{module}: link "
                                f"lessons/{lesson}.ipynb from its section of docs/pitfalls.md")
    anchors = [s["anchor"] for s in sections]
    problems += [f"docs/pitfalls.md has the anchor #{a} twice"
                 for a in sorted({a for a in anchors if anchors.count(a) > 1})]
    return problems


# ----------------------------------------------------------------------- call-path.md


def diagram_embeds(root: Path) -> dict[str, set[str]]:
    """`{diagram: {lesson, ...}}`: the lessons whose source embeds each docs/diagrams/*.mmd."""
    sources = {name: _read(root, f"notebooks/{name}.py") for name in lesson_names(root)}
    return {d.stem: {n for n, s in sources.items() if f'data-diagram="{d.stem}"' in s}
            for d in sorted((root / "docs" / "diagrams").glob("*.mmd"))}


def call_path_page_problems(root: Path) -> list[str]:
    """Under each drawing on docs/call-path.md, an `Embedded in ...` line links exactly
    the lessons that embed it."""
    text = _read(root, "docs/call-path.md")
    problems = []
    for diagram, lessons in diagram_embeds(root).items():
        match = re.search(rf'data-diagram="{re.escape(diagram)}".*?</div>\s*\n\s*\n'
                          r"Embedded in (?P<line>[^\n]*)", text, re.DOTALL)
        if match is None:
            problems.append(f"docs/call-path.md has no `Embedded in ...` line under the "
                            f"{diagram} diagram")
            continue
        said = {m.group("name") for m in _LESSON_LINK.finditer(match.group("line"))}
        if said != lessons:
            problems.append(f"docs/call-path.md says the {diagram} diagram is embedded in "
                            f"{sorted(said) or 'no lesson'}; the lessons that embed it: "
                            f"{sorted(lessons) or 'none'}")
    return problems


# -------------------------------------------------------------------------- index.md


def index_page_problems(root: Path) -> list[str]:
    """docs/index.md: each learning-path row's answers cell links the questions that
    questions.md says the lesson answers ("—" for none; the rule of the lesson header,
    `questions_by_lesson` in docs/hooks/distgrad_site.py); "the N real user questions" is
    the number of questions; "Python X.Y+" is pyproject's requires-python."""
    index = _read(root, "docs/index.md")
    questions = _read(root, "docs/questions.md")
    answered = {uri.removeprefix("lessons/").removesuffix(".ipynb"): {q for q, _ in pairs}
                for uri, pairs in hooks.questions_by_lesson(questions).items()}
    problems = []
    for row in re.finditer(r"^\| \[[^\]]*\]\(lessons/(?P<name>[\w-]+)\.ipynb\) \| "
                           r"(?P<answers>[^|]*) \|", index, re.MULTILINE):
        name, cell = row.group("name"), row.group("answers").strip()
        said = set(re.findall(r"\(questions\.md#(q\d+)\)", cell))
        expected = answered.get(name, set())
        if said != expected or (not expected and cell != "—"):
            problems.append(f"docs/index.md: the answers cell of {name} is {cell!r}; "
                            f"questions.md has it answer {sorted(expected) or '—'}")
    words = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}
    count = re.search(r"the (\w+) real user questions", index)
    asked = len(re.findall(r"^##\s+.+?\{#q\d+\}\s*$", questions, re.MULTILINE))
    if count is None or words.get(count.group(1)) != asked:
        problems.append(f"docs/index.md should say 'the {asked} real user questions' "
                        f"(questions.md has {asked})")
    needed = re.search(r"Python (\d+\.\d+)\+", index)
    pyproject = tomllib.loads(_read(root, "pyproject.toml"))["project"]["requires-python"]
    if needed is None or pyproject != f">={needed.group(1)}":
        problems.append(f"docs/index.md's 'Python X.Y+' does not match requires-python "
                        f"{pyproject!r} in pyproject.toml")
    return problems
