"""Each lesson reads at a reader's pace: a visible core of at most 20 minutes, then deep
dives one click away; its exercises hide their answers; its pointers to other lessons hold.

The reading time is the measure of issue 25 (and of ../shared/tools/lesson_size.py): on the
built page, prose words at 200 a minute and code lines at 10 a minute, counting nothing
inside a collapsed `<details>` block (outputs do not count). The cross-references are read
from the sources (notebooks/*.py and docs/**/*.md), so they need no built site.
"""

from __future__ import annotations

import re

import jupytext
import pytest
from bs4 import BeautifulSoup
from site_helpers import DOCS, ROOT, SITE, lesson_names

CORE_MINUTES = 20
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def visible_core(page_html: str) -> dict:
    article = BeautifulSoup(page_html, "html.parser").select_one("article")
    for collapsed in article.select("details"):
        collapsed.decompose()
    words = sum(len(cell.get_text(" ").split()) for cell in article.select(".jp-MarkdownCell"))
    code = sum(
        len(pre.get_text().rstrip("\n").splitlines())
        for pre in article.select(".jp-InputArea pre")
    )
    return {"prose_words": words, "code_lines": code, "minutes": words / 200 + code / 10}


@pytest.mark.parametrize("name", lesson_names())
def test_a_lessons_visible_core_reads_in_twenty_minutes(site, name):
    size = visible_core((SITE / "lessons" / name / "index.html").read_text(encoding="utf-8"))
    assert size["minutes"] <= CORE_MINUTES, (
        f"{name}: the visible core reads in {size['minutes']:.1f} min "
        f"({size['prose_words']} words, {size['code_lines']} code lines): move detail into a "
        "'Deep dive' section (docs/guides/writing-lessons.md)"
    )


@pytest.mark.parametrize("name", lesson_names())
def test_a_lessons_core_has_a_figure(site, name):
    article = BeautifulSoup(
        (SITE / "lessons" / name / "index.html").read_text(encoding="utf-8"), "html.parser"
    ).select_one("article")
    for collapsed in article.select("details"):
        collapsed.decompose()
    figures = article.select(".jp-OutputArea-output img, figure.diagram")
    assert figures, f"{name}: no figure (a plot or a diagram) outside the deep dives"


@pytest.mark.parametrize("name", lesson_names())
def test_deep_dives_and_answers_are_collapsed_and_every_exercise_has_one(site, name):
    article = BeautifulSoup(
        (SITE / "lessons" / name / "index.html").read_text(encoding="utf-8"), "html.parser"
    ).select_one("article")
    assert article.select("details.deep-dive"), f"{name} has no collapsed deep dive"
    assert not article.select("details.deep-dive[open], details.answer[open]")
    exercises = [h for h in article.select("h3") if h.get_text().startswith("Exercise")]
    assert exercises, f"{name} has no exercises"
    answers = article.select("details.answer")
    assert len(answers) == len(exercises), (
        f"{name}: {len(exercises)} exercises, {len(answers)} collapsed answers: put each "
        "answer under a '#### Answer' heading right after its exercise"
    )


# ------------------------------------------------------------------------ cross-references

# "lesson 02, section 3", "lesson 02, §3", "lesson 02 §3", "Lesson 02's section 3"
_POINTER = re.compile(
    r"[Ll]esson\s+(?P<lesson>\d{2})(?:,|'s)?\s+(?:section\s+|§\s*)(?P<section>\d+)"
)
_NUMBERED_HEADING = re.compile(r"^#{2,3}\s+(?P<number>\d+)\s*·", re.MULTILINE)


def lesson_sections() -> dict[str, set[str]]:
    """{"02": {"1", "2", ...}}: the numbered headings (`## 3 · Title`) of each lesson."""
    sections = {}
    for source in NOTEBOOKS:
        markdown = "\n".join(
            c.source for c in jupytext.read(source).cells if c.cell_type == "markdown"
        )
        sections[source.name[:2]] = set(_NUMBERED_HEADING.findall(markdown))
    return sections


def prose_sources() -> dict[str, str]:
    texts = {
        str(path.relative_to(ROOT)): "\n".join(
            c.source for c in jupytext.read(path).cells if c.cell_type == "markdown"
        )
        for path in NOTEBOOKS
    }
    for path in sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]:
        texts[str(path.relative_to(ROOT))] = path.read_text(encoding="utf-8")
    return texts


def test_the_pointer_pattern_reads_the_forms_the_prose_uses():
    found = [m.groups() for m in _POINTER.finditer(
        "see lesson 02, section 3; lesson 04 §5 and Lesson 03, §6; lesson 01 section 2")]
    assert found == [("02", "3"), ("04", "5"), ("03", "6"), ("01", "2")]


def test_every_lesson_section_pointer_names_an_existing_section():
    sections = lesson_sections()
    broken = [
        f"{where}: {match.group(0)!r}"
        for where, text in prose_sources().items()
        for match in _POINTER.finditer(text)
        if match.group("section") not in sections.get(match.group("lesson"), set())
    ]
    assert not broken, "pointers to sections that do not exist:\n" + "\n".join(broken)


_LINK = re.compile(r"\[(?P<text>[^\]]+)\]\((?P<href>[^)\s]+)\)")


def test_a_linked_section_pointer_links_that_sections_heading():
    """`[lesson 02, section 3](02_x.ipynb#3-the-fix)`: the anchor is section 3's heading
    (headings `## 3 · Title` get ids starting "3-"), in lesson 02's page."""
    wrong = []
    for where, text in prose_sources().items():
        for link in _LINK.finditer(text):
            pointer = _POINTER.search(link.group("text"))
            if pointer is None:
                continue
            page, _, anchor = link.group("href").rpartition("/")[2].partition("#")
            lesson, section = pointer.group("lesson"), pointer.group("section")
            if not page.startswith(lesson) or (anchor and not anchor.startswith(f"{section}-")):
                wrong.append(f"{where}: {link.group(0)}")
    assert not wrong, "links whose words and target disagree:\n" + "\n".join(wrong)
