"""The built site in a real browser: headless Chromium opens it from a local server.

Every lesson page shows its code cells and their outputs, nav and search work, diagrams
render, dark mode switches, and no page needs the network. Screenshots of the home page
(light and dark) and of the first lesson are kept in build/screenshots/.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from site_helpers import DOCS, ROOT, executed_notebook, hooks, lesson_names

LESSONS = lesson_names()


def open_page(page, path: str = ""):
    page.goto(page.site_url + path, wait_until="load")
    page.wait_for_selector("article.md-content__inner")
    return page


def test_the_site_has_lessons(site):
    assert LESSONS, "no lesson pages in site/lessons/: run `make lessons site`"


def test_home_page_shows_the_learning_path_and_nav_to_every_lesson(page, screenshots):
    open_page(page)
    assert page.title().startswith("distgrad")
    path_links = page.locator("article table a[href*='lessons/']")
    linked = {
        path_links.nth(i).get_attribute("href").rstrip("/").split("/")[-1]
        for i in range(path_links.count())
    }
    assert set(LESSONS) <= linked, (
        f"lessons missing from the learning path: {set(LESSONS) - linked}"
    )
    nav = page.locator("nav.md-nav--primary")
    for name in LESSONS:
        assert nav.locator(f"a[href*='lessons/{name}/']").count() >= 1, f"{name} not in the nav"
    page.screenshot(path=str(screenshots / "home.png"))

    # Following the learning path's first link lands on that lesson.
    path_links.first.click()
    page.wait_for_url(f"**/lessons/{LESSONS[0]}/")
    assert page.locator(".jp-Notebook, .jupyter-wrapper").count() >= 1


@pytest.mark.parametrize("name", LESSONS)
def test_lesson_page_renders_every_code_cell_with_its_outputs(page, screenshots, name):
    open_page(page, f"lessons/{name}/")
    notebook = executed_notebook(name)
    code_cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    with_outputs = [c for c in code_cells if c.get("outputs")]

    # mkdocs-jupyter wraps each cell in a second div of the same classes: count the
    # cells by their notebook id.
    cell = ".jp-CodeCell[id^='cell-id=']"
    rendered = page.locator(cell)
    assert rendered.count() == len(code_cells)
    # Every code cell shows highlighted source and has a copy button.
    assert page.locator(f"{cell} .jp-InputArea .highlight-ipynb pre").count() == len(code_cells)
    assert page.locator(f"{cell} clipboard-copy").count() == len(code_cells)
    # Every cell that produced output shows it, visibly (deep dives and answers once opened).
    page.evaluate("document.querySelectorAll('article details').forEach(d => d.open = true)")
    heights = page.locator(f"{cell}:has(.jp-OutputArea-output)").evaluate_all(
        "cells => cells.map(c => c.querySelector('.jp-OutputArea-output')"
        ".getBoundingClientRect().height)")
    assert len(heights) == len(with_outputs)
    hidden = [i for i, height in enumerate(heights) if not height > 0]
    assert not hidden, f"outputs {hidden} of {name} are not visible"
    first_source = "".join(code_cells[0]["source"]).strip().splitlines()[0]
    assert first_source in rendered.first.inner_text()

    # The header: the paired sources, downloadable, and the questions answered.
    header = page.locator(".lesson-header")
    assert header.count() == 1
    py = page.request.get(page.site_url + f"lessons/{name}/{name}.py")
    assert py.ok and py.text() == (ROOT / "notebooks" / f"{name}.py").read_text(encoding="utf-8")
    ipynb = page.request.get(page.site_url + f"lessons/{name}/{name}.ipynb")
    assert ipynb.ok and ipynb.json()["cells"] == notebook["cells"]
    for i in range(header.locator("a[href*='questions/#q']").count()):
        href = header.locator("a[href*='questions/#q']").nth(i).get_attribute("href")
        assert page.request.get(page.url.split("#")[0] + href.split("#")[0]).ok

    if name == LESSONS[0]:
        page.screenshot(path=str(screenshots / "lesson.png"))
        page.screenshot(path=str(screenshots / "lesson-full.png"), full_page=True)


def test_search_finds_a_lesson_by_a_word_in_its_code(page):
    open_page(page)
    page.locator("input.md-search__input").click()
    page.locator("input.md-search__input").press_sequentially("compute_average_loss")
    page.wait_for_selector(".md-search-result__item", timeout=15000)
    # Read every link in one call: the list re-renders while typing results arrive, so a
    # count followed by the n-th item can ask for one that is gone.
    page.wait_for_function(  # the lesson among the results, whenever they settle
        "() => [...document.querySelectorAll('.md-search-result__item a')].some("
        "a => (a.getAttribute('href') || '').includes('lessons/01_where_gradients_sync'))",
        timeout=15000)
    hrefs = page.eval_on_selector_all(".md-search-result__item a",
                                      "links => links.map(a => a.getAttribute('href'))")
    assert any("lessons/01_where_gradients_sync" in h for h in hrefs), hrefs


def test_nav_links_open_their_pages(page):
    open_page(page)
    links = page.locator("nav.md-nav--primary a.md-nav__link[href]")
    hrefs = sorted({links.nth(i).get_attribute("href") for i in range(links.count())})
    assert len(hrefs) >= 8
    for href in hrefs:
        response = page.request.get(page.site_url + href.lstrip("./"))
        assert response.ok, href
    open_page(page, "call-path/")
    page.locator("nav.md-nav--primary a.md-nav__link", has_text="Verified versions").first.click()
    page.wait_for_url("**/versions/")
    # The versions table is read from the executed lessons' environment reports.
    rows = page.locator("table.executed-versions tbody tr")
    assert rows.count() == len(LESSONS)
    for i in range(rows.count()):
        cells = rows.nth(i).locator("td")
        report = hooks.environment_report_of(
            DOCS / "lessons" / f"{cells.nth(0).inner_text()}.ipynb"
        )
        assert cells.nth(2).inner_text() == report["tensorflow"]
        assert cells.nth(3).inner_text() == report["keras"]


def test_mermaid_diagrams_render_offline(page):
    open_page(page, "call-path/")
    expected = len(list((DOCS / "diagrams").glob("*.mmd")))
    # Material replaces each <pre class="mermaid"> by a <div class="mermaid"> holding the SVG.
    page.wait_for_function(
        f"document.querySelectorAll('figure.diagram div.mermaid').length === {expected}",
        timeout=15000,
    )
    diagrams = page.locator("figure.diagram div.mermaid")
    assert page.locator("figure.diagram pre").count() == 0
    for i in range(diagrams.count()):
        box = diagrams.nth(i).bounding_box()
        assert box and box["height"] > 100 and box["width"] > 200
    # Each diagram source parses with the mermaid the site ships (no silent error box).
    for source in sorted((DOCS / "diagrams").glob("*.mmd")):
        parsed = page.evaluate(
            "async (text) => Boolean(await mermaid.parse(text))", source.read_text(encoding="utf-8")
        )
        assert parsed, source.name


def test_dark_mode_toggle_switches_the_palette(page, screenshots):
    open_page(page)
    assert page.locator("body").get_attribute("data-md-color-scheme") == "default"
    page.locator("form[data-md-component='palette'] label:visible").first.click()
    page.wait_for_function("document.body.getAttribute('data-md-color-scheme') === 'slate'")
    page.screenshot(path=str(screenshots / "home-dark.png"))
    # The choice is remembered on the next page.
    open_page(page, "call-path/")
    assert page.locator("body").get_attribute("data-md-color-scheme") == "slate"


def test_markdown_code_blocks_have_copy_buttons(page):
    open_page(page, "guides/gpu/")
    blocks = page.locator("article pre:not(.mermaid) > code")
    assert blocks.count() >= 3
    copy = page.locator("article pre > nav.md-code__nav > button[data-md-type='copy']")
    assert copy.count() == blocks.count()


def test_api_reference_renders_docstrings(page):
    open_page(page, "api/")
    text = page.locator("article").inner_text()
    for name in ("AccumulatingOptimizer", "BackupAndRestore", "ResumableFitModel",
                 "finite_everywhere"):
        assert name in text
    assert "distgrad_course.pitfalls" not in text  # the course's page, below
    open_page(page, "course-api/")
    text = page.locator("article").inner_text()
    for name in ("distgrad_course.devices", "make_strategy", "distgrad_course.pitfalls",
                 "CapturedError"):
        assert name in text
    # That every module and reference class has its heading: test_site_completeness.py.


# "Each class on about two screens" (issue 36), of the 1280 x 900 window the tests use.
CLASS_HEIGHT_PX = 2000


def test_each_class_of_the_api_page_fits_in_about_two_screens(page):
    open_page(page, "api/")
    heights = page.evaluate("""() => [...document.querySelectorAll('div.doc-class')].map(
        d => [d.querySelector('[id]').id, d.getBoundingClientRect().height])""")
    assert len(heights) >= 10, heights  # the reference classes and their helpers
    too_tall = {name: round(px) for name, px in heights if px > CLASS_HEIGHT_PX}
    assert not too_tall, f"over {CLASS_HEIGHT_PX} px at 1280 px: {too_tall}"


def families_covering_chinese() -> set[str]:
    """The font families fontconfig (which Chromium asks for fallback fonts) says cover
    Chinese: `fc-list :lang=zh family`, one line per font, its names comma-separated."""
    fc_list = shutil.which("fc-list")
    assert fc_list, "fc-list not found: install fontconfig (Debian: `make chromium` as root)"
    listed = subprocess.run([fc_list, ":lang=zh", "family"], capture_output=True, text=True,
                            check=True, timeout=60).stdout
    return {name.strip() for line in listed.splitlines() for name in line.split(",") if name}


def glyphs_by_family(page, selector: str) -> dict[str, int]:
    """How many glyphs each font drew for the text of the elements matching `selector`:
    what Chromium itself used (DevTools' CSS.getPlatformFontsForNode), fallback included.
    A character no installed font has is counted under the font that drew its box."""
    session = page.context.new_cdp_session(page)
    session.send("DOM.enable")
    session.send("CSS.enable")
    root = session.send("DOM.getDocument", {"depth": -1})["root"]["nodeId"]
    counts: dict[str, int] = {}
    for node in session.send("DOM.querySelectorAll",
                             {"nodeId": root, "selector": selector})["nodeIds"]:
        for font in session.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]:
            counts[font["familyName"]] = counts.get(font["familyName"], 0) + font["glyphCount"]
    session.detach()
    return counts


# Han ideographs, CJK punctuation and full-width forms: what a Latin font draws as boxes.
_CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")


def test_the_chinese_answer_is_drawn_with_a_chinese_font_not_boxes(page, screenshots):
    """docs/questions.md answers Q3 in Chinese (`lang="zh-Hans"`): every CJK character of
    it must come from a font that covers Chinese (Debian: fonts-noto-cjk, which
    `make chromium` installs beside Chromium); without one Chromium draws empty boxes."""
    open_page(page, "questions/")
    chinese = "article p[lang='zh-Hans']"
    assert page.locator(chinese).count() >= 1, "no Chinese answer (lang='zh-Hans') on the page"
    assert page.locator("article p[lang='es']").count() >= 1, "no Spanish answer (lang='es')"
    characters = len(_CJK.findall("".join(page.locator(chinese).all_inner_texts())))
    assert characters > 100
    covering = families_covering_chinese()
    assert covering, ("no installed font covers Chinese: install one (Debian: "
                      "`apt-get install fonts-noto-cjk`; `make chromium` does it as root)")
    drawn = glyphs_by_family(page, chinese)
    in_chinese_fonts = sum(n for family, n in drawn.items() if family in covering)
    assert in_chinese_fonts >= characters, (
        f"{characters} CJK characters, {in_chinese_fonts} glyphs from fonts covering Chinese "
        f"({sorted(covering)}); drawn with {drawn}")

    # The measure tells boxes apart: characters no font has (unassigned code points) are
    # counted under a font that does not cover Chinese.
    page.evaluate("""() => { const p = document.createElement('p'); p.id = 'no-glyph';
        p.textContent = '\\u0378\\u0379\\u0378\\u0379';
        document.querySelector('article').append(p); }""")
    boxes = glyphs_by_family(page, "#no-glyph")
    assert sum(boxes.values()) == 4 and not set(boxes) & covering, boxes

    # Screenshot of the Q3 section (its English and Chinese answers), to look at.
    top, bottom = (page.locator(f"article h2#{q}").evaluate(
        "h => h.getBoundingClientRect().top + window.scrollY") for q in ("q3", "q4"))
    page.screenshot(path=str(screenshots / "questions-zh.png"), full_page=True,
                    clip={"x": 0, "y": top, "width": 1280, "height": bottom - top})


def test_screenshots_are_kept(screenshots):
    # Runs last in this file: the tests above wrote them.
    for name in ("home.png", "home-dark.png", "lesson.png", "questions-zh.png"):
        shot = Path(screenshots / name)
        assert shot.is_file() and shot.stat().st_size > 10_000, name
