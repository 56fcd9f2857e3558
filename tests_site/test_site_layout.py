"""What a reader sees at 1280 × 800 in headless Chromium: code is not cut, outputs do not
break inside words, math is typeset (offline), diagram text is readable, deep dives and
the environment table start collapsed, and a link into a collapsed section opens it.

Every page of the site is checked, with its collapsed blocks opened (a reader opens them).
"""

from __future__ import annotations

import re

import pytest
from site_helpers import SITE, lesson_names

VIEWPORT = {"width": 1280, "height": 800}
LESSONS = lesson_names()
MIN_DIAGRAM_TEXT_PX = 12
LINE_LENGTH = 100  # the project's (pyproject.toml, [tool.ruff])
# Every page's path below the site root ("" is the home page).
PAGES = sorted(
    f"{p.parent.relative_to(SITE)}/" if p.parent != SITE else ""
    for p in SITE.rglob("index.html")
    if "assets" not in p.parts
) if SITE.is_dir() else []
# TeX a reader must never see as text: control words and $...$ spans around them.
RAW_TEX = re.compile(
    r"\\(?:frac|sum|sqrt|cdot|times|text|mathrm|mathbf|left|right|approx|le|ge)\b|\$\$")



def test_the_site_was_built_with_every_lesson():
    """The checks here and in test_site_browser.py are parametrized over the built site's
    pages and lessons: on a fresh checkout (no `make site`) they would collect nothing and
    pass. This one fails instead, naming the command."""
    notebooks = sorted(p.stem for p in (SITE.parent / "notebooks").glob("[0-9][0-9]_*.py"))
    assert PAGES and LESSONS == notebooks, "the site is not built: run `make site` first"

def open_at_1280(page, path: str):
    page.set_viewport_size(VIEWPORT)
    page.goto(page.site_url + path, wait_until="load")
    page.wait_for_selector("article.md-content__inner")
    # MathJax (lesson pages) typesets after load: wait until its queue is empty.
    page.wait_for_function(
        "() => !window.MathJax || !window.MathJax.Hub || "
        "window.MathJax.Hub.queue.pending === 0 && window.MathJax.Hub.queue.running === 0",
        timeout=30000,
    )
    page.evaluate("document.querySelectorAll('article details').forEach(d => d.open = true)")
    return page


def test_the_site_has_pages():
    assert len(PAGES) > 10 and any(p.startswith("lessons/") for p in PAGES), PAGES


# Material renders each diagram into a *closed* shadow root; the test opens it (before any
# page script runs) to read the rendered text. Rendering is unchanged.
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) {
  return attach.call(this, {...init, mode: 'open'});
};
"""


@pytest.mark.parametrize("path", PAGES)
def test_a_page_at_1280_px_cuts_no_code_shows_no_tex_and_readable_diagrams(page, path):
    page.add_init_script(OPEN_SHADOW_ROOTS)
    open_at_1280(page, path)
    source = (SITE / path / "index.html").read_text(encoding="utf-8")

    # Code up to the project's 100 characters fits; a longer line (a question's code as
    # posted, TensorFlow's source) scrolls; outputs never break inside a word.
    cut = page.evaluate(
        """() => [...document.querySelectorAll(
              'article pre:not(.mermaid), article .jp-OutputArea-output pre')]
            .filter(pre => pre.offsetParent !== null && pre.scrollWidth > pre.clientWidth + 1)
            .map(pre => [pre.textContent.split('\\n').reduce(
                (a, b) => a.length >= b.length ? a : b), getComputedStyle(pre).overflowX])
            .filter(([line, overflow]) => line.length <= LINE_LENGTH
                    || !['auto', 'scroll'].includes(overflow))
            .map(([line]) => line.slice(0, 100))""".replace("LINE_LENGTH", str(LINE_LENGTH))
    )
    assert not cut, f"{path}: code cut at 1280 px: {cut}"
    wrapping = page.evaluate(
        """() => [...document.querySelectorAll('article .jp-OutputArea-output pre')]
            .map(pre => getComputedStyle(pre))
            .filter(s => s.whiteSpace !== 'pre' || s.wordBreak === 'break-all').length"""
    )
    assert wrapping == 0, f"{path}: {wrapping} outputs wrap (and may break words)"

    # No TeX shown as text; a lesson with math has it typeset.
    text = page.evaluate(
        """() => { const a = document.querySelector('article').cloneNode(true);
             a.querySelectorAll('pre, code, script, .MathJax, .MathJax_Display, .MathJax_Preview,'
               + ' .MJX_Assistive_MathML, mjx-container').forEach(e => e.remove());
             return a.innerText; }"""
    )
    raw = sorted({m.group(0) for m in RAW_TEX.finditer(text)})
    assert not raw, f"{path} shows TeX as text: {raw}"
    if path.startswith("lessons/") and "$" in re.sub(
        r"<pre.*?</pre>|<code.*?</code>|<script.*?</script>|<style.*?</style>", "", source,
        flags=re.DOTALL,
    ):
        assert page.locator(".MathJax, .MathJax_Display, mjx-container").count() > 0, (
            f"{path} has math that MathJax did not typeset"
        )

    # Diagram text is at least 12 px as drawn (a wide diagram is scaled down to fit).
    diagrams = source.count('<pre class="mermaid"')
    if diagrams:
        page.wait_for_function(
            f"[...document.querySelectorAll('div.mermaid')].filter(d => d.shadowRoot"
            f" && d.shadowRoot.querySelector('svg')).length === {diagrams}",
            timeout=15000,
        )
        sizes = page.evaluate(
            """() => [...document.querySelectorAll('div.mermaid')].flatMap(host => {
                  const svg = host.shadowRoot.querySelector('svg');
                  const box = svg.getBoundingClientRect();
                  const view = svg.viewBox && svg.viewBox.baseVal;
                  const scale = view && view.width ? box.width / view.width : 1;
                  return [...svg.querySelectorAll('text, foreignObject span, foreignObject div')]
                    .filter(e => e.textContent.trim() && !e.querySelector('span, div, tspan'))
                    .map(e => [parseFloat(getComputedStyle(e).fontSize) * scale,
                               e.textContent.trim().slice(0, 40)]); })"""
        )
        assert sizes, f"{path}: diagrams with no text"
        smallest = min(sizes)
        assert smallest[0] >= MIN_DIAGRAM_TEXT_PX, (
            f"{path}: diagram text as small as {smallest[0]:.1f} px at 1280 px ({smallest[1]!r})"
        )


@pytest.mark.parametrize("name", LESSONS)
def test_a_lesson_opens_with_its_question_and_a_collapsed_environment(page, name):
    page.set_viewport_size(VIEWPORT)
    page.goto(page.site_url + f"lessons/{name}/", wait_until="load")
    environment = page.locator("details.environment")
    assert environment.count() == 1
    assert environment.evaluate("d => !d.open")
    assert "TensorFlow" in environment.locator("summary").inner_text()
    assert page.locator("details.deep-dive").count() >= 1
    assert page.locator("details.deep-dive[open], details.answer[open]").count() == 0


def test_a_link_into_a_collapsed_deep_dive_opens_it(page):
    name = LESSONS[0]
    page.set_viewport_size(VIEWPORT)
    page.goto(page.site_url + f"lessons/{name}/", wait_until="load")
    target = page.locator("details.deep-dive :is(h2, h3, h4)[id]").first
    anchor = target.get_attribute("id")
    page.goto(page.site_url + f"lessons/{name}/#{anchor}", wait_until="load")
    page.wait_for_function(
        f"document.getElementById({anchor!r}).closest('details').open === true", timeout=5000
    )
